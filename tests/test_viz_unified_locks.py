"""What chapter 08's picture of SGLang's ``UnifiedRadixCache`` says each component locks
(``viz.charts.unified_locks``), held to the lock rules of SGLang's component README
(``sglang/srt/mem_cache/unified_cache/components/README.md``): full attention locks every node
to the root, the sliding window walks up from the request's node until its nodes hold the
window (whole nodes, the one that fills it included), Mamba locks the request's node alone.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from viz.charts import UNIFIED_COMPONENTS, unified_locks, unified_locks_chart


@pytest.mark.parametrize(
    ("lengths", "window", "swa"),
    [
        ([24, 9, 7], 8, [False, True, True]),  # the leaf (7) is short of 8: its parent too
        ([24, 9, 7], 7, [False, False, True]),  # the leaf alone fills the window
        ([24, 9, 7], 16, [False, True, True]),  # 7 + 9 = 16: filled at the question node
        ([24, 9, 7], 17, [True, True, True]),  # past the question node: up to the root
        ([5], 100, [True]),  # a path shorter than the window: all of it
    ],
)
def test_each_component_locks_its_own_segment(lengths, window, swa):
    locks = unified_locks(lengths, window)
    assert locks["full"] == [True] * len(lengths)
    assert locks["swa"] == swa
    assert locks["mamba"] == [False] * (len(lengths) - 1) + [True]


@pytest.mark.parametrize(("lengths", "window"), [([], 8), ([3, 0], 8), ([3], 0)])
def test_bad_paths_are_refused(lengths, window):
    with pytest.raises(ValueError):
        unified_locks(lengths, window)


def test_the_chart_draws_one_row_per_component():
    fig = unified_locks_chart([("system", 24), ("question", 9), ("answer", 7)], window=8)
    [ax] = fig.axes
    texts = [t.get_text() for t in ax.texts]
    assert texts.count("locked") == 3 + 2 + 1 and texts.count("not locked") == 0 + 1 + 2
    assert len(ax.patches) == 3 * len(UNIFIED_COMPONENTS)
    assert "sliding window of 8: up to the window" in texts
    plt.close(fig)
