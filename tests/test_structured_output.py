"""Structured output through the engine, with the shipped tiny LLaVA (issue 13, points 1-3).

Every request goes through the chat template with one of the shipped images. Nothing here
depends on the model's answers being right: outputs must be valid (JSON against the schema, a
full regex match, one of the choices), and each setting must give the tokens of a reference
run of the same engine code: alone vs in a mixed batch, chunked prefill, a second request that
hits the radix cache, a pool so small that requests are preempted. Parity: the same greedy
constrained tokens as Hugging Face ``generate()`` with :class:`GrammarLogitsProcessor`.
Every engine run checks ``engine.check_invariants()`` after every step.
"""

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from PIL import Image

from minirad.course.scenes import COLOURS, JSON_PROMPT, SHAPES, SHAPES_JSON_SCHEMA
from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.engine.grammar import GrammarCompiler, GrammarLogitsProcessor, allocate_token_bitmask
from minirad.errors import GrammarError
from minirad.events import EventRecorder, JumpForwardEvent, StepEvent
from minirad.models import load_model

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "data" / "models" / "minirad-tiny-llava"
IMAGES = sorted((ROOT / "data" / "images").glob("*.png"))
JSON_PARAMS = SamplingParams(max_new_tokens=120, json_schema=SHAPES_JSON_SCHEMA)
# Forced text ("colour: ", "; shape: ") between free choices, as in a schema.
REGEX = f"colour: ({'|'.join(COLOURS)}); shape: ({'|'.join(SHAPES)})"
REGEX_PARAMS = SamplingParams(max_new_tokens=30, regex=REGEX)
CHOICE_PARAMS = SamplingParams(max_new_tokens=10, choice=list(COLOURS))


@pytest.fixture(scope="module")
def vlm():
    return load_model(MODEL_DIR)


def chat(processor, question: str) -> str:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def cases(vlm):
    """(name, GenerateRequest): JSON for three scenes, a regex, a choice, and an unconstrained
    caption, all on shipped images."""
    processor = vlm[1]
    out = [
        (f"json-{p.stem}", GenerateRequest(chat(processor, JSON_PROMPT), [p], JSON_PARAMS))
        for p in IMAGES[:3]
    ]
    out += [
        (
            "regex",
            GenerateRequest(chat(processor, "Describe the image."), [IMAGES[3]], REGEX_PARAMS),
        ),
        (
            "choice",
            GenerateRequest(
                chat(processor, "What colour is the circle?"), [IMAGES[4]], CHOICE_PARAMS
            ),
        ),
        (
            "free",
            GenerateRequest(
                chat(processor, "Describe the image."),
                [IMAGES[0]],
                SamplingParams(max_new_tokens=16),
            ),
        ),
    ]
    return out


def make_engine(vlm, **config) -> LLMEngine:
    return LLMEngine(*vlm, **config)


def run(engine: LLMEngine, requests, after_step=None):
    """Outputs of ``requests`` run together, in order; checks invariants after every step."""
    rids = [engine.add_request(r) for r in requests]
    done = {}
    engine.check_invariants()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.rid] = out
        engine.check_invariants()
        if after_step is not None:
            after_step(engine)
    return [done[rid] for rid in rids]


def run_alone(engine: LLMEngine, requests):
    """Each request on its own, from an empty radix cache."""
    outs = []
    for r in requests:
        engine.reset_prefix_cache()
        outs += run(engine, [r])
    return outs


@pytest.fixture(scope="module")
def engine(vlm):
    return make_engine(vlm)  # jump-forward on (the default)


@pytest.fixture(scope="module")
def engine_nojf(vlm):
    return make_engine(vlm, jump_forward=False)


@pytest.fixture(scope="module")
def alone(engine, cases):
    return run_alone(engine, [r for _, r in cases])


@pytest.fixture(scope="module")
def alone_nojf(engine_nojf, cases):
    return run_alone(engine_nojf, [r for _, r in cases])


def check_valid(name: str, out, tokenizer) -> None:
    """The output is a member of its request's language and ended on the stop token."""
    kind = name.split("-")[0]
    assert out.finish_reason == "stop", (name, out.text)
    assert out.token_ids[-1] == 2  # <|im_end|>, which the mask forced once the text was complete
    body = tokenizer.decode(out.token_ids[:-1])
    assert body == out.text
    if kind == "json":
        jsonschema.validate(json.loads(out.text), SHAPES_JSON_SCHEMA)
        assert out.text == json.dumps(json.loads(out.text))  # compact, as json.dumps writes it
    elif kind == "regex":
        assert re.fullmatch(REGEX, out.text), out.text
    elif kind == "choice":
        assert out.text in COLOURS


