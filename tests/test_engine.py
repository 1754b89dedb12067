"""The engine against Hugging Face ``generate()``, on tiny config-built VLMs of every family.

The reference is always HF itself: ``model.generate(**processor(text, images))`` per request,
greedy, no padding, with ``output_logits``. Ours runs the same requests through the engine's
processor, scheduler, radix cache and paged decoder under many settings (batched or one by
one, cache on or off, chunked prefill, pages, policies, a pool so small that requests are
preempted), and must produce the same tokens and logits. Every test ends by checking that
the engine is idle and consistent: no lock held, every KV slot free or owned by the tree.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import (
    BOS_ID,
    IMAGE_SIZE,
    IMAGE_TOKEN_ID,
    VOCAB_SIZE,
    tiny_idefics3_processor,
    tiny_llava_processor,
    tiny_model,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from minirad.engine import (
    GenerateRequest,
    LLMEngine,
    SamplingParams,
    apply_top_k,
    apply_top_p,
    sample_one,
)
from minirad.errors import ImageError, InvalidArgumentError, RequestError
from minirad.events import EventRecorder, StepEvent
from minirad.kvcache.multimodal import pad_input_ids
from minirad.models import cascade_attention, paged_attention

ATOL = 1e-4
MAX_NEW = 8
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "models" / "minirad-tiny-llava"


def make_image(seed: int, size: int = IMAGE_SIZE) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


IMG_A, IMG_B, IMG_BIG = make_image(1), make_image(2), make_image(3, 2 * IMAGE_SIZE)

# (prompt, images). Same text + other image (1 vs 0); same image, longer text (3 vs 0);
# text only; two images (Idefics3 tiles the big one: 5 placeholder runs); a prompt that ends
# with its image, twice (the second is a full hit: its last token, recomputed, is a
# placeholder in LLaVA).
CASES = [
    ("<s> w10 w11 <image> w12 w13", [IMG_A]),
    ("<s> w10 w11 <image> w14", [IMG_B]),
    ("<s> w20 w21 w22 w23", []),
    ("<s> w10 w11 <image> w12 w13 w30 w31", [IMG_A]),
    ("<s> w40 <image> w41 <image> w42", [IMG_A, IMG_BIG]),
    ("<s> w50 w51 <image>", [IMG_B]),
    ("<s> w50 w51 <image>", [IMG_B]),
]


@pytest.fixture(scope="module")
def processor(family):
    return tiny_idefics3_processor() if family == "idefics3" else tiny_llava_processor()


@torch.no_grad()
def hf_generate(model, processor, text, images, max_new_tokens=MAX_NEW, **kw):
    """HF's greedy tokens ``list[int]`` and logits ``[n, vocab]`` for one request."""
    inputs = processor(text=text, images=images or None, return_tensors="pt").to(model.device)
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, torch.stack(out.logits)[:, 0]


@pytest.fixture(scope="module")
def references(model, processor):
    return [hf_generate(model, processor, text, images) for text, images in CASES]


def requests(cases=CASES, **params):
    sp = SamplingParams(max_new_tokens=MAX_NEW, **params)
    return [GenerateRequest(t, ims, sp, return_logits=True) for t, ims in cases]


def words(token_ids):
    """The tiny tokenizer's decoding: ``"w<id>"`` words, special tokens (ids < 4) skipped."""
    return " ".join(f"w{t}" for t in token_ids if t > IMAGE_TOKEN_ID)


def assert_idle(engine: LLMEngine):
    """No request left, no lock held, every slot free or owned by the tree."""
    engine.check_invariants()
    assert not engine.has_unfinished_requests()
    tree, alloc = engine.tree_cache, engine.allocator
    assert tree.protected_size() == 0
    assert alloc.available_size() + tree.total_size() == alloc.size


def assert_matches_hf(outputs, refs):
    for out, (tokens, logits) in zip(outputs, refs, strict=True):
        assert out.token_ids == tokens, out.rid
        assert out.finish_reason == "length"
        torch.testing.assert_close(out.logits, logits, atol=ATOL, rtol=0)


