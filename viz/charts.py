"""Charts of the course's measurements (matplotlib), so that chapters show ideas, not plotting.

Example::

    fig = cached_tokens_chart(
        ["r1", "r2"], {"vLLM (32-token blocks)": [0, 64], "minirad radix tree": [0, 89]},
        prompt_tokens=[98, 101],
    )
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["cached_tokens_chart"]

_COLOURS = ("#9ecae1", "#3182bd", "#31a354", "#e6550d")


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
