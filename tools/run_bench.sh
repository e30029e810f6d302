#!/usr/bin/env bash
# The main job of the README: sets up .venv, then runs the paper's five experiments (python -m seqpar bench).
set -euo pipefail
caller_dir="$PWD"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # works in the checkout (cd), activates .venv
cd "$caller_dir"   # relative --json / --plot paths are the caller's, not the checkout's
exec python -m seqpar bench "$@"
