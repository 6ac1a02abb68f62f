"""Reading raw rows from files, embedded data or ``datasets`` objects, keeping where each row came from.

Every later stage reports problems through :class:`DataError`, whose message names the source, the row, the
field, what was expected and how to fix it, so a bad row in a 100k-row file can be found and fixed in one go.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import datasets

ACCEPTED_FORMATS = (
    "'tiny:<name>' (embedded data), a .jsonl file (one JSON object per line), a .json file (a list of "
    'objects, or {"data": [...]}), a .parquet file, a directory written by datasets\' save_to_disk, or an '
    "in-memory datasets.Dataset / DatasetDict"
)
SKIP_FIX = "Fix the row or set data.skip_bad_rows: true to skip it."


class DataError(ValueError):
    """A problem with the data itself; the message says where it is and how to fix it.

    ``reason`` is a short, stable label (e.g. ``"too long"``) used to count skipped rows by cause.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        index: int | None = None,
        field: str | None = None,
        reason: str = "bad row",
    ) -> None:
        super().__init__(message)
        self.source = source
        self.index = index
        self.field = field
        self.reason = reason


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

    @property
    def where(self) -> str:
        if self.numbering == "line":
            return f"{self.source} row {self.index} (line {self.index})"
        return f"{self.source} row {self.index} (0-based)"

    def error(self, field: str | None, problem: str, *, reason: str, fix: str = SKIP_FIX) -> DataError:
        """A :class:`DataError` about this row: ``"<where>: field '<field>' <problem>. <fix>"``."""
        subject = f"field '{field}' " if field else ""
        return DataError(
            f"{self.where}: {subject}{problem}. {fix}",
            source=self.source,
            index=self.index,
            field=field,
            reason=reason,
        )


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _checked_rows(
    items: list[Any], source: str, numbering: Literal["line", "index"], start: int = 0
) -> list[Row]:
    rows = []
    for i, item in enumerate(items):
        row = Row(item, source, i + start, numbering)
        if not isinstance(item, dict):
            raise DataError(
                f"{row.where}: expected a JSON object (a dict of fields), got {_type_name(item)}. "
                'Each row must be an object such as {"messages": [...]} or {"prompt": ..., '
                '"completion": ...}; fix the row.',
                source=source,
                index=row.index,
                reason="not an object",
            )
        rows.append(row)
    return rows


def _read_jsonl(path: Path, source: str) -> list[Row]:
    # Split on b"\n" only: str.splitlines would also split on U+2028, which JSON allows inside strings.
    rows = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
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
            continue
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
        rows.extend(_checked_rows([item], source, "line", start=lineno))
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
            f'{source}: expected a JSON list of objects or {{"data": [...]}}, got {_type_name(obj)}'
            + (f" with keys {sorted(obj)}" if isinstance(obj, dict) else "")
            + ". Wrap the rows in a list.",
            source=source,
            reason="wrong layout",
        )
    return _checked_rows(obj, source, "index")


def _read_parquet(path: Path, source: str) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow ships with datasets
        import datasets

        items = datasets.Dataset.from_parquet(str(path)).to_list()
    else:
        items = pq.read_table(path).to_pylist()
    return _checked_rows(items, source, "index")


def _from_datasets(obj: Any, source: str, split: str) -> list[Row]:
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
    return _checked_rows(obj.to_list(), source, "index")


def _dataset_name(ds: Any) -> str:
    name = getattr(getattr(ds, "info", None), "dataset_name", None)
    return f"datasets.{type(ds).__name__}({name})" if name else f"in-memory datasets.{type(ds).__name__}"


def load_rows(spec: str | Path | datasets.Dataset | datasets.DatasetDict, split: str = "train") -> list[Row]:
    """Read every row of ``spec`` as a dict with its provenance; never touches the network.

    ``split`` only matters for DatasetDicts (a ``save_to_disk`` directory or an in-memory object). A
    trailing ``[start:stop]`` keeps that slice of the rows (``tiny:rl[:16]``), as ``datasets`` splits do.
    A source without a single row is an error: an empty file is never what a run meant to train on.
    """
    source, selected = _sliced(spec)
    rows = _read_rows(source, split)[selected]
    if not rows:
        source = _dataset_name(spec) if not isinstance(spec, (str, Path)) else str(spec)
        raise DataError(
            f"{source}: has no rows (an empty file, or only blank lines); fix: point the data setting at "
            "the file that holds the rows, or fill this one",
            source=source,
            reason="empty",
        )
    return rows


def _sliced(spec: Any) -> tuple[Any, slice]:
    """``tiny:rl[:16]`` or ``data.jsonl[100:200]``: the source and a row slice (as in ``datasets`` splits)."""
    match = re.fullmatch(r"(.+)\[(-?\d*):(-?\d*)\]", spec) if isinstance(spec, str) else None
    if match is None or Path(spec).expanduser().exists():
        return spec, slice(None)
    start, stop = (int(x) if x else None for x in match.group(2, 3))
    return match.group(1), slice(start, stop)


def _read_rows(spec: str | Path | datasets.Dataset | datasets.DatasetDict, split: str) -> list[Row]:
    if not isinstance(spec, (str, Path)):
        return _from_datasets(spec, _dataset_name(spec), split)
    if isinstance(spec, str) and spec.startswith("tiny:"):
        from padless.tiny import DATASETS, data_path, shapes

        name = spec.removeprefix("tiny:")
        if name in shapes.SPLITS:
            return _checked_rows(shapes.rows(name), spec, "index")
        if name not in DATASETS:
            valid = ", ".join("tiny:" + d for d in (*DATASETS, *shapes.SPLITS))
            raise DataError(
                f"{spec}: no embedded dataset {name!r}; valid: {valid}.",
                source=spec,
                reason="unknown dataset",
            )
        return _read_jsonl(data_path(name), spec)
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

        return _from_datasets(datasets.load_from_disk(str(path)), source, split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, source)
    if suffix == ".json":
        return _read_json(path, source)
    if suffix == ".parquet":
        return _read_parquet(path, source)
    raise DataError(
        f"{source}: unsupported file type {suffix or '(no extension)'!r}. Accepted: {ACCEPTED_FORMATS}.",
        source=source,
        reason="unsupported format",
    )
