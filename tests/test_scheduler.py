"""The scheduler alone, over a real RadixCache and TokenToKVPoolAllocator, without a model.

The model's part of a step is played by :func:`next_token`: a deterministic function of a
request's tokens so far, so every request's output is fixed whatever the schedule (batching,
chunking, preemption, prefix reuse), exactly as greedy decoding of a real model is. That
lets each test compare a constrained run with an unconstrained one.
"""

import random
from collections import deque

import pytest

from minirad.engine import PREFIX_STRATEGIES, Request, SamplingParams, Scheduler, SchedulerConfig
from minirad.engine.processing import ImageSegment
from minirad.errors import InvalidArgumentError, RequestError
from minirad.events import EventBus, EventRecorder
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator, block_table_from_slots
from minirad.kvcache.radix_cache import RadixCache


def make_scheduler(num_slots=256, page_size=1, bus=None, **config):
    bus = bus or EventBus()
    alloc = TokenToKVPoolAllocator(num_slots, page_size, bus)
    tree = RadixCache(page_size, token_to_kv_pool_allocator=alloc, bus=bus)
    config.setdefault("max_model_len", 512)
    return Scheduler(tree, SchedulerConfig(**config))


def make_request(rid, prompt, max_new_tokens=4, key=None, segments=()):
    return Request(
        rid,
        prompt,
        SamplingParams(max_new_tokens=max_new_tokens),
        key_ids=key,
        segments=segments,
    )


def next_token(request: Request) -> int:
    """The 'model': a token that depends only on the request's tokens so far."""
    ids = request.all_token_ids
    return 4 + (sum(ids) * 31 + len(ids) * 7) % 90


def run_step(s: Scheduler):
    out = s.schedule()
    assert out.scheduled, "unfinished requests, but nothing could be scheduled"
    for sr in out.scheduled:  # the forward pass: these tokens now have KV
        assert sr.request.num_computed_tokens == sr.end
    tokens = [next_token(sr.request) for sr in out.scheduled if sr.sample]
    s.update_from_output(out, tokens)
    s.check_invariants()
    return out


def run_all(s: Scheduler, max_steps=1000):
    outs = []
    while s.has_unfinished_requests():
        outs.append(run_step(s))
        assert len(outs) < max_steps
    return outs


def assert_idle(s: Scheduler):
    """Everything finished: no lock held, every slot either free or owned by the tree."""
    s.check_invariants()
    assert not s.running and not s.waiting and not s.requests
    tree = s.tree_cache
    assert tree.protected_size() == 0
    assert s.allocator.available_size() + tree.total_size() == s.allocator.size


def reference_outputs(prompts, max_new_tokens=4):
    """Outputs with no constraint at all (big pool, no budget, no reuse)."""
    s = make_scheduler(num_slots=4096, prefix_strategy="none")
    reqs = [make_request(f"r{i}", p, max_new_tokens) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    run_all(s)
    return [r.output_ids for r in reqs]


def shared_prompts(n, prefix_len=20, suffix_len=5, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 90) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(4, 90) for _ in range(suffix_len)] for _ in range(n)]


def test_new_requests_join_running_decodes_in_one_batch():
    s = make_scheduler()
    a = make_request("a", [1, 5, 6, 7], max_new_tokens=6)
    s.add_request(a)
    out = run_step(s)
    assert [(x.request.rid, x.num_tokens, x.is_prefill) for x in out.scheduled] == [("a", 4, True)]
    b = make_request("b", [2, 9, 9], max_new_tokens=2)
    s.add_request(b)
    out = run_step(s)  # a decodes while b prefills: one mixed batch
    assert [(x.request.rid, x.num_tokens, x.is_prefill) for x in out.scheduled] == [
        ("a", 1, False),
        ("b", 3, True),
    ]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 3
    run_all(s)
    assert a.status.finish_reason == "length" and len(a.output_ids) == 6
    assert a.stats.decode_tokens == 5 and a.stats.prefill_tokens == 4
    assert_idle(s)


