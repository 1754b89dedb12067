#!/usr/bin/env bash
# Build the venv of the real routers (chapter 10, the replicas benchmark, tests/test_routers.py):
# sglang-router 0.3.2 and vllm-router 0.1.17, both Rust programs in PyPI wheels. They get a venv
# of their own so that their Python dependencies never meet the course's or vLLM's.
# Idempotent: a finished venv is left alone (the Makefile re-runs this only when it changes).
set -euo pipefail
VENV=${1:-.venv-router}
PYTHON=${PYTHON:-python3}
STAGE_NAME=routers
. "$(dirname "$0")/venv_progress.sh"

stage "building $VENV: 220 MB, 1 to 2 minutes on a 2-core machine"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip_install "$VENV/bin/python" 'sglang-router==0.3.2' 'vllm-router==0.1.17'
"$VENV/bin/sglang-router" launch --help > /dev/null
"$VENV/bin/vllm-router" --help > /dev/null
echo "sglang-router and vllm-router ready in $VENV"
