"""Reading raw rows from files, embedded data or ``datasets`` objects, keeping where each row came from.

Every later stage reports problems through :class:`DataError`, whose message names the source, the row, the
field, what was expected and how to fix it, so a bad row in a 100k-row file can be found and fixed in one go.
"""

from __future__ import annotations

import json
import numbers
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import pyarrow as pa

from padless.data import given
from padless.errors import DataError

if TYPE_CHECKING:
    import datasets

T = TypeVar("T")

ACCEPTED_FORMATS = (
    "'tiny:<name>' (embedded data), 'reasoning_gym:<task>' or 'verifiers:<module>:<taskset>' (rows a library "
    "makes), a .jsonl file (one JSON object per line), a .json file (a list of objects, or "
    '{"data": [...]}), a .parquet file, a directory written by datasets\' save_to_disk, or (from Python) a '
    "datasets.Dataset / DatasetDict / IterableDataset or a list of dicts"
)
SKIP_FIX = "Fix the row or set data.skip_bad_rows: true to skip it."
SKIP_CLAUSE = re.compile(r",? or set data\.skip_bad_rows: true to skip (?:it|the row)(?=\.)")
# What to do with a row longer than the length limit: refuse it, or keep its first tokens.
Truncation = Literal["error", "truncate"]


def _content_hash(path: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Row:
    """One raw record and its provenance.

    ``index`` is the 1-based line number for jsonl files (``numbering="line"``) and the 0-based position
    otherwise (``numbering="index"``), so it matches what an editor or ``dataset[i]`` shows.
    """

    data: dict[str, Any]
    source: str
    index: int
    numbering: Literal["line", "index"] = "index"
    skippable: bool = True
    """False for what no ``data.skip_bad_rows`` can skip (an environment's turn): its fixes leave it out"""

    @property
    def where(self) -> str:
        if self.numbering == "line":
            return f"{self.source} row {self.index} (line {self.index})"
        return f"{self.source} row {self.index} (0-based)"

    def error(self, field: str | None, problem: str, *, reason: str, fix: str = SKIP_FIX) -> DataError:
        """A :class:`DataError` about this row: ``"<where>: field '<field>' <problem>. <fix>"``."""
        subject = f"field '{field}' " if field else ""
        if not self.skippable:
            fix = SKIP_CLAUSE.sub("", fix)
        return DataError(
            f"{self.where}: {subject}{problem}. {fix}",
            source=self.source,
            index=self.index,
            field=field,
            reason=reason,
        )


# What of a row holds images (turning them into model inputs is padless.data.images): a text-only model
# reads no image, so its rows are checked here, where rows are read.
PLACEHOLDER = "<image>"
IMAGE_COLUMNS = ("images", "image")
CHAT_FIELDS = ("messages", "prompt", "chosen", "rejected", "completion", "response")


def image_column(row: Row) -> tuple[str | None, list[Any]]:
    """The row's image column (``images``, or ``image`` for one) and its images; ``(None, [])`` if none."""
    for name in IMAGE_COLUMNS:
        value = row.data.get(name)
        if value is None:
            continue
        if name == "image" or not isinstance(value, list):
            value = [value]
        return name, list(value)
    return None, []


def _parts_with_images(value: Any) -> bool:
    """Whether chat messages hold image parts or ``<image>`` placeholders."""
    if not isinstance(value, list):
        return False
    for msg in value:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str) and PLACEHOLDER in content:
            return True
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image" for p in content
        ):
            return True
    return False


def has_images(row: Row) -> bool:
    """Whether a row carries images (an image column, image parts or ``<image>`` placeholders)."""
    return image_column(row)[0] is not None or any(_parts_with_images(row.data.get(f)) for f in CHAT_FIELDS)


def reject_images(row: Row) -> None:
    """Stop on a row with images when the model reads text only (they would be dropped silently)."""
    if has_images(row):
        raise row.error(
            None,
            "has images, but the model reads text only, so they would be ignored",
            reason="image on a text-only model",
            fix="Train a vision-language model (e.g. model.name: tiny-qwen2.5-vl), or remove the images and "
            "<image> placeholders from the data.",
        )


