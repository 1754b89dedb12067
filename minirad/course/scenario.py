"""Scripted request scenarios, replayed through a real RadixCache, and what each step did.

A scenario (``data/scenarios/*.json``) is a list of steps; each step sends a few requests made
of named text segments ("system", "hello", ...). Replaying it tokenizes the text with the
course tokenizer and serves every request the way SGLang's scheduler treats a request
(``python/sglang/srt/managers/schedule_batch.py`` and ``mem_cache/radix_cache.py``): match the
prompt, lock the matched prefix, evict if the request asks for room, insert prompt + output,
unlock. What a step did (nodes added, accessed, split, evicted; the tree afterwards) is
computed *only from the cache's events*, exactly as the visualizer sees them; nothing here
reads the tree's internals.

The course's scenario is Figure 3 of the SGLang paper (Zheng et al., NeurIPS 2024, arXiv
2312.07104), retold in ``data/scenarios/figure3.json``, with the paper's colours in
:func:`draw_step`: green = added, blue = accessed, red dashed = evicted, grey = untouched.

Example::

    replay = ScenarioReplay()                     # Figure 3, the course tokenizer, LRU
    for result in replay.run():
        print(result.step.caption, result.names(result.evicted))
        draw_step(result)                         # a graphviz.Digraph

A node keeps one letter (a, b, c, ... in order of creation) through the whole replay, so a
caption's "node c" is the same box in every panel; a split's prefix keeps the letter and the
suffix gets a new one.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from minirad.course import dot
from minirad.errors import InvalidArgumentError
from minirad.events import Event, EventBus, EvictEvent, InsertEvent, MatchEvent, SplitEvent, plural
from minirad.kv_events.event_tree import EventNode, EventTree
from minirad.kvcache.eviction import EvictionPolicy
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache

if TYPE_CHECKING:
    import graphviz

__all__ = [
    "DEFAULT_SCENARIO",
    "LABEL_SEP",
    "Request",
    "Scenario",
    "ScenarioReplay",
    "Step",
    "StepResult",
    "draw_step",
    "load_scenario",
]

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "data" / "scenarios" / "figure3.json"
LABEL_SEP = " + "  # a node's label: the names of the segments on its edge, joined


# ------------------------------------------------------------------ the scenario file
@dataclass(frozen=True)
class Request:
    """One request: segment names of the prompt (sent) and the output (generated).

    ``evict`` names segments: before inserting, the cache is asked to free as many tokens as
    they hold; the eviction policy chooses which leaves go.
    """

    name: str
    prompt: tuple[str, ...]
    output: tuple[str, ...]
    evict: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    """One panel of the story: its requests, caption, and the outcome the file expects.

    ``expected`` holds ``tree`` (nested ``{label: {child label: ...}}``), ``added``,
    ``accessed``, ``evicted`` (label lists) and ``split`` (``[prefix, suffix]`` label pairs).
    ``letters`` maps the letters the caption names to the labels of those nodes (letters
    are the replay's: see :attr:`StepResult.letters`).
    """

    number: int
    title: str
    caption: str
    requests: tuple[Request, ...]
    letters: dict[str, str]
    expected: dict


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    source: str
    notes: tuple[str, ...]
    segments: dict[str, str]  # name -> text
    steps: tuple[Step, ...]


def load_scenario(path: str | Path = DEFAULT_SCENARIO) -> Scenario:
    """Read a scenario file.

    Raises:
        InvalidArgumentError: a request or label names an unknown segment, or the steps are
            not numbered 1, 2, 3, ...
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    segments = dict(data["segments"])

    def known(names, where: str) -> tuple[str, ...]:
        unknown = [n for n in names if n not in segments]
        if unknown:
            raise InvalidArgumentError(f"{where}: unknown segments {unknown}")
        return tuple(names)

    steps = []
    for i, s in enumerate(data["steps"], 1):
        if s["step"] != i:
            raise InvalidArgumentError(f"step {s['step']} is at position {i}")
        requests = tuple(
            Request(
                r["name"],
                known(r["prompt"], f"step {i}"),
                known(r["output"], f"step {i}"),
                known(r.get("evict", ()), f"step {i}"),
            )
            for r in s["requests"]
        )
        for label in s["letters"].values():
            known(label.split(LABEL_SEP), f"step {i} letters")
        steps.append(Step(i, s["title"], s["caption"], requests, s["letters"], s["expected"]))
    return Scenario(
        data["name"], data["title"], data["source"], tuple(data["notes"]), segments, tuple(steps)
    )


# ------------------------------------------------------------------ one step's outcome
@dataclass(frozen=True)
class StepResult:
    """What one step did, from its events. Node ids are the cache's ``TreeNode.id``.

    Attributes:
        step: the scenario step.
        events: every event of the step, in order (cache and KV pool).
        nodes: the tree after the step (root ``0`` included).
        ghosts: nodes evicted during the step, as they were when they left.
        added: new leaves (green), in creation order.
        accessed: nodes walked by a match or an insert that the step neither added nor
            evicted (blue), in the order first walked.
        evicted: evicted nodes (red), in eviction order.
        splits: ``(prefix id, suffix id)`` of every split; the prefix keeps the old id.
        labels: node id -> segment label (nodes and ghosts).
        texts: node id -> decoded text of the edge (nodes and ghosts).
        letters: node id -> the node's letter (nodes and ghosts): ``a`` for the first node
            the replay created, ``b`` for the next...; a node keeps it in every step.
    """

    step: Step
    events: tuple[Event, ...]
    nodes: dict[int, EventNode]
    ghosts: dict[int, EventNode]
    added: tuple[int, ...]
    accessed: tuple[int, ...]
    evicted: tuple[int, ...]
    splits: tuple[tuple[int, int], ...]
    labels: dict[int, str]
    texts: dict[int, str]
    letters: dict[int, str]

    def names(self, ids) -> list[str]:
        """Labels of the given node ids."""
        return [self.labels[i] for i in ids]

    def tree(self, node_id: int = 0) -> dict:
        """The tree below ``node_id`` as nested ``{label: {child label: ...}}``."""
        return {self.labels[c]: self.tree(c) for c in self.nodes[node_id].children}

    def state(self, node_id: int) -> str:
        """``"added"``, ``"accessed"``, ``"evicted"`` or ``"cached"`` (untouched)."""
        for name in ("evicted", "added", "accessed"):
            if node_id in getattr(self, name):
                return name
        return "cached"

    @property
    def total_tokens(self) -> int:
        """Tokens cached after the step."""
        return sum(len(n.key) for n in self.nodes.values())


# ------------------------------------------------------------------ the replay
class ScenarioReplay:
    """Serve a scenario's requests, step by step, with a real :class:`RadixCache`.

    Args:
        scenario: the scenario (Figure 3 if None).
        tokenizer: anything with ``encode(text, add_special_tokens=False)`` and
            ``decode(ids)``; the course tokenizer if None.
        eviction_policy: ``"lru"`` (the paper's), another name of
            :data:`minirad.kvcache.eviction.EVICTION_POLICIES` or a policy object.

    The KV pool holds every token the scenario could ever need, so only the requests' own
    ``evict`` entries free memory. Attributes ``cache``, ``allocator`` and ``bus`` are live.

    Raises:
        InvalidArgumentError: a segment is a token prefix of another (labels would be
            ambiguous), or a request's full text does not tokenize to its segments' tokens.
    """

    def __init__(
        self,
        scenario: Scenario | None = None,
        tokenizer=None,
        eviction_policy: str | EvictionPolicy = "lru",
    ) -> None:
        if tokenizer is None:
            from minirad.models.tokenizer import load_tokenizer

            tokenizer = load_tokenizer()
        self.scenario = scenario if scenario is not None else load_scenario()
        self.tokenizer = tokenizer
        self.segment_ids = {
            name: tuple(tokenizer.encode(text, add_special_tokens=False))
            for name, text in self.scenario.segments.items()
        }
        self._check_segments()
        self.bus = EventBus()
        pool = sum(
            len(self.tokens(r.prompt + r.output)) for s in self.scenario.steps for r in s.requests
        )
        self.allocator = TokenToKVPoolAllocator(max(pool, 1), bus=self.bus)
        self.cache = RadixCache(
            eviction_policy=eviction_policy, token_to_kv_pool_allocator=self.allocator, bus=self.bus
        )
        self.view = EventTree()
        self._letters: dict[int, str] = {}  # node id -> letter, for the whole replay
        self._events: list[Event] = []
        self.bus.subscribe(self.view.apply)
        self.bus.subscribe(self._events.append)
        self.results: list[StepResult] = []

    def _check_segments(self) -> None:
        ids = self.segment_ids
        for a in ids:
            for b in ids:
                if a != b and ids[b][: len(ids[a])] == ids[a]:
                    raise InvalidArgumentError(f"segment {a!r} is a token prefix of {b!r}")
        for step in self.scenario.steps:
            for r in step.requests:
                names = r.prompt + r.output
                text = "".join(self.scenario.segments[n] for n in names)
                if list(self.tokenizer.encode(text, add_special_tokens=False)) != self.tokens(
                    names
                ):
                    raise InvalidArgumentError(
                        f"step {step.number}, {r.name!r}: the full text tokenizes differently "
                        "from its segments (a token spans a segment boundary)"
                    )

    def tokens(self, names) -> list[int]:
        """Token ids of a sequence of segment names."""
        return [t for n in names for t in self.segment_ids[n]]

    def label(self, key) -> str:
        """The segment names that make up ``key``, joined with :data:`LABEL_SEP`; the decoded
        text in quotes if ``key`` does not fall on segment boundaries (a split mid-segment)."""
        names, i = [], 0
        while i < len(key):
            name = next(
                (n for n, ids in self.segment_ids.items() if tuple(key[i : i + len(ids)]) == ids),
                None,
            )
            if name is None:
                return repr(self.tokenizer.decode(list(key)))
            names.append(name)
            i += len(self.segment_ids[name])
        return LABEL_SEP.join(names)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.scenario.steps)

    def step(self) -> StepResult:
        """Serve the next step's requests and return what happened.

        Raises:
            InvalidArgumentError: every step has been replayed.
        """
        if self.done:
            raise InvalidArgumentError("the scenario is over")
        step = self.scenario.steps[len(self.results)]
        start = len(self._events)
        for request in step.requests:
            self._serve(request)
        result = self._summarize(step, tuple(self._events[start:]))
        self.results.append(result)
        return result

    def run(self) -> list[StepResult]:
        """Replay the remaining steps; return every step's result so far."""
        while not self.done:
            self.step()
        return self.results

    def _serve(self, request: Request) -> None:
        prompt = self.tokens(request.prompt)
        seq = prompt + self.tokens(request.output)
        indices, node = self.cache.match_prefix(prompt)
        self.cache.inc_lock_ref(node)  # the running request's prefix must survive eviction
        if request.evict:
            self.cache.evict(len(self.tokens(request.evict)))
        slots = indices + self.allocator.alloc(len(seq) - len(indices), owner=request.name)
        prefix_len = self.cache.insert(seq, slots)
        # Tokens the tree already held beyond the match keep the tree's slots; ours are spare.
        self.allocator.free(slots[len(indices) : prefix_len])
        self.cache.dec_lock_ref(node)

    def _summarize(self, step: Step, events: tuple[Event, ...]) -> StepResult:
        added = [e.node_id for e in events if isinstance(e, InsertEvent) and e.node_id is not None]
        evicted = [e.node_id for e in events if isinstance(e, EvictEvent)]
        walked = [i for e in events if isinstance(e, MatchEvent | InsertEvent) for i in e.path]
        skip = set(added) | set(evicted)
        accessed = list(dict.fromkeys(i for i in walked if i not in skip))
        splits = [(e.node_id, e.new_node_id) for e in events if isinstance(e, SplitEvent)]
        gone = self.view.release()  # first: the copies' children are then the live ones
        nodes = {i: replace(n, children=list(n.children)) for i, n in self.view.nodes.items()}
        ghosts = {i: gone[i] for i in evicted}
        keys = {i: n.key for i, n in (nodes | ghosts).items() if i != 0}
        for i in sorted(keys.keys() - self._letters.keys()):  # ids grow with creation
            self._letters[i] = _letter(len(self._letters))
        return StepResult(
            step=step,
            events=events,
            nodes=nodes,
            ghosts=ghosts,
            added=tuple(added),
            accessed=tuple(accessed),
            evicted=tuple(evicted),
            splits=tuple(splits),
            labels={i: self.label(k) for i, k in keys.items()},
            texts={i: self.tokenizer.decode(list(k)) for i, k in keys.items()},
            letters={i: self._letters[i] for i in keys},
        )


