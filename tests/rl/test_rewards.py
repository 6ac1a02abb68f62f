"""Reward functions: the bundled verifier on hand cases, loading specs, weighting, None, and every error."""

from __future__ import annotations

import math
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import torch

from padless.rl.rewards import (
    BUNDLED,
    RewardComposer,
    RewardError,
    arithmetic,
    first_number,
    load_reward_function,
    scored_mean,
)


def _score(completion: str, answer: Any) -> float | None:
    return arithmetic(["q"], [completion], answer=[answer])[0]


# -- the bundled arithmetic verifier -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "want"),
    [
        ("The answer is 42.", "42", 1.0),
        ("42", "42", 1.0),
        ("  42<|im_end|>", "42", 1.0),
        ("The answer is 41.", "42", 0.0),
        ("-3", "-3", 1.0),
        ("It is -3 degrees.", "-3", 1.0),
        ("It is \u22123.", "-3", 1.0),  # a typographic minus sign
        ("3", "-3", 0.0),
        ("5-3=2", "2", 0.0),  # only the first number counts, and "-3" after a digit is not a sign
        ("no number here", "42", 0.0),
        ("", "42", 0.0),
        ("42.0", "42", 1.0),  # numerically equal
        ("42.5", "42", 0.0),  # not read as 42 plus ".5"
        ("1,234 apples", "1234", 1.0),
        ("42", 42, 1.0),  # an int answer works too
        ("0.5", 0.5, 1.0),
        ("forty-two", "42", 0.0),
    ],
)
def test_arithmetic_hand_cases(completion: str, answer: Any, want: float) -> None:
    assert _score(completion, answer) == want


def test_arithmetic_batches_and_none_answers() -> None:
    got = arithmetic(["a", "b", "c"], ["7", "x 8", "9"], answer=["7", "9", None], extra=[1, 2, 3])
    assert got == [1.0, 0.0, None]
    assert BUNDLED["arithmetic"] is arithmetic


def test_first_number() -> None:
    assert first_number("x = -12.50 and 3") == Decimal("-12.50")
    assert first_number("12,345 and 1,2") == Decimal(12345)
    assert first_number("1,2") == 1
    assert first_number(".5") is None  # not read as 5
    assert first_number("none") is None


def test_arithmetic_errors() -> None:
    with pytest.raises(RewardError, match=r"needs an 'answer' column .* \(columns: \['label'\]\)"):
        arithmetic(["q"], ["1"], label=["1"])
    with pytest.raises(RewardError, match=r"sample 0: 'answer' is 'twelve' \(str\), which is not a number"):
        arithmetic(["q"], ["12"], answer=["twelve"])
    with pytest.raises(RewardError, match="not a number"):
        arithmetic(["q"], ["1"], answer=[True])


# -- loading specs -------------------------------------------------------------------------------------------


REWARD_FILE = """
def exact(prompts, completions, target, **fields):
    return [1.0 if c.strip() == t else 0.0 for c, t in zip(completions, target)]

class Scorer:
    @staticmethod
    def length(prompts, completions, **fields):
        return [float(len(c)) for c in completions]

not_a_function = 3

def too_narrow(completions):
    return [0.0] * len(completions)
"""


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE, encoding="utf-8")
    return path


def test_load_bundled_module_and_file(reward_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_reward_function("arithmetic") is arithmetic
    assert load_reward_function(" arithmetic ") is arithmetic
    assert load_reward_function("padless.rl.rewards:arithmetic") is arithmetic
    exact = load_reward_function(f"{reward_file}:exact")
    assert exact(["p"], [" 4 "], target=["4"]) == [1.0]
    length = load_reward_function(f"{reward_file}:Scorer.length")
    assert length([], ["abc"]) == [3.0]
    monkeypatch.chdir(reward_file.parent)
    assert load_reward_function("my_rewards.py:exact")(["p"], ["5"], target=["4"]) == [0.0]
    monkeypatch.syspath_prepend(str(reward_file.parent))
    assert load_reward_function("my_rewards:exact")(["p"], ["4"], target=["4"]) == [1.0]
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (
            "arithmetc",
            [
                "not a bundled reward (bundled: arithmetic, arithmetic_distance, math_verify, reasoning_gym)",
                "did you mean 'arithmetic'?",
            ],
        ),
        ("lenght", ["not of the form 'module:function'", "fix: write 'package.module:function'"]),
        ("padless.rl.rewards:", ["not of the form 'module:function'"]),
        ("padless.rl.rewards:1abc", ["'1abc' after the last ':' is not a function name"]),
        ("no_such_module_xyz:f", ["no module named 'no_such_module_xyz'", "installed", "file.py:function"]),
        ("padless.nope:f", ["no module named 'padless.nope'"]),
        ("not a module:f", ["'not a module' is neither a module path nor a .py file"]),
        (
            "padless.rl.rewards:arithmatic",
            ["padless.rl.rewards has no attribute 'arithmatic'", "did you mean 'arithmetic'"],
        ),
        ("padless.rl.rewards:SPEC_FORMS", ["SPEC_FORMS is not a function (its type is str)"]),
        (
            "missing/file.py:f",
            ["the file missing/file.py does not exist (resolved to", "give the path of a .py"],
        ),
    ],
)
def test_spec_errors_name_the_spec_and_the_fix(spec: str, fragments: list[str]) -> None:
    with pytest.raises(RewardError) as info:
        load_reward_function(spec)
    msg = str(info.value)
    assert msg.startswith(f"reward function {spec!r}: ") and "; fix: " in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


