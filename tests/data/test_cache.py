"""The store of tokenized sets: one builder, every other process waits and gets its set or its error;
fingerprints are stable across processes (or no warm start would ever hit)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import pytest

from padless.data import DataError, cache
from padless.tiny import tiny_tokenizer

FORK = multiprocessing.get_context("fork")


def _slow_build(log: Path, fail: bool = False):
    """A build that takes a moment, notes each call in ``log`` and writes a complete set (or fails)."""

    def build(out: Path) -> None:
        with log.open("a") as f:
            f.write("built\n")
        time.sleep(0.8)
        if fail:
            raise DataError(
                "d.jsonl row 3 (line 3): bad. Fix it.", source="d.jsonl", index=3, field="x", reason="r"
            )
        (out / "data.arrow").write_text("rows")
        (out / cache.META_FILE).write_text("{}")

    return build


def _wait(path: Path, result: Path) -> None:
    """A waiting rank: records what it got."""
    try:
        hit = cache.load_or_build(path, lambda out: None, "data x", builder=False, waiters=0)
        result.write_text(json.dumps({"hit": hit, "data": (path / "data.arrow").read_text()}))
    except DataError as e:
        result.write_text(json.dumps({"error": str(e), "attrs": [e.source, e.index, e.field, e.reason]}))


@pytest.mark.parametrize("fail", [False, True], ids=["built", "failed"])
def test_one_process_builds_while_the_others_wait(tmp_path: Path, fail: bool) -> None:
    path, log = tmp_path / "store" / "sft-abc", tmp_path / "builds.log"
    waiters = [FORK.Process(target=_wait, args=(path, tmp_path / f"rank{r}.json")) for r in (1, 2)]
    for w in waiters:
        w.start()
    time.sleep(0.3)  # the waiters are polling before the build starts
    build = _slow_build(log, fail)
    if fail:
        with pytest.raises(DataError, match="row 3"):
            cache.load_or_build(path, build, "data x", builder=True, waiters=2)
    else:
        assert cache.load_or_build(path, build, "data x", builder=True, waiters=2) is False
    for w in waiters:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert log.read_text() == "built\n"  # once
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2)]
    if fail:
        assert not path.exists()
        assert all(
            r["attrs"] == ["d.jsonl", 3, "x", "r"] and r["error"].startswith("d.jsonl row 3") for r in results
        )
    else:
        assert all(r == {"hit": False, "data": "rows"} for r in results)
        assert cache.load_or_build(path, _slow_build(log), "data x", builder=True) is True
        assert log.read_text() == "built\n"
    assert sorted(p.name for p in path.parent.iterdir()) == (
        [f"{path.name}.failed.json"] if fail else [path.name]
    )


def test_racing_builders_both_succeed_and_one_set_is_kept(tmp_path: Path) -> None:
    path, log = tmp_path / "store" / "sft-abc", tmp_path / "builds.log"

    def build_alone() -> None:
        cache.load_or_build(path, _slow_build(log), "data x", builder=True, waiters=0)

    other = FORK.Process(target=build_alone)
    other.start()
    build_alone()
    other.join(timeout=30)
    assert other.exitcode == 0
    assert log.read_text() == "built\nbuilt\n"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no half or temporary folders left
    assert (path / "data.arrow").read_text() == "rows"


def test_a_failure_alone_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "store" / "sft-abc"
    with pytest.raises(DataError):
        cache.load_or_build(path, _slow_build(tmp_path / "log", fail=True), "data x", builder=True, waiters=0)
    assert list(path.parent.iterdir()) == []


def test_errors_cross_processes_with_class_message_and_attributes() -> None:
    from padless.data import ChatTemplateError

    for error in (
        DataError("m", source="s", index=4, field="f", reason="too long"),
        ChatTemplateError("the template"),
        ValueError("no eos"),
    ):
        again = cache.error_from(json.loads(json.dumps(cache.error_record(error))))
        assert type(again) is type(error) and str(again) == str(error)
        assert [getattr(again, a, None) for a in ("source", "index", "field", "reason")] == [
            getattr(error, a, None) for a in ("source", "index", "field", "reason")
        ]


def test_tokenizer_fingerprint_is_the_same_in_another_process() -> None:
    code = (
        "from padless.data import cache; from padless.tiny import tiny_tokenizer as t; "
        "print(cache.tokenizer_identity(t()))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = cache.tokenizer_identity(tiny_tokenizer())
    assert other.stdout.strip() == here
    changed = tiny_tokenizer()
    changed.add_tokens(["<new>"])
    assert cache.tokenizer_identity(changed) != here