def grammar_state_matches_its_outputs(compiler: GrammarCompiler):
    """An ``after_step`` check: every unfinished constrained request's grammar is where a fresh
    grammar fed its ``output_ids`` is (same count, same bitmask), whatever happened to its KV."""

    def check(engine: LLMEngine) -> None:
        for r in engine.scheduler.requests.values():
            if r.grammar is None:
                continue
            p = r.sampling_params
            stop = engine.eos_token_ids if p.stop_token_ids is None else p.stop_token_ids
            fresh = compiler.compile(p, stop)
            fresh.accept_tokens(r.output_ids)
            assert r.grammar.num_accepted == len(r.output_ids), r
            masks = allocate_token_bitmask(2, engine.vocab_size)
            fresh.fill_bitmask(masks, 0)
            r.grammar.fill_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]), r

    return check


# ------------------------------------------------------------------ validity
def test_constrained_outputs_are_valid_and_stop(cases, alone, alone_nojf, engine):
    for outs in (alone, alone_nojf):
        for (name, _), out in zip(cases, outs, strict=True):
            if name != "free":
                check_valid(name, out, engine.tokenizer)


def test_bad_constraints_fail_at_add_request_and_queue_nothing(engine, cases):
    prompt, images = cases[0][1].prompt, cases[0][1].images
    bad = [
        SamplingParams(regex="a(b"),
        SamplingParams(json_schema={"type": "integer", "minimum": 5, "maximum": 1}),
    ]
    for params, words in zip(bad, ["unclosed group", "minimum"], strict=True):
        with pytest.raises(GrammarError, match=words):
            engine.add_request(GenerateRequest(prompt, images, params))
        assert not engine.has_unfinished_requests()
    engine.check_invariants()
    # An engine without a processor serves token-id prompts but cannot compile a grammar.
    bare = LLMEngine(engine.vlm.model, None, num_kv_slots=256)
    with pytest.raises(GrammarError, match="tokenizer"):
        bare.add_request(GenerateRequest([1, 432, 202], sampling_params=REGEX_PARAMS))
    assert not bare.has_unfinished_requests()


@pytest.mark.parametrize("jump_forward", [True, False])
def test_sampled_constrained_outputs_are_valid(vlm, cases, jump_forward):
    """Temperature sampling explores other paths through the grammars (other values, other
    splits of the forced text): every output is still valid."""
    eng = make_engine(vlm, jump_forward=jump_forward)
    requests = []
    for name, r in cases:
        if name == "free":
            continue
        for seed in (1, 2):
            kw = {k: getattr(r.sampling_params, k) for k in ("json_schema", "regex", "choice")}
            params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=256, **kw)
            requests.append((name, GenerateRequest(r.prompt, r.images, params)))
    outs = run(eng, [r for _, r in requests])
    for (name, _), out in zip(requests, outs, strict=True):
        check_valid(name, out, eng.tokenizer)


# ------------------------------------------------------------------ batching and the cache
def test_a_mixed_batch_gives_each_request_its_tokens_alone(
    engine, engine_nojf, cases, alone, alone_nojf
):
    requests = [r for _, r in cases]
    for eng, ref in ((engine, alone), (engine_nojf, alone_nojf)):
        eng.reset_prefix_cache()
        outs = run(eng, requests)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_chunked_prefill_gives_the_same_tokens(vlm, cases, alone):
    """16 tokens per step: prompts and forced runs are split across steps."""
    eng = make_engine(vlm, max_num_batched_tokens=16)
    outs = run(eng, [r for _, r in cases])
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert eng.stats.forced_tokens == sum(o.stats.forced_tokens for o in outs) > 0


