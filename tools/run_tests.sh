#!/usr/bin/env bash
# The test command of the README: sets up .venv (torch, triton, the CUDA build) and runs pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m seqpar info
exec python -m pytest -q -ra "$@"
