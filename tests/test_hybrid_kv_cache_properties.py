"""Property tests of the per-group (hybrid) ``KVCacheManager`` over random traces.

A trace is a list of operations on a small pool: new requests whose prompts share prefixes of
a few stems (so they hit, partly, and meet at junctions), prefill in chunks, decode steps,
frees, and evictions (the pool is small: new blocks reuse cached ones). After every operation
``check_invariants()`` must pass; after every lookup the hit must be the longest length every
group can serve, computed here by brute force from the pool's hash table.

Planted bugs (a monkeypatched manager that breaks one rule) show the checker has teeth: for
each, hypothesis finds a trace that the checker rejects.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from minirad.errors import InvariantError
from minirad.kvcache.block_pool import make_block_hash_with_group_id
from minirad.kvcache.kv_cache_coordinator import KVCacheCoordinator
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from minirad.kvcache.single_type_kv_cache_manager import SlidingWindowManager

BS = 4


def sw(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(BS, 1, 8, torch.float32, sliding_window=window)


FULL = FullAttentionSpec(BS, 1, 8, torch.float32)
LAYOUTS = {
    "gemma-like": [sw(8), sw(8), FULL],  # two sliding groups, one full: the simple hybrid
    "two-windows": [sw(8), sw(13), FULL],  # three types: the fixed point may loop
    "windows-only": [sw(6), sw(6)],  # one sliding type, no full attention
    "full-only": [FULL],  # one full group, through the coordinator
}
STEMS = [[random.Random(s).randrange(1, 50) for _ in range(40)] for s in range(3)]

new_op = st.tuples(
    st.just("new"),
    st.integers(0, 2),  # stem
    st.one_of(st.sampled_from([9, 16, 23, 40]), st.integers(0, 40)),  # tokens of the stem
    st.sampled_from([0, 0, 3, 12]),  # own tokens after it (none: a repeat)
    st.sampled_from([3, 8, 64]),  # prefill chunk
)
trace_ops = st.lists(
    st.one_of(
        new_op,
        st.tuples(st.just("step"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7)),
    ),
    min_size=4,
    max_size=40,
)


@dataclass
class Config:
    layout: str
    num_blocks: int
    retention: int | None


configs = st.builds(
    Config,
    st.sampled_from(sorted(LAYOUTS)),
    st.integers(6, 40),
    st.sampled_from([0, 0, None, 16]),
)


def make_manager(config: Config) -> KVCacheManager:
    specs = LAYOUTS[config.layout]
    retention = config.retention
    if retention and not any(isinstance(s, SlidingWindowSpec) for s in specs):
        retention = 0
    return KVCacheManager(
        config.num_blocks, BS, layer_specs=specs, prefix_cache_retention_interval=retention
    )


def serves(manager: KVCacheManager, group_id: int, hashes, length: int) -> bool:
    """Can group ``group_id`` resume at ``length`` tokens? Full attention needs every block
    before it cached, a sliding window the ``cdiv(W - 1, BS)`` blocks before it."""
    spec = manager.kv_cache_groups[group_id].spec
    end = length // BS
    start = 0
    if isinstance(spec, SlidingWindowSpec):
        start = max(0, end - -(-(spec.sliding_window - 1) // BS))
    pool = manager.block_pool
    key = make_block_hash_with_group_id
    return all(pool.get_cached_block(key(hashes[i], group_id)) for i in range(start, end))


def check_hit(manager: KVCacheManager, prompt: list[int], result) -> None:
    """The hit is block-aligned, below the prompt, made of blocks cached under the prompt's
    own hashes, and the longest length every group serves (brute force)."""
    blocks, hit, boundary = result
    max_len = len(prompt) - 1
    hashes = manager.block_hashes(prompt[: max_len // BS * BS])
    groups = range(len(manager.kv_cache_groups))
    best = max(
        L for L in range(0, max_len + 1, BS) if all(serves(manager, g, hashes, L) for g in groups)
    )
    assert hit == best
    for g in groups:
        assert len(blocks[g]) == hit // BS
        spec = manager.kv_cache_groups[g].spec
        for i, b in enumerate(blocks[g]):
            if b.is_null:
                assert isinstance(spec, SlidingWindowSpec) and i < hit // BS - 1
            else:
                assert b.block_hash == make_block_hash_with_group_id(hashes[i], g)
    full = [g for g in groups if not isinstance(manager.kv_cache_groups[g].spec, SlidingWindowSpec)]
    if full and len(full) < len(groups):  # the junction is where full attention alone stops
        alone = max(L for L in range(0, max_len + 1, BS) if serves(manager, full[0], hashes, L))
        assert boundary == (alone if alone > hit else 0)
    else:
        assert boundary == 0


def replay(config: Config, ops: list[tuple]) -> KVCacheManager:
    """Run ``ops`` on a fresh manager, checking the invariants after each one."""
    manager = make_manager(config)
    rng = random.Random(len(ops))
    running: dict[str, dict] = {}
    for n, op in enumerate(ops):
        if op[0] == "new":
            _, stem, shared, own, chunk = op
            prompt = STEMS[stem][:shared] + [rng.randrange(50, 60) for _ in range(own)]
            if len(prompt) < 2:
                continue
            result = manager.get_computed_blocks(prompt)
            check_hit(manager, prompt, result)
            blocks, hit, boundary = result
            first = min(len(prompt) - hit, chunk)
            rid = f"r{n}"
            got = manager.allocate_slots(
                rid, prompt, first, blocks, shared_prefix_boundary=boundary
            )
            if got is not None:
                running[rid] = {"tokens": prompt, "prompt": len(prompt), "chunk": chunk}
        elif running:
            rid = sorted(running)[op[1] % len(running)]
            if op[0] == "free":
                manager.free(rid)
                del running[rid]
            else:
                req = running[rid]
                done = manager.num_tokens[rid]
                if done >= req["prompt"]:  # decode: the last sampled token gets a slot
                    req["tokens"].append(rng.randrange(1, 60))
                    num_new = 1
                else:  # the next prefill chunk
                    num_new = min(req["chunk"], req["prompt"] - done)
                if manager.allocate_slots(rid, req["tokens"], num_new) is None:
                    manager.free(rid)  # preempted
                    del running[rid]
        manager.check_invariants()
    for rid in list(running):
        manager.free(rid)
        manager.check_invariants()
    return manager


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(configs, trace_ops)
def test_random_traces_keep_every_invariant_and_find_the_longest_hit(config, ops):
    manager = replay(config, ops)
    assert manager.block_pool.get_num_free_blocks() == config.num_blocks - 1  # all returned


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(6, 30), trace_ops)
def test_one_full_group_through_the_coordinator_is_the_one_group_manager(num_blocks, ops):
    """The per-group path with one full-attention group gives the one-group manager's hits,
    allocations and block tables (block ids shifted by the null block), evictions included."""
    mine = KVCacheManager(num_blocks + 1, BS, layer_specs=[FULL])
    legacy = KVCacheManager(num_blocks, BS)
    rng = random.Random(0)
    running: dict[str, list[int]] = {}
    for n, op in enumerate(ops):
        if op[0] == "new":
            prompt = STEMS[op[1]][: op[2]] + [rng.randrange(50, 60) for _ in range(op[3])]
            if len(prompt) < 2:
                continue
            blocks, hit, boundary = mine.get_computed_blocks(prompt)
            old_blocks, old_hit = legacy.get_computed_blocks(prompt)
            assert (hit, boundary) == (old_hit, 0)
            rid = f"r{n}"
            got = mine.allocate_slots(rid, prompt, len(prompt) - hit, blocks)
            old = legacy.allocate_slots(rid, prompt, len(prompt) - hit, old_blocks)
            assert (got is None) == (old is None)
            if got is not None:
                running[rid] = prompt
        elif running:
            rid = sorted(running)[op[1] % len(running)]
            if op[0] == "step":
                running[rid].append(rng.randrange(1, 60))
                got = mine.allocate_slots(rid, running[rid], 1)
                old = legacy.allocate_slots(rid, running[rid], 1)
                assert (got is None) == (old is None)
            if op[0] == "free" or got is None:
                mine.free(rid)
                legacy.free(rid)
                del running[rid]
        for rid in running:
            assert [i - 1 for i in mine.get_block_ids(rid)[0]] == legacy.get_block_ids(rid)
        mine.check_invariants()
        legacy.check_invariants()


# ---------------------------------------------------------------------- planted bugs
def caught(config_ops) -> bool:
    """Does the checker (or the hit oracle) reject this trace?"""
    try:
        replay(*config_ops)
    except InvariantError:
        return True
    return False


def find_a_trace_the_checker_rejects() -> tuple:
    return find(
        st.tuples(configs, trace_ops),
        caught,
        settings=settings(
            max_examples=2000, database=None, deadline=None, phases=[Phase.generate]
        ),  # the first trace found will do: no shrinking
    )


def keep_every_skipped_block(self, request_id, num_computed_tokens):
    """Planted bug: never null (nor free) a block that left the window."""


def only_the_replay_boundary(cls, start_block, end_block, spec, interval, boundaries):
    """Planted bug: retain nothing at the shared-prefix junction."""
    return ORIGINAL_MASK.__func__(cls, start_block, end_block, spec, interval, boundaries[:1])


def free_only_full_attention(self, request_id):
    """Planted bug: a finished request's sliding-window blocks are never given back."""
    for m in self.single_type_managers:
        if not isinstance(m, SlidingWindowManager):
            m.free(request_id)


ORIGINAL_MASK = SlidingWindowManager.reachable_block_mask


@pytest.mark.parametrize(
    ("owner", "name", "bug", "message"),
    [
        (SlidingWindowManager, "remove_skipped_blocks", keep_every_skipped_block, "wholly before"),
        (
            SlidingWindowManager,
            "reachable_block_mask",
            classmethod(only_the_replay_boundary),
            "should be retained",
        ),
        (KVCacheCoordinator, "free", free_only_full_attention, "a finished request holds nothing"),
    ],
    ids=["forgets-to-null-a-skipped-block", "retains-nothing-at-the-junction", "leaks-swa-blocks"],
)
def test_the_checker_catches_a_planted_bug(monkeypatch, owner, name, bug, message):
    monkeypatch.setattr(owner, name, bug)
    config, ops = find_a_trace_the_checker_rejects()
    with pytest.raises(InvariantError, match=message):
        replay(config, ops)
