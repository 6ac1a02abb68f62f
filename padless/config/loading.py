"""Reading and writing run configs: a YAML file plus ``key=value`` overrides, checked by the strict
pydantic base that every config section derives from (:class:`ConfigModel`).

Every mistake is reported before a run starts, with the dotted key, where it was set (file and line, or the
command-line override), what was expected, what was found and how to fix it: pydantic finds the mistakes,
:func:`_explain` turns its first one into that line. Values are read with a YAML 1.2-like schema so that
``1e-4`` is a float, while ``yes``/``no``/``on``/``off`` and dates stay strings: a model called ``no`` or a
``data.eval`` of ``2024-01-01`` is not silently turned into a bool or a date. ``padless schema TRAINER``
prints each config's JSON Schema for editors. The sections themselves are in :mod:`padless.config.schema`.
This module imports no torch, so configs can be checked quickly.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from padless.config import meanings

T = TypeVar("T", bound="ConfigModel")

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


@dataclass(frozen=True)
class Applies:
    """Keys that change nothing unless a choice is made: the one place a section says when its keys apply.

    ``keys`` are the section's own (or, on a whole config, dotted keys of its sections); ``when`` reads
    the section (or config) and says whether they apply; ``choices`` are the keys it reads. A key set to
    anything but its default while ``when`` is false is refused (``refuse``), naming it, why it has no
    effect (``because``) and what to set instead (``fix``, where ``{key}`` is the key); with ``refuse``
    false the other key takes precedence by design (``max_steps`` over ``num_epochs``) and the run's log
    says so (:func:`precedence_notes`)."""

    keys: tuple[str, ...]
    choices: tuple[str, ...]
    when: Callable[[Any], bool]
    because: str
    fix: str = "remove {key}"
    refuse: bool = True

    def inert(self, section: ConfigModel) -> list[tuple[str, Any]]:
        """The keys set to something other than their default while they change nothing, with values."""
        if self.when(section):
            return []
        found = []
        for key in self.keys:
            value = _get(section, key)
            if value != _default(type(section), key):
                found.append((key, value))
        return found


@dataclass(frozen=True)
class Why:
    """Why a key's bounds are what they are: said with the bound when a value falls outside it
    (``Annotated[float, Field(gt=0), Why("...")]``)."""

    text: str


def shown(value: Any) -> str:
    """A value as YAML writes it: true, null, 3.0, 'text'."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return repr(value)


def _get(section: Any, key: str) -> Any:
    for part in key.split("."):
        section = getattr(section, part)
    return section


def _default(cls: type[BaseModel], key: str) -> Any:
    """A dotted key's default in ``cls``: the default of its section as ``cls`` builds it (a trainer's
    section may have defaults of its own), then attribute by attribute."""
    first, _, rest = key.partition(".")
    value = cls.model_fields[first].get_default(call_default_factory=True)
    return _get(value, rest) if rest else value


def precedence_notes(cfg: ConfigModel) -> list[str]:
    """One line per key that another key overrides by design (``Applies(refuse=False)``), for the log."""
    notes = []
    for rule in type(cfg).applies:
        for key, value in rule.inert(cfg) if not rule.refuse else ():
            notes.append(f"{key}={shown(value)} has no effect: {rule.because} ({rule.fix.format(key=key)})")
    for name in type(cfg).model_fields:
        child = getattr(cfg, name)
        if isinstance(child, ConfigModel):
            notes += [f"{name}.{note}" for note in precedence_notes(child)]
    return notes


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


def _set_path(data: dict[str, Any], key: str, value: Any, origin: _Origin, item: str) -> None:
    """Put an override's value under its dotted key; a section that is absent or null (``model.lora:
    null``) starts empty, one of another type is refused: the override would silently replace it."""
    node = data
    parts = key.split(".")
    for n, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is not None and not isinstance(child, dict):
            section = ".".join(parts[: n + 1])
            where = origin.where(section) + origin.line(section)
            raise ConfigError(
                f"{section}{where} is {_got(child)}, not a section, so the override {item!r} on the command "
                f"line has nowhere to go; fix: write {section} as a mapping of keys (or leave it out)",
                keys=[section],
            )
        if child is None:
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _leaves(key: str, value: Any) -> list[str]:
    """The dotted keys an override sets: its own, or each key of a mapping it gives (none for ``{}``)."""
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(_join(key, str(k)), v)]
    return [key]


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


