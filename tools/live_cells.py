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

import ast
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
    # A widget output keeps its picture; one with nothing else to draw goes.
    outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {}) or picture(o)]
    first = outputs[0] if outputs else None
    if not (first and first.output_type == "stream" and first.text.startswith(RECORDED)):
        outputs.insert(0, nbformat.v4.new_output("stream", name="stdout", text=RECORDED))
    cell.outputs = outputs


def picture(out: dict) -> bool:
    """Turn a widget output into the static picture and text of the same bundle, in place
    (its player removed). Returns whether anything is left to draw."""
    data = out.get("data", {})
    data.pop(WIDGET_VIEW, None)
    return bool(data)


def used_models(nb: dict) -> set[str]:
    """The widget models the outputs display, and every model those refer to."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    views = [
        out["data"][WIDGET_VIEW]["model_id"]
        for cell in nb.cells
        for out in cell.get("outputs", [])
        if WIDGET_VIEW in out.get("data", {})
    ]
    used = reachable(state, views)
    # A link (jslink) refers to the models it joins, and nothing refers to it: kept when both
    # are.
    links = [k for k, m in state.items() if m.get("model_name") in LINKS]
    return used | {k for k in links if set(refers_to(state[k])) <= used}


def reachable(state: dict, models: list[str]) -> set[str]:
    """``models`` and every model they refer to, directly or not, in the widget state
    ``state`` (model id -> model); ids that ``state`` lacks are included."""
    todo, found = list(models), set()
    while todo:
        model = todo.pop()
        if model not in found:
            found.add(model)
            todo += refers_to(state.get(model, {}))
    return found


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


def _bound(tree: ast.AST) -> set[str]:
    """The names a cell binds at its top level: assignments, imports, ``def``, ``class``,
    loop and ``with`` targets, walrus (a comprehension's own variables stay inside it)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


class _Reads(ast.NodeVisitor):
    """The names a cell reads before it binds them, in the order Python runs its lines.
    Inside a ``def``, ``lambda`` or comprehension, the scope's own names (parameters, loop
    targets, assignments) are not reads."""

    def __init__(self) -> None:
        self.free: set[str] = set()
        self.bound: set[str] = set()
        self.scopes: list[set[str]] = []

    def visit_Name(self, node: ast.Name) -> None:
        if any(node.id in scope for scope in self.scopes):
            return
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound:
                self.free.add(node.id)
        elif not self.scopes:
            self.bound.add(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):  # x += 1 reads x
            self.visit_Name(ast.Name(node.target.id, ast.Load()))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:  # the value runs before the targets
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_alias(self, node: ast.alias) -> None:
        if not self.scopes:
            self.bound.add((node.asname or node.name).split(".")[0])

    def _scope(self, node: ast.AST, own: set[str], body: list[ast.AST]) -> None:
        self.scopes.append(own | _bound(node))
        for child in body:
            self.visit(child)
        self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults, *node.decorator_list]:
            if default is not None:
                self.visit(default)
        params = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        self._scope(node, params, node.body)
        if not self.scopes:
            self.bound.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        params = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        self._scope(node, params, [node.body])

    def visit_comprehension_scope(self, node: ast.AST) -> None:
        self.visit(node.generators[0].iter)  # the first iterable runs outside the scope
        targets = {
            n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)
        }
        parts = [g for g in node.generators] + [
            getattr(node, "elt", None),
            getattr(node, "key", None),
            getattr(node, "value", None),
        ]
        self._scope(node, targets, [p for p in parts if p is not None])

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_comprehension_scope


def _free(tree: ast.AST) -> set[str]:
    """The names a cell reads that it has not bound itself by then: it takes them from the
    cells run before it."""
    reads = _Reads()
    reads.visit(tree)
    return reads.free


def _source(cell: dict) -> str:
    """A code cell's source as Python: IPython's ``%magic`` and ``!shell`` lines dropped."""
    lines = cell["source"].splitlines()
    return "\n".join("" if re.match(r"\s*[%!]", line) else line for line in lines)


def later_rebinds(nb: dict) -> list[tuple[int, str, int]]:
    """``(live cell, name, later cell)`` for every name a live cell reads from earlier cells
    that a cell after it binds again (indices into ``nb.cells``).

    A learner runs a live cell after Run All, when its server exists (``make vllm``...): the
    names it reads then hold what the *last* cell to bind them left, not what they held at
    the live cell's place. Chapter 08's live SGLang cell read ``follow_up``, which section 10
    binds again to a toy prompt: after Run All it asked SGLang for garbage."""
    cells = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    trees = {i: ast.parse(_source(c)) for i, c in cells}
    found = []
    for i, cell in cells:
        if not is_live(cell):
            continue
        free = _free(trees[i])
        for j, _ in cells:
            if j > i:
                found += [(i, name, j) for name in sorted(free & _bound(trees[j]))]
    return found


def main(paths: list[str]) -> int:
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        if mark_live_cells(nb):
            nbformat.write(nb, path)
            print(f"{path}: live cells marked as recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
