"""Chapter 08's live SGLang cell, run the way a learner runs it, in JupyterLab in chromium.

A learner without the SGLang venv runs the whole chapter (Run All: the live cell says there is
no venv), then runs ``make sglang`` as the chapter invites, and runs the live cell again. It
asked SGLang for garbage: section 10 had bound ``follow_up`` again, to a toy prompt, and the
cell printed "SGLang 'wowowowowowowowo', 0 cached" over a tree of unprintable tokens
(tests/test_chapters.py now holds every chapter's live cells to names no later cell binds).
Here the venv "arrives" between Run All and the rerun (``MINIRAD_SGLANG_VENV`` names a path
that is linked to the real venv only then), and the cell must print what its section says,
the recorded lines, while its start says each stage as it comes.

Needs the SGLang venv (``make sglang``; skipped without it, except in CI), chromium and
playwright. About two minutes on 2 cores: the chapter's Run All, then SGLang's start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from browser_tools import jupyter_lab, missing, run_all_cells

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "notebooks/08_real_engines.ipynb"
LIVE_SGLANG = "# live: the real SGLang beside our engine"
REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def code_cells() -> list[dict]:
    cells = json.loads((ROOT / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    return [c for c in cells if c["cell_type"] == "code"]


def test_the_live_sglang_cell_run_after_run_all_asks_what_its_section_says(
    sglang_python, page, tmp_path, monkeypatch
):
    venv = tmp_path / "venv-sglang"  # no SGLang during Run All: "run `make sglang`"
    monkeypatch.setenv("MINIRAD_SGLANG_VENV", str(venv))
    monkeypatch.setenv("MINIRAD_VLLM_VENV", str(tmp_path / "no-vllm"))  # vLLM's cells: quick
    cells = code_cells()
    k = next(i for i, c in enumerate(cells) if LIVE_SGLANG in "".join(c["source"]))
    recorded = [
        line
        for out in cells[k]["outputs"]
        for line in "".join(out.get("text", "")).splitlines()
        if line.startswith("r2")
    ]
    assert len(recorded) == 2, recorded  # r2, and r2's next turn

    lab_dir = tmp_path / "lab"
    lab_dir.mkdir()
    with jupyter_lab(lab_dir) as lab:
        run_all_cells(page, lab, NOTEBOOK, timeout=300)
        cell = page.locator(".jp-Notebook .jp-CodeCell").nth(k)
        out = cell.locator(".jp-OutputArea")
        assert "no SGLang venv" in out.text_content()

        venv.symlink_to(sglang_python.parent.parent)  # `make sglang` is done
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        # While SGLang starts, the cell says how far it is: a stage, long before the end.
        page.wait_for_function(
            "(el) => /SGLang +\\d+ s  importing SGLang/.test(el.textContent)",
            arg=out.element_handle(),
            timeout=120_000,
        )
        assert "SGLang stopped" not in out.text_content()
        page.wait_for_function(
            "(el) => /SGLang stopped|Traceback/.test(el.textContent)",
            arg=out.element_handle(),
            timeout=400_000,
        )
        text = out.text_content()
        assert "Traceback" not in text, text[-3000:]
        for line in recorded:
            assert line in text, f"{line!r} not in the rerun's output:\n{text}"
        assert "ready: /health answers" in text
        # The players are displayed after "SGLang stopped" is printed; widgets render a
        # moment after the text arrives, so wait for them rather than count at once.
        from playwright.sync_api import expect

        players = cell.locator(".radix-view")
        expect(players).to_have_count(2, timeout=60_000)
        shown = players.all_text_contents()
        assert not any("no frames yet" in s or "\ufffd" in s for s in shown), shown
