"""A stand-in for vLLM's ``_custom_ops`` that SGLang 0.5.23 needs to start on CPU.

SGLang's ``RotaryEmbedding.__init__`` (``srt/layers/rotary_embedding/base.py``) imports
``rotary_embedding`` from ``vllm._custom_ops`` on any device that is not CUDA, HIP, XPU, NPU,
MUSA or MPS, although on CPU its forward runs the rotation in plain torch and never calls it.
vLLM cannot share SGLang's venv (each pins its own torch and transformers), so
tools/make_sglang_venv.sh puts this folder on the venv's path instead: the import succeeds, and
a call, which would mean SGLang took a path we have not measured, fails loudly.
"""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError(
        "minirad's stand-in vllm._custom_ops.rotary_embedding was called: SGLang took a code "
        "path that needs vLLM's C++ kernel (see tools/sglang_stubs/vllm/_custom_ops.py)"
    )
