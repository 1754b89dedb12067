"""Sliding-window paged attention against dense windowed attention, with every slot a window
does not need poisoned: what a window leaves behind is never read."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_pool import KVCache, slot_mapping
from minirad.models.cascade_attention import MIN_SAVED_BYTES
from minirad.models.paged_attention import (
    ATTENTION_CHUNK_BYTES,
    AttentionMetadata,
    block_table_to_kv_slots,
    reference_attention,
    split_batch,
    varlen_paged_attention,
)

HEAD_DIM = 8
NUM_HEADS, NUM_KV_HEADS = 4, 2


def run_window_case(seqs, block_size, window, seed, shared=0, kv_row_bytes=None, poison=True):
    """Each seq is ``(prefix_len, query_len)``; its prefix K/V sit in the pool, the new ones go
    in through the split batch's attention, over a window of ``window``. With ``poison``, every
    slot outside the keys a window reads (the slots of positions before each sequence's
    window, the unused slots, slot 0) holds NaN in K and V before the step. ``shared``: the
    sequences' first ``shared`` tokens sit in the same blocks (a radix-tree prefix).

    Returns the split's groups."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [p + q for p, q in seqs]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = KVCache(1, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = pool.layer(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared_blocks = [free.pop() for _ in range(shared // block_size)]
    shared_k = torch.randn(shared, NUM_KV_HEADS, HEAD_DIM, generator=g)
    shared_v = torch.randn(shared, NUM_KV_HEADS, HEAD_DIM, generator=g)
    fill = float("nan") if poison else 0.0
    k_cache.fill_(fill)
    v_cache.fill_(fill)

    tables, ks, vs, qs = [], [], [], []
    for (_, q), n, nb in zip(seqs, lens, blocks_per_seq, strict=True):
        table = shared_blocks + [free.pop() for _ in range(nb - len(shared_blocks))]
        tables.append(table)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)
        k[:shared], v[:shared] = shared_k, shared_v
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q, NUM_HEADS, HEAD_DIM, generator=g))
    for (p, _), table, k, v in zip(seqs, tables, ks, vs, strict=True):
        # Only the keys the step's first query can see: those before are dropped. (A shared
        # block is written by every sequence that sees it, with the same values.)
        kept = range(max(0, p - window + 1), p) if poison else range(p)
        at = torch.tensor(slot_mapping(table, kept, block_size), dtype=torch.int64)
        k_cache[at], v_cache[at] = k[kept.start : p], v[kept.start : p]

    max_blocks = max(blocks_per_seq)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    kv_slots = block_table_to_kv_slots(padded, block_size, max(lens))
    new_slots = torch.tensor(
        [
            s
            for (p, q), t in zip(seqs, tables, strict=True)
            for s in slot_mapping(t, range(p, p + q), block_size)
        ]
    )
    query_lens = torch.tensor([q for _, q in seqs])
    groups = split_batch(
        new_slots, kv_slots, torch.tensor(lens), query_lens, kv_row_bytes, sliding_window=window
    )
    new_k = torch.cat([k[p:] for k, (p, _) in zip(ks, seqs, strict=True)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(vs, seqs, strict=True)])
    scale = HEAD_DIM**-0.5
    out = varlen_paged_attention(torch.cat(qs), new_k, new_v, k_cache, v_cache, groups, scale)
    expected = torch.cat(
        [
            reference_attention(q, k, v, scale, sliding_window=window)
            for q, k, v in zip(qs, ks, vs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[new_slots], new_k)
    return groups


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 20)),  # (cached prefix, new tokens)
        min_size=1,
        max_size=4,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([1, 2, 5, 16]),
    seed=st.integers(0, 2**16),
)
def test_windowed_paged_attention_never_reads_outside_the_window(seqs, block_size, window, seed):
    run_window_case(seqs, block_size, window, seed)


@pytest.mark.parametrize(
    "seqs",
    [
        [(10, 12)],  # a prefill chunk that crosses the window's boundary (W = 16)
        [(0, 40)],  # a whole prompt 2.5 windows long
        [(100, 1)],  # a decode far past the window
        [(15, 1), (16, 1), (17, 1)],  # decodes at the window's edge
        [(30, 1), (5, 9), (47, 1), (20, 20)],  # decodes and prefills in one step
    ],
)
def test_window_edges_and_mixed_batches(seqs):
    run_window_case(seqs, block_size=4, window=16, seed=1)


def test_a_decode_reads_the_window_not_the_sequence():
    (group,) = run_window_case([(200, 1), (90, 1)], block_size=4, window=16, seed=2)
    assert group.metadata.kv_slots.shape == (2, 16)  # not 201 keys
    assert group.metadata.sliding_window == 16


def test_windowed_decodes_are_chunked_by_the_window():
    """Decode groups are cut by the keys each gathers: at most W for a windowed layer."""
    row_bytes = ATTENTION_CHUNK_BYTES // 400  # one 301-key context fills a group's budget
    full = split_batch(
        torch.arange(4),
        torch.zeros(4, 301, dtype=torch.int64),
        torch.tensor([301] * 4),
        torch.ones(4, dtype=torch.int64),
        kv_row_bytes=row_bytes,
    )
    windowed = run_window_case([(300, 1)] * 4, 4, 16, seed=3, kv_row_bytes=row_bytes)
    assert len(full) == 4 and len(windowed) == 1


def test_cascade_is_off_for_windowed_layers_and_still_right():
    """Decodes sharing a long prefix: a full-attention layer attends to it once (cascade); a
    windowed layer does not (sequences of different lengths see different parts of it), and
    its answer is still the dense windowed one."""
    seqs = [(40, 1), (44, 1), (48, 1)]
    (group,) = run_window_case(
        seqs, 4, 16, seed=4, shared=32, kv_row_bytes=MIN_SAVED_BYTES // 32, poison=False
    )
    assert group.metadata.shared_prefix is None
    lens = torch.tensor([p + q for p, q in seqs])
    kv_slots = torch.arange(48 + 1).repeat(3, 1)  # same slots: a shared prefix
    full = AttentionMetadata.build(
        torch.arange(3), kv_slots, lens, torch.ones(3, dtype=torch.int64), 1, MIN_SAVED_BYTES // 32
    )
    assert full.shared_prefix is not None


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_window_must_be_a_positive_int(window):
    with pytest.raises(InvalidArgumentError):
        AttentionMetadata.build(
            torch.tensor([0]),
            torch.tensor([[0]]),
            torch.tensor([1]),
            torch.tensor([1]),
            1,
            sliding_window=window,
        )
