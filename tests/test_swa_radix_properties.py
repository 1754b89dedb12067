"""Property tests of the hybrid (Full, SWA) radix cache: random request traces (a shared system
prompt, branches at any offset, decode past the window, out-of-window frees, early inserts,
finishes, explicit evictions, pools small enough to evict on admission), with
``check_invariants`` after every operation; and planted bugs that the checker must catch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad.errors import InvariantError, OutOfMemoryError
from minirad.kvcache.swa_radix_cache import SWARadixCache

SYS = [50 + i for i in range(10)]
picks = st.integers(0, 1000)
ops = st.one_of(
    st.tuples(
        st.just("start"),
        picks,
        st.integers(0, 30),
        st.lists(st.integers(0, 3), min_size=1, max_size=8),
    ),
    st.tuples(st.just("decode"), picks, st.integers(1, 8)),
    st.tuples(st.just("unfinished"), picks),
    st.tuples(st.just("finish"), picks),
    st.tuples(st.just("evict"), st.integers(0, 20), st.integers(0, 20)),
)


def replay(cache: SWARadixCache, trace, check: bool = True) -> None:
    """Apply ``trace`` (ops as drawn above), checking the invariants after each op."""
    seqs = [SYS]  # earlier sequences, to branch from
    running = []
    for k, op in enumerate(trace):
        if op[0] == "start":
            base = seqs[op[1] % len(seqs)]
            prompt = base[: op[2]] + list(op[3])
            try:
                running.append(cache.start_req(f"r{k}", prompt))
            except OutOfMemoryError:
                pass
        elif op[0] == "evict":
            cache.evict(op[1], op[2])
        elif running:
            req = running[op[1] % len(running)]
            if op[0] == "decode":
                for t in range(op[2]):
                    try:
                        cache.decode(req, (k + t) % 5)
                    except OutOfMemoryError:
                        break
                    cache.free_out_of_window_slots(req)
            elif op[0] == "unfinished":
                cache.cache_unfinished_req(req)
            else:
                seqs.append(list(req.tokens))
                running.remove(req)
                cache.cache_finished_req(req)
        if check:
            cache.check_invariants()
    for req in running:
        cache.cache_finished_req(req)
        if check:
            cache.check_invariants()
    assert cache.protected_size() == 0 and not cache.running


@settings(max_examples=150, deadline=None)
@given(
    trace=st.lists(ops, max_size=40),
    window=st.integers(1, 6),
    full=st.integers(24, 80),
    ratio=st.sampled_from([0.4, 0.6, 0.8, 1.0]),
)
def test_random_traces_keep_every_invariant(trace, window, full, ratio):
    replay(SWARadixCache(full, window, ratio), trace)


def random_trace(rng: random.Random, n: int = 40) -> list:
    """The same kind of trace without Hypothesis (for the planted bugs)."""
    out = []
    for _ in range(n):
        kind = rng.choice(["start", "start", "decode", "decode", "unfinished", "finish", "evict"])
        if kind == "start":
            fresh = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            out.append(("start", rng.randrange(1000), rng.randrange(31), fresh))
        elif kind == "decode":
            out.append(("decode", rng.randrange(1000), rng.randint(1, 8)))
        elif kind == "evict":
            out.append(("evict", rng.randrange(21), rng.randrange(21)))
        else:
            out.append((kind, rng.randrange(1000)))
    return out


# ---------------------------------------------------------------- planted bugs
class ShortWindowLock(SWARadixCache):
    """Locks one node fewer than the window needs (when it takes more than one)."""

    def inc_lock_ref(self, node):
        uuid = super().inc_lock_ref(node)
        up = list(self._upward(node))
        locked = [n for n in up if n.swa.lock_ref > 0]
        if len(locked) > 1 and up[1].swa.lock_ref > 0:
            up[1].swa.lock_ref -= 1
        return uuid


class TombstoneLeaksSWA(SWARadixCache):
    """Tombstones a node without giving its SWA slots back to the pool."""

    def _tombstone(self, n):
        n.swa.value = None
        self._lru_remove(n)
        for f in n.full.value:
            self.pools.full_to_swa[f] = -1
        return len(n.full.value)


class KeepsDuplicates(SWARadixCache):
    """Insert forgets to free the request's duplicate prefix slots."""

    def _overlap(self, node, s, value, prev, evicted):
        free = self.pools.free
        self.pools.free = lambda slots: None
        try:
            super()._overlap(node, s, value, prev, evicted)
        finally:
            self.pools.free = free


class FinishedKeepsSWA(SWARadixCache):
    """A finished request's uninserted tail keeps its SWA slots (frees full only)."""

    def cache_finished_req(self, req):
        real = self.pools.free

        def full_only(slots):
            self.pools.free_full.extend(slots)

        self.pools.free = full_only
        try:
            super().cache_finished_req(req)
        finally:
            self.pools.free = real


@pytest.mark.parametrize(
    "bug", [ShortWindowLock, TombstoneLeaksSWA, KeepsDuplicates, FinishedKeepsSWA]
)
def test_the_checker_catches_planted_bugs(bug):
    for seed in range(300):
        rng = random.Random(seed)
        trace = random_trace(rng)
        replay(SWARadixCache(48, 3, 0.6), trace)  # the real cache passes the same trace
        try:
            replay(bug(48, 3, 0.6), trace)
        except (InvariantError, AssertionError):
            return
    pytest.fail(f"{bug.__name__} went unnoticed on 300 traces")
