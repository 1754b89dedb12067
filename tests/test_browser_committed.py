"""The committed chapters as a learner first sees them, in real JupyterLab and chromium.

- Opened without running anything, after ``make lab``'s ``jupyter trust``: every committed
  picture draws (graphviz trees and chapter 07's SVG frames as images, matplotlib PNGs) and
  every player draws from the widget state saved in the file (``make notebooks`` stores it;
  anywidget's state carries the player's JavaScript), and it steps with no kernel behind it.
  Untrusted, JupyterLab shows none of them: SVG and widgets need a trusted notebook. No
  widget draws as JupyterLab's broken-widget icon (a model it cannot load or find), and
  chapter 10's request slider moves both trees with no kernel behind it.
- Run, then saved, under ``make lab``'s server config (``tools/jupyter_server_config.py``): the
  clone stays clean; an edited cell is saved as usual.

The committed notebooks must have been executed by ``make notebooks``. Skipped only when
chromium or the playwright package is missing; the tooling is in ``tests/browser_tools.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from browser_tools import Console, jupyter_lab, missing, run_all_cells

ROOT = Path(__file__).resolve().parent.parent
REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# A chapter of graphviz trees, the visualizer chapter (SVG frames and four players), and the
# two chapters whose players are filled from KV events (vLLM's recording; several replicas
# side by side, two players in one output).
CHAPTERS = (
    "notebooks/01_radix_tree.ipynb",
    "notebooks/07_visualizer.ipynb",
    "notebooks/08_real_engines.ipynb",
    "notebooks/10_replicas.ipynb",
)
IMAGE_TYPES = ("image/svg+xml", "image/png")
WIDGET = "application/vnd.jupyter.widget-view+json"
# What JupyterLab prints in place of a picture or a player it does not draw.
# "no frames yet": a player whose frames the file did not keep. ipywidgets 8 draws a widget it
# cannot create as a broken-file icon (.jupyter-widgets-error-widget) over "Click to show
# javascript error."; a widget output whose model is not in the file says "Error displaying
# widget: model not found". A widget with no kernel behind it gets a red broken-chain icon
# (.jupyter-widgets-disconnected), which viz hides on its own widgets: they work without one.
NOT_DRAWN = (
    "object at 0x",
    "Digraph at 0x",
    "SVG object>",
    "Error displaying widget",
    "Click to show javascript error",
    "model not found",
    "no frames yet",
)


def expected_outputs(notebook: Path) -> list[dict[str, int]]:
    """Per code cell of the file: how many image outputs and widget outputs it holds."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    counts = []
    for cell in (c for c in cells if c["cell_type"] == "code"):
        data = [o.get("data", {}) for o in cell.get("outputs", [])]
        counts.append(
            {
                "images": sum(WIDGET not in d and any(t in d for t in IMAGE_TYPES) for d in data),
                "widgets": sum(WIDGET in d for d in data),
            }
        )
    return counts


# Per code cell of the open notebook: its drawn pictures (<img>, or an inline <svg> that is no
# part of a player), its outputs that hold players, and its output texts.
_SHOWN = """
() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]
  .map((cell) => {
    const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')];
    return {
      images: outputs.filter((o) => !o.querySelector('.radix-view') &&
        o.querySelector('img, svg')).length,
      widgets: outputs.filter((o) => o.querySelector('.radix-view .rv-counter')).length,
      broken: cell.querySelectorAll('.jupyter-widgets-error-widget').length,
      // ipywidgets' red broken-chain icon (no kernel), where it shows
      unlinked: [...cell.querySelectorAll('.jupyter-widgets-disconnected')].filter((e) =>
        getComputedStyle(e, '::before').display !== 'none').length,
      text: outputs.map((o) => o.textContent).join('\\n'),
    };
  })
"""


def trust(data_dir: Path, notebooks: list[Path]) -> None:
    """``make lab``'s ``jupyter trust``, with its signatures kept in ``data_dir``."""
    env = dict(os.environ, JUPYTER_DATA_DIR=str(data_dir))
    cmd = [sys.executable, "-m", "jupyter", "trust", *map(str, notebooks)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)


