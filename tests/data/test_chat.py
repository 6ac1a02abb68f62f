"""The chat encoder proves each assistant turn's trained tokens against its whole message, ending in the token
the model stops at.

Each template below is written here to reproduce one behaviour of real chat templates: one that cuts the
reasoning out of every assistant turn, a Qwen3-style one that cuts it only out of turns before the last user
message, one that closes a conversation with an end-of-text token, and one with ``{% generation %}`` markers
that shows earlier turns differently. The templates of :mod:`padless.testing.templates` reproduce what they
do with the rest of a message (tool calls, reasoning fields, content parts) and with stop tokens.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest

from padless.cli import main
from padless.data import ChatTemplateError, DataError, Row, chat, load_rows, tokenize_preference, tokenize_sft
from padless.data.sft import SftEncoder, SFTLayout
from padless.data.tokenized import load_set
from padless.testing.templates import TEMPLATES
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


def _both_paths(template: Any, messages: list[dict[str, Any]], monkeypatch, **kw: Any) -> list[Any]:
    """What the one-render path and the prefix-by-prefix path make of a row (``template``: a template or a
    tokenizer): examples, or the error."""
    tok = _tok(template) if isinstance(template, str) else template
    out = []
    for force_prefixes in (False, True):
        if force_prefixes:
            monkeypatch.setattr(SftEncoder, "_chat_by_layout", lambda self, row, messages, turns: None)
        try:
            examples, _ = tokenize_sft(_row(messages), tok, max_length=4096, **kw)
            out.append([(e.input_ids, e.loss_mask) for e in examples])
        except (ChatTemplateError, DataError) as e:
            out.append(str(e))
    assert out[0] == out[1], "the two paths disagree"
    monkeypatch.undo()
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


# -- the whole message: tool calls, reasoning, content parts; stop tokens ----------------------------------


def _call(name: str, arguments: Any, ident: str | None = None) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return call if ident is None else {**call, "id": ident}


WEATHER = _call("get_weather", {"city": "Paris", "days": 3}, "call_8f3a")
ASK = {"role": "user", "content": "Weather in Paris?"}
ROWS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."}],
    "call": [
        ASK,
        {"role": "assistant", "content": "", "tool_calls": [WEATHER]},
        {"role": "tool", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
    ],
    # Kimi-style ids name the function: functions.NAME:INDEX
    "call-named-id": [
        ASK,
        {"role": "assistant", "tool_calls": [{**WEATHER, "id": "functions.get_weather:0"}]},
        {"role": "tool", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C."},
    ],
    "two-calls": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "tool_calls": [WEATHER, _call("get_weather", '{"city": "Rome"}', "call_9b1c")]},
        {"role": "tool", "content": "18 C"},
        {"role": "tool", "content": "20 C"},
        {"role": "assistant", "content": "18 and 20 C."},
    ],
    "reasoning_content": [ASK, {"role": "assistant", "reasoning_content": "It is July.", "content": "Warm."}],
    "reasoning": [ASK, {"role": "assistant", "reasoning": "It is July.", "content": "Warm."}],
    "think-in-content": [ASK, {"role": "assistant", "content": "<think>\nIt is July.\n</think>\n\nWarm."}],
    "thinking-part": [
        ASK,
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "It is July."}, {"type": "text", "text": "Warm."}],
        },
    ],
    "text-parts": [
        ASK,
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Warm, "}, {"type": "text", "text": "24 C."}],
        },
    ],
    "two-exchanges": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "3 + 3?"},
        {"role": "assistant", "content": "6."},
    ],
}
REFUSED = "chat template rejected row"  # the template raises on the row (e.g. a list content it cannot add)
# What each test template does with each row: trains it, or the behaviour it is refused for. Rows not listed
# train. Per-turn mode gives the same, except where it says "per-turn" (it then trains).
VERDICTS: dict[str, dict[str, str]] = {
    "json-calls": {"thinking-part": chat.PARTS_AS_TEXT, "text-parts": chat.PARTS_AS_TEXT},
    "xml-calls": {
        "two-calls": REFUSED,  # arguments given as a JSON string: it iterates over them
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": chat.PARTS_AS_TEXT,
        "text-parts": chat.PARTS_AS_TEXT,
    },
    "drops-calls": {
        "call": chat.CALL_DROPPED,
        "call-named-id": chat.CALL_DROPPED,
        "two-calls": chat.CALL_DROPPED,
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": chat.PARTS_AS_TEXT,
        "text-parts": chat.PARTS_AS_TEXT,
    },
    "id-as-name": {
        "call": chat.CALL_RENAMED,
        "two-calls": chat.CALL_RENAMED,
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": chat.PARTS_AS_TEXT,
        "text-parts": chat.PARTS_AS_TEXT,
    },
    "xml-strings-only": {
        "call": chat.ARGUMENTS_DROPPED,
        "call-named-id": chat.ARGUMENTS_DROPPED,
        "two-calls": REFUSED,
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": chat.PARTS_AS_TEXT,
        "text-parts": chat.PARTS_AS_TEXT,
    },
    "reads-reasoning": {
        "call": chat.CALL_DROPPED,
        "call-named-id": REFUSED,  # no content: it adds an undefined content to text
        "two-calls": REFUSED,
        "reasoning_content": chat.REASONING_IGNORED,
        "thinking-part": REFUSED,
        "text-parts": REFUSED,
    },
    "thinking-parts": {
        "call": chat.CALL_DROPPED,
        "call-named-id": chat.CALL_DROPPED,
        "two-calls": chat.CALL_DROPPED,
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
    },
    "parts-as-text": {
        "call": chat.CALL_DROPPED,
        "call-named-id": chat.CALL_DROPPED,
        "two-calls": chat.CALL_DROPPED,
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": chat.PARTS_AS_TEXT,
        "text-parts": chat.PARTS_AS_TEXT,
    },
    "harmony": {
        "two-calls": chat.STOP_INSIDE,
        "thinking-part": REFUSED,
        "text-parts": REFUSED,
        "two-exchanges": f"{chat.HISTORY_CLOSING}; per-turn",
    },
    "headers": {
        "reasoning_content": chat.REASONING_IGNORED,
        "reasoning": chat.REASONING_IGNORED,
        "thinking-part": REFUSED,
        "text-parts": REFUSED,
    },
    "prefill-think": {
        "call": chat.CALL_DROPPED,
        "call-named-id": REFUSED,
        "two-calls": REFUSED,
        "thinking-part": REFUSED,
        "text-parts": REFUSED,
        "two-exchanges": f"{chat.REWRITES_HISTORY}; per-turn",
    },
}


@functools.cache
def _test_tokenizer(name: str) -> Any:
    return TEMPLATES[name].tokenizer(tiny_tokenizer())


def _one_stop_each(tok: Any, stops: set[int], ids: list[int], mask: list[bool]) -> None:
    """Every run of trained tokens is one turn: it ends with a stop token and holds no other."""
    run: list[int] = []
    for t, m in [*zip(ids, mask, strict=True), (None, False)]:
        if m:
            run.append(t)
        elif run:
            assert run[-1] in stops and sum(t in stops for t in run) == 1, tok.decode(run)
            run = []


def _verdict(name: str, messages: list[dict[str, Any]], monkeypatch, **kw: Any) -> str | list[list[str]]:
    """A test template's verdict on a row, the same on both paths: the behaviour it is refused for, or the
    decoded trained turns of each example (each checked to end in exactly one stop token)."""
    tok = _test_tokenizer(name)
    stops = TEMPLATES[name].stop_ids(tok)
    out = []
    for force_prefixes in (False, True):
        if force_prefixes:
            monkeypatch.setattr(SftEncoder, "_chat_by_layout", lambda self, row, messages, turns: None)
        try:
            examples, _ = tokenize_sft(_row(messages), tok, max_length=4096, stop_ids=stops, **kw)
        except ChatTemplateError as e:
            out.append((e.behaviour, str(e)))
            continue
        except DataError as e:
            out.append((e.reason, str(e)))
            continue
        for e in examples:
            _one_stop_each(tok, {tok.eos_token_id, *stops}, e.input_ids, e.loss_mask)
        out.append([_trained(tok, e.input_ids, e.loss_mask) for e in examples])
    monkeypatch.undo()
    assert out[0] == out[1], "the two paths disagree"
    return out[0][0] if isinstance(out[0], tuple) else out[0]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_template_trains_what_it_renders_whole_and_refuses_what_it_changes(name, monkeypatch):
    """Every row on every test template: trained (each turn ending in exactly one stop token) exactly when
    the template renders the whole message, else refused for what it did, the same on both paths."""
    for row, messages in ROWS.items():
        want = VERDICTS[name].get(row, "train")
        got = _verdict(name, messages, monkeypatch)
        assert (got if isinstance(got, str) else "train") == want.split(";")[0], (name, row, got)
        per_turn = _verdict(name, messages, monkeypatch, per_turn=True)
        assert (per_turn if isinstance(per_turn, str) else "train") == (
            "train" if "per-turn" in want else want.split(";")[0]
        ), (name, row, per_turn)


def _turns_of(name: str, row: str, monkeypatch, **kw: Any) -> list[list[str]]:
    got = _verdict(name, ROWS[row], monkeypatch, **kw)
    assert not isinstance(got, str), got
    return got


def test_tool_calls_train_as_the_template_writes_them(monkeypatch):
    """JSON and XML calls, dict or JSON-string arguments: the call turn trains the whole call and its stop."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert _turns_of("json-calls", "call", monkeypatch) == [[call + "<|im_end|>", "It is 18 C.<|im_end|>"]]
    rome = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert _turns_of("json-calls", "two-calls", monkeypatch)[0][0] == call + rome + "<|im_end|>"
    xml = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    xml += "</parameter>\n</function>\n</tool_call><|im_end|>"
    assert _turns_of("xml-calls", "call", monkeypatch)[0][0] == xml
    named = '<tool_call>functions.get_weather:0 {"city": "Paris", "days": 3}</tool_call><|im_end|>'
    assert _turns_of("id-as-name", "call-named-id", monkeypatch)[0][0] == named
    # reasoning, from its field or from thinking parts
    think = "<think>\nIt is July.\n</think>\n\nWarm.<|im_end|>"
    assert _turns_of("json-calls", "reasoning_content", monkeypatch) == [[think]]
    assert _turns_of("thinking-parts", "thinking-part", monkeypatch) == [
        ["[THINK]It is July.[/THINK]Warm.<|im_end|>"]
    ]
    assert _turns_of("reads-reasoning", "reasoning", monkeypatch) == [
        ["<think>It is July.</think>Warm.<|im_end|>"]
    ]


