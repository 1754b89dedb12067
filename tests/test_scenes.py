"""Synthetic scenes: deterministic, and every caption and answer is what the *pixels* show.

The oracle below reads the rendered image only (exact palette pixels per colour), never the
Scene's coordinates, so a drawing bug and a text bug cannot hide each other.
"""

import json
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minirad.course.scenes import (
    CAPTION_PROMPT,
    COLOURS,
    COUNT_WORDS,
    DEFAULT_IMAGE_SIZE,
    GAP,
    JSON_PROMPT,
    JSON_TASK,
    SHAPES,
    SHAPES_JSON_SCHEMA,
    TASK_TYPES,
    ask,
    caption,
    questions,
    random_scene,
    render,
    save_chapter_images,
    shapes_json,
)
from minirad.models.tokenizer import DEFAULT_TOKENIZER_DIR

seeds = st.integers(min_value=0, max_value=2**32 - 1)


@dataclass
class Seen:
    """One shape as found in the pixels: its colour's exact-pixel mask, bounding box and kind."""

    colour: str
    left: int
    top: int
    right: int  # inclusive
    bottom: int
    kind: str

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


def look(image) -> list[Seen]:
    """Shapes visible in the image: one per palette colour with pixels of exactly that RGB.

    The kind comes from the mask's shape: a square fills its bounding box; an upward triangle
    has about 1/3 as many pixels above its box's middle row as below it, a circle about as many.
    """
    pixels = np.asarray(image)
    seen = []
    for colour, rgb in COLOURS.items():
        mask = (pixels == np.array(rgb)).all(-1)
        if not mask.any():
            continue
        rows, cols = np.nonzero(mask)
        top, bottom, left, right = rows.min(), rows.max(), cols.min(), cols.max()
        fill = mask.sum() / ((bottom - top + 1) * (right - left + 1))
        middle = (top + bottom) / 2
        up_down = (rows < middle).sum() / (rows > middle).sum()
        kind = "square" if fill > 0.95 else "triangle" if up_down < 0.6 else "circle"
        seen.append(Seen(colour, left, top, right, bottom, kind))
    return seen


def where(a: Seen, b: Seen) -> list[str]:
    """Every relation that *clearly* holds between the pixel boxes of a and b: separated along
    one axis, overlapping along the other. Unambiguous scenes give exactly one."""
    overlap_x = a.left <= b.right and b.left <= a.right
    overlap_y = a.top <= b.bottom and b.top <= a.bottom
    found = []
    if overlap_y and a.right < b.left:
        found.append("left")
    if overlap_y and a.left > b.right:
        found.append("right")
    if overlap_x and a.bottom < b.top:
        found.append("above")
    if overlap_x and a.top > b.bottom:
        found.append("below")
    return found


def reading_order(seen: list[Seen]) -> tuple[list[Seen], str]:
    """Shapes sorted along the row, and the row's direction, judged from the pixel boxes."""
    if len(seen) == 1:
        return seen, "single"
    xs = [s.left + s.right for s in seen]
    ys = [s.top + s.bottom for s in seen]
    if max(xs) - min(xs) > max(ys) - min(ys):
        return sorted(seen, key=lambda s: s.left), "horizontal"
    return sorted(seen, key=lambda s: s.top), "vertical"


def article(colour: str) -> str:
    return "an" if colour[0] in "aeiou" else "a"


def expected_caption(seen: list[Seen]) -> str:
    ordered, axis = reading_order(seen)
    names = [f"{article(s.colour)} {s.name}" for s in ordered]
    if axis == "single":
        return names[0]
    if len(names) == 2:
        return f"{names[0]} {'left of' if axis == 'horizontal' else 'above'} {names[1]}"
    order = "from left to right" if axis == "horizontal" else "from top to bottom"
    return f"{names[0]}, {names[1]} and {names[2]} {order}"


def by_name(seen: list[Seen], name: str) -> Seen:
    matches = [s for s in seen if s.name == name]
    assert len(matches) == 1, f"{name!r} does not name exactly one shape in {seen}"
    return matches[0]


