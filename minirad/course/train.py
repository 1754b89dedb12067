"""Train the course's tiny vision-language model from scratch on synthetic scenes.

The model is a stock Hugging Face LLaVA (``LlavaForConditionalGeneration``; Liu et al. 2023,
"Visual Instruction Tuning", https://arxiv.org/abs/2304.08485): a CLIP vision transformer turns
the image into patch features, a two-layer MLP projects them to the text model's width, and they
replace the ``<image>`` placeholder tokens of a Llama decoder's input. The processor
(``LlavaProcessor``) expands the single ``<image>`` of a prompt into one placeholder per patch.
Everything is built from configs, with the course tokenizer (``minirad.models.tokenizer``), so no
file comes from the Hub.

``--text-family gemma3`` puts Gemma 3's text decoder (``Gemma3TextConfig``, the decoder of
``Gemma3ForCausalLM``) in the Llama's place, with the same widths: a hybrid stack where every
``--sliding-window-pattern``-th layer attends to the whole sequence and the others only to the
last ``--sliding-window`` tokens (Gemma 3 Team 2025, https://arxiv.org/abs/2503.19786). It stays
a LLaVA: the image tokens attend causally, as in the Llama model and as vLLM runs a LLaVA (Gemma
3's own VLM lets them see each other).

Task: the scenes of :mod:`minirad.course.scenes`, asked as one-turn ChatML conversations::

    <|im_start|>user
    <image>
    What colour is the circle?<|im_end|>
    <|im_start|>assistant
    red<|im_end|>

The loss is cross-entropy on the answer tokens and the closing ``<|im_end|>`` only (the prompt
and the image are given, not predicted); ``generation_config.eos_token_id`` is ``<|im_end|>`` so
``generate()`` stops there. Each training scene is asked its caption and a few questions; the
questions share one packed sequence in which the image is encoded once (:class:`PackedBatcher`),
which gives about three answers for the price of one image on a CPU where the vision tower and
the 64 image positions cost most of a step.

Usage::

    python -m minirad.course.train --out data/models/minirad-tiny-llava     # the shipped model
    python -m minirad.course.train --out /tmp/smoke --steps 2 --eval-scenes 4   # smoke run
    python -m minirad.course.train --text-family gemma3 --text-layers 6 ...  # see its model card

Training is deterministic for a given seed and thread count: scenes come from a seeded
``random.Random``, weights from ``torch.manual_seed``, and ``torch.set_num_threads`` fixes the
order of float reductions (https://pytorch.org/docs/stable/notes/randomness.html).
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import transformers
from huggingface_hub import ModelCard, ModelCardData
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import (
    CLIPVisionConfig,
    Gemma3TextConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaImageProcessorPil,
    LlavaProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
)

from minirad.course.scenes import (
    DEFAULT_IMAGE_SIZE,
    JSON_TASK,
    QUESTION_TYPES,
    SYSTEM_PROMPTS,
    TASK_TYPES,
    Question,
    ask,
    questions,
    random_scene,
    render,
)
from minirad.models import DEFAULT_MODEL_DIR
from minirad.models.tokenizer import IM_END, IMAGE_TOKEN, load_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "MAX_ANSWER_TOKENS",
    "MODEL_CARD_TEMPLATE",
    "TrainConfig",
    "TEXT_FAMILIES",
    "TrainRun",
    "PackedBatcher",
    "answer_logits",
    "build_model",
    "build_processor",
    "evaluate",
    "generate_answers",
    "make_examples",
    "model_card",
    "sliding_window_of",
    "text_config",
    "train",
]

TEXT_FAMILIES = ("llama", "gemma3")  # --text-family
EVAL_SEED = 1_000_003  # held-out scenes: a stream that training (seed + step) never uses
# Room for the longest answer: the JSON listing of three shapes is 89 tokens with <|im_end|>.
MAX_ANSWER_TOKENS = 96

# The ChatML template of minirad.models.tokenizer, extended to HF's multimodal message format
# (content = a list of {"type": "image"} / {"type": "text", "text": ...} items). A plain string
# content renders exactly as in the tokenizer's template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TrainConfig:
    """Model size and optimisation settings (command-line flags of the same names).

    The defaults are the shipped model's recipe; see its model card for the measurements
    behind them.
    """

    out: Path = DEFAULT_MODEL_DIR
    steps: int = 4000
    seed: int = 0
    batch_size: int = 32  # scenes per step
    questions_per_image: int = 2  # asked besides the descriptions, packed into the image's row
    # Fraction of scenes also asked for their JSON listing (minirad.course.scenes.shapes_json). A
    # JSON answer is ~60 tokens against a caption's ~9 (the tokenizer was trained on prose). Asking
    # it INSTEAD of the caption (0.4 of scenes) cost "where", the caption said another way:
    # 0.83-0.90 against 0.995, so every scene keeps its caption.
    json_prob: float = 0.3
    # Fraction of scenes whose prompts open with a system turn
    # (minirad.course.scenes.SYSTEM_PROMPTS). At 0.0 captions after a system turn fell to 0.69
    # (0.98 without one): the image then starts at another position, and the model had only seen it
    # at one. 0.25 gives 0.997 for both.
    system_prob: float = 0.25
    # 3e-3 made the image features collapse to one large constant vector (the model then
    # ignored the picture); 1e-3 learned, but more slowly than 2e-3 with a 10% warm-up.
    lr: float = 2e-3
    warmup: float = 0.1  # fraction of steps with a linear warm-up
    # Each step's scenes are cut into this many groups of similar row length, run one after
    # the other (gradients accumulated): less padding than one batch of mixed lengths.
    micro_batches: int = 2
    weight_decay: float = 0.01
    # Both cores of an idle 2-core machine: 0.34 s/step with 2 threads vs 0.66 s with 1. On a
    # busy machine pass --threads 1: two OpenMP threads stall on each other whenever another
    # process holds a core (measured 2.0 s/step with 2 vs 0.78 s with 1).
    threads: int = 2
    image_size: int = DEFAULT_IMAGE_SIZE  # pixels per side
    patch_size: int = 6  # pixels per side of one vision patch (one image token): 8x8 tokens
    vision_hidden: int = 128
    vision_layers: int = 3
    vision_heads: int = 4
    vision_mlp: int = 512  # intermediate size of the vision MLP
    text_hidden: int = 128
    text_mlp: int = 256  # intermediate size of the text SwiGLU MLP
    text_layers: int = 3
    text_heads: int = 4
    text_kv_heads: int = 2
    text_family: str = "llama"  # the text decoder, one of TEXT_FAMILIES
    # gemma3 only. A sliding layer's query sees the keys less than this many positions behind it
    # (itself included); a one-question prompt is 75-100 tokens, 64 of them the image's.
    sliding_window: int = 32
    # gemma3 only: every Nth layer attends to the whole sequence, the others through the window
    # (Gemma 3's convention and its old config field: 6 = five sliding layers, then one full).
    sliding_window_pattern: int = 6
    eval_every: int = 200  # steps between teacher-forced checks on held-out scenes (0: never)
    eval_scenes: int = 300  # held-out scenes for the final greedy-decoding accuracy


def build_processor(
    tokenizer: PreTrainedTokenizerFast, image_size: int, patch_size: int
) -> LlavaProcessor:
    """A ``LlavaProcessor`` for ``image_size`` px RGB images cut into ``patch_size`` px patches.

    Each image becomes ``(image_size // patch_size) ** 2`` placeholder tokens: the CLIP tower
    adds a CLS token (``num_additional_image_tokens=1``) that the ``"default"`` feature
    strategy drops again. The PIL image processor is used because torchvision is not installed.
    """
    tokenizer.chat_template = CHAT_TEMPLATE  # saved next to the processor's: keep them equal
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
    )


def vision_sizes(cfg: TrainConfig) -> dict[str, int]:
    """The vision tower's sizes in ``cfg``, as the fields of a ViT config (CLIP's, SigLIP's)."""
    return dict(
        hidden_size=cfg.vision_hidden,
        intermediate_size=cfg.vision_mlp,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=cfg.vision_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
    )


# RoPE bases of the gemma3 family: Gemma 3's own (Gemma3TextConfig's defaults, what vLLM and every
# Gemma 3 checkpoint use), 10,000 in the sliding layers and 1,000,000 in the full ones. At the
# course's lengths (at most 1024 positions) either base would do; two different ones make the two
# layer types differ in one more way, so a decoder that gave every layer one RoPE table fails its
# parity check against this model.
GEMMA3_ROPE_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


def gemma3_layer_types(cfg: TrainConfig) -> list[str]:
    """``layer_types`` of the gemma3 family: every ``cfg.sliding_window_pattern``-th layer full."""
    return [
        "full_attention" if (i + 1) % cfg.sliding_window_pattern == 0 else "sliding_attention"
        for i in range(cfg.text_layers)
    ]


def text_config(
    tokenizer: PreTrainedTokenizerFast,
    cfg: TrainConfig,
    max_position_embeddings: int | None = None,
) -> LlamaConfig | Gemma3TextConfig:
    """The text model of ``cfg.text_family`` sized by ``cfg``, over ``tokenizer``'s vocabulary;
    it stops at ``<|im_end|>``. ``max_position_embeddings`` defaults to 512 for Llama (the
    shipped model's) and 1024 for Gemma 3 (room for the course's multi-turn chats).

    Raises:
        ValueError: an unknown family, or a Gemma 3 layer pattern without a full layer.
    """
    sizes = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_hidden,
        intermediate_size=cfg.text_mlp,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=cfg.text_heads,
        num_key_value_heads=cfg.text_kv_heads,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    if cfg.text_family == "llama":
        return LlamaConfig(**sizes, max_position_embeddings=max_position_embeddings or 512)
    if cfg.text_family != "gemma3":
        raise ValueError(
            f"unknown text family {cfg.text_family!r}; expected one of {TEXT_FAMILIES}"
        )
    layer_types = gemma3_layer_types(cfg)
    if "full_attention" not in layer_types:
        raise ValueError(
            f"{cfg.text_layers} layers with a full layer every {cfg.sliding_window_pattern} "
            "have no full-attention layer: pass --text-layers >= --sliding-window-pattern"
        )
    head_dim = cfg.text_hidden // cfg.text_heads
    return Gemma3TextConfig(
        **sizes,
        max_position_embeddings=max_position_embeddings or 1024,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,  # scores scaled by 1/sqrt(head_dim), as in the Llama
        sliding_window=cfg.sliding_window,
        layer_types=layer_types,
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": theta}
            for kind, theta in GEMMA3_ROPE_THETA.items()
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


def sliding_window_of(config) -> int | None:
    """The window of a model's sliding-window layers (``config``: the model's or its text
    model's); None when every layer attends to the whole sequence."""
    text = config.get_text_config()
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return None
    return text.sliding_window


def build_model(
    tokenizer: PreTrainedTokenizerFast, cfg: TrainConfig
) -> LlavaForConditionalGeneration:
    """A randomly initialised LLaVA (CLIP vision + ``cfg.text_family`` text) sized by ``cfg``.

    Seed torch first (``torch.manual_seed``) for reproducible weights."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    vision = CLIPVisionConfig(**vision_sizes(cfg), projection_dim=cfg.vision_hidden)
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_config(tokenizer, cfg),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(cfg.image_size // cfg.patch_size) ** 2,
        vision_feature_layer=-1,  # a 3-layer tower has no spare layers: use the last one
        vision_feature_select_strategy="default",
        tie_word_embeddings=True,
    )
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = im_end
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    return model


def _prompt_text(processor: ProcessorMixin, prompt: str, system: str | None = None) -> str:
    """The chat-templated prompt: an optional system turn, then the image and ``prompt``."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append(
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
    )
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# How often each question type is drawn, relative to the others (without replacement). The
# questions that compare two shapes, or find a shape by its kind, are learned last; the others
# are solved by step ~1500 even at weight 1, so the later steps go mostly to the hard ones.
# With the JSON task, "colour" (find the shape of a kind, name its colour) needed 4: at 2 the
# model answered the first shape's colour (0.64, what that shortcut scores; in every JSON
# answer the first "colour" is the first shape's). "where" at 5 keeps its share of draws.
QUESTION_WEIGHTS = {"colour": 4, "shape": 2, "count": 1, "where": 5, "exists": 1}


class Example(NamedTuple):
    """A rendered scene, the questions asked about it, and the system prompt they share
    (None: no system turn)."""

    image: Image.Image
    questions: list[Question]
    system: str | None = None


def make_examples(
    rng: random.Random,
    n: int,
    image_size: int = DEFAULT_IMAGE_SIZE,
    questions_per_image: int | None = None,
    system_prob: float = 0.0,
    json_prob: float = 0.0,
) -> list[Example]:
    """``n`` fresh rendered scenes, each with a description and questions.

    ``questions_per_image=None`` asks every task the scene admits
    (:func:`minirad.course.scenes.questions`: caption, JSON and up to five questions); an integer k
    asks the caption, the JSON listing with probability ``json_prob``, then k other questions,
    drawn by :data:`QUESTION_WEIGHTS` (a one-shape scene is not asked "colour"). A description
    names every shape, so it carries the most about the picture per answer. With probability
    ``system_prob`` a scene's prompts open with one of :data:`minirad.course.scenes.SYSTEM_PROMPTS`.
    """
    examples = []
    for _ in range(n):
        scene = random_scene(rng, size=image_size)
        asked = questions(scene, rng)
        if questions_per_image is not None:
            # A one-shape scene's colour question is never asked in training: it rewards
            # naming the first shape's colour, which opens every caption and JSON answer. With
            # it, the model settled for that shortcut (0.63 on colour, what the shortcut
            # scores); without it, naming the first colour scores 0.40 and the model must
            # find the shape by its kind.
            pool = [
                q
                for q in asked
                if q.type in QUESTION_TYPES and not (q.type == "colour" and len(scene.shapes) == 1)
            ]
            picked = [q for q in asked if q.type == "caption"]
            if rng.random() < json_prob:
                picked += [q for q in asked if q.type == JSON_TASK]
            for _ in range(min(questions_per_image, len(pool))):
                weights = [QUESTION_WEIGHTS[q.type] for q in pool]
                picked.append(pool.pop(rng.choices(range(len(pool)), weights)[0]))
            asked = picked
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < system_prob else None
        examples.append(Example(render(scene), asked, system))
    return examples


class PackedBatcher:
    """Packs each image and all its questions into one row that encodes the image once.

    Every single-question prompt about an image starts with the same ids,
    ``<|im_start|>user\\n`` and the image placeholders: the *prefix*. A row is laid out as
    ``[prefix][segment 1]...[segment K][pads]``, where segment k is the rest of question k's
    prompt, its answer and ``<|im_end|>``. A 4-D attention mask lets segment k see only the
    prefix and itself, and its position ids continue from the prefix, so every segment is
    computed exactly as the single-question prompt that ``generate`` sees, while the vision
    tower and the prefix run once for K answers. (The radix cache shares a common prefix
    between requests in the same way.)

    Prompt ids come from the processor itself (chat template, ``<image>`` expansion,
    tokenizer), cached per prompt text. Only the answer tokens and ``<|im_end|>`` get a target.

    With ``sliding_window`` (a Gemma 3 text model: :func:`sliding_window_of`) the mask is a dict,
    ``{"full_attention": m, "sliding_attention": m & window}``, which the Gemma 3 text model
    takes as its per-layer-type masks. A 4-D tensor would be used as it is by every layer
    (transformers builds the sliding mask only from a 2-D one), training the sliding layers
    without their window. The window is measured in position ids, which count within the
    unpacked prompt: query q sees key k when ``pos[q] - pos[k] < sliding_window``, exactly what
    ``generate`` and vLLM give the one-question prompt.
    """

    def __init__(self, processor: ProcessorMixin, sliding_window: int | None = None) -> None:
        self.processor = processor
        self.sliding_window = sliding_window
        self.pad_id = processor.tokenizer.pad_token_id
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.prompt_ids: dict[str, list[int]] = {}
        self.answer_ids: dict[str, list[int]] = {}

    def ids(
        self, image: Image.Image, question: Question, system: str | None = None
    ) -> tuple[list[int], int]:
        """``(prompt ids + answer ids + <|im_end|>, number of prompt ids)``.

        A prompt's ids depend on the image only through its size, which is fixed, so they are
        computed once per prompt text by the processor and reused.
        """
        text = _prompt_text(self.processor, question.prompt, system)
        if text not in self.prompt_ids:
            self.prompt_ids[text] = self.processor(images=[image], text=text)["input_ids"][0]
        if question.answer not in self.answer_ids:
            answer = question.answer + IM_END
            self.answer_ids[question.answer] = self.processor.tokenizer.encode(
                answer, add_special_tokens=False
            )
        prompt = self.prompt_ids[text]
        return prompt + self.answer_ids[question.answer], len(prompt)

    def row_length(self, example: Example) -> int:
        """Tokens in ``example``'s packed row, padding excluded."""
        image, asked, system = example
        seqs = [self.ids(image, q, system) for q in asked]
        prefix = self._prefix_length(seqs[0][0])
        return prefix + sum(len(ids) - prefix for ids, _ in seqs)

    def _prefix_length(self, ids: list[int]) -> int:
        """The image prefix ends after the last image placeholder, before the question."""
        return len(ids) - ids[::-1].index(self.image_token_id)

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        """Model inputs for (image, questions) pairs, plus ``targets`` (the token each position
        must predict, -100 for none) and ``answer_lengths`` (target count per question, in
        order)."""
        rows, answer_lengths = [], []
        for image, asked, system in examples:
            seqs = [self.ids(image, q, system) for q in asked]
            rows.append(self._row(seqs))
            answer_lengths += [len(ids) - n_prompt for ids, n_prompt in seqs]
        width = max(len(ids) for ids, _, _, _ in rows)
        batch = len(rows)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        position_ids = torch.zeros((batch, width), dtype=torch.long)
        targets = torch.full((batch, width), -100, dtype=torch.long)
        segment = torch.full((batch, width), -1, dtype=torch.long)  # -1: padding
        for r, (ids, pos, tgt, seg) in enumerate(rows):
            n = len(ids)
            input_ids[r, :n], position_ids[r, :n] = torch.tensor(ids), torch.tensor(pos)
            targets[r, :n], segment[r, :n] = torch.tensor(tgt), torch.tensor(seg)
        # Query i may attend key j <= i in the prefix (segment 0) or in its own segment.
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = segment[:, :, None] == segment[:, None, :]
        mask = causal & (same | (segment[:, None, :] == 0))
        attention_mask: torch.Tensor | dict[str, torch.Tensor] = mask[:, None]
        if self.sliding_window is not None:
            near = position_ids[:, :, None] - position_ids[:, None, :] < self.sliding_window
            attention_mask = {
                "full_attention": mask[:, None],
                "sliding_attention": (mask & near)[:, None],
            }
        pixels = self.processor.image_processor([e.image for e in examples], return_tensors="pt")
        return {
            "input_ids": input_ids,
            "pixel_values": pixels["pixel_values"],
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "targets": targets,
            "answer_lengths": torch.tensor(answer_lengths),
        }

    def _row(self, seqs: list[tuple[list[int], int]]) -> tuple[list[int], ...]:
        """One row's (ids, position ids, targets, segment numbers) for one image's questions."""
        first = seqs[0][0]
        prefix = self._prefix_length(first)
        ids, pos, tgt, seg = first[:prefix], list(range(prefix)), [-100] * prefix, [0] * prefix
        for k, (seq, n_prompt) in enumerate(seqs, start=1):
            if seq[:prefix] != first[:prefix]:
                raise ValueError("questions about one image must share the image prefix")
            tail = range(prefix, len(seq))
            ids += seq[prefix:]
            pos += list(tail)
            # Position s predicts token s + 1 when that token belongs to the answer.
            tgt += [seq[s + 1] if n_prompt <= s + 1 < len(seq) else -100 for s in tail]
            seg += [k] * len(tail)
        return ids, pos, tgt, seg


def answer_logits(
    model: LlavaForConditionalGeneration, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the positions that predict an answer token, and those tokens.

    The LM head (vocab x hidden) runs only on these few positions, not the whole sequence.
    """
    hidden = model.model(
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).last_hidden_state
    keep = batch["targets"] != -100
    return model.lm_head(hidden[keep]), batch["targets"][keep]


@torch.no_grad()
def _held_out_check(
    model: LlavaForConditionalGeneration, batcher: PackedBatcher, examples
) -> tuple[dict[str, float], float]:
    """Exact match per task type on held-out examples, and the model's image gain.

    Exact: every answer token is the argmax given the true prefix. This equals greedy
    decoding's exact match (if each argmax is right, greedy emits the answer and then
    ``<|im_end|>``), at the cost of one forward pass instead of a decode loop.
    Image gain: how much the loss rises when each example is given another example's image
    (nats per answer token); near 0 means the model ignores the picture.
    """
    model.eval()
    batch = batcher(examples)
    logits, targets = answer_logits(model, batch)
    shuffled = dict(batch, pixel_values=batch["pixel_values"].roll(1, 0))
    loss = F.cross_entropy(logits, targets)
    gain = F.cross_entropy(answer_logits(model, shuffled)[0], targets) - loss
    correct = (logits.argmax(-1) == targets).float()
    per_question = torch.split(correct, batch["answer_lengths"].tolist())
    asked = [q for e in examples for q in e.questions]
    hits: dict[str, list[bool]] = {t: [] for t in (*TASK_TYPES, "questions")}
    for q, c in zip(asked, per_question, strict=True):
        hits[q.type].append(bool(c.all()))
        if q.type in QUESTION_TYPES:
            hits["questions"].append(bool(c.all()))
    model.train()
    return {t: sum(h) / len(h) for t, h in hits.items() if h}, gain.item()


@torch.no_grad()
def generate_answers(
    model: PreTrainedModel,
    processor: ProcessorMixin,
    images: Sequence[Image.Image],
    prompts: Sequence[str],
    batch_size: int = 128,
    max_new_tokens: int = 32,
    system: str | None = None,
) -> list[str]:
    """Greedy answers of ``model`` to ``prompts[i]`` about ``images[i]``, via the stock HF path:
    ``processor.apply_chat_template`` + ``processor(...)`` + ``model.generate``; every prompt
    opens with the system turn ``system`` if given.

    Prompts are left-padded to a common length within a batch (the attention mask and the
    position ids derived from it make padding invisible to the model).
    """
    model.eval()
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        texts = [_prompt_text(processor, p, system) for p in prompts[start : start + batch_size]]
        inputs = processor(
            images=list(images[start : start + batch_size]),
            text=texts,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        )
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        new_tokens = out[:, inputs["input_ids"].shape[1] :]
        answers += processor.batch_decode(new_tokens, skip_special_tokens=True)
    return answers


def evaluate(
    model: PreTrainedModel,
    processor: ProcessorMixin,
    n_scenes: int,
    seed: int = EVAL_SEED,
    image_size: int = DEFAULT_IMAGE_SIZE,
    system: str | None = None,
) -> dict[str, float]:
    """Exact-match accuracy of greedy answers on ``n_scenes`` fresh scenes from ``seed``
    (prompts open with the system turn ``system`` if given).

    Every scene is asked every task it admits (:func:`minirad.course.scenes.ask`); returns the
    accuracy per task type, ``"questions"`` (all question types pooled) and ``"all"``.
    """
    rng = random.Random(seed)
    images, asked = [], []
    for _ in range(n_scenes):
        scene = random_scene(rng, size=image_size)
        image = render(scene)
        for task in TASK_TYPES:
            question = ask(scene, task, rng)
            if question is not None:
                images.append(image)
                asked.append(question)
    # Grouped by task: a batch decodes until its longest answer ends, so one-word answers do not
    # wait for JSON ones.
    order = sorted(range(len(asked)), key=lambda i: TASK_TYPES.index(asked[i].type))
    asked = [asked[i] for i in order]
    answers = generate_answers(
        model,
        processor,
        [images[i] for i in order],
        [q.prompt for q in asked],
        max_new_tokens=MAX_ANSWER_TOKENS,
        system=system,
    )
    hits: dict[str, list[bool]] = {t: [] for t in (*TASK_TYPES, "questions", "all")}
    for q, a in zip(asked, answers, strict=True):
        ok = a.strip() == q.answer
        hits[q.type].append(ok)
        hits["all"].append(ok)
        if q.type in QUESTION_TYPES:
            hits["questions"].append(ok)
    return {t: sum(h) / len(h) for t, h in hits.items() if h}


def _accumulate_gradients(
    model: LlavaForConditionalGeneration,
    batcher: PackedBatcher,
    examples: Sequence[Example],
    micro_batches: int,
) -> float:
    """Backpropagate the batch's mean answer-token cross-entropy in ``micro_batches`` passes;
    returns that loss.

    The rows are sorted by length and cut into groups of similar length, so a short row is
    padded to its group's longest row, not the batch's (a JSON answer is ~60 tokens, a
    one-word answer 2). Each group's summed loss is divided by the batch's target count, so
    the accumulated gradient is the full batch's, up to the order of float additions.
    """
    rows = sorted(examples, key=batcher.row_length)
    size = math.ceil(len(rows) / micro_batches)
    batches = [batcher(rows[i : i + size]) for i in range(0, len(rows), size)]
    total = sum(int((b["targets"] != -100).sum()) for b in batches)
    loss = 0.0
    for batch in batches:
        logits, targets = answer_logits(model, batch)
        part = F.cross_entropy(logits, targets, reduction="sum") / total
        part.backward()
        loss += part.item()
    return loss


def _lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to zero (multiplier of ``cfg.lr``)."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


def train(cfg: TrainConfig, command: str = "") -> dict[str, float]:
    """Train, save the model + processor to ``cfg.out`` with ``save_pretrained``, evaluate the
    saved copy, and write its model card. Returns the evaluation (see :func:`evaluate`)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer()
    processor = build_processor(tokenizer, cfg.image_size, cfg.patch_size)
    model = build_model(tokenizer, cfg)
    model.train()
    batcher = PackedBatcher(processor, sliding_window_of(model.config))
    rng = random.Random(cfg.seed)
    held_out = make_examples(
        random.Random(EVAL_SEED + 1), 64, cfg.image_size, system_prob=cfg.system_prob
    )

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_at(s, cfg))

    # (step, seconds, loss EMA, caption exact, JSON exact, question exact)
    curve: list[tuple[int, float, float, float, float, float]] = []
    ema = None
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train", mininterval=5, file=sys.stderr)
    for step in bar:
        examples = make_examples(
            rng,
            cfg.batch_size,
            cfg.image_size,
            cfg.questions_per_image,
            cfg.system_prob,
            cfg.json_prob,
        )
        optimizer.zero_grad(set_to_none=True)
        loss = _accumulate_gradients(model, batcher, examples, cfg.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        done = step + 1
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            exact, gain = _held_out_check(model, batcher, held_out)
            curve.append(
                (
                    done,
                    time.perf_counter() - start,
                    ema,
                    exact["caption"],
                    exact[JSON_TASK],
                    exact["questions"],
                )
            )
            per_type = " ".join(f"{t} {a:.2f}" for t, a in exact.items())
            bar.write(
                f"step {done}: {curve[-1][1]:.0f} s, loss {ema:.4f}, image gain {gain:.2f}; "
                f"held-out exact: {per_type}"
            )
        bar.set_postfix(loss=f"{ema:.4f}", refresh=False)
    seconds = time.perf_counter() - start

    save_checkpoint(model, processor, cfg.out)
    # Evaluate what was saved, loaded back the way users load it.
    auto_model, auto_processor = (
        transformers.AutoModelForImageTextToText,
        transformers.AutoProcessor,
    )
    reloaded = auto_model.from_pretrained(cfg.out, local_files_only=True)
    reprocessor = auto_processor.from_pretrained(cfg.out, local_files_only=True)
    t0 = time.perf_counter()
    accuracy = evaluate(reloaded, reprocessor, cfg.eval_scenes, image_size=cfg.image_size)
    with_system = evaluate(
        reloaded, reprocessor, cfg.eval_scenes, image_size=cfg.image_size, system=SYSTEM_PROMPTS[0]
    )
    eval_seconds = time.perf_counter() - t0
    run = TrainRun(command, seconds, eval_seconds, accuracy, with_system, curve, _software())
    model_card(cfg, model, run).save(cfg.out / "README.md")
    print(f"trained {cfg.steps} steps in {seconds:.0f} s; accuracy {accuracy}")
    return accuracy


# Every LLaVA on the Hub, and vLLM's loader, name the CLIP tower's weights
# ``vision_tower.vision_model.*`` (the ``CLIPVisionModel`` wrapper). transformers 5 builds the
# tower without that wrapper and saves a model made from a config as ``vision_tower.*``; it
# maps the Hub names back when loading, so only the file needs the Hub's names.
_TOWER = "vision_tower."
_HUB_TOWER = "vision_tower.vision_model."


def _hub_name(key: str) -> str:
    if key.startswith(_TOWER) and not key.startswith(_HUB_TOWER):
        return _HUB_TOWER + key[len(_TOWER) :]
    return key


def save_checkpoint(
    model: LlavaForConditionalGeneration, processor: LlavaProcessor, out: Path
) -> None:
    """``save_pretrained`` both, with the weights in the Hub's LLaVA layout.

    The vision tower's tensors are renamed ``vision_tower.*`` -> ``vision_tower.vision_model.*``
    (values untouched), so transformers and vLLM 0.32 both load the folder as it is.
    """
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    path = out / "model.safetensors"
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        tensors = {_hub_name(k): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, path, metadata=metadata)


MODEL_CARD_TEMPLATE = Path(__file__).with_name("model_card_template.md")


class TrainRun(NamedTuple):
    """What one training run measured: the numbers its model card reports."""

    command: str  # the command line that trained the model
    seconds: float  # training wall time, held-out checks included
    eval_seconds: float  # both evaluations of :func:`train`
    accuracy: dict[str, float]  # exact match per task (:func:`evaluate`)
    with_system: dict[str, float]  # the same after the system turn SYSTEM_PROMPTS[0]
    # (step, seconds, loss EMA, caption exact, JSON exact, question exact) at each held-out check
    curve: list[tuple[int, float, float, float, float, float]]
    software: str  # "torch X, transformers Y, Python Z" of the run


def _software() -> str:
    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}"
    )


