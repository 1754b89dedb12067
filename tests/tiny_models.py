"""Tiny Hugging Face VLMs built from configs, for parity tests (offline, deterministic).

Each builder returns a random-init model in eval mode, fp32, whose weights are perturbed by
N(0, 0.2) so that the logits are not flat and greedy decoding does not repeat one token (HF's
0.02-std init gives near-uniform logits, and parity on those proves little): logit std ~1.7.
Same arguments -> same weights.

Geometry shared by every family, chosen so that tests run in a fraction of a second:
text model 2 layers, hidden 64, 4 query heads / 2 KV heads (GQA, head_dim 16), vocab 96;
vision tower 1 layer on 32x32 images. Token ids: 0 pad, 1 bos, 2 eos, 3 image placeholder.
"""

from __future__ import annotations

import torch
from transformers import (
    CLIPVisionConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

VOCAB_SIZE = 96
PAD_ID, BOS_ID, EOS_ID, IMAGE_TOKEN_ID = 0, 1, 2, 3
IMAGE_SIZE = 32
PATCH_SIZE = 8
LLAVA_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLIP "default": CLS dropped -> 16
IDEFICS3_SCALE = 2
IDEFICS3_IMAGE_TOKENS = LLAVA_IMAGE_TOKENS // IDEFICS3_SCALE**2  # pixel shuffle -> 4

FAMILIES = ("llava-llama", "llava-qwen2", "llava-gemma3", "idefics3")


def text_config(kind: str = "llama", **overrides) -> LlamaConfig | Qwen2Config:
    """A 2-layer GQA text config; ``kind`` is ``"llama"`` or ``"qwen2"`` (q/k/v bias)."""
    kw = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return Qwen2Config(**kw) if kind == "qwen2" else LlamaConfig(**kw)


def perturb_(model: torch.nn.Module, std: float = 0.2, seed: int = 0) -> None:
    """Add N(0, std) noise to every parameter, from a private seeded generator."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)


def _finish(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    perturb_(model, seed=seed)
    model.generation_config.pad_token_id = PAD_ID
    # No EOS: generate() must run the full number of steps the test compares.
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = BOS_ID
    return model.eval()


def tiny_llava(text: str = "llama", seed: int = 0, **text_overrides) -> PreTrainedModel:
    """LLaVA (CLIP vision tower + MLP projector) with a Llama or Qwen2 text model."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text_config(text, **text_overrides),
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return _finish(LlavaForConditionalGeneration(cfg), seed)


def tiny_idefics3(seed: int = 0, **text_overrides) -> PreTrainedModel:
    """Idefics3 (SmolVLM: SigLIP-style tower + pixel-shuffle connector) with a Llama text model."""
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    cfg = Idefics3Config(
        vision_config=vision,
        text_config=text_config("llama", **text_overrides),
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=IDEFICS3_SCALE,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return _finish(Idefics3ForConditionalGeneration(cfg), seed)


def tiny_model(family: str, seed: int = 0) -> PreTrainedModel:
    """One of :data:`FAMILIES`."""
    if family == "llava-llama":
        return tiny_llava("llama", seed)
    if family == "llava-qwen2":
        return tiny_llava("qwen2", seed)
    if family == "llava-gemma3":
        return tiny_llava_gemma3(seed)
    if family == "idefics3":
        return tiny_idefics3(seed)
    raise ValueError(f"unknown tiny family {family!r}; expected one of {FAMILIES}")


def image_tokens(family: str) -> int:
    """Placeholder tokens one 32x32 image takes in a prompt of ``family``."""
    return IDEFICS3_IMAGE_TOKENS if family == "idefics3" else LLAVA_IMAGE_TOKENS


def pixel_inputs(family: str, num_images: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random preprocessed images, shaped as the family's processor returns them for one prompt:
    LLaVA ``pixel_values [num_images, 3, 32, 32]``; Idefics3 ``[1, num_images, 3, 32, 32]``."""
    g = torch.Generator().manual_seed(seed)
    pv = torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return {"pixel_values": pv.unsqueeze(0) if family == "idefics3" else pv}


def prompt_ids(
    family: str, text_before: int, text_after: int, num_images: int = 1, seed: int = 0
) -> list[int]:
    """``bos, text_before random tokens, then per image (placeholder run, 2 random tokens),
    then text_after random tokens``: the token layout a processor produces, without a
    tokenizer. Random tokens are drawn from ``4 .. VOCAB_SIZE - 1`` (never special)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(4, VOCAB_SIZE, (n,), generator=g).tolist()

    ids = [BOS_ID, *rand(text_before)]
    for _ in range(num_images):
        ids += [IMAGE_TOKEN_ID] * image_tokens(family) + rand(2)
    return ids + rand(text_after)


def word_level_tokenizer(special: dict[str, int] | None = None):
    """A whitespace-split word-level tokenizer over the tiny vocabulary: ``"<pad>"``, ``"<s>"``,
    ``"</s>"``, ``"<image>"``, then ``special`` tokens, then ``"w<i>"`` for every other id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<image>": IMAGE_TOKEN_ID}
    vocab.update(special or {})
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )


def tiny_llava_processor():
    """A real ``LlavaProcessor`` for :func:`tiny_llava`: the word-level tokenizer and the PIL
    image processor at 32x32. ``"<image>"`` expands to 16 placeholders."""
    from transformers import LlavaImageProcessorPil, LlavaProcessor

    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer(),
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def tiny_idefics3_processor():
    """A real ``Idefics3Processor`` for :func:`tiny_idefics3`: the word-level tokenizer plus
    Idefics3's special tokens; images up to 64 px are split into 32 px tiles (one placeholder
    run of 4 tokens each) plus a global 32 px view."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    special = {"<fake_token_around_image>": 4, "<global-img>": 5, "<end_of_utterance>": 6}
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=True,
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=word_level_tokenizer(special),
        image_seq_len=IDEFICS3_IMAGE_TOKENS,
    )


def bytes_per_token(model) -> int:
    """K and V of one token over all layers, from the HF config (not from our KVCache)."""
    text = model.config.text_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


GEMMA3_WINDOW = 16


def gemma3_text_config(**overrides):
    """A 6-layer Gemma 3 text config (5 sliding-window layers, then 1 full-attention layer, as
    Gemma 3 alternates them), window :data:`GEMMA3_WINDOW`, head_dim 32, 2 query heads and 1
    KV head (GQA), ``query_pre_attn_scalar`` apart from head_dim (so the softmax scale is
    checked), linear RoPE scaling on the global layers (HF's 4B+ checkpoints scale so) and a
    final logit softcap."""
    from transformers import Gemma3TextConfig

    kw = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=GEMMA3_WINDOW,
        max_position_embeddings=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=30.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def raise_gemma_norms_(layers, amount: float) -> None:
    """Raise the q/k norms and the norms after attention and MLP of Gemma ``layers`` by
    ``amount`` (see :func:`tiny_gemma3` for why a tiny Gemma needs it)."""
    with torch.no_grad():
        for layer in layers:
            for norm in (
                layer.self_attn.q_norm,
                layer.self_attn.k_norm,
                layer.post_attention_layernorm,
                layer.post_feedforward_layernorm,
            ):
                norm.weight.add_(amount)


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A ``Gemma3ForCausalLM`` of :func:`gemma3_text_config`, perturbed as the VLMs are (HF's
    RMSNorm weights start at 0 and scale by ``1 + w``, so the noise makes ``1 + w`` differ
    from 1), then the q/k norms and the norms after attention and MLP raised by 2 (scales
    near 3): with scales near 1 the tied, scaled embedding dominates the residual stream and
    greedy decoding repeats its last token; sharper attention and louder layers make it move
    (and make ``1 + w`` far from ``w``). SDPA attention, as HF picks by default on a CPU."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = _finish(Gemma3ForCausalLM(gemma3_text_config(**overrides)), seed)
    raise_gemma_norms_(model.model.layers, 2.0)
    return model.to(dtype)


def gemma4_text_config(**overrides):
    """A Gemma 4 text config of :func:`gemma3_text_config`'s geometry (5 sliding layers of
    window :data:`GEMMA3_WINDOW`, then a full one; head_dim 32, 2 query heads, 1 KV head),
    dense: no per-layer input embeddings, KV sharing or experts. The full layer's head size
    is the sliding layers' (``global_head_dim``; pass another to give it its own) and its
    RoPE HF's default for Gemma 4: proportional, a quarter of each head rotating."""
    from transformers import Gemma4TextConfig

    kw = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=32,
        sliding_window=GEMMA3_WINDOW,
        hidden_size_per_layer_input=0,
        max_position_embeddings=512,
        final_logit_softcapping=30.0,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )
    kw.update(overrides)
    return Gemma4TextConfig(**kw)