def oracle_answer(seen: list[Seen], prompt: str) -> str:
    """Answer a prompt from the pixels alone, asserting that the answer is unique."""
    if prompt == CAPTION_PROMPT:
        return expected_caption(seen)
    if prompt == JSON_PROMPT:
        shapes = [{"colour": s.colour, "shape": s.kind} for s in reading_order(seen)[0]]
        return json.dumps({"shapes": shapes})
    if prompt == "How many shapes are there?":
        return COUNT_WORDS[len(seen)]
    if prompt.startswith("What colour is the "):
        kind = prompt.removeprefix("What colour is the ").removesuffix("?")
        matches = [s for s in seen if s.kind == kind]
        assert len(matches) == 1, f"{prompt!r} is ambiguous or unanswerable"
        return matches[0].colour
    if prompt.startswith("What shape is the "):
        colour = prompt.removeprefix("What shape is the ").removesuffix(" one?")
        (match,) = [s for s in seen if s.colour == colour]
        return match.kind
    if prompt.startswith("Where is the "):
        a, b = prompt.removeprefix("Where is the ").removesuffix("?").split(" relative to the ")
        first, second = by_name(seen, a), by_name(seen, b)
        (rel,) = where(first, second)  # exactly one relation holds
        if rel in ("right", "below"):  # the answer names the pair in reading order
            first, second = second, first
        phrase = "left of" if rel in ("left", "right") else "above"
        return f"the {first.name} is {phrase} the {second.name}"
    if prompt.startswith("Is there "):
        article, name = prompt.removeprefix("Is there ").removesuffix("?").split(" ", 1)
        assert article == ("an" if name.startswith("orange") else "a"), prompt
        return "yes" if any(s.name == name for s in seen) else "no"
    raise AssertionError(f"unknown prompt {prompt!r}")


@given(seeds)
def test_same_seed_same_scene_and_pixels(seed):
    a, b = random_scene(random.Random(seed)), random_scene(random.Random(seed))
    assert a == b
    assert render(a).tobytes() == render(b).tobytes()
    qa, qb = questions(a, random.Random(seed)), questions(b, random.Random(seed))
    assert qa == qb


def test_different_seeds_differ():
    scenes = [random_scene(random.Random(seed)) for seed in range(50)]
    assert len({render(s).tobytes() for s in scenes}) == 50
    assert len({caption(s) for s in scenes}) > 30


