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

``smolvlm-256m``
    Idefics3 (SmolVLM's family) with the same text model and a SigLIP-style tower like
    SmolVLM-256M's (12 layers, hidden 768, MLP 3072, 512 px in patches of 16, pixel shuffle by
    4: 64 image tokens). One 512 px view per image: SmolVLM's tiling is off, so every image
    costs the same. The shipped tokenizer gets Idefics3's three special tokens.

``python -m minirad.course.real_size --like llava-200m OUT``; ``--text-layers`` and
``--vision-layers`` make a shallower model of the same widths (the tests use 2 and 1).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from minirad.course.train import (
    CHAT_TEMPLATE,
    TrainConfig,
    build_model,
    build_processor,
    save_checkpoint,
    text_config,
    vision_sizes,
)
from minirad.models.tokenizer import IM_END, IMAGE_TOKEN, load_tokenizer

__all__ = ["LIKE", "make_model"]

# The text model of both: SmolLM2-135M's shape.
SMOLLM2_135M = dict(text_hidden=576, text_mlp=1536, text_layers=30, text_heads=9, text_kv_heads=3)
# The vision tower of both: ViT-B/16 (CLIP's for LLaVA, SigLIP's for SmolVLM).
VIT_B16 = dict(vision_hidden=768, vision_mlp=3072, vision_layers=12, vision_heads=12, patch_size=16)
# Each size as the training recipe's model fields (minirad.course.train.TrainConfig).
LIKE: dict[str, dict[str, int]] = {
    "llava-200m": SMOLLM2_135M | VIT_B16 | dict(image_size=224),
    "smolvlm-256m": SMOLLM2_135M | VIT_B16 | dict(image_size=512),
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
    return _save(*_build(like, text_layers, vision_layers, seed), Path(out))


def _build(like: str, text_layers: int | None, vision_layers: int | None, seed: int):
    """The model and processor of :func:`make_model`, in memory."""
    if like not in LIKE:
        raise ValueError(f"unknown size {like!r}; expected one of {', '.join(LIKE)}")
    sizes = dict(LIKE[like])
    for name, layers in (("text_layers", text_layers), ("vision_layers", vision_layers)):
        if layers is not None:
            if layers < 1:
                raise ValueError(f"{name} must be >= 1, got {layers}")
            sizes[name] = layers
    cfg = replace(TrainConfig(), **sizes)
    tokenizer = load_tokenizer()
    torch.manual_seed(seed)
    if like.startswith("smolvlm"):
        return _idefics3(tokenizer, cfg)
    return build_model(tokenizer, cfg), build_processor(tokenizer, cfg.image_size, cfg.patch_size)


def _save(model: torch.nn.Module, processor, out: Path) -> Path:
    if model.config.model_type == "llava":
        save_checkpoint(model, processor, out)  # the vision tower under the Hub's names
    else:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        processor.save_pretrained(out)
    return out


IDEFICS3_SPECIAL = ("<fake_token_around_image>", "<global-img>", "<end_of_utterance>")
PIXEL_SHUFFLE = 4  # Idefics3's scale_factor: 4x4 patches become one image token


def _idefics3(tokenizer, cfg: TrainConfig):
    """A random-init Idefics3 sized by ``cfg``, and its processor (one view per image)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    tokenizer.add_special_tokens({"additional_special_tokens": list(IDEFICS3_SPECIAL)})
    tokenizer.chat_template = CHAT_TEMPLATE
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    side = {"longest_edge": cfg.image_size}
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size=side, max_image_size=side, do_image_splitting=False
        ),
        tokenizer=tokenizer,
        image_seq_len=(cfg.image_size // cfg.patch_size) ** 2 // PIXEL_SHUFFLE**2,
        chat_template=CHAT_TEMPLATE,
    )
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(**vision_sizes(cfg)),
        text_config=text_config(tokenizer, cfg, max_position_embeddings=2048),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=PIXEL_SHUFFLE,
        tie_word_embeddings=True,
    )
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.eos_token_id = im_end
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = False
    return model, processor


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
        model, processor = _build(args.like, args.text_layers, args.vision_layers, args.seed)
    except ValueError as e:
        parser.error(str(e))
    out = _save(model, processor, args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.like}: {params / 1e6:.1f} M parameters in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
