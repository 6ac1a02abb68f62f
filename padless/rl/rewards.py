"""Reward functions for RL: loading them from a spec string, checking what they return, weighting them.

A reward function scores a batch of completions at once::

    def my_reward(prompts: list[str], completions: list[str], **fields) -> list[float | None]: ...

It is called with keyword arguments: ``prompts`` (the rendered prompt of each sample), ``completions`` (the
decoded completion of each sample) and one keyword per data column other than ``prompt`` (e.g.
``answer=[...]``), each a list with one value per sample. The samples of one prompt are adjacent, so with
``num_generations=4`` every prompt and its columns appear four times in a row. Declare the columns you need
and take ``**fields`` for the rest, so a data set with extra columns still works.

Return one number per completion, or ``None`` for a completion the function does not apply to (e.g. a code
test for a math prompt, when several data sets share a run). ``None`` is left out of that function's
logged mean and adds 0 to the weighted total; a completion no function applies to gets a total of 0.
NaN and infinities are refused rather than silently poisoning the advantages: use ``None`` instead.

Specs (``reward.functions`` in a config) name a function as ``"package.module:function"`` (importable),
``"path/to/file.py:function"`` (loaded from that file) or a bundled name (:data:`BUNDLED`).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch

from padless.data import given
from padless.errors import InputError, UserExit
from padless.run.interrupts import bounded

__all__ = [
    "BUNDLED",
    "RewardComposer",
    "RewardError",
    "RewardFunction",
    "arithmetic",
    "first_number",
    "load_reward_function",
]

RewardFunction = Callable[..., Sequence[float | None]]

SPEC_FORMS = "'package.module:function', 'path/to/file.py:function' or a bundled name"
_SIGNATURE = "def f(prompts, completions, **fields)"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class RewardError(InputError):
    """A reward function that cannot be loaded or called, or that returned something unusable (the user's
    to fix: exit code 2, and a run names the step it stopped at)."""


# --------------------------------------------------------------------------------------------------
# Bundled rewards

# An optional sign (ASCII hyphen or U+2212 minus) right before the digits, not after a digit or a dot
# (".5" is not 5); thousands separators only in groups of three ("12,345", while "1,2" is 1); an optional
# fraction.
_NUMBER = re.compile(r"(?<![\d.])([-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?")


def first_number(text: str) -> Decimal | None:
    """The first number written in ``text`` ("The answer is -3." → -3), or None when there is none."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    sign, digits, frac = m.groups()
    return Decimal(("-" if sign else "") + digits.replace(",", "") + (frac or ""))


def _expected(value: Any, i: int) -> Decimal | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return Decimal(str(value))
    if isinstance(value, str):
        text = value.strip()
        m = _NUMBER.fullmatch(text)
        if m is not None:
            return first_number(text)
    raise RewardError(
        f"sample {i}: 'answer' is {value!r} ({type(value).__name__}), which is not a number; the arithmetic "
        "reward compares the completion's first number with it. Fix the data set's 'answer' column"
    )


def _score_numbers(
    completions: list[str],
    answer: list[Any] | None,
    fields: dict[str, Any],
    score: Callable[[Decimal, Decimal], float],
) -> list[float | None]:
    """``score(got, expected)`` for the first number of each completion (0.0 when it has none)."""
    if answer is None:
        raise RewardError(
            "the arithmetic reward needs an 'answer' column (the expected number of each prompt), but the "
            f"data has none (columns: {sorted(fields) or 'only prompt'}). Add an 'answer' to every row, or "
            "use another reward function"
        )
    out: list[float | None] = []
    for i, (completion, value) in enumerate(zip(completions, answer, strict=True)):
        expected = _expected(value, i)
        if expected is None:
            out.append(None)
            continue
        got = first_number(completion)
        out.append(0.0 if got is None else score(got, expected))
    return out


def arithmetic(
    prompts: list[str], completions: list[str], answer: list[Any] | None = None, **fields: Any
) -> list[float | None]:
    """1.0 when the first number in the completion equals ``answer`` numerically, else 0.0.

    Made for the embedded ``tiny:rl`` prompts, which ask for "just the number": text around the number is
    fine ("The answer is 42."), but only the first number counts, so "26 + 19 = 45" scores 0 for 45 (it
    reads 26). There is no format bonus. A sample whose ``answer`` is None gets None (not applicable).
    """
    return _score_numbers(completions, answer, fields, lambda got, expected: float(got == expected))


