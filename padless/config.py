"""Typed run configs: a YAML file plus ``key=value`` overrides, checked against nested dataclasses.

Every mistake is reported before a run starts, with the dotted key, where it was set (file or command
line), what was expected, what was found and how to fix it. Values are read with a YAML 1.2-like schema
so that ``1e-4`` is a float, while ``yes``/``no``/``on``/``off`` and dates stay strings: a model called
``no`` or a ``data.eval`` of ``2024-01-01`` is not silently turned into a bool or a date.

This module imports no torch, so configs can be checked quickly (and in tests) without loading models.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")

__all__ = [
    "ConfigError",
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
    "load_config",
    "parse_override",
    "read_yaml",
    "save_config",
    "to_dict",
]


# --------------------------------------------------------------------------------------------------
# Errors


class ConfigError(ValueError):
    """A config a run cannot start from; the message says where, what was expected, what was found, the fix.

    ``keys`` are the dotted keys involved; ``problem``/``fix`` are set for errors made by :func:`invalid`,
    so :func:`from_dict` can re-raise them with full dotted keys and the place the values came from.
    """

    def __init__(
        self, message: str, *, keys: Sequence[str] = (), problem: str | None = None, fix: str | None = None
    ) -> None:
        super().__init__(message)
        self.keys = tuple(keys)
        self.problem = problem
        self.fix = fix


def _format(keys: Sequence[str], source: str, problem: str, fix: str | None) -> str:
    where = ", ".join(keys) or "config"
    return f"{where}{source}: {problem}" + (f"; fix: {fix}" if fix else "")


def invalid(keys: str | Sequence[str], problem: str, fix: str) -> ConfigError:
    """The error a dataclass's ``__post_init__`` raises for an impossible value or combination.

    ``keys`` are relative to that dataclass (``"warmup_ratio"``, or ``"data.eval"`` from a parent);
    :func:`from_dict` re-raises with the full dotted keys and the file or override that set them, so
    cross-field errors read like every other config error.
    """
    names = (keys,) if isinstance(keys, str) else tuple(keys)
    return ConfigError(_format(names, "", problem, fix), keys=names, problem=problem, fix=fix)


# --------------------------------------------------------------------------------------------------
# YAML dialect: only true/false are bools, 1e-4 is a float, no implicit dates.

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


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config file into a plain dict; every failure becomes a :class:`ConfigError` naming the file."""
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
    try:
        data = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
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
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (e.g. 'model:', 'train:'), "
            f"got {_got(data)}; fix: write 'section:' lines with indented 'key: value' lines under them"
        )
    return data


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


# --------------------------------------------------------------------------------------------------
# Building dataclasses


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _describe(tp: Any) -> str:
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if _is_union(tp):
        args = sorted(get_args(tp), key=lambda a: a is type(None))  # null last
        return " or ".join(_describe(a) for a in args)
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin is list:
        return f"list of {_describe(get_args(tp)[0])}"
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        return "mapping" if value_tp is Any else f"mapping of {_describe(key_tp)} to {_describe(value_tp)}"
    if _is_dataclass_type(tp):
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


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


class _Mismatch(Exception):
    """Internal: a value of the wrong shape; turned into a ConfigError with key and source by the caller."""

    def __init__(self, tp: Any, value: Any, fix: str) -> None:
        super().__init__()
        self.tp, self.value, self.fix = tp, value, fix


