"""The chat encoder proves each assistant turn's trained tokens against its message.

Each template below is written here to reproduce one behaviour of real chat templates: one that cuts the
reasoning out of every assistant turn, a Qwen3-style one that cuts it only out of turns before the last user
message, one that closes a conversation with an end-of-text token, and one with ``{% generation %}`` markers
that shows earlier turns differently.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from padless.cli import main
from padless.data import ChatTemplateError, Row, load_rows, tokenize_preference, tokenize_sft
from padless.data.sft import SftEncoder, SFTLayout
from padless.data.tokenized import load_set
from padless.tiny import build_tiny_model, tiny_tokenizer


def _chatml(assistant: str, *, end: str = "", markers: bool = False) -> str:
    """A ChatML template whose assistant turn renders ``assistant`` (a Jinja expression of ``m``, ``i``
    and ``last_user``), optionally inside generation markers, and that writes ``end`` after the last turn."""
    open_, close = ("{% generation %}", "{% endgeneration %}") if markers else ("", "")
    return (
        "{%- set ns = namespace(last_user=0) %}"
        "{%- for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
        "{% endfor %}"
        "{%- for m in messages %}{% set i = loop.index0 %}{% set last_user = ns.last_user %}"
        "{%- if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant\\n' }}"
        + open_
        + "{{ "
        + assistant
        + " + '<|im_end|>' }}"
        + close
        + "{{ '\\n' }}"
        "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{%- else %}{{ '" + end + "' }}{% endif %}"
    )


AFTER_THINK = "m['content'].split('</think>')[-1].lstrip('\\n')"
VERBATIM = _chatml("m['content']")
STRIPS_EVERY_TURN = _chatml(AFTER_THINK)
# Qwen3: the reasoning of turns before the last user message is cut out; later turns keep it.
QWEN3_STYLE = _chatml(f"(m['content'] if i > last_user else {AFTER_THINK})")
END_OF_TEXT = _chatml("m['content']", end="<|endoftext|>")
MARKED_QWEN3_STYLE = _chatml(f"(m['content'] if i > last_user else {AFTER_THINK})", markers=True)
MARKED_STRIPS_EVERY_TURN = _chatml(AFTER_THINK, markers=True)

REASONING = [
    {"role": "user", "content": "Capital of France?"},
    {
        "role": "assistant",
        "content": "<think>\nFrance is in Europe; its capital is Paris.\n</think>\n\nParis.",
    },
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "<think>\nItaly's capital is Rome.\n</think>\n\nRome."},
]


def _tok(template: str):
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def _row(messages: list[dict[str, Any]]) -> list[Row]:
    return [Row({"messages": messages}, "mem.jsonl", 1, "line")]


def _trained(tok, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs, cur = [], []
    for t, m in [*zip(ids, mask, strict=True), (None, False)]:
        if m:
            cur.append(t)
        elif cur:
            runs, cur = [*runs, tok.decode(cur)], []
    return runs


def _both_paths(template: str, messages: list[dict[str, Any]], monkeypatch, **kw: Any) -> list[Any]:
    """What the one-render path and the prefix-by-prefix path make of a row: examples, or the error."""
    out = []
    for force_prefixes in (False, True):
        if force_prefixes:
            monkeypatch.setattr(SftEncoder, "_chat_by_layout", lambda self, row, messages, last_only: None)
        try:
            examples, _ = tokenize_sft(_row(messages), _tok(template), max_length=4096, **kw)
            out.append([(e.input_ids, e.loss_mask) for e in examples])
        except ChatTemplateError as e:
            out.append(str(e))
    assert out[0] == out[1], "the two paths disagree"
    return out[0]


@pytest.mark.parametrize("template", [STRIPS_EVERY_TURN, MARKED_STRIPS_EVERY_TURN], ids=["plain", "markers"])
def test_a_template_that_drops_content_in_every_turn_is_refused(template, monkeypatch):
    """Consistent in every turn, so prefix-stable: only the content check sees that the reasoning is gone."""
    got = _both_paths(template, REASONING, monkeypatch)
    assert isinstance(got, str)
    assert "mem.jsonl row 1" in got and "changed messages[1] (assistant)" in got
    assert "dropped the text before 'Paris.'" in got and "</think>" in got
    # per-turn mode cannot help: the template cuts the reasoning out of a last turn too
    got = _both_paths(template, REASONING, monkeypatch, per_turn=True)
    assert isinstance(got, str) and "changed messages[1] (assistant)" in got
    # a row without reasoning is rendered verbatim and trains
    plain = [{**m, "content": m["content"].split("</think>")[-1].strip()} for m in REASONING]
    ((ids, mask),) = _both_paths(template, plain, monkeypatch)
    assert _trained(_tok(template), ids, mask) == ["Paris.<|im_end|>", "Rome.<|im_end|>"]


@pytest.mark.parametrize("template", [QWEN3_STYLE, MARKED_QWEN3_STYLE], ids=["plain", "markers"])
def test_history_rewrite_is_refused_naming_per_turn_mode(template, monkeypatch):
    """Earlier reasoning cut out once a later user message exists: refused on both paths, markers included
    (they used to skip the prefix check), and the message names the fix."""
    got = _both_paths(template, REASONING, monkeypatch)
    assert isinstance(got, str) and "mem.jsonl row 1" in got and "data.per_turn: true" in got


@pytest.mark.parametrize("template", [QWEN3_STYLE, MARKED_QWEN3_STYLE], ids=["plain", "markers"])
def test_per_turn_mode_trains_each_turn_on_its_full_content(template, monkeypatch):
    """One example per assistant turn: its context is exactly the generation prompt the template renders
    (earlier reasoning cut out, as the model will see it), its targets the whole message and <|im_end|>."""
    tok = _tok(template)
    examples = _both_paths(template, REASONING, monkeypatch, per_turn=True)
    assert len(examples) == 2
    for (ids, mask), i in zip(examples, (1, 3), strict=True):
        context = tok.apply_chat_template(REASONING[:i], add_generation_prompt=True)["input_ids"]
        assert ids[: len(context)] == context and not any(mask[: len(context)])
        assert _trained(tok, ids, mask) == [REASONING[i]["content"] + "<|im_end|>"]
    second_context = tok.decode(examples[1][0])
    assert "France is in Europe" not in second_context and "Paris." in second_context


def test_end_of_conversation_token_belongs_to_the_last_turn(monkeypatch):
    """<|endoftext|> written only after the last turn is not instability: every turn trains as with the
    verbatim template, through its stop token; the model stops at <|im_end|>, so what the template writes
    after it is context, not something the model writes."""
    plain = [{**m, "content": m["content"].split("</think>")[-1].strip()} for m in REASONING]
    ((ids, mask),) = _both_paths(END_OF_TEXT, plain, monkeypatch)
    ((want_ids, want_mask),) = _both_paths(VERBATIM, plain, monkeypatch)
    tok = _tok(END_OF_TEXT)
    assert ids == [*want_ids, tok.convert_tokens_to_ids("<|endoftext|>")]
    assert (
        _trained(tok, ids, mask)
        == _trained(tok, want_ids, want_mask)
        == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
    )


def _qwen3_rows(n: int) -> list[dict[str, Any]]:
    """``n`` two-turn chats with reasoning in both answers."""
    rows = []
    for k in range(n):
        messages = [dict(m) for m in REASONING]
        messages[1]["content"] = f"<think>\nStep {k}: France.\n</think>\n\nParis {k}."
        messages[3]["content"] = f"<think>\nStep {k}: Italy.\n</think>\n\nRome {k}."
        rows.append({"messages": messages})
    return rows


def test_per_turn_through_the_tokenized_set(tmp_path):
    """The datasets path (what `padless sft` runs) gives the in-memory examples, and counts rows, not
    examples, as kept."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _qwen3_rows(5)))
    tok = _tok(QWEN3_STYLE)
    stored, stats = load_set(
        str(path), SFTLayout(max_length=512, per_turn=True), tok, cache_dir=tmp_path / "c"
    )
    want, want_stats = tokenize_sft(load_rows(str(path)), tok, max_length=512, per_turn=True)
    assert [(e.input_ids, e.loss_mask) for e in stored] == [(e.input_ids, e.loss_mask) for e in want]
    assert len(want) == 10 and stats.kept == want_stats.kept == 5


