"""``make lab``'s server config (tools/jupyter_server_config.py): a chapter saved with its
cells unedited is written as the committed file, byte for byte; an edited one as usual, but
with every player's widget state in the file (the models JupyterLab did not send taken from
the file on disk or the committed one, the unused ones dropped, a player whose model is
nowhere turned into its picture).

Saves go through Jupyter Server's own ``FileContentsManager`` over a git repository made here.
``make lab`` itself is started as ``make -n lab`` prints it: the server's root is the
repository, the tour opens first, JupyterLab shows no news pop-up and checks no updates, and it
saves widget state.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from jupyter_server.services.contents.filemanager import FileContentsManager

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "notebooks/01_radix_tree.ipynb"
# Jupyter Server validates the hook trait twice when a contents manager is built with it, and
# warns that the hook replaces itself (the config file silences the same warning).
pytestmark = pytest.mark.filterwarnings("ignore:Overriding existing pre_save_hook")


def load_config():
    spec = importlib.util.spec_from_file_location(
        "jupyter_server_config", ROOT / "tools" / "jupyter_server_config.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository with one committed chapter (a copy of ``CHAPTER``) and the
    repository's .gitignore (JupyterLab's checkpoints are ignored)."""
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    shutil.copy(ROOT / CHAPTER, tmp_path / CHAPTER)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "chapter")
    return tmp_path


@pytest.fixture
def contents(repo) -> FileContentsManager:
    return FileContentsManager(
        root_dir=str(repo), pre_save_hook=load_config().keep_committed_notebook
    )