SETUPS = {
    "batched": {},
    "one-by-one": {},
    "no-cache": dict(prefix_strategy="none"),
    "truncate": dict(prefix_strategy="truncate"),
    "chunked": dict(max_num_batched_tokens=7),  # chunks end inside images
    "pages-lpm": dict(page_size=4, policy="lpm"),
    "preempt": dict(num_kv_slots=96, max_num_batched_tokens=24),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_tokens_and_logits_match_hf(model, processor, references, setup):
    engine = LLMEngine(model, processor, **SETUPS[setup])
    if setup == "one-by-one":
        outputs = [engine.generate([r])[0] for r in requests()]
    else:
        outputs = engine.generate(requests())
    assert_matches_hf(outputs, references)
    stats = engine.stats
    if setup == "preempt":
        assert stats.num_preemptions > 0
    else:
        assert stats.num_preemptions == 0
        for out in outputs:  # each prompt token was either reused or computed, once
            s = out.stats
            assert s.cached_tokens + s.prefill_tokens == s.prompt_tokens
            assert s.decode_tokens == MAX_NEW - 1
    if setup == "no-cache":
        assert stats.cached_tokens == 0 and engine.tree_cache.total_size() == 0
    elif setup == "truncate":  # reuse stops at the first image
        for out, req in zip(outputs, requests(), strict=True):
            segments = engine.input_processor.process(req.prompt, req.images).segments
            assert out.stats.cached_tokens <= (segments[0].offset if segments else 99)
    else:
        assert stats.cached_tokens > 0
    full_hit = outputs[6].stats  # the same prompt as case 5, which ran first
    if setup in ("batched", "one-by-one"):
        assert full_hit.cached_tokens == full_hit.prompt_tokens - 1  # the len - 1 rule
    elif setup == "pages-lpm":
        assert full_hit.cached_tokens == (full_hit.prompt_tokens - 1) // 4 * 4
    assert_idle(engine)


def test_prompt_ids_equal_the_processors(model, processor):
    """The engine preprocesses each image once and splices its expansion into the tokenized
    text; the ids must be exactly those of ``processor(text, images)`` (tiles, several images
    and repeated images included)."""
    proc = LLMEngine(model, processor).input_processor
    for text, images in [*CASES, ("<s> w60 <image> w61 <image>", [IMG_B, IMG_B])]:
        expected = processor(text=text, images=images or None, return_tensors="pt")
        processed = proc.process(text, images)
        assert processed.prompt_token_ids == expected["input_ids"][0].tolist()
        # Only the first image of a size goes through the whole processor; the pixels of the
        # others come from its image processor alone, and must be the same.
        for image, item in zip(images, processed.images, strict=True):
            alone = processor(text=proc.image_token, images=[image], return_tensors="pt")
            for name, tensor in item.pixel_inputs.items():
                assert torch.equal(tensor, alone[name]), name


def test_same_text_other_image_forks_at_the_first_image_token(model, processor):
    engine = LLMEngine(model, processor)
    a, b, _, c, *_ = requests()
    engine.generate([a])
    out_b, out_c = engine.generate([b]), engine.generate([c])
    proc = engine.input_processor
    key_a, key_b, key_c = (proc.process(r.prompt, r.images).key_ids for r in (a, b, c))
    first_image = proc.process(a.prompt, a.images).segments[0].offset
    processed = proc.process(CASES[4][0], CASES[4][1])  # two images
    ids = processed.prompt_token_ids
    if len(processed.segments) == 2:  # one run per image: exactly SGLang's pad_input_ids
        hashes = [im.mm_hash for im in processed.images]
        assert processed.key_ids == pad_input_ids(ids, IMAGE_TOKEN_ID, hashes, VOCAB_SIZE)
    else:  # Idefics3 tiles: one image, several runs, all with the image's pad id
        assert len({processed.key_ids[s.offset] for s in processed.segments}) == 2
    assert min(k for k, t in zip(processed.key_ids, ids, strict=True) if k != t) >= VOCAB_SIZE
    assert out_b[0].stats.cached_tokens == first_image  # nothing past the first image token
    image_end = max(s.offset + s.length for s in proc.process(a.prompt, a.images).segments)
    assert out_c[0].stats.cached_tokens > image_end  # the same image is shared
    tree = engine.tree_cache
    slots_a = tree.match_prefix(key_a).indices
    slots_b = tree.match_prefix(key_b).indices
    slots_c = tree.match_prefix(key_c).indices
    assert slots_a[:first_image] == slots_b[:first_image]
    assert not set(slots_a[first_image:]) & set(slots_b[first_image:])
    assert slots_c[: len(key_a)] == slots_a[: len(key_a)]
    # Features: the vision tower ran for image A and B once each; C reused A's KV, not even
    # its features.
    assert engine.stats.encoder_calls == 2
    assert_idle(engine)


def test_prefix_hit_inside_an_image_feeds_that_images_features(model, processor):
    """B shares A's text and image and diverges just after it; with pages of ``ps`` tokens
    the reused prefix is cut down to a page boundary inside the image, so B's prefill starts
    mid-image and needs the image's remaining feature rows (and not another image's)."""
    text_a, text_b = "<s> w10 w11 <image> w12 w13", "<s> w10 w11 <image> w60 w61"
    probe = LLMEngine(model, processor).input_processor
    ids_a = probe.process(text_a, [IMG_A]).prompt_token_ids
    ids_b = probe.process(text_b, [IMG_A]).prompt_token_ids
    diverge = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y)
    segs = probe.process(text_a, [IMG_A]).segments
    ps, hit = next(
        (ps, diverge // ps * ps)
        for ps in range(2, 17)
        if any(s.offset < diverge // ps * ps < s.offset + s.length for s in segs)
    )
    engine = LLMEngine(model, processor, page_size=ps)
    # Another image is in the same batch as B: its features must not leak into B's rows.
    engine.generate(requests([(text_a, [IMG_A])]))
    out_b, _ = engine.generate(requests([(text_b, [IMG_A]), ("<s> w10 w11 <image> w62", [IMG_B])]))
    assert out_b.stats.cached_tokens == hit
    assert engine.stats.encoder_hits >= 1  # A's features, from the encoder cache
    assert_matches_hf([out_b], [hf_generate(model, processor, text_b, [IMG_A])])
    assert_idle(engine)


def test_encoder_runs_once_per_distinct_image(model, processor):
    engine = LLMEngine(model, processor)
    cases = [("<s> w20 <image> w21", [IMG_A]), ("<s> w70 <image> w71", [IMG_A])]
    outs = [engine.generate([r])[0] for r in requests(cases)]
    assert outs[1].stats.cached_tokens == 1  # other text first: KV not reusable...
    assert engine.stats.encoder_calls == 1 and engine.stats.encoder_hits == 1  # ...features are
    assert_matches_hf(outs, [hf_generate(model, processor, t, ims) for t, ims in cases])
    assert_idle(engine)


def test_waiting_images_are_encoded_ahead_without_extra_runs(model, processor):
    """One request at a time: the step that encodes the first image also encodes the next
    waiting request's image, in the same call; the counts stay those of encoding on demand
    (one run per distinct image; the third request's reuse of A is the only hit)."""
    engine = LLMEngine(model, processor, max_num_seqs=1)
    cases = [("<s> w20 <image> w21", [IMG_A]), ("<s> w30 <image> w31", [IMG_B])]
    cases.append(("<s> w40 <image> w41", [IMG_A]))
    rids = [engine.add_request(r) for r in requests(cases)]
    engine.step()
    assert len(engine.encoder_cache) == 2  # A for the running request, B ahead for the next
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.rid, o) for o in engine.step() if o.finished)
    assert engine.stats.encoder_calls == 2 and engine.stats.encoder_hits == 1
    assert_matches_hf(
        [done[r] for r in rids], [hf_generate(model, processor, t, ims) for t, ims in cases]
    )
    assert_idle(engine)


