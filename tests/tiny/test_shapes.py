"""The embedded shapes data: seeded pictures whose answers are right, a reward and an accuracy that read
completions the way a user would."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from padless.tiny import shapes


def test_rows_are_seeded_and_every_split_has_its_fields():
    for name, (_, n) in shapes.SPLITS.items():
        rows = shapes.rows(name)
        assert len(rows) == n
        assert rows[:3] == shapes.rows(name)[:3]  # same seed, same bytes
        assert {r["kind"] for r in rows} == set(shapes.QUESTIONS)
    assert shapes.rows("shapes_sft")[0]["images"] != shapes.rows("shapes_eval")[0]["images"]
    pair = shapes.rows("shapes_preference")[0]
    assert pair["chosen"] != pair["rejected"] and pair["answer"] in pair["chosen"][0]["content"]


def test_pictures_show_their_answer():
    """The colour named is the only colour besides the background, and the shape spans the picture's
    shorter side (so most image tokens of a square picture see it)."""
    rng = random.Random(0)
    for _ in range(30):
        png, facts = shapes.draw(rng)
        image = Image.open(io.BytesIO(png)).convert("RGB")
        assert image.width in shapes.SIDES and image.height in shapes.SIDES
        colours = {rgb for _, rgb in image.getcolors(1 << 16)}
        assert colours == {shapes.BACKGROUND, shapes.COLOURS[facts["colour"]]}
        mask = Image.eval(image.convert("L"), lambda v: 255 * (v != sum(shapes.BACKGROUND) // 3))
        left, top, right, bottom = mask.getbbox()
        assert min(right - left, bottom - top) >= 0.75 * min(image.size)


def test_says_answer_rewards_exactly_the_right_option():
    rewards = shapes.says_answer(
        ["p"] * 4,
        ["It is red.", "It is blue.", "red or blue", "It is a circle."],
        answer=["red", "red", "red", "circle"],
        kind=["colour", "colour", "colour", "shape"],
    )
    assert rewards == [1.0, 0.0, 0.0, 1.0]


def test_accuracy_of_the_true_answers_is_one_and_of_a_constant_is_its_share():
    rows = shapes.rows("shapes_eval")
    perfect = shapes.accuracy([r["messages"][-1]["content"] for r in rows])
    assert perfect["colour"] == perfect["shape"] == perfect["all"] == 1.0
    constant = shapes.accuracy(["It is a red circle."] * len(rows))
    colours = [r for r in rows if r["kind"] == "colour"]
    assert constant["colour"] == pytest.approx(sum(r["answer"] == "red" for r in colours) / len(colours))
    assert constant["chance/colour"] == pytest.approx(1 / 6) and constant["chance/shape"] == pytest.approx(
        1 / 3
    )
    with pytest.raises(ValueError, match="3 completions for the 150 rows of shapes_eval"):
        shapes.accuracy(["x"] * 3)