class _Builder:
    """Builds one config, knowing which keys came from the file and which from command-line overrides."""

    def __init__(self, source: str, origins: Mapping[str, str], raw: Mapping[str, str]) -> None:
        self.source = source  # " in run.yaml", or "" when unnamed
        self.origins = origins  # dotted key -> the override that set it, "key=value"
        self.raw = raw  # dotted key -> override text, so a str field keeps e.g. "007" rather than 7

    def override_of(self, key: str) -> str | None:
        """The command-line override that set ``key`` (or a section above it), if any."""
        parts = re.split(r"[\[ ]", key, maxsplit=1)[0].split(".")  # "a.b[2]" and "a.b.k (the key)" -> a.b
        for n in range(len(parts), 0, -1):
            item = self.origins.get(".".join(parts[:n]))
            if item is not None:
                return item
        return None

    def where(self, *keys: str) -> str:
        """' in run.yaml', " on the command line ('a=1', 'b=2')", both joined by 'and', or ''."""
        items = [self.override_of(k) for k in keys]
        overrides = list(dict.fromkeys(i for i in items if i is not None))
        parts = [self.source] if self.source and None in items else []
        if overrides:
            parts.append(" on the command line (" + ", ".join(map(repr, overrides)) + ")")
        return " and".join(parts)

    def mismatch(self, key: str, m: _Mismatch) -> ConfigError:
        problem = f"expected {_describe(m.tp)}, got {_got(m.value)}"
        return ConfigError(_format([key or "config"], self.where(key), problem, m.fix), keys=[key])

    # ---- dataclasses

    def build(self, cls: type[T], data: Any, prefix: str, base: Any = None) -> T:
        if data is None:  # an empty section ('model:' with every line commented out) means defaults
            data = {}
        if not isinstance(data, Mapping):
            raise self.mismatch(prefix, _Mismatch(cls, data, self._fix_section(cls)))
        hints = _hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
        names = [f.name for f in fields]
        for name in data:
            if not isinstance(name, str) or name not in names:
                raise self.unknown(name, prefix, names)
        kwargs: dict[str, Any] = {}
        for f in fields:
            key = f"{prefix}.{f.name}" if prefix else f.name
            if f.name in data:
                field_base = getattr(base, f.name) if base is not None else _field_default(f)
                kwargs[f.name] = self.value(hints[f.name], data[f.name], key, field_base)
            elif base is not None:
                kwargs[f.name] = copy.deepcopy(getattr(base, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                under = f" under '{prefix}'" if prefix else ""
                raise ConfigError(
                    f"missing required key '{key}'{self.where(key)}; "
                    f"fix: add {f.name}: <{_describe(hints[f.name])}>{under}",
                    keys=[key],
                )
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if e.problem is None:
                raise
            full = [f"{prefix}.{k}" if prefix else k for k in e.keys]
            given = [k for k, rel in zip(full, e.keys, strict=True) if _present(data, rel)]
            source = self.where(*given) if given else ""
            raise ConfigError(
                _format(full, source, e.problem, e.fix), keys=full, problem=e.problem, fix=e.fix
            ) from None

    def unknown(self, name: Any, prefix: str, names: list[str]) -> ConfigError:
        key = f"{prefix}.{name}" if prefix else str(name)
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ";"
        section = f"valid keys under '{prefix}'" if prefix else "valid top-level keys"
        return ConfigError(
            f"unknown key '{key}'{self.where(key)}{hint} {section}: {', '.join(names)}", keys=[key]
        )

    # ---- values

    def value(self, tp: Any, value: Any, key: str, base: Any = None) -> Any:
        try:
            return self.convert(tp, value, key, base)
        except _Mismatch as m:
            raise self.mismatch(key, m) from None

    def convert(self, tp: Any, value: Any, key: str, base: Any) -> Any:
        """Check ``value`` against ``tp``; raises _Mismatch for this key, ConfigError for deeper keys."""
        if tp is Any:
            return value
        if _is_union(tp):
            return self.union(tp, value, key, base)
        origin = get_origin(tp)
        if _is_dataclass_type(tp):
            if value is not None and not isinstance(value, Mapping):
                raise _Mismatch(tp, value, self._fix_section(tp))
            return self.build(tp, value, key, base if isinstance(base, tp) else None)
        if origin is Literal:
            return self.literal(tp, value, key)
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise _Mismatch(tp, value, "write true or false")
        if tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                raise _Mismatch(tp, value, f"write it as a whole number: {int(value)}")
            raise _Mismatch(tp, value, "write a whole number without quotes, e.g. 100")
        if tp is float:
            return self.finite_float(value)
        if tp is str:
            if isinstance(value, str):
                return value
            if key in self.raw and isinstance(value, (int, float, bool)):
                return self.raw[key]  # train.output_dir=007 means the string "007"
            if isinstance(value, (int, float, bool)):
                return_as = str(value).lower() if isinstance(value, bool) else str(value)
                raise _Mismatch(tp, value, f"quote it: '{return_as}'")
            raise _Mismatch(tp, value, "write a single string")
        if origin is list:
            (item_tp,) = get_args(tp)
            if not isinstance(value, list):
                raise _Mismatch(tp, value, f"write a list, e.g. [a, b] (on the command line: {key}=[a,b])")
            return [self.value(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        if origin is dict:
            key_tp, item_tp = get_args(tp)
            if not isinstance(value, Mapping):
                raise _Mismatch(tp, value, "write a mapping, e.g. {a: 1.0, b: 0.5}")
            out = {}
            for k, v in value.items():
                sub = f"{key}.{k}"
                out[self.value(key_tp, k, f"{sub} (the key)")] = self.value(item_tp, v, sub)
            return out
        raise TypeError(f"config field {key!r} has a type padless.config cannot read: {tp!r}")

    @staticmethod
    def finite_float(value: Any) -> float:
        """A number as a float; inf and nan are refused everywhere: no setting means anything with them."""
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if not isinstance(value, int) or abs(value) < 2**1023 else math.inf
        elif isinstance(value, str) and _NUMBER_RE.fullmatch(value.strip()):
            number = float(value.strip())
        if number is None:
            raise _Mismatch(float, value, "write a number, e.g. 3e-4 or 0.5")
        if not math.isfinite(number):
            raise _Mismatch("a finite number", value, "write a finite number, e.g. 3e-4 or 0.5")
        return number

    def union(self, tp: Any, value: Any, key: str, base: Any) -> Any:
        members = [a for a in get_args(tp) if a is not type(None)]
        optional = len(members) < len(get_args(tp))
        if value is None and optional:
            return None
        # pick the member by the value's shape, so errors inside a section or list stay precise
        if isinstance(value, Mapping):
            shaped = [a for a in members if _is_dataclass_type(a) or get_origin(a) is dict or a is Any]
        elif isinstance(value, list):
            shaped = [a for a in members if get_origin(a) is list or a is Any]
        else:
            shaped = [a for a in members if not _is_dataclass_type(a) and get_origin(a) not in (list, dict)]
        if len(shaped) == 1 or (shaped and not isinstance(value, (str, int, float, bool))):
            try:
                return self.convert(shaped[0], value, key, base)
            except _Mismatch as m:
                raise _Mismatch(tp, value, m.fix + (", or null" if optional else "")) from None
        for member in shaped:
            try:
                return self.convert(member, value, key, base)
            except _Mismatch:
                continue
        first = members[0]
        fix = self._fix_section(first) if _is_dataclass_type(first) else f"give {_describe(tp)}"
        raise _Mismatch(tp, value, fix + (", or null" if optional and _is_dataclass_type(first) else ""))

    def literal(self, tp: Any, value: Any, key: str) -> Any:
        allowed = get_args(tp)
        candidates = [value]
        if key in self.raw and isinstance(value, (int, float, bool)):
            candidates.append(self.raw[key])
        for v in candidates:
            for a in allowed:
                if v == a and type(v) is type(a):
                    return a
        text = str(value)
        names = [str(a) for a in allowed]
        same_case = [a for a in names if a.lower() == text.lower()]
        close = same_case or difflib.get_close_matches(text, names, n=1, cutoff=0.5)
        fix = f"did you mean {close[0]!r}?" if close else "use one of the allowed values"
        raise _Mismatch(tp, value, fix)

    @staticmethod
    def _fix_section(cls: type) -> str:
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        return f"write a mapping with keys from: {', '.join(names)}"


def _present(data: Mapping[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "", *, prefix: str = "") -> T:
    """Build dataclass ``cls`` (recursively) from plain data, checking every key and value.

    ``where`` names the source in error messages (a file name such as ``"run.yaml"``); ``prefix`` is
    the dotted key ``data`` sits under, when it is one section of a bigger config. Keys that are left
    out keep the dataclass defaults.
    """
    builder = _Builder(f" in {where}" if where else "", {}, {})
    return builder.build(cls, data, prefix)


def load_config(cls: type[T], path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML at ``path`` (defaults when None), apply ``key=value`` overrides, build and check ``cls``.

    Overrides are applied in order (later wins); ``model.lora.r=8`` on a config with no LoRA section
    creates one with defaults for the other keys, and ``model.lora=null`` removes it.
    """
    if isinstance(overrides, str):  # a lone "a=b" would otherwise be read one character at a time
        overrides = [overrides]
    data = read_yaml(path) if path is not None else {}
    origins: dict[str, str] = {}
    raw: dict[str, str] = {}
    for item in overrides:
        key, value = parse_override(item)
        below = key + "."
        for table in (origins, raw):
            for k in [k for k in table if k == key or k.startswith(below)]:
                del table[k]
        _set_path(data, key, value)
        origins[key] = item.strip()
        raw[key] = item.partition("=")[2].strip()
    return _Builder(f" in {path}" if path is not None else "", origins, raw).build(cls, data, "")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain nested dicts and lists (init fields only, so it builds back the same)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}


def save_config(cfg: Any, path: str | os.PathLike[str]) -> Path:
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


# --------------------------------------------------------------------------------------------------
# The configs the trainers read

REPORTERS = ("tensorboard", "jsonl")


def _require_finite(name: str, value: Any) -> None:
    """Configs built in Python skip the YAML reader's check: inf is no rate, size or count either."""
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid(name, f"must be a finite number, got {value!r}", f"set {name} to a finite value")


def _require_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require_finite(name, value)
        if not value > 0:
            raise invalid(name, f"must be > 0, got {value!r}", f"set {name} to a positive value")


def _require_num_proc(data: Any) -> None:
    if data.num_proc is not None and data.num_proc < 1:
        raise invalid(
            "num_proc", f"must be >= 1, got {data.num_proc!r}", "set num_proc to 1 or more, or null"
        )


def _require_non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require_finite(name, value)
        if not value >= 0:
            raise invalid(name, f"must be >= 0, got {value!r}", f"set {name} to 0 or more")


def _require_fraction(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not 0 <= value < 1:
            raise invalid(name, f"must be in [0, 1), got {value!r}", f"set {name} to at least 0 and below 1")


@dataclass
class LoraSettings:
    """LoRA adapters; present (even as ``lora: {}``) means train adapters instead of all weights."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"  # module names, or "all-linear"

    def __post_init__(self) -> None:
        _require_positive(self, "r", "alpha")
        _require_fraction(self, "dropout")
        if not self.target_modules:
            raise invalid(
                "target_modules",
                "is empty, so no layer would get an adapter",
                "list module names such as [q_proj, v_proj], or use all-linear",
            )


@dataclass
class ModelSettings:
    name: str = "tiny-qwen2"  # embedded name, local dir or cached HF id
    attn_implementation: Literal["varlen", "sdpa", "eager", "flex_attention", "flash_attention_2"] = "varlen"
    varlen_kernel: Literal["auto", "sdpa", "torch", "flash_attn"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    seed: int = 0  # init seed for embedded tiny models
    trust_remote_code: bool = False  # run Python code shipped in a model folder (auto_map); never a prompt

    def __post_init__(self) -> None:
        if not self.name:
            raise invalid("name", "is empty", "give an embedded model name, a local directory or a HF id")
        if self.varlen_kernel != "auto" and self.attn_implementation != "varlen":
            raise invalid(
                ("varlen_kernel", "attn_implementation"),
                f"varlen_kernel={self.varlen_kernel!r} only applies to attn_implementation 'varlen', "
                f"but attn_implementation is {self.attn_implementation!r}, so it would be ignored",
                "set attn_implementation to varlen, or varlen_kernel to auto",
            )


@dataclass
class DataSettings:
    train: str = "tiny:sft"  # jsonl/json/parquet path, a datasets dir (save_to_disk), or "tiny:<name>"
    eval: str | None = None
    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    max_length: int = 2048
    truncation: Literal["error", "truncate"] = "error"  # what to do with a sequence longer than max_length
    completion_only_loss: bool = True
    skip_bad_rows: bool = False
    cache_dir: str | None = None  # tokenized sets are cached here; null: padless/ in the datasets cache
    num_proc: int | None = None  # processes that tokenize on a cache miss; null: one per core, at most 8

    def __post_init__(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")
        _require_positive(self, "max_length")
        _require_num_proc(self)


@dataclass
class TrainSettings:
    output_dir: str = "runs/sft"
    seed: int = 42
    num_epochs: float = 1.0
    max_steps: int = -1  # >0 overrides num_epochs
    learning_rate: float = 1e-4
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # >0 overrides warmup_ratio
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # <=0 disables clipping
    gradient_accumulation_steps: int = 1
    batching: Literal["tokens", "packing", "padded"] = "tokens"
    max_tokens_per_batch: int = 4096  # tokens per micro-batch for "tokens" and bin size for "packing"
    batch_size: int = 8  # sequences per micro-batch for "padded" (comparison mode only)
    padding_side: Literal["left", "right"] = "right"  # "padded" mode only
    logging_steps: int = 10
    eval_steps: int = 0  # 0: evaluate only at the end (if data.eval is set)
    eval_generate: bool = False
    eval_max_new_tokens: int = 64
    eval_batch_size: int = 8
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int = 0  # 0: keep all
    resume_from_checkpoint: str | None = None  # path, "latest" (must exist) or "auto" (latest if any)
    overwrite_output_dir: bool = False  # a used output_dir is refused unless resuming or this is true
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or grad norm: stop, or skip the step
    report_to: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    progress_bar: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # console and output_dir/log.txt

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise invalid("output_dir", "is empty", "give a directory for checkpoints and logs, e.g. runs/x")
        _require_positive(
            self,
            "learning_rate",
            "gradient_accumulation_steps",
            "max_tokens_per_batch",
            "batch_size",
            "logging_steps",
            "eval_max_new_tokens",
            "eval_batch_size",
            "adam_epsilon",
        )
        _require_non_negative(
            self, "num_epochs", "warmup_steps", "weight_decay", "eval_steps", "save_steps", "save_total_limit"
        )
        _require_fraction(self, "warmup_ratio", "adam_beta1", "adam_beta2")
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


@dataclass
class SFTConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)

    def __post_init__(self) -> None:
        _check_eval_set(self.data.eval, self.train, "an eval data set")
        if self.data.eval is None and self.train.eval_generate:
            raise invalid(
                ("train.eval_generate", "data.eval"),
                "eval_generate samples completions for eval prompts, but data.eval is not set",
                "set data.eval, or train.eval_generate to false",
            )


# --------------------------------------------------------------------------------------------------
# Preference training: DPO (and its reference-free variants) and reward models


@dataclass
class PreferenceDataSettings:
    train: str = "tiny:preference"  # same sources as DataSettings.train
    eval: str | None = None
    max_length: int = 2048  # per side: prompt + chosen, and prompt + rejected
    truncation: Literal["error", "truncate"] = "error"  # truncate cuts the completion, never the prompt
    skip_bad_rows: bool = False
    cache_dir: str | None = None  # tokenized sets are cached here; null: padless/ in the datasets cache
    num_proc: int | None = None  # processes that tokenize on a cache miss; null: one per core, at most 8

    def __post_init__(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")
        _require_positive(self, "max_length")
        _require_num_proc(self)


@dataclass
class DPOSettings:
    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid only, in [0, 0.5): conservative DPO for noisy labels
    rpo_alpha: float | None = None  # weight of an NLL term on chosen (RPO); null: none
    simpo_gamma: float = 0.5  # SimPO target reward margin; used as gamma / beta inside the sigmoid, like TRL
    reference: Literal["model", "adapters"] = "model"  # adapters: the policy with its LoRA adapters disabled
    ref_model: str | None = None  # null: a frozen copy of model.name
    precompute_ref_logps: bool = False

    def __post_init__(self) -> None:
        _require_positive(self, "beta")
        _require_non_negative(self, "simpo_gamma")
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


@dataclass
class DPOConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: PreferenceDataSettings = field(default_factory=PreferenceDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/dpo", learning_rate=5e-6)
    )
    dpo: DPOSettings = field(default_factory=DPOSettings)

    def __post_init__(self) -> None:
        _check_preference_run(self.data, self.train)
        if self.dpo.reference == "adapters" and self.model.lora is None:
            raise invalid(
                ("dpo.reference", "model.lora"),
                "reference 'adapters' means the policy with its LoRA adapters disabled, but model.lora is "
                "not set, so there are no adapters",
                "add a model.lora section (e.g. model.lora.r=16), or set dpo.reference to model",
            )


@dataclass
class RMSettings:
    margin: bool = False  # add each row's "margin" field to the Bradley-Terry loss (every row must have one)


@dataclass
class RMConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    data: PreferenceDataSettings = field(default_factory=PreferenceDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/rm", learning_rate=1e-4)
    )
    rm: RMSettings = field(default_factory=RMSettings)

    def __post_init__(self) -> None:
        _check_preference_run(self.data, self.train)


# --------------------------------------------------------------------------------------------------
# Online RL: GRPO and PPO


@dataclass
class RLDataSettings:
    train: str = "tiny:rl"  # rows {"prompt": str | messages, ...}; other columns go to the reward functions
    eval: str | None = None
    max_prompt_length: int = 512  # prompts are never truncated: a longer one is a bad row
    chat_template: bool | None = None  # string prompts as a user message; None: when the tokenizer has one
    skip_bad_rows: bool = False
    cache_dir: str | None = None  # tokenized sets are cached here; null: padless/ in the datasets cache
    num_proc: int | None = None  # processes that tokenize on a cache miss; null: one per core, at most 8

    def __post_init__(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")
        _require_positive(self, "max_prompt_length")
        _require_num_proc(self)


@dataclass
class RolloutSettings:
    engine: Literal["hf", "vllm"] = "hf"  # vllm: colocated, needs vLLM and CUDA (checked at start)
    prompts_per_step: int = 16  # prompts per rollout batch
    num_generations: int = 4  # samples per prompt (GRPO group size; PPO usually 1)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: int = 32  # sequences per generate() call
    mask_truncated: bool = True  # completions that hit max_new_tokens without EOS: out of the loss, or kept
    vllm_gpu_memory_utilization: float = 0.3  # engine vllm: share of GPU memory for its weights + KV cache

    def __post_init__(self) -> None:
        _require_positive(
            self, "prompts_per_step", "num_generations", "max_new_tokens", "generation_batch_size"
        )
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
        if not 0 < self.top_p <= 1:
            raise invalid("top_p", f"must be in (0, 1], got {self.top_p!r}", "set top_p to 1.0 or e.g. 0.9")


@dataclass
class RewardSettings:
    """The reward: a weighted sum of ``functions`` (see :mod:`padless.rewards`) and a reward model's score."""

    functions: list[str] = field(default_factory=lambda: ["arithmetic"])  # bundled, module:fn or file.py:fn
    weights: list[float] | None = None  # default 1.0 each; one per function, in order
    model: str | None = None  # a padless reward model checkpoint (score at each sequence's last token)
    model_weight: float = 1.0

    def __post_init__(self) -> None:
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
        if self.weights is not None:
            if len(self.weights) != len(self.functions):
                raise invalid(
                    ("weights", "functions"),
                    f"{len(self.weights)} weight(s) for {len(self.functions)} function(s)",
                    "give one weight per function, in the same order, or null for 1.0 each",
                )
            bad = [w for w in self.weights if not math.isfinite(w)]
            if bad:
                raise invalid("weights", f"must be finite numbers, got {bad[0]!r}", "give finite weights")
        if self.model == "":
            raise invalid("model", "is an empty string", "give a reward model checkpoint, or null for none")
        if not math.isfinite(self.model_weight):
            raise invalid(
                "model_weight", f"must be finite, got {self.model_weight!r}", "give a finite number"
            )
        if self.model is None and self.model_weight != 1.0:
            raise invalid(
                ("model_weight", "model"),
                f"model_weight={self.model_weight} weights a reward model's score, but model is not set, so "
                "it would be ignored",
                "set model to a reward model checkpoint, or leave model_weight at 1.0",
            )


@dataclass
class GRPOSettings:
    beta: float = 0.04  # KL (k3) coefficient; 0 disables the reference model
    epsilon: float = 0.2  # clip range: ratios are clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # asymmetric upper clip (DAPO); default = epsilon
    scale_rewards: bool = True  # divide group-centred rewards by the group std
    loss_normalisation: Literal["token", "sequence"] = "token"
    updates_per_rollout: int = 1  # policy passes over each rollout batch (ratios from stored old log-probs)
    mini_batches_per_rollout: int = 1  # optimizer steps per pass

    def __post_init__(self) -> None:
        _require_non_negative(self, "beta")
        _require_positive(self, "updates_per_rollout", "mini_batches_per_rollout")
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


@dataclass
class PPOSettings:
    value_model: str | None = None  # default: model.name with a fresh scalar head
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05  # per-token KL penalty folded into the reward
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True
    critic_warmup_steps: int = 0  # rollouts that update only the value model first
    updates_per_rollout: int = 1
    mini_batches_per_rollout: int = 1
    value_learning_rate: float | None = None  # default: train.learning_rate

    def __post_init__(self) -> None:
        if self.value_model == "":
            raise invalid(
                "value_model", "is an empty string", "name a model, or null for model.name with a fresh head"
            )
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise invalid(name, f"must be in [0, 1], got {value!r}", f"set {name} to e.g. 1.0 or 0.95")
        for name in ("cliprange", "cliprange_value"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise invalid(name, f"must be in (0, 1), got {value!r}", f"set {name} to e.g. 0.2")
        _require_non_negative(self, "kl_coef", "critic_warmup_steps")
        _require_positive(self, "vf_coef", "updates_per_rollout", "mini_batches_per_rollout")
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


@dataclass
class GRPOConfig:
    """Group Relative Policy Optimization: ``num_generations`` samples per prompt, advantages within groups.

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout of
    ``rollout.prompts_per_step`` prompts gives ``grpo.updates_per_rollout x grpo.mini_batches_per_rollout``
    of them, so a run makes ``max_steps / (updates x mini-batches)`` rollouts.
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    data: RLDataSettings = field(default_factory=RLDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/grpo", learning_rate=1e-5, max_steps=100)
    )
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)

    def __post_init__(self) -> None:
        if self.rollout.num_generations < 2:
            raise invalid(
                "rollout.num_generations",
                f"is {self.rollout.num_generations}, but GRPO's advantages compare the samples of one prompt "
                "with each other, so every group needs at least 2",
                "set rollout.num_generations to 2 or more (e.g. 4 or 8)",
            )
        n_mini = self.grpo.mini_batches_per_rollout
        _check_rl_run(self.data, self.train, self.rollout, "grpo.mini_batches_per_rollout", n_mini)


@dataclass
class PPOConfig:
    """Proximal Policy Optimization with a learned value model (GAE advantages, per-token KL penalty).

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout gives
    ``ppo.updates_per_rollout x ppo.mini_batches_per_rollout`` of them (critic warm-up rollouts included).
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    data: RLDataSettings = field(default_factory=RLDataSettings)
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/ppo", learning_rate=1e-5, max_steps=100)
    )
    rollout: RolloutSettings = field(default_factory=lambda: RolloutSettings(num_generations=1))
    reward: RewardSettings = field(default_factory=RewardSettings)
    ppo: PPOSettings = field(default_factory=PPOSettings)

    def __post_init__(self) -> None:
        n_mini = self.ppo.mini_batches_per_rollout
        _check_rl_run(self.data, self.train, self.rollout, "ppo.mini_batches_per_rollout", n_mini)
