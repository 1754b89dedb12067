"""paged_attention against dense per-sequence attention, over scattered pages of a KV pool."""

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
    _decode_chunks,
    block_table_to_kv_slots,
    paged_attention,
    reference_attention,
    split_batch,
    varlen_paged_attention,
)

HEAD_DIM = 8


def run_case(seqs, block_size, num_heads, num_kv_heads, seed, shared=0, kv_row_bytes=None):
    """Each seq is ``(prefix_len, query_len)``. The prefix K/V already sit in the pool (written
    at the sequence's slots beforehand), the new K/V go in through paged_attention. Blocks are
    drawn from a shuffled free list, so no sequence's context is contiguous; every slot not in
    use holds large random values, so reading a wrong or padding slot unmasked shows up.
    ``shared`` (a multiple of ``block_size``, at most every prefix): the sequences' first
    ``shared`` tokens are the same tokens in the same blocks, as the radix tree shares them;
    ``kv_row_bytes`` as in AttentionMetadata.build (None: no cascade)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    lens = [p + q for p, q in seqs]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = KVCache(1, num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = pool.layer(0)
    k_cache.copy_(torch.randn(k_cache.shape, generator=g) * 100)
    v_cache.copy_(torch.randn(v_cache.shape, generator=g) * 100)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared_blocks = [free.pop() for _ in range(shared // block_size)]
    shared_k = torch.randn(shared, num_kv_heads, HEAD_DIM, generator=g)
    shared_v = torch.randn(shared, num_kv_heads, HEAD_DIM, generator=g)

    block_tables, ks, vs, qs = [], [], [], []
    for (p, q), n, nb in zip(seqs, lens, blocks_per_seq, strict=True):
        table = shared_blocks + [free.pop() for _ in range(nb - len(shared_blocks))]
        block_tables.append(table)
        k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g)
        k[:shared], v[:shared] = shared_k, shared_v
        prefix = torch.tensor(slot_mapping(table, range(p), block_size), dtype=torch.int64)
        k_cache[prefix], v_cache[prefix] = k[:p], v[:p]
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(q, num_heads, HEAD_DIM, generator=g))

    max_blocks = max(blocks_per_seq)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables])
    kv_slots = block_table_to_kv_slots(tables, block_size, max(lens))
    new_slots = [
        s
        for (p, q), t in zip(seqs, block_tables, strict=True)
        for s in slot_mapping(t, range(p, p + q), block_size)
    ]
    query_lens = torch.tensor([q for _, q in seqs])
    meta = AttentionMetadata.build(
        torch.tensor(new_slots),
        kv_slots,
        torch.tensor(lens),
        query_lens,
        int(query_lens.max()),
        kv_row_bytes,
    )
    new_k = torch.cat([k[p:] for k, (p, _) in zip(ks, seqs, strict=True)])
    new_v = torch.cat([v[p:] for v, (p, _) in zip(vs, seqs, strict=True)])
    scale = HEAD_DIM**-0.5
    pool_before = k_cache.clone(), v_cache.clone()
    out = paged_attention(torch.cat(qs), new_k, new_v, k_cache, v_cache, meta, scale)

    expected = torch.cat(
        [reference_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new K/V landed in the pool at slot_mapping.
    torch.testing.assert_close(k_cache[torch.tensor(new_slots)], new_k)
    torch.testing.assert_close(v_cache[torch.tensor(new_slots)], new_v)

    # The engine's split batch: same outputs, same pool, from the pool as it was before.
    pool_after = k_cache.clone(), v_cache.clone()
    k_cache.copy_(pool_before[0])
    v_cache.copy_(pool_before[1])
    groups = split_batch(
        torch.tensor(new_slots), kv_slots, torch.tensor(lens), query_lens, kv_row_bytes
    )
    out = varlen_paged_attention(torch.cat(qs), new_k, new_v, k_cache, v_cache, groups, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, pool_after[0]) and torch.equal(v_cache, pool_after[1])
    return meta, groups


@settings(max_examples=40)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 9)),  # (cached prefix, new tokens)
        min_size=1,
        max_size=4,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 2), (4, 4), (6, 1)]),
    seed=st.integers(0, 2**16),
)
def test_paged_matches_dense(seqs, block_size, heads, seed):
    run_case(seqs, block_size, *heads, seed)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_chunk_and_decodes(block_size):
    # A fresh prompt, a chunk after a cached prefix, and two decodes of different lengths.
    meta, groups = run_case([(0, 7), (5, 3), (11, 1), (2, 1)], block_size, 4, 2, seed=1)
    assert meta.query_index is not None and meta.output_index.shape == (12,)
    # Split: the two prefills padded to 7 queries, the decodes to 1, each to its own contexts.
    prefills, decodes = (g.metadata for g in groups)
    assert [g.rows for g in groups] == [slice(0, 10), slice(10, 12)]
    assert prefills.mask.shape == (2, 1, 7, 8) and decodes.mask.shape == (2, 1, 1, 12)


@pytest.mark.parametrize(
    ("seqs", "rows"),
    [
        ([(4, 1), (0, 5), (6, 1)], [[0, 6], list(range(1, 6))]),  # decodes around a prefill
        ([(0, 3), (4, 1), (2, 4)], [[0, 1, 2, 4, 5, 6, 7], [3]]),  # prefills around a decode
    ],
)
def test_split_groups_that_are_not_contiguous(seqs, rows):
    _, groups = run_case(seqs, 4, 4, 2, seed=3)
    got = [
        list(range(g.rows.start, g.rows.stop)) if isinstance(g.rows, slice) else g.rows.tolist()
        for g in groups
    ]
    assert got == rows
    assert isinstance(groups[0].rows, torch.Tensor)  # scattered rows: gathered, put back


def test_uniform_decode_batch_needs_no_gather():
    # All sequences have one new token: queries are a reshape, not a gather; one group.
    meta, groups = run_case([(3, 1), (9, 1), (0, 1)], 4, 4, 2, seed=2)
    assert meta.query_index is None and meta.output_index is None
    assert len(groups) == 1 and groups[0].rows == slice(0, 3)


@settings(max_examples=30)
@given(
    suffixes=st.lists(st.integers(0, 12), min_size=2, max_size=5),  # cached past the prefix
    shared=st.sampled_from([16, 32, 48]),
    block_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 2), (4, 4), (6, 1)]),
    seed=st.integers(0, 2**16),
)
def test_decodes_sharing_a_prefix_attend_to_it_once(suffixes, shared, block_size, heads, seed):
    """Decodes whose contexts begin with the same slots take the cascade path, and it equals
    dense attention over each whole context (run_case checks), suffixes of any lengths."""
    seqs = [(shared + s, 1) for s in suffixes]
    # A K/V row counted as MIN_SAVED_BYTES: any shared token pays for the cascade.
    meta, groups = run_case(seqs, block_size, *heads, seed, shared, MIN_SAVED_BYTES)
    prefix = meta.shared_prefix
    assert prefix is not None and prefix.slots.shape[0] >= shared  # more if suffixes agree
    assert prefix.suffix_real.sum(1).tolist() == [
        shared + s + 1 - prefix.slots.shape[0] for s in suffixes
    ]


def test_no_cascade_below_the_threshold_for_one_sequence_or_prefills():
    # Three decodes sharing 16 tokens save 2 * 16 rows of copies per layer.
    meta, _ = run_case(
        [(16, 1)] * 3, 1, 4, 2, seed=5, shared=16, kv_row_bytes=MIN_SAVED_BYTES // 32
    )
    assert meta.shared_prefix is not None
    meta, _ = run_case(
        [(16, 1)] * 3, 1, 4, 2, seed=5, shared=16, kv_row_bytes=MIN_SAVED_BYTES // 33
    )
    assert meta.shared_prefix is None  # too little to pay for a second call
    meta, _ = run_case([(20, 1)], 4, 4, 2, seed=6, shared=16, kv_row_bytes=MIN_SAVED_BYTES)
    assert meta.shared_prefix is None  # one sequence: nothing to share
    meta, _ = run_case([(20, 3), (20, 2)], 4, 4, 2, seed=7, shared=16, kv_row_bytes=MIN_SAVED_BYTES)
    assert meta.shared_prefix is None  # prefill chunks attend as usual
    meta, _ = run_case([(20, 1)] * 3, 4, 4, 2, seed=8, shared=16)
    assert meta.shared_prefix is None  # no kv_row_bytes: cascade off


@given(
    lens=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    row_bytes=st.sampled_from([None, 64, 1536, 46080, ATTENTION_CHUNK_BYTES]),
)
def test_decode_chunks_are_few_even_and_fit_the_budget(lens, row_bytes):
    chunks = _decode_chunks(lens, row_bytes)
    assert [i for c in chunks for i in c] == list(range(len(lens)))  # all, in order
    if row_bytes is None:
        assert len(chunks) == 1
        return
    fits = max(1, ATTENTION_CHUNK_BYTES // (max(lens) * row_bytes))
    assert len(chunks) == -(-len(lens) // fits)  # as few as the budget allows
    assert len({len(c) for c in chunks[:-1]}) <= 1 and len(chunks[-1]) <= len(chunks[0])
    for c in chunks:
        assert len(c) == 1 or len(c) * max(lens) * row_bytes <= ATTENTION_CHUNK_BYTES


@pytest.mark.parametrize("block_size", [1, 4])
def test_decodes_cut_to_fit_the_cache_match_dense(block_size):
    """Decodes, some beside a prefill, cut in groups of two by the budget: same outputs
    (run_case compares), groups in row order."""
    seqs = [(10, 1), (5, 1), (0, 4), (12, 1), (3, 1), (7, 1)]
    row_bytes = ATTENTION_CHUNK_BYTES // (2 * 13)  # two contexts of at most 13 tokens fit
    _, groups = run_case(seqs, block_size, 4, 2, seed=9, kv_row_bytes=row_bytes)
    # Five decodes (13 tokens at most) in 3 groups: 2 + 2 + 1; then the prefill.
    assert [g.metadata.batch_size for g in groups] == [2, 2, 1, 1]
    assert [g.metadata.max_query_len for g in groups] == [1, 1, 1, 4]


def test_block_table_expansion_matches_slot_mapping():
    tables = torch.tensor([[5, 2, 7], [1, 0, 0]])
    got = block_table_to_kv_slots(tables, 4, 10)
    for row, table in zip(got.tolist(), tables.tolist(), strict=True):
        assert row == slot_mapping(table, range(10), 4)
    with pytest.raises(InvalidArgumentError):
        block_table_to_kv_slots(tables, 4, 13)


def test_split_batch_rejects_inconsistent_lengths():
    kv_slots, lens = torch.zeros(2, 5, dtype=torch.int64), torch.tensor([5, 5])
    with pytest.raises(InvalidArgumentError):  # 4 tokens, but 1 + 2 new ones
        split_batch(torch.zeros(4, dtype=torch.int64), kv_slots, lens, torch.tensor([1, 2]))


def test_metadata_rejects_inconsistent_shapes():
    kv_slots = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(InvalidArgumentError):  # 3 lengths for 2 rows
        AttentionMetadata.build(
            torch.zeros(2, dtype=torch.int64),
            kv_slots,
            torch.tensor([5, 5, 5]),
            torch.tensor([1, 1, 1]),
            1,
        )
    with pytest.raises(InvalidArgumentError):  # 5 tokens cannot come from 2 seqs of <= 2
        AttentionMetadata.build(
            torch.zeros(5, dtype=torch.int64),
            kv_slots,
            torch.tensor([5, 5]),
            torch.tensor([2, 2]),
            2,
        )


def test_split_batch_refuses_an_empty_batch():
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(InvalidArgumentError):
        split_batch(empty, torch.zeros(0, 0, dtype=torch.long), empty, empty)
