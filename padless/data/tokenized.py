"""Tokenized sets: rows tokenized once by a batched ``datasets.map``, kept in Arrow on disk, memory-mapped
by every rank and turned into Python objects one micro-batch at a time.

Token ids are int32 (4 bytes a token), loss masks one bit a token, and a process touches only the pages it
reads, which every process of a machine shares through the page cache; a ``length`` column (tokens per item)
is all that planning micro-batches needs. :func:`load_set` is the entry point: it fingerprints the data,
tokenizer and settings, builds the set on a cache miss (:mod:`padless.data.cache`) and returns an
:class:`ArrowSet` with the report of skipped rows.

Each task has one tokenizing driver, its :class:`Layout`, which sits beside the task's rows (``SFTLayout`` in
:mod:`padless.data.sft`, ``PairLayout`` and ``ScoringLayout`` in :mod:`padless.data.preference`,
``PromptLayout`` in :mod:`padless.data.prompts`, ``UnpairedLayout`` in :mod:`padless.data.unpaired`) and
whose fields are the task's data options, each named once. A layout is prepared once (the first rows decide
the format; the tokenizer and, for vision-language models, the processor make the encoder), makes each row's
items, and turns items into columns and back. The Arrow build maps :meth:`Layout.examples` over the rows;
:meth:`Layout.tokenize` runs the very same preparation and per-row code over rows in memory (rows with
images, the embedded image sets, rows a caller holds), so both paths give the same examples and the same
errors. Errors are not raised inside the workers: a bad row becomes a row of error columns, and once the map
is done the error the in-memory driver would have raised first is raised (any unreadable line, then the
first bad row), or the bad rows are counted as skipped, in row order, whatever the number of processes.

What recipes plan micro-batches from is an :class:`ExampleSet`: an :class:`ArrowSet` reads only its
``length`` column to plan, and a micro-batch's items become Python objects only when it runs
(:meth:`ExampleSet.select` gives a sequence read each time it is iterated, never kept); an
:class:`InMemory` set is a list with the same interface. Rows with images (vision-language models) and the
embedded image sets stay in memory: their items hold pixel tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, overload

import numpy as np
import pyarrow.compute as pc

from padless.data import cache
from padless.data.records import (
    DataError,
    RawRows,
    Row,
    SkipStats,
    good_rows,
    no_rows,
    open_source,
    raw_rows,
    sliced,
)
from padless.faults import doing

if TYPE_CHECKING:
    import datasets

    from padless.data.images import ImageInputs

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_ROWS_PER_PROCESS = 2000  # below this a worker process costs more than it saves
MAX_PROCESSES = 8  # the default: one per core, at most this many
PROGRESS_ROWS = 10_000  # sets this big show datasets' progress bars while they build
READ, FATAL, SKIPPED = 0, 1, 2  # error_kind: an unreadable line, an error to raise, a row to skip


# --------------------------------------------------------------------------------------------------------
# Layouts: one task's items as columns


class Layout(ABC, Generic[T]):
    """One task's tokenizing driver: how its items are made from rows (its dataclass fields are the task's
    data options), stored in columns and read back.

    Every set also has ``row`` (the row's number in its source) and ``length`` (tokens of the item).
    """

    name: ClassVar[str]
    skip_bad_rows: bool

    def settings(self) -> dict[str, Any]:
        """The options, which make the set's content (part of its fingerprint): the layout's public fields."""
        names = (f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]
        return {n: getattr(self, n) for n in names if not n.startswith("_")}

    @abstractmethod
    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        """Decide what the first rows decide (the format...) and build the encoder, in the main process.
        ``images``: the model's image side (vision-language models; their rows are tokenized in memory)."""

    def store(self, raw: RawRows) -> None:
        """Decide what the stored columns depend on besides the options (a source's own column types), before
        an Arrow build; nothing by default."""

    @abstractmethod
    def examples(self, row: Row) -> list[T]:
        """One row's items (one, unless the layout makes several of a row, as SFT's per-turn mode does); a
        bad row raises :class:`DataError`. After :meth:`prepare`."""

    def tokenize(
        self, rows: Sequence[Row], tokenizer: Any, images: ImageInputs | None = None
    ) -> tuple[list[T], SkipStats]:
        """The items of ``rows``, tokenized in memory, row by row: bad rows raise :class:`DataError`, or with
        ``skip_bad_rows`` are counted in the returned :class:`SkipStats`; template and tokenizer problems
        raise whatever the setting, as in the Arrow build."""
        stats = SkipStats()
        if not rows:
            return [], stats
        self.prepare(rows, tokenizer, images)
        made = good_rows(rows, self.examples, self.skip_bad_rows, stats)
        return [item for items in made for item in items], stats

    @abstractmethod
    def columns(self, item: T) -> dict[str, Any]:
        """The item's own columns."""

    @abstractmethod
    def features(self) -> dict[str, Any]:
        """``datasets`` features of :meth:`columns` (after :meth:`prepare`)."""

    @abstractmethod
    def read_columns(self, stored: list[str]) -> list[str]:
        """Which of a stored set's columns :meth:`decode` reads, besides ``row``."""

    @abstractmethod
    def decode(self, columns: dict[str, list[Any]], source: str) -> list[T]:
        """Items back from a batch of columns."""

    def shared(self, dataset: datasets.Dataset) -> np.ndarray:
        """Tokens per item that a tree row computes once although its sequences all hold them
        (:attr:`ExampleSet.shared`); none unless the layout's items share a prompt."""
        return np.zeros(len(dataset), dtype=np.int64)


def ids_feature() -> Any:
    """The ``datasets`` feature of a column of token ids (int32)."""
    import datasets

    return datasets.List(datasets.Value("int32"))


# --------------------------------------------------------------------------------------------------------
# Example sets: what recipes plan from and read micro-batches from


class ExampleSet(Sequence[T]):
    """Items with their ``lengths`` (tokens per item), to plan micro-batches from without reading items.

    :meth:`select` gives a micro-batch's items as a sequence to read when the micro-batch runs.
    """

    lengths: np.ndarray

    @abstractmethod
    def take(self, indices: Sequence[int]) -> list[T]:
        """The items at ``indices``, in memory."""

    @abstractmethod
    def select(self, indices: Sequence[int]) -> Sequence[T]:
        """The items at ``indices``, read when iterated."""

    @property
    @abstractmethod
    def targets(self) -> np.ndarray:
        """Trained predictions per example (:attr:`Example.num_targets`); examples only."""

    @abstractmethod
    def set_meta(self, key: str, values: Sequence[Any]) -> None:
        """Give item ``i`` ``meta[key] = values[i]`` (e.g. precomputed reference log-probs)."""

    @property
    @abstractmethod
    def shared(self) -> np.ndarray:
        """Tokens per item that its sequences share ahead of their first trained prediction (a preference
        pair's prompt, less its last token), which a tree row (:mod:`padless.forward.tree`) computes once:
        an item's tree tokens are ``lengths - shared``."""

    def __len__(self) -> int:
        return len(self.lengths)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        return self.take([range(len(self))[i]])[0]

    def __iter__(self) -> Iterator[T]:
        for start in range(0, len(self), 1000):
            yield from self.take(range(start, min(start + 1000, len(self))))


class InMemory(ExampleSet[T]):
    """A list of items (the in-memory path, and what tests build by hand)."""

    def __init__(self, items: Sequence[T]) -> None:
        self.items = list(items)
        self.lengths = np.array([len(x) for x in self.items], dtype=np.int64)

    def take(self, indices: Sequence[int]) -> list[T]:
        return [self.items[i] for i in indices]

    def select(self, indices: Sequence[int]) -> list[T]:
        return self.take(indices)

    @property
    def targets(self) -> np.ndarray:
        return np.array([x.num_targets for x in self.items], dtype=np.int64)

    def set_meta(self, key: str, values: Sequence[Any]) -> None:
        for item, value in zip(self.items, values, strict=True):
            item.meta[key] = value

    @property
    def shared(self) -> np.ndarray:
        return np.array([getattr(x, "shared_tokens", 0) for x in self.items], dtype=np.int64)


class _Selection(Sequence[T]):
    """Some items of an :class:`ArrowSet`, read from Arrow each time they are iterated (never kept)."""

    def __init__(self, parent: ArrowSet[T], indices: Sequence[int]) -> None:
        self.parent, self.indices = parent, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.parent.take(self.indices[i])
        return self.parent.take([self.indices[i]])[0]

    def __iter__(self) -> Iterator[T]:
        return iter(self.parent.take(self.indices))


class ArrowSet(ExampleSet[T]):
    """A tokenized set on disk, memory-mapped; items are rebuilt from their columns when read."""

    def __init__(
        self, dataset: datasets.Dataset, layout: Layout[T], source: str, path: Path, cached: bool
    ) -> None:
        """``path``: the set's folder; ``cached``: whether it was there already (not built by this call)."""
        self.dataset, self.layout, self.source, self.path, self.cached = dataset, layout, source, path, cached
        self.lengths = dataset.data.column("length").to_numpy()
        read = layout.read_columns(dataset.column_names)
        self._columns = dataset.with_format("arrow").select_columns(["row", *read])
        self._meta: dict[str, Sequence[Any]] = {}

    def take(self, indices: Sequence[int]) -> list[T]:
        indices = [int(i) for i in indices]
        if not indices:
            return []
        items = self.layout.decode(self._columns[indices].to_pydict(), self.source)
        for key, values in self._meta.items():
            for i, item in zip(indices, items, strict=True):
                item.meta[key] = values[i]
        return items

    def select(self, indices: Sequence[int]) -> _Selection[T]:
        return _Selection(self, indices)

    @property
    def targets(self) -> np.ndarray:
        return self.dataset.data.column("targets").to_numpy()

    @property
    def shared(self) -> np.ndarray:
        return self.layout.shared(self.dataset)

    def set_meta(self, key: str, values: Sequence[Any]) -> None:
        if len(values) != len(self):
            raise ValueError(f"set_meta({key!r}): {len(values)} values for {len(self)} items")
        self._meta[key] = values


def as_set(items: Sequence[T]) -> ExampleSet[T]:
    """``items`` as an :class:`ExampleSet` (a list is wrapped; a set is returned as it is)."""
    return items if isinstance(items, ExampleSet) else InMemory(items)


# --------------------------------------------------------------------------------------------------------
# Building a set: the map, the errors, the folder


def _error_features() -> dict[str, Any]:
    import datasets

    string = datasets.Value("string")
    return {
        "error_kind": datasets.Value("int8"),
        "error_type": string,
        "error": string,
        "error_field": string,
        "error_reason": string,
    }


class _Tokenize:
    """The batched map function: one output row per row read, error columns set on bad rows.

    Rows are handled in order within a worker's share. After the share's first error that stops the run,
    rows are only read (an unreadable line later still wins: the row-by-row path reads the whole file
    before it tokenizes); after an unreadable line nothing more matters.
    """

    def __init__(self, raw: RawRows, layout: Layout[Any], names: list[str]) -> None:
        self.decoder, self.layout, self.names = raw.decoder, layout, names
        self.failed = self.stopped = False

    def __call__(self, batch: Any, indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.names}
        for item in self.decoder.rows(batch, indices):
            if self.stopped:
                break
            if isinstance(item, DataError):
                self._error(out, item.index, READ, item)
                self.stopped = True
            elif not self.failed:
                try:
                    examples = self.layout.examples(item)
                except DataError as e:
                    self._error(out, item.index, SKIPPED if self.layout.skip_bad_rows else FATAL, e)
                except ValueError as e:  # the template or the tokenizer: no row can fix it
                    self._error(out, item.index, FATAL, e)
                else:
                    for example in examples:
                        record = {"row": item.index, "length": len(example), **self.layout.columns(example)}
                        self._append(out, record)
        return out

    def _error(self, out: dict[str, list[Any]], index: int | None, kind: int, error: ValueError) -> None:
        self.failed = self.failed or kind != SKIPPED
        record = cache.error_record(error)
        attrs = record["attrs"]
        self._append(
            out,
            {
                "row": index,
                "error_kind": kind,
                "error_type": record["type"],
                "error": record["message"],
                "error_field": attrs.get("field"),
                "error_reason": attrs.get("reason"),
            },
        )

    def _append(self, out: dict[str, list[Any]], record: dict[str, Any]) -> None:
        for name, column in out.items():
            column.append(record.get(name))


def _error(record: dict[str, Any], source: str) -> ValueError:
    """An error row of the map back as the exception the in-memory driver raises."""
    attrs = {"source": source, "index": record["row"], "field": record["error_field"]}
    attrs["reason"] = record["error_reason"]
    return cache.error_from({"type": record["error_type"], "message": record["error"], "attrs": attrs})


def default_processes() -> int:
    """One per core this process may run on, at most :data:`MAX_PROCESSES`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_PROCESSES)


def _build(
    raw: RawRows, layout: Layout[Any], out: Path, workdir: Path, num_proc: int | None
) -> dict[str, Any]:
    """Tokenize ``raw`` into a set saved at ``out``; raise what the in-memory driver would raise first.
    Returns what to record about the build."""
    started = time.perf_counter()
    rows = len(raw.dataset)
    procs = max(1, min(num_proc or default_processes(), rows // MIN_ROWS_PER_PROCESS))
    with _progress_bars(rows >= PROGRESS_ROWS):
        mapped = _map(raw, layout, procs, workdir)
        stats, kept = _kept(mapped, raw.decoder.source)
        tokens = pc.sum(mapped.data.column("length"), min_count=0).as_py()  # bad rows' lengths are null
        kept.save_to_disk(str(out), num_shards=None if len(kept) else 1)  # an empty set still gets a file
    return {
        "rows": len(kept),  # examples saved (per-turn mode makes several of a row)
        "tokens": tokens,
        "processes": procs,
        "build_s": round(time.perf_counter() - started, 3),
        "stats": {
            "skipped": stats.skipped,
            "kept": stats.kept,
            "reasons": list(stats.reasons.items()),
            "examples_of": stats.examples_of,
            "rows_of": stats.rows_of,
        },
    }


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """``datasets``' progress bars for sets big enough to take a while; small ones build quietly."""
    import datasets

    change = not show and datasets.is_progress_bar_enabled()
    if change:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if change:
            datasets.enable_progress_bars()


def _map(raw: RawRows, layout: Layout[Any], procs: int, workdir: Path) -> datasets.Dataset:
    """Every row through :class:`_Tokenize`, by ``procs`` processes, each on a contiguous share."""
    import datasets

    features = {"row": datasets.Value("int64"), "length": datasets.Value("int32"), **layout.features()}
    features |= _error_features()
    mapped = raw.dataset.with_format("arrow").map(
        _Tokenize(raw, layout, list(features)),
        batched=True,
        with_indices=True,
        remove_columns=raw.dataset.column_names,
        features=datasets.Features(features),
        num_proc=procs if procs > 1 else None,
        cache_file_name=str(workdir / "map.arrow"),
        load_from_cache_file=False,
        new_fingerprint=f"padless-{layout.name}-{os.getpid()}",
        desc=f"padless: tokenizing {raw.decoder.source}",
    )
    return mapped.with_format(None)


def _kept(mapped: datasets.Dataset, source: str) -> tuple[SkipStats, datasets.Dataset]:
    """The rows to keep and the skip report; raises the error that stops the run, if there is one."""
    errors = list(_error_features())
    bad = np.flatnonzero(mapped.data.column("error_kind").is_valid().to_numpy(zero_copy_only=False))
    stats = SkipStats()
    if bad.size:
        records = mapped.select(bad).select_columns(["row", *errors]).to_list()
        read = [r for r in records if r["error_kind"] == READ]
        stop = read or [r for r in records if r["error_kind"] == FATAL]
        if stop:
            raise _error(stop[0], source)
        for record in records:
            stats.record(_error(record, source))
    kept = mapped.remove_columns(errors)
    if bad.size:
        kept = kept.select(np.setdiff1d(np.arange(len(kept)), bad))
    good = pc.filter(mapped.data.column("row"), mapped.data.column("error_kind").is_null())
    stats.kept = pc.count_distinct(good).as_py()  # rows, not examples (a row makes several per turn)
    return stats, kept


def _stats(saved: dict[str, Any]) -> SkipStats:
    stats = SkipStats(
        saved["skipped"], saved["kept"], examples_of=saved["examples_of"], rows_of=saved["rows_of"]
    )
    for reason, n in saved["reasons"]:
        stats.reasons[reason] = n
    return stats


def load_set(
    spec: Any,
    layout: Layout[T],
    tokenizer: Any,
    *,
    images: ImageInputs | None = None,
    cache_dir: str | Path | None = None,
    num_proc: int | None = None,
    split: str = "train",
) -> tuple[ExampleSet[T], SkipStats]:
    """The tokenized set of ``spec`` (a data setting: a file, ``tiny:`` name or ``datasets`` object, with an
    optional ``[start:stop]``) and what ``skip_bad_rows`` dropped from it.

    Built once per fingerprint into ``cache_dir`` (default: ``padless/`` in the ``datasets`` cache) by
    ``num_proc`` processes (default: one per core, at most 8, and at most one per 2,000 rows), then
    memory-mapped. With ``images`` (a vision-language model), and for the embedded image sets, the same
    layout tokenizes the rows in memory (:meth:`Layout.tokenize`).
    """
    source_spec, selected = sliced(spec)
    source = open_source(source_spec, split)
    if images is not None or source.kind == "python":
        every = source.rows()
        rows = every[selected]
        if not rows:
            raise no_rows(spec, len(every))
        items, stats = layout.tokenize(rows, tokenizer, images)
        return InMemory(items), stats
    settings = layout.settings()
    key = cache.digest(
        {
            "layout": layout.name,
            "settings": settings,
            "spec": str(spec),
            "split": split,
            "data": source.identity(),
            "tokenizer": cache.tokenizer_identity(tokenizer),
            "code": cache.code_identity(),
            "versions": cache.versions(),
        }
    )
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache.default_root()
    path = root / f"{layout.name}-{key}"

    def build(out: Path) -> None:
        workdir = out / "work"
        workdir.mkdir()
        try:
            raw = raw_rows(source, selected, spec, workdir)
            layout.prepare(raw, tokenizer)
            layout.store(raw)
            log.info("data %s: not in the cache; tokenizing %d rows into %s", spec, len(raw.dataset), path)
            done = _build(raw, layout, out, workdir, num_proc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        meta = {
            "layout": layout.name,
            "source": str(spec),
            "settings": settings,
            "versions": cache.versions(),
            "files": cache.files_of(out),
        }
        (out / cache.META_FILE).write_text(json.dumps(meta | done, indent=1, ensure_ascii=False))

    with doing(f"building the data cache of data {spec}", root, setting="data.cache_dir"):
        hit = cache.load_or_build(path, build, f"data {spec}")
    with doing(f"reading the data cache of data {spec}", path, setting="data.cache_dir"):
        try:
            return _open(path, layout, source.name, spec, hit)
        except Exception as e:
            damage = cache.is_damage(e)
            if damage is None:
                raise
            cache.set_aside(path, damage)
    with doing(f"rebuilding the data cache of data {spec}", root, setting="data.cache_dir"):
        cache.load_or_build(path, build, f"data {spec}")
    with doing(f"reading the data cache of data {spec}", path, setting="data.cache_dir"):
        return _open(path, layout, source.name, spec, False)


def _open(path: Path, layout: Layout[T], source: str, spec: Any, hit: bool) -> tuple[ArrowSet[T], SkipStats]:
    import datasets

    meta = json.loads((path / cache.META_FILE).read_text())
    cache.check_files(path, meta["files"])
    dataset = datasets.load_from_disk(str(path), keep_in_memory=False)
    if len(dataset) != meta["rows"]:
        raise cache.Damaged(f"{len(dataset)} rows, {meta['rows']} recorded")
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    how = "cache hit" if hit else f"built in {meta['build_s']:.1f} s by {meta['processes']} process(es)"
    log.info(
        "data %s: tokenized set %s (%s; %s rows, %s tokens, %.1f MB)",
        spec,
        path,
        how,
        f"{meta['rows']:,}",
        f"{meta['tokens']:,}",
        size / 1e6,
    )
    return ArrowSet(dataset, layout, source, path, hit), _stats(meta["stats"])
