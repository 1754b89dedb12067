"""The Figure 3 replay (``minirad.course.scenario`` + ``data/scenarios/figure3.json``).

Two independent sources of truth are checked after each of the nine steps:

- the expectations written in the scenario file (tree shape as segment labels, and the nodes
  added / accessed / evicted / split), written by hand from the paper's figure;
- ``REFERENCE`` below: the reference table of ``shared/reference/sglang-figure3.md`` in the
  figure's own letters and counts, mapped to our nodes through ``FIGURE_LETTERS``.

The figure renames its nodes in every panel; ours keep one letter each, and the letters the
file's captions name are checked against the replay's.

The tree that the replay rebuilds from events is also compared with the real cache's tree,
and every node's decoded text with the text of the segments its label names.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minirad import RadixCache
from minirad.course.scenario import (
    DEFAULT_SCENARIO,
    LABEL_SEP,
    ScenarioReplay,
    draw_step,
    load_scenario,
)
from minirad.errors import InvalidArgumentError
from minirad.events import EventBus, EventRecorder, event_from_dict
from minirad.kv_events.event_tree import EventTree

# The reference table (sglang-figure3.md), step by step: the letters the figure's caption
# uses for nodes added / accessed / evicted / split / left untouched, and how many nodes
# (root excluded) each set and the tree after the step hold.
REFERENCE = {
    1: dict(added=set(), accessed=set(), evicted=set(), split=set(), untouched=set(),
            counts=(0, 0, 0), nodes=0),
    2: dict(added={"a"}, accessed=set(), evicted=set(), split=set(), untouched=set(),
            counts=(1, 0, 0), nodes=1),
    3: dict(added=set(), accessed={"b"}, evicted=set(), split=set(), untouched=set(),
            counts=(1, 1, 0), nodes=2),
    4: dict(added={"d"}, accessed={"b"}, evicted=set(), split={"b"}, untouched={"c"},
            counts=(1, 1, 0), nodes=4),
    5: dict(added=set(), accessed={"d"}, evicted={"c"}, split=set(), untouched=set(),
            counts=(1, 2, 1), nodes=4),
    6: dict(added={"e"}, accessed=set(), evicted=set(), split=set(), untouched=set(),
            counts=(1, 0, 0), nodes=5),
    7: dict(added=set(), accessed={"e"}, evicted=set(), split={"e"}, untouched={"f", "g", "h"},
            counts=(2, 1, 0), nodes=8),
    8: dict(added={"i"}, accessed=set(), evicted={"g", "h"}, split=set(),
            untouched={"j", "k", "l"}, counts=(1, 2, 2), nodes=7),
    9: dict(added=set(), accessed={"j"}, evicted={"i", "k", "l"}, split={"j"}, untouched=set(),
            counts=(3, 2, 3), nodes=8),
}  # fmt: skip
# Where the reference states an order: step 8 evicts h, then g (which became a leaf).
REFERENCE_EVICTION_ORDER = {8: ["h", "g"]}
# The figure's per-panel letters, as the labels of our nodes.
_S, _HH, _SOLVE = "system + user", "hello + assistant + hi", "user + solve + assistant + sure_solve"
_WC, _ST = "what_can + assistant + i_can", "user + story + assistant + sure_story"
_J = "user + solve + assistant + sure_solve + user + how_about + assistant + it_is"
FIGURE_LETTERS = {
    1: {},
    2: {"a": "system + user + hello + assistant + hi"},
    3: {"b": "system + user + hello + assistant + hi"},
    4: {"b": _S, "c": _SOLVE, "d": _WC},
    5: {"c": _SOLVE, "d": _WC},
    6: {"e": "examples + q_what + a_this"},
    7: {"e": "examples", "f": _HH, "g": _WC, "h": _ST},
    8: {"g": _WC, "h": _ST, "i": _J, "j": "q_what + a_this", "k": "q_when + a_when",
        "l": "q_how + a_how"},
    9: {"i": _J, "j": "q_what", "k": "q_when + a_when", "l": "q_how + a_how"},
}  # fmt: skip


def real_tree(cache: RadixCache) -> dict[int, tuple[int, tuple[int, ...]]]:
    """node id -> (parent id, key), walked on the live cache."""
    out, stack = {}, [cache.root_node]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            out[child.id] = (node.id, tuple(child.key))
            stack.append(child)
    return out


@pytest.fixture(scope="module")
def replayed(tokenizer):
    """Replay every step; after each one record the real cache's tree and check invariants."""
    replay = ScenarioReplay(tokenizer=tokenizer)
    real = []
    while not replay.done:
        replay.step()
        replay.cache.check_invariants()
        real.append((real_tree(replay.cache), replay.cache.total_size()))
    return replay, real


