"""``python -m minirad.bench hybrid``: what a hybrid KV cache saves, measured on the block
manager itself.

A Gemma-3-style model has five sliding-window layers for each full-attention layer. A
full-attention design keeps every token of every layer; vLLM's hybrid design
(:class:`~minirad.kvcache.kv_cache_coordinator.HybridKVCacheCoordinator`) keeps a block table
per KV-cache group and, as decode moves on, turns a sliding group's blocks that fell out of the
window into the null block and gives them back to the pool (``remove_skipped_blocks``, which
``allocate_slots`` calls first at every step).

Three measurements, each on a real :class:`~minirad.kvcache.kv_cache_manager.KVCacheManager`
driven as vLLM's scheduler drives it (the prompt allocated in one step, then one
``allocate_slots`` per decoded token), never from a formula:

1. **Bytes per sequence**: one sequence decoded to each length ``L``; the bytes it holds at the
   step where its ``L``-th token got a slot (the table that step's forward pass reads) are
   the non-null blocks of all its block tables times the bytes of one block. The formula
   column recomputes the same number from the model shape alone, to show they agree.
2. **Concurrent sequences**: one pool of a fixed size in bytes (by default, what eight
   full-attention sequences of 1,024 tokens need); sequences are started and decoded to ``L``
   one after another, each keeping its blocks, until an allocation fails. The count is the
   sequences that reached ``L``.
3. **The curve**: bytes held against tokens, step by step, for one sequence: full attention
   grows by a block every ``block_size`` tokens; the sliding groups hold a window's worth that
   rises by a block when a new one opens and falls when the oldest leaves the window (a
   sawtooth). :attr:`HybridBenchmark.curves` carries every point, for a plot.

**A block's bytes.** vLLM gives every group the same number of layers (the group size, see
``kv_cache_groups.py``) so that one block id means the same memory in every group: a block is
``group size x page_size_bytes`` (one page per layer of the group). Full attention alone is one
group of every layer, so its block is ``num_layers`` pages; Gemma 3's 6 layers in the hybrid
design are six groups of one layer, so a block is one page. Pools are therefore compared in
bytes, not blocks.

**Designs.** :data:`DESIGNS` lists the designs measured, each a :class:`Design` whose ``make``
builds a fresh store (:class:`SequenceStore`) for a shape, a block size and a pool in bytes; a
design with a different layout (token-granular pools, say) adds one entry and the three
measurements run on it unchanged.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from minirad.entrypoints.argtypes import positive_int
from minirad.errors import InvalidArgumentError
from minirad.kvcache.kv_cache_groups import get_kv_cache_groups
from minirad.kvcache.kv_cache_manager import KVCacheManager
from minirad.kvcache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = [
    "DESIGNS",
    "SHAPES",
    "Concurrency",
    "Curve",
    "Design",
    "HybridBenchmark",
    "ModelShape",
    "SequenceStore",
    "VllmBlockStore",
    "add_arguments",
    "count_concurrent",
    "decode_curve",
    "format_report",
    "full_attention_bytes",
    "gemma3_270m_shape",
    "hybrid_bytes",
    "pool_bytes_for",
    "predicted_concurrency",
    "run_cli",
    "run_hybrid_benchmark",
    "tiny_shape",
]

_TINY_CONFIG = (
    Path(__file__).resolve().parents[2] / "data" / "models" / "minirad-tiny-llava" / "config.json"
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelShape:
    """The KV-relevant dimensions of a Gemma-3-style decoder: every ``full_every``-th layer is
    full attention, the others a sliding window of ``sliding_window`` tokens (HF's count).

    Attributes:
        name: row label.
        num_layers: decoder layers (a multiple of ``full_every``: no padded group).
        num_kv_heads, head_dim: K and V are ``[num_kv_heads, head_dim]`` per token and layer.
        dtype: the KV dtype.
        sliding_window: ``W``.
        full_every: 6 for Gemma 3's 5 sliding : 1 full.
        source: where the numbers come from.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int
    full_every: int = 6
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "sliding_window", "full_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        if self.num_layers % self.full_every:
            raise InvalidArgumentError(
                f"num_layers ({self.num_layers}) must be a multiple of full_every "
                f"({self.full_every}), so that no KV-cache group is padded"
            )

    @property
    def num_full_layers(self) -> int:
        return self.num_layers // self.full_every

    @property
    def num_sliding_layers(self) -> int:
        return self.num_layers - self.num_full_layers

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K plus V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def layer_specs(self, block_size: int) -> list[KVCacheSpec]:
        """Each layer's spec, in model order (layer ``i`` is full when ``(i + 1) % full_every
        == 0``, as Gemma 3's ``layer_types``)."""
        kw = dict(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )
        return [
            FullAttentionSpec(**kw)
            if (i + 1) % self.full_every == 0
            else SlidingWindowSpec(**kw, sliding_window=self.sliding_window)
            for i in range(self.num_layers)
        ]

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.name}: {self.num_layers} layers ({self.num_sliding_layers} sliding : "
            f"{self.num_full_layers} full, window {self.sliding_window}), {self.num_kv_heads} KV "
            f"head(s) x {self.head_dim}, {dtype}: {self.bytes_per_token_per_layer:,} B per token "
            f"per layer ({self.source})"
        )


