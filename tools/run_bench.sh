#!/usr/bin/env bash
# The main job of the README: sets up .venv, then runs the paper's five experiments (python -m seqpar bench).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec python -m seqpar bench "$@"
