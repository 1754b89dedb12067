"""The radix-cache benchmark (``python -m minirad.bench radix``) on tiny traces.

No timing is asserted: only the trace's structure, determinism, the hit-rate ordering of the
baselines, a brute-force reference for the never-evicting cache, and the final state of every
cache and allocator (no lock held, no slot leaked).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minirad import InvalidArgumentError
from minirad.bench import build_parser
from minirad.bench.radix import SCHEDULES, capacity_for_fraction, replay, run_radix_benchmark
from minirad.bench.trace import ChatTrace, TraceEvent, TraceRequest, make_chat_trace
from minirad.kvcache.belady import belady
from minirad.kvcache.eviction import ClosedSessionLRUPolicy
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace():
    return make_chat_trace(20, turns=3, seed=7)


def test_trace_is_deterministic_for_a_seed(trace):
    assert make_chat_trace(20, turns=3, seed=7) == trace
    other = make_chat_trace(20, turns=3, seed=8)
    assert other.requests != trace.requests


def test_trace_is_multi_turn_chat(trace):
    by_conv: dict[int, list] = {}
    for r in trace.requests:
        by_conv.setdefault(r.conversation, []).append(r)
        assert r.rid == f"c{r.conversation}t{r.turn}"
        assert any(r.prompt[: len(s)] == s for s in trace.system_prompts)
    assert len(by_conv) == 20
    for reqs in by_conv.values():
        assert [r.turn for r in reqs] == list(range(len(reqs)))
        for prev, nxt in zip(reqs, reqs[1:], strict=False):
            history = prev.prompt + prev.output
            assert nxt.prompt[: len(history)] == history and len(nxt.prompt) > len(history)


def test_trace_timeline_interleaves_conversations(trace):
    times = [e.time for e in trace.events]
    assert times == sorted(times)
    assert len(trace.events) == 2 * len(trace.requests)
    started, finished = set(), set()
    running = peak = 0
    for e in trace.events:
        r = trace.requests[e.request]
        if e.kind == "start":
            assert e.request not in started
            if r.turn:  # the previous turn of the conversation has finished
                prev = next(
                    i
                    for i, q in enumerate(trace.requests)
                    if q.conversation == r.conversation and q.turn == r.turn - 1
                )
                assert prev in finished
            started.add(e.request)
            running += 1
        else:
            assert e.request in started and e.request not in finished
            finished.add(e.request)
            running -= 1
        peak = max(peak, running)
    assert finished == set(range(len(trace.requests)))
    assert peak > 1  # conversations overlap in time


def _reference_infinite_hits(trace, page_size: int) -> int:
    """Hits of a cache that never evicts, by brute force: at each start, the longest common
    prefix (whole pages, at most ``len(prompt) - 1``) with any finished request's tokens
    that have KV (prompt + output minus the last sampled token)."""
    done: list[list[int]] = []
    hits = 0
    for e in trace.events:
        r = trace.requests[e.request]
        if e.kind == "finish":
            done.append(r.prompt + r.output[:-1])
            continue
        query = r.prompt[:-1]
        best = 0
        for seq in done:
            n = 0
            for a, b in zip(query, seq, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n - n % page_size)
        hits += best
    return hits


def _assert_clean_final_state(result) -> None:
    cache, alloc = result.cache, result.allocator
    if cache is None:
        assert alloc.available_size() == result.capacity  # every slot came back
        return
    cache.check_invariants()
    assert cache.protected_size() == 0
    assert cache.root_node.lock_ref == 1
    assert all(n.lock_ref == 0 for n in cache.nodes())
    # Every slot is either free or owned by the tree: nothing leaked, nothing double-freed.
    assert alloc.available_size() + cache.total_size() == result.capacity
    assert cache.evictable_size() == cache.total_size()


@pytest.mark.parametrize("page_size", [1, 4])
def test_benchmark_baselines_and_invariants(trace, page_size):
    # Tight pool: a little above what running requests need, so every policy evicts.
    capacity = trace.peak_running_tokens(page_size) + 64 * page_size
    bench = run_radix_benchmark(trace, capacity, page_size, policy="lru")

    # every policy of the cache but priority (the trace has no priorities), and lru-closed
    assert set(bench.policies) == {"lru", "lfu", "fifo", "slru", "tlru", "lru-closed"}
    assert bench.headline is bench.policies["lru"]
    assert bench.no_cache.hit_tokens == 0
    assert bench.no_cache.prefill_tokens == sum(len(r.prompt) for r in trace.requests)
    for r in bench.runs:
        assert r.prompt_tokens == trace.prompt_tokens
        assert r.requests == len(trace.requests)
        _assert_clean_final_state(r)
    for name, r in bench.policies.items():
        assert r.cache.eviction_policy.name == name
        assert bench.infinite.hit_rate >= r.hit_rate >= 0.0
        assert r.evicted_tokens > 0
        assert r.evicted_tokens % page_size == 0
    assert bench.infinite.evicted_tokens == 0
    assert bench.infinite.hit_tokens == _reference_infinite_hits(trace, page_size)
    assert bench.infinite.hit_tokens > 0
    # MIN at the same capacity: no policy beats its bound, and it is below the infinite cache.
    opt = bench.optimal
    assert opt.capacity == capacity and opt.resupplied_tokens == 0
    for r in bench.policies.values():
        assert 0.0 < bench.share_of_optimal(r.hit_tokens) <= 1.0
    assert opt.hit_tokens <= opt.bound_hit_tokens <= bench.infinite.hit_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_peak_pool_occupancy(trace, page_size):
    # The allocator's peak is what the run held at most: never above the pool; a cache that
    # keeps everything peaks at what it holds in the end (page_size 1).
    capacity = trace.peak_running_tokens(page_size) + 64 * page_size
    bench = run_radix_benchmark(trace, capacity, page_size, optimal=False)
    for r in bench.runs:
        assert 0 < r.peak_used_tokens <= r.capacity
        assert r.peak_usage == r.peak_used_tokens / r.capacity
    for r in bench.policies.values():  # a full pool is evicted from, so it was full
        assert r.peak_used_tokens > capacity - max(len(q.prompt) for q in trace.requests)
    # Without a cache, the peak is what running requests hold (prompt + output - 1 each).
    running = peak = 0
    for e in trace.events:
        q = trace.requests[e.request]
        need = -(-(len(q.prompt) + len(q.output) - 1) // page_size) * page_size
        running += need if e.kind == "start" else -need
        peak = max(peak, running)
    assert bench.no_cache.peak_used_tokens == peak
    # A cache that never evicts only grows, except for the unaligned tails it frees.
    final = bench.infinite.cache.total_size()
    assert final <= bench.infinite.peak_used_tokens <= final + (page_size > 1) * peak
    if page_size == 1:
        assert bench.infinite.peak_used_tokens == final


def test_unique_tokens_and_capacity_fraction(trace):
    # Brute force: the distinct prefixes of every prompt + output.
    seen = {tuple(q.prompt + q.output)[:i] for q in trace.requests
            for i in range(1, len(q.prompt) + len(q.output) + 1)}  # fmt: skip
    assert trace.unique_tokens() == len(seen)
    assert capacity_for_fraction(trace, 1.0) == max(len(seen), trace.peak_running_tokens())
    small = capacity_for_fraction(trace, 0.01, page_size=4)
    assert small == trace.peak_running_tokens(4)  # raised to what running requests need
    with pytest.raises(InvalidArgumentError, match="fraction"):
        capacity_for_fraction(trace, 0.0)


def test_closed_sessions_go_first():
    pool = TokenToKVPoolAllocator(64)
    policy = ClosedSessionLRUPolicy()
    cache = RadixCache(1, policy, pool)
    old, new = [1, 2, 3], [4, 5, 6]
    old_slots, new_slots = pool.alloc(3), pool.alloc(3)
    policy.reopen(old_slots + new_slots)
    policy.close(new_slots)  # the newer session is over: it goes first despite LRU
    cache.insert(old, old_slots)
    cache.insert(new, new_slots)
    assert cache.evict(1) == new_slots
    assert cache.evict(1) == old_slots  # then plain LRU


def test_closed_session_policy_beats_lru_on_chat():
    # Same trace as the hit-rate tests of chapter 03, at its tightest pool.
    chat = make_chat_trace(60, turns=4, seed=0, system_prompt_len=(100, 300), user_median=32,
                           answer_median=64, arrival_interval=8.0, think_time=400.0)  # fmt: skip
    capacity = chat.peak_running_tokens()
    lru = replay(chat, capacity, policy="lru")
    closed = replay(chat, capacity, policy="lru-closed")
    assert closed.hit_tokens > lru.hit_tokens
    _assert_clean_final_state(closed)


def test_replay_is_deterministic(trace):
    capacity = trace.peak_running_tokens() + 200
    a = replay(trace, capacity, policy="lfu")
    b = replay(trace, capacity, policy="lfu")
    assert (a.hit_tokens, a.evicted_tokens) == (b.hit_tokens, b.evicted_tokens)
    assert a.cache.format_tree() == b.cache.format_tree()


def test_capacity_too_small_is_rejected(trace):
    with pytest.raises(InvalidArgumentError, match="too small"):
        replay(trace, trace.peak_running_tokens() - 1)
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy"):
        run_radix_benchmark(trace, 10**6, policy="mru")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "minirad.bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_radix_smoke():
    out = _cli(
        "radix",
        "--conversations",
        "10",
        "--turns",
        "2",
        "--capacity-frac",
        "1",
        "--page-size",
        "2",
        "--policy",
        "fifo",
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    for row in ("no cache", "lru", "lfu", "fifo *", "infinite"):
        assert f"\n{row} " in out.stdout
    assert "prefill tokens saved vs no cache:" in out.stdout
    assert "fifo hit rate vs infinite-cache bound:" in out.stdout
    assert "\nmin " in out.stdout and "of MIN" in out.stdout and "peak KV" in out.stdout
    assert "% of the unique tokens" in out.stdout


def test_cli_capacity_fraction_is_parsed():
    parser = build_parser()
    args = parser.parse_args(["radix", "--capacity-frac", "0.1"])
    assert args.capacity_frac == 0.1
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["radix", "--capacity-frac", bad])
    with pytest.raises(SystemExit):  # one way to size the pool, not two
        parser.parse_args(["radix", "--capacity", "100", "--capacity-frac", "0.1"])


def test_cli_reports_bad_arguments():
    out = _cli("radix", "--conversations", "10", "--capacity", "100", "--no-progress")
    assert out.returncode == 2
    assert "too small" in out.stderr
    assert _cli().returncode == 2  # the subcommand is required


# ----------------------------------------------------------------- the waiting queue
def _starts(ran) -> list[int]:
    return [e.request for e in ran.events if e.kind == "start"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("max_running", [1, 3])
def test_queue_respects_the_cap_and_runs_every_request_once(trace, schedule, max_running):
    capacity = trace.peak_running_tokens() // 2  # tight enough to queue on memory too
    result = replay(trace, capacity, policy="lru", max_running=max_running, schedule=schedule)
    ran = result.ran
    assert ran.requests is trace.requests and len(ran.events) == len(trace.events)
    trace_at = {(e.kind, e.request): e.time for e in trace.events}
    ran_at: dict[tuple[str, int], float] = {}
    running = 0
    times = [e.time for e in ran.events]
    assert times == sorted(times)
    for e in ran.events:
        assert (e.kind, e.request) not in ran_at  # each request starts and finishes once
        ran_at[e.kind, e.request] = e.time
        running += 1 if e.kind == "start" else -1
        assert 0 <= running <= max_running
    assert len(ran_at) == 2 * len(trace.requests)
    assert ran.peak_running_tokens() <= capacity
    by_conv: dict[int, list[int]] = {}
    for i, r in enumerate(trace.requests):
        by_conv.setdefault(r.conversation, []).append(i)
        # Admitted no earlier than it arrived in the trace; runs one step per output token.
        assert ran_at["start", i] >= trace_at["start", i]
        assert ran_at["finish", i] - ran_at["start", i] == pytest.approx(len(r.output))
    for turns in by_conv.values():  # closed loop: think time counts from the real finish
        for a, b in zip(turns, turns[1:], strict=False):
            think = trace_at["start", b] - trace_at["finish", a]
            assert ran_at["start", b] >= ran_at["finish", a] + think - 1e-6
    assert result.queue_delay > 0 and result.makespan >= trace.events[-1].time
    _assert_clean_final_state(result)
    if schedule == "fcfs":  # the returned order is the one that ran: replaying it agrees
        again = replay(ran, capacity, policy="lru")
        assert (again.hit_tokens, again.evicted_tokens) == (result.hit_tokens,
                                                            result.evicted_tokens)  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lru-closed", None])
def test_a_cap_that_never_binds_reproduces_the_trace_order(trace, page_size, policy):
    capacity = trace.peak_running_tokens(page_size) + 64 * page_size
    today = replay(trace, capacity, page_size, policy)
    assert today.ran is trace and today.queue_delay == 0 and today.max_running is None
    for schedule in SCHEDULES:
        queued = replay(trace, capacity, page_size, policy, max_running=len(trace.requests),
                        schedule=schedule)  # fmt: skip
        assert queued.ran.events == trace.events
        assert queued.queue_delay == 0 and queued.makespan == today.makespan
        got = (queued.hit_tokens, queued.evicted_tokens, queued.peak_used_tokens)
        assert got == (today.hit_tokens, today.evicted_tokens, today.peak_used_tokens)
    if policy == "lru":  # MIN on the order that ran is MIN on the trace
        assert belady(queued.ran, capacity, page_size) == belady(trace, capacity, page_size)


def _hand_trace() -> ChatTrace:
    """r0 runs from 0 to 10; r1 (unrelated) and r3 (unrelated) and r2 (extends r0's prompt
    and answer) arrive while it runs, in the order r1, r2, r3."""
    a, o0 = list(range(100, 120)), list(range(200, 210))
    prompts = [a, list(range(300, 320)), a + o0 + [7, 8], list(range(400, 420))]
    outputs = [o0, [1] * 5, [2] * 5, [3] * 5]
    reqs = [TraceRequest(f"c{i}t0", i, 0, prompts[i], outputs[i]) for i in range(4)]
    arrive = [0.0, 1.0, 2.0, 3.0]
    events = sorted(
        [TraceEvent(t, "start", i) for i, t in enumerate(arrive)]
        + [TraceEvent(t + len(outputs[i]), "finish", i) for i, t in enumerate(arrive)],
        key=lambda e: e.time,
    )
    return ChatTrace(reqs, events, [])


def test_lpm_admits_the_waiting_request_with_the_longest_cached_prefix():
    hand = _hand_trace()
    fcfs = replay(hand, 1000, policy="lru", max_running=1, schedule="fcfs")
    lpm = replay(hand, 1000, policy="lru", max_running=1, schedule="lpm")
    assert _starts(fcfs.ran) == [0, 1, 2, 3]
    assert _starts(lpm.ran) == [0, 2, 1, 3]  # r2 finds r0's 29 tokens cached; ties by arrival
    assert lpm.hit_tokens == fcfs.hit_tokens == 20 + 10 - 1  # all but r0's last output token
    assert lpm.queue_delay == (10 - 2) + (15 - 1) + (20 - 3)


def test_queued_benchmark_reports_min_on_each_order(trace):
    capacity = trace.peak_running_tokens() // 2
    bench = run_radix_benchmark(trace, capacity, policies=("lru", "lru-closed"), max_running=2,
                                schedule="lpm")  # fmt: skip
    assert set(bench.optima) == {"lru", "lru-closed"}
    for name, r in bench.policies.items():
        assert r.max_running == 2 and r.schedule == "lpm"
        assert bench.optima[name] == belady(r.ran, capacity)
        assert 0.0 < bench.share_of_optimal(r.hit_tokens, name) <= 1.0
    assert bench.optimal is bench.optima["lru"]


def test_queue_arguments_are_checked(trace):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_running"):
            replay(trace, 10**6, max_running=bad)
    with pytest.raises(InvalidArgumentError, match="schedule"):
        replay(trace, 10**6, max_running=2, schedule="sjf")
    biggest = max(len(r.prompt) + len(r.output) for r in trace.requests)
    with pytest.raises(InvalidArgumentError, match="too small"):
        replay(trace, biggest - 1, max_running=2)
    assert replay(trace, biggest, max_running=2).ran.peak_running_tokens() <= biggest


def test_cli_radix_with_a_queue():
    out = _cli("radix", "--conversations", "10", "--turns", "2", "--capacity-frac", "1",
               "--max-running", "2", "--schedule", "lpm", "--no-progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "queue: at most 2 running, schedule lpm" in out.stdout
    assert "wait" in out.stdout and "makespan" in out.stdout
    assert "MIN (Belady, the order lru ran" in out.stdout
    assert _cli("radix", "--schedule", "sjf").returncode == 2


def test_cli_refuses_a_schedule_without_a_queue():
    out = _cli("radix", "--conversations", "10", "--schedule", "lpm", "--no-progress")
    assert out.returncode == 2
    assert "--max-running" in out.stderr