@pytest.mark.parametrize(
    ("name", "row", "says"),
    [
        ("drops-calls", "call", "did not render messages[1].tool_calls[0] (the turn trains as '<|im_end|>')"),
        (
            "id-as-name",
            "call",
            "without its function name 'get_weather'; it writes the call's id 'call_8f3a'",
        ),
        ("xml-strings-only", "call", "wrote messages[1].tool_calls[0] without function.arguments.days"),
        ("reads-reasoning", "reasoning_content", "reads the reasoning from 'reasoning': rename the field"),
        ("thinking-parts", "reasoning_content", "from thinking parts: put it in the content as a"),
        ("parts-as-text", "text-parts", "(a list of parts) out as a serialised list"),
    ],
)
def test_a_refusal_names_the_row_turn_field_and_what_the_template_did(name, row, says):
    tok = _test_tokenizer(name)
    with pytest.raises(ChatTemplateError) as error:
        tokenize_sft(_row(ROWS[row]), tok, max_length=4096, skip_bad_rows=True)  # not a row's fault
    message = str(error.value)
    assert message.startswith("mem.jsonl row 1 (line 1): the chat template ") and says in message
    assert "\n" not in message


def test_harmony_turns_end_at_the_token_the_model_stops_at(monkeypatch):
    """A tool call ends in <|call|>, the last answer in <|return|> (generation-config and tokenizer eos); an
    answer that history closes with <|end|> is trained per turn, as the template renders it last; two calls
    in one turn cannot be one target (the model stops after the first); without <|call|> among the stop
    ids a call turn never stops."""
    call, final = _turns_of("harmony", "call", monkeypatch)[0]
    assert (
        call == " to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 3}<|call|>'
    )
    assert final == "<|channel|>final<|message|>It is 18 C.<|return|>"
    analysis = _turns_of("harmony", "reasoning_content", monkeypatch)[0][0]
    assert analysis == (
        "<|channel|>analysis<|message|>It is July.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Warm.<|return|>"
    )
    with pytest.raises(
        ChatTemplateError,
        match=r"as '4\.<\|end\|>' once later messages follow, but with "
        r"'<\|return\|>'.*data\.per_turn: true",
    ):
        tokenize_sft(
            _row(ROWS["two-exchanges"]),
            _test_tokenizer("harmony"),
            max_length=512,
            stop_ids=TEMPLATES["harmony"].stop_ids(_test_tokenizer("harmony")),
        )
    per_turn = _turns_of("harmony", "two-exchanges", monkeypatch, per_turn=True)
    assert per_turn == [
        ["<|channel|>final<|message|>4.<|return|>"],
        ["<|channel|>final<|message|>6.<|return|>"],
    ]
    tok = _test_tokenizer("harmony")
    (_,), stats = tokenize_sft(
        _row(ROWS["two-calls"]) + _row(ROWS["plain"]),
        tok,
        max_length=512,
        stop_ids=TEMPLATES["harmony"].stop_ids(tok),
        skip_bad_rows=True,
    )
    assert (
        stats.reasons == {chat.STOP_INSIDE: 1}
        and "before messages[1].tool_calls[1].function.name" in stats.examples_of[0]
    )
    with pytest.raises(
        ChatTemplateError, match=r"no token the model stops at \('<\|return\|>' \(tokenizer eos\)\)"
    ) as e:
        tokenize_sft(_row(ROWS["call"]), tok, max_length=512)  # no generation config: <|call|> stops nothing
    assert e.value.behaviour == chat.NO_STOP