@pytest.mark.parametrize("jump_forward", [True, False])
def test_the_same_constrained_request_twice_hits_the_cache(vlm, cases, jump_forward):
    eng = make_engine(vlm, jump_forward=jump_forward)
    request = cases[0][1]
    first, second = run(eng, [request]), run(eng, [request])
    assert second[0].token_ids == first[0].token_ids
    assert first[0].stats.cached_tokens == 0 < second[0].stats.cached_tokens
    # In one batch: the second waits for the prefix the first computes (in-batch sharing).
    eng.reset_prefix_cache()
    pair = run(eng, [request, request])
    assert [o.token_ids for o in pair] == [first[0].token_ids] * 2
    assert pair[0].stats.cached_tokens == 0 < pair[1].stats.cached_tokens
    for out in (first[0], second[0], *pair):
        s = out.stats  # every token but the last sampled one: cached or computed, once
        computed = s.prefill_tokens + s.decode_tokens
        assert s.cached_tokens + s.cached_forced_tokens + computed == (
            s.prompt_tokens + len(out.token_ids) - 1
        )


def test_cached_tokens_never_exceed_the_prompt_with_jump_forward(vlm, cases):
    """RequestStats.cached_tokens is documented as prompt tokens found in the tree (vLLM's
    num_cached_tokens, < prompt_tokens); jump-forward appends the first forced run before
    admission, so the second request's match reaches into its outputs, which must not count."""
    eng = make_engine(vlm)
    request = cases[0][1]
    run(eng, [request])
    second = run(eng, [request])[0]
    assert second.stats.cached_tokens <= second.stats.prompt_tokens
    assert second.stats.cached_forced_tokens > 0  # the first forced run, found in the tree


@pytest.mark.parametrize("jump_forward", [True, False])
def test_preemption_keeps_outputs_and_grammar_state(vlm, cases, alone, alone_nojf, jump_forward):
    """Four JSON requests (~170 tokens each) in a pool of 320 slots: the newest are preempted,
    keep their output ids (and so their grammar state) and recompute their KV when readmitted.
    After every step each grammar must equal a fresh one fed the request's outputs."""
    ref = alone if jump_forward else alone_nojf
    names = [n for n, _ in cases]
    jsons = [(r, ref[names.index(n)]) for n, r in cases if n.startswith("json")]
    extra = GenerateRequest(chat(vlm[1], JSON_PROMPT), [IMAGES[5]], JSON_PARAMS)
    eng = make_engine(vlm, num_kv_slots=320, jump_forward=jump_forward)
    expected = [o.token_ids for _, o in jsons] + [run_alone(eng, [extra])[0].token_ids]
    eng.reset_prefix_cache()
    preempted_with_outputs = []
    check_grammar = grammar_state_matches_its_outputs(
        GrammarCompiler(eng.tokenizer, eng.vocab_size)
    )

    def after_step(e: LLMEngine) -> None:
        check_grammar(e)
        preempted_with_outputs.extend(
            r.rid for r in e.scheduler.waiting if r.stats.num_preemptions and r.output_ids
        )

    n0 = eng.stats.num_preemptions
    outs = run(eng, [r for r, _ in jsons] + [extra], after_step)
    assert eng.stats.num_preemptions > n0
    assert preempted_with_outputs  # the grammar path was exercised, not just the prompt's
    assert [o.token_ids for o in outs] == expected
    for (name, _), out in zip(
        [c for c in cases if c[0].startswith("json")] + [("json", None)], outs, strict=True
    ):
        check_valid(name, out, eng.tokenizer)


