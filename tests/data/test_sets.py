"""Example sets: micro-batches read from disk when they run (never kept), meta attached beside the items."""

from __future__ import annotations

from pathlib import Path

from padless.data.sets import InMemory
from padless.data.tokenized import PairLayout, load_set
from padless.tiny import tiny_tokenizer


def _load(spec, layout, tmp_path: Path):
    return load_set(spec, layout, tiny_tokenizer(), cache_dir=tmp_path / "cache")


def test_selections_are_read_when_iterated_and_meta_can_be_attached(tmp_path: Path) -> None:
    pairs, _ = _load("tiny:preference", PairLayout(max_length=2048), tmp_path)
    picked = pairs.select([5, 2, 9])
    first, again = list(picked), list(picked)
    assert first == again and first[0] is not again[0]  # read afresh: nothing is kept in memory
    assert [p.meta["row"] for p in first] == [6, 3, 10]  # jsonl rows are 1-based line numbers
    pairs.set_meta("ref_logps", [(float(i), -float(i)) for i in range(len(pairs))])
    assert [p.meta["ref_logps"] for p in picked] == [(5.0, -5.0), (2.0, -2.0), (9.0, -9.0)]
    listed = InMemory(list(pairs.take([5, 2])))
    listed.set_meta("ref_logps", [(1.0, 1.0), (2.0, 2.0)])
    assert [p.meta["ref_logps"] for p in listed.select([1, 0])] == [(2.0, 2.0), (1.0, 1.0)]