# Untrusted, the same wait would always last its 60 s: no player ever draws. There the wait is
# for every output the file holds to have its renderer chosen (JupyterLab marks the rendered
# element with its MIME type, and keeps the choice): what it shows then is what it will show.
_RENDERERS = """(n) => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  if (!panel || panel.querySelectorAll('.jp-CodeCell').length !== n[0]) return null;
  const outputs = [...panel.querySelectorAll('.jp-CodeCell .jp-OutputArea-output')];
  const mimes = outputs.map((o) => o.getAttribute('data-mime-type') ||
    o.querySelector('[data-mime-type]')?.getAttribute('data-mime-type'));
  return outputs.length === n[1] && mimes.every(Boolean) ? mimes : null;
}"""


def open_unrun(page, lab, notebook: str, root: Path, trusted: bool = True) -> list[dict]:
    """Open ``notebook`` in a fresh workspace, run nothing, and wait until every code cell and
    every output the file holds is drawn (or 60 s); ``trusted=False``: until every output has
    its renderer (and none is a player's). Returns :data:`_SHOWN`."""
    expected = expected_outputs(root / notebook)
    page.goto(lab.tree(notebook) + "&reset")
    settled = """(n) => { const cells = document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell');
      return cells.length === n[0] &&
        [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')]
          .filter((o) => o.querySelector('.radix-view .rv-counter')).length >= n[1]; }"""
    total_widgets = sum(c["widgets"] for c in expected)
    arg = [len(expected), total_widgets]
    if not trusted:
        cells = json.loads((root / notebook).read_text(encoding="utf-8"))["cells"]
        settled = _RENDERERS
        arg = [len(expected), sum(len(c.get("outputs", [])) for c in cells if "outputs" in c)]
    try:
        mimes = page.wait_for_function(settled, arg=arg, timeout=60_000, polling=250).json_value()
    except Exception:  # noqa: BLE001 (the assertions below say what is missing)
        mimes = []
    if not trusted:
        assert WIDGET not in mimes, f"{notebook}: an untrusted output chose a player's renderer"
    return page.evaluate(_SHOWN)


def check_drawn(shown: list[dict], expected: list[dict], notebook: str) -> None:
    assert len(shown) == len(expected), f"{notebook}: {len(shown)} code cells drawn"
    for i, (got, want) in enumerate(zip(shown, expected, strict=True)):
        where = f"{notebook}, code cell {i}"
        missed = [t for t in NOT_DRAWN if t in got["text"]]
        assert not missed, f"{where} shows text instead of a picture: {got['text'][:300]}"
        assert not got["broken"], f"{where}: {got['broken']} broken widget icons"
        assert not got["unlinked"], f"{where}: {got['unlinked']} broken-chain widget icons"
        assert got["images"] >= want["images"], f"{where}: {got['images']} of {want} images"
        assert got["widgets"] == want["widgets"], f"{where}: {got['widgets']} of {want} players"


