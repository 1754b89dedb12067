"""A chapter the learner saved shows its players after a reload, in real JupyterLab and chromium
(issue 43): on a ``git clone`` of the repository, under ``make lab``'s server config and lab
settings (``tools/jupyter_server_config.py``, ``tools/lab_settings/overrides.json``).

- Nothing run: chapter 08's exercise answered and saved. JupyterLab sends no state for the
  players it restored from the file (they have no kernel behind them); the server's hook keeps
  them from the file on disk.
- Run All: chapter 07's cells make new players (new widget model ids), then the exercise is
  answered and the chapter saved. JupyterLab's widget manager sends their state
  (``saveState``, on in the overrides); without it the file's outputs name models it does not
  hold, and read "Error displaying widget: model not found" once the kernel is gone.

Each time the kernel is then shut down and the chapter opened again in a fresh workspace: every
widget output the saved file holds must draw as a player, and a player steps. Skipped only when
chromium or the playwright package is missing (``tests/browser_tools.py``).
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import nbformat
import pytest
from browser_tools import Console, jupyter_lab, missing, run_all_cells, write_notebook
from test_browser_committed import (
    WIDGET,
    check_drawn,
    expected_outputs,
    git,
    open_unrun,
    save,
    steps_a_player,
    trust,
    widget_errors,
)

ROOT = Path(__file__).resolve().parent.parent
REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

UNRUN = "notebooks/08_real_engines.ipynb"  # players, one of them ipywidgets boxes and links
RUN = "notebooks/07_visualizer.ipynb"  # four players; Run All takes 20-30 s on 2 cores
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A clone of the repository: the tests save its chapters."""
    clone = tmp_path_factory.mktemp("save") / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    return clone


@pytest.fixture(scope="module")
def lab(tmp_path_factory, clone):
    """``make lab``'s JupyterLab over ``clone``, its chapters trusted."""
    tmp = tmp_path_factory.mktemp("lab")
    trust(tmp / "data", [clone / UNRUN, clone / RUN])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_DATA_DIR", str(tmp / "data"))
        with jupyter_lab(tmp, root=clone) as lab:
            yield lab


def answer(page, notebook: Path, text: str) -> None:
    """Replace the first line of the open chapter's q1 cell (``answer = ...``) by ``text``."""
    cells = [c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
    k = next(i for i, c in enumerate(cells) if c.source.startswith("answer = ...\nq1.check"))
    code = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").nth(k)
    code.locator(".cm-content").click()
    page.keyboard.press("Control+Home")
    page.keyboard.press("Shift+End")
    page.keyboard.type(text)


def api(lab, path: str, method: str = "GET"):
    """Call JupyterLab's REST API; returns the JSON answer (None if empty)."""
    url = f"{lab.url}{path}?token={lab.token}"
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as r:
        body = r.read()
    return json.loads(body) if body else None


def shut_down_kernels(lab) -> None:
    """Shut every session's kernel down: the next page holds only what the file holds."""
    for session in api(lab, "/api/sessions"):
        api(lab, f"/api/sessions/{session['id']}", "DELETE")


def fresh_lab(lab) -> None:
    """No kernel and no workspace left by another test (an open chapter would come back)."""
    shut_down_kernels(lab)
    for workspace in api(lab, "/lab/api/workspaces")["workspaces"]["ids"]:
        api(lab, f"/lab/api/workspaces/{workspace}", "DELETE")


def players(path: Path) -> tuple[list[str], dict]:
    """The model ids the file's outputs display, and its widget state."""
    nb = nbformat.read(path, as_version=4)
    shown = [
        o.data[WIDGET]["model_id"]
        for c in nb.cells
        for o in c.get("outputs", [])
        if WIDGET in o.get("data", {})
    ]
    return shown, nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})


def check_reopened(page, lab, clone: Path, notebook: str, console: Console) -> None:
    """Shut the kernel down, open ``notebook`` in a fresh workspace: every widget output of the
    saved file draws as a player (none reads "model not found"), and one steps."""
    shut_down_kernels(lab)
    expected = expected_outputs(clone / notebook)
    check_drawn(open_unrun(page, lab, notebook, clone), expected, notebook)
    steps_a_player(page)
    assert not widget_errors(console)


def test_a_chapter_answered_without_running_keeps_its_players(lab, clone, page):
    fresh_lab(lab)
    console = Console().watch(page)
    committed, _ = players(clone / UNRUN)
    open_unrun(page, lab, UNRUN, clone)
    answer(page, clone / UNRUN, "answer = 3")
    save(page)
    sources = [c.source for c in nbformat.read(clone / UNRUN, as_version=4).cells]
    assert "answer = 3\nq1.check(answer)" in sources
    shown, state = players(clone / UNRUN)
    assert shown == committed, "a player turned into its picture"
    check_reopened(page, lab, clone, UNRUN, console)
    assert set(shown) <= state.keys(), f"{UNRUN} saved without the state of its players"


def test_a_chapter_run_then_answered_keeps_its_new_players(lab, clone, page):
    fresh_lab(lab)
    console = Console().watch(page)
    committed, committed_state = players(clone / RUN)
    run_all_cells(page, lab, RUN, root=clone, timeout=300)
    save(page)  # unedited, with its new players: still the committed file
    assert git(clone, "status", "--porcelain", RUN) == ""
    answer(page, clone / RUN, "answer = 3")
    save(page)
    shown, state = players(clone / RUN)
    # Still four players (none turned into its picture), each a model of this run.
    assert len(shown) == len(committed) and not set(shown) & set(committed), "no new players"
    check_reopened(page, lab, clone, RUN, console)
    assert set(shown) <= state.keys(), f"{RUN} saved without the state of its new players"
    # Only the models the outputs use: as many as the committed file holds.
    assert len(state) == len(committed_state), sorted(state)


LIVE = (
    "import viz\nfrom minirad import RadixCache\n"
    "cache = RadixCache()\nlive = viz.RadixView().attach(cache)\nlive",
    "for key in ([1, 2, 3, 4], [1, 2, 9], [7, 8]):\n    cache.insert(key)",
)


def test_a_live_players_frames_that_came_after_it_was_shown_are_saved(lab, clone, page):
    """A live player (chapter 08's vLLM cell) draws the frames that come after it is shown
    from messages, which the notebook did not keep: saved, its kernel gone, it came back at its
    first frame. The page keeps them in the model's state, which JupyterLab saves."""
    fresh_lab(lab)
    console = Console().watch(page)
    notebook = "notebooks/live_player.ipynb"
    write_notebook(clone / notebook, LIVE)
    run_all_cells(page, lab, notebook, root=clone)
    view = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .radix-view").first
    page.wait_for_function(
        "(el) => el.querySelector('.rv-counter').textContent === '5 / 5'",
        arg=view.element_handle(),
        timeout=30_000,
    )
    page.wait_for_timeout(1000)  # the page keeps them half a second after the last one
    page.keyboard.press("Escape")
    save(page)
    shut_down_kernels(lab)
    open_unrun(page, lab, notebook, clone)
    view = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .radix-view").first
    assert view.locator(".rv-counter").text_content() == "5 / 5"
    assert not widget_errors(console)