def test_role_headers_end_turns_when_the_generation_config_lists_them(monkeypatch):
    """GLM-style: no end-of-turn token. Each turn trains through the header that follows it (a stop id), the
    last one through the header the template writes next (appended); without those ids nothing stops."""
    tok = _test_tokenizer("headers")
    assert _turns_of("headers", "call", monkeypatch) == [
        ['get_weather\n{"city": "Paris", "days": 3}<|observation|>', "It is 18 C.<|user|>"]
    ]
    (example,), _ = tokenize_sft(
        _row(ROWS["plain"]), tok, max_length=512, stop_ids=TEMPLATES["headers"].stop_ids(tok)
    )
    rendered = tok.apply_chat_template(ROWS["plain"], return_dict=True)["input_ids"]
    assert example.input_ids == [*rendered, tok.convert_tokens_to_ids("<|user|>")]
    with pytest.raises(ChatTemplateError, match=r"ends as ' there\.', and no token the model stops at") as e:
        tokenize_sft(_row(ROWS["plain"]), tok, max_length=512)
    assert e.value.behaviour == chat.NO_STOP


def test_a_generation_prompt_that_prefills_think_trains_what_follows_it(monkeypatch):
    """The generation prompt ends in "<think>\\n": a turn trains from there, and reasoning given in the
    content is found with the part the prompt pre-fills. History without reasoning is trained per turn."""
    assert _turns_of("prefill-think", "reasoning_content", monkeypatch) == [
        ["It is July.\n</think>\n\nWarm.<|im_end|>"]
    ]
    assert _turns_of("prefill-think", "think-in-content", monkeypatch) == [
        ["It is July.\n</think>\n\nWarm.<|im_end|>"]
    ]
    assert _turns_of("prefill-think", "plain", monkeypatch) == [["\n</think>\n\nHello there.<|im_end|>"]]


