"""Every accepted source loads with the right provenance; every broken one says where and how to fix it."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from padless.data import DataError, Row, load_rows
from padless.tiny import data_path

ROWS = [{"text": "one"}, {"text": "two"}, {"text": "three"}]


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_rows_carry_line_numbers(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), "", "   ", json.dumps(ROWS[1])])
    rows = load_rows(path)
    assert [r.data for r in rows] == ROWS[:2]
    assert [r.index for r in rows] == [1, 4]  # blank lines skipped but still counted
    assert rows[1].source == str(path)
    assert rows[1].where == f"{path} row 4 (line 4)"


def test_jsonl_keeps_u2028_inside_strings(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_rows(path)[0].data == {"text": "a\u2028b"}


def test_malformed_jsonl_line_is_reported_by_number(tmp_path: Path) -> None:
    lines = [json.dumps(r) for r in ROWS] + ['{"text": "oops",', json.dumps(ROWS[0])]
    lines.insert(1, "")
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=r"bad\.jsonl row 5 \(line 5\): not valid JSON") as info:
        load_rows(path)
    assert info.value.index == 5
    assert info.value.source == str(path)


def test_non_dict_row_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(ROWS[0]), json.dumps(["text", "x"])])
    with pytest.raises(DataError, match=r"row 2 \(line 2\): expected a JSON object .*got list"):
        load_rows(path)
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps([ROWS[0], "just a string"]))
    with pytest.raises(DataError, match=r"d\.json row 1 \(0-based\): expected a JSON object .*got str"):
        load_rows(json_path)


def test_json_list_and_data_wrapper(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "b.json").write_text(json.dumps({"data": ROWS, "version": 1}))
    for name in ("a.json", "b.json"):
        rows = load_rows(tmp_path / name)
        assert [r.data for r in rows] == ROWS
        assert [r.index for r in rows] == [0, 1, 2]
        assert rows[2].where.endswith("row 2 (0-based)")
    (tmp_path / "c.json").write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataError, match=r"c\.json: expected a JSON list .*keys \['rows'\]"):
        load_rows(tmp_path / "c.json")


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    rows = load_rows(str(path))
    assert [r.data for r in rows] == ROWS
    assert rows[0].source == str(path) and rows[0].index == 0


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert [r.data for r in load_rows(tmp_path / "ds")] == ROWS

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert [r.data for r in load_rows(tmp_path / "dd")] == ROWS
    assert [r.data for r in load_rows(tmp_path / "dd", split="test")] == ROWS[:1]
    with pytest.raises(DataError, match=r"no split 'validation'; available splits: train, test"):
        load_rows(tmp_path / "dd", split="validation")


def test_in_memory_dataset() -> None:
    rows = load_rows(datasets.Dataset.from_list(ROWS))
    assert [r.data for r in rows] == ROWS
    assert [r.index for r in rows] == [0, 1, 2]
    assert "Dataset" in rows[0].source
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    assert len(load_rows(dd)) == 3


def test_tiny_datasets() -> None:
    rows = load_rows("tiny:sft")
    n_lines = sum(1 for line in data_path("sft").read_text().splitlines() if line.strip())
    assert len(rows) == n_lines == 400
    assert rows[0].source == "tiny:sft" and rows[0].index == 1
    assert "messages" in rows[0].data
    with pytest.raises(DataError, match=r"no embedded dataset 'nope'; valid: tiny:sft"):
        load_rows("tiny:nope")


def test_missing_file_names_path_and_formats(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(DataError, match="no such file or directory") as info:
        load_rows(missing)
    assert str(missing) in str(info.value)
    assert ".parquet" in str(info.value) and "save_to_disk" in str(info.value)


def test_unsupported_extension_and_plain_directory(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("text\nx\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        load_rows(tmp_path / "d.csv")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="not one written by datasets' save_to_disk"):
        load_rows(tmp_path / "plain")


def test_row_error_message_shape() -> None:
    row = Row({"messages": "hi"}, "sft.jsonl", 17, "line")
    err = row.error("messages", "must be a list of {role, content} dicts, got str", reason="wrong type")
    assert str(err) == (
        "sft.jsonl row 17 (line 17): field 'messages' must be a list of {role, content} dicts, got str. "
        "Fix the row or set data.skip_bad_rows: true to skip it."
    )
    assert (err.source, err.index, err.field, err.reason) == ("sft.jsonl", 17, "messages", "wrong type")
    assert isinstance(err, ValueError)