@pytest.fixture(scope="module")
def trusted_lab(tmp_path_factory):
    """JupyterLab over the repository after ``jupyter trust`` on every chapter (its
    signature database in a temporary Jupyter data folder)."""
    tmp = tmp_path_factory.mktemp("lab")
    trust(tmp / "data", sorted((ROOT / "notebooks").glob("*.ipynb")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(tmp / "data"))
        with jupyter_lab(tmp) as lab:
            yield lab


@pytest.mark.parametrize("notebook", CHAPTERS)
def test_committed_pictures_and_players_draw_before_running(trusted_lab, page, notebook):
    console = Console().watch(page)
    expected = expected_outputs(ROOT / notebook)
    assert sum(c["images"] + c["widgets"] for c in expected), f"{notebook} has no pictures"
    check_drawn(open_unrun(page, trusted_lab, notebook, ROOT), expected, notebook)
    if any(c["widgets"] for c in expected):
        steps_a_player(page)
    assert not widget_errors(console)


def steps_a_player(page) -> None:
    """A player of the open notebook steps through its saved frames (no kernel behind it)."""
    view = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .radix-view").first
    before = view.locator(".rv-counter").text_content()
    shown, total = before.split(" / ")
    # A player saved at its last frame steps back; any other steps forward.
    view.locator(".rv-back" if shown == total else ".rv-fwd").click()
    page.wait_for_function(
        "([el, text]) => el.textContent !== text",
        arg=[view.locator(".rv-counter").element_handle(), before],
        timeout=10_000,
    )


def widget_errors(console: Console) -> list[str]:
    """The page's errors about widgets or their models ("widget model not found"...)."""
    return [e for e in console.errors if "widget" in e.lower() or "model" in e.lower()]


def test_untrusted_chapter_shows_no_pictures(page, tmp_path):
    """Why ``make lab`` trusts the chapters: without it the same file draws none of them."""
    notebook = "notebooks/07_visualizer.ipynb"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
        with jupyter_lab(tmp_path) as lab:
            shown = open_unrun(page, lab, notebook, ROOT, trusted=False)
    assert not any(c["widgets"] for c in shown)
    assert any("SVG object>" in c["text"] for c in shown)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def save(page) -> None:
    """File > Save, and wait until the notebook is no longer marked dirty."""
    page.keyboard.press("Control+s")
    page.wait_for_function(
        """() => !document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)')
             ?.closest('.lm-DockPanel')?.querySelector('.lm-TabBar-tab.lm-mod-current.jp-mod-dirty')""",
        timeout=30_000,
    )
    page.wait_for_timeout(500)  # the server has answered the save before the tab updates


def test_running_a_chapter_leaves_the_clone_clean(page, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    notebook = "notebooks/00_tour.ipynb"
    lab_tmp = tmp_path / "lab"
    lab_tmp.mkdir()
    with jupyter_lab(lab_tmp, root=clone) as lab:  # make lab's server config, the hook
        run_all_cells(page, lab, notebook, root=clone, timeout=300)
        save(page)
        status = git(clone, "status", "--porcelain")
        assert status == "", f"running {notebook} changed the clone:\n{status}"
        # An edited cell is the learner's: saved as usual.
        cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").first
        cell.locator(".cm-content").click()
        page.keyboard.press("Control+End")
        page.keyboard.type("\n# my note")
        save(page)
        assert git(clone, "status", "--porcelain").split() == ["M", notebook]
    assert "# my note" in (clone / notebook).read_text(encoding="utf-8")


# ---------------------------------------------------------------------- chapter 10's slider
_ROUTE_VIEW = """
(out) => ({
  counters: [...out.querySelectorAll('.radix-view .rv-counter')].map((c) => c.textContent),
  current: [...out.querySelectorAll('.rv-route-table tr.rv-route')]
    .findIndex((tr) => tr.classList.contains('current')),
})
"""


def test_chapter_10s_request_slider_moves_the_trees_before_running(trusted_lab, page):
    """The slider under the replicas' trees works from the saved widget state: each tree goes
    to the frame at which that request's blocks had arrived, as the recording says."""
    import viz
    from minirad.course.recordings import RECORDINGS_DIR

    notebook = "notebooks/10_replicas.ipynb"
    console = Console().watch(page)
    open_unrun(page, trusted_lab, notebook, ROOT)
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
    sources = [
        c["source"]
        for c in json.loads((ROOT / notebook).read_text())["cells"]
        if c["cell_type"] == "code"
    ]
    k = next(i for i, s in enumerate(sources) if "routing_round_robin.jsonl" in "".join(s))
    out = cells.nth(k).locator(".jp-OutputArea-output").first
    slider = out.locator("input.rv-route-slider")
    assert slider.count() == 1, f"{notebook}: no request slider that works without a kernel"
    recorded = viz.replay_replicas(RECORDINGS_DIR / "routing_round_robin.jsonl")
    for request in (0, 2, len(recorded.routes) - 1):
        slider.fill(str(request))
        frames = recorded.routes[request].frames
        want = [
            f"{max(1, n)} / {len(v.frames)}" for n, v in zip(frames, recorded.views, strict=True)
        ]
        page.wait_for_function(
            f"(out) => ({_ROUTE_VIEW})(out).counters.join() === {json.dumps(','.join(want))}",
            arg=out.element_handle(),
            timeout=10_000,
        )
        assert out.evaluate(_ROUTE_VIEW)["current"] == request
    assert not widget_errors(console)