@dataclass
class SkipStats:
    """What ``skip_bad_rows`` dropped, so a run can report it instead of silently shrinking the data."""

    skipped: int = 0
    kept: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    examples_of: list[str] = field(default_factory=list)
    rows_of: dict[str, list[int]] = field(default_factory=dict)  # reason -> its first row numbers

    MAX_EXAMPLES: ClassVar[int] = 5
    MAX_ROWS: ClassVar[int] = 3

    def record(self, error: DataError) -> None:
        self.skipped += 1
        self.reasons[error.reason] += 1
        if len(self.examples_of) < self.MAX_EXAMPLES:
            self.examples_of.append(str(error))
        rows = self.rows_of.setdefault(error.reason, [])
        if error.index is not None and len(rows) < self.MAX_ROWS:
            rows.append(error.index)

    def summary(self) -> str:
        """``skipped 3 of 40 rows: too long (2) at rows 5, 17; not an object (1) at row 9``."""
        if not self.skipped:
            return f"kept all {self.kept} rows"
        causes = []
        for reason, n in self.reasons.most_common():
            rows = self.rows_of.get(reason, [])
            where = f" at row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}" if rows else ""
            causes.append(f"{reason} ({n}){where}{', ...' if n > len(rows) and rows else ''}")
        return f"skipped {self.skipped} of {self.skipped + self.kept} rows: {'; '.join(causes)}"


def good_rows(
    rows: Iterable[Row], make: Callable[[Row], T], skip_bad_rows: bool, stats: SkipStats
) -> list[T]:
    """``make(row)`` of every row, in order: every task's one skip loop. A bad row (:class:`DataError`)
    stops the load, or, with ``skip_bad_rows``, is counted in ``stats`` and left out; kept rows are
    counted there too."""
    out = []
    for row in rows:
        try:
            item = make(row)
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.record(e)
            continue
        out.append(item)
        stats.kept += 1
    return out


def present_fields(row: Row) -> set[str]:
    """The row's fields that hold a value."""
    # datasets/parquet fill a column missing from a row with None, so None counts as absent.
    return {k for k, v in row.data.items() if v is not None}


def type_name(value: Any) -> str:
    """A value's JSON-ish type name for error messages (``null`` for None)."""
    return "null" if value is None else type(value).__name__


# -- chat messages ------------------------------------------------------------------------------------------
# Fields follow the OpenAI / transformers message format: ``content`` is a string or a list of ``text`` /
# ``image`` / ``thinking`` parts; ``tool_calls`` holds ``{"type": "function", "function": {"name",
# "arguments"}}`` calls (or ``{"name", "arguments"}``), arguments an object or a JSON string; reasoning is in
# ``reasoning_content``, ``reasoning`` or ``thinking``. A per-message ``loss`` / ``train`` boolean or a
# ``weight`` of 0 or 1 (the conventions of ms-swift and axolotl datasets) says whether an assistant turn is a
# target; it is read here and never reaches the template.

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TRAIN_FLAGS = ("loss", "train", "weight")
PART_TYPES = ("text", "image", "thinking")