def test_file_spec_errors(reward_file: Path, tmp_path: Path) -> None:
    def msg(spec: str) -> str:
        with pytest.raises(RewardError) as info:
            load_reward_function(spec)
        return str(info.value)

    assert "has no attribute 'exakt'" in msg(f"{reward_file}:exakt") and "did you mean 'exact'" in msg(
        f"{reward_file}:exakt"
    )
    assert "Scorer has no attribute 'size'" in msg(f"{reward_file}:Scorer.size")
    assert "not_a_function is not a function (its type is int)" in msg(f"{reward_file}:not_a_function")
    assert "do not take prompts and completions as keyword arguments" in msg(f"{reward_file}:too_narrow")
    assert "is a directory" in msg(f"{tmp_path}/:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import definitely_not_installed_pkg\n", encoding="utf-8")
    text = msg(f"{broken}:f")
    assert "raised ModuleNotFoundError" in text and "make the file import cleanly" in text
    assert not [m for m in sys.modules if m.startswith("padless_reward_file_") and m.endswith("_broken")]


def test_missing_dependency_of_a_module_is_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_dep.py").write_text("import definitely_not_installed_pkg\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        RewardError, match="it needs module 'definitely_not_installed_pkg', which is not installed"
    ):
        load_reward_function("needs_dep:f")
    sys.modules.pop("needs_dep", None)


def test_bad_spec_type() -> None:
    for bad in ("", "   ", None, 3):
        with pytest.raises(RewardError, match="must be a non-empty string"):
            load_reward_function(bad)  # type: ignore[arg-type]


# -- composing -----------------------------------------------------------------------------------------------


def _ones(prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
    return [1.0] * len(completions)


def _length(prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def _math_only(
    prompts: list[str], completions: list[str], kind: list[str], **fields: Any
) -> list[float | None]:
    return [2.0 if k == "math" else None for k in kind]


def test_weights_combine_and_values_are_per_function() -> None:
    composer = RewardComposer([_ones, _length, "arithmetic"], [0.5, 2.0, -1.0])
    assert composer.names == ["_ones", "_length", "arithmetic"]
    total, values = composer(["p1", "p2", "p3"], ["7", "abc", "7!"], {"answer": ["7", "7", "8"]})
    assert total.dtype == torch.float32 and total.shape == (3,)
    want = [0.5 + 2 * 1 - 1, 0.5 + 2 * 3 - 0, 0.5 + 2 * 2 - 0]
    assert total.tolist() == pytest.approx(want)
    assert values == {"_ones": [1.0] * 3, "_length": [1.0, 3.0, 2.0], "arithmetic": [1.0, 0.0, 0.0]}
    default = RewardComposer([_ones, _length])
    assert default.weights == [1.0, 1.0]
    assert default(["a", "b"], ["x", "yy"])[0].tolist() == [2.0, 3.0]
    assert "_length×1" in repr(default)


def test_none_is_left_out_of_the_mean_and_adds_zero() -> None:
    composer = RewardComposer([_math_only, _ones], [3.0, 1.0])
    total, values = composer(["a"] * 4, ["x"] * 4, {"kind": ["math", "code", "math", "code"]})
    assert total.tolist() == [7.0, 1.0, 7.0, 1.0]
    assert values["_math_only"] == [2.0, None, 2.0, None]
    assert scored_mean(values["_math_only"]) == 2.0 and scored_mean(values["_ones"]) == 1.0
    total, values = composer(["a"] * 2, ["x"] * 2, {"kind": ["code", "code"]})
    assert total.tolist() == [1.0, 1.0] and math.isnan(scored_mean(values["_math_only"]))


def test_numpy_tensor_and_bool_results_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    composer = RewardComposer(
        [
            lambda prompts, completions, **f: np.array([0.5, 1.5]),
            lambda prompts, completions, **f: torch.tensor([1.0, 2.0]),
            lambda prompts, completions, **f: (True, False),
        ]
    )
    assert composer.names == ["<lambda>", "<lambda>_2", "<lambda>_3"]
    total, _ = composer(["a", "b"], ["x", "y"])
    assert total.tolist() == [2.5, 3.5]


def test_names_fall_back_to_the_spec_when_function_names_clash(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "r.py").write_text("def score(prompts, completions, **f):\n    return [1.0]\n")
    specs = [f"{tmp_path}/a/r.py:score", f"{tmp_path}/b/r.py:score"]
    assert RewardComposer(specs).names == specs


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        (lambda prompts, completions, **f: 1.0, "returned float 1.0; fix: return a list with one float"),
        (lambda prompts, completions, **f: [1.0], "returned 1 value(s) for 2 completions"),
        (lambda prompts, completions, **f: [1.0, "1"], "returned '1' (str) for completion 1"),
        (lambda prompts, completions, **f: [1.0, float("nan")], "returned nan (float) for completion 1"),
        (
            lambda prompts, completions, **f: [math.inf, 0.0],
            "NaN and infinities are not allowed: return None",
        ),
        (lambda prompts, completions, **f: 1 / 0, "raised ZeroDivisionError: division by zero"),
        (lambda prompts, completions, answer: [0.0, 0.0], "cannot take this data"),
        (lambda prompts, completions, label, **f: [0.0, 0.0], "missing a required argument: 'label'"),
    ],
)
def test_bad_results_name_the_function_and_what_it_returned(fn: Any, fragment: str) -> None:
    fn.__name__ = "bad_fn"
    composer = RewardComposer([fn])
    with pytest.raises(RewardError) as info:
        composer(["a", "b"], ["x", "y"], {"answer": ["1", "2"], "kind": ["m", "m"]})
    msg = str(info.value)
    assert msg.startswith("reward function 'bad_fn' ") and fragment in msg, msg


