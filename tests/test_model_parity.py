"""Our paged decoder against Hugging Face, on tiny config-built VLMs of every supported family.

The reference is always HF itself: ``model(...)`` with its own cache for logits, and
``model.generate()`` for greedy tokens, one sequence at a time (no padding on the HF side).
Ours runs through the paged KV cache with slots from a shuffled free list, several sequences
per forward pass.
"""

import random

import pytest
import torch
from tiny_models import (
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    perturb_,
    pixel_inputs,
    prompt_ids,
    text_config,
    tiny_llava,
    tiny_llava_processor,
)
from transformers import LlavaConfig, MistralConfig, Qwen2ForCausalLM, Qwen2VLConfig

from minirad.errors import ImageError, InvalidArgumentError, UnsupportedModelError
from minirad.kvcache.kv_pool import KVCache
from minirad.kvcache.multimodal import placeholder_runs
from minirad.models import (
    ForwardBatch,
    PagedDecoder,
    PagedVLM,
    get_family,
    image_features_for_chunk,
    kv_cache_dims,
    load_model,
)

ATOL = 1e-4
DECODE_STEPS = 8


class Pool:
    """A KV pool plus a shuffled free list of blocks: sequences get scattered blocks."""

    def __init__(self, model, block_size=1, num_blocks=256, seed=0):
        dims = kv_cache_dims(model.config)
        self.kv = KVCache(num_blocks=num_blocks, block_size=block_size, **dims)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, slots: list[int], n: int) -> list[int]:
        """Append ``n`` slots to a sequence's slot list, taking a new block when one fills."""
        bs = self.kv.block_size
        for pos in range(len(slots), len(slots) + n):
            slots.append(self.free.pop() * bs if pos % bs == 0 else slots[-1] + 1)
        return slots


class Request:
    """One sequence: prompt ids, image inputs, and its slots in the pool."""

    def __init__(self, family, seed, num_images=1, text_before=3, text_after=4):
        self.ids = prompt_ids(family, text_before, text_after, num_images, seed=seed)
        self.pixels = pixel_inputs(family, num_images, seed=seed) if num_images else {}
        self.slots: list[int] = []
        self.tokens: list[int] = []  # generated

    def prefill_args(self, vlm, pool, start=0, end=None):
        """(token_ids, kv_slots, mm_features) for prefilling ``ids[start:end]`` after a prefix
        of ``start`` tokens whose slots are already in ``self.slots``."""
        end = len(self.ids) if end is None else end
        pool.grow(self.slots, end - start)
        feats = None
        if self.pixels:
            feats = image_features_for_chunk(
                self.ids, start, end, IMAGE_TOKEN_ID, vlm.encode_images(self.pixels)
            )
        return self.ids[start:end], list(self.slots), feats

    def decode_args(self, pool):
        pool.grow(self.slots, 1)
        return [self.tokens[-1]], list(self.slots), None


def image_rows(seqs) -> list[int]:
    """Rows of the flattened batch ``seqs`` (a list of token lists) that hold a placeholder."""
    flat = [t for seq in seqs for t in seq]
    return [i for i, t in enumerate(flat) if t == IMAGE_TOKEN_ID]


def step(vlm, args, all_logits=False):
    ids, slots, feats = zip(*args, strict=True)
    # Placeholders of sequences without features (decode steps) are text, as HF embeds them.
    padded = [seq if f is not None else [-1] * len(seq) for seq, f in zip(ids, feats, strict=True)]
    rows = image_rows(padded) if any(f is not None for f in feats) else None
    mm = [f for f in feats if f is not None]
    batch = ForwardBatch.build(
        ids,
        slots,
        mm_features=torch.cat(mm) if mm else None,
        mm_token_indices=rows,
        all_logits=all_logits,
    )
    return vlm(batch)


@torch.no_grad()
def hf_reference(model, req: Request, steps=DECODE_STEPS):
    """HF logits for the prompt ``[T, V]`` and a list of ``steps`` greedy decode steps' logits
    ``[V]`` (each step fed HF's own argmax), with HF's cache."""
    out = model(input_ids=torch.tensor([req.ids]), **req.pixels, use_cache=True)
    prefill, decode = out.logits[0], []
    tok = int(prefill[-1].argmax())
    for _ in range(steps):
        out = model(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True)
        decode.append(out.logits[0, -1])
        tok = int(decode[-1].argmax())
    return prefill, decode


