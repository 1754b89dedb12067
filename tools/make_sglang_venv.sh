#!/usr/bin/env bash
# Build the isolated venv for the real SGLang (chapter 08, the peer benchmark, the parity tests).
#
# `pip install sglang==0.5.23` pins torch==2.14.1, a CUDA build here (11 GB with its nvidia-*
# libraries), and `sglang==0.5.23 torch==2.13.0` cannot resolve. SGLang serves a text model on
# CPU without any of the CUDA packages, so this venv is its resolved dependency set minus those,
# pinned in tools/sglang-cpu-requirements.txt and installed with --no-deps (3.4 GB, about two
# minutes). torchvision's CUDA-built C ops cannot load against the CPU torch: its
# _meta_registrations.py is emptied, as tools/make_vllm_venv.sh explains. The stand-in
# tools/sglang_stubs/vllm/_custom_ops.py goes on the venv's path (its docstring says why).
# Idempotent: a finished venv is left alone (the Makefile re-runs this only when it changes).
set -euo pipefail
VENV=${1:-.venv-sglang}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
STAGE_NAME=sglang
. "$HERE/venv_progress.sh"

stage "building $VENV: 3.4 GB, 3 to 9 minutes on a 2-core machine"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
stage "downloading and installing its pinned packages"
pip_install "$VENV/bin/python" --no-deps -r "$HERE/sglang-cpu-requirements.txt"
stage "checking that SGLang's model runner imports"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '# Emptied by minirad tools/make_sglang_venv.sh: the CUDA-built C ops of this wheel cannot\n# load with the CPU torch, so there are no ops to register fake kernels for.\n' \
    > "$site/torchvision/_meta_registrations.py"
# The stand-in on the path through a .pth file, so the venv's python finds it from any folder.
echo "$HERE/sglang_stubs" > "$site/minirad_sglang_stubs.pth"
# The check that matters: the server's model runner (and with it the rotary embedding) imports.
"$VENV/bin/python" -c "import vllm._custom_ops, sglang.srt.layers.rotary_embedding, sglang.srt.model_executor.model_runner" ||
    { echo "make sglang: SGLang's model runner does not import in $VENV (see the error above)" >&2; exit 1; }
"$VENV/bin/python" -c 'import sglang; print("sglang", sglang.__version__, "ready in '"$VENV"'")'