# The generation prompt ends in a space that the answer's first word takes into its token.
SPACE_PROMPT = (
    "{% for m in messages %}{{ m.role + ': ' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def test_a_generation_prompt_ending_inside_a_token_is_tokenized_as_at_inference(monkeypatch):
    """The turn's context is exactly the generation prompt's tokens, the rest tokenized after it (as the model
    sees and writes them), where the whole rendering tokenizes across the cut; an earlier turn cannot be cut
    so (a later turn's context would differ from inference): per-turn mode trains it."""
    tok = _tok(SPACE_PROMPT)
    ((ids, mask),) = _both_paths(SPACE_PROMPT, ROWS["plain"], monkeypatch)
    prompt = tok.apply_chat_template(ROWS["plain"][:1], add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    whole = tok.apply_chat_template(ROWS["plain"], return_dict=True)["input_ids"]
    assert whole[: len(prompt)] != prompt and tok.decode(ids) == tok.decode(whole)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert _trained(tok, ids, mask) == ["Hello there.<|im_end|>"]
    words = [
        {**m, "content": {"4.": "Four.", "6.": "Six."}.get(m["content"], m["content"])}
        for m in ROWS["two-exchanges"]
    ]
    refused = _both_paths(SPACE_PROMPT, words, monkeypatch)
    assert isinstance(refused, str) and "not prefix-stable" in refused and "data.per_turn: true" in refused
    per_turn = _both_paths(SPACE_PROMPT, words, monkeypatch, per_turn=True)
    assert [_trained(tok, *example) for example in per_turn] == [["Four.<|im_end|>"], ["Six.<|im_end|>"]]


def test_markers_train_calls_and_must_hold_the_stop_token(monkeypatch):
    """The embedded template marks its calls; markers that leave the stop token out are refused."""
    tok = tiny_tokenizer()
    call = '<call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</call><|im_end|>'
    ((ids, mask),) = _both_paths(tok, ROWS["call"], monkeypatch)
    assert _trained(tok, ids, mask) == [call, "It is 18 C.<|im_end|>"]
    short = _tok(
        tok.chat_template.replace(
            "{{ '<|im_end|>' }}{% endgeneration %}", "{% endgeneration %}{{ '<|im_end|>' }}"
        )
    )
    with pytest.raises(
        ChatTemplateError,
        match=r"markers of messages\[1\] \(assistant\) leave out its stop token '<\|im_end\|>'",
    ):
        tokenize_sft(_row(ROWS["plain"]), short, max_length=512)


@pytest.mark.slow
def test_padless_sft_refuses_dropped_calls_and_trains_every_turn_through_its_stop(tmp_path, capsys):
    """Tool-call and reasoning rows: a template that drops them (the calls and the reasoning field) stops
    `padless sft` with exit 2 and one line naming the row, turn and field; a faithful one trains, every
    trained turn ending in its stop token (read back from the run's own tokenized set)."""
    from padless.data.sources import load_tokenizer, stop_token_ids

    data = tmp_path / "calls.jsonl"
    rows = [ROWS["reasoning_content"], ROWS["call"], ROWS["two-calls"], ROWS["plain"]]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    weights = build_tiny_model("tiny-qwen2")
    runs = {}
    for name in ("drops-calls", "json-calls"):
        folder = tmp_path / name
        weights.save_pretrained(folder)
        _test_tokenizer(name).save_pretrained(folder)
        args = ["sft", f"model.name={folder}", f"data.train={data}", f"data.cache_dir={tmp_path / 'cache'}"]
        args += ["train.max_steps=1", "train.progress_bar=false", "train.report_to=[jsonl]"]
        runs[name] = main([*args, f"train.output_dir={tmp_path / name}-run"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("padless sft: error")]
    assert runs == {"drops-calls": 2, "json-calls": 0} and len(err) == 1
    assert "calls.jsonl row 1 (line 1): the chat template ignored messages[1].reasoning_content" in err[0]
    tok = load_tokenizer(str(tmp_path / "json-calls"))  # as the run loaded it
    layout = SFTLayout(max_length=2048, stop_ids=stop_token_ids(str(tmp_path / "json-calls")))
    stored, _ = load_set(str(data), layout, tok, cache_dir=tmp_path / "cache")
    assert stored.cached  # the very set the run trained on
    turns = [run for e in stored for run in _trained(tok, e.input_ids, e.loss_mask)]
    assert len(turns) == 6 and all(t.endswith("<|im_end|>") and t.count("<|im_end|>") == 1 for t in turns)
    assert sum("<tool_call>" in t for t in turns) == 2
