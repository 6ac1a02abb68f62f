"""Multi-turn RL: the environments and tools users write, and how a model turn becomes tool calls.

An environment is built once per episode from its prompt row and talks to the policy in messages::

    class Calculator(Environment):
        def reset(self) -> list[dict]:            # the first messages (default: the row's prompt)
            return [{"role": "user", "content": self.row["prompt"]}]

        def step(self, turn: Turn) -> Step:       # after every model turn
            return Step(messages=turn.tool_messages, reward=0.0, done=not turn.tool_messages)

``turn`` holds the model's turn as text and as the exact token ids sampled, the tool calls parsed from it
and the tool messages their results became. :class:`Environment` itself is the plain tool loop: the tool
results go back to the model until it answers without calling a tool.

Tools are plain functions with type hints and a Google-style docstring; transformers' ``get_json_schema``
turns each into the JSON schema handed to the chat template's ``tools``. Tool calls are read from a model
turn with the tokenizer's ``response_template`` (transformers' response parsing, the template's own call
syntax) or ``rollout.response_template``; a call that cannot be parsed, names no tool, has bad arguments or
raises becomes a tool message saying so: the model sees its mistake, the run goes on.

With a vision-language policy, message contents may also be lists of ``{"type": "text", "text": ...}`` and
``{"type": "image", ...}`` parts: ``reset()``'s images are the prompt row's, and an environment turn's image
parts hold their image (``image``, ``path`` or ``url``); see :mod:`padless.rl.episodes`.

Environments and tools are named like reward functions: ``package.module:Name``, ``path/file.py:Name`` or a
bundled name (:data:`BUNDLED_ENVIRONMENTS`). An environment that raises or returns the wrong type stops the
run with one line (:class:`padless.errors.UserCodeError`); one that never ends is cut at
``rollout.max_turns``.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from padless.errors import InputError, UserCodeError, UserExit
from padless.rl.rewards import first_number, load_callable
from padless.run.interrupts import bounded

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Turn:
    """One model turn, as the environment receives it."""

    index: int  # 0 for the model's first turn
    text: str  # decoded, without the end-of-turn token
    token_ids: list[int]  # exactly as sampled, end-of-turn token included
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"} each
    tool_messages: list[dict[str, Any]] = field(default_factory=list)  # one "tool" message per call


@dataclass
class Step:
    """What an environment answers a turn with: the next messages, a reward contribution (summed over the
    episode's steps, added to the reward functions' total) and whether the episode is over."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


class Environment:
    """The plain tool loop, and the base class of user environments (one instance per episode).

    ``row`` is the prompt row as read from the data (``prompt`` and every other column); ``tools``: tool
    functions the environment brings (added to ``rollout.tools``).
    """

    tools: Sequence[Callable[..., Any]] = ()

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    @classmethod
    def tools_for(cls, data: Sequence[str]) -> Sequence[Callable[..., Any] | dict[str, Any]]:
        """The tools the environment brings to a run on the data sets ``data``: ``tools`` by default; a
        JSON schema (``{"type": "function", "function": {...}}``) stands for a tool the environment runs
        itself, through :meth:`run_tool`."""
        return cls.tools

    def run_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run a call to a tool the environment brought as a schema (its result: the tool message's text)."""
        raise NotImplementedError(f"{type(self).__name__} brings tool {name!r} but does not run it")

    def close(self) -> None:
        """The episode is over (ended or cut): release what the environment holds."""

    def reset(self) -> list[dict[str, Any]]:
        """The episode's first messages: the row's prompt (a string becomes one user message)."""
        prompt = self.row.get("prompt")
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])

    def step(self, turn: Turn) -> Step:
        """Tool results (and failed calls' errors) go back to the model; a turn that calls no tool is its
        answer and ends the episode."""
        return Step(messages=turn.tool_messages, done=not turn.tool_messages)


# --------------------------------------------------------------------------------------------------
# Tools