def test_images_encoded_before_are_not_encoded_ahead(model, processor):
    """An image the engine encoded before may have its KV in the tree, so only its own
    request may ask for it: here the repeated prompt finds its image's KV and never does."""
    engine = LLMEngine(model, processor, max_num_seqs=1)
    first = ("<s> w20 <image> w21 w22", [IMG_A])
    engine.generate(requests([first]))
    engine.encoder_cache.clear()  # A's features are gone; its KV stays in the tree
    for r in requests([("<s> w30 <image> w31", [IMG_B]), first]):
        engine.add_request(r)
    engine.step()
    assert len(engine.encoder_cache) == 1  # B only
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.encoder_calls == 2  # A once, B once
    assert_idle(engine)


# ---------------------------------------------------------------------- one family suffices


@pytest.fixture(scope="module")
def llava():
    return tiny_model("llava-llama"), tiny_llava_processor()


@pytest.mark.parametrize("threshold", [None, 8])
def test_in_batch_prefix_sharing_lowers_prefill_tokens(llava, threshold):
    model, processor = llava
    cases = [(f"<s> w10 w11 <image> w12 w13 w14 w15 w{20 + i}", [IMG_A]) for i in range(4)]
    engine = LLMEngine(model, processor, in_batch_prefix_threshold=threshold)
    outs = engine.generate(requests(cases))
    prompt = outs[0].stats.prompt_tokens
    if threshold is None:  # all four computed the shared prefix
        assert engine.stats.prefill_tokens == 4 * prompt
    else:  # computed once; the others reused it one step later
        assert engine.stats.prefill_tokens == prompt + 3 * 1
        assert [o.stats.cached_tokens for o in outs] == [0] + [prompt - 1] * 3
    assert_matches_hf(outs, [hf_generate(model, processor, t, ims) for t, ims in cases])
    assert_idle(engine)


