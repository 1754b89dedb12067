"""The text half of a LLaVA folder, saved as a ``LlamaForCausalLM`` folder a text-only server loads.

SGLang 0.5.23 cannot serve LLaVA on CPU (it has no CLIP tower class there and dies on the first
image request), but it serves Llama. The shipped tiny LLaVA's language model *is* a Llama: its
weights under ``language_model.*``, its config under ``text_config``. Saved on their own, with the
same tokenizer and chat template, they give a text model whose greedy tokens on a text prompt
are the LLaVA's on the same prompt, so the real SGLang and our engine can be compared token for
token and cached token for cached token.

Only the standard library, numpy and safetensors' numpy API: no torch in this process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from minirad.errors import InvalidArgumentError
from minirad.peers.vllm_env import REPO_ROOT

__all__ = ["DEFAULT_TEXT_MODEL_DIR", "save_text_model", "text_model_dir"]

DEFAULT_LLAVA_DIR = REPO_ROOT / "data" / "models" / "minirad-tiny-llava"
# Built on first use from the shipped LLaVA (2.5 MB), beside the build outputs git ignores.
DEFAULT_TEXT_MODEL_DIR = REPO_ROOT / "build" / "models" / "minirad-tiny-llama"
_PREFIX = "language_model."
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_text_model(llava_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the language model of the LLaVA at ``llava_dir`` to ``out_dir`` as a
    ``LlamaForCausalLM`` folder: ``config.json`` (its ``text_config``), ``model.safetensors``
    (the ``language_model.*`` tensors, prefix dropped), ``generation_config.json`` and the
    tokenizer files. Returns ``out_dir``.

    Raises:
        InvalidArgumentError: ``llava_dir`` is not a LLaVA folder with a Llama text model.
    """
    import numpy as np  # noqa: F401  (safetensors' numpy API needs it)
    from safetensors import safe_open
    from safetensors.numpy import save_file

    src, out = Path(llava_dir), Path(out_dir)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"no readable config.json in {src}: {e}") from e
    text = config.get("text_config") or {}
    if config.get("model_type") != "llava" or text.get("model_type") != "llama":
        raise InvalidArgumentError(
            f"{src} is not a LLaVA with a Llama text model (model_type="
            f"{config.get('model_type')!r}, text model_type={text.get('model_type')!r})"
        )
    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        tensors = {k[len(_PREFIX) :]: f.get_tensor(k) for k in f.keys() if k.startswith(_PREFIX)}
    if not tensors:
        raise InvalidArgumentError(f"{src}/model.safetensors has no {_PREFIX}* tensors")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text_config = dict(
        text,
        architectures=["LlamaForCausalLM"],
        dtype=config.get("dtype", "float32"),
        tie_word_embeddings=config.get("tie_word_embeddings", text.get("tie_word_embeddings")),
    )
    (out / "config.json").write_text(json.dumps(text_config, indent=2) + "\n")
    generation = {key: text.get(key) for key in ("eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def text_model_dir(llava_dir: str | os.PathLike = DEFAULT_LLAVA_DIR) -> Path:
    """The text half of the shipped LLaVA (or of ``llava_dir``), built once under ``build/``
    and rebuilt when the LLaVA's weights are newer. Returns its folder."""
    src = Path(llava_dir)
    out = (
        DEFAULT_TEXT_MODEL_DIR
        if src.resolve() == DEFAULT_LLAVA_DIR.resolve()
        else REPO_ROOT / "build" / "models" / f"{src.resolve().name}-text"
    )
    weights = out / "model.safetensors"
    stale = (
        weights.is_file() and weights.stat().st_mtime < (src / "model.safetensors").stat().st_mtime
    )
    if not weights.is_file() or stale:
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        save_text_model(src, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)  # atomic: two processes building at once each see a whole folder
    return out
