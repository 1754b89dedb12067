"""Exercises of chapter 05 (images in the prefix cache).

Expected answers are computed here with the real ``minirad`` code: :func:`pad_value` and
:func:`hash_image` for q1 and q2, and the :class:`~minirad.engine.LLMEngine` on the shipped
model (:data:`~minirad.models.DEFAULT_MODEL_DIR`) and the shipped scene images for q3 to q5,
so the answers follow the model's processor (placeholders per image) and chat template. The
model is loaded once, on the first check that needs it. Every ``Qn_SOLUTION`` is runnable code
that sets ``answer``; the tests run it and check it with ``qn``.

Usage in the notebook::

    from minirad.exercises.ch05 import q1
    answer = ...
    q1.check(answer)
"""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image, ImageOps

from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.exercises import Exercise, WrongAnswer, is_int, wrong_type
from minirad.kvcache.multimodal import hash_image, pad_value
from minirad.models import DEFAULT_MODEL_DIR, load_model

__all__ = [
    "IMAGE_DIR",
    "Q1_HASH",
    "Q1_VOCAB_SIZE",
    "Q2_IMAGE",
    "Q2_PREPROCESS",
    "Q3_IMAGE",
    "Q3_PAGE_SIZE",
    "Q3_QUESTIONS",
    "Q4_IMAGES",
    "Q4_QUESTIONS",
    "STRATEGIES",
    "SYSTEM",
    "chat_prompt",
    "q1",
    "q2",
    "q2_images",
    "q3",
    "q4",
    "q5",
    "run_workload",
]

IMAGE_DIR = DEFAULT_MODEL_DIR.parents[1] / "images"  # data/images: the shipped scenes
# The chapter's system prompt: shared text before every image.
SYSTEM = "You are a helpful assistant. Look at the picture and answer the question in one word."
STRATEGIES = ("radix", "truncate", "none")

# q1: the pad id of an image hash, for the shipped model's vocabulary.
Q1_HASH = "9f3c2a7be5d41806c1a0e97f4b3d2c8e5a6f70b1d9e8c3a24f5b6d7e8091a2b3c"
Q1_VOCAB_SIZE = 1024

# q2: which variants of one image keep its hash.
Q2_IMAGE = "red_circle_left_of_blue_square.png"
Q2_PREPROCESS = {"size": 48}  # the preprocessing parameters hashed with the pixels

# q3: two questions about one image, in an engine with pages of Q3_PAGE_SIZE tokens.
Q3_IMAGE = "red_circle_left_of_blue_square.png"
Q3_QUESTIONS = ("Is there a red circle?", "Is there a blue square?")
Q3_PAGE_SIZE = 16

# q4, q5: every question about every image, one request at a time, image by image.
Q4_IMAGES = ("red_circle_left_of_blue_square.png", "orange_square.png")
Q4_QUESTIONS = ("How many shapes are there?", "Is there a red circle?", "What shape is it?")


# ---------------------------------------------------------------------------------- the model
@functools.cache
def _model_and_processor():
    with torch.random.fork_rng(devices=[]):  # loading must not move the learner's RNG
        return load_model(DEFAULT_MODEL_DIR)