def tiny_gemma4(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A ``Gemma4ForCausalLM`` of :func:`gemma4_text_config`, perturbed as the VLMs are (its
    norms scale by ``w``, 1 at init), then the norms after attention and MLP raised by 1
    (scales near 2: louder layers, so greedy decoding moves) and each layer's
    ``layer_scalar`` (a buffer, 1 at init) drawn from 0.5 .. 1.5 so that it counts. The q/k
    norms stay near 1: Gemma 4's softmax scale is 1, so scores are sharp already, and sharper
    ones make the model so sensitive that HF's one pass and its cached decode differ by 2e-3
    in fp32 (near 1: 5e-5)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = _finish(Gemma4ForCausalLM(gemma4_text_config(**overrides)), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.add_(1.0)
            layer.post_feedforward_layernorm.weight.add_(1.0)
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
    return model.to(dtype)


def tiny_llava_gemma3(seed: int = 0, **text_overrides) -> PreTrainedModel:
    """LLaVA (the CLIP tower and projector of :func:`tiny_llava`) around the text model of
    :func:`gemma3_text_config`, its norms raised as in :func:`tiny_gemma3`. The text config
    sets a final logit softcap, which HF's LLaVA head does not apply."""
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=gemma3_text_config(**text_overrides),
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=LLAVA_IMAGE_TOKENS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = _finish(LlavaForConditionalGeneration(cfg), seed)
    raise_gemma_norms_(model.model.language_model.layers, 1.0)
    return model


BOI_ID, EOI_ID = 4, 5  # Gemma 3's <start_of_image> and <end_of_image> in the tiny vocabulary
GEMMA3_IMAGE_TOKENS = 4  # mm_tokens_per_image: the 4x4 SigLIP patches pooled 2x2


def tiny_gemma3_vlm(seed: int = 0, **text_overrides) -> PreTrainedModel:
    """The real ``Gemma3ForConditionalGeneration``: a 2-layer SigLIP tower on 32x32 images
    (patch 8: 16 patches), Gemma 3's projector (average-pooled to :data:`GEMMA3_IMAGE_TOKENS`
    rows, RMS-normed, projected) and the text model of :func:`gemma3_text_config`, its norms
    raised as in :func:`tiny_llava_gemma3`. Image placeholder :data:`IMAGE_TOKEN_ID`,
    bracketed in prompts by :data:`BOI_ID` and :data:`EOI_ID`. No final logit softcap, as in
    Google's Gemma 3 checkpoints (HF's ``Gemma3ForConditionalGeneration`` would ignore one;
    vLLM's applies it)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        vision_use_head=False,
    )
    cfg = Gemma3Config(
        vision_config=vision,
        text_config=gemma3_text_config(**{"final_logit_softcapping": None, **text_overrides}),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = _finish(Gemma3ForConditionalGeneration(cfg), seed)
    raise_gemma_norms_(model.model.language_model.layers, 1.0)
    return model


def gemma3_prompt_ids(text_before: int, text_after: int, num_images: int = 1, seed: int = 0):
    """A Gemma 3 prompt as its processor lays it out: ``bos, text_before random tokens, then
    per image (boi, the placeholders, eoi, 2 random tokens), then text_after random tokens``.
    Random tokens are drawn from ``6 .. VOCAB_SIZE - 1`` (never special)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(6, VOCAB_SIZE, (n,), generator=g).tolist()

    ids = [BOS_ID, *rand(text_before)]
    for _ in range(num_images):
        ids += [BOI_ID, *[IMAGE_TOKEN_ID] * GEMMA3_IMAGE_TOKENS, EOI_ID, *rand(2)]
    return ids + rand(text_after)


def tiny_gemma3_processor():
    """A real ``Gemma3Processor`` for :func:`tiny_gemma3_vlm`, as vLLM needs one: a word-level
    tokenizer whose vocabulary has Gemma 3's image tokens (``<image_soft_token>`` =
    :data:`IMAGE_TOKEN_ID`, ``<start_of_image>`` = :data:`BOI_ID`, ``<end_of_image>`` =
    :data:`EOI_ID`) and its newline runs ``"\\n"`` .. ``"\\n\\n\\n\\n"`` (ids 6-9: the processor
    wraps each image in ``"\\n\\n"``, which vLLM merges with neighbouring newlines), then
    ``"w<i>"``; and Gemma 3's PIL image processor at 32x32, no pan-and-scan. A prompt's
    ``<start_of_image>`` expands to ``\\n\\n <start_of_image> 4 x <image_soft_token>
    <end_of_image> \\n\\n``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    vocab = {
        "<pad>": PAD_ID,
        "<bos>": BOS_ID,
        "<eos>": EOS_ID,
        "<image_soft_token>": IMAGE_TOKEN_ID,
        "<start_of_image>": BOI_ID,
        "<end_of_image>": EOI_ID,
    }
    vocab.update({"\n" * n: 5 + n for n in range(1, 5)})
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB_SIZE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    # Words and newline runs are tokens; spaces separate them.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+|[^\s]+"), "removed", invert=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens={
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        },
    )
    image_processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
    )
