"""Why each request of our engine missed (issue 33, minirad/engine/explain.py): scripted
workloads whose causes are known by construction, each engine cause at least once, on the tiny
llava-llama (token-id prompts, ids < vocab 96). Every request's runs must cover its prompt
exactly, and its served tokens (hit + host + storage) equal ``stats.cached_tokens``."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_model

from minirad.engine import GenerateRequest, LLMEngine, SamplingParams
from minirad.engine.explain import ENGINE_CAUSES, check_runs
from minirad.events import StepEvent

ONE = SamplingParams(max_new_tokens=1, stop_token_ids=())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llava-llama")


def ids(start: int, n: int) -> list[int]:
    """``n`` distinct-looking token ids < 96 (a stride walk, so prompts share nothing)."""
    return [4 + (start + 7 * i) % 90 for i in range(n)]


def spans(out) -> list[tuple[int, int, str]]:
    return [(r.start, r.end, r.cause) for r in out.miss_causes]


def checked(outs):
    """``outs``, each one's runs checked (cover the prompt; served == cached_tokens)."""
    for out in outs:
        assert out.miss_causes is not None, out.rid
        check_runs(out.miss_causes, out.stats)
    return outs


def one(engine: LLMEngine, prompt: list[int], rid: str, params: SamplingParams = ONE):
    (out,) = checked(engine.generate([GenerateRequest(prompt, sampling_params=params, rid=rid)]))
    return out


def test_the_default_engine_explains_nothing_and_listens_to_nothing(model):
    engine = LLMEngine(model, None, num_kv_slots=64)
    (out,) = engine.generate([GenerateRequest(ids(0, 12), sampling_params=ONE)])
    assert out.miss_causes is None and out.stats.miss_causes is None
    assert engine.explainer is None and engine.scheduler.observers == ()
    assert not engine.bus.active  # no subscriber: events are not even built
    assert "miss_causes" not in repr(out.stats)


def test_hit_last_token_block_floor_first_seen_and_evicted_in_pages(model):
    """Pages of 4, a pool of 64 slots, one request at a time (1 output token: a request's KV
    is its prompt's, inserted in whole pages):
    a0: A (24 tokens) is new. a1: A again: 20 served (a hit stops at len - 1, in whole pages),
    its last page recomputed. c: A's first 10 tokens, then new ones: pages 0-1 served; tokens
    8-9 were in A but their page never was (it holds 10-11 of A): block_floor; new from 10.
    b: 40 new tokens need 10 pages, 9 are free: the least recently used leaf goes, A's last
    page (a1's match cut A there, so that page was last used by a0). a2: A again: 20 served,
    its last page evicted for b (lru)."""
    engine = LLMEngine(model, None, num_kv_slots=64, page_size=4, explain_misses=True)
    A = ids(0, 24)
    a0 = one(engine, A, "a0")
    assert spans(a0) == [(0, 24, "first_seen")]
    a1 = one(engine, A, "a1")
    assert spans(a1) == [(0, 20, "hit"), (20, 24, "last_token")]
    c = one(engine, A[:10] + ids(50, 3), "c")
    assert spans(c) == [(0, 8, "hit"), (8, 10, "block_floor"), (10, 13, "first_seen")]
    assert c.miss_causes[2].detail["at"] == 10
    assert spans(one(engine, ids(30, 40), "b")) == [(0, 40, "first_seen")]
    a2 = one(engine, A, "a2")
    assert spans(a2) == [(0, 20, "hit"), (20, 24, "evicted")]
    detail = a2.miss_causes[1].detail
    assert detail["by_request"] == "b" and detail["policy"] == "lru"
    totals = engine.explainer.totals()
    assert list(totals) == list(ENGINE_CAUSES)
    assert totals["hit"] == engine.stats.cached_tokens == 20 + 8 + 20
    assert sum(totals.values()) == engine.stats.queried_tokens
    assert engine.explainer.error is None
    engine.check_invariants()


def test_a_prefix_computed_in_the_same_batch_is_in_flight(model):
    """Two requests with the same 40-token prompt, submitted together. In-batch prefix caching
    off: both compute the prefix in the same step; the second's tokens are in flight (the
    first computes them), up to its last page, which it would recompute anyway. On (the
    default): the scheduler defers the second one step, and it is served from the tree."""
    A = ids(3, 40)
    both = [GenerateRequest(A, sampling_params=ONE, rid=r) for r in ("first", "second")]
    off = LLMEngine(model, None, page_size=4, in_batch_prefix_threshold=None, explain_misses=True)
    first, second = checked(off.generate(both))
    assert spans(first) == [(0, 40, "first_seen")]
    assert spans(second) == [(0, 36, "in_flight"), (36, 40, "last_token")]
    assert second.miss_causes[0].detail == {"by_request": "first"}
    assert second.stats.cached_tokens == 0

    on = LLMEngine(model, None, page_size=4, explain_misses=True)
    steps = []
    on.bus.subscribe(lambda e: steps.append(e) if isinstance(e, StepEvent) else None)
    first, second = checked(on.generate(both))
    assert any("second" in s.deferred for s in steps)
    assert spans(second) == [(0, 36, "hit"), (36, 40, "last_token")]


