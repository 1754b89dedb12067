"""Synthetic scenes for the tiny VLM: coloured shapes drawn with Pillow, captions and questions.

A scene is 1 to 3 shapes (circle, square or triangle) in distinct colours, laid out in a row,
either left to right or top to bottom. Shape sizes, gaps and the row's place on the canvas are
random. Every scene comes with text whose answer the picture fixes exactly:

- a caption that names the shapes in reading order::

      "a red circle"
      "a red circle left of a blue square"          (or "... above ...")
      "a red circle, a blue square and a green triangle from left to right"

- questions, each with one correct answer (see :data:`QUESTION_TYPES`)::

      colour    "What colour is the circle?"                       -> "red"
      shape     "What shape is the red one?"                       -> "circle"
      count     "How many shapes are there?"                       -> "two"
      where     "Where is the blue square relative to the red circle?"
                                          -> "the red circle is left of the blue square"
      exists    "Is there a green triangle?"                       -> "no"

- a JSON listing of the shapes in reading order (chapter 09's document-style extraction),
  valid against :data:`SHAPES_JSON_SCHEMA` and written as ``json.dumps`` writes it::

      json      "List the shapes as JSON."
                     -> '{"shapes": [{"colour": "red", "shape": "circle"}, ...]}'

Why the answers are unique: colours never repeat within a scene, so "the red one" names one
shape; a question about "the circle" is only asked when the scene has one circle; and along the
row the shapes' bounding boxes are separated by a gap of at least :data:`GAP` x canvas size
while across it their centres differ by at most ``2 * JITTER`` x canvas size, so exactly one of
left / right / above / below holds for every pair.

Everything is deterministic: :func:`random_scene` draws only from the ``random.Random`` it is
given, and :func:`render` is integer Pillow drawing (4x supersampled, then box-filtered, so edges
are anti-aliased the same way on every machine). ``python -m minirad.course.scenes`` rewrites the
chapter images in ``data/images/``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

__all__ = [
    "CAPTION_PROMPT",
    "COLOURS",
    "COUNT_WORDS",
    "DEFAULT_IMAGE_SIZE",
    "DESCRIPTION_TYPES",
    "JSON_PROMPT",
    "JSON_TASK",
    "QUESTION_TYPES",
    "SHAPES",
    "SHAPES_JSON_SCHEMA",
    "SYSTEM_PROMPTS",
    "TASK_TYPES",
    "Question",
    "Scene",
    "Shape",
    "ask",
    "caption",
    "questions",
    "random_scene",
    "render",
    "save_chapter_images",
    "shapes_json",
]

# RGB fill of each colour name; far apart in RGB so that box-filtered edges stay distinguishable.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "yellow": (240, 200, 30),
    "orange": (250, 130, 20),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("zero", "one", "two", "three")
BACKGROUND = (255, 255, 255)
DEFAULT_IMAGE_SIZE = 48  # pixels per side: the tiny VLM's input resolution

# Layout, as fractions of the canvas side (scale-free, so any canvas size gives the same scenes).
MARGIN = 0.03  # empty border around the row
GAP = 0.035  # minimum empty space between neighbouring shapes' bounding boxes, along the row
JITTER = 0.04  # max offset of a shape's centre from the row's centre line, across the row
# Half the side of a shape's bounding box. Three shapes in a row fit up to a radius of 0.145,
# so the smallest shapes (6 px at 48 px) are still about two vision patches wide.
RADIUS = (0.13, 0.19)
SUPERSAMPLE = 4  # draw at 4x and box-filter down: anti-aliased, integer-exact edges

CAPTION_PROMPT = "Describe the image."
# System prompts for examples that share a system turn (the radix cache's favourite case);
# the tiny VLM's training opens a quarter of its prompts with one (`--system-prob`).
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Look at the picture and answer briefly.",
    "You describe pictures of coloured shapes.",
    "Answer the question about the image.",
)
JSON_PROMPT = "List the shapes as JSON."
# What a "json" answer is: every shape, in reading order, as {"colour", "shape"} pairs. The
# enums make each value one of the scene vocabulary's words, so a grammar leaves the model only
# those choices; the key order is the one the answers are written in.
SHAPES_JSON_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "shapes": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "colour": {"enum": list(COLOURS)},
                    "shape": {"enum": list(SHAPES)},
                },
                "required": ["colour", "shape"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["shapes"],
    "additionalProperties": False,
}
# A question type picks one template. "caption" and "json" are the two description tasks: both
# name every shape in reading order, one in words, one as JSON. TASK_TYPES are the tasks the
# shipped model is trained and evaluated on.
JSON_TASK = "json"
DESCRIPTION_TYPES = ("caption", JSON_TASK)
QUESTION_TYPES = ("colour", "shape", "count", "where", "exists")
TASK_TYPES = (*DESCRIPTION_TYPES, *QUESTION_TYPES)


@dataclass(frozen=True)
class Shape:
    """One filled shape. Coordinates are in pixels of the scene's canvas (floats, origin top left).

    ``radius`` is half the side of the shape's square bounding box: a circle of that radius, a
    square of side ``2 * radius``, or an upward triangle with base and height ``2 * radius``.
    """

    colour: str
    kind: str
    cx: float
    cy: float
    radius: float

    @property
    def name(self) -> str:
        """``"red circle"``: unique within a scene, because colours do not repeat."""
        return f"{self.colour} {self.kind}"

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        """``(left, top, right, bottom)`` in pixels."""
        r = self.radius
        return (self.cx - r, self.cy - r, self.cx + r, self.cy + r)


@dataclass(frozen=True)
class Scene:
    """Shapes in reading order (left to right if ``axis == "horizontal"``, else top to bottom)
    on a white ``size`` x ``size`` pixel canvas."""

    shapes: tuple[Shape, ...]
    axis: str
    size: int = DEFAULT_IMAGE_SIZE


@dataclass(frozen=True)
class Question:
    """A prompt about a scene and its one correct answer. ``type`` is one of :data:`TASK_TYPES`."""

    type: str
    prompt: str
    answer: str


def random_scene(
    rng: random.Random,
    size: int = DEFAULT_IMAGE_SIZE,
    objects: Sequence[tuple[str, str]] | None = None,
    axis: str | None = None,
) -> Scene:
    """Draw a scene from ``rng``: 1-3 shapes, distinct colours, random sizes and places.

    ``objects`` fixes the ``(colour, kind)`` pairs in reading order and ``axis`` the row's
    direction (``"horizontal"`` or ``"vertical"``); otherwise both are random. The same ``rng``
    state always gives the same scene.

    Raises:
        ValueError: unknown colour, shape or axis; repeated colours; more than 3 objects.
    """
    if objects is None:
        n = rng.randint(1, 3)
        colours = rng.sample(sorted(COLOURS), n)
        objects = [(c, rng.choice(SHAPES)) for c in colours]
    objects = list(objects)
    if axis is None:
        axis = rng.choice(("horizontal", "vertical"))
    _check_objects(objects, axis)
    n = len(objects)

    # Radii: capped so that n boxes, n-1 gaps and two margins fit along the row.
    margin, gap, jitter = MARGIN * size, GAP * size, JITTER * size
    r_lo, r_hi = RADIUS[0] * size, RADIUS[1] * size
    r_hi = min(r_hi, (size - 2 * margin - (n - 1) * gap) / (2 * n))
    radii = [rng.uniform(r_lo, r_hi) for _ in range(n)]

    # Along the row: n random cuts split the slack into the space before each shape (the rest
    # goes after the last one).
    slack = size - 2 * margin - 2 * sum(radii) - (n - 1) * gap
    cuts = sorted(rng.uniform(0, slack) for _ in range(n))
    pieces = [b - a for a, b in zip([0.0, *cuts[:-1]], cuts, strict=True)]
    along, pos = [], margin
    for r, piece in zip(radii, pieces, strict=True):
        pos += piece
        along.append(pos + r)
        pos += 2 * r + gap

    # Across the row: a random centre line that keeps every jittered shape inside the canvas.
    reach = max(radii) + jitter
    line = rng.uniform(margin + reach, size - margin - reach)
    across = [line + rng.uniform(-jitter, jitter) for _ in range(n)]

    shapes = []
    for (colour, kind), a, c, r in zip(objects, along, across, radii, strict=True):
        cx, cy = (a, c) if axis == "horizontal" else (c, a)
        shapes.append(Shape(colour, kind, cx, cy, r))
    return Scene(tuple(shapes), axis, size)


def _check_objects(objects: list[tuple[str, str]], axis: str) -> None:
    if axis not in ("horizontal", "vertical"):
        raise ValueError(f"axis must be 'horizontal' or 'vertical', got {axis!r}")
    if not 1 <= len(objects) <= 3:
        raise ValueError(f"a scene has 1 to 3 objects, got {len(objects)}")
    for colour, kind in objects:
        if colour not in COLOURS or kind not in SHAPES:
            raise ValueError(f"unknown object {colour!r} {kind!r}; see COLOURS and SHAPES")
    if len({c for c, _ in objects}) != len(objects):
        raise ValueError("colours must be distinct within a scene (they name the shapes)")


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image of ``scene.size`` x ``scene.size`` pixels."""
    s = SUPERSAMPLE
    image = Image.new("RGB", (scene.size * s, scene.size * s), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        left, top, right, bottom = (round(v * s) for v in shape.bbox)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse((left, top, right, bottom), fill=fill)
        elif shape.kind == "square":
            draw.rectangle((left, top, right, bottom), fill=fill)
        else:
            draw.polygon([((left + right) // 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image.reduce(s)


def caption(scene: Scene) -> str:
    """The one caption of a scene: its shapes in reading order (see the module docstring)."""
    names = [f"{'an' if shape.colour == 'orange' else 'a'} {shape.name}" for shape in scene.shapes]
    if len(names) == 1:
        return names[0]
    if len(names) == 2:
        word = "left of" if scene.axis == "horizontal" else "above"
        return f"{names[0]} {word} {names[1]}"
    order = "from left to right" if scene.axis == "horizontal" else "from top to bottom"
    return f"{', '.join(names[:-1])} and {names[-1]} {order}"


def shapes_json(scene: Scene) -> str:
    """The scene's shapes as the JSON answer: ``json.dumps`` with its default separators
    (``", "`` and ``": "``, no other whitespace), the compact form a grammar without free
    whitespace allows."""
    shapes = [{"colour": s.colour, "shape": s.kind} for s in scene.shapes]
    return json.dumps({"shapes": shapes})


def ask(scene: Scene, task: str, rng: random.Random) -> Question | None:
    """A random question of type ``task`` (one of :data:`TASK_TYPES`) about ``scene``, or None
    when the scene admits none (``where`` needs two shapes, ``colour`` a shape kind that occurs
    once).

    ``exists`` answers "yes" or "no" with probability 1/2 each.

    Raises:
        ValueError: unknown ``task``.
    """
    shapes = scene.shapes
    if task == "caption":
        return Question(task, CAPTION_PROMPT, caption(scene))
    if task == JSON_TASK:
        return Question(task, JSON_PROMPT, shapes_json(scene))
    if task == "colour":
        kinds = [s.kind for s in shapes]
        unique = [s for s in shapes if kinds.count(s.kind) == 1]
        if not unique:
            return None
        s = rng.choice(unique)
        return Question(task, f"What colour is the {s.kind}?", s.colour)
    if task == "shape":
        s = rng.choice(shapes)
        return Question(task, f"What shape is the {s.colour} one?", s.kind)
    if task == "count":
        return Question(task, "How many shapes are there?", COUNT_WORDS[len(shapes)])
    if task == "where":
        if len(shapes) < 2:
            return None
        a, b = rng.sample(shapes, 2)
        # The answer names the two shapes in reading order, as the caption does, whichever one
        # the question names first. A one-word answer ("right") makes the model compare, in a
        # single step, which shape comes first with which one the question named first: the
        # tiny model learned that only at 58%. Said in reading order, each word of the answer
        # is a step it learns (99.5%). A yes/no twin, "Is the red circle left of the blue
        # square?", was dropped: the model reached 79% on it by answering "yes" along the row
        # and "no" across it, never comparing the two shapes, and 55% once that shortcut was
        # taken away.
        first, second = sorted((a, b), key=shapes.index)  # shapes are in reading order
        word = "left of" if scene.axis == "horizontal" else "above"
        answer = f"the {first.name} is {word} the {second.name}"
        return Question(task, f"Where is the {a.name} relative to the {b.name}?", answer)
    if task == "exists":
        present = {(s.colour, s.kind) for s in shapes}
        if rng.random() < 0.5:
            colour, kind = rng.choice(sorted(present))
        else:
            # Half of the "no" cases are near misses (a colour or a kind from the scene), so the
            # answer needs the right colour *and* kind, not just one of them.
            absent = [(c, k) for c in COLOURS for k in SHAPES if (c, k) not in present]
            near = [(c, k) for c, k in absent if any(c == pc or k == pk for pc, pk in present)]
            colour, kind = rng.choice(near if near and rng.random() < 0.5 else absent)
        answer = "yes" if (colour, kind) in present else "no"
        article = "an" if colour == "orange" else "a"
        return Question(task, f"Is there {article} {colour} {kind}?", answer)
    raise ValueError(f"unknown question type {task!r}; expected one of {TASK_TYPES}")


def questions(scene: Scene, rng: random.Random) -> list[Question]:
    """Both description tasks (caption, JSON) plus one random question of every type the scene
    admits, in :data:`TASK_TYPES` order."""
    asked = (ask(scene, t, rng) for t in TASK_TYPES)
    return [q for q in asked if q is not None]


# Chapter images: (file stem, objects in reading order, axis, seed of the layout).
_CHAPTER_SCENES = (
    ("red_circle_left_of_blue_square", [("red", "circle"), ("blue", "square")], "horizontal", 1),
    ("blue_square_left_of_red_circle", [("blue", "square"), ("red", "circle")], "horizontal", 1),
    ("red_circle_left_of_blue_square_2", [("red", "circle"), ("blue", "square")], "horizontal", 7),
    (
        "green_triangle_above_yellow_circle",
        [("green", "triangle"), ("yellow", "circle")],
        "vertical",
        2,
    ),
    ("orange_square", [("orange", "square")], "horizontal", 3),
    (
        "purple_circle_green_square_red_triangle",
        [("purple", "circle"), ("green", "square"), ("red", "triangle")],
        "horizontal",
        4,
    ),
    (
        "yellow_triangle_blue_triangle_orange_circle",
        [("yellow", "triangle"), ("blue", "triangle"), ("orange", "circle")],
        "vertical",
        5,
    ),
)


def save_chapter_images(out_dir: str | Path) -> list[Path]:
    """Write the chapters' scene PNGs (named after their captions) and a README listing them.

    Returns the written PNG paths. The same files come out on every run.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, paths = [], []
    for stem, objects, axis, seed in _CHAPTER_SCENES:
        scene = random_scene(random.Random(seed), objects=objects, axis=axis)
        path = out_dir / f"{stem}.png"
        render(scene).save(path, optimize=True)
        paths.append(path)
        rows.append(f"| `{path.name}` | {caption(scene)} | {seed} |")
    readme = [
        "# Scene images for the chapters",
        "",
        f"{DEFAULT_IMAGE_SIZE}x{DEFAULT_IMAGE_SIZE} px, the tiny VLM's input size. Generated by",
        "`python -m minirad.course.scenes` (`minirad.course.scenes.save_chapter_images`); "
        "do not edit by hand.",
        "`red_circle_left_of_blue_square.png` and `..._2.png` have the same caption but",
        "different pixels (a different layout seed): the same text, two images.",
        "",
        "| file | caption | layout seed |",
        "|---|---|---|",
        *rows,
        "",
    ]
    (out_dir / "README.md").write_text("\n".join(readme), encoding="utf-8")
    return paths


def main() -> None:
    default = Path(__file__).resolve().parents[2] / "data" / "images"
    parser = argparse.ArgumentParser(description="Write the chapter scene images.")
    parser.add_argument("--out", type=Path, default=default, help=f"default: {default}")
    args = parser.parse_args()
    for path in save_chapter_images(args.out):
        print(path)


if __name__ == "__main__":
    main()
