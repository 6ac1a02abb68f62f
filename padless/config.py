"""Typed run configs: a YAML file plus ``key=value`` overrides, checked by pydantic models.

Every mistake is reported before a run starts, with the dotted key, where it was set (file and line, or the
command-line override), what was expected, what was found and how to fix it: pydantic finds the mistakes,
:func:`_explain` turns its first one into that line. Values are read with a YAML 1.2-like schema so that
``1e-4`` is a float, while ``yes``/``no``/``on``/``off`` and dates stay strings: a model called ``no`` or a
``data.eval`` of ``2024-01-01`` is not silently turned into a bool or a date. ``padless schema TRAINER``
prints each config's JSON Schema for editors.

To add a key, add a field (with a default and a docstring) to its section below; cross-field rules go in
the section's ``_check``. This module imports no torch, so configs can be checked quickly.
"""

from __future__ import annotations

import difflib
import os
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

T = TypeVar("T", bound="ConfigModel")

__all__ = [
    "ConfigError",
    "ConfigModel",
    "DPOConfig",
    "DPOSettings",
    "DataSettings",
    "GRPOConfig",
    "GRPOSettings",
    "LoraSettings",
    "ModelSettings",
    "PPOConfig",
    "PPOSettings",
    "PreferenceDataSettings",
    "RLDataSettings",
    "RMConfig",
    "RMSettings",
    "RewardSettings",
    "RolloutSettings",
    "SFTConfig",
    "TrainSettings",
    "from_dict",
    "invalid",
    "json_schema",
    "load_config",
    "parse_override",
    "save_config",
    "to_dict",
]


# --------------------------------------------------------------------------------------------------
# Errors


class ConfigError(ValueError):
    """A config a run cannot start from; the message says where, what was expected, what was found, the fix.

    ``keys`` are the dotted keys involved; ``problem``/``fix`` are set for errors made by :func:`invalid`,
    so they can be re-raised with full dotted keys and the place the values came from.
    """

    def __init__(
        self, message: str, *, keys: Sequence[str] = (), problem: str | None = None, fix: str | None = None
    ) -> None:
        super().__init__(message)
        self.keys = tuple(keys)
        self.problem = problem
        self.fix = fix


def _format(keys: Sequence[str], source: str, problem: str, fix: str | None, line: str = "") -> str:
    where = ", ".join(keys) or "config"
    return f"{where}{source}: {problem}{line}" + (f"; fix: {fix}" if fix else "")


def invalid(keys: str | Sequence[str], problem: str, fix: str) -> ConfigError:
    """The error a section's ``_check`` raises for an impossible value or combination.

    ``keys`` are relative to that section (``"warmup_ratio"``, or ``"data.eval"`` from a whole config);
    loading re-raises it with the full dotted keys and the file line or override that set them, so
    cross-field errors read like every other config error.
    """
    names = (keys,) if isinstance(keys, str) else tuple(keys)
    return ConfigError(_format(names, "", problem, fix), keys=names, problem=problem, fix=fix)


# --------------------------------------------------------------------------------------------------
# YAML dialect: only true/false are bools, 1e-4 is a float, no implicit dates, no duplicate keys.

_BOOL = "tag:yaml.org,2002:bool"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
# YAML 1.1 needs a dot in a float; this adds the exponent-only form (1e-4, 5E+3) YAML 1.2 allows.
_EXP_FLOAT_RE = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
_NUMBER_RE = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?")


