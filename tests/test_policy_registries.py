"""One registry per kind of policy, and what reads it; chapter 06's printout of a request's
counters, which a new ``RequestStats`` field must not change (issue 44).

A contributor adds a policy to one registry (``EVICTION_POLICIES``, ``SCHEDULE_POLICIES``): the
engine's check and the ``minirad`` flags' choices read it (``tests/test_cli.py``,
``tests/test_scheduler.py``). The docs may list the names too; here each list is checked against
its registry, in the registry's order, so a new policy fails this test until the docs name it.
"""

import contextlib
import io
import json
import re
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from minirad.engine.request import RequestStats
from minirad.engine.schedule_policy import SCHEDULE_POLICIES
from minirad.kvcache.eviction import EVICTION_POLICIES

ROOT = Path(__file__).resolve().parent.parent


def one_line(path: Path) -> str:
    """A doc's text (a notebook's markdown cells) with every run of whitespace one space."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    else:
        text = path.read_text(encoding="utf-8")
    return " ".join(text.split())


# Where the docs list a registry's names: (file, a pattern whose group holds the list).
LISTS = [
    ("docs/architecture.md", r"`EVICTION_POLICIES` \(([^;]*);", EVICTION_POLICIES),
    ("docs/architecture.md", r"`SCHEDULE_POLICIES` \(([^;]*);", SCHEDULE_POLICIES),
    ("docs/serving.md", r"when the pool is full \(([^:]*): the eviction", EVICTION_POLICIES),
    ("docs/serving.md", r"are admitted in \(([^:]*): the scheduling", SCHEDULE_POLICIES),
    (
        "notebooks/00_tour.ipynb",
        r"\| `kvcache/eviction.py` \| which unlocked leaf goes first: ([^|]*)\|",
        EVICTION_POLICIES,
    ),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "pattern", "registry"), LISTS)
def test_every_list_of_policies_in_the_docs_is_its_registry(doc, pattern, registry):
    found = re.findall(pattern, one_line(ROOT / doc))
    assert len(found) == 1, f"{doc}: the list ({pattern}) is gone or doubled"
    names = re.findall(r"`([\w-]+)`", found[0])
    assert names == list(registry), f"{doc} lists {names}; the registry has {list(registry)}"


def test_each_registry_maps_a_name_to_the_class_of_that_name():
    for registry in (EVICTION_POLICIES, SCHEDULE_POLICIES):
        assert all(cls.name == name for name, cls in registry.items())


# ------------------------------------------------------------- chapter 06's request counters
CELL = "ch06-10"  # prints a finished request's counters, then the same request's again


@dataclass
class FutureStats(RequestStats):
    """``RequestStats`` with a field added after chapter 06 was recorded."""

    usage_tokens: int = 123


def chapter_cell(cell_id: str) -> dict:
    nb = json.loads((ROOT / "notebooks/06_engine.ipynb").read_text(encoding="utf-8"))
    (cell,) = [c for c in nb["cells"] if c.get("id") == cell_id]
    return cell


def run_cell(source: str, stats_type: type) -> str:
    """What the cell prints for the first request of chapter 06 and its repeat (the counts of
    the recorded run), its stats of ``stats_type``."""

    def output(**counts):
        stats = stats_type(**counts, cached_tokens_by_source={"device": counts["cached_tokens"]})
        return types.SimpleNamespace(text="orange", finish_reason="stop", stats=stats)

    out = output(prompt_tokens=79, cached_tokens=0, prefill_tokens=79, decode_tokens=2)
    again = output(prompt_tokens=79, cached_tokens=78, prefill_tokens=1, decode_tokens=2)
    engine = types.SimpleNamespace(generate=lambda requests: [again])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(source, {"out": out, "engine": engine, "request": object()})
    return printed.getvalue()


def test_a_new_request_stats_field_leaves_chapter_06_as_recorded():
    """Chapter 06 prints the counters it teaches by name: its recorded output is what the cell
    prints, and stays so with one more ``RequestStats`` field (a repr would show it)."""
    cell = chapter_cell(CELL)
    source = "".join(cell["source"])
    (stream,) = cell["outputs"]
    recorded = "".join(stream["text"])
    assert run_cell(source, RequestStats) == recorded
    assert run_cell(source, FutureStats) == recorded
    assert "usage_tokens" in repr(FutureStats())  # the check would see a repr
