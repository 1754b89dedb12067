"""Real-size models without a download: random weights at a real small VLM's dimensions.

The shipped model has 1.2 M parameters, where Python overhead is most of an engine step. To
see the engine where the matmuls are real work, build a model with a real model's layer
sizes, offline, from the shipped tokenizer, chat template and image processor (random weights:
its answers are noise, but the same noise through HF ``generate()``, our engine and vLLM, so
tokens can still be compared one for one):

``llava-200m``
    LLaVA with a text model shaped like SmolLM2-135M (hidden 576, 30 layers, 9 query / 3 KV
    heads of 64, MLP 1536) and a vision tower shaped like CLIP ViT-B/16 at 224 px (12 layers,
    hidden 768, MLP 3072; 196 image tokens): 193 M parameters with the 1,024-token
    vocabulary. The tower is saved under the Hub's ``vision_tower.vision_model.*`` names, so
    vLLM loads the folder too.

``python -m minirad.course.real_size --like llava-200m OUT``; ``--text-layers`` and
``--vision-layers`` make a shallower model of the same widths (the tests use 2 and 1).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from minirad.course.train import TrainConfig, build_model, build_processor, save_checkpoint
from minirad.models.tokenizer import load_tokenizer

__all__ = ["LIKE", "make_model"]

# Each size as the training recipe's model fields (minirad.course.train.TrainConfig).
LIKE: dict[str, dict[str, int]] = {
    "llava-200m": dict(
        text_hidden=576,
        text_mlp=1536,
        text_layers=30,
        text_heads=9,
        text_kv_heads=3,
        vision_hidden=768,
        vision_mlp=3072,
        vision_layers=12,
        vision_heads=12,
        image_size=224,
        patch_size=16,
    ),
}


def make_model(
    like: str,
    out: str | Path,
    text_layers: int | None = None,
    vision_layers: int | None = None,
    seed: int = 0,
) -> Path:
    """Build the model ``like`` names (:data:`LIKE`) with random weights, save it with its
    processor to ``out`` and return ``out``. Same arguments, same weights.

    Raises:
        ValueError: ``like`` is not a known size, or a layer count is below 1.
    """
    if like not in LIKE:
        raise ValueError(f"unknown size {like!r}; expected one of {', '.join(LIKE)}")
    sizes = dict(LIKE[like])
    for name, layers in (("text_layers", text_layers), ("vision_layers", vision_layers)):
        if layers is not None:
            if layers < 1:
                raise ValueError(f"{name} must be >= 1, got {layers}")
            sizes[name] = layers
    cfg = replace(TrainConfig(), out=Path(out), **sizes)
    tokenizer = load_tokenizer()
    processor = build_processor(tokenizer, cfg.image_size, cfg.patch_size)
    torch.manual_seed(seed)
    model = build_model(tokenizer, cfg).eval()
    save_checkpoint(model, processor, cfg.out)
    return cfg.out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minirad.course.real_size",
        description="Build a random-weight VLM at a real model's dimensions, offline.",
    )
    parser.add_argument("out", type=Path, help="the folder to write (Hugging Face format)")
    parser.add_argument("--like", choices=sorted(LIKE), default="llava-200m")
    parser.add_argument("--text-layers", type=int, default=None, help="fewer text layers")
    parser.add_argument("--vision-layers", type=int, default=None, help="fewer vision layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        out = make_model(args.like, args.out, args.text_layers, args.vision_layers, args.seed)
    except ValueError as e:
        parser.error(str(e))
    params = sum(p.numel() for p in _load(out).parameters())
    print(f"{args.like}: {params / 1e6:.1f} M parameters in {out}")
    return 0


def _load(path: Path) -> torch.nn.Module:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path)


if __name__ == "__main__":
    raise SystemExit(main())
