"""Chapter 11's pictures of a hierarchical KV cache: where each node's KV is, what a load-back
costs against a recompute, and the hit rates the tiers buy.

- :func:`tier_lines`: a :class:`~minirad.kvcache.hiradix_cache.HiRadixCache` as text, one node a
  line, with the tiers that hold its KV (``RadixCache.pretty_print`` shows the device only).
- :func:`transfer_cost_chart`: load-back time over each link against recompute time, by prefix
  length, with the break-even lengths of :mod:`minirad.kvcache.transfer_cost` marked.
- :func:`tier_hits_chart`: prompt tokens served by each tier per run, beside Belady's MIN.

The charts are matplotlib figures (imported when drawn); nothing here imports the visualizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from minirad.kvcache.transfer_cost import (
    TierLink,
    break_even_tokens,
    load_time_s,
    recompute_time_s,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from minirad.kvcache.radix_cache import RadixCache, TreeNode

__all__ = ["TIER_COLORS", "node_tiers", "tier_hits_chart", "tier_lines", "transfer_cost_chart"]

# The visualizer's tier colours (device slate, host brown, disk olive), for the charts.
TIER_COLORS = {"device": "#37474f", "host": "#8d6e63", "disk": "#827717"}


def node_tiers(node: TreeNode) -> tuple[str, ...]:
    """Where ``node``'s KV is: ``"device"`` (device slots), ``"host"`` (a host copy), ``"disk"``
    (its storage pages are written), in that order."""
    on = (
        bool(node.value),
        getattr(node, "host_value", None) is not None,
        getattr(node, "on_disk", False),
    )
    return tuple(t for t, o in zip(("device", "host", "disk"), on, strict=True) if o)


def tier_lines(
    cache: RadixCache, decode: Callable[[list[int]], str] | None = None, max_chars: int = 36
) -> str:
    """The tree, one node a line, depth first (children in key order): id, tokens, tiers
    (``host only`` for a demoted node), and the edge's text (``decode``) or token ids."""
    lines = [f"root  device {cache.total_size()} tokens, host {cache.host_size()} tokens"]

    def walk(node: TreeNode, depth: int) -> None:
        for child in sorted(node.children.values(), key=lambda n: n.key):
            tiers = node_tiers(child)
            where = (
                "+".join(tiers)
                if "device" in tiers
                else "host only" + ("+disk" if "disk" in tiers else "")
            )
            text = repr(decode(child.key)) if decode is not None else str(child.key)
            if len(text) > max_chars:
                text = text[: max_chars - 3] + "..."
            pad = "  " * depth
            lines.append(f"{pad}[{child.id}] {len(child.key):>3} tok  {where:<18} {text}")
            walk(child, depth + 1)

    walk(cache.root_node, 1)
    return "\n".join(lines)


def transfer_cost_chart(
    bytes_per_token: int,
    links: Sequence[TierLink],
    prefill_tokens_per_s: float,
    lengths: Sequence[int] = (1, 4, 16, 64, 256, 1024, 4096, 16384),
    title: str | None = None,
) -> Figure:
    """Load-back time over each of ``links`` and recompute time, against the prefix length
    (both axes logarithmic); a dot where a link's line crosses the recompute line (its
    break-even length), none for a link that never pays."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = list(lengths)
    ms = [1e3 * recompute_time_s(n, prefill_tokens_per_s) for n in xs]
    ax.plot(
        xs,
        ms,
        color="black",
        linestyle="--",
        linewidth=2,
        label=f"recompute ({prefill_tokens_per_s:,.0f} tok/s)",
    )
    for link in links:
        (line,) = ax.plot(
            xs,
            [1e3 * load_time_s(n, bytes_per_token, link) for n in xs],
            marker=".",
            label=f"{link.name} ({link.bandwidth_gb_s:g} GB/s, {link.latency_us:g} us)",
        )
        even = break_even_tokens(bytes_per_token, link, prefill_tokens_per_s)
        if even is not None and xs[0] <= even <= xs[-1]:
            ax.plot([even], [1e3 * even / prefill_tokens_per_s], "o", color=line.get_color(), ms=8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prefix length (tokens)",
        ylabel="time (ms)",
        title=title or f"load back vs recompute, {bytes_per_token:,} bytes of KV per token",
    )
    ax.grid(True, which="major", color="#dddddd", linewidth=0.6)
    ax.legend(frameon=False, fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def tier_hits_chart(
    labels: Sequence[str],
    device: Sequence[int],
    host: Sequence[int],
    prompt_tokens: int,
    optimal: Sequence[float | None] = (),
    disk: Sequence[int] = (),
    title: str = "prompt tokens served by each tier",
) -> Figure:
    """One stacked bar per run: the share of ``prompt_tokens`` the device held, the host
    loaded back (``host``, of which ``disk`` was read from the disk first: drawn apart), and a
    black tick at Belady's MIN for the run's total capacity (``optimal``, hit rates; None for
    none)."""
    import matplotlib.pyplot as plt

    n = len(labels)
    disk = list(disk) or [0] * n
    dev = [d / prompt_tokens for d in device]
    from_host = [(h - k) / prompt_tokens for h, k in zip(host, disk, strict=True)]
    from_disk = [k / prompt_tokens for k in disk]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = range(n)
    ax.bar(x, dev, color=TIER_COLORS["device"], label="device hit")
    ax.bar(x, from_host, bottom=dev, color=TIER_COLORS["host"], label="loaded back from host")
    if any(from_disk):
        bottom = [a + b for a, b in zip(dev, from_host, strict=True)]
        ax.bar(x, from_disk, bottom=bottom, color=TIER_COLORS["disk"], label="read from disk")
    for i, best in enumerate(optimal):
        if best is not None:
            ax.plot([i - 0.4, i + 0.4], [best, best], color="black", linewidth=2)
            ax.text(i, best + 0.015, f"MIN {best:.0%}", ha="center", fontsize=7)
    for i in x:
        total = dev[i] + from_host[i] + from_disk[i]
        ax.text(i, total / 2, f"{total:.1%}", ha="center", color="white", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set(ylim=(0, 1.15), ylabel="hit rate, % of prompt tokens", title=title)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0], ["0%", "25%", "50%", "75%", "100%"])
    ax.legend(frameon=False, fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    return fig
