"""The real ``Gemma3ForConditionalGeneration`` through PagedVLM: its image tokens attend
bidirectionally within their image (HF's ``token_type_ids`` mask), in full and sliding layers.

A tiny random model (tests/tiny_models.py :func:`tiny_gemma3_vlm`: 2-layer SigLIP, 4 image
tokens, the 6-layer Gemma 3 text model of window 16) against HF in fp32: logits within 1e-4
and greedy tokens equal to ``generate(input_ids, pixel_values, token_type_ids)``, on prompts
shorter and longer than the window, in one chunk or in chunks cut at image boundaries, alone or
beside another sequence. A chunk cut inside an image is refused. And the lesson: the causal
variant (every token causal, as a text model) is HF *without* ``token_type_ids``, and is not
HF's model.
"""

import random

import pytest
import torch
from tiny_models import (
    GEMMA3_IMAGE_TOKENS,
    GEMMA3_WINDOW,
    IMAGE_TOKEN_ID,
    gemma3_prompt_ids,
    pixel_inputs,
    tiny_gemma3_vlm,
)

from minirad.errors import ImageError
from minirad.kvcache.kv_pool import KVCache
from minirad.models import (
    FAMILIES,
    ForwardBatch,
    PagedVLM,
    image_features_for_chunk,
    kv_cache_dims,
    load_model,
)
from minirad.models.vlm import image_spans

ATOL = 1e-4
STEPS = 8
W = GEMMA3_WINDOW
# (text_before, text_after, num_images): within one window; images past the first window; a
# prompt of 4 windows with three images.
PROMPTS = {"short": (3, 4, 1), "long": (20, 9, 2), "longer": (30, 14, 3)}


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3_vlm()


class Seq:
    """One prompt, its images, its scattered slots (block size 4) and its generated tokens."""

    def __init__(self, name: str, seed: int = 0):
        before, after, n = PROMPTS[name]
        self.ids = gemma3_prompt_ids(before, after, n, seed=seed)
        self.pixels = pixel_inputs("llava", n, seed=seed)
        self.slots: list[int] = []
        self.tokens: list[int] = []
        self.free = list(range(1, 64))
        random.Random(seed).shuffle(self.free)
        self.offset = 64 * seed  # blocks of its own in the shared pool

    def grow(self, n: int) -> list[int]:
        for pos in range(len(self.slots), len(self.slots) + n):
            if pos % 4:
                self.slots.append(self.slots[-1] + 1)
            else:
                self.slots.append((self.offset + self.free.pop()) * 4)
        return list(self.slots)


def pool(model) -> KVCache:
    return KVCache(num_blocks=256, block_size=4, **kv_cache_dims(model.config))


def prefill(vlm, seqs_and_chunks, all_logits=True):
    """One step prefilling ``seq.ids[start:end]`` of each ``(seq, start, end)``."""
    ids, slots, feats, rows, base = [], [], [], [], 0
    for seq, start, end in seqs_and_chunks:
        chunk = seq.ids[start:end]
        ids.append(chunk)
        slots.append(seq.grow(end - start))
        f = image_features_for_chunk(
            seq.ids, start, end, IMAGE_TOKEN_ID, vlm.encode_images(seq.pixels)
        )
        if f is not None:
            feats.append(f)
            rows += [base + i for i, t in enumerate(chunk) if t == IMAGE_TOKEN_ID]
        base += len(chunk)
    batch = ForwardBatch.build(
        ids,
        slots,
        mm_features=torch.cat(feats) if feats else None,
        mm_token_indices=rows or None,
        all_logits=all_logits,
    )
    return vlm(batch)


def decode(vlm, seq: Seq) -> torch.Tensor:
    return vlm(ForwardBatch.build([[seq.tokens[-1]]], [seq.grow(1)]))[-1]


def serve(vlm, seq: Seq, chunks: list[int], steps: int = STEPS) -> torch.Tensor:
    """Prefill in ``chunks`` (token counts), then ``steps - 1`` greedy decodes: the logits of
    every prompt token and of each decode, ``[len(ids) + steps - 1, V]``."""
    logits, start = [], 0
    for n in chunks:
        logits.append(prefill(vlm, [(seq, start, start + n)]))
        start += n
    assert start == len(seq.ids)
    seq.tokens.append(int(logits[-1][-1].argmax()))
    for _ in range(steps - 1):
        logits.append(decode(vlm, seq)[None])
        seq.tokens.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits)


