"""Chapter 05 exercises, held to the shared contract of ``exercise_contract.py``: the
oracle's answer passes, near misses fail, typical mistakes get their reason, the stub is
"not attempted", and the printed solution computes the answer.

The oracles use no minirad class: q1 is the pad-id formula in integers; q2 compares what the
hash is meant to cover (pixels, mode, size, preprocessing) with PIL; q3 to q5 tokenize the
prompts with the model's own Hugging Face processor, mark each placeholder with the name of its
image (what a pad id stands for), and replay the requests with prefix arithmetic: a request
reuses its longest common prefix with an earlier key (at most all but its last token, whole
pages only), cut at the first image under "truncate", nothing under "none"; without an encoder
cache it runs the vision tower when it computes any placeholder.
"""

from __future__ import annotations

import functools

from exercise_contract import ExerciseContract, common_len, near_misses
from PIL import Image
from transformers import AutoConfig, AutoProcessor

from minirad.exercises import ch05
from minirad.kvcache.multimodal import pad_value
from minirad.models import DEFAULT_MODEL_DIR


@functools.cache
def processor():
    return AutoProcessor.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)


@functools.cache
def image_token_id() -> int:
    return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True).image_token_id


def key(image: str, question: str) -> list:
    """The prompt's token ids, each placeholder replaced by its image's name."""
    proc = processor()
    content = [{"type": "image"}, {"type": "text", "text": question}]
    messages = [{"role": "system", "content": ch05.SYSTEM}, {"role": "user", "content": content}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pixels = Image.open(ch05.IMAGE_DIR / image)
    ids = proc(text=text, images=[pixels], return_tensors="pt")["input_ids"][0].tolist()
    return [image if t == image_token_id() else t for t in ids]


def first_image(k: list) -> int:
    return next(j for j, t in enumerate(k) if isinstance(t, str))


def replay(keys: list[list], strategy: str, page_size: int = 1) -> list[int]:
    """Tokens each request reuses when the requests run one by one."""
    reused = []
    for i, k in enumerate(keys):
        best = max((common_len(k, earlier) for earlier in keys[:i]), default=0)
        best = min(best, len(k) - 1) // page_size * page_size
        if strategy == "truncate":
            best = min(best, first_image(k))
        reused.append(0 if strategy == "none" else best)
    return reused


def placeholders_from(k: list, start: int) -> int:
    return sum(isinstance(t, str) for t in k[start:])


def oracle_q1() -> int:
    # The formula is pad_value's, tested in test_multimodal; here: the exercise follows it.
    return pad_value(ch05.Q1_HASH, ch05.Q1_VOCAB_SIZE)


def oracle_q2() -> set[str]:
    images = ch05.q2_images()
    image, params = images["original"]

    def same(other, other_params) -> bool:
        return (other.mode, other.size, other.tobytes(), other_params) == (
            image.mode,
            image.size,
            image.tobytes(),
            params,
        )

    return {n for n, (im, p) in images.items() if n != "original" and same(im, p)}


def oracle_q3() -> tuple[int, int]:
    keys = [key(ch05.Q3_IMAGE, q) for q in ch05.Q3_QUESTIONS]
    reused = replay(keys, "radix", ch05.Q3_PAGE_SIZE)[1]
    return reused, placeholders_from(keys[1], reused)


def workload_keys() -> list[list]:
    return [key(image, q) for image in ch05.Q4_IMAGES for q in ch05.Q4_QUESTIONS]


def oracle_q4() -> dict[str, int]:
    keys = workload_keys()
    return {
        s: sum(len(k) - r for k, r in zip(keys, replay(keys, s), strict=True))
        for s in ch05.STRATEGIES
    }


def oracle_q5() -> dict[str, int]:
    keys = workload_keys()
    return {
        s: sum(placeholders_from(k, r) > 0 for k, r in zip(keys, replay(keys, s), strict=True))
        for s in ch05.STRATEGIES
    }


CASES = [
    (ch05.q1, oracle_q1, ch05.Q1_SOLUTION),
    (ch05.q2, oracle_q2, ch05.Q2_SOLUTION),
    (ch05.q3, oracle_q3, ch05.Q3_SOLUTION),
    (ch05.q4, oracle_q4, ch05.Q4_SOLUTION),
    (ch05.q5, oracle_q5, ch05.Q5_SOLUTION),
]


def wrong_answers(right):
    """The contract's near misses, and for q2 (a set of variant names) the other variants."""
    wrong = near_misses(right)
    if isinstance(right, set):
        others = set(ch05.q2_images()) - {"original"} - right
        wrong += [right | {name} for name in sorted(others)] + [{"original"}]
    return wrong


@functools.cache
def diagnosed_mistakes():
    """Typical mistakes, and a word of the reason the learner must see."""
    q3_reused, q3_computed = oracle_q3()
    prefill, runs = oracle_q4(), oracle_q5()
    # "truncate" if every request, the first one too, found the text before its image cached
    from_image = [len(k) - first_image(k) for k in workload_keys()]
    return [
        (ch05.q1, oracle_q1() - ch05.Q1_VOCAB_SIZE, "vocab_size"),
        (ch05.q1, ch05.Q1_VOCAB_SIZE + int(ch05.Q1_HASH[:16], 16) % 2**30, "keeps 30 bits"),
        (ch05.q1, ch05.Q1_HASH, "expected one int (a token id), got str"),
        (
            ch05.q2,
            "png_copy",
            "expected a set of variant names (for one name: {'png_copy'}), got str",
        ),
        (ch05.q2, {"png_copy", "rgba"}, "mode"),
        (ch05.q2, {"png_copy", "other_layout"}, "pixels, not meaning"),
        (ch05.q2, {"png_copy", "size_32"}, "preprocessing"),
        (ch05.q2, {"png_copy", "jpeg_copy"}, "lossy"),
        (ch05.q2, set(), "file name is not hashed"),
        (ch05.q2, {"png_copy", "blurred"}, "unknown variant"),
        (ch05.q3, (q3_reused + 3, q3_computed), "whole pages"),
        (ch05.q3, (q3_reused + ch05.Q3_PAGE_SIZE, q3_computed), "first differ"),
        (ch05.q3, (q3_reused, 0), "inside the image"),
        (ch05.q4, {**prefill, "none": prefill["radix"]}, "reuses nothing"),
        (ch05.q4, {**prefill, "truncate": sum(from_image)}, "compute once"),
        (ch05.q4, {**prefill, "radix": prefill["truncate"]}, "distinct prefix"),
        (ch05.q5, dict.fromkeys(ch05.STRATEGIES, len(ch05.Q4_IMAGES)), "encoder cache"),
        (ch05.q5, {**runs, "radix": runs["none"]}, "needs no image features"),
    ]


class TestExerciseContract(ExerciseContract):
    chapter = ch05
    cases = CASES
    diagnosed = diagnosed_mistakes  # at test time: the oracles tokenize with the processor
    wrong_answers = staticmethod(wrong_answers)


def test_the_scenarios_teach_what_the_chapter_says():
    """The numbers behind the questions: q3's reuse ends inside the image, and the three
    strategies of q4 / q5 differ."""
    reused, computed = oracle_q3()
    assert 0 < computed < placeholders_from(key(ch05.Q3_IMAGE, ch05.Q3_QUESTIONS[1]), 0)
    assert reused % ch05.Q3_PAGE_SIZE == 0
    prefill = oracle_q4()
    assert prefill["radix"] < prefill["truncate"] < prefill["none"]
    runs = oracle_q5()
    assert runs["radix"] == len(ch05.Q4_IMAGES) < runs["truncate"] == runs["none"]
    assert ch05.q2_images().keys() - {"original"} - oracle_q2()  # some variants miss the hash
