"""``padless check --data FILE --model DIR``: the data through the model's chat template and stop tokens, rows
counted by what they hold and why they are refused, before any training."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from padless.cli import main
from padless.data.chat import CALL_DROPPED, HISTORY_CLOSING, STOP_INSIDE
from padless.data.sources import load_tokenizer, stop_token_ids
from padless.proof.chat_data import check_data
from padless.testing.templates import TEMPLATES
from padless.tiny import tiny_config, tiny_tokenizer

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
ASK = {"role": "user", "content": "What is 2 + 3?"}
PLAIN = [ASK, {"role": "assistant", "content": "5."}]
CALLING = [ASK, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "5"}, PLAIN[1]]
TWO_CALLS = [
    ASK,
    {"role": "assistant", "tool_calls": [CALL, CALL]},
    {"role": "tool", "content": "5"},
    PLAIN[1],
]
REASONING = [ASK, {"role": "assistant", "reasoning_content": "Two plus three.", "content": "5."}]
TWO_EXCHANGES = [*PLAIN, {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "8."}]
# rows 1-8 of the file
ROWS = [PLAIN, CALLING, TWO_CALLS, REASONING, TWO_EXCHANGES, CALLING, PLAIN, TWO_EXCHANGES]


def _folder(tmp_path: Path, name: str) -> Path:
    """A model folder with a test template: tokenizer, config and the generation config's stop tokens."""
    template = TEMPLATES[name]
    tok = template.tokenizer(tiny_tokenizer())
    folder = tmp_path / name
    tok.save_pretrained(folder)
    tiny_config("tiny-qwen2").save_pretrained(folder)
    GenerationConfig(eos_token_id=[tok.eos_token_id, *template.stop_ids(tok)]).save_pretrained(folder)
    return folder


def _data(tmp_path: Path, rows: list[list[dict[str, Any]]]) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def test_the_report_counts_rows_by_what_they_hold_and_why_they_are_refused(tmp_path, capsys):
    """Harmony-style template, its <|call|> stop read from generation_config.json: plain, calling and
    reasoning rows train (5); two calls in a turn (1) and history closed by <|end|> (2) are refused, the
    latter trainable per turn. The same data under a template that drops calls refuses every calling row."""
    data = _data(tmp_path, ROWS)
    folder = _folder(tmp_path, "harmony")
    tok = load_tokenizer(str(folder))
    report = check_data(str(data), tok, stop_token_ids(str(folder)))
    assert (report.rows, report.trained) == (8, 5)
    assert {h: (c["rows"], c["train"]) for h, c in report.by_holding.items()} == {
        "plain": (2, 2),
        "tool calls": (3, 2),
        "reasoning field": (1, 1),
        "several assistant turns": (5, 2),
    }
    assert {r: (c.rows, c.first) for r, c in report.causes.items()} == {
        HISTORY_CLOSING: (2, [5, 8]),
        STOP_INSIDE: (1, [3]),
    }
    assert report.per_turn == [5, 8]

    assert main(["check", "--data", str(data), "--model", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert f"{data} through the chat template of {folder}: 8 rows, 5 train, 3 refused" in out
    assert "'<|call|>' (generation config)" in out and "'<|return|>' (tokenizer eos)" in out
    assert re.search(r"\ntool calls +3 +2 +1\n", out)
    assert f"  {HISTORY_CLOSING}: 2; rows 5, 8" in out and f"  {STOP_INSIDE}: 1; row 3" in out
    assert "with data.per_turn: true, 2 of them train (rows 5, 8)" in out
    assert "FAILED: padless sft would refuse 3 of 8 rows" in err

    assert main(["check", "--data", str(data), "--model", str(_folder(tmp_path, "drops-calls"))]) == 2
    out, _ = capsys.readouterr()
    assert re.search(r"\ntool calls +3 +0 +3\n", out)
    assert f"  {CALL_DROPPED}: 3; rows 2, 3, 6" in out and "did not render messages[1].tool_calls[0]" in out
    faithful = _folder(tmp_path, "json-calls")
    assert main(["check", "--data", str(_data(tmp_path, [PLAIN, CALLING])), "--model", str(faithful)]) == 0
    assert "OK: every row trains" in capsys.readouterr().out
