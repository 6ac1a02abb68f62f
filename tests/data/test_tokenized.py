"""Tokenized sets on disk give the very examples, errors and skip reports of the row-by-row drivers, are
built once per fingerprint, and are rebuilt when the data, the tokenizer or a setting changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from padless.data import (
    ChatTemplateError,
    DataError,
    load_rows,
    tokenize_preference,
    tokenize_prompts,
    tokenize_sft,
)
from padless.data import tokenized as tk
from padless.data.preference import PairLayout, ScoringLayout
from padless.data.prompts import PromptLayout
from padless.data.sft import SFTLayout
from padless.data.tokenized import ArrowSet, InMemory, load_set
from padless.data.unpaired import UnpairedLayout
from padless.tiny import tiny_tokenizer

TOK = tiny_tokenizer()


@pytest.fixture(autouse=True)
def _small_shares(monkeypatch) -> None:
    """Let a few dozen rows be shared out between worker processes, as a big set would be."""
    monkeypatch.setattr(tk, "MIN_ROWS_PER_PROCESS", 20)


def _jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _load(spec: Any, layout: Any, tmp_path: Path, tokenizer: Any = TOK, processes: int = 1):
    return load_set(spec, layout, tokenizer, cache_dir=tmp_path / "cache", num_proc=processes)


def _raised(fn: Any) -> BaseException:
    with pytest.raises(ValueError) as info:
        fn()
    return info.value


def _same_error(got: BaseException, want: BaseException) -> None:
    assert type(got) is type(want)
    assert str(got) == str(want)
    for attr in ("source", "index", "field", "reason"):
        assert getattr(got, attr, None) == getattr(want, attr, None), attr


def _same_stats(got: Any, want: Any) -> None:
    assert (got.kept, got.skipped, got.summary()) == (want.kept, want.skipped, want.summary())
    assert (got.examples_of, got.rows_of) == (want.examples_of, want.rows_of)


# -- the same examples -------------------------------------------------------------------------------------

REFERENCES = {
    "sft": (
        "tiny:sft",
        lambda: SFTLayout(max_length=1024),
        lambda rows: tokenize_sft(rows, TOK, max_length=1024),
    ),
    "prompt-completion": (
        "tiny:sft_prompt_completion",
        lambda: SFTLayout(max_length=96, truncation="truncate", completion_only_loss=False),
        lambda rows: tokenize_sft(
            rows, TOK, max_length=96, truncation="truncate", completion_only_loss=False
        ),
    ),
    "preference": (
        "tiny:preference",
        lambda: PairLayout(max_length=2048),
        lambda rows: tokenize_preference(rows, TOK, max_length=2048),
    ),
    "rl": (
        "tiny:rl",
        lambda: PromptLayout(max_prompt_length=512),
        lambda rows: tokenize_prompts(rows, TOK, max_prompt_length=512),
    ),
}


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("name", list(REFERENCES))
def test_same_examples_as_the_row_by_row_driver(name: str, processes: int, tmp_path: Path) -> None:
    spec, layout, driver = REFERENCES[name]
    got, stats = _load(spec, layout(), tmp_path, processes=processes)
    want, want_stats = driver(load_rows(spec))
    assert isinstance(got, ArrowSet) and len(got) == len(want) > 100
    assert list(got) == want  # every token, mask, meta (row, source, side) and field
    assert got.lengths.tolist() == [len(x) for x in want]
    _same_stats(stats, want_stats)


def test_scoring_and_unpaired_rows_from_arrow_are_the_in_memory_items(tmp_path: Path) -> None:
    """The layouts without a trainer test of their own through the cache: scoring rows, KTO's unpaired
    completions, and KTO reading preference pairs."""
    pairs = [r.data for r in load_rows("tiny:preference[:40]")]
    rows = [
        {"prompt": p["prompt"], "response": p["chosen"], "completion": p[side], "label": side == "chosen"}
        for i, p in enumerate(pairs)
        for side in (("chosen", "rejected")[i % 2],)
    ]
    path = str(_jsonl(tmp_path / "scored.jsonl", rows))
    for spec, layout in (
        (path, lambda: ScoringLayout(max_length=2048)),
        (path, lambda: UnpairedLayout(max_length=2048)),
        ("tiny:preference[:40]", lambda: UnpairedLayout(max_length=2048)),
    ):
        got, stats = _load(spec, layout(), tmp_path)
        want, want_stats = layout().tokenize(load_rows(spec), TOK)
        assert isinstance(got, ArrowSet) and len(got) == len(want) >= 40
        assert list(got) == want
        _same_stats(stats, want_stats)
    assert {e.meta["desirable"] for e in got} == {True, False} and len(got) == 80
    with pytest.raises(ValueError, match="text only"):
        UnpairedLayout(max_length=2048).tokenize(load_rows(path), TOK, images=object())  # type: ignore[arg-type]


def test_skipped_rows_and_their_report_match_in_order(tmp_path: Path) -> None:
    good = [r.data for r in load_rows("tiny:sft")[:60]]
    lines: list[Any] = list(good)
    lines[3] = {"messages": "not a list"}
    lines[25] = {"text": "x " * 2500}  # too long
    lines[40] = {"prompt": "no completion"}  # missing field
    lines[41] = "   "  # blank: skipped but counted in line numbers
    lines[55] = {"messages": [{"role": "pilot", "content": "hi"}]}
    path = _jsonl(tmp_path / "mixed.jsonl", lines)
    layout = SFTLayout(max_length=2048, skip_bad_rows=True)
    got, stats = _load(str(path), layout, tmp_path, processes=2)
    want, want_stats = tokenize_sft(load_rows(path), TOK, max_length=2048, skip_bad_rows=True)
    assert want_stats.skipped == 4
    assert list(got) == want
    _same_stats(stats, want_stats)


def test_margins_are_stored_and_kept_on_request(tmp_path: Path) -> None:
    rows = [
        r.data | ({"margin": i / 4} if i % 3 else {}) for i, r in enumerate(load_rows("tiny:preference")[:30])
    ]
    path = _jsonl(tmp_path / "pairs.jsonl", rows)
    kept, _ = _load(str(path), PairLayout(max_length=2048), tmp_path)
    assert list(kept) == tokenize_preference(load_rows(path), TOK, max_length=2048)[0]
    assert kept[4].meta["margin"] == 1.0 and "margin" not in kept[3].meta
    dropped, _ = _load(str(path), PairLayout(max_length=2048, keep_margin=False), tmp_path)
    assert all("margin" not in p.meta for p in dropped)
    error = _raised(lambda: _load(str(path), PairLayout(max_length=2048, require_margin=True), tmp_path))
    want = _raised(lambda: tokenize_preference(load_rows(path), TOK, max_length=2048, require_margin=True))
    _same_error(error, want)


@pytest.mark.parametrize("kind", ["parquet", "datasets", "json"])
def test_rl_fields_keep_their_values_from_any_source(kind: str, tmp_path: Path) -> None:
    rows = [
        {"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3, "tags": ["add", str(i)]}
        | ({"note": "only here"} if i == 5 else {} if kind == "json" else {"note": None})
        for i in range(12)
    ]
    if kind == "parquet":
        spec: Any = tmp_path / "rl.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(spec))
        spec = str(spec)
    elif kind == "datasets":
        spec = datasets.Dataset.from_list(rows)
    else:
        spec = tmp_path / "rl.json"
        spec.write_text(json.dumps(rows))
        spec = str(spec)
    got, _ = _load(spec, PromptLayout(max_prompt_length=64), tmp_path)
    want, _ = tokenize_prompts(load_rows(spec), TOK, max_prompt_length=64)
    assert list(got) == want
    assert got[5].fields["note"] == "only here" and got[5].fields["level"] == 2


def test_row_slices_number_rows_in_the_source(tmp_path: Path) -> None:
    got, _ = _load("tiny:rl[10:14]", PromptLayout(max_prompt_length=512), tmp_path)
    want, _ = tokenize_prompts(load_rows("tiny:rl[10:14]"), TOK, max_prompt_length=512)
    assert list(got) == want and [p.meta["row"] for p in got] == [11, 12, 13, 14]
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"text": f"row {i}"} for i in range(8)]).to_parquet(str(parquet))
    texts, _ = _load(f"{parquet}[-3:]", SFTLayout(max_length=64), tmp_path)
    assert [e.meta["row"] for e in texts] == [5, 6, 7]


# -- the same errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2])
def test_the_first_bad_row_stops_the_run_with_the_drivers_message(processes: int, tmp_path: Path) -> None:
    lines: list[Any] = [r.data for r in load_rows("tiny:sft")[:60]]
    lines[45] = {"messages": [{"role": "user"}]}  # in the second worker's share
    lines[7] = {"messages": [{"role": "user", "content": 3}]}
    path = _jsonl(tmp_path / "bad.jsonl", lines)
    error = _raised(lambda: _load(str(path), SFTLayout(max_length=2048), tmp_path, processes=processes))
    _same_error(error, _raised(lambda: tokenize_sft(load_rows(path), TOK, max_length=2048)))
    assert error.index == 8 and error.field == "messages[0].content"
    assert not list((tmp_path / "cache").glob("sft-*"))  # a failed build leaves no set


@pytest.mark.parametrize("processes", [1, 2])
def test_an_unreadable_line_wins_over_an_earlier_bad_row(processes: int, tmp_path: Path) -> None:
    """The row-by-row path reads the whole file before it tokenizes, so a broken line anywhere is what it
    reports first."""
    lines: list[Any] = [r.data for r in load_rows("tiny:sft")[:60]]
    lines[2] = {"messages": "not a list"}
    lines[50] = '{"messages": [oops'
    lines[55] = "[1, 2]"
    path = _jsonl(tmp_path / "broken.jsonl", lines)
    for skip in (False, True):
        layout = SFTLayout(max_length=2048, skip_bad_rows=skip)
        error = _raised(lambda layout=layout: _load(str(path), layout, tmp_path, processes=processes))
        want = _raised(lambda: load_rows(path))
        _same_error(error, want)
        assert error.index == 51 and "not valid JSON" in str(error)


def test_template_problems_stop_the_run_even_when_skipping(tmp_path: Path) -> None:
    bare = tiny_tokenizer()
    bare.chat_template = None
    layout = SFTLayout(max_length=2048, skip_bad_rows=True)
    error = _raised(lambda: _load("tiny:sft[:30]", layout, tmp_path, tokenizer=bare, processes=1))
    want = _raised(
        lambda: tokenize_sft(load_rows("tiny:sft[:30]"), bare, max_length=2048, skip_bad_rows=True)
    )
    assert isinstance(error, ChatTemplateError)
    _same_error(error, want)


def test_sources_without_rows_or_of_unknown_kinds_are_refused_like_load_rows(tmp_path: Path) -> None:
    for name, content in (("empty.jsonl", "\n \n"), ("d.csv", "a,b\n"), ("wrong.json", '{"rows": 1}')):
        path = tmp_path / name
        path.write_text(content)
        error = _raised(lambda path=path: _load(str(path), SFTLayout(max_length=64), tmp_path))
        _same_error(error, _raised(lambda path=path: load_rows(path)))
        assert isinstance(error, DataError)


# -- the cache ---------------------------------------------------------------------------------------------


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """Rows the layouts tokenized in this process (the map runs here with one process)."""
    calls: list[int] = []
    for cls in (SFTLayout, PairLayout, PromptLayout):
        original = cls.examples

        def examples(self: Any, row: Any, original: Any = original) -> Any:
            calls.append(row.index)
            return original(self, row)

        monkeypatch.setattr(cls, "examples", examples)
    return calls


def test_a_second_load_reads_the_cache_without_tokenizing(tmp_path: Path, encoded: list[int]) -> None:
    first, stats = _load("tiny:sft", SFTLayout(max_length=1024), tmp_path)
    assert len(encoded) == 400
    second, again = _load("tiny:sft", SFTLayout(max_length=1024), tmp_path)
    assert len(encoded) == 400, "the cached set was tokenized again"
    assert not first.cached and second.cached
    assert second.path == first.path and list(second) == list(first)
    _same_stats(again, stats)
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no leftovers beside the one set


def test_any_change_of_input_rebuilds(tmp_path: Path, encoded: list[int]) -> None:
    rows = [r.data for r in load_rows("tiny:sft")[:20]]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    base, _ = _load(str(path), SFTLayout(max_length=1024), tmp_path)
    built = len(encoded)

    def rebuilt(layout: Any = None, tokenizer: Any = TOK) -> Any:
        before = len(encoded)
        got, _ = _load(str(path), layout or SFTLayout(max_length=1024), tmp_path, tokenizer=tokenizer)
        assert len(encoded) > before and got.path != base.path
        return got

    _load(str(path), SFTLayout(max_length=1024), tmp_path)
    assert len(encoded) == built  # nothing changed: a hit
    rebuilt(SFTLayout(max_length=700))
    rebuilt(SFTLayout(max_length=1024, completion_only_loss=False))
    other = tiny_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert rebuilt(tokenizer=other)[0].input_ids != base[0].input_ids
    new = [{"role": "user", "content": "A new question?"}, {"role": "assistant", "content": "A new answer."}]
    _jsonl(path, [*rows[:19], {"messages": new}])
    changed = rebuilt()
    assert list(changed) == tokenize_sft(load_rows(path), TOK, max_length=1024)[0]
    assert len(base) == 20 and base[19] != changed[19]  # the old set is still there, untouched


def test_images_and_embedded_image_sets_stay_in_memory(tmp_path: Path) -> None:
    got, stats = _load("tiny:shapes_sft[:4]", SFTLayout(max_length=256, skip_bad_rows=True), tmp_path)
    assert isinstance(got, InMemory) and stats.skipped == 4  # a text model: every image row is refused
    assert not (tmp_path / "cache").exists()


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