def rerun(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What a run in JupyterLab changes without an edit: counts, outputs, kernel metadata."""
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = 100 + i
        cell.outputs = [nbformat.v4.new_output("stream", text="<object at 0x7f00>\n")]
        cell.metadata["trusted"] = True
    nb.metadata["kernelspec"] = {"name": "other", "display_name": "Other", "language": "python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    return nb


def save(contents: FileContentsManager, nb: nbformat.NotebookNode) -> None:
    contents.save({"type": "notebook", "format": "json", "content": nb}, CHAPTER)


def test_an_unedited_chapter_is_saved_as_committed(repo, contents):
    committed = (repo / CHAPTER).read_bytes()
    nb = rerun(contents.get(CHAPTER)["content"])
    save(contents, nb)
    assert (repo / CHAPTER).read_bytes() == committed
    assert git(repo, "status", "--porcelain") == ""


def test_an_edited_cell_is_saved_as_usual(repo, contents):
    nb = rerun(contents.get(CHAPTER)["content"])
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.source += "\n# my note"
    save(contents, nb)
    saved = nbformat.read(repo / CHAPTER, as_version=4)
    assert "# my note" in next(c for c in saved.cells if c.cell_type == "code").source
    assert saved.metadata.kernelspec.name == "other"
    assert git(repo, "status", "--porcelain").split() == ["M", CHAPTER]


def test_a_deleted_cell_is_saved_as_usual(repo, contents):
    nb = contents.get(CHAPTER)["content"]
    del nb.cells[-1]
    save(contents, nb)
    assert len(nbformat.read(repo / CHAPTER, as_version=4).cells) == len(nb.cells)


def test_an_untracked_notebook_is_saved_as_usual(repo, contents):
    nb = rerun(contents.get(CHAPTER)["content"])
    contents.save({"type": "notebook", "format": "json", "content": nb}, "notebooks/mine.ipynb")
    saved = nbformat.read(repo / "notebooks" / "mine.ipynb", as_version=4)
    assert saved.metadata.kernelspec.name == "other"


# ---------------------------------------------------------------------- players
# A chapter of two players (a model with its layout, as anywidget's) and an exercise, as JupyterLab
# sends it: the state is what its widget manager saves with saveState on, the models its kernel
# made (none when nothing ran: the players restored from the file have no kernel behind them).
PLAYERS = "notebooks/players.ipynb"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def player(model_id: str) -> dict:
    """A widget output: the player, its static picture and its text."""
    view = {"model_id": model_id, "version_major": 2, "version_minor": 1}
    data = {WIDGET_VIEW: view, "image/svg+xml": f"<svg>{model_id}</svg>", "text/plain": "view"}
    return nbformat.v4.new_output("display_data", data=data)


def models(*ids: str) -> dict:
    """Widget models: each id ``x`` with its layout ``x0`` (``"IPY_MODEL_x0"`` in its state)."""
    state = {}
    for m in ids:
        state[m] = {"model_name": "AnyModel", "state": {"layout": f"IPY_MODEL_{m}0", "_esm": m}}
        state[f"{m}0"] = {"model_name": "LayoutModel", "state": {}}
    return state


def with_players(nb: nbformat.NotebookNode, ids: list[str], state: dict | None):
    """``nb`` with its players' outputs showing ``ids`` and ``state`` as its widget state (None:
    no widget metadata at all)."""
    for cell, m in zip([c for c in nb.cells if c.cell_type == "code"], ids, strict=False):
        cell.outputs = [player(m)] if m else []
    nb.metadata.pop("widgets", None)
    if state is not None:
        nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0}}
        nb.metadata["widgets"][WIDGET_STATE]["state"] = state
    return nb


@pytest.fixture
def players(repo, contents) -> Path:
    """``PLAYERS`` committed in ``repo``: players a1 and b1, then the exercise."""
    cells = ["view_a", "view_b", "answer = ...\nq1.check(answer)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(with_players(nb, ["a1", "b1"], models("a1", "b1")), repo / PLAYERS)
    git(repo, "add", PLAYERS)
    git(repo, "commit", "-q", "-m", "players")
    return repo / PLAYERS


def answered(contents: FileContentsManager, ids: list[str], state: dict | None):
    """The saved chapter as JupyterLab sends it with the exercise answered."""
    nb = contents.get(PLAYERS)["content"]
    nb.cells[-1].source = "answer = 42\nq1.check(answer)"
    return with_players(nb, ids, state)


def saved_players(path: Path) -> tuple[list[list[str]], dict]:
    """Per code cell its outputs' MIME types, and the file's widget state."""
    nb = nbformat.read(path, as_version=4)
    outputs = [[sorted(o.data) for o in c.outputs] for c in nb.cells if c.cell_type == "code"]
    return outputs, nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state")


PLAYER = [WIDGET_VIEW, "image/svg+xml", "text/plain"]
PICTURE = ["image/svg+xml", "text/plain"]


@pytest.mark.parametrize("sent", [{}, None], ids=["saveState", "no-widget-metadata"])
def test_an_edited_chapter_keeps_the_committed_players(players, contents, sent):
    """Answered, nothing run: JupyterLab sends no model (or no widget metadata at all)."""
    contents.save({"type": "notebook", "content": answered(contents, ["a1", "b1"], sent)}, PLAYERS)
    outputs, state = saved_players(players)
    assert outputs == [[PLAYER], [PLAYER], []]
    assert state == models("a1", "b1")


def test_a_run_keeps_its_players_and_only_the_models_they_use(players, contents):
    # Run twice: the kernel still holds the first run's models (a2, b2) besides a3, b3.
    sent = models("a2", "b2", "a3", "b3")
    contents.save({"type": "notebook", "content": answered(contents, ["a3", "b3"], sent)}, PLAYERS)
    assert saved_players(players) == ([[PLAYER], [PLAYER], []], models("a3", "b3"))
    # Saved again with no kernel behind it (reopened later): the models come from the file.
    contents.save({"type": "notebook", "content": answered(contents, ["a3", "b3"], {})}, PLAYERS)
    assert saved_players(players) == ([[PLAYER], [PLAYER], []], models("a3", "b3"))


def test_a_player_whose_model_is_nowhere_becomes_its_picture(players, contents):
    """Cell a ran under a JupyterLab that saves no widget state (its model a2 is lost); b still
    shows the committed b1, whose layout the save lacks too."""
    sent = {"b1": models("b1")["b1"]}
    contents.save({"type": "notebook", "content": answered(contents, ["a2", "b1"], sent)}, PLAYERS)
    assert saved_players(players) == ([[PICTURE], [PLAYER], []], models("b1"))
    nb = nbformat.read(players, as_version=4)
    nb.cells[0].outputs[0].data = {WIDGET_VIEW: {"model_id": "c9"}}  # nothing else to draw
    contents.save({"type": "notebook", "content": with_players(nb, [], {})}, PLAYERS)
    assert saved_players(players) == ([[], [PLAYER], []], models("b1"))


def test_a_chapter_with_no_player_left_saves_no_widget_state(players, contents):
    contents.save({"type": "notebook", "content": answered(contents, [None, None], {})}, PLAYERS)
    assert saved_players(players) == ([[], [], []], None)
    assert "widgets" not in nbformat.read(players, as_version=4).metadata


def test_the_committed_players_are_taken_when_the_file_lost_them(players, contents):
    """A file saved by a JupyterLab without the hook (no widget state on disk): the committed
    models are taken from git HEAD."""
    nb = with_players(nbformat.read(players, as_version=4), ["a1", "b1"], None)
    nbformat.write(nb, players)
    contents.save({"type": "notebook", "content": answered(contents, ["a1", "b1"], {})}, PLAYERS)
    assert saved_players(players) == ([[PLAYER], [PLAYER], []], models("a1", "b1"))


def test_a_file_on_disk_that_is_no_notebook_is_passed_over(players, contents):
    nb = answered(contents, ["a1", "b1"], {})
    players.write_text("not a notebook")
    contents.save({"type": "notebook", "content": nb}, PLAYERS)
    assert saved_players(players) == ([[PLAYER], [PLAYER], []], models("a1", "b1"))


def test_an_unedited_chapter_with_players_is_saved_as_committed(players, contents):
    committed = players.read_bytes()
    nb = with_players(contents.get(PLAYERS)["content"], ["a5", "b5"], models("a5", "b5"))
    contents.save({"type": "notebook", "content": nb}, PLAYERS)
    assert players.read_bytes() == committed


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_chapter_names_its_kernel_as_ipykernel_does(path):
    """JupyterLab writes the running kernel's spec into a notebook when the kernel starts: a
    committed spec that differs (e.g. "Python 3" for "Python 3 (ipykernel)") marks the chapter
    unsaved the moment it opens, before the learner did anything."""
    from ipykernel.kernelspec import get_kernel_dict

    spec = get_kernel_dict()
    expected = {"display_name": spec["display_name"], "language": spec["language"]}
    assert nbformat.read(path, as_version=4).metadata.kernelspec == expected | {"name": "python3"}


# ---------------------------------------------------------------------- make lab, as it runs
def make_lab_command() -> list[str]:
    """The ``jupyter lab`` command of ``make lab``, as ``make -n lab`` prints it, run by this
    Python (``python -m jupyter lab ...``)."""
    printed = subprocess.run(
        ["make", "-n", "lab"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    lines = [shlex.split(line) for line in printed.replace("\\\n", " ").splitlines()]
    [cmd] = [
        words for words in lines if words[:2] and words[0].endswith("jupyter") and words[1] == "lab"
    ]
    return [sys.executable, "-m", "jupyter", *cmd[1:]]


@contextlib.contextmanager
def make_lab(tmp: Path) -> Iterator[tuple[str, str, Path]]:
    """Start ``make lab``'s JupyterLab in the repository, on a free port with a token of its
    own, with Jupyter's config, data and runtime folders under ``tmp`` (no settings of the
    user's). Yields ``(url, token, runtime folder)``."""
    from browser_tools import Lab, free_port, running_lab

    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"))
    env |= {"JUPYTER_DATA_DIR": str(tmp / "data"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    cmd = make_lab_command() + ["--no-browser", "--ip=127.0.0.1", f"--port={port}"]
    cmd += [f"--IdentityProvider.token={token}"]
    lab = Lab(f"http://127.0.0.1:{port}", token, tmp / "lab.log")
    with running_lab(cmd, env, ROOT, lab, timeout=60):
        yield lab.url, token, tmp / "runtime"


def get(base: str, token: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"{base}{path}?token={token}&content=0", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make program")
def test_make_lab_serves_the_repository_opens_the_tour_and_fetches_no_news(tmp_path):
    with make_lab(tmp_path) as (base, token, runtime):
        # The chapters send the learner to these: all inside the server's root.
        for path in ("notebooks/00_tour.ipynb", "minirad/kvcache/radix_cache.py", "data", "tools"):
            status, _ = get(base, token, f"/api/contents/{path}")
            assert status == 200, f"make lab's JupyterLab cannot open {path} ({status})"
        # The page it opens: the tour (the browser is sent to this file's URL).
        [opener] = glob.glob(str(runtime / "jpserver-file-to-run-*-open.html"))
        assert "/lab/tree/notebooks/00_tour.ipynb" in Path(opener).read_text()
        # No news pop-up, no update check: the plugin's settings, as the page reads them...
        plugin = "@jupyterlab/apputils-extension:notification"
        _, body = get(base, token, f"/lab/api/settings/{plugin}")
        answer = json.loads(body)
        schema = answer["schema"]["properties"]  # the overrides are its defaults
        composite = {k: v.get("default") for k, v in schema.items()} | answer["settings"]
        assert composite.get("fetchNews") == "false", composite
        assert composite.get("checkForUpdates") is False, composite
        # The widget manager saves the state of its kernel's widgets: a saved chapter keeps the
        # players of the cells the learner ran.
        plugin = "@jupyter-widgets/jupyterlab-manager:plugin"
        answer = json.loads(get(base, token, f"/lab/api/settings/{plugin}")[1])
        assert answer["schema"]["properties"]["saveState"]["default"] is True, answer["schema"]
        # ... and the server's own answers: no feed, no newer version.
        assert json.loads(get(base, token, "/lab/api/news")[1]) == {"news": []}
        assert json.loads(get(base, token, "/lab/api/update")[1]) == {"notification": None}