def _annotated_members(tp: Any) -> tuple[Any, ...]:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def _strip_annotated(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _members(tp: Any) -> tuple[Any, ...]:
    """The types a union allows, each without its ``Annotated`` constraints."""
    return tuple(_strip_annotated(m) for m in _annotated_members(tp))


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
    applies: ClassVar[tuple[Applies, ...]] = ()
    """When the section's keys apply (see :class:`Applies`); checked before ``_check``."""

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
        for rule in self.applies:
            for key, value in rule.inert(self)[:1] if rule.refuse else ():
                raise invalid(
                    (key, *rule.choices),
                    f"{key.rpartition('.')[2]}={shown(value)} has no effect: {rule.because}",
                    rule.fix.format(key=key),
                )
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


def _metadata(spec: FieldInfo) -> list[Any]:
    """A field's constraints and notes, also those inside an optional type (``PositiveFloat | None``)."""
    found = list(spec.metadata)
    for member in _annotated_members(spec.annotation):
        if get_origin(member) is Annotated:
            for item in get_args(member)[1:]:
                found += list(getattr(item, "metadata", ())) or [item]
    return found


def bounds(spec: FieldInfo) -> dict[str, float]:
    """A field's bounds: ``{"gt": 0}``, ``{"ge": 0, "lt": 1}``; empty when it has none."""
    return {
        k: getattr(m, k)
        for m in _metadata(spec)
        for k in ("gt", "ge", "lt", "le")
        if getattr(m, k, None) is not None
    }


def _bounds(spec: FieldInfo) -> str:
    """A field's bounds in words: '> 0', 'in [0, 1)'."""
    b = bounds(spec)
    low = f"({b['gt']}" if "gt" in b else f"[{b['ge']}" if "ge" in b else ""
    high = f"{b['lt']})" if "lt" in b else f"{b['le']}]" if "le" in b else ""
    if low and high:
        return f"in {low}, {high}"
    return next(f"{op} {b[k]}" for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if k in b)


def _inside(spec: FieldInfo) -> Any:
    """A value within a field's bounds to show in a fix: its default, or a round number inside."""
    if spec.default is not None and not callable(spec.default_factory):
        return spec.default
    b = bounds(spec)
    low = b.get("ge", b.get("gt", 0))
    high = b.get("le", b.get("lt", math.inf))
    value = low + 1 if high - low > 1 else (low + high) / 2
    return int(value) if int in _members(spec.annotation) else value


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
    meaning = meanings.value(key.rpartition(".")[2], value)
    if meaning is not None:
        fix = f"did you mean {meaning.to[0]!r}? ({meaning.note})" if meaning.to else meaning.note
    elif get_origin(one) is Literal:
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


def _meant(name: str, names: list[str], root: type, prefix: str) -> str:
    """What an unknown key is likely meant to be, with a trailing "; ", or "": a name other trainers use
    (:mod:`padless.config.meanings`), a key of another section, then a key spelled like it."""

    def locate(target: str) -> str | None:
        if target in names:
            return target
        for section, spec in root.model_fields.items():
            tp = _strip_none(spec.annotation)
            if _is_model(tp) and target in tp.model_fields:
                return _join(prefix, f"{section}.{target}")
        return None

    meaning = meanings.KEYS.get(name)
    if meaning is not None:
        found = next((k for t in meaning.to if (k := locate(t))), None)
        if found:
            return f"did you mean '{found}'? ({meaning.note}); "
        if not meaning.to:
            return f"{meaning.note}; "
    found = locate(name)
    if found:
        return f"did you mean '{found}'? ({name} is a key of that section); "
    close = difflib.get_close_matches(name, names, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


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
        hint = _meant(str(loc[-1]), names, cls, prefix)
        section = f"valid keys under '{_join(prefix, key)}'" if prefix or key else "valid top-level keys"
        where = origin.where(unknown) + origin.line(unknown)
        unknown = _join(prefix, unknown)
        return ConfigError(
            f"unknown key '{unknown}'{where}; {hint}{section}: {', '.join(names)}", keys=[unknown]
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
        text = _bounds(spec)
        why = "".join(f" ({m.text})" for m in _metadata(spec) if isinstance(m, Why))
        problem = f"must be {text}, got {value!r}{why}"
        fix = (
            f"set {key.rpartition('.')[2]} to a value {text}, e.g. {_inside(spec)!r}"
            + ", or null" * _optional(spec.annotation)
        )
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


def load_config(
    cls: type[T], path: str | os.PathLike[str] | None, overrides: Sequence[str] = (), *, once: bool = False
) -> T:
    """Read YAML at ``path`` (defaults when None), apply ``key=value`` overrides, build and check ``cls``.

    Overrides are applied in order (later wins); with ``once`` (the command line, where a repeated key is a
    slip, not a composition) an override that would replace another's value is refused. ``model.lora.r=8``
    on a config with no LoRA section creates one with defaults for the other keys, and ``model.lora=null``
    removes it; a section of another type in the file (``train: 5``) is refused, not replaced. An override
    of a text key keeps its text as written: ``train.output_dir=007`` is the string ``"007"``.
    """
    if isinstance(overrides, str):  # a lone "a=b" would otherwise be read one character at a time
        overrides = [overrides]
    data, lines = _read(path) if path is not None else ({}, {})
    origin = _Origin(str(path) if path is not None else "", lines)
    given: dict[str, str] = {}  # dotted key -> the override that set it
    for item in overrides:
        key, value = parse_override(item)
        for leaf in _leaves(key, value) if once else ():
            earlier = next((i for k, i in given.items() if _below(k, leaf) or _below(leaf, k)), None)
            if earlier is not None:
                raise ConfigError(
                    f"{key} on the command line ({item.strip()!r}) sets again what {earlier!r} set, and the "
                    "first value would be silently lost; fix: give each key once",
                    keys=[key],
                )
            given[leaf] = item.strip()
        parts = key.split(".")
        _, tp, named, _ = _walk(cls, parts)
        if named == len(parts) and _takes_text(tp) and isinstance(value, (bool, int, float)):
            value = item.partition("=")[2].strip()
        for table in (origin.lines, origin.overrides):
            for k in [k for k in table if _below(k, key)]:
                del table[k]
        _set_path(data, key, value, origin, item.strip())
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
