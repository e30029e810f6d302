#!/usr/bin/env bash
# The main job of the README: sets up .venv, then runs the paper's five experiments (python -m seqpar bench).
set -euo pipefail
caller_dir="$PWD"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # works in the checkout (cd), activates .venv
cd "$caller_dir"   # relative --json / --plot paths are the caller's, not the checkout's
# the console script, not python -m: that puts the caller's directory first on sys.path, where the checkout's
# own folder (run from its parent) would be imported as an empty namespace package named seqpar
exec seqpar-bench "$@"
