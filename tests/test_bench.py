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
from minirad.bench.radix import replay, run_radix_benchmark
from minirad.bench.trace import make_chat_trace

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

    assert set(bench.policies) == {"lru", "lfu", "fifo"}
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
        "--capacity",
        "40000",
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


def test_cli_reports_bad_arguments():
    out = _cli("radix", "--conversations", "10", "--capacity", "100", "--no-progress")
    assert out.returncode == 2
    assert "too small" in out.stderr
    assert _cli().returncode == 2  # the subcommand is required