def test_arithmetic_without_answer_column_names_it() -> None:
    with pytest.raises(
        RewardError, match=r"'arithmetic' raised RewardError: the arithmetic reward needs an 'answer'"
    ):
        RewardComposer(["arithmetic"])(["a"], ["1"], {"label": ["1"]})


def test_composer_input_and_weight_errors() -> None:
    with pytest.raises(RewardError, match=r"2 reward weight\(s\) for 1 reward function\(s\)"):
        RewardComposer([_ones], [1.0, 2.0])
    with pytest.raises(RewardError, match=r"the weight of .* is nan; fix: give a finite number"):
        RewardComposer([_ones], [math.nan])
    with pytest.raises(RewardError, match="'arithmetic' is listed more than once"):
        RewardComposer(["arithmetic", " arithmetic"])
    with pytest.raises(RewardError, match="not a bundled reward"):
        RewardComposer(["arithmetc"])
    composer = RewardComposer([_ones])
    with pytest.raises(RewardError, match="1 prompts for 2 completions"):
        composer(["a"], ["x", "y"])
    with pytest.raises(RewardError, match="column named 'completions', which clashes"):
        composer(["a"], ["x"], {"completions": ["c"]})
    with pytest.raises(RewardError, match=r"column 'answer' has 1 value\(s\) for 2 completions"):
        composer(["a", "b"], ["x", "y"], {"answer": ["1"]})
    with pytest.raises(RewardError, match="column 'answer' is a str, not a list"):
        composer(["a", "b"], ["x", "y"], {"answer": "12"})


def test_no_functions_gives_zeros() -> None:
    total, values = RewardComposer([])(["a", "b"], ["x", "y"])
    assert total.tolist() == [0.0, 0.0] and values == {}


def test_arithmetic_distance_gives_partial_credit_by_hand():
    from padless.rl.rewards import arithmetic_distance

    got = arithmetic_distance(
        [""] * 4, ["The answer is 40.", "no number", "-3", "50"], answer=["42", "5", "-3", "5"]
    )
    assert got == pytest.approx([1 - 2 / 43, 0.0, 1.0, 0.0])
    assert load_reward_function("arithmetic_distance") is arithmetic_distance


def test_math_verify_compares_answers_as_mathematics():
    """The bundled math_verify reward: LaTeX, fractions and decimals agree; a wrong value, no answer or a
    missing gold answer do not count (None where the row has no answer)."""
    reward = load_reward_function("math_verify")
    completions = [
        "so the answer is $\\boxed{\\frac{1}{2}}$",
        "0.5",
        "x = 3, so 2x = 6",
        "I am not sure",
        "7",
    ]
    assert reward(prompts=[""] * 5, completions=completions, answer=["0.5", "1/2", "6", "4", None]) == [
        1.0,
        1.0,
        1.0,
        0.0,
        None,
    ]
    with pytest.raises(RewardError, match="needs an 'answer' column"):
        reward(prompts=[""], completions=["1"])


def test_a_bundled_reward_whose_package_is_missing_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = lambda n, *a: None if n == "math_verify" else real(n, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(RewardError, match=r"needs the math_verify package.*padless\[math\]"):
        load_reward_function("math_verify")
