"""``make lab``'s server config (tools/jupyter_server_config.py): a chapter saved with its
cells unedited is written as the committed file, byte for byte; an edited one as usual.

Saves go through Jupyter Server's own ``FileContentsManager`` over a git repository made here.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
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