def _letter(k: int) -> str:
    """The ``k``-th letter name: ``a`` .. ``z``, then ``aa``, ``ab``..."""
    name = ""
    k += 1
    while k:
        k, r = divmod(k - 1, 26)
        name = chr(ord("a") + r) + name
    return name


# ------------------------------------------------------------------ drawing
# The paper's colours: green added, blue accessed, red dashed evicted, grey untouched.
_STYLE = {
    "added": {"fillcolor": "#d4edcf", "color": "#3a8a2e"},
    "accessed": {"fillcolor": "#d6e6fb", "color": "#2f62b0"},
    "cached": {"fillcolor": "#eeeeee", "color": "#777777"},
    "evicted": {"fillcolor": "#ffffff", "color": "#c62828", "fontcolor": "#c62828"},
}


def _label_text(text: str, width: int, max_lines: int) -> str:
    """``text`` wrapped to ``width`` characters and left-aligned (Graphviz's ``\\l`` line
    ends; a newline in the text starts a new line). Beyond ``max_lines`` lines the middle is
    cut, keeping the last line: where an edge ends is what a reader compares with a sibling."""
    lines = [w for part in text.strip().split("\n") for w in textwrap.wrap(part, width) or [""]]
    if len(lines) > max_lines:
        lines = lines[: max_lines - 2] + ["…", lines[-1]]
    return "".join(dot.escape(line) + "\\l" for line in lines)