def test_step_events_describe_every_batch(llava, tmp_path):
    """Each step publishes one StepEvent; together they account for every computed token, and
    each request finishes exactly once (in the step whose output says so)."""
    engine = LLMEngine(*llava, max_num_batched_tokens=16, max_num_seqs=2)
    recorder = EventRecorder(engine.bus)
    outputs = engine.generate(requests(CASES[:4]))
    steps = [e for e in recorder.events if isinstance(e, StepEvent)]
    stats = engine.stats
    assert len(steps) == stats.num_steps
    assert all(len(e.rids) <= 2 and sum(e.num_tokens) <= 16 for e in steps)
    prefill = sum(n for e in steps for n, p in zip(e.num_tokens, e.is_prefill, strict=True) if p)
    assert prefill == stats.prefill_tokens
    assert sum(sum(e.num_tokens) for e in steps) == prefill + stats.decode_tokens
    finished = [rid for e in steps for rid in e.finished]
    assert sorted(finished) == sorted(o.rid for o in outputs)
    recorder.save(tmp_path / "steps.jsonl")
    assert EventRecorder.load(tmp_path / "steps.jsonl").events == recorder.events
    assert_idle(engine)


def test_stream_yields_each_token_and_matches_generate(llava):
    model, processor = llava
    engine = LLMEngine(model, processor)
    recorder = EventRecorder(engine.bus)
    (req,) = requests(CASES[:1])
    engine.add_request(
        GenerateRequest("<s> w80 w81", sampling_params=SamplingParams(max_new_tokens=4))
    )
    pieces = list(engine.stream(req))
    assert len(pieces) == MAX_NEW and pieces[-1].finished and not pieces[0].finished
    assert [t for p in pieces for t in p.new_token_ids] == pieces[-1].token_ids
    assert "".join(p.new_text for p in pieces) == pieces[-1].text
    assert pieces[-1].text == words(pieces[-1].token_ids)
    (full,) = engine.generate([req])
    assert full.token_ids == pieces[-1].token_ids
    while engine.has_unfinished_requests():  # the request added before stream() started
        engine.step()
    kinds = {e.kind for e in recorder.events}  # the tree and the pool share engine.bus
    assert {"match", "insert", "lock", "unlock", "alloc", "free", "split"} <= kinds

    it = engine.stream(req)
    next(it), next(it)
    it.close()  # a consumer that stops early aborts its request
    assert_idle(engine)