@pytest.mark.slow
def test_padless_sft_trains_a_qwen3_style_template_per_turn(tmp_path, capsys):
    """A model folder whose template strips earlier reasoning: refused as is (exit 2, the fix named), trained
    with data.per_turn: true."""
    folder = tmp_path / "model"
    build_tiny_model("tiny-qwen2").save_pretrained(folder)
    _tok(QWEN3_STYLE).save_pretrained(folder)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _qwen3_rows(8)))
    args = [
        "sft",
        f"model.name={folder}",
        f"data.train={data}",
        "train.max_steps=1",
        "train.progress_bar=false",
    ]
    args += ["train.report_to=[jsonl]"]
    assert main([*args, f"train.output_dir={tmp_path / 'refused'}"]) == 2
    assert "data.per_turn: true" in capsys.readouterr().err
    assert main([*args, "data.per_turn=true", f"train.output_dir={tmp_path / 'run'}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["data/train/rows"] == 8 and records[0]["data/train/skipped"] == 0
    assert math.isfinite(next(r["train/loss"] for r in records if "train/loss" in r))


def test_preference_completions_are_proven_against_their_message():
    """DPO / RM completions too: a template that cuts the reasoning out of the reply is refused, naming the
    side; a verbatim one keeps the whole reply."""
    prompt = REASONING[:1]
    row = {
        "prompt": prompt,
        "chosen": [REASONING[1]],
        "rejected": [{"role": "assistant", "content": "<think>\nNo idea.\n</think>\n\nLyon."}],
    }
    rows = [Row(row, "mem.jsonl", 1, "line")]
    with pytest.raises(
        ChatTemplateError, match=r"changed 'chosen' \(assistant\): it dropped the text before"
    ):
        tokenize_preference(rows, _tok(STRIPS_EVERY_TURN), max_length=512)
    (pair,), _ = tokenize_preference(rows, _tok(VERBATIM), max_length=512)
    tok = _tok(VERBATIM)
    assert tok.decode(pair.chosen.input_ids[pair.prompt_length :]) == REASONING[1]["content"] + "<|im_end|>"