def token_types(ids: list[int]) -> torch.Tensor:
    return torch.tensor([[int(t == IMAGE_TOKEN_ID) for t in ids]])


@torch.no_grad()
def hf_logits(model, seq: Seq, bidirectional: bool = True) -> torch.Tensor:
    """HF's logits of the prompt followed by our generated tokens (text), in one pass; with
    ``token_type_ids`` (HF's model) or without (the causal mask of a text model)."""
    ids = seq.ids + seq.tokens[:-1]
    kw = {"token_type_ids": token_types(ids)} if bidirectional else {}
    return model(input_ids=torch.tensor([ids]), **seq.pixels, **kw).logits[0]


@torch.no_grad()
def hf_generate(model, seq: Seq, bidirectional: bool = True) -> list[int]:
    kw = {"token_type_ids": token_types(seq.ids)} if bidirectional else {}
    out = model.generate(
        input_ids=torch.tensor([seq.ids]), **seq.pixels, **kw, max_new_tokens=STEPS, do_sample=False
    )
    return out[0, len(seq.ids) :].tolist()


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def image_bounds(ids: list[int]) -> list[tuple[int, int]]:
    """``(first, last + 1)`` of each image's placeholder run."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == IMAGE_TOKEN_ID and start is None:
            start = i
        elif t != IMAGE_TOKEN_ID and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_the_family_is_registered(model):
    family = FAMILIES["gemma3"]
    assert family.architecture == "Gemma3ForConditionalGeneration"
    assert family.bidirectional_images
    assert not FAMILIES["llava"].bidirectional_images
    vlm = PagedVLM(model, pool(model))
    assert vlm.tokens_per_image == GEMMA3_IMAGE_TOKENS
    assert vlm.decoder.logit_softcap is None  # Gemma3ForConditionalGeneration does not cap


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_and_greedy_decode_match_hf(model, name):
    seq = Seq(name)
    assert len(seq.ids) > W or name == "short"
    logits = serve(PagedVLM(model, pool(model)), seq, [len(seq.ids)])
    close(logits, hf_logits(model, seq))
    assert seq.tokens == hf_generate(model, seq)


def test_chunks_cut_at_image_boundaries(model):
    """Chunks that end just before an image, just after one, and between two."""
    seq = Seq("longer")
    (a0, a1), (b0, b1), (c0, _) = image_bounds(seq.ids)
    cuts = [a0, b1, c0, len(seq.ids)]
    chunks = [y - x for x, y in zip([0, *cuts], cuts, strict=False)]
    logits = serve(PagedVLM(model, pool(model)), seq, chunks)
    close(logits, hf_logits(model, seq))
    assert seq.tokens == hf_generate(model, seq)


def test_two_prefills_in_one_step(model):
    """A prompt beside another one's second chunk: a ragged step of two sequences, each with
    its own images, in the sliding layers' gathered windows too."""
    vlm = PagedVLM(model, pool(model))
    a, b = Seq("long", seed=1), Seq("longer", seed=2)
    b_cut = image_bounds(b.ids)[1][1]  # b's first chunk ends after its second image
    first = prefill(vlm, [(b, 0, b_cut)])
    both = prefill(vlm, [(a, 0, len(a.ids)), (b, b_cut, len(b.ids))])
    close(both[: len(a.ids)], hf_logits(model, a)[: len(a.ids)])
    close(torch.cat([first, both[len(a.ids) :]]), hf_logits(model, b)[: len(b.ids)])


def test_a_chunk_inside_an_image_is_refused(model):
    vlm = PagedVLM(model, pool(model))
    seq = Seq("long")
    start, _ = image_bounds(seq.ids)[1]
    with pytest.raises(ImageError, match="whole image"):
        prefill(vlm, [(seq, 0, start + 1)])
    seq = Seq("short")
    start, _ = image_bounds(seq.ids)[0]
    prefill(vlm, [(seq, 0, start)])
    with pytest.raises(ImageError, match="whole image"):
        prefill(vlm, [(seq, start, start + GEMMA3_IMAGE_TOKENS - 1)])
    # Beside another sequence, the message names the sequence whose image is cut.
    other, cut = Seq("short", seed=1), Seq("long", seed=2)
    inside = image_bounds(cut.ids)[0][0] + 2
    with pytest.raises(ImageError, match="of sequence 1 "):
        prefill(vlm, [(other, 0, len(other.ids)), (cut, 0, inside)])