def tiny_shape(sliding_window: int = 64, num_layers: int = 6) -> ModelShape:
    """The shipped tiny model's KV heads and head dim (read from its ``config.json``), fp32, as
    a 6-layer Gemma-3-style stack (the course's ``--text-family gemma3 --text-layers 6``)."""
    text = json.loads(_TINY_CONFIG.read_text())
    text = text.get("text_config", text)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return ModelShape(
        f"tiny-{num_layers}L",
        num_layers,
        text["num_key_value_heads"],
        head_dim,
        torch.float32,
        sliding_window,
        source="minirad-tiny-llava's KV heads and head dim",
    )


def gemma3_270m_shape(sliding_window: int = 512) -> ModelShape:
    """google/gemma-3-270m's published text config: 18 layers (``layer_types`` five sliding to
    one full), 1 KV head of ``head_dim`` 256, ``sliding_window`` 512, bf16 weights."""
    return ModelShape(
        "gemma-3-270m",
        18,
        1,
        256,
        torch.bfloat16,
        sliding_window,
        source="google/gemma-3-270m's config.json",
    )


SHAPES: dict[str, Callable[[int | None], ModelShape]] = {
    "tiny": lambda w: tiny_shape() if w is None else tiny_shape(w),
    "gemma-3-270m": lambda w: gemma3_270m_shape() if w is None else gemma3_270m_shape(w),
}


# ---------------------------------------------------------------------- designs
class SequenceStore(Protocol):
    """One design's KV store over a pool of fixed bytes, driven a sequence at a time.

    ``start`` and ``step`` return False (and leave the store as it was, but for blocks a
    window already dropped) when the pool cannot hold the tokens.
    """

    pool_bytes: int  # the pool's bytes
    usable_bytes: int  # of those, what sequences can hold (vLLM: all but the null block)

    def start(self, seq_id: str, prompt_tokens: int) -> bool:
        """Admit a new sequence with a prompt of ``prompt_tokens`` tokens (one prefill step)."""
        ...

    def step(self, seq_id: str) -> bool:
        """One decode step: a slot for one more token."""
        ...

    def held_bytes(self, seq_id: str) -> int:
        """KV bytes the sequence holds now, over every layer."""
        ...

    def free(self, seq_id: str) -> None: ...


