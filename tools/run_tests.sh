#!/usr/bin/env bash
# The test command of the README: sets up .venv (torch, triton, the CUDA build) and runs pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m seqpar info
# Two pytest-xdist workers (CI has 2 cores; the suite spends much of its time starting gloo ranks and
# Pythons): 740 s serial -> 520 s here (whole files per worker: 550 s, a long file left alone at the end).
# SEQPAR_TEST_WORKERS=0 runs in this process.
exec python -m pytest -q -ra -n "${SEQPAR_TEST_WORKERS:-2}" --dist worksteal "$@"
