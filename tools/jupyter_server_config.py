"""Jupyter server settings of ``make lab``: running the course leaves the clone clean, and
JupyterLab asks nothing of the internet.

A chapter whose cells (their types and sources) are those of the committed version (git
``HEAD``) is saved as the committed file, byte for byte. Its committed outputs are what running
it produces (``make test`` checks that with nbval), while a fresh run also rewrites what no
learner wrote: object addresses, widget model ids, execution counts, the kernel's metadata. A
notebook with an edited, added or deleted cell is saved as usual.

No news and no update checks: JupyterLab would fetch an announcement feed and PyPI's latest
version, and first asks "Would you like to get notified about official Jupyter news?" in a
pop-up. The server serves no news (``LabApp.news_url = None``) and checks no version
(``NeverCheckForUpdate``), and the settings in ``tools/lab_settings/overrides.json`` (read as
the defaults of the notification plugin's settings) turn both off in the page, so the pop-up
never shows; a learner may still turn them on in Settings.

Loaded with ``jupyter lab --config=tools/jupyter_server_config.py`` (``make lab``, which also
roots the server at the repository and opens ``notebooks/00_tour.ipynb``); the hook follows
Jupyter Server's ``ContentsManager.pre_save_hook`` contract (``hook(model=, path=,
contents_manager=)``, which may change ``model`` in place). It finds the committed notebook with
``git`` in the notebook's own folder, so it works whatever the server's root.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path
from typing import Any

import nbformat


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


def keep_committed_notebook(model: dict[str, Any], path: str, contents_manager: Any, **_) -> None:
    """Pre-save hook: replace ``model["content"]`` by the committed notebook when the cells'
    types and sources equal it; leave every other save alone."""
    if model.get("type") != "notebook" or "content" not in model:
        return
    committed = committed_notebook(Path(contents_manager._get_os_path(path)))
    if committed is not None and _cells(committed) == _cells(model["content"]):
        model["content"] = committed


# Jupyter's config loader runs this file with `get_config` defined; tests import it without.
if "get_config" in globals():
    c = get_config()  # noqa: F821
    c.ContentsManager.pre_save_hook = keep_committed_notebook
    c.LabApp.news_url = None
    c.LabApp.check_for_updates_class = "jupyterlab.handlers.announcements.NeverCheckForUpdate"
    # overrides.json there: the notification plugin's fetchNews and checkForUpdates off.
    c.LabApp.app_settings_dir = str(Path(__file__).resolve().with_name("lab_settings"))
    # Jupyter Server applies the config to its contents manager again when JupyterLab's
    # extension loads, and warns that the (same) hook replaces itself.
    warnings.filterwarnings("ignore", "Overriding existing pre_save_hook", UserWarning)
