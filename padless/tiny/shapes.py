"""Embedded image data: coloured shapes drawn with PIL from a seed, with questions about colour, shape, count.

Every image holds 1-3 shapes of one kind and one colour on a light background, at a size between 56 and 112
pixels a side (4 to 16 image tokens for the tiny VLM), so rows differ in length. Rows are built in memory
(PNG bytes in an ``images`` column) and are the same for the same name on every machine: nothing is stored
or downloaded. Names: ``shapes_sft``, ``shapes_eval``, ``shapes_preference``, ``shapes_rl``.
"""

from __future__ import annotations

import io
import random
from typing import Any

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
QUESTIONS = {
    "colour": ("What colour are the shapes?", "Which colour is used here?", "Name the colour."),
    "shape": ("What shape is in the picture?", "Which shape do you see?", "Name the shape."),
    "count": ("How many shapes are there?", "Count the shapes.", "How many shapes do you see?"),
}
SIDES = (56, 84, 112)

# name: (seed, rows)
SPLITS = {
    "shapes_sft": (3001, 600),
    "shapes_eval": (3002, 60),
    "shapes_preference": (3003, 400),
    "shapes_rl": (3004, 300),
}


def draw(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """One PNG and its facts (``colour``, ``shape``, ``count`` as words)."""
    from PIL import Image, ImageDraw

    colour, shape, count = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(COUNT_WORDS))
    width, height = rng.choice(SIDES), rng.choice(SIDES)
    image = Image.new("RGB", (width, height), (235, 235, 235))
    pen = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(width // 28) for y in range(height // 28)], count)
    for cx, cy in cells:
        r = rng.randint(8, 12)
        x, y = cx * 28 + 14 + rng.randint(-1, 1), cy * 28 + 14 + rng.randint(-1, 1)
        box = (x - r, y - r, x + r, y + r)
        if shape == "circle":
            pen.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            pen.rectangle(box, fill=COLOURS[colour])
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), {"colour": colour, "shape": shape, "count": COUNT_WORDS[count]}


def answer(kind: str, facts: dict[str, str]) -> str:
    if kind == "colour":
        return f"They are {facts['colour']}."
    if kind == "shape":
        return f"It is a {facts['shape']}."
    return f"There are {facts['count']}." if facts["count"] != "one" else "There is one."


def _wrong(kind: str, facts: dict[str, str], rng: random.Random) -> dict[str, str]:
    options = {"colour": list(COLOURS), "shape": list(SHAPES), "count": list(COUNT_WORDS.values())}[kind]
    return {**facts, kind: rng.choice([o for o in options if o != facts[kind]])}


def rows(name: str) -> list[dict[str, Any]]:
    """The rows of an embedded image dataset (see the module docstring for the names)."""
    if name not in SPLITS:
        raise ValueError(f"unknown image dataset {name!r}; valid: {', '.join(SPLITS)}")
    seed, n = SPLITS[name]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        png, facts = draw(rng)
        kind = rng.choice(list(QUESTIONS))
        question = rng.choice(QUESTIONS[kind])
        user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        row: dict[str, Any] = {"images": [{"bytes": png}], "kind": kind, "answer": facts[kind]}
        if name in ("shapes_sft", "shapes_eval"):
            row["messages"] = [user, {"role": "assistant", "content": answer(kind, facts)}]
        elif name == "shapes_preference":
            row["prompt"] = [user]
            row["chosen"] = [{"role": "assistant", "content": answer(kind, facts)}]
            row["rejected"] = [{"role": "assistant", "content": answer(kind, _wrong(kind, facts, rng))}]
        else:
            row["prompt"] = [user]
        out.append(row)
    return out