STEPS = range(1, 10)


def test_the_scenario_has_nine_steps_with_captions():
    scenario = load_scenario()
    assert [s.number for s in scenario.steps] == list(STEPS)
    assert all(s.caption and s.title for s in scenario.steps)


@pytest.mark.parametrize("n", STEPS)
def test_tree_after_step_matches_the_file(replayed, n):
    replay, _ = replayed
    result = replay.results[n - 1]
    assert result.tree() == result.step.expected["tree"]


@pytest.mark.parametrize("n", STEPS)
def test_added_accessed_evicted_split_match_the_file(replayed, n):
    result = replayed[0].results[n - 1]
    expected = result.step.expected
    assert result.names(result.added) == expected["added"]
    assert result.names(result.accessed) == expected["accessed"]
    assert result.names(result.evicted) == expected["evicted"]
    assert [[result.labels[a], result.labels[b]] for a, b in result.splits] == expected["split"]


@pytest.mark.parametrize("n", STEPS)
def test_step_matches_the_reference_table(replayed, n):
    result = replayed[0].results[n - 1]
    ref = REFERENCE[n]
    letters = FIGURE_LETTERS[n]
    ids = {letter: [i for i, lab in result.labels.items() if lab == letters[letter]]
           for letter in letters}  # fmt: skip
    assert all(len(v) == 1 for v in ids.values()), "a letter must name exactly one node"
    node = {letter: v[0] for letter, v in ids.items()}
    assert {node[x] for x in ref["added"]} <= set(result.added)
    assert {node[x] for x in ref["accessed"]} <= set(result.accessed)
    assert {node[x] for x in ref["evicted"]} == set(result.evicted)
    assert {node[x] for x in ref["split"]} == {prefix for prefix, _ in result.splits}
    for x in ref["untouched"]:
        assert result.state(node[x]) == "cached", x
    assert (len(result.added), len(result.accessed), len(result.evicted)) == ref["counts"]
    assert len(result.nodes) - 1 == ref["nodes"]
    if n in REFERENCE_EVICTION_ORDER:
        assert list(result.evicted) == [node[x] for x in REFERENCE_EVICTION_ORDER[n]]


@pytest.mark.parametrize("n", STEPS)
def test_the_captions_letters_name_the_replays_nodes(replayed, n):
    result = replayed[0].results[n - 1]
    named = {result.letters[i]: label for i, label in result.labels.items()}
    assert {x: named[x] for x in result.step.letters} == result.step.letters
    for x in result.step.letters:
        assert f" {x}" in result.step.caption, x


def test_a_node_keeps_its_letter_in_every_step(replayed):
    """Chapter 03's panels: the node that is (a) in step 2 is (a) in every later step, and no
    two nodes ever share a letter."""
    owner: dict[str, int] = {}
    for result in replayed[0].results:
        for i, letter in result.letters.items():
            assert owner.setdefault(letter, i) == i, (result.step.number, letter)
        assert len(set(result.letters.values())) == len(result.letters)
    first = replayed[0].results[1]
    (node_a,) = first.nodes.keys() - {0}
    assert all(r.letters[node_a] == "a" for r in replayed[0].results[1:])


def test_drawing_shows_each_nodes_letter(replayed):
    for result in replayed[0].results[2:4]:  # step 3 and step 4, which splits a
        body = "\n".join(draw_step(result).body)
        for i, letter in result.letters.items():
            (line,) = [ln for ln in body.splitlines() if ln.lstrip().startswith(f"{i} [")]
            assert f'label="({letter}) ' in line


@pytest.mark.parametrize("n", STEPS)
def test_tree_from_events_is_the_real_tree(replayed, n):
    replay, real = replayed
    result = replay.results[n - 1]
    from_events = {i: (v.parent, v.key) for i, v in result.nodes.items() if i != 0}
    assert from_events == real[n - 1][0]
    assert result.total_tokens == real[n - 1][1]


