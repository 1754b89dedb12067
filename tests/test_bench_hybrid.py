"""``python -m minirad.bench hybrid``: the numbers it prints follow from the block manager's
tables, and agree with what the model shape alone predicts (computed here independently)."""

from __future__ import annotations

import pytest
import torch

from minirad.bench import main
from minirad.bench.hybrid import (
    DESIGNS,
    Design,
    ModelShape,
    VllmBlockStore,
    count_concurrent,
    decode_curve,
    format_report,
    gemma3_270m_shape,
    pool_bytes_for,
    run_hybrid_benchmark,
    tiny_shape,
)
from minirad.errors import InvalidArgumentError

FULL, HYBRID = DESIGNS


def small(window: int = 24) -> ModelShape:
    return ModelShape("small", 6, 2, 8, torch.float32, window, source="test")


def ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def blocks_per_layer(shape: ModelShape, bs: int, tokens: int, prompt: int) -> tuple[int, int]:
    """(full layer, sliding layer) blocks once token ``tokens`` has a slot. At the prefill step
    nothing has been computed, so nothing is dropped; at a decode step the query of position
    ``tokens - 1`` reads keys ``tokens - W .. tokens - 1``, so a sliding layer holds the blocks
    from the one holding key ``max(0, tokens - W)`` to the last."""
    total = ceil(tokens, bs)
    if tokens == prompt:
        return total, total
    return total, total - max(0, tokens - shape.sliding_window) // bs


def expected_bytes(shape: ModelShape, bs: int, tokens: int, prompt: int, hybrid: bool) -> int:
    page = bs * 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    full, sliding = blocks_per_layer(shape, bs, tokens, prompt)
    num_full = sum((i + 1) % 6 == 0 for i in range(shape.num_layers))
    if not hybrid:
        return shape.num_layers * full * page
    return (num_full * full + (shape.num_layers - num_full) * sliding) * page


@pytest.mark.parametrize(("bs", "window"), [(8, 24), (8, 20), (4, 9), (16, 64)])
def test_bytes_per_sequence_are_the_tables_blocks_and_match_the_shape(bs, window) -> None:
    shape, prompt = small(window), 5
    for design, hybrid in ((FULL, False), (HYBRID, True)):
        curve = decode_curve(design, shape, bs, 100, prompt)
        assert [t for t, _ in curve.points] == list(range(prompt, 101))
        for tokens, held in curve.points:
            assert held == expected_bytes(shape, bs, tokens, prompt, hybrid), (hybrid, tokens)
            if tokens > prompt:
                assert design.formula(shape, bs, tokens) == held


def test_the_store_counts_the_non_null_blocks_of_every_group() -> None:
    """Read the manager's block tables directly: one full group with every block, five
    sliding groups whose blocks before the window are the null block (id 0)."""
    shape, bs = small(24), 8
    store = VllmBlockStore(shape, bs, pool_bytes_for(shape, bs, 1, 200), hybrid=True)
    assert store.block_bytes == bs * 2 * 2 * 8 * 4  # six groups of one layer: one page
    assert store.start("a", 5)
    for _ in range(95):
        assert store.step("a")
    tables = store.manager.get_block_ids("a")
    assert len(tables) == 6
    window_blocks = ceil(100, bs) - (100 - 24) // bs
    assert sorted(sum(i != 0 for i in t) for t in tables) == [window_blocks] * 5 + [ceil(100, bs)]
    assert store.held_bytes("a") == (ceil(100, bs) + 5 * window_blocks) * store.block_bytes
    store.manager.check_invariants()
    store.free("a")
    full = VllmBlockStore(shape, bs, pool_bytes_for(shape, bs, 1, 200), hybrid=False)
    assert full.block_bytes == 6 * store.block_bytes  # one group of six layers


@pytest.mark.parametrize("length", [48, 61, 96])
def test_concurrent_sequences_follow_from_the_bytes_and_hybrid_holds_more(length) -> None:
    shape, bs, prompt = small(24), 8, 5
    pool = pool_bytes_for(shape, bs, 3, 96)
    counts = {}
    for design, hybrid in ((FULL, False), (HYBRID, True)):
        got = count_concurrent(design, shape, bs, length, pool, prompt)
        held = expected_bytes(shape, bs, length, prompt, hybrid)
        peak = max(expected_bytes(shape, bs, t, prompt, hybrid) for t in range(prompt, length + 1))
        n = got.sequences
        # n finished sequences fit, the (n + 1)-th could not get to the end of its decode.
        assert (n - 1) * held + peak <= got.usable_bytes < n * held + peak
        counts[hybrid] = n
    assert counts[True] > counts[False] >= 3 * (96 // length)
    if length == 96:
        assert counts[False] == 3  # the pool is sized for exactly three of them


def test_gemma3_270m_groups_three_layers_per_block() -> None:
    shape, bs = gemma3_270m_shape(), 32
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.sliding_window) == (
        18,
        1,
        256,
        512,
    )
    curve = decode_curve(HYBRID, shape, bs, 1024, 32)
    page = 32 * 2 * 256 * 2
    assert curve.bytes_at(1024) == (3 * 32 + 15 * (32 - 512 // 32)) * page
    assert decode_curve(FULL, shape, bs, 1024, 32).bytes_at(1024) == 18 * 32 * page


def test_the_tiny_shape_reads_the_shipped_model() -> None:
    shape = tiny_shape()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (6, 2, 32)
    assert shape.dtype == torch.float32 and shape.sliding_window == 64


def test_the_curve_is_a_sawtooth_below_full_attention() -> None:
    shape, bs = small(24), 8
    full = [b for _, b in decode_curve(FULL, shape, bs, 120, 1).points]
    hybrid = [b for _, b in decode_curve(HYBRID, shape, bs, 120, 1).points]
    assert full == sorted(full)
    assert all(h <= f for h, f in zip(hybrid, full, strict=True))
    drops = [i for i in range(1, len(hybrid)) if hybrid[i] < hybrid[i - 1]]
    assert len(drops) >= 5  # a block leaves the window every block_size tokens


def test_a_new_design_is_one_entry_and_the_report_shows_it() -> None:
    again = Design("full again", "again", FULL.make, FULL.formula)
    bench = run_hybrid_benchmark(
        [small(24)], [8], [40, 64], 5, 2, 64, designs=[FULL, HYBRID, again]
    )
    report = format_report(bench)
    assert "full again" in report and "again/full" in report
    assert "DIFFERS" not in report and "agrees" in report
    assert bench.concurrent("small", 8, "full again", 64).sequences == 2
    with pytest.raises(InvalidArgumentError):
        run_hybrid_benchmark([small()], [8], [5], 5)


def test_the_command_runs_small(capsys) -> None:
    argv = ["hybrid", "--shapes", "tiny", "--block-sizes", "16", "--window", "32"]
    argv += ["--lengths", "48", "80", "--pool-sequences", "2", "--pool-length", "80"]
    assert main([*argv, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tiny-6L" in out and "hybrid/full" in out
    assert "agrees" in out and "DIFFERS" not in out
    with pytest.raises(SystemExit):
        main(["hybrid", "--lengths", "16", "--prompt-tokens", "32", "--no-progress"])