def _strict_resolvers() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    table = {
        first: [(tag, rx) for tag, rx in entries if tag not in (_BOOL, _TIMESTAMP)]
        for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    for first in "tTfF":
        table.setdefault(first, []).insert(0, (_BOOL, _BOOL_RE))
    for first in "-+0123456789":
        table.setdefault(first, []).append((_FLOAT, _EXP_FLOAT_RE))
    return table


class _Loader(yaml.SafeLoader):
    """SafeLoader with the strict scalar rules above, rejecting duplicate keys (PyYAML keeps the last)."""

    yaml_implicit_resolvers = _strict_resolvers()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue  # unhashable key: SafeConstructor reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _union_resolvers() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    table = {first: list(entries) for first, entries in yaml.SafeDumper.yaml_implicit_resolvers.items()}
    for first, entries in _Loader.yaml_implicit_resolvers.items():
        table.setdefault(first, []).extend(entries)
    return table


class _Dumper(yaml.SafeDumper):
    """Quotes every string that our reader or a standard YAML 1.1 reader would take for a non-string."""

    yaml_implicit_resolvers = _union_resolvers()


def _key_lines(node: yaml.Node | None, prefix: str, lines: dict[str, int]) -> dict[str, int]:
    """The 1-based line of every dotted key (and list item, ``key[i]``) under ``node``."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            key = _join(prefix, str(key_node.value))
            lines[key] = key_node.start_mark.line + 1
            _key_lines(value, key, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{prefix}[{i}]"] = item.start_mark.line + 1
            _key_lines(item, f"{prefix}[{i}]", lines)
    return lines


MAX_YAML_NODES = 100_000  # far above any real config; aliases of aliases reach billions in a few lines


def _refuse_alias_bomb(node: yaml.Node | None, path: str | os.PathLike[str]) -> None:
    """Count the nodes the document expands to (each alias counted in full), stopping at the limit: a few
    lines of nested aliases ("billion laughs") would otherwise cost gigabytes once expanded."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = 1  # a recursive alias counts once; PyYAML refuses it later anyway
        children: list[yaml.Node] = []
        if isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        elif isinstance(n, yaml.MappingNode):
            children = [x for pair in n.value for x in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                break
        sizes[id(n)] = total
        return total

    if node is not None and size(node) > MAX_YAML_NODES:
        raise ConfigError(
            f"{path}: the YAML expands to more than {MAX_YAML_NODES:,} values through its aliases (&name / "
            "*name); fix: write the settings out without nested aliases"
        )


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """A config file as a plain dict and the line of each key in it; failures name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file not found: {path} (resolved to {p.absolute()}); "
            "fix: check the path, or leave the config file out to start from the defaults"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config path {path} is a directory; fix: pass the YAML file inside it") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 ({e.reason}); fix: save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    loader = _Loader(text)  # a SafeLoader
    try:
        node = loader.get_single_node()
        _refuse_alias_bomb(node, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path} line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        lines = text.splitlines()
        near = f" near {lines[mark.line].strip()!r}" if mark and mark.line < len(lines) else ""
        what = " ".join(str(s) for s in (e.context, e.problem) if s)
        raise ConfigError(
            f"{where}: YAML syntax error: {what}{near}; "
            "fix: check indentation, the space after ':', and quotes around values with ':' or '#'"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(
            f"config file {path} is empty (no YAML in it, only blanks or comments); fix: write the settings "
            "in it (see `padless schema <trainer>`), or leave the file out to run every default"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (e.g. 'model:', 'train:'), "
            f"got {_got(data)}; fix: write 'section:' lines with indented 'key: value' lines under them"
        )
    return data, _key_lines(node, "", {})


# --------------------------------------------------------------------------------------------------
# Overrides

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``a.b.c=value`` into its dotted key and its value read as YAML (``[q,v]``, ``null``)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(
            f"malformed override {item!r} on the command line: expected the form key=value; "
            "fix: write e.g. train.learning_rate=3e-4"
        )
    if not _NAME_RE.fullmatch(key):
        raise ConfigError(
            f"malformed override {item!r} on the command line: {key!r} is not a dotted key; "
            "fix: use the form key=value with a dotted key such as train.max_steps=100"
        )
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(
            f"override {item!r} on the command line: the value {text!r} is not valid YAML ({problem}); "
            f"fix: put the value in YAML quotes, e.g. {key}=\"'{text}'\""
        ) from None
    return key, value


def _set_path(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):  # absent, null (e.g. model.lora: null) or a scalar: start a section
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _below(key: str, parent: str) -> bool:
    return key == parent or key.startswith((parent + ".", parent + "["))


@dataclass
class _Origin:
    """Where the values of one config came from, so that an error can say it."""

    file: str = ""  # the config file as given, or "" (no file, or a config built in Python)
    lines: dict[str, int] = field(default_factory=dict)  # dotted key -> its line in the file
    overrides: dict[str, str] = field(default_factory=dict)  # dotted key -> the "key=value" that set it

    def override_of(self, key: str) -> str | None:
        """The command-line override that set ``key``, a section above it or a key below it, if any."""
        parts = key.split("[")[0].split(".")
        for n in range(len(parts), 0, -1):
            item = self.overrides.get(".".join(parts[:n]))
            if item is not None:
                return item
        return next((item for k, item in self.overrides.items() if _below(k, key)), None)

    def where(self, *keys: str) -> str:
        """' in run.yaml', " on the command line ('a=1', 'b=2')", both joined by 'and', or ''."""
        items = [self.override_of(k) for k in keys]
        overrides = list(dict.fromkeys(i for i in items if i is not None))
        parts = [f" in {self.file}"] if self.file and None in items else []
        if overrides:
            parts.append(" on the command line (" + ", ".join(map(repr, overrides)) + ")")
        return " and".join(parts)

    def line(self, *keys: str) -> str:
        """' (line 3)' or ' (lines 3, 5)' for the keys written in the file, or ''."""
        found = set()
        for key in keys:
            if self.override_of(key) is not None:
                continue
            while key and key not in self.lines:  # a.b[1] -> a.b -> a -> ""
                key = key[: max(key.rfind("."), key.rfind("["), 0)]
            if key:
                found.add(self.lines[key])
        numbers = ", ".join(map(str, sorted(found)))
        return f" (line{'s' * (len(found) > 1)} {numbers})" if found else ""


# --------------------------------------------------------------------------------------------------
# Models and their errors


def _members(tp: Any) -> tuple[Any, ...]:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def _optional(tp: Any) -> bool:
    return type(None) in _members(tp)


def _strip_none(tp: Any) -> Any:
    """``X | None`` -> ``X``; other unions stay whole."""
    rest = [m for m in _members(tp) if m is not type(None)]
    return rest[0] if len(rest) == 1 else tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _takes_text(tp: Any) -> bool:
    return any(m is str or (get_origin(m) is Literal and str in map(type, get_args(m))) for m in _members(tp))


class ConfigModel(BaseModel):
    """A config section: unknown keys, wrong types and non-finite numbers are errors, nothing is coerced
    except a number written as a string where a float goes (``'1e-6'``), and a section left empty
    (``model:`` with every line commented out) means its defaults. A partial section starts from the
    field's default (``DPOConfig.train`` keeps ``output_dir: runs/dpo``). Built directly in Python, a bad
    value raises the same :class:`ConfigError` as from a file."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _explain(e, type(self), data, _Origin()) from None

    # Tells pydantic that __init__ only validates, so nested sections are validated without calling it.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @field_validator("*", mode="before")
    @classmethod
    def _defaults_and_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        spec = cls.model_fields[info.field_name]
        tp = spec.annotation
        if _is_model(tp) and (value is None or isinstance(value, Mapping)):
            base = (
                {}
                if spec.is_required()
                else spec.get_default(call_default_factory=True).model_dump(exclude_unset=True)
            )
            return {**base, **(value or {})}
        if isinstance(value, str) and float in _members(tp) and _NUMBER_RE.fullmatch(value.strip()):
            return float(value.strip())
        return value

    @model_validator(mode="after")
    def _checked(self) -> ConfigModel:
        self._check()
        return self

    def _check(self) -> None:
        """Rules across fields: raise :func:`invalid` naming the keys involved."""


def _walk(cls: type, loc: Sequence[str | int]) -> tuple[str, Any, int, FieldInfo | None]:
    """For an error location: its dotted key, the declared type there, how many location parts name
    fields (the rest is a union member's tag, or an unknown key), and the last field's definition."""
    key, tp, spec = "", cls, None
    for n, part in enumerate(loc):
        tp = _strip_none(tp)
        if _is_model(tp) and part in tp.model_fields:
            spec = tp.model_fields[str(part)]
            key, tp = _join(key, str(part)), spec.annotation
        elif get_origin(tp) is list and isinstance(part, int):
            key, tp = f"{key}[{part}]", get_args(tp)[0]
        elif get_origin(tp) is dict and isinstance(part, str):
            key, tp = _join(key, part), get_args(tp)[1]
        else:
            return key, tp, n, spec
    return key, tp, len(loc), spec


def _bounds(spec: FieldInfo) -> str:
    """A field's bounds in words: '> 0', 'in [0, 1)'."""
    b = {
        k: getattr(m, k)
        for m in spec.metadata
        for k in ("gt", "ge", "lt", "le")
        if getattr(m, k, None) is not None
    }
    low = f"({b['gt']}" if "gt" in b else f"[{b['ge']}" if "ge" in b else ""
    high = f"{b['lt']})" if "lt" in b else f"{b['le']}]" if "le" in b else ""
    if low and high:
        return f"in {low}, {high}"
    return next(f"{op} {b[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in b)


def _describe(tp: Any) -> str:
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if len(_members(tp)) > 1:
        return " or ".join(_describe(m) for m in sorted(_members(tp), key=lambda m: m is type(None)))
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        return "mapping" if value_tp is Any else f"mapping of {_describe(key_tp)} to {_describe(value_tp)}"
    if _is_model(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _got(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if isinstance(value, Mapping):
        return f"mapping {text}"
    if isinstance(value, list):
        return f"list {text}"
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    return f"{type(value).__name__} {text}"


def _fix(tp: Any, value: Any, key: str) -> str:
    """How to write a value of type ``tp`` instead of ``value``."""
    one = _strip_none(tp)
    if _is_model(one):
        return f"write a mapping with keys from: {', '.join(one.model_fields)}" + ", or null" * _optional(tp)
    if get_origin(one) is Literal:
        names, text = [str(a) for a in get_args(one)], str(value)
        close = [a for a in names if a.lower() == text.lower()] or difflib.get_close_matches(
            text, names, 1, 0.5
        )
        fix = f"did you mean {close[0]!r}?" if close else "use one of the allowed values"
    elif one is bool:
        fix = "write true or false"
    elif one is int and isinstance(value, float) and value.is_integer():
        fix = f"write it as a whole number: {int(value)}"
    elif one is int:
        fix = "write a whole number without quotes, e.g. 100"
    elif one is float:
        fix = "write a number, e.g. 3e-4 or 0.5"
    elif one is str and isinstance(value, (int, float, bool)):
        fix = f"quote it: '{str(value).lower() if isinstance(value, bool) else value}'"
    elif one is str:
        fix = "write a single string"
    elif get_origin(one) is list:
        fix = f"write a list, e.g. [a, b] (on the command line: {key}=[a,b])"
    elif get_origin(one) is dict:
        fix = "write a mapping, e.g. {a: 1.0, b: 0.5}"
    else:
        fix = f"give {_describe(one)}"
    return fix + ", or null" * _optional(tp)


def _present(data: Any, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def _explain(error: ValidationError, cls: type, data: Any, origin: _Origin, prefix: str = "") -> ConfigError:
    """pydantic's first error (an unknown key first) as one line: key, source, expected, got, fix.

    Keys are looked up in ``data`` and ``origin`` as they are, and shown under ``prefix``."""
    errors = error.errors()
    first: ErrorDetails = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc, kind = first["loc"], first["type"]
    key, tp, named, spec = _walk(cls, loc)
    if named < len(loc) and kind != "extra_forbidden":  # inside one member of a union: show the whole value
        first = min((e for e in errors if e["loc"][:named] == loc[:named]), key=lambda e: len(e["loc"]))
        kind = first["type"]
    if kind == "extra_forbidden":
        unknown = _join(key, str(loc[-1]))
        names = list(_strip_none(tp).model_fields)
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ";"
        section = f"valid keys under '{_join(prefix, key)}'" if prefix or key else "valid top-level keys"
        where = origin.where(unknown) + origin.line(unknown)
        unknown = _join(prefix, unknown)
        return ConfigError(
            f"unknown key '{unknown}'{where}{hint} {section}: {', '.join(names)}", keys=[unknown]
        )
    if kind == "missing":
        section, _, name = _join(prefix, key).rpartition(".")
        under = f" under '{section}'" if section else ""
        return ConfigError(
            f"missing required key '{_join(prefix, key)}'{origin.where(key)}; "
            f"fix: add {name}: <{_describe(tp)}>{under}",
            keys=[_join(prefix, key)],
        )
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError) and cause.problem is not None:  # raised by a section's _check
        keys = [_join(key, k) for k in cause.keys]
        given = [k for k in keys if _present(data, k)]
        source = origin.where(*given) if given else ""
        shown = [_join(prefix, k) for k in keys]
        message = _format(shown, source, cause.problem, cause.fix, origin.line(*given))
        return ConfigError(message, keys=shown, problem=cause.problem, fix=cause.fix)
    value = first["input"]
    if kind == "finite_number":
        problem = f"expected a finite number, got {_got(value)}"
        fix = "write a finite number, e.g. 3e-4 or 0.5"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and spec:
        bounds = _bounds(spec)
        problem = f"must be {bounds}, got {value!r}"
        fix = f"set {key.rpartition('.')[2]} to a value {bounds}, e.g. {spec.default!r}"
    else:
        problem, fix = f"expected {_describe(tp)}, got {_got(value)}", _fix(tp, value, key)
    message = _format([_join(prefix, key)], origin.where(key), problem, fix, origin.line(key))
    return ConfigError(message, keys=[_join(prefix, key)])


def _build(cls: type[T], data: Mapping[str, Any] | None, origin: _Origin, prefix: str = "") -> T:
    data = {} if data is None else data
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _explain(e, cls, data, origin, prefix) from None


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "", *, prefix: str = "") -> T:
    """Build config model ``cls`` from plain data, checking every key and value.

    ``where`` names the source in error messages (a file name such as ``"run.yaml"``); ``prefix`` is
    the dotted key ``data`` sits under, when it is one section of a bigger config. Keys that are left
    out keep their defaults.
    """
    return _build(cls, data, _Origin(where), prefix)


def load_config(cls: type[T], path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML at ``path`` (defaults when None), apply ``key=value`` overrides, build and check ``cls``.

    Overrides are applied in order (later wins); ``model.lora.r=8`` on a config with no LoRA section
    creates one with defaults for the other keys, and ``model.lora=null`` removes it. An override of a
    text key keeps its text as written: ``train.output_dir=007`` is the string ``"007"``.
    """
    if isinstance(overrides, str):  # a lone "a=b" would otherwise be read one character at a time
        overrides = [overrides]
    data, lines = _read(path) if path is not None else ({}, {})
    origin = _Origin(str(path) if path is not None else "", lines)
    for item in overrides:
        key, value = parse_override(item)
        parts = key.split(".")
        _, tp, named, _ = _walk(cls, parts)
        if named == len(parts) and _takes_text(tp) and isinstance(value, (bool, int, float)):
            value = item.partition("=")[2].strip()
        for table in (origin.lines, origin.overrides):
            for k in [k for k in table if _below(k, key)]:
                del table[k]
        _set_path(data, key, value)
        origin.overrides[key] = item.strip()
    return _build(cls, data, origin)


def to_dict(cfg: ConfigModel) -> dict[str, Any]:
    """A config as plain nested dicts and lists, which build back the same config."""
    if not isinstance(cfg, BaseModel):
        raise TypeError(f"to_dict expects a config instance, got {type(cfg).__name__}")
    return cfg.model_dump()


def save_config(cfg: ConfigModel, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as YAML (atomically), so a run directory records exactly what ran.

    The file loads back with :func:`load_config` to an equal config.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    name = type(cfg).__name__
    body = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    header = f"# Resolved {name} written by padless; load with load_config({name}, this file).\n"
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(header + body, encoding="utf-8")
    os.replace(tmp, p)
    return p


def json_schema(cls: type[ConfigModel]) -> dict[str, Any]:
    """The JSON Schema of one trainer's config file, for editors to complete and check YAML against.

    A section whose defaults differ from its class's (``DPOConfig.train``) states them as its default."""
    schema = cls.model_json_schema()
    for name, spec in cls.model_fields.items():
        if spec.default_factory is not None and _is_model(spec.annotation):
            own = spec.get_default(call_default_factory=True).model_dump(mode="json", exclude_unset=True)
            schema["properties"][name].update({"default": own} if own else {})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# --------------------------------------------------------------------------------------------------
# The configs the trainers read

REPORTERS = ("tensorboard", "jsonl")


# Bounds are part of a key's type (PositiveInt, ... from pydantic, or Field(ge=..., lt=...)), so that the
# JSON Schema carries them and editors check them too; rules that need a reason or a fix of their own
# go in the section's _check.
Fraction = Annotated[float, Field(ge=0, lt=1)]


class LoraSettings(ConfigModel):
    """LoRA adapters; present (even as ``lora: {}``) means train adapters instead of all weights."""

    r: PositiveInt = 16
    alpha: PositiveInt = 32
    dropout: Fraction = 0.05
    target_modules: list[str] | str = "all-linear"
    """module names, or all-linear"""

    def _check(self) -> None:
        if not self.target_modules:
            raise invalid(
                "target_modules",
                "is empty, so no layer would get an adapter",
                "list module names such as [q_proj, v_proj], or use all-linear",
            )


class ModelSettings(ConfigModel):
    name: str = "tiny-qwen2"
    """embedded name, local dir or cached HF id"""
    attn_implementation: Literal["varlen", "sdpa", "eager", "flex_attention", "flash_attention_2"] = "varlen"
    varlen_kernel: Literal["auto", "sdpa", "torch", "flash_attn"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU"""
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    seed: int = 0
    """init seed for embedded tiny models"""
    trust_remote_code: bool = False
    """run Python code shipped in a model folder (auto_map); never a prompt"""

    def _check(self) -> None:
        if not self.name:
            raise invalid("name", "is empty", "give an embedded model name, a local directory or a HF id")
        if self.varlen_kernel != "auto" and self.attn_implementation != "varlen":
            raise invalid(
                ("varlen_kernel", "attn_implementation"),
                f"varlen_kernel={self.varlen_kernel!r} only applies to attn_implementation 'varlen', "
                f"but attn_implementation is {self.attn_implementation!r}, so it would be ignored",
                "set attn_implementation to varlen, or varlen_kernel to auto",
            )


class DataSettings(ConfigModel):
    train: str = "tiny:sft"
    """jsonl/json/parquet path, a datasets dir (save_to_disk), or tiny:<name>"""
    eval: str | None = None
    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    max_length: PositiveInt = 2048
    truncation: Literal["error", "truncate"] = "error"
    """what to do with a sequence longer than max_length"""
    completion_only_loss: bool = True
    skip_bad_rows: bool = False
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


class TrainSettings(ConfigModel):
    output_dir: str = "runs/sft"
    seed: int = 42
    num_epochs: NonNegativeFloat = 1.0
    max_steps: int = -1
    """>0 overrides num_epochs"""
    learning_rate: PositiveFloat = 1e-4
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: Fraction = 0.0
    warmup_steps: NonNegativeInt = 0
    """>0 overrides warmup_ratio"""
    weight_decay: NonNegativeFloat = 0.0
    adam_beta1: Fraction = 0.9
    adam_beta2: Fraction = 0.999
    adam_epsilon: PositiveFloat = 1e-8
    max_grad_norm: float = 1.0
    """<=0 disables clipping"""
    gradient_accumulation_steps: PositiveInt = 1
    batching: Literal["tokens", "packing", "padded"] = "tokens"
    max_tokens_per_batch: PositiveInt = 4096
    """tokens per micro-batch for batching tokens, and bin size for packing"""
    batch_size: PositiveInt = 8
    """sequences per micro-batch for "padded" (comparison mode only)"""
    padding_side: Literal["left", "right"] = "right"
    """batching padded only"""
    logits_memory_mb: PositiveInt = 1024
    """fp32 logits of a micro-batch above this many MB: the LM head runs in chunks"""
    logging_steps: PositiveInt = 10
    eval_steps: NonNegativeInt = 0
    """0: evaluate only at the end (if data.eval is set)"""
    eval_generate: bool = False
    eval_max_new_tokens: PositiveInt = 64
    eval_batch_size: PositiveInt = 8
    save_steps: NonNegativeInt = 0
    """0: save only at the end"""
    save_total_limit: NonNegativeInt = 0
    """0: keep all"""
    resume_from_checkpoint: str | None = None
    """path, "latest" (must exist) or "auto" (latest if any)"""
    overwrite_output_dir: bool = False
    """a used output_dir is refused unless resuming or this is true"""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """a NaN/inf loss or grad norm: stop, or skip the step"""
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard", "jsonl"])
    progress_bar: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console and output_dir/log.txt"""

    def _check(self) -> None:
        if not self.output_dir:
            raise invalid("output_dir", "is empty", "give a directory for checkpoints and logs, e.g. runs/x")
        if not (self.num_epochs > 0 or self.max_steps > 0):
            raise invalid(
                ("num_epochs", "max_steps"),
                f"num_epochs={self.num_epochs!r} and max_steps={self.max_steps!r} give no training steps",
                "set num_epochs > 0, or max_steps > 0",
            )
        unknown = [r for r in self.report_to if r not in REPORTERS]
        if unknown:
            raise invalid(
                "report_to",
                f"unknown reporter(s) {', '.join(map(repr, unknown))}; padless writes to "
                f"{', '.join(map(repr, REPORTERS))}",
                "use a subset of [tensorboard, jsonl] ([] for none)",
            )
        if self.resume_from_checkpoint == "":
            raise invalid(
                "resume_from_checkpoint",
                "is an empty string",
                "give a checkpoint path, 'latest', 'auto', or null to start fresh",
            )
        if self.overwrite_output_dir and self.resume_from_checkpoint in ("latest", "auto"):
            raise invalid(
                ("overwrite_output_dir", "resume_from_checkpoint"),
                f"overwrite_output_dir deletes the checkpoints in output_dir that resume_from_checkpoint="
                f"{self.resume_from_checkpoint} would resume from",
                "set one of them: overwrite_output_dir=false to resume, or resume_from_checkpoint=null",
            )


def _check_eval_set(eval_data: str | None, train: TrainSettings, what: str) -> None:
    if eval_data is None and train.eval_steps > 0:
        raise invalid(
            ("train.eval_steps", "data.eval"),
            f"eval_steps={train.eval_steps} asks for evaluation but data.eval is not set",
            f"set data.eval to {what}, or train.eval_steps to 0",
        )


class SFTConfig(ConfigModel):
    """Supervised fine-tuning: the loss on completions (or assistant turns) of packed examples."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)

    def _check(self) -> None:
        _check_eval_set(self.data.eval, self.train, "an eval data set")
        if self.data.eval is None and self.train.eval_generate:
            raise invalid(
                ("train.eval_generate", "data.eval"),
                "eval_generate samples completions for eval prompts, but data.eval is not set",
                "set data.eval, or train.eval_generate to false",
            )


# --------------------------------------------------------------------------------------------------
# Preference training: DPO (and its reference-free variants) and reward models


class PreferenceDataSettings(ConfigModel):
    train: str = "tiny:preference"
    """same sources as DataSettings.train"""
    eval: str | None = None
    max_length: PositiveInt = 2048
    """per side: prompt + chosen, and prompt + rejected"""
    truncation: Literal["error", "truncate"] = "error"
    """truncate cuts the completion, never the prompt"""
    skip_bad_rows: bool = False
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


class DPOSettings(ConfigModel):
    beta: PositiveFloat = 0.1
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    label_smoothing: float = 0.0
    """sigmoid only, in [0, 0.5): conservative DPO for noisy labels"""
    rpo_alpha: float | None = None
    """weight of an NLL term on chosen (RPO); null: none"""
    simpo_gamma: NonNegativeFloat = 0.5
    """SimPO target reward margin; used as gamma / beta inside the sigmoid, like TRL"""
    reference: Literal["model", "adapters"] = "model"
    """adapters: the policy with its LoRA adapters disabled"""
    ref_model: str | None = None
    """null: a frozen copy of model.name"""
    precompute_ref_logps: bool = False

    def _check(self) -> None:
        if not 0 <= self.label_smoothing < 0.5:
            raise invalid(
                "label_smoothing",
                f"must be in [0, 0.5), got {self.label_smoothing!r} (0.5 would make chosen and rejected "
                "interchangeable)",
                "set label_smoothing to at least 0 and below 0.5, e.g. 0.1",
            )
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise invalid(
                ("label_smoothing", "loss_type"),
                f"label_smoothing={self.label_smoothing} only applies to loss_type 'sigmoid', but loss_type "
                f"is {self.loss_type!r}, so it would be ignored",
                "set label_smoothing to 0, or loss_type to sigmoid",
            )
        if self.rpo_alpha is not None and not self.rpo_alpha >= 0:
            raise invalid("rpo_alpha", f"must be >= 0, got {self.rpo_alpha!r}", "set rpo_alpha >= 0, or null")
        if self.ref_model == "":
            raise invalid("ref_model", "is an empty string", "name a model, or null for a copy of model.name")
        if self.ref_model is not None and self.reference == "adapters":
            raise invalid(
                ("ref_model", "reference"),
                f"reference 'adapters' uses the policy itself with adapters disabled, so ref_model="
                f"{self.ref_model!r} would be ignored",
                "set ref_model to null, or reference to model",
            )
        if self.loss_type == "simpo":
            given = [
                (name, text)
                for name, text, used in (
                    ("ref_model", f"ref_model={self.ref_model!r}", self.ref_model is not None),
                    ("reference", "reference='adapters'", self.reference == "adapters"),
                    ("precompute_ref_logps", "precompute_ref_logps=true", self.precompute_ref_logps),
                )
                if used
            ]
            if given:
                name, text = given[0]
                raise invalid(
                    (name, "loss_type"),
                    f"simpo is reference-free (it scores length-normalized policy log-probs only), so "
                    f"{text} would be ignored",
                    f"unset {name}, or choose a loss_type that uses a reference (sigmoid, ipo, hinge)",
                )


def _check_preference_run(data: PreferenceDataSettings, train: TrainSettings) -> None:
    """Cross-section checks shared by DPO and reward-model configs."""
    if train.eval_generate:
        raise invalid(
            "train.eval_generate",
            "eval_generate is an SFT option (DPO and reward-model evaluation report preference metrics on "
            "data.eval instead)",
            "set train.eval_generate to false",
        )
    _check_eval_set(data.eval, train, "an eval data set (e.g. tiny:preference_eval)")


class DPOConfig(ConfigModel):
    """Direct preference optimisation (sigmoid, IPO, hinge, SimPO; optional RPO term) on preference pairs."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/dpo", learning_rate=5e-6)
    )
    dpo: DPOSettings = Field(default_factory=DPOSettings)

    def _check(self) -> None:
        _check_preference_run(self.data, self.train)
        if self.dpo.reference == "adapters" and self.model.lora is None:
            raise invalid(
                ("dpo.reference", "model.lora"),
                "reference 'adapters' means the policy with its LoRA adapters disabled, but model.lora is "
                "not set, so there are no adapters",
                "add a model.lora section (e.g. model.lora.r=16), or set dpo.reference to model",
            )


class RMSettings(ConfigModel):
    margin: bool = False
    """add each row's "margin" field to the Bradley-Terry loss (every row must have one)"""


class RMConfig(ConfigModel):
    """A reward model: a scalar head trained with the Bradley-Terry loss on chosen/rejected pairs."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/rm", learning_rate=1e-4)
    )
    rm: RMSettings = Field(default_factory=RMSettings)

    def _check(self) -> None:
        _check_preference_run(self.data, self.train)


# --------------------------------------------------------------------------------------------------
# Online RL: GRPO and PPO


class RLDataSettings(ConfigModel):
    train: str = "tiny:rl"
    """rows {"prompt": str | messages, ...}; other columns go to the reward functions"""
    eval: str | None = None
    max_prompt_length: PositiveInt = 512
    """prompts are never truncated: a longer one is a bad row"""
    chat_template: bool | None = None
    """string prompts as a user message; None: when the tokenizer has one"""
    skip_bad_rows: bool = False
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


class RolloutSettings(ConfigModel):
    engine: Literal["hf", "vllm"] = "hf"
    """vllm: colocated, needs vLLM and CUDA (checked at start)"""
    prompts_per_step: PositiveInt = 16
    """prompts per rollout batch"""
    num_generations: PositiveInt = 4
    """samples per prompt (GRPO group size; PPO usually 1)"""
    max_new_tokens: PositiveInt = 64
    temperature: float = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    generation_batch_size: PositiveInt = 32
    """sequences per generate() call"""
    mask_truncated: bool = True
    """completions that hit max_new_tokens without EOS: out of the loss, or kept"""
    vllm_gpu_memory_utilization: float = 0.3
    """engine vllm: share of GPU memory for its weights + KV cache"""

    def _check(self) -> None:
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise invalid(
                "vllm_gpu_memory_utilization",
                f"must be in (0, 1), got {self.vllm_gpu_memory_utilization!r}: the rest of the GPU holds the "
                "policy, its gradients and optimizer state",
                "set it to e.g. 0.3",
            )
        if not self.temperature > 0:
            raise invalid(
                "temperature",
                f"must be > 0, got {self.temperature!r}: RL samples completions, and greedy decoding would "
                "give every sample of a prompt the same completion",
                "set temperature to e.g. 1.0 (or 0.7 for less random samples)",
            )


class RewardSettings(ConfigModel):
    """The reward: a weighted sum of ``functions`` (see :mod:`padless.rewards`) and a reward model's score."""

    functions: list[str] = Field(default_factory=lambda: ["arithmetic"])
    """bundled, module:fn or file.py:fn"""
    weights: list[float] | None = None
    """default 1.0 each; one per function, in order"""
    model: str | None = None
    """a padless reward model checkpoint (score at each sequence's last token)"""
    model_weight: float = 1.0

    def _check(self) -> None:
        if not self.functions and self.model is None:
            raise invalid(
                ("functions", "model"),
                "no reward: functions is empty and model is not set",
                "list reward functions (e.g. [arithmetic]) or set model to a reward model checkpoint",
            )
        for i, spec in enumerate(self.functions):
            if not spec.strip():
                raise invalid(
                    "functions",
                    f"item {i} is an empty string",
                    "write 'package.module:function', 'path/to/file.py:function' or a bundled name",
                )
        repeated = sorted({s for s in self.functions if self.functions.count(s) > 1})
        if repeated:
            raise invalid(
                "functions",
                f"{repeated[0]!r} is listed more than once, so it would count twice",
                "list it once and raise its weight instead",
            )
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise invalid(
                ("weights", "functions"),
                f"{len(self.weights)} weight(s) for {len(self.functions)} function(s)",
                "give one weight per function, in the same order, or null for 1.0 each",
            )
        if self.model == "":
            raise invalid("model", "is an empty string", "give a reward model checkpoint, or null for none")
        if self.model is None and self.model_weight != 1.0:
            raise invalid(
                ("model_weight", "model"),
                f"model_weight={self.model_weight} weights a reward model's score, but model is not set, so "
                "it would be ignored",
                "set model to a reward model checkpoint, or leave model_weight at 1.0",
            )


class GRPOSettings(ConfigModel):
    beta: NonNegativeFloat = 0.04
    """KL (k3) coefficient; 0 disables the reference model"""
    epsilon: float = 0.2
    """clip range: ratios are clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: float | None = None
    """asymmetric upper clip (DAPO); default = epsilon"""
    scale_rewards: bool = True
    """divide group-centred rewards by the group std"""
    loss_normalisation: Literal["token", "sequence"] = "token"
    updates_per_rollout: PositiveInt = 1
    """policy passes over each rollout batch (ratios from stored old log-probs)"""
    mini_batches_per_rollout: PositiveInt = 1
    """optimizer steps per pass"""

    def _check(self) -> None:
        if not 0 < self.epsilon < 1:
            raise invalid(
                "epsilon",
                f"must be in (0, 1), got {self.epsilon!r} (the lower clip bound 1 - epsilon must stay > 0)",
                "set epsilon to e.g. 0.2",
            )
        if self.epsilon_high is not None and not self.epsilon_high >= self.epsilon:
            raise invalid(
                ("epsilon_high", "epsilon"),
                f"epsilon_high={self.epsilon_high!r} is below epsilon={self.epsilon!r}; it is the upper clip "
                "range, meant to be at least as wide as the lower one (DAPO's clip-higher: 0.28 with 0.2)",
                "set epsilon_high >= epsilon, or null for a symmetric clip",
            )


class PPOSettings(ConfigModel):
    value_model: str | None = None
    """default: model.name with a fresh scalar head"""
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    kl_coef: NonNegativeFloat = 0.05
    """per-token KL penalty folded into the reward"""
    cliprange: float = Field(0.2, gt=0, lt=1)
    cliprange_value: float = Field(0.2, gt=0, lt=1)
    vf_coef: PositiveFloat = 0.1
    whiten_advantages: bool = True
    critic_warmup_steps: NonNegativeInt = 0
    """rollouts that update only the value model first"""
    updates_per_rollout: PositiveInt = 1
    mini_batches_per_rollout: PositiveInt = 1
    value_learning_rate: float | None = None
    """default: train.learning_rate"""

    def _check(self) -> None:
        if self.value_model == "":
            raise invalid(
                "value_model", "is an empty string", "name a model, or null for model.name with a fresh head"
            )
        if self.value_learning_rate is not None and not self.value_learning_rate > 0:
            raise invalid(
                "value_learning_rate",
                f"must be > 0, got {self.value_learning_rate!r}",
                "set a positive learning rate, or null to use train.learning_rate",
            )


def _check_rl_run(
    data: RLDataSettings, train: TrainSettings, rollout: RolloutSettings, mini_batches: str, n_mini: int
) -> None:
    """Cross-section checks shared by GRPO and PPO configs."""
    if train.batching == "padded":
        raise invalid(
            "train.batching",
            "'padded' is a comparison mode for SFT and preference training; RL scoring always runs packed",
            "set train.batching to tokens or packing",
        )
    if train.eval_generate:
        raise invalid(
            "train.eval_generate",
            "eval_generate is an SFT option (RL evaluation samples completions for data.eval and reports "
            "their rewards instead)",
            "set train.eval_generate to false",
        )
    _check_eval_set(data.eval, train, "a prompt data set")
    samples = rollout.prompts_per_step * rollout.num_generations
    if samples % n_mini:
        raise invalid(
            (mini_batches, "rollout.prompts_per_step", "rollout.num_generations"),
            f"a rollout of {rollout.prompts_per_step} prompts x {rollout.num_generations} generations = "
            f"{samples} samples does not split into {n_mini} equal mini-batches",
            f"choose {mini_batches.rpartition('.')[2]} dividing {samples}, or change prompts_per_step",
        )


class GRPOConfig(ConfigModel):
    """Group Relative Policy Optimization: ``num_generations`` samples per prompt, advantages within groups.

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout of
    ``rollout.prompts_per_step`` prompts gives ``grpo.updates_per_rollout x grpo.mini_batches_per_rollout``
    of them, so a run makes ``max_steps / (updates x mini-batches)`` rollouts.
    """

    model: ModelSettings = Field(default_factory=ModelSettings)
    data: RLDataSettings = Field(default_factory=RLDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/grpo", learning_rate=1e-5, max_steps=100)
    )
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)

    def _check(self) -> None:
        if self.rollout.num_generations < 2:
            raise invalid(
                "rollout.num_generations",
                f"is {self.rollout.num_generations}, but GRPO's advantages compare the samples of one prompt "
                "with each other, so every group needs at least 2",
                "set rollout.num_generations to 2 or more (e.g. 4 or 8)",
            )
        n_mini = self.grpo.mini_batches_per_rollout
        _check_rl_run(self.data, self.train, self.rollout, "grpo.mini_batches_per_rollout", n_mini)


class PPOConfig(ConfigModel):
    """Proximal Policy Optimization with a learned value model (GAE advantages, per-token KL penalty).

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout gives
    ``ppo.updates_per_rollout x ppo.mini_batches_per_rollout`` of them (critic warm-up rollouts included).
    """

    model: ModelSettings = Field(default_factory=ModelSettings)
    data: RLDataSettings = Field(default_factory=RLDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/ppo", learning_rate=1e-5, max_steps=100)
    )
    rollout: RolloutSettings = Field(default_factory=lambda: RolloutSettings(num_generations=1))
    reward: RewardSettings = Field(default_factory=RewardSettings)
    ppo: PPOSettings = Field(default_factory=PPOSettings)

    def _check(self) -> None:
        n_mini = self.ppo.mini_batches_per_rollout
        _check_rl_run(self.data, self.train, self.rollout, "ppo.mini_batches_per_rollout", n_mini)