def arithmetic_distance(
    prompts: list[str], completions: list[str], answer: list[Any] | None = None, **fields: Any
) -> list[float | None]:
    """Partial credit ``max(0, 1 - |got - answer| / (|answer| + 1))`` for the first number.

    A dense signal for small models that rarely hit the exact answer, so a group's samples differ and
    group-relative advantages are not all zero; combine it with ``arithmetic``.
    """
    return _score_numbers(
        completions,
        answer,
        fields,
        lambda got, expected: max(0.0, 1.0 - float(abs(got - expected) / (abs(expected) + 1))),
    )


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer(completion: str) -> str:
    """What a completion answers: the text of its last ``<answer>...</answer>``, else all of it, stripped."""
    tagged = _ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def math_verify(
    prompts: list[str], completions: list[str], answer: list[Any] | None = None, **fields: Any
) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer mathematically equal to ``answer``, else 0.0.

    Both are parsed by math-verify (LaTeX such as ``\\frac{1}{2}`` or ``\\boxed{x^2}``, plain expressions,
    numbers; in the completion, the last answer found), so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` agree. A
    sample whose ``answer`` is None gets None. ``pip install 'padless[math]'``.
    """
    from math_verify import parse, verify

    if answer is None:
        raise RewardError(
            "the math_verify reward needs an 'answer' column (each prompt's expected answer); the data has "
            f"none (columns: {sorted(fields) or 'only prompt'}). Add one, or use another reward function"
        )

    def same(completion: str, expected: Any) -> bool:
        gold = parse(str(expected) if "$" in str(expected) or "\\" in str(expected) else f"${expected}$")
        return bool(gold) and verify(gold, parse(completion))

    return _per_sample(completions, answer, same)


def reasoning_gym(
    prompts: list[str], completions: list[str], reasoning_gym: list[Any] | None = None, **fields: Any
) -> list[float | None]:
    """reasoning-gym's own scorer of each row's task (0 to 1), on the completion's :func:`final_answer`.

    Reads the ``reasoning_gym`` column that ``data.train: reasoning_gym:<task>`` rows carry (the task's
    entry); a sample without one gets None. ``pip install 'padless[reasoning-gym]'``.
    """
    import reasoning_gym as gym

    if reasoning_gym is None:
        raise RewardError(
            "the reasoning_gym reward scores rows of data.train: reasoning_gym:<task> (their reasoning_gym "
            f"column holds each task's entry); the data has none (columns: {sorted(fields) or 'only prompt'})"
        )

    def score(completion: str, entry: Any) -> float:
        return gym.get_score_answer_fn(entry["metadata"]["source_dataset"])(final_answer(completion), entry)

    return _per_sample(completions, reasoning_gym, score)


def _per_sample(
    completions: list[str], column: list[Any], score: Callable[[str, Any], float]
) -> list[float | None]:
    """``score(completion, its row's value)`` for each sample; None where the row has no value."""
    return [None if v is None else float(score(c, v)) for c, v in zip(completions, column, strict=True)]


BUNDLED: dict[str, RewardFunction] = {
    "arithmetic": arithmetic,
    "arithmetic_distance": arithmetic_distance,
    "math_verify": math_verify,
    "reasoning_gym": reasoning_gym,
}
# bundled rewards that read an optional package: (its import name, the padless extra that installs it)
NEEDS = {"math_verify": ("math_verify", "math"), "reasoning_gym": ("reasoning_gym", "reasoning-gym")}


# --------------------------------------------------------------------------------------------------
# Loading


def _error(spec: str, problem: str, fix: str, kind: str = "reward function") -> RewardError:
    return RewardError(f"{kind} {spec!r}: {problem}; fix: {fix}")


def _load_file(spec: str, target: str, kind: str) -> Any:
    path = Path(target).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise _error(
            spec,
            f"the file {target} {what} (resolved to {path.absolute()})",
            "give the path of a .py file, relative to the directory you run from or absolute",
            kind,
        )
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"padless_reward_file_{digest}_{re.sub(r'[^A-Za-z0-9_]', '_', resolved.stem)}"
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise _error(spec, f"cannot load {target} as a Python module", "give a .py file", kind)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        bounded(module_spec.loader.exec_module, module)
    except Exception as e:
        del sys.modules[name]
        raise _error(
            spec,
            f"running {target} raised {type(e).__name__}: {e}",
            "make the file import cleanly (install what it imports)",
            kind,
        ) from e
    return module


def _import_module(spec: str, target: str, kind: str) -> Any:
    if not _IDENT.fullmatch(target):
        raise _error(
            spec,
            f"{target!r} is neither a module path nor a .py file",
            f"write {SPEC_FORMS}",
            kind,
        )
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise _error(
                spec,
                f"no module named {e.name!r}",
                "check the spelling and that the package is installed in this environment; for a file of "
                "your own, write 'path/to/file.py:function' (or put its directory on PYTHONPATH)",
                kind,
            ) from e
        raise _error(
            spec,
            f"importing {target} failed: it needs module {e.name!r}, which is not installed",
            f"install the package that provides {e.name!r}",
            kind,
        ) from e
    except Exception as e:
        raise _error(
            spec, f"importing {target} raised {type(e).__name__}: {e}", "make the module import cleanly", kind
        ) from e


def _check_signature(spec: str, fn: Callable[..., Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: find out when calling
        return
    try:
        sig.bind_partial(prompts=[], completions=[])
    except TypeError as e:
        raise _error(
            spec,
            f"its parameters {sig} do not take prompts and completions as keyword arguments ({e})",
            f"define it as {_SIGNATURE}",
        ) from None


def load_reward_function(spec: str) -> RewardFunction:
    """The callable a spec names: a bundled name, ``"package.module:function"`` or ``"file.py:function"``.

    The attribute may be dotted (``"module:Class.method"``). Every failure is a :class:`RewardError` that
    names the spec and says how to fix it, raised when the run starts rather than at the first rollout.
    """
    fn = load_callable(spec, "reward function", BUNDLED)
    package, extra = NEEDS.get(spec.strip(), (None, None))
    if package is not None and importlib.util.find_spec(package) is None:
        raise _error(
            spec.strip(),
            f"it needs the {package} package, which is not installed",
            f"pip install 'padless[{extra}]'",
        )
    _check_signature(spec.strip(), fn)
    return fn


def load_callable(spec: str, kind: str, bundled: Mapping[str, Any]) -> Any:
    """What ``spec`` names (a function or class): a ``bundled`` name, ``"package.module:attr"`` or
    ``"file.py:attr"``; every failure a :class:`RewardError` naming the ``kind`` of object, the spec and
    the fix. Reward functions, tools and environments are all loaded this way."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"{kind} spec must be a non-empty string, got {spec!r}; write {SPEC_FORMS}")
    spec = spec.strip()
    if given.is_given(spec):  # handed to padless.api as a Python object
        return given.lookup(spec, kind)
    noun = "reward" if kind == "reward function" else kind
    thing = "class" if kind == "environment" else "function"
    if spec in bundled:
        return bundled[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        close = difflib.get_close_matches(spec, list(bundled), n=1)
        hint = f"did you mean {close[0]!r}? Otherwise write " if close else "write "
        raise _error(
            spec,
            f"not a bundled {noun} (bundled: {', '.join(bundled) or 'none'}) and not of the form "
            f"'module:{thing}'",
            hint + SPEC_FORMS,
            kind,
        )
    if not _IDENT.fullmatch(attr):
        raise _error(spec, f"{attr!r} after the last ':' is not a {thing} name", f"write {SPEC_FORMS}", kind)
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(spec, target, kind) if is_file else _import_module(spec, target, kind)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = target if i == 0 else ".".join(attr.split(".")[:i])
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            close = difflib.get_close_matches(part, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            raise _error(
                spec,
                f"{owner} has no attribute {part!r}",
                f"{hint}name one defined there (callables found: {listed or 'none'})",
                kind,
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise _error(
            spec,
            f"{attr} is not a {thing} (its type is {type(obj).__name__})",
            f"point the spec at the {kind} itself"
            if kind != "reward function"
            else f"point the spec at a function defined as {_SIGNATURE}",
            kind,
        )
    return obj


# --------------------------------------------------------------------------------------------------
# Combining


def _short_name(spec: str | Callable[..., Any]) -> str:
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__)
    return spec.strip().rpartition(":")[2].rpartition(".")[2]


def _unique_names(specs: Sequence[str | Callable[..., Any]]) -> list[str]:
    names = [_short_name(s) for s in specs]
    names = [
        s.strip() if isinstance(s, str) and names.count(n) > 1 else n
        for s, n in zip(specs, names, strict=True)
    ]
    out: list[str] = []
    for n in names:
        k, name = 1, n
        while name in out:
            k += 1
            name = f"{n}_{k}"
        out.append(name)
    return out


def _as_list(result: Any) -> Any:
    if isinstance(result, torch.Tensor) or type(result).__module__ == "numpy":
        tolist = getattr(result, "tolist", None)
        if callable(tolist) and getattr(result, "ndim", 1) == 1:
            return tolist()
    return result


def scored_mean(values: Sequence[float | None]) -> float:
    """Mean over the completions a reward applies to (NaN when it applied to none)."""
    scored = [v for v in values if v is not None]
    return math.fsum(scored) / len(scored) if scored else math.nan


class RewardComposer:
    """Several reward functions, weighted and summed into one reward per completion.

    ``specs`` are spec strings (see :func:`load_reward_function`) or callables; ``weights`` default to 1.0
    each. Calling it returns the ``[N]`` float32 total (CPU) and each function's unweighted values (None
    where it does not apply), keyed by :attr:`names` (the function name, or the whole spec when two specs
    share a function name).
    """

    def __init__(
        self, specs: Sequence[str | Callable[..., Any]], weights: Sequence[float] | None = None
    ) -> None:
        specs = list(specs)
        strings = [s.strip() for s in specs if isinstance(s, str)]
        repeated = sorted({s for s in strings if strings.count(s) > 1})
        if repeated:
            raise RewardError(
                f"reward function {repeated[0]!r} is listed more than once, so it would count twice; "
                "fix: list it once and raise its weight instead"
            )
        if weights is None:
            weights = [1.0] * len(specs)
        weights = list(weights)
        if len(weights) != len(specs):
            raise RewardError(
                f"{len(weights)} reward weight(s) for {len(specs)} reward function(s); fix: give one weight "
                "per function, in the same order, or leave the weights out for 1.0 each"
            )
        for spec, w in zip(specs, weights, strict=True):
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
                raise RewardError(f"the weight of {spec!r} is {w!r}; fix: give a finite number")
        self.functions: list[Callable[..., Any]] = [
            s if callable(s) else load_reward_function(s) for s in specs
        ]
        self.weights = [float(w) for w in weights]
        self.names = _unique_names(specs)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}×{w:g}" for n, w in zip(self.names, self.weights, strict=True))
        return f"RewardComposer({parts})"

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        fields: Mapping[str, Sequence[Any]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, list[float | None]]]:
        """Weighted total reward ``[N]`` (None counts 0) and each function's values."""
        n = len(completions)
        fields = dict(fields or {})
        self._check_inputs(prompts, completions, fields)
        total = torch.zeros(n, dtype=torch.float64)
        per_function: dict[str, list[float | None]] = {}
        for name, fn, weight in zip(self.names, self.functions, self.weights, strict=True):
            values = self._call_one(name, fn, list(prompts), list(completions), fields)
            per_function[name] = values
            total += weight * torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float64)
        return total.float(), per_function

    @staticmethod
    def _check_inputs(prompts: Sequence[str], completions: Sequence[str], fields: dict[str, Any]) -> None:
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"{len(prompts)} prompts for {n} completions: give one prompt per completion")
        for key in ("prompts", "completions"):
            if key in fields:
                raise RewardError(
                    f"the data has a column named {key!r}, which clashes with the {key!r} argument every "
                    "reward function receives; fix: rename that column"
                )
        for key, column in fields.items():
            if isinstance(column, (str, bytes)) or not isinstance(column, Sequence):
                raise RewardError(
                    f"column {key!r} is a {type(column).__name__}, not a list with one value per completion; "
                    "fix: pass each column as a list (repeat a prompt's value for each of its samples)"
                )
            if len(column) != n:
                raise RewardError(
                    f"column {key!r} has {len(column)} value(s) for {n} completions; fix: give one value per "
                    "completion (repeat a prompt's values for each of its samples)"
                )

    @staticmethod
    def _call_one(
        name: str,
        fn: Callable[..., Any],
        prompts: list[str],
        completions: list[str],
        fields: dict[str, Any],
    ) -> list[float | None]:
        kwargs = {k: list(v) for k, v in fields.items()}
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            try:
                sig.bind(prompts=prompts, completions=completions, **kwargs)
            except TypeError as e:
                raise RewardError(
                    f"reward function {name!r} cannot take this data ({e}); its parameters are {sig} and the "
                    f"data columns are {sorted(kwargs) or 'none'}. Fix: name only columns the data has and "
                    f"end the parameters with **fields ({_SIGNATURE})"
                ) from None
        try:
            result = bounded(fn, prompts=prompts, completions=completions, **kwargs)
        except UserExit as e:  # sys.exit() in user code must not end the run as if it had finished
            raise RewardError(
                f"reward function {name!r} {e}, which would end the run; fix: return scores (None for 'not "
                "applicable'), or raise an exception to stop"
            ) from None
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        result = _as_list(result)
        n = len(completions)
        fix = "return a list with one float (or None for 'not applicable') per completion"
        if not isinstance(result, (list, tuple)):
            raise RewardError(
                f"reward function {name!r} returned {type(result).__name__} {_short_repr(result)}; fix: {fix}"
            )
        if len(result) != n:
            raise RewardError(
                f"reward function {name!r} returned {len(result)} value(s) for {n} completions; fix: {fix}"
            )
        out: list[float | None] = []
        for i, v in enumerate(result):
            if v is None:
                out.append(None)
                continue
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise RewardError(
                    f"reward function {name!r} returned {_short_repr(v)} ({type(v).__name__}) for completion "
                    f"{i}; fix: {fix} (NaN and infinities are not allowed: return None)"
                )
            out.append(float(v))
        return out


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