def test_stop_tokens_and_context_limit(llava):
    model, processor = llava
    text, images = CASES[0]
    ref, _ = hf_generate(model, processor, text, images)
    stop = ref[3]
    hf_stop, _ = hf_generate(model, processor, text, images, eos_token_id=stop)
    engine = LLMEngine(model, processor)
    (out,) = engine.generate(
        [GenerateRequest(text, images, SamplingParams(max_new_tokens=8, stop_token_ids=[stop]))]
    )
    assert out.token_ids == hf_stop == ref[: ref.index(stop) + 1]
    assert out.finish_reason == "stop"
    # vLLM's rule: the stop token's text is left out of the answer (vllm #2538), unless
    # include_stop_str_in_output; the ids keep it either way.
    assert out.text == words(out.token_ids[:-1]) and words([stop])
    (kept,) = engine.generate(
        [
            GenerateRequest(
                text,
                images,
                SamplingParams(
                    max_new_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True
                ),
            )
        ]
    )
    assert kept.token_ids == out.token_ids and kept.text == words(out.token_ids)
    assert_idle(engine)
    model.generation_config.eos_token_id = stop  # the default stop ids: the model's EOS
    try:
        eos_engine = LLMEngine(model, processor)
    finally:
        model.generation_config.eos_token_id = None
    (out,) = eos_engine.generate([GenerateRequest(text, images)])
    assert out.token_ids == hf_stop and out.finish_reason == "stop"
    assert_idle(eos_engine)

    prompt_len = len(out.prompt_token_ids)
    short = LLMEngine(model, processor, max_model_len=prompt_len + 3)
    (out,) = short.generate([GenerateRequest(text, images, SamplingParams(max_new_tokens=8))])
    assert out.token_ids == ref[:3] and out.finish_reason == "length"  # the context is full
    assert_idle(short)


