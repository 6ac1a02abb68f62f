"""Messages as rows give them: tool calls, reasoning and content parts checked, and per-turn train flags (the
``loss`` / ``train`` / ``weight`` conventions of ms-swift and axolotl datasets) deciding which turns are
targets, composed with per-turn mode and ``completion_only_loss``."""

from __future__ import annotations

from typing import Any

import pytest

from padless.data import DataError, Row, tokenize_preference, tokenize_sft
from padless.data.messages import SENTINEL, chat_messages, with_sentinels
from padless.testing.templates import TEMPLATES
from padless.tiny import tiny_tokenizer

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}, "id": "call_1"}
CHAT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8."},
]
TOK = TEMPLATES["json-calls"].tokenizer(tiny_tokenizer())


def _row(data: dict[str, Any]) -> Row:
    return Row(data, "mem.jsonl", 3, "line")


def _flagged(flags: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, **flags.get(j, {})} for j, m in enumerate(CHAT)]


def _turn_spans(ids: list[int], mask: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for k, m in enumerate([*mask, False]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            spans.append((start, k))
            start = None
    return spans


def test_flags_mask_exactly_the_turns_they_name():
    """Against the unflagged row: a turn flagged off (tool call or plain, by loss / train / weight) loses its
    targets, every other token keeps its mask, and the ids do not change."""
    (whole,), _ = tokenize_sft([_row({"messages": CHAT})], TOK, max_length=512)
    spans = _turn_spans(whole.input_ids, whole.loss_mask)
    assert [TOK.decode(whole.input_ids[a:b]) for a, b in spans] == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
        "8.<|im_end|>",
    ]
    for flags, off in [
        ({2: {"loss": False}}, [0]),
        ({4: {"train": False}, 6: {"weight": 0}}, [1, 2]),
        ({2: {"weight": 0.0}, 4: {"loss": True}, 6: {"weight": 1}}, [0]),
    ]:
        (ex,), _ = tokenize_sft([_row({"messages": _flagged(flags)})], TOK, max_length=512)
        assert ex.input_ids == whole.input_ids
        want = list(whole.loss_mask)
        for k in off:
            a, b = spans[k]
            want[a:b] = [False] * (b - a)
        assert ex.loss_mask == want


def test_flags_compose_with_per_turn_and_completion_only_loss():
    """Per-turn mode makes an example of each trained turn only; a prompt/completion row's flagged-off
    completion trains nothing, or (completion_only_loss: false) the prompt alone."""
    flagged = _flagged({4: {"loss": False}})
    examples, _ = tokenize_sft([_row({"messages": flagged})], TOK, max_length=512, per_turn=True)
    every, _ = tokenize_sft([_row({"messages": CHAT})], TOK, max_length=512, per_turn=True)
    assert [e.input_ids for e in examples] == [every[0].input_ids, every[2].input_ids]
    assert [e.loss_mask for e in examples] == [every[0].loss_mask, every[2].loss_mask]
    row = {"prompt": CHAT[:6], "completion": [{**CHAT[6], "weight": 0}]}
    with pytest.raises(DataError, match="no trainable token"):
        tokenize_sft([_row(row)], TOK, max_length=512)
    (ex,), _ = tokenize_sft([_row(row)], TOK, max_length=512, completion_only_loss=False)
    prompt = TOK.apply_chat_template(CHAT[:6], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ex.loss_mask == [True] * len(prompt) + [False] * (len(ex.input_ids) - len(prompt))


@pytest.mark.parametrize(
    ("flags", "where", "says"),
    [
        ({1: {"loss": False}}, "messages[1].loss", "messages of role 'user' are never trained"),
        ({4: {"weight": 0.5}}, "messages[4].weight", "must be 0 (not trained) or 1 (trained), got 0.5"),
        ({4: {"train": "no"}}, "messages[4].train", "must be true or false, got str"),
        ({4: {"loss": True, "weight": 0}}, "messages[4]", "flags that disagree"),
        (
            {2: {"loss": False}, 4: {"loss": False}, 6: {"loss": False}},
            "messages",
            "every one is flagged off",
        ),
    ],
)
def test_bad_flags_are_refused_with_the_row(flags, where, says):
    with pytest.raises(DataError) as error:
        tokenize_sft([_row({"messages": _flagged(flags)})], TOK, max_length=512)
    assert str(error.value).startswith(f"mem.jsonl row 3 (line 3): field '{where}' ") and says in str(
        error.value
    )


def test_a_flag_where_nothing_trains_turn_by_turn_is_refused():
    """A preference completion trains whole: a flag on it would do nothing, so it is refused."""
    row = {"prompt": CHAT[:2], "chosen": [{"role": "assistant", "content": "5", "loss": False}]}
    row["rejected"] = [{"role": "assistant", "content": "6"}]
    with pytest.raises(
        DataError, match=r"'chosen\[0\]\.loss' says whether a turn trains, but 'chosen' is never"
    ):
        tokenize_preference([_row(row)], TOK, max_length=512)


@pytest.mark.parametrize(
    ("message", "where", "says"),
    [
        ({"tool_calls": {"name": "add"}}, "messages[1].tool_calls", "must be a list of tool calls, got dict"),
        (
            {"tool_calls": [{"function": {"arguments": {}}}]},
            "messages[1].tool_calls[0].function.name",
            "None",
        ),
        ({"tool_calls": [{"name": "add", "arguments": 3}]}, "messages[1].tool_calls[0].arguments", "got int"),
        ({"reasoning_content": ["a"]}, "messages[1].reasoning_content", "must be a string, got list"),
        ({"content": [{"type": "thinking", "thinking": 1}]}, "messages[1].content[0].thinking", "got int"),
        ({"content": [{"type": "audio"}]}, "messages[1].content[0]", "got 'audio'"),
    ],
)
def test_malformed_fields_name_the_field(message, where, says):
    messages = [CHAT[1], {"role": "assistant", "content": "x", **message}]
    with pytest.raises(DataError) as error:
        chat_messages(_row({}), "messages", messages)
    assert f"field '{where}' " in str(error.value) and says in str(error.value)


def test_sentinels_stand_in_for_every_value_a_turn_must_render():
    """Content parts, reasoning, each call's name, argument keys and values (numbers stay numbers); an id
    that names the function carries the name's sentinel, any other id its own (not required)."""
    message = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Sum:"}],
        "reasoning_content": "adding",
        "tool_calls": [
            {**CALL, "function": {"name": "add", "arguments": {"a": 2, "b": "3", "opts": {"exact": True}}}},
            {"id": "functions.mul:1", "function": {"name": "mul", "arguments": '{"a": 1}'}},
        ],
    }
    perturbed, leaves = with_sentinels(message, "messages[2]")
    assert [(leaf.path, leaf.required) for leaf in leaves] == [
        ("messages[2].content[0].thinking", True),
        ("messages[2].content[1].text", True),
        ("messages[2].reasoning_content", True),
        ("messages[2].tool_calls[0].function.name", True),
        ("messages[2].tool_calls[0].function.arguments.a (name)", True),
        ("messages[2].tool_calls[0].function.arguments.a", True),
        ("messages[2].tool_calls[0].function.arguments.b (name)", True),
        ("messages[2].tool_calls[0].function.arguments.b", True),
        ("messages[2].tool_calls[0].function.arguments.opts (name)", True),
        ("messages[2].tool_calls[0].function.arguments.opts.exact (name)", True),
        ("messages[2].tool_calls[0].id", False),
        ("messages[2].tool_calls[1].function.name", True),
        ("messages[2].tool_calls[1].function.arguments", True),
    ]
    first = perturbed["tool_calls"][0]["function"]["arguments"]
    assert isinstance(first[SENTINEL.format(4)], int) and first[SENTINEL.format(6)] == SENTINEL.format(7)
    assert list(first[SENTINEL.format(8)].values()) == [True]  # true / false / null stay: their key stands
    assert perturbed["tool_calls"][1]["id"] == f"functions.{SENTINEL.format(11)}:1"
    assert message["tool_calls"][1]["id"] == "functions.mul:1"  # the row itself is untouched
