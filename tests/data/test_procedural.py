"""Rows reasoning-gym makes (``data.train: reasoning_gym:<task>``): made offline and the same for the same
spec, each with the task's entry, which the bundled reward scores with the task's own scorer."""

from __future__ import annotations

import pytest

from padless.data import load_rows
from padless.errors import DataError
from padless.rl.rewards import load_reward_function

SPEC = (
    "reasoning_gym:basic_arithmetic?size=6&seed=3&max_terms=2&max_digits=1&operators=[+, -]"
    "&allow_parentheses=false&allow_negation=false"
)


def test_rows_are_the_tasks_questions_answers_and_entries_and_the_reward_scores_them():
    rows = load_rows(SPEC)
    again = load_rows(SPEC + "&seed=3")  # the same options: the same rows
    assert [r.data for r in rows] == [r.data for r in again] and len(rows) == 6
    assert rows[0].source == SPEC and rows[2].where == f"{SPEC} row 2 (0-based)"
    for row in rows:
        entry = row.data["reasoning_gym"]
        assert row.data["prompt"] == entry["question"] and row.data["answer"] == entry["answer"]
        assert set(entry["metadata"]["expression"]) <= set("0123456789 +-")  # the options reached the task
    reward = load_reward_function("reasoning_gym")
    entries = [r.data["reasoning_gym"] for r in rows]
    right = [r.data["answer"] for r in rows]
    wrong = [f"<answer>{int(a) + 1}</answer>" for a in right]
    tagged = [f"Let me think. <answer>{a}</answer>" for a in right]
    assert reward(prompts=[""] * 6, completions=right, reasoning_gym=entries) == [1.0] * 6
    assert reward(prompts=[""] * 6, completions=tagged, reasoning_gym=entries) == [1.0] * 6
    assert reward(prompts=[""] * 6, completions=wrong, reasoning_gym=entries) == [0.0] * 6
    assert reward(prompts=["", ""], completions=["1", "2"], reasoning_gym=[None, None]) == [None, None]
    assert load_rows(SPEC + "[2:4]") == rows[2:4]


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("reasoning_gym:basic_arithmetc", "no task 'basic_arithmetc'; fix: did you mean basic_arithmetic"),
        ("reasoning_gym:basic_arithmetic?max_digitz=2", "refused the options"),
    ],
)
def test_a_bad_task_or_option_is_one_line_naming_the_spec(spec, said):
    with pytest.raises(DataError, match=said) as caught:
        load_rows(spec)
    assert str(caught.value).startswith(spec.partition("?")[0])