def nonempty_str(row: Row, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise row.error(name, f"must be a string, got {type_name(value)}", reason="wrong type")
    if not value.strip():
        raise row.error(name, "is empty; it must contain text", reason="empty content")
    return value


def check_parts(row: Row, where: str, content: list[Any]) -> None:
    """A list content holds text, image and thinking parts, and at least one of them."""
    if not content:
        raise row.error(
            where, "is an empty list; it must contain text or image parts", reason="empty content"
        )
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise row.error(
                f"{where}[{k}]",
                "must be a {'type': 'text' | 'image' | 'thinking', ...} part, got "
                + (repr(kind) if isinstance(part, dict) else type_name(part)),
                reason="wrong type",
            )
        if kind in ("text", "thinking") and not isinstance(part.get(kind), str):
            raise row.error(
                f"{where}[{k}].{kind}",
                f"must be a string, got {type_name(part.get(kind))}",
                reason="wrong type",
            )


def call_function(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's function (``name``, ``arguments``): the OpenAI form nests it, the flat form is it."""
    return call["function"] if isinstance(call.get("function"), dict) else call


def _check_calls(row: Row, where: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise row.error(where, f"must be a list of tool calls, got {type_name(calls)}", reason="wrong type")
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise row.error(
                at,
                f"must be a {{'type': 'function', 'function': {{'name', 'arguments'}}}} call, got "
                f"{type_name(call)}",
                reason="wrong type",
            )
        at += ".function" if isinstance(call.get("function"), dict) else ""
        fn = call_function(call)
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise row.error(
                f"{at}.name", f"must be the function's name, got {fn.get('name')!r}", reason="bad tool call"
            )
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, (dict, str)):
            raise row.error(
                f"{at}.arguments",
                f"must be an object or a JSON string, got {type_name(arguments)}",
                reason="bad tool call",
            )


def train_flag(row: Row, where: str, message: dict[str, Any]) -> bool | None:
    """Whether the message's own flag makes it a target (``loss`` / ``train``, or ``weight`` 0 or 1); None
    when it has none. Flags that disagree, or a weight between 0 and 1, are refused."""
    said: dict[str, bool] = {}
    for key in TRAIN_FLAGS:
        value = message.get(key)
        if value is None:
            continue
        if key == "weight":
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value not in (0, 1):
                raise row.error(
                    f"{where}.weight",
                    f"must be 0 (not trained) or 1 (trained), got {value!r}: padless trains a turn or "
                    "leaves it out, it does not scale its loss",
                    reason="bad train flag",
                    fix="Set it to 0 or 1, or set data.skip_bad_rows: true to skip the row.",
                )
            said[key] = value == 1
        elif not isinstance(value, bool):
            raise row.error(
                f"{where}.{key}", f"must be true or false, got {type_name(value)}", reason="bad train flag"
            )
        else:
            said[key] = value
    if len(set(said.values())) > 1:
        raise row.error(
            where,
            "has flags that disagree on whether the turn trains: "
            + ", ".join(f"{k}={message[k]!r}" for k in said),
            reason="bad train flag",
            fix="Keep one of them, or set data.skip_bad_rows: true to skip the row.",
        )
    return next(iter(said.values()), None)


def chat_messages(row: Row, name: str, value: Any, *, flags: bool = False) -> list[dict[str, Any]]:
    """Validated copy of a message list, with null-valued keys and empty ``tool_calls`` (schema filler from
    datasets) and the train flags dropped. ``flags``: whether a train flag may stand on the list's assistant
    messages (it is refused where nothing trains, or on other roles)."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type_name(value)
        raise row.error(name, f"must be a list of {{role, content}} dicts, got {got}", reason="wrong type")
    out = []
    for j, msg in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(msg, dict):
            raise row.error(
                where, f"must be a {{role, content}} dict, got {type_name(msg)}", reason="wrong type"
            )
        msg = {k: v for k, v in msg.items() if v is not None and not (k == "tool_calls" and v == [])}
        role = msg.get("role")
        if role is None:
            raise row.error(
                f"{where}.role", f"is missing; it must be one of {', '.join(ROLES)}", reason="missing field"
            )
        if role not in ROLES:
            raise row.error(
                f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}", reason="unknown role"
            )
        if train_flag(row, where, msg) is not None:
            key = next(k for k in TRAIN_FLAGS if k in msg)
            if role != "assistant":
                raise row.error(
                    f"{where}.{key}",
                    f"says whether a turn trains, but messages of role {role!r} are never trained (only "
                    "assistant turns are targets)",
                    reason="train flag on a non-assistant message",
                    fix="Remove the flag, or set data.skip_bad_rows: true to skip the row.",
                )
            if not flags:
                raise row.error(
                    f"{where}.{key}",
                    f"says whether a turn trains, but '{name}' is never trained turn by turn, so it would "
                    "do nothing",
                    reason="train flag with no effect",
                    fix="Remove the flag (per-turn flags belong in SFT 'messages' rows), or set "
                    "data.skip_bad_rows: true to skip the row.",
                )
            msg = {k: v for k, v in msg.items() if k not in TRAIN_FLAGS}
        if "tool_calls" in msg:
            _check_calls(row, f"{where}.tool_calls", msg["tool_calls"])
        for key in REASONING_KEYS:
            if key in msg and not isinstance(msg[key], str):
                raise row.error(
                    f"{where}.{key}", f"must be a string, got {type_name(msg[key])}", reason="wrong type"
                )
        # An assistant turn that only calls tools may have no text; every other message must have some.
        if isinstance(msg.get("content"), list):
            check_parts(row, f"{where}.content", msg["content"])
        elif not (role == "assistant" and msg.get("tool_calls") and not msg.get("content")):
            nonempty_str(row, f"{where}.content", msg.get("content"))
        out.append(msg)
    return out


def turn_flags(row: Row, name: str, value: list[Any]) -> list[bool]:
    """Per message of a list :func:`chat_messages` accepted: whether it is a trained assistant turn (an
    assistant message trains unless its flag says otherwise)."""
    return [
        m.get("role") == "assistant" and train_flag(row, f"{name}[{j}]", m) is not False
        for j, m in enumerate(value)
    ]


def _checked_rows(
    items: list[Any], source: str, numbering: Literal["line", "index"], start: int = 0
) -> list[Row]:
    rows = []
    for i, item in enumerate(items):
        row = Row(item, source, i + start, numbering)
        if not isinstance(item, dict):
            raise DataError(
                f"{row.where}: expected a JSON object (a dict of fields), got {type_name(item)}. "
                'Each row must be an object such as {"messages": [...]} or {"prompt": ..., '
                '"completion": ...}; fix the row.',
                source=source,
                index=row.index,
                reason="not an object",
            )
        rows.append(row)
    return rows


def _parse_line(raw: bytes, lineno: int, source: str) -> Row | None:
    """Line ``lineno`` of a .jsonl file as a row; None for a blank line (skipped, but still counted)."""
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{source} row {lineno} (line {lineno}): not valid UTF-8 ({e.reason} at byte {e.start}). "
            "Re-encode the file as UTF-8.",
            source=source,
            index=lineno,
            reason="invalid UTF-8",
        ) from None
    if not line.strip():
        return None
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{source} row {lineno} (line {lineno}): not valid JSON ({e.msg} at column {e.colno}). "
            "Each line of a .jsonl file must hold exactly one JSON object; fix or remove the line.",
            source=source,
            index=lineno,
            reason="invalid JSON",
        ) from None
    return _checked_rows([item], source, "line", start=lineno)[0]


def _read_jsonl(path: Path, source: str) -> list[Row]:
    # Split on b"\n" only: str.splitlines would also split on U+2028, which JSON allows inside strings.
    rows = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        row = _parse_line(raw, lineno, source)
        if row is not None:
            rows.append(row)
    return rows


def _read_json(path: Path, source: str) -> list[Row]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{source}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). A .json file must "
            'hold a list of objects or {"data": [...]}; for one object per line name the file .jsonl.',
            source=source,
            reason="invalid JSON",
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(
            f'{source}: expected a JSON list of objects or {{"data": [...]}}, got {type_name(obj)}'
            + (f" with keys {sorted(obj)}" if isinstance(obj, dict) else "")
            + ". Wrap the rows in a list.",
            source=source,
            reason="wrong layout",
        )
    return _checked_rows(obj, source, "index")


def _read_parquet(path: Path, source: str) -> list[Row]:
    import pyarrow.parquet as pq

    return _checked_rows(pq.read_table(path).to_pylist(), source, "index")


def _split_of(obj: Any, source: str, split: str) -> datasets.Dataset:
    import datasets

    if isinstance(obj, datasets.DatasetDict):
        if split not in obj:
            raise DataError(
                f"{source}: has no split {split!r}; available splits: {', '.join(obj)}. "
                "Pass one of them as the split.",
                source=source,
                reason="missing split",
            )
        obj = obj[split]
    if not isinstance(obj, datasets.Dataset):
        raise DataError(
            f"{source}: expected a datasets.Dataset or DatasetDict, got {type(obj).__name__}. "
            f"Accepted: {ACCEPTED_FORMATS}.",
            source=source,
            reason="wrong layout",
        )
    return obj


def _dataset_name(ds: Any) -> str:
    name = getattr(getattr(ds, "info", None), "dataset_name", None)
    return f"datasets.{type(ds).__name__}({name})" if name else f"in-memory datasets.{type(ds).__name__}"


SourceKind = Literal["jsonl", "json", "parquet", "datasets", "python"]


@dataclass
class Source:
    """A data source checked to exist and to be of an accepted kind, not yet read.

    ``kind`` is ``"python"`` for the embedded image sets, which are built in memory (PNG bytes in their rows)
    and are only ever read as Python rows.
    """

    name: str  # what rows and messages call it
    kind: SourceKind
    path: Path | None = None
    dataset: datasets.Dataset | None = None
    items: list[Any] | None = None

    def rows(self) -> list[Row]:
        if self.kind == "jsonl":
            return _read_jsonl(self.path, self.name)
        if self.kind == "json":
            return (
                _read_json(self.path, self.name)
                if self.items is None
                else _checked_rows(self.items, self.name, "index")
            )
        if self.kind == "parquet":
            return _read_parquet(self.path, self.name)
        if self.kind == "python":
            return _checked_rows(self.items, self.name, "index")
        return _checked_rows(self.dataset.to_list(), self.name, "index")

    def identity(self) -> str:
        """What changes when the rows may have: a file's path and a hash of its bytes (a file edited in
        place with the same size and time is still a new set; xxh3 reads several GB/s), or a dataset's
        ``datasets`` fingerprint plus its files' sizes and times."""
        if self.path is not None and self.dataset is None:
            return f"{self.kind}:{self.path.resolve()}:{_content_hash(self.path)}"
        if self.items is not None:  # rows handed in from Python
            from datasets.fingerprint import Hasher

            return f"rows:{Hasher.hash(self.items)}"
        files = sorted(f["filename"] for f in self.dataset.cache_files)
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        return f"datasets:{self.dataset._fingerprint}:{stats}"

    def arrow(self, workdir: Path) -> tuple[datasets.Dataset, Literal["line", "index"] | None]:
        """All rows as an Arrow dataset, and how JSON rows are numbered (None: the source is Arrow already).

        JSON sources become two columns, ``index`` (line number or position) and ``line`` (the row's JSON
        text, undecoded), streamed to ``workdir`` without holding the file in memory: each worker then decodes
        its own rows, bad lines keep their line numbers and every row keeps its own types (``datasets``' JSON
        reader would unify one schema over all rows). Parquet files are streamed to an Arrow file so workers
        memory-map it.
        """
        import datasets

        if self.kind == "datasets":
            return self.dataset, None
        path = workdir / "rows.arrow"
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(self.path)
            with pa.ipc.new_stream(str(path), parquet.schema_arrow) as out:
                for batch in parquet.iter_batches():
                    out.write_batch(batch)
            return datasets.Dataset.from_file(str(path)), None
        if self.kind == "jsonl":
            lines, numbering = _jsonl_lines(self.path), "line"
        elif self.kind == "json":
            lines = ((r.index, _json_line(r)) for r in self.rows())
            numbering = "index"
        else:
            raise TypeError(f"{self.name}: rows built in memory are read as Python rows, not as Arrow")
        schema = pa.schema([("index", pa.int64()), ("line", pa.binary())])
        with pa.ipc.new_stream(str(path), schema) as out:
            for chunk in _chunks(lines, 10_000):
                index, text = zip(*chunk, strict=True)
                out.write_batch(
                    pa.record_batch([pa.array(index, pa.int64()), pa.array(text, pa.binary())], schema)
                )
        return datasets.Dataset.from_file(str(path)), numbering


def _json_line(row: Row) -> bytes:
    try:
        return json.dumps(row.data).encode()
    except (TypeError, ValueError) as e:  # a row handed in from Python may hold any object
        raise row.error(
            None,
            f"holds a value that is not JSON ({e})",
            reason="not JSON",
            fix="Keep rows to text, numbers, lists and dicts, or hand in a datasets.Dataset.",
        ) from None


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of every line that is not blank, streamed."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.removesuffix(b"\n")
            if not _blank(raw, lineno):
                yield lineno, raw


def _blank(raw: bytes, lineno: int) -> bool:
    """Whether :func:`_parse_line` skips this line as blank, decoding only lines that do not start with an
    ASCII character (JSON rows start with ``{``); a line that is not valid UTF-8 is not blank (its worker
    reports it)."""
    rest = raw.lstrip()
    if not rest:
        return True
    if rest[0] < 0x80 and not chr(rest[0]).isspace():
        return False
    try:
        return not raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
    except UnicodeDecodeError:
        return False


def open_source(spec: str | Path | datasets.Dataset | datasets.DatasetDict, split: str = "train") -> Source:
    """Check that ``spec`` (without a row slice) names an accepted source; nothing is read yet."""
    name = None
    if isinstance(spec, str) and spec.startswith(given.PREFIX):  # handed to padless.api: a dataset or rows
        name, spec = spec, given.lookup(spec, "data")
        if isinstance(spec, list):
            return Source(name, "json", items=spec)
    if not isinstance(spec, (str, Path)):
        name = name or _dataset_name(spec)
        return Source(name, "datasets", dataset=_split_of(spec, name, split))
    if isinstance(spec, str) and spec.startswith(("reasoning_gym:", "verifiers:")):  # rows a library makes
        from padless.data import procedural

        return Source(spec, "json", items=procedural.rows(spec))
    if isinstance(spec, str) and spec.startswith("tiny:"):
        from padless.tiny import DATASETS, data_path, shapes

        name = spec.removeprefix("tiny:")
        if name in shapes.SPLITS:
            return Source(spec, "python", items=shapes.rows(name))
        if name not in DATASETS:
            valid = ", ".join("tiny:" + d for d in (*DATASETS, *shapes.SPLITS))
            raise DataError(
                f"{spec}: no embedded dataset {name!r}; valid: {valid}.",
                source=spec,
                reason="unknown dataset",
            )
        return Source(spec, "jsonl", path=data_path(name))
    source = str(spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"{source}: no such file or directory. Accepted: {ACCEPTED_FORMATS}.",
            source=source,
            reason="missing file",
        )
    if path.is_dir():
        if not any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
            raise DataError(
                f"{source}: a directory, but not one written by datasets' save_to_disk (no dataset_dict.json "
                f"or state.json inside). Accepted: {ACCEPTED_FORMATS}.",
                source=source,
                reason="wrong layout",
            )
        import datasets

        return Source(source, "datasets", path, _split_of(datasets.load_from_disk(str(path)), source, split))
    kind = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(path.suffix.lower())
    if kind is None:
        raise DataError(
            f"{source}: unsupported file type {path.suffix.lower() or '(no extension)'!r}. "
            f"Accepted: {ACCEPTED_FORMATS}.",
            source=source,
            reason="unsupported format",
        )
    return Source(source, kind, path)


def load_rows(spec: str | Path | datasets.Dataset | datasets.DatasetDict, split: str = "train") -> list[Row]:
    """Read every row of ``spec`` as a dict with its provenance; never touches the network.

    ``split`` only matters for DatasetDicts (a ``save_to_disk`` directory or an in-memory object). A
    trailing ``[start:stop]`` keeps that slice of the rows (``tiny:rl[:16]``), as ``datasets`` splits do.
    A source without a single row is an error: an empty file is never what a run meant to train on.
    """
    source, selected = sliced(spec)
    every = open_source(source, split).rows()
    rows = every[selected]
    if not rows:
        raise no_rows(spec, len(every))
    return rows


def no_rows(spec: Any, total: int = 0) -> DataError:
    """The error for a selection without rows: an empty source, or a slice past its ``total`` rows."""
    source = _dataset_name(spec) if not isinstance(spec, (str, Path)) else str(spec)
    if total:
        name, selected = sliced(spec)
        start, stop = ("" if x is None else x for x in (selected.start, selected.stop))
        return DataError(
            f"{source}: {name} has {total} rows, and the slice [{start}:{stop}] selects none of them; fix: "
            f"slice within its {total} rows (e.g. {name}[:{total}])",
            source=source,
            reason="empty",
        )
    return DataError(
        f"{source}: has no rows (an empty file, or only blank lines); fix: point the data setting at "
        "the file that holds the rows, or fill this one",
        source=source,
        reason="empty",
    )


def sliced(spec: Any) -> tuple[Any, slice]:
    """``tiny:rl[:16]`` or ``data.jsonl[100:200]``: the source and a row slice (as in ``datasets`` splits)."""
    match = re.fullmatch(r"(.+)\[(-?\d*):(-?\d*)\]", spec) if isinstance(spec, str) else None
    if match is None or Path(spec).expanduser().exists():
        return spec, slice(None)
    start, stop = (int(x) if x else None for x in match.group(2, 3))
    return match.group(1), slice(start, stop)


@dataclass(frozen=True)
class RowDecoder:
    """Turns a batch of a source's Arrow rows back into :class:`Row` s; small, so it travels to workers."""

    source: str
    numbering: Literal["line", "index"] | None  # JSON rows and how they are numbered; None: Arrow rows
    positions: range  # Arrow rows: each selected row's position in the source

    def rows(self, batch: pa.Table, indices: Sequence[int]) -> Iterator[Row | DataError]:
        """The batch's rows in order; a line that cannot be read comes as its :class:`DataError`."""
        if self.numbering is None:
            for i, item in zip(indices, batch.to_pylist(), strict=True):
                yield Row(item, self.source, self.positions[i], "index")
            return
        lines = zip(batch.column("index").to_pylist(), batch.column("line").to_pylist(), strict=True)
        for index, raw in lines:
            if self.numbering == "index":  # .json rows, checked when the file was read
                yield Row(json.loads(raw), self.source, index, "index")
                continue
            try:
                row = _parse_line(raw, index, self.source)
            except DataError as e:
                yield e
            else:
                assert row is not None, "blank lines are not stored"
                yield row


@dataclass
class RawRows:
    """The selected rows of a source in Arrow, and how to decode them (see :meth:`Source.arrow`)."""

    dataset: datasets.Dataset
    decoder: RowDecoder

    def __iter__(self) -> Iterator[Row]:
        """Rows in order, read in this process; the first unreadable one raises its :class:`DataError`."""
        table = self.dataset.with_format("arrow")
        for start in range(0, len(table), 1000):
            batch = table[start : start + 1000]
            for item in self.decoder.rows(batch, range(start, start + batch.num_rows)):
                if isinstance(item, DataError):
                    raise item
                yield item


def raw_rows(source: Source, selected: slice, spec: Any, workdir: Path) -> RawRows:
    """The rows ``selected`` of ``source`` in Arrow (``spec``, the setting as given, names an empty
    selection)."""
    dataset, numbering = source.arrow(workdir)
    positions = range(len(dataset))[selected]
    if not positions:
        raise no_rows(spec, len(dataset))
    if len(positions) != len(dataset):
        dataset = dataset.select(positions)
    return RawRows(dataset, RowDecoder(source.name, numbering, positions))