def tool_schema(spec: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a tool function, from its type hints and docstring (transformers' own reader)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException, ...
        raise InputError(
            f"rollout.tools: {spec!r}: its JSON schema cannot be read ({type(e).__name__}: {e}); fix: give "
            "every argument a type hint and a line in a Google-style docstring's Args: section"
        ) from None


class Tools:
    """Tool functions by name, their schemas, and how calls parsed from a model turn run."""

    def __init__(
        self,
        specs: Sequence[str | Callable[..., Any]],
        response_template: dict[str, Any] | None,
        environment: tuple[str, Sequence[Callable[..., Any] | dict[str, Any]]] = ("", ()),
    ):
        """``specs``: ``rollout.tools``; ``environment``: an environment's name and the tools it brings
        (functions, or the JSON schemas of tools it runs itself)."""
        self.functions: dict[str, Callable[..., Any] | None] = {}  # None: the environment runs it
        self.schemas: list[dict[str, Any]] = []
        origins: dict[str, str] = {}
        env_name, env_tools = environment
        given = [(f"rollout.tools[{i}] ({spec!r})", spec) for i, spec in enumerate(specs)]
        for origin, spec in given + [(f"environment {env_name!r}", fn) for fn in env_tools]:
            if isinstance(spec, dict):  # a tool the environment runs: its schema as the model sees it
                fn, schema = None, spec
            else:
                fn = spec if callable(spec) else load_callable(spec, "tool", BUNDLED_TOOLS)
                schema = tool_schema(str(spec), fn)
            name = schema["function"]["name"]
            if name in self.functions:
                fix = (
                    "the environment brings it already: remove it from rollout.tools"
                    if origin.startswith("environment")
                    else "give each tool function its own name"
                )
                raise InputError(
                    f"rollout.tools: {origins[name]} and {origin} both bring a tool named {name!r}, and a "
                    f"call can run only one of them; fix: {fix}"
                )
            self.functions[name], origins[name] = fn, origin
            self.schemas.append(schema)
        self.response_template = response_template

    def __bool__(self) -> bool:
        return bool(self.functions)

    def parse(self, text: str, prefix: str) -> tuple[list[dict[str, Any]], str | None]:
        """The calls in a model turn (``{"name", "arguments"}`` each) and, when the turn's call syntax is
        broken, why (the calls then are none and the reason goes back to the model as a tool message)."""
        message, problem = self.read(text, prefix)
        return ([], problem) if message is None else self.calls(message)

    def read(self, text: str, prefix: str) -> tuple[dict[str, Any] | None, str | None]:
        """A model turn as the message it is (content, tool calls...), or why its syntax is broken."""
        from transformers.utils.chat_parsing import parse_response

        try:
            return parse_response(text, self.response_template, prefix=prefix, tools=self.schemas), None
        except Exception as e:
            return None, f"error: the tool call could not be parsed ({type(e).__name__}: {first_line(e)})"

    @staticmethod
    def calls(message: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
        """A parsed turn's calls (``{"name", "arguments"}`` each), or why one is not a call."""
        calls = []
        for call in message.get("tool_calls") or []:
            inner = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
                return [], f"error: a tool call has no name: {str(call)[:80]}"
            calls.append({"name": inner["name"], "arguments": inner.get("arguments", {})})
        return calls, None

    def run(self, call: dict[str, Any], env: Any = None) -> tuple[dict[str, Any], bool]:
        """A call's tool message and whether the call succeeded (exceptions become the message's text);
        ``env``: the episode's environment, which runs the tools it brought as schemas."""
        name, arguments = call["name"], call["arguments"]
        fn = self.functions.get(name)
        if fn is None and name in self.functions:  # a tool the environment runs: arguments as one object
            fn = lambda **kw: env.run_tool(name, kw)  # noqa: E731
        if fn is None:
            result, ok = f"error: no tool named {name!r}; the tools are {', '.join(self.functions)}", False
        elif not isinstance(arguments, dict):
            result, ok = f"error: the arguments of {name} must be an object, got {str(arguments)[:80]}", False
        else:
            try:
                value = bounded(fn, **arguments)
                result = value if isinstance(value, str) else json.dumps(value, default=str)
                ok = True
            except UserExit as e:  # sys.exit() in a tool is a failed call too, never the end of the run
                result, ok = f"error: {name} {e}", False
            except Exception as e:  # the model's mistake (or the tool's): the model reads what happened
                result, ok = f"error: {name} raised {type(e).__name__}: {first_line(e)}", False
        return {"role": "tool", "name": name, "content": result}, ok


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


# --------------------------------------------------------------------------------------------------
# Environments: loading, and checking what user code returns


def load_environment(spec: str | None) -> type:
    """The environment class a spec names (None: the plain tool loop, :class:`Environment`)."""
    if spec is None:
        return Environment
    cls = load_callable(BUNDLED_ELSEWHERE.get(spec, spec), "environment", BUNDLED_ENVIRONMENTS)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise InputError(
            f"rollout.environment: {spec!r} is not a class with a step(turn) method; fix: subclass "
            "padless.rl.environments.Environment and override step (and reset for the first messages)"
        )
    return cls


def user_call(spec: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call environment code; what it raises (``sys.exit()`` included) stops the run in one line naming the
    method."""
    try:
        return bounded(fn, *args)
    except Exception as e:
        did = str(e) if isinstance(e, UserExit) else f"raised {type(e).__name__}: {first_line(e)}"
        raise UserCodeError(
            f"environment {spec!r}: {what} {did}; fix the environment (a tool's errors are handed to the "
            "model, an environment's stop the run)"
        ) from e


def is_part(part: Any) -> bool:
    """A content part of a vision-language conversation: ``{"type": "text", "text": str}`` or an image."""
    if not isinstance(part, dict):
        return False
    return part.get("type") == "image" or (part.get("type") == "text" and isinstance(part.get("text"), str))


def checked_messages(spec: str, what: str, value: Any, parts: bool = False) -> list[dict[str, Any]]:
    """Messages returned by user code: a list of {"role", "content"} dicts with a known role; with
    ``parts`` (a vision-language policy) a content may also be a list of text and image parts."""
    fix = 'return a list of {"role": ..., "content": str} dicts'
    if parts:
        fix += " (or contents as lists of {'type': 'text' | 'image', ...} parts)"
    if not isinstance(value, list):
        raise UserCodeError(f"environment {spec!r}: {what} returned {type(value).__name__}; fix: {fix}")
    for j, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        listed = parts and isinstance(content, list) and all(is_part(p) for p in content)
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (isinstance(content, str) or listed):
            raise UserCodeError(
                f"environment {spec!r}: {what} returned message {j} = {str(m)[:80]}; fix: {fix} with role "
                f"one of {', '.join(ROLES)}"
            )
    return value


def checked_step(spec: str, value: Any, parts: bool = False) -> Step:
    """A step's answer, checked: a :class:`Step` with messages (contents may be lists of parts with
    ``parts``, see :func:`checked_messages`), a finite reward and a bool ``done``."""
    if not isinstance(value, Step):
        raise UserCodeError(
            f"environment {spec!r}: step() returned {type(value).__name__}; fix: return "
            "padless.rl.environments.Step(messages=[...], reward=0.0, done=False)"
        )
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise UserCodeError(
            f"environment {spec!r}: step() returned reward {reward!r}; fix: return a finite number"
        )
    if not isinstance(value.done, bool):
        raise UserCodeError(f"environment {spec!r}: step() returned done={value.done!r}; fix: return a bool")
    checked_messages(spec, "step()", value.messages, parts)
    if value.messages and value.messages[-1]["role"] == "assistant":
        raise UserCodeError(
            f"environment {spec!r}: step() returned messages ending with an assistant message; fix: end "
            "with the message the model answers (the model writes its own turns)"
        )
    return value


# --------------------------------------------------------------------------------------------------
# Bundled: a calculator for the embedded arithmetic prompts

_EXPRESSION = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*(\+|-|\*|x|/|plus|minus|times)\s*(-?\d+(?:\.\d+)?)\s*")


def calculate(expression: str) -> str:
    """Compute two numbers joined by an operator.

    Args:
        expression: for example "26 + 19", "47 minus 35" or "6 x 6" (+ - * x / plus minus times)
    """
    m = _EXPRESSION.fullmatch(expression)
    if m is None:
        raise ValueError(f"cannot read {expression!r}: write two numbers and an operator, e.g. 26 + 19")
    a, op, b = Decimal(m.group(1)), m.group(2), Decimal(m.group(3))
    if op in ("/",) and b == 0:
        raise ValueError("division by zero")
    ops = {"+": a + b, "plus": a + b, "-": a - b, "minus": a - b, "*": a * b, "x": a * b, "times": a * b}
    value = ops[op] if op in ops else a / b
    return str(value.normalize()) if value != value.to_integral() else str(int(value))


class Calculator(Environment):
    """The tiny:rl arithmetic prompts with a calculator tool and a teacher: tool results go back to the
    model; an answer whose first number is not the row's ``answer`` gets "not right, try again", up to
    ``answers`` answers; a right one ends the episode. The reward comes from ``reward.functions`` (e.g.
    ``arithmetic``) on the last turn."""

    tools = (calculate,)
    answers = 2

    def step(self, turn: Turn) -> Step:
        if turn.tool_messages:
            return Step(messages=turn.tool_messages)
        self.given = getattr(self, "given", 0) + 1
        answer = self.row.get("answer")
        right = answer is None or first_number(turn.text) == first_number(str(answer))
        if right or self.given == self.answers:
            return Step(done=True)
        return Step(messages=[{"role": "user", "content": "That is not right. Try again: just the number."}])


BUNDLED_ENVIRONMENTS: dict[str, type] = {"tools": Environment, "calculator": Calculator}
# bundled environments in modules of their own (they build on this one): a verifiers task per episode
BUNDLED_ELSEWHERE = {"verifiers": "padless.rl.verifiers_env:VerifiersEnvironment"}
BUNDLED_TOOLS: dict[str, Callable[..., Any]] = {"calculate": calculate}