class VllmBlockStore:
    """vLLM 0.32's block manager (:class:`KVCacheManager` in per-group mode) as a
    :class:`SequenceStore`.

    Args:
        shape, block_size: the model and its block size.
        pool_bytes: the pool; it gets ``pool_bytes // block_bytes`` blocks, the null block
            among them (vLLM's ``num_gpu_blocks``).
        hybrid: False is vLLM's ``--disable-hybrid-kv-cache-manager``: one full-attention
            group of every layer, nothing dropped.

    Each sequence's tokens are distinct from every other's (its first token is its own), so
    prefix caching, on as in vLLM, never shares a block between them.
    """

    def __init__(
        self, shape: ModelShape, block_size: int, pool_bytes: int, *, hybrid: bool
    ) -> None:
        specs = shape.layer_specs(block_size)
        self.groups = get_kv_cache_groups(specs, disable_hybrid=not hybrid)
        # One block id is one page in every layer slot of a group (module docstring).
        self.block_bytes = specs[0].page_size_bytes * max(len(g.layer_ids) for g in self.groups)
        num_blocks = pool_bytes // self.block_bytes
        if num_blocks < 2:
            raise InvalidArgumentError(
                f"a pool of {pool_bytes:,} B holds fewer than 2 blocks of {self.block_bytes:,} B"
            )
        self.pool_bytes = num_blocks * self.block_bytes
        self.usable_bytes = self.pool_bytes - self.block_bytes
        self.manager = KVCacheManager(num_blocks, block_size, kv_cache_groups=self.groups)
        self.tokens: dict[str, list[int]] = {}
        self._next_first = 1

    def start(self, seq_id: str, prompt_tokens: int) -> bool:
        first, self._next_first = self._next_first, self._next_first + 1
        tokens = [first] + [(first + i) % 30000 + 1 for i in range(1, prompt_tokens)]
        blocks, hit, boundary = self.manager.get_computed_blocks(tokens)
        got = self.manager.allocate_slots(
            seq_id, tokens, len(tokens) - hit, blocks, shared_prefix_boundary=boundary
        )
        if got is None:
            return False
        self.tokens[seq_id] = tokens
        return True

    def step(self, seq_id: str) -> bool:
        tokens = self.tokens[seq_id]
        tokens.append(len(tokens) % 30000 + 1)
        if self.manager.allocate_slots(seq_id, tokens, 1) is None:
            tokens.pop()
            return False
        return True

    def held_blocks(self, seq_id: str) -> int:
        """Non-null blocks over all the sequence's block tables."""
        tables = self.manager.coordinator.get_blocks(seq_id)
        return sum(not b.is_null for table in tables for b in table)

    def held_bytes(self, seq_id: str) -> int:
        return self.held_blocks(seq_id) * self.block_bytes

    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)
        del self.tokens[seq_id]


def full_attention_bytes(shape: ModelShape, block_size: int, tokens: int) -> int:
    """Every layer holds ``cdiv(tokens, block_size)`` pages."""
    page = shape.bytes_per_token_per_layer * block_size
    return shape.num_layers * cdiv(tokens, block_size) * page


def hybrid_bytes(shape: ModelShape, block_size: int, tokens: int) -> int:
    """Full layers hold every block; a sliding layer, at the step that gives token
    ``tokens - 1`` its slot (``tokens - 1`` computed), has dropped the blocks wholly before
    token ``tokens - W`` (the oldest key the new query reads), so it holds the blocks from
    ``(tokens - W) // block_size`` to the last."""
    page = shape.bytes_per_token_per_layer * block_size
    total = cdiv(tokens, block_size)
    window = total - max(0, tokens - shape.sliding_window) // block_size
    return (shape.num_full_layers * total + shape.num_sliding_layers * window) * page


@dataclass(frozen=True)
class Design:
    """A KV-cache design the benchmark measures.

    Attributes:
        name: column label.
        short: its name in a ratio's label (``hybrid/full``).
        make: a fresh store for ``(shape, block_size, pool_bytes)``.
        formula: the bytes one sequence of ``tokens`` tokens should hold, from the shape
            alone, ``(shape, block_size, tokens) -> bytes``; None: no formula.
    """

    name: str
    short: str
    make: Callable[[ModelShape, int, int], SequenceStore]
    formula: Callable[[ModelShape, int, int], int] | None = None