def test_a_running_request_not_yet_inserted_is_in_flight(model):
    """A running request inserts its prompt after its prefill step, but its decode tokens
    only when it finishes. A second request whose prompt is the first one's prompt and its
    first three outputs, admitted while the first decodes: the prompt is served from the tree,
    the outputs are in flight, held by the running request (the last token is recomputed
    anyway)."""
    engine = LLMEngine(model, None, page_size=1, in_batch_prefix_threshold=None, num_kv_slots=256)
    explainer = engine.explain()
    A = ids(5, 12)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    engine.add_request(GenerateRequest(A, sampling_params=params, rid="talker"))
    for _ in range(4):  # the prompt's step, then three decodes (not inserted until the end)
        engine.step()
    talker = engine.scheduler.requests["talker"]
    follow = A + talker.output_ids[:3]
    engine.add_request(GenerateRequest(follow, sampling_params=ONE, rid="follow"))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.rid] = out
    out = checked([outs["follow"]])[0]
    assert spans(out) == [(0, 12, "hit"), (12, 14, "in_flight"), (14, 15, "last_token")]
    assert out.miss_causes[1].detail == {"by_request": "talker"}
    assert explainer.error is None


def test_a_preempted_request_recomputes_its_prompt(model):
    """Three 8-token prompts sharing nothing, 24 new tokens each, in a pool of 48 slots (as
    tests/test_engine.py's preemption test): the newest is preempted, its KV goes into the tree
    and is evicted for the others, so a readmission computes its prompt again (one that finds
    its prompt still in the tree keeps its labels)."""
    engine = LLMEngine(model, None, num_kv_slots=48, explain_misses=True)
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    prompts = [[4 + 8 * i + j for j in range(8)] for i in range(3)]
    outs = checked(engine.generate([GenerateRequest(p, sampling_params=params) for p in prompts]))
    assert engine.stats.num_preemptions > 0
    preempted = [o for o in outs if o.stats.num_preemptions]
    assert preempted
    for out in preempted:
        runs = [r for r in out.miss_causes if r.cause == "preempted"]
        assert all(r.detail["was"] == "first_seen" for r in runs)
        assert all(r.cause in ("first_seen", "preempted") for r in out.miss_causes)
    assert engine.explainer.totals()["preempted"] > 0
    for out in outs:
        if not out.stats.num_preemptions:
            assert spans(out) == [(0, 8, "first_seen")]


def conversations(num: int = 4, turns: int = 3, prefix: int = 30, turn: int = 6):
    """tests/test_engine_hicache.py's workload: conversations taking turns, each turn its
    previous turn plus ``turn`` tokens, on a device pool too small to keep them all."""
    rng = np.random.default_rng(0)
    convs = [[4 + c] + rng.integers(4, 96, prefix + turn * turns).tolist() for c in range(num)]
    return [convs[c][: 1 + prefix + turn * (t + 1)] for t in range(turns) for c in range(num)]


def run_each(engine: LLMEngine, prompts: list[list[int]]):
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    return checked(
        [engine.generate([GenerateRequest(p, sampling_params=params)])[0] for p in prompts]
    )


def served_by_label(out) -> dict[str, int]:
    got = dict.fromkeys(("hit", "host", "storage"), 0)
    for r in out.miss_causes:
        if r.cause in got:
            got[r.cause] += r.end - r.start
    return got


def test_host_tier_loads_back_what_the_device_demoted(model):
    """With a host tier, a conversation's next turn finds its prefix demoted from the device
    and loads it back: ``host`` tokens, as many as ``cached_tokens_by_source["host"]``; the
    same workload without tiers says those were evicted."""
    tiered = LLMEngine(model, None, num_kv_slots=96, hicache_ratio=4, explain_misses=True)
    outs = run_each(tiered, conversations())
    for out in outs:
        by = out.stats.cached_tokens_by_source
        assert served_by_label(out) == {
            "hit": by.get("device", 0),
            "host": by.get("host", 0),
            "storage": by.get("storage", 0),
        }
    assert tiered.explainer.totals()["host"] == tiered.stats.cached_tokens_by_source["host"] > 0
    flat = LLMEngine(model, None, num_kv_slots=96, explain_misses=True)
    flat_outs = run_each(flat, conversations())
    assert flat.explainer.totals()["evicted"] > 0
    assert flat.explainer.totals()["host"] == 0
    assert sum(o.stats.cached_tokens for o in flat_outs) < tiered.stats.cached_tokens
    tiered.check_invariants()