@pytest.mark.parametrize("n", STEPS)
def test_labels_decode_to_their_segments_text(replayed, tokenizer, n):
    replay, _ = replayed
    result = replay.results[n - 1]
    segments = replay.scenario.segments
    for i, label in result.labels.items():
        node = result.nodes.get(i) or result.ghosts[i]
        text = "".join(segments[s] for s in label.split(LABEL_SEP))
        assert tokenizer.decode(list(node.key)) == text == result.texts[i]


@pytest.mark.parametrize("n", STEPS)
def test_total_tokens_is_the_sum_of_the_expected_segments(replayed, n):
    replay, _ = replayed
    result = replay.results[n - 1]

    def labels(tree):
        for label, sub in tree.items():
            yield label
            yield from labels(sub)

    expected = sum(
        len(replay.tokens(label.split(LABEL_SEP))) for label in labels(result.step.expected["tree"])
    )
    assert result.total_tokens == expected


def test_evictions_free_exactly_the_named_segments(replayed):
    replay, _ = replayed
    for result in replay.results:
        asked = sum(len(replay.tokens(r.evict)) for r in result.step.requests)
        freed = sum(len(result.ghosts[i].key) for i in result.evicted)
        assert freed == asked, result.step.number


def test_a_different_policy_breaks_the_figure(tokenizer):
    """The expectations can fail: FIFO evicts by insertion time and, at step 9, removes the
    old answer 'This is 17.' (inserted at step 6) that LRU keeps."""
    replay = ScenarioReplay(tokenizer=tokenizer, eviction_policy="fifo")
    results = replay.run()
    assert all(r.tree() == r.step.expected["tree"] for r in results[:8])
    step9 = results[8]
    assert "a_this" in step9.names(step9.evicted)
    assert step9.tree() != step9.step.expected["tree"]


def test_recorded_events_rebuild_the_same_trees(replayed):
    """A subscriber that only gets the saved events (the visualizer) sees the same trees."""
    replay, _ = replayed
    view = EventTree()
    for result in replay.results:
        for event in result.events:
            view.apply(event_from_dict(json.loads(json.dumps(event.to_dict()))))
        assert {i: n.key for i, n in view.nodes.items()} == {
            i: n.key for i, n in result.nodes.items()
        }


def test_event_tree_follows_a_reset():
    bus = EventBus()
    view = EventTree()
    bus.subscribe(view.apply)
    cache = RadixCache(bus=bus)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 2, 4], [10, 11, 13])
    assert len(view.nodes) == 4
    cache.reset()
    assert list(view.nodes) == [0] and len(view.evicted) == 3
    assert len(view.release()) == 3 and not view.nodes[0].children and not view.evicted


def test_drawing_colours_follow_the_events(replayed):
    result = replayed[0].results[8]  # step 9: adds, accesses, evicts and keeps untouched nodes
    body = "\n".join(draw_step(result).body)
    colours = {"added": "#d4edcf", "accessed": "#d6e6fb", "cached": "#eeeeee"}
    for i in [*result.nodes, *result.ghosts]:
        if i == 0:
            continue
        (line,) = [ln for ln in body.splitlines() if ln.lstrip().startswith(f"{i} [")]
        state = result.state(i)
        if state == "evicted":
            assert "dashed" in line and "#c62828" in line
        else:
            assert colours[state] in line and "dashed" not in line
    assert {result.state(i) for i in result.nodes if i} == {"added", "accessed", "cached"}


# ---------------------------------------------------------------------- file validation
def scenario_dict() -> dict:
    return json.loads(DEFAULT_SCENARIO.read_text(encoding="utf-8"))


def test_unknown_segment_is_rejected(tmp_path):
    data = scenario_dict()
    data["steps"][1]["requests"][0]["prompt"].append("no_such_segment")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgumentError, match="no_such_segment"):
        load_scenario(path)


def test_steps_must_be_numbered_in_order(tmp_path):
    data = scenario_dict()
    data["steps"][2]["step"] = 7
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgumentError, match="step 7"):
        load_scenario(path)


def test_segments_that_are_prefixes_of_each_other_are_rejected(tmp_path, tokenizer):
    data = scenario_dict()
    data["segments"]["hi_there"] = data["segments"]["hi"] + " There!\n"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgumentError, match="prefix"):
        ScenarioReplay(load_scenario(path), tokenizer=tokenizer)


