"""Jupyter server settings of ``make lab``: running the course leaves the clone clean, a
chapter the learner saved shows its players after a reload, and JupyterLab asks nothing of the
internet.

A chapter whose cells (their types and sources) are those of the committed version (git
``HEAD``) is saved as the committed file, byte for byte. Its committed outputs are what running
it produces (``make test`` checks that with nbval), while a fresh run also rewrites what no
learner wrote: object addresses, widget model ids, execution counts, the kernel's metadata.

A notebook with an edited, added or deleted cell is saved as JupyterLab sends it, with its
players' widget state made whole, so that every player in the file draws after a reload, with
or without a kernel. JupyterLab saves the state of the widgets its kernel made (the setting
``saveState`` of ``@jupyter-widgets/jupyterlab-manager:plugin``, on in
``tools/lab_settings/overrides.json``; JupyterLab's default is off), but not that of the
players it restored from the file itself, which have no kernel behind them: a chapter edited
without running anything would lose all its players. So before the save, the hook
(:func:`keep_players`):

- takes each model an output displays (and those it refers to) that the save lacks from the
  file on disk, else from git ``HEAD``: models are found by id, which a kernel draws at random;
- turns an output whose model is in none of them (the save of a JupyterLab with ``saveState``
  off, or of a run whose kernel was restarted before any save) into the static picture and
  text of its own bundle, which draw anywhere, instead of "Error displaying widget: model not
  found";
- keeps only the models the outputs use (``tools/live_cells.py``'s
  :func:`~live_cells.used_models`): JupyterLab saves every model its kernel ever made, and an
  anywidget's state carries the player's JavaScript.

With ``saveState`` on, JupyterLab marks a chapter with players as changed the moment it opens
(its widget manager does so for every model it loads): saving it, or autosave, writes the
committed file again, as above.

No news and no update checks: JupyterLab would fetch an announcement feed and PyPI's latest
version, and first asks "Would you like to get notified about official Jupyter news?" in a
pop-up. The server serves no news (``LabApp.news_url = None``) and checks no version
(``NeverCheckForUpdate``), and the settings in ``tools/lab_settings/overrides.json`` (read as
the defaults of the plugins' settings: here the notification plugin's) turn both off in the
page, so the pop-up never shows; a learner may still turn them on in Settings (and
``saveState`` off: Settings > Save Widget State Automatically).

Loaded with ``jupyter lab --config=tools/jupyter_server_config.py`` (``make lab``, which also
roots the server at the repository and opens ``notebooks/00_tour.ipynb``); the hook follows
Jupyter Server's ``ContentsManager.pre_save_hook`` contract (``hook(model=, path=,
contents_manager=)``, which may change ``model`` in place). It finds the committed notebook with
``git`` in the notebook's own folder, so it works whatever the server's root.

A JupyterLab started without this config (``saveState`` off, no hook) saves a chapter with the
widget state it read from the file: the players of cells not run since still draw, those of
cells run again read "model not found" once the kernel is gone (run the cell again, or save the
chapter once under ``make lab``: they become pictures). docs/troubleshooting.md says so.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import warnings
from pathlib import Path
from typing import Any

import nbformat


def _live_cells():
    # tools/ is no package, and Jupyter's config loader puts no folder on sys.path.
    spec = importlib.util.spec_from_file_location(
        "live_cells", Path(__file__).resolve().with_name("live_cells.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


live_cells = _live_cells()


def committed_notebook(os_path: Path) -> nbformat.NotebookNode | None:
    """The notebook at ``os_path`` as git ``HEAD`` has it (nbformat 4), or None where there is
    none: outside a git work tree, a file ``HEAD`` does not track, no ``git`` program."""
    try:
        shown = subprocess.run(
            ["git", "-C", str(os_path.parent), "show", f"HEAD:./{os_path.name}"],
            capture_output=True,
            check=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return nbformat.reads(shown.stdout.decode("utf-8"), as_version=4)


def _cells(nb: dict) -> list[tuple[str, str]]:
    # The REST API may carry a source as a list of lines, as the file format allows.
    return [
        (c["cell_type"], c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
        for c in nb["cells"]
    ]


def _widget_state(nb: nbformat.NotebookNode | None) -> dict:
    """The widget models a notebook stores (model id -> model); {} where it has none."""
    widgets = nb.metadata.get("widgets", {}) if nb is not None else {}
    return widgets.get(live_cells.WIDGET_STATE, {}).get("state", {})


def _on_disk(os_path: Path) -> nbformat.NotebookNode | None:
    """The notebook as the file holds it now, before this save; None where there is none."""
    try:  # only its widget state is read: not validated (0.2 s for a chapter)
        nb = nbformat.from_dict(json.loads(os_path.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # no file yet, not JSON: nothing to take from it
        return None
    return nb if isinstance(nb, dict) and isinstance(nb.get("metadata"), dict) else None


def _drawable(out: dict, state: dict) -> bool:
    """Whether output ``out`` draws with the widget ``state``; a player whose model, or one it
    refers to, is missing is turned into its picture first (False: nothing left to draw)."""
    view = out.get("data", {}).get(live_cells.WIDGET_VIEW)
    if view is None or live_cells.reachable(state, [view.get("model_id")]) <= state.keys():
        return True
    return live_cells.picture(out)


def keep_players(nb: nbformat.NotebookNode, *older: nbformat.NotebookNode | None) -> None:
    """Make ``nb``'s widget state whole, in place: each model its outputs use that it lacks is
    taken from the first of the ``older`` notebooks that has it; an output whose model (or one
    it refers to) is still missing keeps only its static picture and text; the state keeps only
    the models the outputs use, and goes where none is left."""
    state = {}
    for source in (*reversed(older), nb):  # the later wins: nb, then older[0], ...
        state |= _widget_state(source)
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [out for out in cell.outputs if _drawable(out, state)]
    widgets = nb.metadata.setdefault("widgets", {})
    saved = widgets.setdefault(live_cells.WIDGET_STATE, {"version_major": 2, "version_minor": 0})
    saved["state"] = state  # used_models reads it from nb
    used = live_cells.used_models(nb)
    saved["state"] = {k: v for k, v in state.items() if k in used}
    if not saved["state"]:
        del widgets[live_cells.WIDGET_STATE]
    if not widgets:
        del nb.metadata["widgets"]


def keep_committed_notebook(model: dict[str, Any], path: str, contents_manager: Any, **_) -> None:
    """Pre-save hook: replace ``model["content"]`` by the committed notebook when the cells'
    types and sources equal it; otherwise save it with its players whole
    (:func:`keep_players`: models from the file on disk, then from the committed one)."""
    if model.get("type") != "notebook" or "content" not in model:
        return
    os_path = Path(contents_manager._get_os_path(path))
    committed = committed_notebook(os_path)
    if committed is not None and _cells(committed) == _cells(model["content"]):
        model["content"] = committed
        return
    nb = nbformat.from_dict(model["content"])  # a copy
    try:
        keep_players(nb, _on_disk(os_path), committed)
    except Exception:  # noqa: BLE001 (the learner's save must not fail for its players)
        contents_manager.log.warning("%s: saved as sent, players unchecked", path, exc_info=True)
        return
    model["content"] = nb


# Jupyter's config loader runs this file with `get_config` defined; tests import it without.
if "get_config" in globals():
    c = get_config()  # noqa: F821
    c.ContentsManager.pre_save_hook = keep_committed_notebook
    c.LabApp.news_url = None
    c.LabApp.check_for_updates_class = "jupyterlab.handlers.announcements.NeverCheckForUpdate"
    # overrides.json there: the notification plugin's fetchNews and checkForUpdates off, the
    # widget manager's saveState on.
    c.LabApp.app_settings_dir = str(Path(__file__).resolve().with_name("lab_settings"))
    # Jupyter Server applies the config to its contents manager again when JupyterLab's
    # extension loads, and warns that the (same) hook replaces itself.
    warnings.filterwarnings("ignore", "Overriding existing pre_save_hook", UserWarning)
