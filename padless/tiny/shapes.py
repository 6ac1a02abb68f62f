"""Embedded image data: one coloured shape per picture, drawn with PIL from a seed, with questions about its
colour and its shape.

The shape spans the picture's shorter side, and pictures are 56 to 112 pixels a side (4 to 16 image tokens for
the tiny VLM), so rows differ in length. Why one big shape: with a tiny model trained for a few minutes,
an answer can only come from the picture if most image tokens carry it. Measured with the tiny VLM
(600 rows, 8 epochs): with 1-3 small shapes per picture (a sixteenth of the area each) and questions about
colour, shape and count, held-out accuracy stayed at chance (0.2-0.4) while the answer format was learned;
with one big shape, colour and shape questions are learned.

Rows are built in memory (PNG bytes in an ``images`` column) and are the same for the same name on every
machine: nothing is stored or downloaded. Names: ``shapes_sft``, ``shapes_eval``, ``shapes_preference``,
``shapes_preference_eval``, ``shapes_rl``. Every row keeps ``kind`` (``colour`` / ``shape``) and ``answer``
(the word), which :func:`says_answer` (a reward function) and :func:`accuracy` read.
"""

from __future__ import annotations

import io
import json
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path
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
QUESTIONS = {
    "colour": ("What colour is the shape?", "Which colour is used here?", "Name the colour."),
    "shape": ("What shape is in the picture?", "Which shape do you see?", "Name the shape."),
}
OPTIONS = {"colour": tuple(COLOURS), "shape": SHAPES}
SIDES = (56, 84, 112)
BACKGROUND = (235, 235, 235)

# name: (seed, rows)
SPLITS = {
    "shapes_sft": (3001, 600),
    "shapes_eval": (3002, 150),
    "shapes_preference": (3003, 400),
    "shapes_rl": (3004, 300),
    "shapes_preference_eval": (3005, 100),
}


def draw(rng: random.Random) -> tuple[bytes, dict[str, str]]:
    """One PNG and its facts (``colour``, ``shape``)."""
    from PIL import Image, ImageDraw

    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    width, height = rng.choice(SIDES), rng.choice(SIDES)
    image = Image.new("RGB", (width, height), BACKGROUND)
    r = min(width, height) // 2 - rng.randint(2, 6)
    x, y = rng.randint(r, width - r), rng.randint(r, height - r)
    box = (x - r, y - r, x + r, y + r)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue(), {"colour": colour, "shape": shape}


def answer(kind: str, facts: dict[str, str]) -> str:
    return f"It is {facts['colour']}." if kind == "colour" else f"It is a {facts['shape']}."


def _wrong(kind: str, facts: dict[str, str], rng: random.Random) -> dict[str, str]:
    return {**facts, kind: rng.choice([o for o in OPTIONS[kind] if o != facts[kind]])}


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
        elif name.startswith("shapes_preference"):
            row["prompt"] = [user]
            row["chosen"] = [{"role": "assistant", "content": answer(kind, facts)}]
            row["rejected"] = [{"role": "assistant", "content": answer(kind, _wrong(kind, facts, rng))}]
        else:
            row["prompt"] = [user]
        out.append(row)
    return out


def named_answer(completion: str, kind: str) -> str | None:
    """The one option of ``kind`` a completion names, or None when it names none or several."""
    named = set(re.findall(r"[a-z]+", completion.lower())) & set(OPTIONS[kind])
    return named.pop() if len(named) == 1 else None


def says_answer(
    prompts: list[str], completions: list[str], answer: list[str], kind: list[str], **fields: Any
) -> list[float]:
    """Reward: 1.0 when a completion names the right colour / shape and no other option, else 0.0."""
    return [float(named_answer(c, k) == a) for c, a, k in zip(completions, answer, kind, strict=True)]


def accuracy(completions: Sequence[str], split: str = "shapes_eval") -> dict[str, float]:
    """Share of ``split``'s questions answered right, per kind and overall, from completions in row order
    (what SFT's ``predictions-step*.jsonl`` holds), with the chance level of each for comparison."""
    data = rows(split)
    if len(completions) != len(data):
        raise ValueError(f"{len(completions)} completions for the {len(data)} rows of {split}")
    right: dict[str, list[bool]] = {kind: [] for kind in QUESTIONS}
    for row, completion in zip(data, completions, strict=True):
        right[row["kind"]].append(named_answer(completion, row["kind"]) == row["answer"])
    out = {kind: sum(v) / len(v) for kind, v in right.items()}
    out["all"] = sum(sum(v) for v in right.values()) / len(data)
    chance = {kind: 1 / len(OPTIONS[kind]) for kind in QUESTIONS}
    chance["all"] = sum(chance[row["kind"]] for row in data) / len(data)
    return {**out, **{f"chance/{k}": v for k, v in chance.items()}}


def main(argv: list[str]) -> None:
    """``python -m padless.tiny.shapes runs/vlm-sft-tiny/predictions-step*.jsonl``: accuracy per file."""
    if not argv:
        raise SystemExit("usage: python -m padless.tiny.shapes PREDICTIONS.jsonl [...]")
    for path in argv:
        completions = [json.loads(line)["completion"] for line in Path(path).read_text().splitlines()]
        scores = accuracy(completions)
        print(f"{path}: " + " ".join(f"{k}={v:.3f}" for k, v in scores.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