def test_image_spans():
    """Per token the positions of its image: two sequences, the second's image at the start
    of its chunk (its boi in an earlier step); text tokens (0, 0)."""
    n = GEMMA3_IMAGE_TOKENS
    a = [1, 4, *[IMAGE_TOKEN_ID] * n, 5, 9]
    b = [*[IMAGE_TOKEN_ID] * n, 5]
    rows = [i for i, t in enumerate(a + b) if t == IMAGE_TOKEN_ID]
    batch = ForwardBatch.build(
        [a, b],
        [list(range(len(a))), list(range(100, 110 + len(b)))],
        mm_features=torch.zeros(2 * n, 8),
        mm_token_indices=rows,
    )
    spans = image_spans(batch, n).tolist()
    assert spans[: len(a)] == [[0, 0]] * 2 + [[2, 2 + n]] * n + [[0, 0]] * 2
    assert spans[len(a) :] == [[10, 10 + n]] * n + [[0, 0]]
    assert image_spans(ForwardBatch.build([[7]], [[0]]), n) is None


def test_bidirectionality_matters(model):
    """The causal variant (``bidirectional_images=False``) is HF without ``token_type_ids``,
    and differs from HF's model: in the logits of every prompt, in the greedy tokens of at
    least one."""
    differ = []
    for name in sorted(PROMPTS):
        seq, ref = Seq(name), Seq(name)
        logits = serve(
            PagedVLM(model, pool(model), bidirectional_images=False), seq, [len(seq.ids)]
        )
        close(logits, hf_logits(model, seq, bidirectional=False))
        assert seq.tokens == hf_generate(model, seq, bidirectional=False)
        serve(PagedVLM(model, pool(model)), ref, [len(ref.ids)])
        gap = (logits[: len(seq.ids)] - hf_logits(model, seq)[: len(seq.ids)]).abs().max()
        assert gap > 0.05, f"{name}: the causal variant is within {gap:.2g} of HF"
        differ.append(seq.tokens != ref.tokens)
    assert any(differ)


def test_load_model_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded, _ = load_model(tmp_path, load_processor=False)
    assert type(loaded).__name__ == "Gemma3ForConditionalGeneration"
    seq = Seq("short")
    close(serve(PagedVLM(loaded, pool(loaded)), seq, [len(seq.ids)]), hf_logits(model, seq))


def test_a_window_shorter_than_an_image():
    """Window 3 < 4 image tokens: in the sliding layers an image token sees the later tokens of
    its image but not those 3 or more positions back (HF: ``window AND (causal OR image)``)."""
    small = tiny_gemma3_vlm(sliding_window=3)
    seq = Seq("long")
    logits = serve(PagedVLM(small, pool(small)), seq, [len(seq.ids)])
    close(logits, hf_logits(small, seq))
    assert seq.tokens == hf_generate(small, seq)


def test_a_decode_beside_an_image_prefill(model):
    """A step of one decode and one prompt with images: the split batch's prefill group gets
    its tokens' spans, the decode group none."""
    vlm = PagedVLM(model, pool(model))
    a, b = Seq("long", seed=1), Seq("longer", seed=2)
    a.tokens.append(int(prefill(vlm, [(a, 0, len(a.ids))])[-1].argmax()))
    step = ForwardBatch.build(
        [[a.tokens[-1]], b.ids],
        [a.grow(1), b.grow(len(b.ids))],
        mm_features=torch.cat(vlm.encode_images(b.pixels)),
        mm_token_indices=[1 + i for i, t in enumerate(b.ids) if t == IMAGE_TOKEN_ID],
        all_logits=True,
    )
    logits = vlm(step)
    a.tokens.append(0)  # hf_logits reads tokens[:-1]: a's first generated token
    close(logits[0], hf_logits(model, a)[-1])
    close(logits[1:], hf_logits(model, b))
