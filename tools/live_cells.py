"""Mark the chapters' live cells as recorded: ``python tools/live_cells.py notebooks/*.ipynb``
(``make notebooks`` runs it after executing the chapters).

A live cell starts real servers when their venv exists (``make vllm``, ``make routers``): its
source begins with ``# NBVAL_SKIP`` (nbval does not run it) and then ``# live:``. What it
printed on the author's machine says nothing about the learner's, so in the committed file:

- it is tagged ``skip-execution``: ``make notebooks`` (nbclient) leaves it and its outputs
  alone, so the recording survives a re-run on a machine without those venvs; it shows no
  execution count, as a cell this run did not run;
- its outputs begin with :data:`RECORDED`, the line that says they are a recording;
- a widget output keeps only its static picture (the SVG and text of the same bundle): the
  player of a server that is gone would stand frozen at a dead port, and the widget state that
  ``make notebooks`` stores comes from its own kernel, which never ran the cell, so JupyterLab
  would draw a broken widget icon in its place;
- the notebook's widget state keeps only the models its outputs use (and those they refer to).

To record a live cell again, run the chapter in JupyterLab with the venvs, save it with the
cell edited (the server config keeps an unedited chapter as committed), and run this tool.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat

LIVE = re.compile(r"# NBVAL_SKIP\n# live:")
SKIP_TAG = "skip-execution"  # nbclient's ExecutePreprocessor.skip_cells_with_tag
RECORDED = (
    "Recorded on the author's machine when this chapter was committed, not by your run: "
    "run the cell to see what it does on yours.\n"
)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
LINKS = ("LinkModel", "DirectionalLinkModel")


def is_live(cell: dict) -> bool:
    return cell["cell_type"] == "code" and bool(LIVE.match(cell["source"]))


def mark_live_cell(cell: dict) -> None:
    """Tag one live cell, put :data:`RECORDED` first, and turn its widgets into pictures."""
    tags = cell.metadata.setdefault("tags", [])
    if SKIP_TAG not in tags:
        tags.append(SKIP_TAG)
    cell.execution_count = None  # not run in this file's run: "[ ]"
    outputs = []
    for out in cell.outputs:
        data = out.get("data", {})
        if WIDGET_VIEW in data:
            del data[WIDGET_VIEW]
            if not data:  # nothing to draw without the widget
                continue
        outputs.append(out)
    first = outputs[0] if outputs else None
    if not (first and first.output_type == "stream" and first.text.startswith(RECORDED)):
        outputs.insert(0, nbformat.v4.new_output("stream", name="stdout", text=RECORDED))
    cell.outputs = outputs


def used_models(nb: dict) -> set[str]:
    """The widget models the outputs display, and every model those refer to."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    todo = [
        out["data"][WIDGET_VIEW]["model_id"]
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if WIDGET_VIEW in out.get("data", {})
    ]
    used: set[str] = set()
    while todo:
        model = todo.pop()
        if model not in used:
            used.add(model)
            todo += refers_to(state.get(model, {}))
    # A link (jslink) refers to the models it joins, and nothing refers to it: kept when both
    # are.
    links = [k for k, m in state.items() if m.get("model_name") in LINKS]
    return used | {k for k in links if set(refers_to(state[k])) <= used}


def refers_to(model: dict) -> list[str]:
    """The model ids a model's state names (``"IPY_MODEL_<id>"``)."""
    return re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(model.get("state", {})))


def mark_live_cells(nb: nbformat.NotebookNode) -> bool:
    """Mark every live cell of ``nb`` in place and drop unused widget models. Returns whether
    anything changed."""
    before = json.dumps(nb, sort_keys=True)
    for cell in nb.cells:
        if is_live(cell):
            mark_live_cell(cell)
    widgets = nb.metadata.get("widgets", {}).get(WIDGET_STATE)
    if widgets:
        used = used_models(nb)
        widgets["state"] = {k: v for k, v in widgets["state"].items() if k in used}
    return json.dumps(nb, sort_keys=True) != before


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        if mark_live_cells(nb):
            nbformat.write(nb, path)
            print(f"{path}: live cells marked as recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