# ------------------------------------------------------------------ stopping
@pytest.mark.parametrize("jump_forward", [True, False])
def test_too_few_tokens_finish_by_length_with_invalid_json(vlm, cases, alone_nojf, jump_forward):
    eng = make_engine(vlm, jump_forward=jump_forward)
    request = cases[0][1]
    params = SamplingParams(max_new_tokens=10, json_schema=SHAPES_JSON_SCHEMA)
    out = run(eng, [GenerateRequest(request.prompt, request.images, params)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    if not jump_forward:  # greedy, token by token: the first 10 tokens of the full answer
        assert out.token_ids == alone_nojf[0].token_ids[:10]
    else:  # the first run stopped one short of the limit: the last token was sampled
        g = eng.grammar_compiler.compile(params, eng.eos_token_ids)
        assert out.stats.forced_tokens == min(len(g.jump_forward_tokens()), 9) > 0
        assert out.token_ids[:9] == g.jump_forward_tokens()[:9]


@pytest.mark.parametrize("jump_forward", [True, False])
def test_without_stop_tokens_the_grammar_ends_the_request(vlm, cases, alone_nojf, jump_forward):
    """``stop_token_ids=()``: the request finishes on the token that completes the grammar,
    with no end-of-sequence token after it, far from the length limit. Token by token (no
    jump-forward) the tokens are those of the run with a stop token, minus the stop token."""
    eng = make_engine(vlm, jump_forward=jump_forward)
    names = [n for n, _ in cases]
    extra = [
        (
            "choice-whole",
            GenerateRequest(
                cases[4][1].prompt, cases[4][1].images, SamplingParams(choice=["red circle"])
            ),
        )
    ]
    for name, request in [c for c in cases if c[0] != "free"] + extra:
        params = SamplingParams(
            max_new_tokens=request.sampling_params.max_new_tokens,
            stop_token_ids=(),
            **{k: getattr(request.sampling_params, k) for k in ("json_schema", "regex", "choice")},
        )
        out = run(eng, [GenerateRequest(request.prompt, request.images, params)])[0]
        assert out.finish_reason == "stop", name
        assert len(out.token_ids) < params.max_new_tokens, name
        assert not set(out.token_ids) & set(eng.tokenizer.all_special_ids), (name, out.token_ids)
        assert eng.tokenizer.decode(out.token_ids) == out.text
        if name in names:
            ref = alone_nojf[names.index(name)]
            if not jump_forward:
                assert out.token_ids == ref.token_ids[:-1], name
            assert out.text == ref.text, name
        else:
            assert out.text == "red circle"


# ------------------------------------------------------------------ jump-forward
def test_jump_forward_gives_the_same_text_in_fewer_steps(engine, engine_nojf, vlm):
    """JSON for every shipped scene, in one batch, with and without jump-forward."""
    requests = [GenerateRequest(chat(vlm[1], JSON_PROMPT), [p], JSON_PARAMS) for p in IMAGES]
    results = {}
    for eng in (engine, engine_nojf):
        eng.reset_prefix_cache()
        s0 = eng.stats
        outs = run(eng, requests)
        results[eng.config.jump_forward] = (outs, eng.stats.num_steps - s0.num_steps)
    (on, steps_on), (off, steps_off) = results[True], results[False]
    for p, a, b in zip(IMAGES, on, off, strict=True):
        assert a.text == b.text, p.name
        check_valid("json", a, engine.tokenizer)
    assert sum(o.stats.forced_tokens for o in off) == 0
    assert sum(o.stats.forced_tokens for o in on) > 0
    assert steps_on < steps_off
    # Without jump-forward a request takes one step per token (plus its prompt's): the batch
    # takes as many steps as its longest answer.
    assert steps_off == max(len(o.token_ids) for o in off)


def test_forced_tokens_agree_with_the_events_and_the_grammar(engine, cases, vlm):
    """engine.stats.forced_tokens, each RequestOutput.stats.forced_tokens and the
    JumpForwardEvents on the bus count the same tokens, and each event's tokens are the run
    that a fresh grammar, fed the request's outputs before it, forces there."""
    requests = [r for _, r in cases]
    engine.reset_prefix_cache()
    recorder = EventRecorder(engine.bus)
    f0 = engine.stats.forced_tokens
    try:
        outs = run(engine, requests)
    finally:
        recorder.close()
    events = [e for e in recorder.events if isinstance(e, JumpForwardEvent)]
    assert engine.stats.forced_tokens - f0 == sum(e.num_tokens for e in events)
    assert sum(o.stats.forced_tokens for o in outs) == sum(e.num_tokens for e in events) > 0
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    for o, (_, request) in zip(outs, cases, strict=True):
        mine = [e for e in events if e.rid == o.rid]
        assert sum(e.num_tokens for e in mine) == o.stats.forced_tokens
        if request.sampling_params.structured_output_kind is None:
            assert not mine
            continue
        for e in mine:
            done = e.start - len(o.prompt_token_ids)  # outputs before the run
            g = compiler.compile(request.sampling_params, engine.eos_token_ids)
            g.accept_tokens(o.token_ids[:done])
            assert (
                g.jump_forward_tokens()[: e.num_tokens] == o.token_ids[done : done + e.num_tokens]
            )
    # Each run is computed whole in one step, as a prefill chunk (no token budget here): the
    # step that computes the run's first position computes all of it.
    steps = [e for e in recorder.events if isinstance(e, StepEvent)]
    for e in events:
        chunk = next(
            (start, n, prefill)
            for s in steps
            for rid, start, n, prefill in zip(
                s.rids, s.starts, s.num_tokens, s.is_prefill, strict=True
            )
            if rid == e.rid and start <= e.start < start + n
        )
        assert chunk[2] and chunk[0] + chunk[1] == e.start + e.num_tokens, (e, chunk)


# ------------------------------------------------------------------ parity with HF
@torch.no_grad()
def hf_constrained(vlm, request: GenerateRequest, stop=(2,)) -> list[int]:
    """HF ``generate`` greedy with the same grammar as a logits processor: its new tokens."""
    model, processor = vlm
    images = [Image.open(p).convert("RGB") for p in request.images]
    inputs = processor(text=request.prompt, images=images, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    params = request.sampling_params
    grammar = GrammarCompiler(processor.tokenizer, model.config.text_config.vocab_size).compile(
        params, stop
    )
    out = model.generate(
        **inputs,
        max_new_tokens=params.max_new_tokens,
        do_sample=False,
        logits_processor=[GrammarLogitsProcessor([grammar], prompt_len)],
    )
    return out[0, prompt_len:].tolist()


def without_stop(token_ids, stop=(2,)) -> list[int]:
    return [t for t in token_ids if t not in stop]


def test_constrained_greedy_equals_hf_token_for_token(vlm, cases, alone_nojf):
    """Without jump-forward, every constrained token is our sampler's argmax of the same
    masked logits as HF's: the same ids (stop tokens aside) for JSON, regex and choice."""
    for (name, request), ours in zip(cases, alone_nojf, strict=True):
        if name == "free":
            continue
        hf = hf_constrained(vlm, request)
        assert without_stop(ours.token_ids) == without_stop(hf), name
        assert hf[-1] == 2  # HF stopped on the stop token the mask forced


def test_jump_forward_text_equals_hf(vlm, cases, alone):
    """With jump-forward the text must equal HF's where every forced run is the tokenization
    the model picks token by token, or where nothing free follows a run (a choice with one
    member). Elsewhere it may differ (:meth:`Grammar.jump_forward_tokens`): the run is the
    canonical tokenization of the forced text, the model might have spelled it with other
    tokens, and its next free choice sees other tokens. The token ids may differ in either
    case. On these requests the text is equal (measured; a difference is a finding to report
    with its request)."""
    tokenizer = vlm[1].tokenizer
    for (name, request), ours in zip(cases, alone, strict=True):
        if name == "free":
            continue
        hf = hf_constrained(vlm, request)
        assert ours.text == tokenizer.decode(hf, skip_special_tokens=True), name


def test_a_broken_grammar_aborts_its_request_not_the_engine(vlm, cases):
    """A matcher that enters an error state mid-generation (here: fed a token it forbids, through
    the public accept_token) ends its own request with finish reason "error" (vLLM's
    FINISHED_ERROR) and the grammar's error; the engine keeps its invariants and serves the
    next request as if nothing happened."""
    eng = make_engine(vlm)
    name, request = cases[0]
    expected = run(eng, [request])[0].token_ids
    eng.reset_prefix_cache()
    rid = eng.add_request(request)
    eng.step()
    grammar = eng.scheduler.requests[rid].grammar
    with pytest.raises(GrammarError):
        grammar.accept_token(1)  # <|im_start|>: never allowed in the answer
    outs = [o for o in eng.step() if o.rid == rid]
    assert [o.finish_reason for o in outs] == ["error"]
    assert isinstance(outs[0].error, GrammarError)
    assert not eng.has_unfinished_requests()
    eng.check_invariants()
    assert run(eng, [request])[0].token_ids == expected


@pytest.mark.parametrize("stop", ['"colour"', '"shape"'])
def test_a_stop_string_a_forced_run_completes_ends_ids_text_and_usage_there(
    engine, engine_nojf, vlm, stop
):
    """A stop string inside a forced run (the first one, before any sampling: '"colour"'; one
    after a sampled colour: '"shape"') ends the token ids where it ends the text, as without
    jump-forward (vllm PR #47616: the ids and usage used to run past it)."""
    params = dataclasses.replace(JSON_PARAMS, stop=[stop])
    request = GenerateRequest(chat(vlm[1], JSON_PROMPT), [IMAGES[0]], params)
    (jumped,) = run(engine, [request])
    (stepped,) = run(engine_nojf, [request])
    assert jumped.finish_reason == stepped.finish_reason == "stop"
    assert jumped.token_ids == stepped.token_ids and jumped.text == stepped.text
    decode = vlm[1].tokenizer.decode
    assert stop in decode(jumped.token_ids) and stop not in decode(jumped.token_ids[:-1])
    assert jumped.stats.forced_tokens < len(jumped.token_ids)