def test_storage_tier_serves_a_second_engine(model, tmp_path):
    """A second engine on the same disk folder reads the first one's pages: ``storage``."""
    kw = dict(num_kv_slots=96, hicache_ratio=2, hicache_storage_dir=tmp_path)
    first = LLMEngine(model, None, **kw)
    prompts = conversations()
    first.generate([GenerateRequest(p, sampling_params=ONE) for p in prompts])
    first.close()
    second = LLMEngine(model, None, explain_misses=True, **kw)
    outs = run_each(second, prompts[-4:])
    stored = second.stats.cached_tokens_by_source["storage"]
    assert second.explainer.totals()["storage"] == stored > 0
    for out in outs:
        assert served_by_label(out)["storage"] == out.stats.cached_tokens_by_source["storage"]
    second.close()


def test_a_reset_is_an_eviction_and_a_late_explainer_starts_from_the_tree(model):
    """An explainer attached after requests ran knows the tree as it is (hits and last token
    right away); reset_prefix_cache evicts everything, which the next request is told."""
    engine = LLMEngine(model, None, num_kv_slots=128, page_size=2)
    A = ids(9, 20)
    engine.generate([GenerateRequest(A, sampling_params=ONE)])
    explainer = engine.explain()
    assert engine.explain() is explainer  # one per engine
    assert engine.scheduler.observers == (explainer,)  # the scheduler's public hook
    assert spans(one(engine, A, "again")) == [(0, 18, "hit"), (18, 20, "last_token")]
    engine.reset_prefix_cache()
    after = one(engine, A, "after")
    assert spans(after) == [(0, 20, "evicted")]
    assert after.miss_causes[0].detail["policy"] == "reset"
    explainer.close()
    explainer.close()  # twice: nothing more to remove
    assert engine.scheduler.observers == ()
    (out,) = engine.generate([GenerateRequest(A, sampling_params=ONE)])
    assert out.miss_causes is None


def test_minirad_serve_explains_a_request_that_asks(tmp_path):
    """``"minirad_explain": true`` in a request body (an extra field the real OpenAI client
    sends with ``extra_body``; vLLM and SGLang ignore it): the usage's
    ``prompt_tokens_details.miss_causes`` holds the prompt's runs. The first request that asks
    turns the explainer on; one that does not ask gets no such field."""
    import openai
    from servers import serving

    from minirad.entrypoints.openai.api_server import build_app
    from minirad.models import DEFAULT_MODEL_DIR

    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the shipped model is not there (being retrained?)")
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR)
    prompt = "A purple circle sits beside a green square and a red triangle, and"
    with serving(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert engine.explainer is None
        details = plain.usage.prompt_tokens_details
        assert "miss_causes" not in (details.model_extra or {})

        def ask(**kw):
            answer = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=2,
                extra_body={"minirad_explain": True},
                **kw,
            )
            if kw.get("stream"):  # the usage comes in the last chunk
                (usage,) = [chunk.usage for chunk in answer if chunk.usage is not None]
            else:
                usage = answer.usage
            runs = usage.prompt_tokens_details.model_extra["miss_causes"]
            assert runs[0]["start"] == 0 and runs[-1]["end"] == usage.prompt_tokens
            assert all(a["end"] == b["start"] for a, b in zip(runs, runs[1:], strict=False))
            served = sum(r["end"] - r["start"] for r in runs if r["cause"] == "hit")
            assert served == usage.prompt_tokens_details.cached_tokens
            return [(r["start"], r["end"], r["cause"]) for r in runs]

        n = plain.usage.prompt_tokens
        # The plain request's prompt was cached before the explainer started: it counts as
        # cached (the late explainer starts from the tree), so this is a hit at once.
        assert ask() == [(0, n - 1, "hit"), (n - 1, n, "last_token")]
        assert engine.explainer is not None and engine.explainer.error is None
        streamed = ask(stream=True, stream_options={"include_usage": True})
        assert streamed == [(0, n - 1, "hit"), (n - 1, n, "last_token")]
        other = client.completions.create(
            model="tiny",
            prompt="Something else entirely",
            max_tokens=1,
            extra_body={"minirad_explain": True},
        ).usage.prompt_tokens_details.model_extra["miss_causes"]
        assert other[-1]["cause"] == "first_seen" and "seen_next" in other[-1]["detail"]


def test_the_explainer_reads_the_scheduler_and_the_tree_through_their_public_api():
    """Issue 44: the explainer set ``scheduler.explainer`` and called the private
    ``_prefix_key``; it is now an observer (``Scheduler.add_observer``) and calls
    ``prefix_key``. No ``scheduler._...`` or ``tree._...`` in its source."""
    import re
    from pathlib import Path

    import minirad.engine.explain as explain

    source = Path(explain.__file__).read_text(encoding="utf-8")
    assert re.findall(r"\b(?:scheduler|tree|tree_cache)\.(_\w+)", source) == []
    assert "add_observer(self)" in source
