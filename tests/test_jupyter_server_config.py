"""``make lab``'s server config (tools/jupyter_server_config.py): a chapter saved with its
cells unedited is written as the committed file, byte for byte; an edited one as usual.

Saves go through Jupyter Server's own ``FileContentsManager`` over a git repository made here.
``make lab`` itself is started as ``make -n lab`` prints it: the server's root is the
repository, the tour opens first, and JupyterLab shows no news pop-up and checks no updates.
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
        # ... and the server's own answers: no feed, no newer version.
        assert json.loads(get(base, token, "/lab/api/news")[1]) == {"news": []}
        assert json.loads(get(base, token, "/lab/api/update")[1]) == {"notification": None}