def close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4])
def test_prefill_and_decode_match_hf(family, model, block_size):
    pool = Pool(model, block_size)
    vlm = PagedVLM(model, pool.kv)
    req = Request(family, seed=0)
    hf_prefill, hf_decode = hf_reference(model, req)
    assert hf_prefill.std() > 1.0  # the perturbed weights give logits worth comparing

    logits = step(vlm, [req.prefill_args(vlm, pool)], all_logits=True)
    close(logits, hf_prefill)
    req.tokens.append(int(logits[-1].argmax()))
    for i in range(DECODE_STEPS):
        logits = step(vlm, [req.decode_args(pool)])
        close(logits[0], hf_decode[i])
        req.tokens.append(int(hf_decode[i].argmax()))  # teacher-forced on HF's tokens


def test_varlen_batch_with_joining_sequence(family, model):
    """A (1 image) and B (2 images, other pixels) prefill together; A and B decode jointly;
    at decode step 3, C (text only) prefills in the same forward as A's and B's decodes."""
    pool = Pool(model, block_size=4)
    vlm = PagedVLM(model, pool.kv)
    a = Request(family, seed=1)
    b = Request(family, seed=2, num_images=2, text_before=6, text_after=1)
    c = Request(family, seed=3, num_images=0, text_before=9, text_after=0)
    refs = {id(r): hf_reference(model, r) for r in (a, b, c)}

    logits = step(vlm, [a.prefill_args(vlm, pool), b.prefill_args(vlm, pool)], all_logits=True)
    close(logits[: len(a.ids)], refs[id(a)][0])
    close(logits[len(a.ids) :], refs[id(b)][0])
    for r in (a, b):
        r.tokens.append(int(refs[id(r)][0][-1].argmax()))

    running, done = [a, b], {id(a): 0, id(b): 0}
    for i in range(DECODE_STEPS):
        args = [r.decode_args(pool) for r in running]
        joining = i == 3
        if joining:
            args.append(c.prefill_args(vlm, pool))
        logits = step(vlm, args)
        for r, row in zip(running, logits, strict=False):
            close(row, refs[id(r)][1][done[id(r)]])
            r.tokens.append(int(row.argmax()))
            done[id(r)] += 1
        if joining:
            close(logits[-1], refs[id(c)][0][-1])
            c.tokens.append(int(logits[-1].argmax()))
            running.append(c)
            done[id(c)] = 0


def test_chunked_prefill_splits_an_image(family, model):
    pool = Pool(model, block_size=4)
    vlm = PagedVLM(model, pool.kv)
    req = Request(family, seed=4)
    hf_prefill, hf_decode = hf_reference(model, req, steps=1)
    ((offset, length),) = placeholder_runs(req.ids, IMAGE_TOKEN_ID)
    cuts = [0, offset + length // 2, offset + length + 1, len(req.ids)]  # first cut mid-image
    for start, end in zip(cuts, cuts[1:], strict=False):
        logits = step(vlm, [req.prefill_args(vlm, pool, start, end)], all_logits=True)
        close(logits, hf_prefill[start:end])
    req.tokens.append(int(logits[-1].argmax()))
    close(step(vlm, [req.decode_args(pool)])[0], hf_decode[0])


@pytest.mark.parametrize("where", ["mid-image", "after-image"])
def test_prefill_reusing_a_cached_prefix(family, model, where):
    """B shares A's prompt up to its first text token after the image; B's prefill reuses
    A's KV slots for a prefix that ends inside the image or after it (a radix-tree hit)."""
    pool = Pool(model, block_size=1)
    vlm = PagedVLM(model, pool.kv)
    a = Request(family, seed=5)
    step(vlm, [a.prefill_args(vlm, pool)])
    ((offset, length),) = placeholder_runs(a.ids, IMAGE_TOKEN_ID)
    b = Request(family, seed=5)
    rng = random.Random(6)
    b.ids = a.ids[: offset + length + 1] + [rng.randrange(4, VOCAB_SIZE) for _ in range(5)]
    assert b.ids != a.ids
    hit = offset + length // 2 if where == "mid-image" else offset + length + 1
    b.slots = a.slots[:hit]  # shared: these K/V were written by A's prefill

    logits = step(vlm, [b.prefill_args(vlm, pool, start=hit)], all_logits=True)
    hf_prefill, _ = hf_reference(model, b, steps=0)
    close(logits, hf_prefill[hit:])


def test_greedy_tokens_equal_hf_generate(family, model):
    pool = Pool(model, block_size=4)
    vlm = PagedVLM(model, pool.kv)
    reqs = [Request(family, seed=7), Request(family, seed=8, num_images=2, text_before=1)]
    logits = step(vlm, [r.prefill_args(vlm, pool) for r in reqs])
    for _ in range(DECODE_STEPS):
        for r, row in zip(reqs, logits, strict=True):
            r.tokens.append(int(row.argmax()))
        logits = step(vlm, [r.decode_args(pool) for r in reqs])
    for r in reqs:
        ids = torch.tensor([r.ids])
        out = model.generate(
            input_ids=ids, **r.pixels, max_new_tokens=DECODE_STEPS, do_sample=False
        )
        assert r.tokens == out[0, ids.shape[1] :].tolist()
        assert len(set(r.tokens)) > 2  # not a degenerate repeat


def test_image_placeholders_must_match_features(family, model):
    vlm = PagedVLM(model, Pool(model).kv)
    req = Request(family, seed=0)
    feats = vlm.encode_images(req.pixels)
    with pytest.raises(ImageError):
        ForwardBatch.build(
            [req.ids],
            [list(range(len(req.ids)))],
            mm_features=torch.cat(feats)[:-1],
            mm_token_indices=image_rows([req.ids]),
        )
    with pytest.raises(ImageError):
        image_features_for_chunk(req.ids[1:], 0, 5, IMAGE_TOKEN_ID, feats + feats)
    with pytest.raises(InvalidArgumentError):
        ForwardBatch.build([req.ids], [[0]])  # context shorter than the new tokens


def test_yarn_rope_uses_hf_frequencies_and_scaling():
    """YaRN changes inv_freq and scales cos/sin (attention_scaling != 1): both come from HF."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = tiny_llava("llama", rope_parameters=rope)
    assert model.model.language_model.rotary_emb.attention_scaling != 1.0
    req = Request("llava-llama", seed=9)
    pool = Pool(model, block_size=4)
    vlm = PagedVLM(model, pool.kv)
    close(step(vlm, [req.prefill_args(vlm, pool)], all_logits=True), hf_reference(model, req, 0)[0])


def test_decoder_alone_runs_a_text_only_causal_lm():
    """PagedDecoder needs no VLM: a Qwen2ForCausalLM's ``model`` and ``lm_head`` suffice."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(text_config("qwen2")).eval()
    perturb_(model)
    pool = Pool(model, block_size=4)
    decoder = PagedDecoder(model.model, model.lm_head, pool.kv)
    prompts = [[1, 7, 9, 30, 41], [1, 50, 60]]
    batch = ForwardBatch.build(prompts, [pool.grow([], len(p)) for p in prompts], all_logits=True)
    logits = decoder(batch)
    with torch.no_grad():
        expected = torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p in prompts])
    close(logits, expected)