_FAMILY_NAMES = {"llama": "Llama", "gemma3": "Gemma 3"}
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _layer_runs(layer_types: Sequence[str]) -> str:
    """``layer_types`` in words: ``"layers 0-4 sliding, layer 5 full"``."""
    runs: list[list] = []  # [type, first, last]
    for i, kind in enumerate(layer_types):
        if runs and runs[-1][0] == kind:
            runs[-1][2] = i
        else:
            runs.append([kind, i, i])
    return ", ".join(
        (f"layers {a}-{b}" if a < b else f"layer {a}") + " " + kind.split("_")[0]
        for kind, a, b in runs
    )


def _card_path(out: Path) -> str:
    """``out`` as the card's example loads it: relative to the repository root if inside it."""
    try:
        return out.resolve().relative_to(_REPO_ROOT).as_posix()
    except ValueError:
        return out.as_posix()


def model_card(cfg: TrainConfig, model: LlavaForConditionalGeneration, run: TrainRun) -> ModelCard:
    """The Hugging Face model card of a model trained with ``cfg`` and saved in ``cfg.out``:
    :data:`MODEL_CARD_TEMPLATE` (Jinja, rendered by ``ModelCard.from_template``) filled with
    the configuration, the parameter counts, the file size and ``run``'s measurements."""

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    text = model.config.get_text_config()
    gemma3 = cfg.text_family == "gemma3"
    family = _FAMILY_NAMES[cfg.text_family]
    layer_types = list(getattr(text, "layer_types", None) or [])
    tags = ["llava", "tiny", "synthetic", "minirad"]
    if gemma3:
        tags[1:1] = ["gemma3", "sliding-window"]
    data = ModelCardData(library_name="transformers", pipeline_tag="image-text-to-text", tags=tags)
    return ModelCard.from_template(
        data,
        template_path=MODEL_CARD_TEMPLATE,
        cfg=cfg,
        run=run,
        name=cfg.out.name,
        path=_card_path(cfg.out),
        gemma3=gemma3,
        pattern=(
            f"{layer_types.count('sliding_attention')} sliding : "
            f"{layer_types.count('full_attention')} full"
        ),
        layer_types=layer_types,
        layer_runs=_layer_runs(layer_types),
        rope_theta={k: v["rope_theta"] for k, v in text.rope_parameters.items()} if gemma3 else {},
        max_positions=text.max_position_embeddings,
        parameters={
            "vision tower (CLIP ViT)": count(model.model.vision_tower),
            "projector (MLP)": count(model.model.multi_modal_projector),
            f"text model ({family}; embeddings tied to the LM head)": count(
                model.model.language_model
            ),
        },
        total=count(model),
        size=(cfg.out / "model.safetensors").stat().st_size,
        image_tokens=(cfg.image_size // cfg.patch_size) ** 2,
        question_weights=QUESTION_WEIGHTS,
        weak={t: a for t, a in run.accuracy.items() if t in TASK_TYPES and a < 0.95},
        eval_seed=EVAL_SEED,
        system_prompt=SYSTEM_PROMPTS[0],
    )


def _parse(argv: Sequence[str] | None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in vars(defaults).items():
        kind = Path if isinstance(value, Path) else type(value)
        choices = TEXT_FAMILIES if name == "text_family" else None
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=value, choices=choices
        )
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "-m", "minirad.course.train", *args])
    train(_parse(args), command)


if __name__ == "__main__":
    main()