def chat_prompt(question: str, system: str = SYSTEM) -> str:
    """The chapter's prompt text: ``system``, then a user turn with one image and
    ``question``, in the shipped model's chat template (the processor expands ``<image>``)."""
    _, processor = _model_and_processor()
    content = [{"type": "image"}, {"type": "text", "text": question}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _engine(**settings) -> LLMEngine:
    model, processor = _model_and_processor()
    return LLMEngine(model, processor, **settings)


def _request(image: str, question: str) -> GenerateRequest:
    # One output token: the exercises count prompt work, which the answer does not change.
    params = SamplingParams(max_new_tokens=1)
    return GenerateRequest(chat_prompt(question), [IMAGE_DIR / image], params)


@functools.cache
def run_workload(strategy: str, encoder_cache_size: int = 4096) -> tuple[int, int]:
    """Every question of :data:`Q4_QUESTIONS` about every image of :data:`Q4_IMAGES`, one
    request at a time, through an engine with ``prefix_strategy=strategy``.

    Returns:
        ``(prefill tokens computed, vision tower runs)``.
    """
    engine = _engine(prefix_strategy=strategy, encoder_cache_size=encoder_cache_size)
    for image in Q4_IMAGES:
        for question in Q4_QUESTIONS:
            engine.generate([_request(image, question)])
    return engine.stats.prefill_tokens, engine.stats.encoder_calls


def _strategy_dict(answer: object) -> dict[str, int]:
    if not isinstance(answer, dict) or set(answer) != set(STRATEGIES):
        raise WrongAnswer(wrong_type(f"a dict with the keys {list(STRATEGIES)}", answer))
    if not all(is_int(v) for v in answer.values()):
        raise WrongAnswer(wrong_type("a dict whose values are ints", answer))
    return answer


# ----------------------------------------------------------------------------------------- q1
def _check_q1(answer: object) -> str | None:
    if not is_int(answer):
        return wrong_type("one int (a token id)", answer)
    expected = pad_value(Q1_HASH, Q1_VOCAB_SIZE)
    if answer == expected:
        return None
    if answer == expected - Q1_VOCAB_SIZE:
        return "pad ids start at vocab_size, so that they can never equal a real token id"
    if answer == Q1_VOCAB_SIZE + int(Q1_HASH[:16], 16) % 2**30:
        return (
            "that id keeps 30 bits of the hash, as SGLang's pad ids do; pad_value's docstring "
            "says why minirad keeps more"
        )
    return (
        f"{answer} is not it: read pad_value in minirad/kvcache/multimodal.py "
        "(pad_value?? shows it)"
    )


Q1_SOLUTION = """\
from minirad.exercises.ch05 import Q1_HASH, Q1_VOCAB_SIZE
from minirad.kvcache.multimodal import pad_value

answer = pad_value(Q1_HASH, Q1_VOCAB_SIZE)  # its docstring gives the formula and the why"""

q1 = Exercise(
    "q1 the pad id of an image",
    _check_q1,
    "Read minirad.kvcache.multimodal.pad_value and its docstring (pad_value?? in a cell): which "
    "part of the hash does it keep, and where do its ids start?",
    Q1_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q2
def _reopened(image: Image.Image, fmt: str) -> Image.Image:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    buf.seek(0)
    out = Image.open(buf)
    out.load()
    return out


def q2_images() -> dict[str, tuple[Image.Image, dict]]:
    """``{name: (image, preprocessing parameters)}``: ``"original"`` (:data:`Q2_IMAGE` with
    :data:`Q2_PREPROCESS`) and its variants:

    - ``"png_copy"``: saved as PNG under another name and read back;
    - ``"jpeg_copy"``: saved as JPEG (quality 95) and read back;
    - ``"rgba"``: converted to RGBA (fully opaque: the processor converts it back to RGB);
    - ``"mirrored"``: flipped left to right;
    - ``"other_layout"``: ``red_circle_left_of_blue_square_2.png``, the same caption drawn with
      another layout;
    - ``"size_32"``: the original, for a processor that resizes to 32 pixels.
    """
    original = Image.open(IMAGE_DIR / Q2_IMAGE)
    original.load()
    other = Image.open(IMAGE_DIR / Q2_IMAGE.replace(".png", "_2.png"))
    other.load()
    return {
        "original": (original, Q2_PREPROCESS),
        "png_copy": (_reopened(original, "PNG"), Q2_PREPROCESS),
        "jpeg_copy": (_reopened(original.convert("RGB"), "JPEG"), Q2_PREPROCESS),
        "rgba": (original.convert("RGBA"), Q2_PREPROCESS),
        "mirrored": (ImageOps.mirror(original), Q2_PREPROCESS),
        "other_layout": (other, Q2_PREPROCESS),
        "size_32": (original, {**Q2_PREPROCESS, "size": 32}),
    }


_Q2_WHY = {
    "jpeg_copy": "JPEG is lossy: the copy's pixels differ a little, so its hash differs",
    "rgba": "the hash covers the mode: an RGBA copy is another image to the cache, although "
    "the processor turns it into the same RGB pixels (a missed reuse, never a wrong one)",
    "mirrored": "a mirrored image has other pixels",
    "other_layout": "the same caption is not the same picture: the hash sees pixels, not meaning",
    "size_32": "the preprocessing parameters are hashed too: resized for another processor, "
    "the same file gives the model other pixels",
}


def _q2_expected() -> set[str]:
    images = q2_images()
    original = hash_image(images["original"][0], **images["original"][1])
    return {
        name
        for name, (image, params) in images.items()
        if name != "original" and hash_image(image, **params) == original
    }


def _check_q2(answer: object) -> str | None:
    if not isinstance(answer, set | frozenset | list | tuple) or not all(
        isinstance(x, str) for x in answer
    ):
        if isinstance(answer, str):  # one name: a str is also a sequence of strs
            return wrong_type(f"a set of variant names (for one name: {{{answer!r}}})", answer)
        return wrong_type('a set of variant names, e.g. {"mirrored"}', answer)
    names = set(answer)
    known = set(q2_images()) - {"original"}
    if unknown := names - known:
        return f"unknown variant(s) {sorted(unknown)}; the variants are {sorted(known)}"
    expected = _q2_expected()
    if names == expected:
        return None
    for name in sorted(names - expected):
        if name in _Q2_WHY:
            return _Q2_WHY[name]
    if "png_copy" in expected - names:
        return "the file name is not hashed: a lossless copy has the same pixels, mode and size"
    return f"{sorted(names)} is not it"


Q2_SOLUTION = """\
from minirad.exercises.ch05 import q2_images
from minirad.kvcache.multimodal import hash_image

images = q2_images()
original = hash_image(images["original"][0], **images["original"][1])
answer = {
    name
    for name, (image, params) in images.items()
    if name != "original" and hash_image(image, **params) == original
}  # {"png_copy"}: only a lossless copy keeps pixels, mode, size and preprocessing"""

q2 = Exercise(
    "q2 which copies share the hash",
    _check_q2,
    "hash_image covers the decoded pixels, the mode, the size and the preprocessing "
    "parameters, and nothing else.",
    Q2_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q3
@functools.cache
def _q3_expected() -> tuple[int, int]:
    """``(tokens B reuses, B's image placeholders that B's prefill computes)``."""
    engine = _engine(page_size=Q3_PAGE_SIZE)
    first, second = (_request(Q3_IMAGE, q) for q in Q3_QUESTIONS)
    engine.generate([first])
    [out] = engine.generate([second])
    reused = out.stats.cached_tokens
    segments = engine.input_processor.process(second.prompt, second.images).segments
    computed = sum(max(0, s.offset + s.length - max(s.offset, reused)) for s in segments)
    return reused, computed


def _check_q3(answer: object) -> str | None:
    if not isinstance(answer, tuple | list) or len(answer) != 2 or not all(map(is_int, answer)):
        return wrong_type("two ints: (tokens reused, image placeholders computed)", answer)
    reused, computed = answer
    exp_reused, exp_computed = _q3_expected()
    if (reused, computed) == (exp_reused, exp_computed):
        return None
    if reused % Q3_PAGE_SIZE:
        return f"the tree matches whole pages: round down to a multiple of {Q3_PAGE_SIZE}"
    if reused != exp_reused:
        return (
            "find where the two radix keys first differ (the same image gives the same pad "
            "ids, and the questions share their first words), then round down to a page"
        )
    if computed == 0:
        return "the reused prefix ends inside the image: its last placeholders are computed"
    return "count the placeholder positions at or after the reused prefix"


Q3_SOLUTION = """\
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.exercises.ch05 import IMAGE_DIR, Q3_IMAGE, Q3_PAGE_SIZE, Q3_QUESTIONS, chat_prompt
from minirad.models import DEFAULT_MODEL_DIR

engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, page_size=Q3_PAGE_SIZE)
a, b = (GenerateRequest(chat_prompt(q), [IMAGE_DIR / Q3_IMAGE]) for q in Q3_QUESTIONS)
engine.generate([a])
reused = engine.generate([b])[0].stats.cached_tokens
[image] = engine.input_processor.process(b.prompt, b.images).segments  # one placeholder run
answer = (reused, image.offset + image.length - reused)
# The keys agree up to "...<image>\\nIs there a"; whole pages of 16 end inside the image."""

q3 = Exercise(
    "q3 a hit that ends inside the image",
    _check_q3,
    "The two requests' keys agree through the system prompt, image A (the same picture both "
    "times, so the same pad ids) and the first words of the questions; the tree keeps whole "
    "pages only.",
    Q3_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q4
def _check_q4(answer: object) -> str | None:
    got = _strategy_dict(answer)
    expected = {s: run_workload(s)[0] for s in STRATEGIES}
    if got == expected:
        return None
    if got["none"] != expected["none"]:
        return '"none" reuses nothing: it computes every prompt token of every request'
    if got["truncate"] != expected["truncate"]:
        return (
            '"truncate" reuses the text before the first image, which the first request '
            "must compute once"
        )
    return (
        '"radix" computes each distinct prefix once: count the tokens of the tree that holds '
        "every request's key (the same image gives the same pad ids)"
    )


Q4_SOLUTION = """\
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.exercises.ch05 import IMAGE_DIR, Q4_IMAGES, Q4_QUESTIONS, chat_prompt
from minirad.models import DEFAULT_MODEL_DIR

answer = {}
for strategy in ("radix", "truncate", "none"):
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, prefix_strategy=strategy)
    for image in Q4_IMAGES:
        for question in Q4_QUESTIONS:
            request = GenerateRequest(
                chat_prompt(question), [IMAGE_DIR / image], SamplingParams(max_new_tokens=1)
            )
            engine.generate([request])
    answer[strategy] = engine.stats.prefill_tokens"""

q4 = Exercise(
    "q4 prefill tokens per strategy",
    _check_q4,
    'Per request: "none" computes the whole prompt, "truncate" all but the text before the '
    'image (once it is cached), "radix" all but the longest cached prefix of its key.',
    Q4_SOLUTION,
)


# ----------------------------------------------------------------------------------------- q5
def _check_q5(answer: object) -> str | None:
    got = _strategy_dict(answer)
    expected = {s: run_workload(s, encoder_cache_size=0)[1] for s in STRATEGIES}
    if got == expected:
        return None
    if all(v == len(Q4_IMAGES) for v in got.values()):
        return "that is with an encoder cache; this one keeps nothing"
    if got["radix"] != expected["radix"]:
        return (
            "a request whose reused prefix covers its whole image needs no image features: "
            "its prefill starts after the image"
        )
    return "without the encoder cache, every prefill that computes an image runs the tower"


Q5_SOLUTION = """\
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.exercises.ch05 import IMAGE_DIR, Q4_IMAGES, Q4_QUESTIONS, chat_prompt
from minirad.models import DEFAULT_MODEL_DIR

answer = {}
for strategy in ("radix", "truncate", "none"):
    engine = LLMEngine.from_pretrained(
        DEFAULT_MODEL_DIR, prefix_strategy=strategy, encoder_cache_size=0
    )
    for image in Q4_IMAGES:
        for question in Q4_QUESTIONS:
            request = GenerateRequest(
                chat_prompt(question), [IMAGE_DIR / image], SamplingParams(max_new_tokens=1)
            )
            engine.generate([request])
    answer[strategy] = engine.stats.encoder_calls
# radix: once per image (later questions reuse the image's KV); the others: once per request"""

q5 = Exercise(
    "q5 vision tower runs without an encoder cache",
    _check_q5,
    "The engine asks for an image's features only when a prefill computes some of its "
    "placeholders. Which requests compute their image under each strategy?",
    Q5_SOLUTION,
)