@given(seeds)
def test_image_properties(seed):
    scene = random_scene(random.Random(seed))
    image = render(scene)
    assert image.mode == "RGB"
    assert image.size == (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
    pixels = np.asarray(image)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    assert (border == 255).all(), "shapes must stay inside the margin"
    assert 1 <= len(scene.shapes) <= 3
    assert len({s.colour for s in scene.shapes}) == len(scene.shapes)


@given(seeds)
def test_captions_and_answers_match_the_pixels(seed):
    rng = random.Random(seed)
    scene = random_scene(rng)
    seen = look(render(scene))
    assert sorted(s.name for s in seen) == sorted(s.name for s in scene.shapes)
    for question in questions(scene, rng):
        assert question.answer == oracle_answer(seen, question.prompt), question


@given(seeds)
def test_every_pair_has_exactly_one_relation(seed):
    scene = random_scene(random.Random(seed))
    seen = look(render(scene))
    for a in seen:
        for b in seen:
            if a is not b:
                assert len(where(a, b)) == 1
                # Along the row the boxes are at least GAP apart (minus 2 px of anti-aliasing).
                gap = max(b.left - a.right, a.left - b.right, b.top - a.bottom, a.top - b.bottom)
                assert gap >= GAP * DEFAULT_IMAGE_SIZE - 2


@pytest.mark.parametrize("size", [32, 64, 96])
def test_other_canvas_sizes(size):
    rng = random.Random(size)
    for _ in range(20):
        scene = random_scene(rng, size=size)
        image = render(scene)
        assert image.size == (size, size)
        seen = look(image)
        assert caption(scene) == expected_caption(seen)


def test_question_types_cover_all_answers():
    rng = random.Random(0)
    answers: dict[str, list[str]] = {t: [] for t in TASK_TYPES}
    for _ in range(600):
        scene = random_scene(rng)
        for q in questions(scene, rng):
            answers[q.type].append(q.answer)
    assert set(answers["colour"]) == set(COLOURS)
    assert set(answers["shape"]) == set(SHAPES)
    assert set(answers["count"]) == {"one", "two", "three"}
    assert {a.split(" is ")[1].rsplit(" the ")[0] for a in answers["where"]} == {"left of", "above"}
    share = answers["exists"].count("yes") / len(answers["exists"])
    assert 0.4 < share < 0.6, f"exists: {share:.2f} yes"
    # Every scene has both descriptions, a shape and a count question.
    assert len(answers["caption"]) == len(answers["json"]) == 600
    assert len(answers["shape"]) == len(answers["count"]) == 600


@pytest.mark.parametrize("seed", range(40))
def test_json_answers_list_the_caption_and_validate(seed):
    """The JSON answer names the caption's shapes in the same reading order, validates against
    the schema, and is written as json.dumps writes it (compact, fixed separators)."""
    jsonschema = pytest.importorskip("jsonschema")
    scene = random_scene(random.Random(seed))
    answer = ask(scene, JSON_TASK, random.Random(seed)).answer
    assert answer == shapes_json(scene)
    value = json.loads(answer)
    jsonschema.validate(value, SHAPES_JSON_SCHEMA)
    assert json.dumps(value) == answer
    names = [f"{s['colour']} {s['shape']}" for s in value["shapes"]]
    assert names == [s.name for s in scene.shapes]
    positions = [caption(scene).index(n) for n in names]
    assert positions == sorted(positions)


def test_the_shipped_schema_file_is_the_one_in_the_code():
    """data/schemas/shapes.schema.json (docs/serving.md's `--json-schema` example) is
    SHAPES_JSON_SCHEMA, written with json.dumps(indent=2)."""
    path = DEFAULT_TOKENIZER_DIR.parent / "schemas" / "shapes.schema.json"
    assert json.loads(path.read_text()) == SHAPES_JSON_SCHEMA


def test_ask_returns_none_when_the_scene_admits_no_such_question():
    one = random_scene(random.Random(0), objects=[("red", "circle")], axis="horizontal")
    assert ask(one, "where", random.Random(0)) is None
    same = [("red", "circle"), ("blue", "circle"), ("green", "circle")]
    three_circles = random_scene(random.Random(0), objects=same, axis="vertical")
    assert ask(three_circles, "colour", random.Random(0)) is None
    assert {q.type for q in questions(three_circles, random.Random(0))} == set(TASK_TYPES) - {
        "colour"
    }


def test_fixed_objects_and_axis():
    objects = [("orange", "triangle"), ("purple", "square")]
    scene = random_scene(random.Random(3), objects=objects, axis="vertical")
    assert [(s.colour, s.kind) for s in scene.shapes] == objects
    assert caption(scene) == "an orange triangle above a purple square"
    assert expected_caption(look(render(scene))) == caption(scene)


@pytest.mark.parametrize(
    ("objects", "axis"),
    [
        ([("red", "circle"), ("red", "square")], "horizontal"),  # repeated colour
        ([("pink", "circle")], "horizontal"),
        ([("red", "star")], "horizontal"),
        ([], "horizontal"),
        ([("red", "circle")] + [(c, "square") for c in ("blue", "green", "yellow")], "vertical"),
        ([("red", "circle")], "diagonal"),
    ],
)
def test_bad_scene_specs_are_rejected(objects, axis):
    with pytest.raises(ValueError):
        random_scene(random.Random(0), objects=objects, axis=axis)


def test_unknown_question_type_is_rejected():
    with pytest.raises(ValueError, match="unknown question type"):
        ask(random_scene(random.Random(0)), "size", random.Random(0))


def test_chapter_images_are_reproducible(tmp_path):
    """The committed data/images/ PNGs are exactly what save_chapter_images draws."""
    from PIL import Image

    committed = DEFAULT_TOKENIZER_DIR.parent / "images"
    paths = save_chapter_images(tmp_path)
    assert 6 <= len(paths) <= 8
    for path in paths:
        fresh, shipped = Image.open(path), Image.open(committed / path.name)
        assert fresh.size == shipped.size == (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
        assert fresh.tobytes() == shipped.tobytes(), path.name
        # The file name lists the shapes the image shows, in reading order.
        names = [f"{s.colour}_{s.kind}" for s in reading_order(look(fresh))[0]]
        positions = [path.stem.find(name) for name in names]
        assert -1 not in positions and positions == sorted(positions), path.name
    assert (tmp_path / "README.md").read_text() == (committed / "README.md").read_text()