def first_token_completing(stop: str, token_ids: list[int]) -> int:
    """How many of ``token_ids`` the text needs before it contains ``stop``."""
    return next(k for k in range(1, len(token_ids) + 1) if stop in words(token_ids[:k]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_end_the_request(llava, include):
    """vLLM's ``stop``: the step whose token completes the string ends the request ("stop"),
    that token kept; the text ends before the string (after it with
    ``include_stop_str_in_output``), and no streamed piece shows what comes after the cut."""
    model, processor = llava
    text, images = CASES[0]
    engine = LLMEngine(model, processor)
    (ref,) = engine.generate([GenerateRequest(text, images, SamplingParams(max_new_tokens=8))])
    # A string across the 3rd and 4th generated words ("...1 w4..."), so no single token
    # holds it; the earliest place it occurs in the text is where the request must stop.
    stop = f"{words(ref.token_ids[2:3])[-1]} {words(ref.token_ids[3:4])[:2]}"
    n = first_token_completing(stop, ref.token_ids)
    # One character wider, the same token completes it, earlier in the text: it wins.
    at = ref.text.index(stop) - 1
    wider = ref.text[at : at + 1 + len(stop)]
    cut = at + (len(wider) if include else 0)
    params = SamplingParams(
        max_new_tokens=8, stop=[stop, "never said", wider], include_stop_str_in_output=include
    )
    pieces = list(engine.stream(GenerateRequest(text, images, params)))
    last = pieces[-1]
    assert last.finished and last.finish_reason == "stop" and len(pieces) == n
    assert last.token_ids == ref.token_ids[:n]
    assert last.text == ref.text[:cut]
    assert "".join(p.new_text for p in pieces) == last.text
    for p in pieces[:-1]:  # held back: never a character past the cut, nor of the string
        assert ref.text[:at].startswith(p.text)
    assert_idle(engine)
    (again,) = engine.generate([GenerateRequest(text, images, params)])
    assert again.text == last.text and again.stats.cached_tokens > 0  # its KV was cached


def test_a_stop_string_on_the_last_allowed_token_still_says_stop(llava):
    model, processor = llava
    text, images = CASES[2]
    engine = LLMEngine(model, processor)
    (ref,) = engine.generate([GenerateRequest(text, images, SamplingParams(max_new_tokens=8))])
    stop = words(ref.token_ids[4:5])  # the 5th word, whole
    n = first_token_completing(stop, ref.token_ids)
    for max_new, reason in ((n, "stop"), (n - 1, "length")):
        params = SamplingParams(max_new_tokens=max_new, stop=stop)  # a str: one stop string
        (out,) = engine.generate([GenerateRequest(text, images, params)])
        assert out.finish_reason == reason and out.token_ids == ref.token_ids[:max_new]
        assert out.text == (
            ref.text[: ref.text.index(stop)] if reason == "stop" else words(ref.token_ids[:max_new])
        )
    (unseen,) = engine.generate(
        [GenerateRequest(text, images, SamplingParams(max_new_tokens=8, stop=["w10 w11"]))]
    )  # the prompt's words: only the output is searched
    assert unseen.text == ref.text and unseen.finish_reason == ref.finish_reason
    assert_idle(engine)


@pytest.mark.parametrize("stop", [[""], [1], "", ["a", None], {"a"}])
def test_bad_stop_strings_are_refused(stop):
    with pytest.raises(RequestError, match="stop must be"):
        SamplingParams(stop=stop)


def test_seeded_sampling_does_not_depend_on_the_batch(llava):
    model, processor = llava
    text, images = CASES[0]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_new_tokens=12)
    single = LLMEngine(model, processor)
    (alone,) = single.generate([GenerateRequest(text, images, params)])
    assert_idle(single)
    others = [
        GenerateRequest(t, ims, dataclasses.replace(params, seed=i))
        for i, (t, ims) in enumerate(CASES[1:4])
    ]
    engine = LLMEngine(model, processor, num_kv_slots=64, max_num_batched_tokens=9)
    batched = engine.generate([*others, GenerateRequest(text, images, params)])[-1]
    assert batched.token_ids == alone.token_ids
    other_seed = dataclasses.replace(params, seed=8)
    again = engine.generate([GenerateRequest(text, images, other_seed)])[0]
    assert again.token_ids != alone.token_ids
    top1 = SamplingParams(top_k=1, temperature=2.0, max_new_tokens=MAX_NEW)  # = greedy
    (greedy,) = engine.generate([GenerateRequest(text, images, top1)])
    assert greedy.token_ids == hf_generate(model, processor, text, images)[0]
    assert_idle(engine)


def test_top_k_top_p_agree_with_hf_warpers():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        for k in (1, 5, 49):
            ours = apply_top_k(logits, k)
            hf = TopKLogitsWarper(k)(None, logits[None])[0]
            assert torch.equal(ours.isinf(), hf.isinf())
        for p in (0.1, 0.5, 0.95):
            ours = apply_top_p(logits, p)
            hf = TopPLogitsWarper(p)(None, logits[None])[0]
            assert torch.equal(ours.isinf(), hf.isinf())


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_value_float32_holds_as_zero_samples_the_argmax(field):
    """1e-46 is 0 in float32: dividing the logits by it, or a nucleus of mass 0, gave NaN
    probabilities and killed the engine thread. Below vLLM's 1e-5 a temperature is greedy,
    and top-p keeps the most likely token whatever p is."""
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    params = SamplingParams(**{"temperature": 1.0, field: 1e-46})
    g = torch.Generator().manual_seed(0)
    assert [sample_one(logits, params, g) for _ in range(20)] == [1] * 20


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    params = SamplingParams(temperature=0.7, seed=0)
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(
        torch.tensor([sample_one(logits, params, g) for _ in range(n)]), minlength=5
    )
    expected = (logits / 0.7).softmax(-1)
    assert (counts / n - expected).abs().max() < 0.03


def test_bad_requests_raise_typed_errors_and_leave_the_engine_usable(llava, tmp_path):
    model, processor = llava
    engine = LLMEngine(model, processor, num_kv_slots=128)
    garbage = tmp_path / "broken.png"
    garbage.write_bytes(b"not a png at all")
    text, images = CASES[0]
    bad = [
        (ImageError, GenerateRequest(text, [tmp_path / "missing.png"])),
        (ImageError, GenerateRequest(text, [garbage])),
        (ImageError, GenerateRequest(text, [IMG_A, IMG_B])),  # more images than placeholders
        (ImageError, GenerateRequest(text, [])),  # fewer
        (ImageError, GenerateRequest([BOS_ID, 9, IMAGE_TOKEN_ID, 9], [IMG_A])),  # ids, 1 of 16
        (ImageError, GenerateRequest(text, [42])),
        (RequestError, GenerateRequest("")),
        (RequestError, GenerateRequest([])),
        (RequestError, GenerateRequest([BOS_ID, VOCAB_SIZE])),  # not a token
        (RequestError, GenerateRequest([BOS_ID] + [9] * 300)),  # longer than the context
        (
            RequestError,
            GenerateRequest([BOS_ID, 9], sampling_params=SamplingParams(max_new_tokens=150)),
        ),
        (RequestError, GenerateRequest(text, images, sampling_params={"max_new_tokens": 3})),
    ]
    for error, request in bad:
        with pytest.raises(error):
            engine.add_request(request)
        assert_idle(engine)
    with pytest.raises(RequestError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(RequestError):
        SamplingParams(top_p=0.0)
    for temperature in (float("inf"), float("nan"), True, -0.5):
        with pytest.raises(RequestError):
            SamplingParams(temperature=temperature)
    with pytest.raises(RequestError):  # one bad request: none of the batch is queued
        engine.generate([requests(CASES[:1])[0], GenerateRequest("")])
    assert_idle(engine)
    engine.add_request(GenerateRequest("<s> w9", rid="dup"))
    with pytest.raises(RequestError):
        engine.add_request(GenerateRequest("<s> w9", rid="dup"))
    with pytest.raises(InvalidArgumentError):
        LLMEngine(model, processor, num_kv_slot=12)  # a typo is not silently ignored
    outs = engine.generate(requests(CASES[:2]))  # still serves, still exact
    assert_matches_hf(outs, [hf_generate(model, processor, t, ims) for t, ims in CASES[:2]])
    assert engine.abort_request("dup").finish_reason == "abort"
    assert engine.abort_request("dup") is None
    assert_idle(engine)


def test_token_id_prompts_and_image_paths(llava, tmp_path):
    model, processor = llava
    path = tmp_path / "a.png"
    IMG_A.save(path)
    text, _ = CASES[0]
    ids = processor(text=text, images=[IMG_A])["input_ids"][0]
    engine = LLMEngine(model, processor)
    outs = engine.generate(
        [GenerateRequest(text, [IMG_A]), GenerateRequest(list(ids), [path], rid="by-ids")]
    )
    assert outs[1].rid == "by-ids" and outs[0].token_ids == outs[1].token_ids
    assert engine.stats.encoder_calls == 1  # a PNG round trip keeps the pixels: one hash
    assert_idle(engine)


def test_from_pretrained_loads_a_saved_model(llava, tmp_path):
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, page_size=2)
    outs = engine.generate(requests(CASES[:2]))
    assert_matches_hf(outs, [hf_generate(model, processor, t, ims) for t, ims in CASES[:2]])
    assert_idle(engine)


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="the shipped tiny LLaVA is not trained yet")
def test_shipped_model_matches_hf():
    """The course's trained model, with its chat template and EOS, on the shipped images."""
    engine = LLMEngine.from_pretrained(SHIPPED)
    model, processor = engine.vlm.model, engine.processor
    images = [Image.open(p).convert("RGB") for p in sorted(SHIPPED.parents[1].glob("images/*.png"))]
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in ("What shapes are in the picture?", "What color is the circle?")
    ]
    cases = [(t, [im]) for t in texts for im in images[:2]]
    params = SamplingParams(max_new_tokens=16)  # stops on the model's EOS, as HF does
    outs = engine.generate([GenerateRequest(t, ims, params) for t, ims in cases])
    for out, (t, ims) in zip(outs, cases, strict=True):
        assert out.token_ids == hf_generate(model, processor, t, ims, max_new_tokens=16)[0]
    assert engine.stats.encoder_calls == 2  # two images, each asked twice
    assert_idle(engine)


