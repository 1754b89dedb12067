"""Charts of the course's measurements and KV pools (matplotlib), so that chapters show
ideas, not plotting.

- :func:`cached_tokens_chart`: cached prompt tokens per request, for several caches.
- :func:`block_pool_chart`: a paged KV pool, one row per block (chapter 02).
- :func:`paged_batch_chart`: one paged-attention step, the pool beside the gathered batch
  (chapter 04).
- :func:`hit_rate_chart`: hit rate over pool size for several eviction policies, Belady's MIN
  and the infinite cache (chapter 03).
- :func:`forced_tokens_chart`: an answer's tokens in reading order, those a grammar forced
  (jump-forward) in teal (chapter 09).
- :func:`routing_runs_chart`: measured router runs, hit rate and requests per worker, for
  several kinds of worker side by side (chapter 10).
- :func:`replica_sweep_chart`: simulated hit rate and load imbalance of router policies over
  a swept quantity (replicas, traffic skew; chapter 10).
- :func:`unified_locks_chart`: one path of SGLang's ``UnifiedRadixCache`` and what a request
  at its end locks, per component: full attention, sliding window, Mamba state (chapter 08).

Example::

    fig = cached_tokens_chart(
        ["r1", "r2"], {"vLLM (32-token blocks)": [0, 64], "minirad radix tree": [0, 89]},
        prompt_tokens=[98, 101],
    )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minirad import slot_mapping
from minirad.kvcache.swa_window import window_lock_mask

__all__ = [
    "block_pool_chart",
    "cached_tokens_chart",
    "forced_tokens_chart",
    "hit_rate_chart",
    "paged_batch_chart",
    "replica_sweep_chart",
    "routing_runs_chart",
    "unified_locks",
    "unified_locks_chart",
]

_COLOURS = ("#9ecae1", "#3182bd", "#31a354", "#e6550d")
# One colour per request of a pool chart, in the order the requests are given.
REQUEST_COLOURS = ("#8ecae6", "#ffb703", "#90be6d", "#f4a3a8", "#cdb4db")


def cached_tokens_chart(
    requests: Sequence[str],
    cached: Mapping[str, Sequence[int]],
    prompt_tokens: Sequence[int],
    title: str = "prompt tokens served from the prefix cache",
) -> Figure:
    """Grouped bars: for each request, the cached prompt tokens of each system, over a grey
    bar of the request's prompt length (what a cache could at most serve).

    Args:
        requests: one label per request (the x axis).
        cached: ``{system: cached tokens per request}``, bars left to right in this order.
        prompt_tokens: each request's prompt length in tokens.

    Raises:
        ValueError: a series does not have one value per request.
    """
    n = len(requests)
    if len(prompt_tokens) != n or any(len(v) != n for v in cached.values()):
        raise ValueError("every series needs one value per request")
    fig, ax = plt.subplots(figsize=(7.2, 2.8))
    width = 0.8 / max(len(cached), 1)
    xs = range(n)
    ax.bar(xs, prompt_tokens, width=0.9, color="#eeeeee", label="prompt tokens")
    for k, ((name, values), colour) in enumerate(zip(cached.items(), _COLOURS, strict=False)):
        offset = (k - (len(cached) - 1) / 2) * width
        bars = ax.bar([x + offset for x in xs], values, width=width, color=colour, label=name)
        ax.bar_label(bars, fontsize=7, padding=1)
    ax.set_xticks(list(xs), requests, fontsize=8)
    ax.set_ylabel("tokens")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncols=len(cached) + 1, frameon=False)
    ax.set_ylim(0, max(prompt_tokens) * 1.3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# Line styles of hit_rate_chart: (colour, marker, line style); other series cycle _COLOURS.
_POLICY_STYLES = {
    "lru": ("#2f62b0", "o", "-"),
    "lfu": ("#3a8a2e", "s", "-"),
    "fifo": ("#c62828", "x", "--"),
    "slru": ("#7b3fa0", "v", "-"),
    "tlru": ("#00897b", "P", "-"),
    "priority": ("#8d6e63", "*", ":"),
    "lru-closed": ("#e6a100", "^", "-"),
    "MIN": ("black", "D", "--"),
}


def hit_rate_chart(
    capacities: Sequence[int],
    hit_rates: Mapping[str, Sequence[float]],
    infinite: float,
    unique_tokens: int,
    title: str = "hit rate over pool size",
) -> Figure:
    """Hit rate (prompt tokens served from the cache) over KV pool size, one line per series,
    with the infinite cache as a dotted ceiling.

    Args:
        capacities: pool sizes in tokens (the x axis, drawn as % of ``unique_tokens``).
        hit_rates: ``{series: hit rate per capacity}``, e.g. policies and ``"MIN"``; hit rates
            are fractions in [0, 1].
        infinite: hit rate of a cache that never evicts.
        unique_tokens: the trace's unique tokens (what the infinite cache holds).

    Raises:
        ValueError: a series does not have one value per capacity, or ``unique_tokens <= 0``.
    """
    if any(len(v) != len(capacities) for v in hit_rates.values()):
        raise ValueError("every series needs one value per capacity")
    if unique_tokens <= 0:
        raise ValueError(f"unique_tokens must be > 0, got {unique_tokens}")
    xs = [100 * c / unique_tokens for c in capacities]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.axhline(infinite, color="0.5", linestyle=":", label=f"infinite cache ({infinite:.1%})")
    for k, (name, rates) in enumerate(hit_rates.items()):
        colour, marker, line = _POLICY_STYLES.get(name, (_COLOURS[k % len(_COLOURS)], ".", "-"))
        ax.plot(xs, rates, marker=marker, linestyle=line, color=colour, label=name)
    ax.set_xlabel("KV pool size (% of the trace's unique tokens)")
    ax.set_ylabel("hit rate (prompt tokens)")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    ax.legend(frameon=False, fontsize=8, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def _request_colours(names: Sequence[str]) -> dict[str, str]:
    if len(names) > len(REQUEST_COLOURS):
        raise ValueError(f"at most {len(REQUEST_COLOURS)} requests, got {len(names)}")
    return dict(zip(names, REQUEST_COLOURS, strict=False))


def _block_axes(ax: Axes, num_blocks: int, block_size: int, offset_label: str) -> None:
    """Rows ``block 0..`` top-down, columns one per slot offset within the block."""
    ax.set_xlim(0, block_size)
    ax.set_ylim(num_blocks, 0)
    ax.set_xticks(
        [o + 0.5 for o in range(block_size)], [offset_label.format(o) for o in range(block_size)]
    )
    ax.set_yticks([b + 0.5 for b in range(num_blocks)], [f"block {b}" for b in range(num_blocks)])
    ax.tick_params(length=0)


def block_pool_chart(
    num_blocks: int,
    block_size: int,
    requests: Mapping[str, tuple[Sequence[int], Sequence[str]]],
    title: str,
) -> Figure:
    """A paged KV pool: one row per block, one cell per slot (its slot id in small print),
    each request's blocks in its colour with its tokens written in; reserved slots that hold
    no token yet are hatched, blocks nobody owns say "free".

    Args:
        num_blocks, block_size: the pool's shape (slot ``s`` is offset ``s % block_size`` of
            block ``s // block_size``).
        requests: ``{name: (block_table, tokens as text)}``, at most five; token ``i`` sits in
            slot ``block_table[i // block_size] * block_size + i % block_size``.
        title: the picture's title.

    Raises:
        ValueError: more than five requests.
    """
    colours = _request_colours(list(requests))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    owned = {block for table, _ in requests.values() for block in table}
    for b in range(num_blocks):
        for o in range(block_size):
            ax.add_patch(Rectangle((o, b), 1, 1, facecolor="white", edgecolor="0.6"))
            ax.text(o + 0.06, b + 0.22, b * block_size + o, fontsize=6, color="0.4")
        if b not in owned:
            ax.text(block_size / 2, b + 0.6, "free", ha="center", color="0.5", style="italic")
    for name, (table, tokens) in requests.items():
        for i, block in enumerate(table):
            for o in range(block_size):
                pos = i * block_size + o
                used = pos < len(tokens)
                ax.add_patch(
                    Rectangle(
                        (o, block),
                        1,
                        1,
                        facecolor=colours[name],
                        edgecolor="0.6",
                        alpha=1.0 if used else 0.35,
                        hatch=None if used else "//",
                    )
                )
                if used:
                    ax.text(o + 0.5, block + 0.6, tokens[pos].strip(), ha="center", fontsize=8)
    _block_axes(ax, num_blocks, block_size, "offset {}")
    ax.set_title(title, fontsize=10)
    handles = [
        Patch(facecolor=colours[name], label=f"{name}: block_table {list(table)}")
        for name, (table, _) in requests.items()
    ]
    handles.append(Patch(facecolor="white", hatch="//", label="reserved, no token yet"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    fig.tight_layout()
    return fig


def paged_batch_chart(
    num_blocks: int,
    block_size: int,
    block_tables: Mapping[str, Sequence[int]],
    tokens: Mapping[str, Sequence[str]],
    query_lens: Mapping[str, int],
    kv_slots: Any,
    mask: Any,
) -> Figure:
    """One paged-attention step. Left, the pool: each sequence's tokens in its blocks, the
    slots this step writes (``slot_mapping`` of the last ``query_lens`` tokens) with a thick
    border. Right, the gathered batch: per sequence its ``kv_slots`` row (the slot read at each
    context index and the token found there, "pad" past its length), then one row per padded
    query of ``mask``: coloured where the query may attend, white where masked, hatched for a
    padded query row.

    Args:
        num_blocks, block_size: the pool's shape.
        block_tables: ``{name: block_table}``, at most five sequences, in batch order.
        tokens: ``{name: the sequence's context tokens as text}`` (its length is the
            sequence's ``seq_len``).
        query_lens: ``{name: new tokens this step}``.
        kv_slots: ``[batch, max_seq_len]`` slot ids (a tensor or an array).
        mask: ``[batch, 1, max_query_len, max_seq_len]`` booleans, True where attended
            (``AttentionMetadata.mask``).

    Raises:
        ValueError: more than five sequences.
    """
    names = list(block_tables)
    colours = _request_colours(names)
    seq_lens = {n: len(tokens[n]) for n in names}
    fig, (ax_pool, ax_batch) = plt.subplots(1, 2, figsize=(10, 4.4), width_ratios=[4, 9])

    owner = {b: (n, i) for n, table in block_tables.items() for i, b in enumerate(table)}
    new = {n: range(seq_lens[n] - query_lens[n], seq_lens[n]) for n in names}
    written = {s for n in names for s in slot_mapping(block_tables[n], new[n], block_size)}
    for b in range(num_blocks):
        for o in range(block_size):
            slot, fill, label = b * block_size + o, "white", ""
            if b in owner:
                name, i = owner[b]
                pos = i * block_size + o
                if pos < seq_lens[name]:
                    fill, label = colours[name], tokens[name][pos]
            lw = 2.5 if slot in written else 0.8
            ax_pool.add_patch(
                Rectangle((o, b), 1, 1, facecolor=fill, edgecolor="0.2" if lw > 1 else "0.6", lw=lw)
            )
            ax_pool.text(o + 0.06, b + 0.25, slot, fontsize=6, color="0.4")
            ax_pool.text(o + 0.5, b + 0.68, label, ha="center", fontsize=7)
    _block_axes(ax_pool, num_blocks, block_size, "+{}")
    ax_pool.set_title(f"KV pool (block_size={block_size})", fontsize=10)

    max_seq_len, max_query_len = kv_slots.shape[1], mask.shape[2]
    slot_token = {
        slot_mapping(block_tables[n], [p], block_size)[0]: tokens[n][p]
        for n in names
        for p in range(seq_lens[n])
    }
    row, yticks, ylabels = 0.0, [], []
    for b, name in enumerate(names):
        for j in range(max_seq_len):  # the kv_slots row: slot id and the token read from it
            slot, pad = int(kv_slots[b, j]), j >= seq_lens[name]
            ax_batch.add_patch(
                Rectangle(
                    (j, row),
                    1,
                    1,
                    facecolor="0.85" if pad else colours[name],
                    edgecolor="0.6",
                    alpha=1.0 if pad else 0.5,
                )
            )
            ax_batch.text(j + 0.06, row + 0.25, slot, fontsize=6, color="0.3")
            ax_batch.text(
                j + 0.5,
                row + 0.7,
                slot_token.get(slot, "") if not pad else "pad",
                ha="center",
                fontsize=7,
                style="italic" if pad else "normal",
            )
        yticks.append(row + 0.5)
        ylabels.append(f"{name}: kv_slots (read)")
        row += 1
        for i in range(max_query_len):  # the mask rows of this sequence's padded queries
            real = i < query_lens[name]
            for j in range(max_seq_len):
                allowed = bool(mask[b, 0, i, j])
                colour = (colours[name] if real else "0.85") if allowed else "white"
                ax_batch.add_patch(
                    Rectangle(
                        (j, row),
                        1,
                        1,
                        facecolor=colour,
                        edgecolor="0.6",
                        hatch=None if real else "//",
                    )
                )
            pos = seq_lens[name] - query_lens[name] + i
            yticks.append(row + 0.5)
            ylabels.append(f"query {tokens[name][pos]!r}" if real else "padded query")
            row += 1
        row += 0.4  # a gap between sequences
    ax_batch.set_xlim(0, max_seq_len)
    ax_batch.set_ylim(row - 0.4, 0)
    ax_batch.set_xticks([j + 0.5 for j in range(max_seq_len)], range(max_seq_len))
    ax_batch.set_yticks(yticks, ylabels, fontsize=8)
    ax_batch.set_xlabel("context index (key)")
    ax_batch.tick_params(length=0)
    ax_batch.set_title(
        "gathered batch: kv_slots and mask [batch, max_query_len, max_seq_len]", fontsize=10
    )
    handles = [Patch(facecolor=colours[n], label=n) for n in names]
    handles += [
        Patch(facecolor="white", edgecolor="0.2", lw=2.5, label="written this step"),
        Patch(facecolor="0.85", label="padding"),
        Patch(facecolor="white", edgecolor="0.6", label="masked"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


FORCED = "#00897b"  # viz.svg.FORCED: tokens a grammar forced


def forced_tokens_chart(
    pieces: Sequence[str],
    forced: Sequence[bool],
    title: str = "the answer's tokens: forced by the grammar (teal) or chosen by the model",
    line_chars: int = 64,
) -> Figure:
    """An answer's tokens as boxes in reading order, wrapped into lines of ``line_chars``
    characters: teal where the grammar forced the token (jump-forward appended it), white where
    the model chose it (one engine step each). Spaces are drawn as ``␣``.

    Args:
        pieces: each token's text (``tokenizer.decode([t])``), in order.
        forced: one flag per token.

    Raises:
        ValueError: ``forced`` does not have one flag per token, or ``line_chars < 8``.
    """
    if len(forced) != len(pieces):
        raise ValueError("forced needs one flag per token")
    if line_chars < 8:
        raise ValueError(f"line_chars must be >= 8, got {line_chars}")
    places, x, line = [], 0, 0  # (x, line, width) in characters
    for piece in pieces:
        width = max(len(piece), 1)
        if x + width > line_chars and x > 0:
            x, line = 0, line + 1
        places.append((x, line, width))
        x += width
    lines = line + 1
    fig, ax = plt.subplots(figsize=(7.6, 0.42 * lines + 0.55))
    for piece, is_forced, (x, y, width) in zip(pieces, forced, places, strict=True):
        ax.add_patch(
            Rectangle(
                (x + 0.06, -y - 0.82),
                width - 0.12,
                0.64,
                facecolor=FORCED if is_forced else "white",
                edgecolor="white" if is_forced else "0.35",
                linewidth=0.8,
            )
        )
        ax.text(
            x + width / 2,
            -y - 0.5,
            piece.replace(" ", "␣"),
            ha="center",
            va="center",
            family="monospace",
            fontsize=8,
            color="white" if is_forced else "black",
        )
    ax.set_xlim(0, line_chars)
    ax.set_ylim(-lines - 0.05, 0)
    ax.axis("off")
    chosen = len(forced) - sum(forced)
    ax.set_title(
        f"{title}\n{len(pieces)} tokens: {chosen} chosen, {sum(forced)} forced", fontsize=9
    )
    ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="0.35", label="chosen by the model (a step each)"),
            Patch(facecolor=FORCED, edgecolor=FORCED, label="forced (appended by jump-forward)"),
        ],
        fontsize=7,
        loc="lower center",
        bbox_to_anchor=(0.5, -0.02 - 0.5 / lines),
        ncols=2,
        frameon=False,
    )
    fig.tight_layout()
    return fig


# Router policies of chapter 10: (colour, marker, line style).
_ROUTING_STYLES = {
    "round_robin": ("0.45", "o", "-"),
    "random": ("#c9a227", "v", "-"),
    "power_of_two": ("#e6550d", "s", "-"),
    "cache_aware": ("#3182bd", "o", "-"),
    "kv_aware": ("#31a354", "x", "--"),
}
# Worker 0 and worker 1 of a run's request split (dark, light), per kind of worker.
_WORKER_SHADES = (("#3182bd", "#9ecae1"), ("#e6550d", "#fdae6b"), ("#31a354", "#a1d99b"))


def routing_runs_chart(
    runs: Mapping[str, Sequence[Any]],
    best: float | None = None,
    baseline: float | None = None,
    baseline_label: str = "round robin",
    title: str = "two workers behind the real routers",
) -> Figure:
    """Measured router runs: above, each run's hit rate, one marker per kind of worker; below,
    how its requests split between the workers (stacked, worker 0 dark), one bar per kind.

    Args:
        runs: ``{kind of worker: runs}``, each run with ``router``, ``policy``,
            ``concurrency``, ``hit_rate`` and ``requests`` (one count per worker), as
            :class:`minirad.bench.replicas.RouteRun` has; every kind lists the same
            (router, policy, concurrency) in the same order (the x axis).
        best: the best hit rate any router could reach, drawn as a dotted line.
        baseline: another reference hit rate, drawn dashed, named ``baseline_label``.

    Raises:
        ValueError: no runs, or kinds that do not list the same runs in the same order.
    """
    kinds = list(runs)
    if not kinds or not runs[kinds[0]]:
        raise ValueError("no runs to draw")
    if len(kinds) > len(_WORKER_SHADES):
        raise ValueError(f"at most {len(_WORKER_SHADES)} kinds of worker, got {len(kinds)}")
    keys = [(r.router, r.policy, r.concurrency) for r in runs[kinds[0]]]
    for kind in kinds[1:]:
        if [(r.router, r.policy, r.concurrency) for r in runs[kind]] != keys:
            raise ValueError(f"{kind!r} does not list the runs of {kinds[0]!r} in its order")
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(7.6, 4.6), sharex=True, gridspec_kw={"height_ratios": [1, 1.2]}
    )
    xs = range(len(keys))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        offset = (k - (len(kinds) - 1) / 2) * width
        dark, light = _WORKER_SHADES[k]
        top.plot(
            [x + offset for x in xs],
            [r.hit_rate for r in runs[kind]],
            linestyle="none",
            marker="o",
            color=dark,
            label=f"{kind} workers",
        )
        first = [r.requests[0] for r in runs[kind]]
        rest = [sum(r.requests[1:]) for r in runs[kind]]
        at = [x + offset for x in xs]
        bottom.bar(at, first, width=width * 0.9, color=dark, label=f"{kind}: worker 0")
        bottom.bar(
            at, rest, width=width * 0.9, bottom=first, color=light, label=f"{kind}: worker 1"
        )
    if best is not None:
        top.axhline(
            best, color="black", linestyle=":", linewidth=1, label=f"best possible {best:.3f}"
        )
    if baseline is not None:
        top.axhline(
            baseline,
            color="0.5",
            linestyle="--",
            linewidth=1,
            label=f"{baseline_label} {baseline:.3f}",
        )
    starts = [x for x in range(len(keys)) if x == 0 or keys[x][:2] != keys[x - 1][:2]]
    for x in starts[1:]:  # a thin line between two routes
        for ax in (top, bottom):
            ax.axvline(x - 0.5, color="0.85", linewidth=0.8)
    for a, b in zip(starts, [*starts[1:], len(keys)], strict=True):  # each route, named once
        router, policy, _ = keys[a]
        bottom.annotate(
            f"{policy}\n{router}-router",
            ((a + b - 1) / 2, 0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -16),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=7,
        )
    top.set_ylabel("hit rate", fontsize=8)
    top.set_title(title, fontsize=10, pad=22)
    top.legend(fontsize=7, frameon=False, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 0.98))
    bottom.set_ylabel("requests per worker", fontsize=8)
    bottom.legend(
        fontsize=7,
        frameon=False,
        ncols=2 * len(kinds),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.36),
    )
    bottom.set_xticks(list(xs), [str(c) for _, _, c in keys], fontsize=7)
    bottom.set_xlabel("clients", fontsize=7, labelpad=1)
    bottom.xaxis.set_label_coords(-0.045, -0.02)
    for ax in (top, bottom):
        ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


def replica_sweep_chart(
    xs: Sequence[float],
    hit_rates: Mapping[str, Sequence[float]],
    imbalance: Mapping[str, Sequence[float]],
    xlabel: str,
    title: str = "",
    log_x: bool = False,
) -> Figure:
    """Two panels over a swept quantity (the number of replicas, the traffic skew): left, each
    policy's hit rate; right, its load imbalance (max / mean requests per replica, 1 is even).

    Args:
        xs: the swept values (the x axis of both panels).
        hit_rates, imbalance: ``{policy: one value per x}``; policies named as in
            :data:`minirad.cluster.routing.POLICIES` get their own styles.
        xlabel: what ``xs`` are.
        log_x: a base-2 logarithmic x axis (replica counts 2, 4, ... 64).

    Raises:
        ValueError: a series does not have one value per x.
    """
    series = list(hit_rates.values()) + list(imbalance.values())
    if any(len(v) != len(xs) for v in series):
        raise ValueError("every series needs one value per x")
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.6, 2.9))
    for ax, values, ylabel in (
        (left, hit_rates, "hit rate (prompt tokens)"),
        (right, imbalance, "requests: max / mean replica"),
    ):
        for k, (name, ys) in enumerate(values.items()):
            colour, marker, line = _ROUTING_STYLES.get(
                name, (_COLOURS[k % len(_COLOURS)], ".", "-")
            )
            ax.plot(xs, ys, marker=marker, linestyle=line, color=colour, label=name)
        if log_x:
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    left.set_ylim(0, 1)
    right.set_ylim(bottom=0)
    right.axhline(1, color="0.7", linestyle=":", linewidth=1)
    left.legend(fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# SGLang's UnifiedRadixCache components (sglang/srt/mem_cache/unified_cache/components/).
UNIFIED_COMPONENTS = ("full", "swa", "mamba")
_COMPONENT_STYLES = {
    "full": ("#3182bd", "full attention: every node to the root"),
    "swa": ("#31a354", "sliding window of {window}: up to the window"),
    "mamba": ("#e6550d", "Mamba state: the last node only"),
}


def unified_locks(lengths: Sequence[int], window: int) -> dict[str, list[bool]]:
    """Which nodes of a root-to-leaf path (``lengths``: each node's tokens, root first) a
    request that matched the whole path locks, per component of SGLang's
    ``UnifiedRadixCache``: full attention every node (a path lock, as chapter 01's tree);
    sliding window the nodes from the last one up until they hold ``window`` tokens (the
    window lock); Mamba the last node only (its state is one per node, not per token).

    Raises:
        ValueError: no node, a node of no tokens, or ``window < 1``.
    """
    if not lengths or any(n < 1 for n in lengths) or window < 1:
        raise ValueError(f"need nodes of >= 1 token and window >= 1, got {lengths}, {window}")
    swa = window_lock_mask(list(lengths), window)  # the rule lives in minirad.kvcache
    last = [i == len(lengths) - 1 for i in range(len(lengths))]
    return {"full": [True] * len(lengths), "swa": swa, "mamba": last}


def unified_locks_chart(
    nodes: Sequence[tuple[str, int]],
    window: int,
    title: str = "what a request at the end of this path locks, per component",
) -> Figure:
    """One path of SGLang's radix tree, drawn once per component of its
    ``UnifiedRadixCache``: a node is filled where the component locks it for a request that
    matched the whole path (:func:`unified_locks`), hatched where it does not, so that the
    component may evict its data there while the request runs (an inner node that loses its
    sliding-window KV or Mamba state stays in the tree, a tombstone, for full attention).
    Nodes are as wide as their tokens.

    Args:
        nodes: ``(label, tokens)`` per node, root first.
        window: the sliding window, in tokens.

    Raises:
        ValueError: as :func:`unified_locks`.
    """
    lengths = [n for _, n in nodes]
    locks = unified_locks(lengths, window)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    total = sum(lengths)
    fig, ax = plt.subplots(figsize=(7.6, 2.5))
    for row, name in enumerate(UNIFIED_COMPONENTS):
        colour, label = _COMPONENT_STYLES[name]
        y = -row
        for start, n, locked in zip(starts, lengths, locks[name], strict=True):
            ax.add_patch(
                Rectangle(
                    (start + 0.3, y - 0.38),
                    n - 0.6,
                    0.76,
                    facecolor=colour if locked else "white",
                    edgecolor=colour,
                    hatch=None if locked else "////",
                    linewidth=1.0,
                    alpha=0.85 if locked else 0.6,
                )
            )
            ax.text(
                start + n / 2,
                y,
                "locked" if locked else "not locked",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if locked else "0.3",
            )
        ax.text(-1, y, label.format(window=window), ha="right", va="center", fontsize=8)
    for (text, n), start in zip(nodes, starts, strict=True):
        ax.text(start + n / 2, 0.62, f"{text} ({n})", ha="center", va="bottom", fontsize=7)
    ax.set_xlim(-total * 0.75, total + 0.5)
    ax.set_ylim(-len(UNIFIED_COMPONENTS) + 0.45, 1.1)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