DESIGNS: list[Design] = [
    Design(
        "full attention",
        "full",
        lambda shape, bs, pool: VllmBlockStore(shape, bs, pool, hybrid=False),
        full_attention_bytes,
    ),
    Design(
        "vLLM hybrid",
        "hybrid",
        lambda shape, bs, pool: VllmBlockStore(shape, bs, pool, hybrid=True),
        hybrid_bytes,
    ),
]
"""Full attention (vLLM with ``--disable-hybrid-kv-cache-manager``: one group, nothing
dropped) and vLLM's hybrid manager (``HybridKVCacheCoordinator``). The first is the baseline
of every ratio."""


# ---------------------------------------------------------------------- measurements
@dataclass(frozen=True)
class Curve:
    """One sequence's KV bytes, step by step.

    Attributes:
        shape, block_size, design: what was measured.
        prompt_tokens: the prefill step's tokens (the first point).
        points: ``(tokens with a slot, bytes held)`` after the prefill and after each decode
            step.
    """

    shape: str
    block_size: int
    design: str
    prompt_tokens: int
    points: list[tuple[int, int]]

    def bytes_at(self, tokens: int) -> int:
        """Bytes held at the step that gave the ``tokens``-th token its slot."""
        first = self.points[0][0]
        if not first <= tokens <= self.points[-1][0]:
            raise InvalidArgumentError(f"the curve spans {first}..{self.points[-1][0]} tokens")
        return self.points[tokens - first][1]

    def peak_bytes(self, up_to: int, since: int = 0) -> int:
        """Most bytes held at any step from ``since`` to ``up_to`` tokens."""
        return max(b for t, b in self.points if since <= t <= up_to)


def _check_lengths(prompt_tokens: int, length: int) -> None:
    if prompt_tokens >= length:
        raise InvalidArgumentError(
            f"a sequence of {length} tokens needs a decode step after its prompt of "
            f"{prompt_tokens}: give lengths above --prompt-tokens"
        )


def decode_curve(
    design: Design, shape: ModelShape, block_size: int, max_tokens: int, prompt_tokens: int
) -> Curve:
    """One sequence alone in a pool big enough for full attention, prefilled with
    ``prompt_tokens`` tokens then decoded to ``max_tokens``; its bytes after every step.

    Raises:
        InvalidArgumentError: ``prompt_tokens >= max_tokens``.
    """
    _check_lengths(prompt_tokens, max_tokens)
    pool = full_attention_bytes(shape, block_size, max_tokens + 2 * block_size)
    store = design.make(shape, block_size, pool)
    if not store.start("s", prompt_tokens):
        raise InvalidArgumentError(f"{design.name}: a prompt of {prompt_tokens} does not fit")
    points = [(prompt_tokens, store.held_bytes("s"))]
    for tokens in range(prompt_tokens + 1, max_tokens + 1):
        if not store.step("s"):
            raise InvalidArgumentError(f"{design.name}: one sequence of {tokens} does not fit")
        points.append((tokens, store.held_bytes("s")))
    store.free("s")
    return Curve(shape.name, block_size, design.name, prompt_tokens, points)


@dataclass(frozen=True)
class Concurrency:
    """How many sequences of ``length`` tokens one pool held at once.

    Attributes:
        shape, block_size, design, length, prompt_tokens: what was measured.
        pool_bytes: the pool the design's store got (rounded down to whole blocks).
        usable_bytes: of those, what sequences can hold.
        sequences: sequences that reached ``length`` tokens, all held together.
    """

    shape: str
    block_size: int
    design: str
    length: int
    prompt_tokens: int
    pool_bytes: int
    usable_bytes: int
    sequences: int