def draw_step(result: StepResult, width: int = 28, max_lines: int = 5) -> graphviz.Digraph:
    """The tree after ``result``'s step, coloured by what the step did, with the nodes it
    evicted drawn as red dashed ghosts under their old parents.

    Each box shows the node's letter (the same in every step), the edge's length in tokens and
    its text (wrapped to ``width`` characters, at most ``max_lines`` lines).
    """
    n = result.step.number
    graph = dot.digraph(
        f"step{n}",
        graph_attr={
            "label": f"({n}) {result.step.title}",
            "labelloc": "t",
            "fontsize": "12",
            "nodesep": "0.2",
            "ranksep": "0.25",
        },
        node_attr={"shape": "box", "style": "rounded,filled"},
        edge_attr={"arrowhead": "none", "color": "#555555"},
    )
    graph.node("0", "root", shape="circle", fontsize="9", fillcolor="#eeeeee", color="#777777")
    for node in [*result.nodes.values(), *result.ghosts.values()]:
        if node.id == 0:
            continue
        state = result.state(node.id)
        head = f"({result.letters[node.id]}) " + ("evicted, " if state == "evicted" else "")
        text = _label_text(result.texts[node.id], width, max_lines)
        label = f"{dot.escape(head)}{plural(len(node.key), 'token')}\\l{text}"
        style = "rounded,dashed" if state == "evicted" else "rounded,filled"
        graph.node(str(node.id), label, fontsize="9", style=style, **_STYLE[state])
        edge = {"style": "dashed", "color": "#c62828"} if state == "evicted" else {}
        graph.edge(str(node.parent), str(node.id), **edge)
    return graph