def test_chunked_prefill_respects_the_token_budget():
    prompts = [list(range(4, 4 + n)) for n in (23, 9, 17)]
    s = make_scheduler(max_num_batched_tokens=8, in_batch_prefix_threshold=None)
    reqs = [make_request(f"r{i}", p, 5) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    first = run_step(s)
    assert [x.num_tokens for x in first.scheduled] == [8] and not first.scheduled[0].sample
    # The computed chunk is in the tree at once (cache_unfinished_req), locked by its owner.
    assert s.tree_cache.protected_size() == 8
    outs = run_all(s)
    assert all(o.num_scheduled_tokens <= 8 for o in outs)
    assert any(o.num_prefill_tokens and o.num_decode_tokens for o in outs)  # mixed steps
    assert [r.output_ids for r in reqs] == reference_outputs(prompts, 5)
    assert_idle(s)


def test_full_hit_recomputes_only_the_last_token():
    s = make_scheduler()
    prompt = [1, 8, 9, 10, 11, 12]
    s.add_request(make_request("a", prompt))
    run_all(s)
    b = make_request("b", prompt)
    s.add_request(b)
    out = run_step(s)
    assert out.scheduled[0].num_tokens == 1 and out.scheduled[0].sample
    assert b.stats.cached_tokens == len(prompt) - 1  # the len - 1 rule
    run_all(s)
    assert b.output_ids == reference_outputs([prompt])[0]
    assert_idle(s)


@pytest.mark.parametrize("threshold", [None, 8])
def test_in_batch_prefix_sharing_computes_a_shared_prefix_once(threshold):
    prompts = shared_prompts(4, prefix_len=20, suffix_len=5)
    s = make_scheduler(in_batch_prefix_threshold=threshold)
    reqs = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    first = run_step(s)
    run_all(s)
    prefill = sum(r.stats.prefill_tokens for r in reqs)
    if threshold is None:  # all four prefill together: the prefix is computed four times
        assert len(first.scheduled) == 4 and prefill == 4 * 25
    else:  # one goes first, the other three wait a step and reuse its prefix
        assert len(first.scheduled) == 1 and len(first.deferred) == 3
        assert [r.stats.cached_tokens for r in reqs] == [0, 20, 20, 20]
        assert prefill == 25 + 3 * 5
    assert [r.output_ids for r in reqs] == reference_outputs(prompts)
    assert_idle(s)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(policy):
    s = make_scheduler(max_num_seqs=1, policy=policy)
    cached = list(range(10, 40))
    s.add_request(make_request("warm", cached + [5]))
    run_all(s)
    s.add_request(make_request("cold", [60, 61, 62, 63]))
    s.add_request(make_request("hot", cached + [7, 8]))
    out = run_step(s)
    first = out.scheduled[0].request.rid
    assert first == ("hot" if policy == "lpm" else "cold")
    run_all(s)
    assert_idle(s)


def test_eviction_comes_before_preemption():
    s = make_scheduler(num_slots=40)
    for i, p in enumerate(shared_prompts(3, prefix_len=0, suffix_len=10, seed=1)):
        s.add_request(make_request(f"old{i}", p))
        run_all(s)
    assert s.tree_cache.evictable_size() == 39  # 3 x 13 tokens with KV, all cached
    new = make_request("new", list(range(20, 45)))  # 25 tokens: needs evictions
    s.add_request(new)
    run_all(s)
    assert s.num_preemptions == 0
    assert new.output_ids == reference_outputs([new.prompt_token_ids])[0]
    assert_idle(s)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("strategy", ["radix", "none"])
def test_preemption_recomputes_with_unchanged_output(page_size, strategy):
    prompts = shared_prompts(4, prefix_len=8, suffix_len=6, seed=2)
    s = make_scheduler(num_slots=48, page_size=page_size, prefix_strategy=strategy)
    reqs = [make_request(f"r{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    preempted = []
    while s.has_unfinished_requests():
        out = run_step(s)
        if out.preempted:
            running_before = [x.request for x in out.scheduled]
            # the newest running requests go, never one already scheduled in this step
            assert not set(out.preempted) & set(running_before)
            preempted += out.preempted
    assert preempted and s.num_preemptions == len(preempted)
    assert sum(r.stats.num_preemptions for r in reqs) == len(preempted)
    assert [r.output_ids for r in reqs] == reference_outputs(prompts, 12)
    for r in reqs:  # recompute work: prefill covers the prompt and the re-fed outputs
        assert r.stats.prefill_tokens + r.stats.cached_tokens >= r.num_prompt_tokens
    assert_idle(s)


class Recorder:
    """A SchedulerObserver that notes every call: (hook, rid, what the request has then)."""

    def __init__(self):
        self.calls = []

    def _note(self, hook, request):
        self.calls.append((hook, request.rid, request.num_computed_tokens))

    def scheduling(self, request):
        self._note("scheduling", request)

    def matching(self, request):
        self._note("matching", request)

    def preempting(self, request):
        self._note("preempting", request)

    def admitted(self, request):
        self._note("admitted", request)

    def readmitted(self, request):
        self._note("readmitted", request)


def test_observers_are_told_of_matches_admissions_and_preemptions_until_removed():
    """The scheduler's public hook (the miss explainer is one): every observer hears every
    moment, in order; a removed one hears nothing more, and removing twice is harmless."""
    prompts = shared_prompts(4, prefix_len=8, suffix_len=6, seed=2)
    s = make_scheduler(num_slots=48)
    first, second = Recorder(), Recorder()
    remove = s.add_observer(first)
    s.add_observer(second)
    assert s.observers == (first, second)
    reqs = [make_request(f"r{i}", p, max_new_tokens=12) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    run_all(s)
    assert first.calls == second.calls
    hooks = [hook for hook, _, _ in first.calls]
    assert hooks.count("admitted") == len(reqs)
    assert hooks.count("preempting") == s.num_preemptions == hooks.count("readmitted") > 0
    for r in reqs:  # matched, then admitted once; a preempted request still held its KV
        mine = [(hook, n) for hook, rid, n in first.calls if rid == r.rid]
        assert mine[0][0] == "matching" and [h for h, _ in mine].count("admitted") == 1
        assert all(n > 0 for hook, n in mine if hook == "preempting")
    remove()
    remove()
    assert s.observers == (second,)
    s.add_request(make_request("late", prompts[0]))
    run_all(s)
    assert all(rid != "late" for _, rid, _ in first.calls)
    assert any(rid == "late" for _, rid, _ in second.calls)
    assert_idle(s)


def test_the_schedule_policies_are_one_registry():
    """SchedulerConfig accepts exactly the registry's names (SGLang's), and the scheduler
    orders its queue with the registry's class; prefix_key is public (the explainer uses it)."""
    from minirad.engine.schedule_policy import LPM_MAX_QUEUE, SCHEDULE_POLICIES, LPMPolicy

    assert list(SCHEDULE_POLICIES) == ["fcfs", "lpm"]
    for name, cls in SCHEDULE_POLICIES.items():
        assert cls.name == name
        assert isinstance(make_scheduler(policy=name).schedule_policy, cls)
    with pytest.raises(InvalidArgumentError, match=r"one of \('fcfs', 'lpm'\)"):
        SchedulerConfig(policy="random")
    s = make_scheduler(page_size=4, prefix_strategy="truncate")
    r = make_request("a", list(range(4, 14)))
    assert s.prefix_key(r) == list(range(4, 13))  # all but the last token (no image)
    # lpm sorts a short queue by cached length, stably; a long one keeps arrival order
    queue = deque(make_request(f"q{i}", [4, 5 + i]) for i in range(4))
    cached = {"q0": 1, "q1": 3, "q2": 3, "q3": 0}
    ordered = LPMPolicy().order(queue, lambda q: cached[q.rid])
    assert [q.rid for q in ordered] == ["q1", "q2", "q0", "q3"]
    long = deque(make_request(f"l{i}", [4, 5]) for i in range(LPM_MAX_QUEUE + 1))
    assert LPMPolicy().order(long, lambda q: int(q.rid[1:])) is long


def test_the_old_registry_name_still_works_with_a_warning():
    import minirad.engine.scheduler as scheduler
    import minirad.kvcache.eviction as eviction

    with pytest.warns(DeprecationWarning, match="SCHEDULE_POLICIES"):
        assert scheduler.POLICIES == ("fcfs", "lpm")
    with pytest.warns(DeprecationWarning, match="EVICTION_POLICIES"):
        assert eviction.POLICIES is eviction.EVICTION_POLICIES


def test_newest_running_request_is_preempted():
    s = make_scheduler(num_slots=30, in_batch_prefix_threshold=None)
    a = make_request("a", list(range(10, 22)), max_new_tokens=10)
    b = make_request("b", list(range(40, 52)), max_new_tokens=10)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefill: 24 slots
    victims = []
    while not victims:
        victims = run_step(s).preempted
    assert victims == [b] and a.status.value == "running"
    assert s.waiting[0] is b and b.num_computed_tokens == 0
    # b's computed KV went into the tree (cache_finished_req), evictable
    assert s.tree_cache.evictable_size() > 0
    run_all(s)
    assert_idle(s)


def test_prefix_strategies_with_an_image():
    """Same text, different images: radix forks at the first image token; truncate reuses
    the text before the image even for the same image; none reuses nothing."""
    text, img_at, img_len = [1, 20, 21, 22], 4, 6
    prompt = text + [3] * img_len + [30, 31]
    segs = [ImageSegment(img_at, img_len, 0, 0)]

    def key(pad):
        return text + [pad] * img_len + [30, 31]

    for strategy, same, other in [("radix", 11, 4), ("truncate", 4, 4), ("none", 0, 0)]:
        s = make_scheduler(prefix_strategy=strategy)
        s.add_request(make_request("a", prompt, key=key(1000), segments=segs))
        run_all(s)
        b = make_request("b", prompt, key=key(1000), segments=segs)  # same image
        c = make_request("c", prompt, key=key(2000), segments=segs)  # another image
        for r in (b, c):
            s.add_request(r)
            run_all(s)
        assert (b.stats.cached_tokens, c.stats.cached_tokens) == (same, other), strategy
        assert_idle(s)
        if strategy == "none":
            assert s.tree_cache.total_size() == 0


def test_abort_running_and_waiting_requests():
    s = make_scheduler(max_num_seqs=1)
    a = make_request("a", [1, 2, 3, 4, 5], max_new_tokens=8)
    b = make_request("b", [1, 2, 3, 9], max_new_tokens=8)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    assert s.finish_request("b") is b and b.status.finish_reason == "abort"
    assert s.finish_request("a") is a and a.status.finish_reason == "abort"
    assert s.finish_request("a") is None
    assert_idle(s)
    assert s.tree_cache.evictable_size() == 5  # a's computed prompt stayed cached


def test_requests_that_cannot_be_served_are_refused():
    s = make_scheduler(num_slots=16, max_model_len=32)
    with pytest.raises(RequestError, match="context"):
        s.add_request(make_request("long", list(range(4, 36))))
    with pytest.raises(RequestError, match="pool"):
        s.add_request(make_request("big", list(range(4, 14)), max_new_tokens=10))
    s.add_request(make_request("ok", list(range(4, 14)), max_new_tokens=7))  # 16 slots
    with pytest.raises(RequestError, match="already"):
        s.add_request(make_request("ok", [5, 6]))
    run_all(s)
    assert_idle(s)


def test_bad_scheduler_settings_raise():
    for bad in [
        dict(policy="sjf"),
        dict(prefix_strategy="hash"),
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(in_batch_prefix_threshold=-1),
    ]:
        with pytest.raises(InvalidArgumentError):
            SchedulerConfig(**bad)
    with pytest.raises(InvalidArgumentError):
        Scheduler(RadixCache())  # no allocator: nothing to schedule slots from


def test_page_aligned_kv_fills_pages_in_order():
    s = make_scheduler(page_size=4, max_num_batched_tokens=5)
    r = make_request("a", list(range(4, 17)), max_new_tokens=6)
    s.add_request(r)
    while s.has_unfinished_requests():
        run_step(s)
        if r.kv_indices:  # a block table exists for the slots at every step
            block_table_from_slots(r.kv_indices, 4)
    assert_idle(s)


def test_one_event_bus_sees_the_tree_and_the_pool():
    bus = EventBus()
    rec = EventRecorder(bus)
    s = make_scheduler(num_slots=24, bus=bus)
    for i, p in enumerate(shared_prompts(3, prefix_len=6, suffix_len=4, seed=3)):
        s.add_request(make_request(f"r{i}", p, max_new_tokens=6))
    run_all(s)
    kinds = {e.kind for e in rec.events}
    assert {"match", "insert", "lock", "unlock", "alloc", "free"} <= kinds
    times = [e.time for e in rec.events]
    assert times == sorted(times)  # one logical clock


@pytest.mark.parametrize("seed", range(9))
def test_random_workloads_keep_every_invariant(seed):
    """Random arrivals, shared prefixes and images, pool sizes, pages, budgets, policies and
    strategies: every step keeps the tree, locks and slots consistent, and every output
    equals the unconstrained run's."""
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    s = make_scheduler(
        num_slots=page * rng.randrange(-(-20 // page), -(-40 // page)),  # 20..40 slots
        page_size=page,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([None, 6, 16]),
        policy=["fcfs", "lpm"][seed % 2],
        prefix_strategy=PREFIX_STRATEGIES[seed % 3],
        in_batch_prefix_threshold=rng.choice([None, 4]),
    )

    def text(lo, hi):
        return [rng.randrange(4, 90) for _ in range(rng.randrange(lo, hi))]

    stems = [text(2, 8) for _ in range(3)]
    reqs, pending = [], []
    for i in range(14):
        prompt = rng.choice(stems)
        key, segments = list(prompt), []
        if rng.random() < 0.5:  # one of two 4-token images, then more text
            segments = [ImageSegment(len(prompt), 4, 0, 0)]
            key = key + [1000 + rng.randrange(2)] * 4
            prompt = prompt + [3] * 4
        tail = text(1, 4)
        r = make_request(f"r{i}", prompt + tail, rng.randrange(1, 7), key + tail, segments)
        pending.append(r)
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                r = pending.pop(0)
                s.add_request(r)
                reqs.append(r)
        if s.has_unfinished_requests():
            run_step(s)
    ref = reference_outputs([r.prompt_token_ids for r in reqs], max_new_tokens=6)
    for r, out in zip(reqs, ref, strict=True):
        assert r.output_ids == out[: len(r.output_ids)]
        assert len(r.output_ids) == r.sampling_params.max_new_tokens
    assert_idle(s)


def test_a_request_that_cannot_be_admitted_evicts_nothing():
    """Admission evicts tree leaves only when that makes room (SGLang's PrefillAdder budgets
    with available + evictable first): a request that cannot fit anyway leaves the cache as
    it was."""
    allocator = TokenToKVPoolAllocator(48)
    tree = RadixCache(token_to_kv_pool_allocator=allocator)
    s = Scheduler(tree, SchedulerConfig(max_model_len=64))
    s.add_request(Request("old", list(range(10, 20)), SamplingParams(max_new_tokens=1)))
    s.update_from_output(s.schedule(), [5])  # "old" finishes: 10 tokens cached, evictable
    s.add_request(Request("long", list(range(100, 125)), SamplingParams(max_new_tokens=8)))
    s.update_from_output(s.schedule(), [5])  # "long" runs: 25 slots; 13 free + 10 evictable
    before = tree.evictable_size()
    s.add_request(Request("big", list(range(200, 230)), SamplingParams(max_new_tokens=1)))
    out = s.schedule()  # needs 30 slots: even evicting all 10 cannot make room
    assert [x.request.rid for x in out.scheduled] == ["long"]
    assert tree.evictable_size() == before