def count_concurrent(
    design: Design,
    shape: ModelShape,
    block_size: int,
    length: int,
    pool_bytes: int,
    prompt_tokens: int,
    progress: Callable[[int], object] | None = None,
) -> Concurrency:
    """Start sequences one after another in one pool of ``pool_bytes``, each prefilled with
    ``prompt_tokens`` tokens and decoded one step at a time to ``length`` while the earlier
    ones keep their blocks, until an allocation fails; ``progress`` gets the tokens of each
    step.

    Raises:
        InvalidArgumentError: ``prompt_tokens >= length``.
    """
    _check_lengths(prompt_tokens, length)
    store = design.make(shape, block_size, pool_bytes)
    done = 0
    while True:
        seq = f"seq-{done}"
        ok = store.start(seq, prompt_tokens)
        for _ in range(length - prompt_tokens):
            if not ok:
                break
            ok = store.step(seq)
        if progress is not None:
            progress(length)
        if not ok:
            break
        done += 1
    return Concurrency(
        shape.name,
        block_size,
        design.name,
        length,
        prompt_tokens,
        store.pool_bytes,
        store.usable_bytes,
        done,
    )


@dataclass
class HybridBenchmark:
    """Every measurement of one run.

    Attributes:
        shapes: the model shapes.
        block_sizes, lengths, prompt_tokens: the grid.
        designs: the designs, the baseline (of every ratio) first.
        pool_sequences, pool_length: the concurrency pool is what ``pool_sequences``
            full-attention sequences of ``pool_length`` tokens need (null block included).
        curves: one per shape, block size and design, to the longest length.
        concurrency: one per shape, block size, design and length.
    """

    shapes: list[ModelShape]
    block_sizes: list[int]
    lengths: list[int]
    prompt_tokens: int
    designs: list[Design]
    pool_sequences: int
    pool_length: int
    curves: list[Curve] = field(default_factory=list)
    concurrency: list[Concurrency] = field(default_factory=list)

    def curve(self, shape: str, block_size: int, design: str) -> Curve:
        return next(
            c
            for c in self.curves
            if (c.shape, c.block_size, c.design) == (shape, block_size, design)
        )

    def concurrent(self, shape: str, block_size: int, design: str, length: int) -> Concurrency:
        return next(
            c
            for c in self.concurrency
            if (c.shape, c.block_size, c.design, c.length) == (shape, block_size, design, length)
        )


def pool_bytes_for(shape: ModelShape, block_size: int, sequences: int, length: int) -> int:
    """What ``sequences`` full-attention sequences of ``length`` tokens need, the null block
    included: ``(sequences * cdiv(length, block_size) + 1)`` blocks of ``num_layers`` pages."""
    page = shape.bytes_per_token_per_layer * block_size
    return (sequences * cdiv(length, block_size) + 1) * shape.num_layers * page


def run_hybrid_benchmark(
    shapes: Sequence[ModelShape],
    block_sizes: Sequence[int] = (32, 16),
    lengths: Sequence[int] = (128, 256, 512, 1024, 4096),
    prompt_tokens: int = 32,
    pool_sequences: int = 8,
    pool_length: int = 1024,
    designs: Sequence[Design] = tuple(DESIGNS),
    concurrency: bool = True,
    progress: bool = False,
) -> HybridBenchmark:
    """Measure every design on every shape and block size: the curve to ``max(lengths)``
    (bytes per sequence at each length are read off it) and, with ``concurrency``, how many
    sequences of each length a pool of ``pool_sequences`` full-attention sequences of
    ``pool_length`` tokens holds.

    Raises:
        InvalidArgumentError: a length not above ``prompt_tokens``, no designs, or a pool too
            small.
    """
    if not designs:
        raise InvalidArgumentError("need at least one design")
    lengths = sorted(set(lengths))
    for n in lengths:
        _check_lengths(prompt_tokens, n)
    bench = HybridBenchmark(
        list(shapes),
        list(block_sizes),
        lengths,
        prompt_tokens,
        list(designs),
        pool_sequences,
        pool_length,
    )
    combos = [(s, bs, d) for s in shapes for bs in block_sizes for d in designs]
    bar = tqdm(total=len(combos), desc="hybrid", unit="run", disable=not progress, leave=False)
    for shape, bs, design in combos:
        bar.set_postfix_str(f"{shape.name} bs {bs} {design.name}")
        bench.curves.append(decode_curve(design, shape, bs, lengths[-1], prompt_tokens))
        if concurrency:
            pool = pool_bytes_for(shape, bs, pool_sequences, pool_length)
            for n in lengths:
                bench.concurrency.append(
                    count_concurrent(design, shape, bs, n, pool, prompt_tokens)
                )
        bar.update()
    bar.close()
    return bench