def test_preempted_request_does_not_count_its_own_kv_as_prefix_hits(llava):
    """Issue 11 point 1 (vLLM #25787): a readmitted request re-matches its own earlier KV,
    generated tokens included; that is recompute saved, not a prefix hit. Three 8-token prompts
    that share nothing, 24 new tokens each, in a pool of 48 slots: they must preempt, and the
    hit rate must stay 0 (it read "25 cached / 24 prompt tokens" before the fix)."""
    from minirad.entrypoints.cli import run_batch

    engine = LLMEngine(llava[0], None, num_kv_slots=48)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    prompts = [[4 + 8 * i + j for j in range(8)] for i in range(3)]
    outs, stats = run_batch(engine, [GenerateRequest(p, sampling_params=params) for p in prompts])
    assert stats.num_preemptions > 0
    assert [len(o.token_ids) for o in outs] == [24] * 3
    assert stats.prompt_tokens == 24
    assert stats.cached_tokens == 0 and stats.hit_rate == 0.0
    assert [o.stats.cached_tokens for o in outs] == [0, 0, 0]
    found_again = sum(o.stats.preempted_cached_tokens for o in outs)  # recompute saved
    assert found_again > 0 and engine.stats.preempted_cached_tokens == found_again
    assert_idle(engine)


class FailingDecode:
    """A tokenizer whose ``decode`` raises: detokenizing fails after the step's update."""

    def decode(self, token_ids, **kwargs):
        raise RuntimeError("injected detokenize fault")