def test_a_token_across_a_segment_boundary_is_rejected(tmp_path, tokenizer):
    # "Hel" + "lo!" tokenizes as "Hello" + "!" when sent as one text.
    data = scenario_dict()
    data["segments"].update(hel=" Hel", lo="lo!\n")
    data["steps"][1]["requests"][0]["output"] = ["hel", "lo"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert tokenizer.encode(" Hello!\n") != tokenizer.encode(" Hel") + tokenizer.encode("lo!\n")
    with pytest.raises(InvalidArgumentError, match="segment boundary"):
        ScenarioReplay(load_scenario(path), tokenizer=tokenizer)


def test_replaying_past_the_end_raises(tokenizer):
    replay = ScenarioReplay(tokenizer=tokenizer)
    replay.run()
    with pytest.raises(InvalidArgumentError):
        replay.step()


def test_recorder_sees_cache_and_pool_events(tokenizer):
    replay = ScenarioReplay(tokenizer=tokenizer)
    recorder = EventRecorder(replay.bus)
    for _ in range(3):  # step 3 is the first to lock a node (step 2 matches only the root)
        replay.step()
    kinds = {e.kind for e in recorder.events}
    assert {"match", "lock", "alloc", "insert", "unlock"} <= kinds


# ------------------------------------------------------------ chapter 03's prose, letter for letter
CHAPTER_03 = Path(__file__).resolve().parent.parent / "notebooks" / "03_eviction.ipynb"


def prose_letters(text: str) -> list[str]:
    """The node letters a text names, in order of first mention. Letters b, c, ... stand alone
    (not inside code, not after an apostrophe); node a is written "node a" or "a's", since a
    bare "a" is the article."""
    text = re.sub(r"`[^`]*`", " ", text)
    found = re.finditer(r"\bnode (a)\b|\b(a)['’]s\b|(?<!['’])\b([b-z])\b(?!['’])", text)
    letters = [next(g for g in m.groups() if g) for m in found]
    return list(dict.fromkeys(letters))


def split_claims(text: str) -> list[str]:
    """The letters a text says are split ("splits g", "g is split")."""
    return re.findall(r"\bsplits (?:node )?([a-z])\b|\b([a-z]) is split\b", text)


def step_prose() -> dict[int, str]:
    """Chapter 03, section 6: the markdown cell after a step's drawing that explains it
    ("Step 4 is ...", "Step 9: ..."), by step number."""
    cells = json.loads(CHAPTER_03.read_text(encoding="utf-8"))["cells"]
    prose = {}
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and (m := re.match(r"Step (\d+)\b", text)):
            prose[int(m[1])] = text
    return prose


def test_chapter_03_explains_some_steps_in_prose():
    assert set(step_prose()) >= {4, 5, 8, 9}


@pytest.mark.parametrize("n", sorted(step_prose()))
def test_chapter_03s_prose_names_the_replays_letters(replayed, n):
    """The chapter promises stable letters (a node keeps its letter in every panel, and the
    captions use them): the prose under a step must use the same ones as its caption and
    drawing, not the paper's per-panel letters. It may name only nodes of that step's drawing,
    must name every node the step splits or evicts, evictions in the order they happened."""
    result = replayed[0].results[n - 1]
    text = step_prose()[n]
    named = prose_letters(text)
    drawn = set(result.letters.values())
    evicted = [result.letters[i] for i in result.evicted]
    split = [result.letters[prefix] for prefix, _ in result.splits]
    assert set(named) <= drawn, f"step {n} names {sorted(set(named) - drawn)}, not in its drawing"
    missing = [x for x in split + evicted if x not in named]
    assert not missing, f"step {n} splits {split} and evicts {evicted}; its prose names {named}"
    assert [x for x in named if x in evicted] == evicted, f"step {n} evicts in the order {evicted}"
    claims = [a or b for a, b in split_claims(text)]
    assert set(claims) <= set(split), f"step {n}: the prose splits {claims}, the replay {split}"


def test_exercise_5s_solution_names_the_replays_letters(replayed):
    """q5's solution explains step 9 in the same letters."""
    from minirad.exercises.ch03 import Q5_SOLUTION

    result = replayed[0].results[8]
    comments = "\n".join(line for line in Q5_SOLUTION.splitlines() if line.startswith("#"))
    split = {result.letters[prefix] for prefix, _ in result.splits}
    assert set(prose_letters(comments)) <= set(result.letters.values())
    claims = {a or b for a, b in split_claims(comments)}
    assert claims and claims <= split, f"the solution splits {claims}, the replay {split}"