# ---------------------------------------------------------------------- report
def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 10 << 20 else f"{n / (1 << 20):,.1f} MiB"


def predicted_concurrency(curve: Curve, length: int, usable_bytes: int) -> int:
    """Sequences of ``length`` tokens that ``usable_bytes`` hold by the curve's bytes: each
    finished one keeps ``bytes_at(length)``, and the last must also pass its own peak on the
    way there (a sliding group holds one block more between block boundaries, and a long
    prompt is held whole in every group until the next step)."""
    held, peak = curve.bytes_at(length), curve.peak_bytes(length)
    if peak > usable_bytes:
        return 0
    return (usable_bytes - peak) // held + 1


def _runs(curves: Sequence[Curve], start: int, end: int) -> list[tuple[int, int]]:
    """``(first, last)`` token counts of each run of steps in which no curve changes."""
    runs: list[tuple[int, int]] = []
    for t in range(start, end + 1):
        if runs and all(c.bytes_at(t) == c.bytes_at(t - 1) for c in curves):
            runs[-1] = (runs[-1][0], t)
        else:
            runs.append((t, t))
    return runs


def _verdict(checks: list[bool]) -> str:
    return "-" if not checks else "agrees" if all(checks) else "DIFFERS"


def format_report(bench: HybridBenchmark, curve_tokens: int | None = None) -> str:
    """The measurements as text tables: bytes per sequence, concurrency, and the first shape's
    curve at its first block size, run by run, up to ``curve_tokens`` (default: three
    windows)."""
    base, others = bench.designs[0], bench.designs[1:]
    names = [d.name for d in bench.designs]
    ratio_heads = "".join(f" {d.short + '/' + base.short:>13}" for d in others)
    lines = ["model shapes:"] + [f"  {s.describe()}" for s in bench.shapes]
    lines += [
        "",
        f"1. KV bytes one sequence holds during decode (prompt {bench.prompt_tokens} tokens, "
        "then one token a step; at the step that gives token L its slot): non-null blocks of "
        "its block tables x block bytes, measured; max: the most it held over the block of "
        "steps ending at L (a window that is not block-aligned spans one block more); "
        "formula: the at-L bytes from the shape alone",
        f"{'shape':<14} {'block':>5} {'L':>6} "
        + " ".join(f"{n:>16}" for n in names)
        + ratio_heads
        + "".join(f" {d.short + ' max':>14}" for d in others)
        + f" {'formula':>8}",
    ]
    for shape in bench.shapes:
        for bs in bench.block_sizes:
            for n in bench.lengths:
                curves = {d.name: bench.curve(shape.name, bs, d.name) for d in bench.designs}
                held = {name: c.bytes_at(n) for name, c in curves.items()}
                checks = [
                    d.formula(shape, bs, n) == held[d.name]
                    for d in bench.designs
                    if d.formula is not None
                ]
                lines.append(
                    f"{shape.name:<14} {bs:>5} {n:>6} "
                    + " ".join(f"{_kib(held[name]):>16}" for name in names)
                    + "".join(f" {held[d.name] / held[base.name]:>13.3f}" for d in others)
                    + "".join(
                        f" {_kib(curves[d.name].peak_bytes(n, n + 1 - bs)):>14}" for d in others
                    )
                    + f" {_verdict(checks):>8}"
                )
    if bench.concurrency:
        lines += [
            "",
            f"2. concurrent sequences of L tokens in one pool (the bytes {bench.pool_sequences} "
            f"full-attention sequences of {bench.pool_length} tokens need, null block "
            "included), each started and decoded to L while the earlier ones hold theirs, "
            "until an allocation fails; by bytes: the count table 1's bytes predict",
            f"{'shape':<14} {'block':>5} {'pool':>10} {'L':>6} "
            + " ".join(f"{n:>16}" for n in names)
            + ratio_heads
            + f" {'by bytes':>9}",
        ]
        for shape in bench.shapes:
            for bs in bench.block_sizes:
                for n in bench.lengths:
                    got = {name: bench.concurrent(shape.name, bs, name, n) for name in names}
                    checks = [
                        predicted_concurrency(bench.curve(shape.name, bs, name), n, c.usable_bytes)
                        == c.sequences
                        for name, c in got.items()
                    ]
                    first = got[base.name].sequences
                    ratios = "".join(
                        f" {got[d.name].sequences / first:>13.2f}" if first else f" {'-':>13}"
                        for d in others
                    )
                    lines.append(
                        f"{shape.name:<14} {bs:>5} {_kib(got[base.name].pool_bytes):>10} {n:>6} "
                        + " ".join(f"{got[name].sequences:>16}" for name in names)
                        + ratios
                        + f" {_verdict(checks):>9}"
                    )
    shape, bs = bench.shapes[0], bench.block_sizes[0]
    end = min(curve_tokens or 3 * shape.sliding_window, bench.lengths[-1])
    curves = [bench.curve(shape.name, bs, name) for name in names]
    top = max(c.peak_bytes(end) for c in curves) or 1
    lines += [
        "",
        f"3. bytes held against tokens, {shape.name}, block {bs}, window "
        f"{shape.sliding_window}: one row per run of steps where no design's bytes change "
        f"(the bar: {names[-1]}; every step is in HybridBenchmark.curves)",
        f"{'tokens':>11} " + " ".join(f"{name:>16}" for name in names),
    ]
    for first, last in _runs(curves, bench.prompt_tokens, end):
        held = [c.bytes_at(first) for c in curves]
        span = f"{first}" if first == last else f"{first}-{last}"
        bar = "#" * round(40 * held[-1] / top)
        lines.append(f"{span:>11} " + " ".join(f"{_kib(h):>16}" for h in held) + f"  {bar}")
    lines.append(
        "(a vLLM block id is one page in each layer of a KV-cache group: full attention is one "
        "group of every layer, the hybrid design groups of a sixth of the layers each)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hybrid`` subcommand's options."""
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "gemma-3-270m"],
        help="model shapes (tiny: 6 layers of the shipped model's KV heads and head dim, fp32; "
        "gemma-3-270m: its config, bf16)",
    )  # fmt: skip
    parser.add_argument(
        "--window", type=positive_int, default=None,
        help="sliding window W of every shape (default: tiny 64, gemma-3-270m its own 512)",
    )  # fmt: skip
    parser.add_argument(
        "--block-sizes", type=positive_int, nargs="+", default=[32, 16],
        help="tokens per block (vLLM's CPU default is 32, its GPU default 16)",
    )  # fmt: skip
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[128, 256, 512, 1024, 4096],
        help="sequence lengths L (tokens)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-tokens", type=positive_int, default=32,
        help="each sequence's prompt (one prefill step), then one token per decode step",
    )  # fmt: skip
    parser.add_argument(
        "--pool-sequences", type=positive_int, default=8,
        help="the concurrency pool holds this many full-attention sequences...",
    )  # fmt: skip
    parser.add_argument(
        "--pool-length", type=positive_int, default=1024, help="... of this many tokens"
    )
    parser.add_argument(
        "--curve-tokens", type=positive_int, default=None,
        help="the printed curve's last token (default: three windows)",
    )  # fmt: skip
    parser.add_argument(
        "--no-concurrency", action="store_true", help="skip the concurrent-sequences table"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_cli(args: argparse.Namespace) -> int:
    """Run ``python -m minirad.bench hybrid``: print the report, return the exit code."""
    shapes = [SHAPES[name](args.window) for name in dict.fromkeys(args.shapes)]
    bench = run_hybrid_benchmark(
        shapes,
        list(dict.fromkeys(args.block_sizes)),
        args.lengths,
        args.prompt_tokens,
        args.pool_sequences,
        args.pool_length,
        concurrency=not args.no_concurrency,
        progress=not args.no_progress,
    )
    print(format_report(bench, args.curve_tokens))
    return 0