def test_a_request_failing_after_its_step_finishes_once(llava, monkeypatch):
    """A request whose text fails to decode after its step ends with "error" and counts once in
    ``num_finished`` and in the step's events, whether or not the update had finished it already
    (one still running used to count twice: once when it failed, once among the finished)."""
    engine = LLMEngine(*llava)
    recorder = EventRecorder(engine.bus)
    (text_a, ims_a), (text_b, ims_b) = CASES[0], CASES[2]
    engine.add_request(GenerateRequest(text_a, ims_a, SamplingParams(max_new_tokens=8), "a"))
    engine.add_request(GenerateRequest(text_b, ims_b, SamplingParams(max_new_tokens=1), "b"))
    monkeypatch.setattr(engine, "tokenizer", FailingDecode())
    outs = engine.step()  # one step: a gets its first token, b its only one; both fail after
    monkeypatch.undo()
    assert sorted((o.rid, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert all(isinstance(o.error, RuntimeError) for o in outs)
    assert engine.stats.num_finished == 2
    (ok,) = engine.generate([GenerateRequest(text_a, ims_a, SamplingParams(max_new_tokens=8))])
    assert ok.finish_reason == "length" and engine.stats.num_finished == 3
    finished = [rid for e in recorder.events if isinstance(e, StepEvent) for rid in e.finished]
    assert sorted(finished) == sorted(["a", "b", ok.rid])
    assert_idle(engine)


def test_decodes_sharing_a_prefix_match_hf_through_cascade_attention(model, processor, monkeypatch):
    """Requests that reuse one cached prefix decode together through cascade attention (its
    threshold lowered: the tiny models' K/V rows are too small to reach it) and still give
    HF's tokens and logits."""
    monkeypatch.setattr(cascade_attention, "MIN_SAVED_BYTES", 1)
    prefixes = []  # every SharedPrefix attended through (a recording pass-through)
    cascade = paged_attention.cascade_decode
    monkeypatch.setattr(
        paged_attention,
        "cascade_decode",
        lambda q, k, v, prefix, scale: prefixes.append(prefix) or cascade(q, k, v, prefix, scale),
    )
    prompt = "<s> w10 w11 <image> w12 w13"
    cases = [(prompt + s, [IMG_A]) for s in ("", " w30", " w31 w32", " w33 w34 w35")]
    refs = [hf_generate(model, processor, text, images) for text, images in cases]
    engine = LLMEngine(model, processor)
    outputs = engine.generate(requests(cases[:1]))  # caches the prefix
    outputs += engine.generate(requests(cases[1:]))  # three decodes that share it
    assert_matches_hf(outputs, refs)
    assert prefixes and max(p.slots.shape[0] for p in prefixes) >= 5
    off = LLMEngine(model, processor, cascade_attention=False)
    prefixes.clear()
    off.generate(requests(cases[:1]))
    assert [o.token_ids for o in off.generate(requests(cases[1:]))] == [t for t, _ in refs[1:]]
    assert not prefixes
    assert_idle(engine)