def test_kv_cache_must_fit_the_model():
    model = tiny_llava("qwen2")
    wrong = KVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=4, head_dim=16)
    with pytest.raises(InvalidArgumentError):
        PagedDecoder(model.model.language_model, model.lm_head, wrong)


def test_unsupported_architectures_raise_typed_errors():
    with pytest.raises(UnsupportedModelError, match="LlavaForConditionalGeneration") as e:
        get_family(Qwen2VLConfig())
    assert "Idefics3ForConditionalGeneration" in str(e.value)
    with pytest.raises(UnsupportedModelError, match="llama, qwen2"):
        get_family(LlavaConfig(text_config=MistralConfig(num_hidden_layers=1)))
    with pytest.raises(UnsupportedModelError, match="sliding"):
        get_family(LlavaConfig(text_config=text_config("qwen2", use_sliding_window=True)))
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        get_family(LlavaConfig(text_config=text_config("llama", rope_parameters=dynamic)))


def test_load_model_round_trip(tmp_path):
    model, processor = tiny_llava("qwen2"), tiny_llava_processor()
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()

    loaded, loaded_proc = load_model(tmp_path)
    assert get_family(loaded.config).model_type == "llava" and not loaded.training
    inputs = loaded_proc(
        images=torch.rand(3, 40, 40), text="<s> w5 <image> w7 w8", return_tensors="pt"
    )
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE_TOKEN_ID) == 16
    pool = Pool(loaded, block_size=4)
    vlm = PagedVLM(loaded, pool.kv)
    feats = vlm.encode_images(inputs)
    batch = ForwardBatch.build(
        [ids],
        [pool.grow([], len(ids))],
        mm_features=torch.cat(feats),
        mm_token_indices=image_rows([ids]),
        all_logits=True,
    )
    with torch.no_grad():
        close(vlm(batch), model(**inputs).logits[0])


def test_load_model_refuses_unsupported_and_missing(tmp_path):
    with pytest.raises(InvalidArgumentError):
        load_model(tmp_path / "missing")
    Qwen2VLConfig().save_pretrained(tmp_path)  # config only: rejected before any weight
    with pytest.raises(UnsupportedModelError):
        load_model(tmp_path)
