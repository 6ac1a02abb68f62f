"""Example sets: what recipes plan micro-batches from (a length per item) and read them from.

An :class:`ArrowSet` is a tokenized set on disk (:mod:`padless.data.tokenized`), memory-mapped: planning
reads only its ``length`` column, and a micro-batch's items become Python objects only when it runs
(:meth:`ExampleSet.select` gives a sequence that is read each time it is iterated, never kept). An
:class:`InMemory` set is a list of items with the same interface (rows with images, and tests).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import numpy as np

if TYPE_CHECKING:
    import datasets

T = TypeVar("T")
Item = TypeVar("Item", covariant=True)


class ColumnReader(Protocol[Item]):
    """What an :class:`ArrowSet` needs of its task's layout (:class:`padless.data.tokenized.Layout`):
    which stored columns to read, and how items are rebuilt from them."""

    def read_columns(self, stored: list[str]) -> list[str]: ...

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[Item]: ...


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
        self, dataset: datasets.Dataset, layout: ColumnReader[T], source: str, path: Path, cached: bool
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

    def set_meta(self, key: str, values: Sequence[Any]) -> None:
        if len(values) != len(self):
            raise ValueError(f"set_meta({key!r}): {len(values)} values for {len(self)} items")
        self._meta[key] = values


def as_set(items: Sequence[T]) -> ExampleSet[T]:
    """``items`` as an :class:`ExampleSet` (a list is wrapped; a set is returned as it is)."""
    return items if isinstance(items, ExampleSet) else InMemory(items)
