"""SFT tokenization: targets are exactly what the model should learn to write, or the row is refused."""

from __future__ import annotations

import pickle
import re
from typing import Any

import pytest

from padless.data import ChatTemplateError, DataError, Row, load_rows, tokenize_preference, tokenize_sft
from padless.data.records import chat_messages
from padless.data.sft import SftEncoder
from padless.testing import templates
from padless.tiny import EOS_TOKEN_ID, tiny_tokenizer

TOK = tiny_tokenizer()

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "3 + 3 = 6."},
]


def _rows(*data: dict[str, Any]) -> list[Row]:
    return [Row(d, "mem.jsonl", i + 1, "line") for i, d in enumerate(data)]


def _targets(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """Decoded runs of consecutive target tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def _without_generation_tags(tokenizer):
    tokenizer.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", tokenizer.chat_template)
    assert (
        "{% generation %}" not in tokenizer.chat_template
        and "add_generation_prompt" in tokenizer.chat_template
    )
    return tokenizer


def _sft(rows: list[Row], tokenizer=TOK, **kw: Any):
    kw.setdefault("max_length", 2048)
    return tokenize_sft(rows, tokenizer, **kw)


# -- messages ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("marker_free", [False, True], ids=["generation-markers", "prefix-rendering"])
def test_messages_targets_are_assistant_content_and_end_of_turn(marker_free: bool) -> None:
    tok = _without_generation_tags(tiny_tokenizer()) if marker_free else TOK
    (ex,), stats = _sft(_rows({"messages": CONVERSATION, "id": 7}), tok)
    assert _targets(tok, ex.input_ids, ex.loss_mask) == ["2 + 2 = 4.<|im_end|>", "3 + 3 = 6.<|im_end|>"]
    assert ex.input_ids == TOK.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    # No system/user token, and no header token, is ever a target.
    non_targets = TOK.decode([t for t, m in zip(ex.input_ids, ex.loss_mask, strict=True) if not m])
    assert "Be brief." in non_targets and "What is 2 + 2?" in non_targets and "And 3 + 3?" in non_targets
    assert non_targets.count("<|im_start|>assistant\n") == 2
    assert ex.meta == {"row": 1, "source": "mem.jsonl"}
    assert stats.skipped == 0 and stats.kept == 1


def test_prefix_rendering_matches_generation_markers_on_whole_dataset() -> None:
    rows = load_rows("tiny:sft")
    marked, _ = _sft(rows)
    rendered, _ = _sft(rows, _without_generation_tags(tiny_tokenizer()))
    assert len(marked) == len(rendered) == len(rows)
    for a, b in zip(marked, rendered, strict=True):
        assert a.input_ids == b.input_ids
        assert a.loss_mask == b.loss_mask


def test_non_prefix_stable_template_is_refused() -> None:
    # Like reasoning templates: earlier assistant turns lose their <think> part once a later turn exists.
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    conv = [dict(m) for m in CONVERSATION]
    conv[2]["content"] = "<think>add</think>2 + 2 = 4."
    with pytest.raises(ChatTemplateError, match=r"mem\.jsonl row 1 .*not prefix-stable.*data\.per_turn"):
        _sft(_rows({"messages": conv}), tok)
    # ... and skip_bad_rows does not hide it: the template, not the row, is at fault.
    with pytest.raises(ChatTemplateError):
        _sft(_rows({"messages": conv}), tok, skip_bad_rows=True)
    # A single-turn conversation renders the same either way, so it is accepted.
    (ex,), _ = _sft(_rows({"messages": conv[:3]}), tok)
    assert _targets(tok, ex.input_ids, ex.loss_mask) == ["<think>add</think>2 + 2 = 4.<|im_end|>"]


def test_messages_without_chat_template() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        _sft(_rows({"messages": CONVERSATION}), tok)


@pytest.mark.parametrize(
    ("messages", "field", "message"),
    [
        ("hello", "messages", "must be a list of {role, content} dicts, got str"),
        ([], "messages", "got an empty list"),
        (["hi"], "messages[0]", "must be a {role, content} dict, got str"),
        (
            [{"role": "bot", "content": "x"}],
            "messages[0].role",
            "must be one of system, user, assistant, tool",
        ),
        ([{"content": "x"}], "messages[0].role", "is missing"),
        ([{"role": "user", "content": 3}], "messages[0].content", "must be a string, got int"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
            "messages[1].content",
            "empty",
        ),
        ([{"role": "user", "content": "q"}], "messages", "no assistant message"),
    ],
)
def test_bad_messages_name_row_and_field(messages: Any, field: str, message: str) -> None:
    rows = _rows({"messages": CONVERSATION}, {"messages": messages})
    with pytest.raises(DataError) as info:
        _sft(rows, format="messages")
    text = str(info.value)
    assert text.startswith(f"mem.jsonl row 2 (line 2): field '{field}' ")
    assert message in text
    assert "skip_bad_rows" in text
    assert info.value.index == 2 and info.value.field == field


def test_format_mismatch_names_missing_and_extra_fields() -> None:
    rows = _rows({"messages": CONVERSATION}, {"prompt": "p", "completion": " c"})
    with pytest.raises(
        DataError, match=r"row 2 .*'messages' is missing.*detected from .*row 1.*'completion', 'prompt'"
    ):
        _sft(rows)
    with pytest.raises(DataError, match=r"row 1 .*matches no SFT format.*\['question'\]"):
        _sft(_rows({"question": "q"}))


# -- prompt / completion ------------------------------------------------------------------------------------


def test_prompt_completion_targets_are_completion_plus_eos() -> None:
    row = {"prompt": "Question: What is 2 + 2?\nAnswer:", "completion": " 4."}
    (ex,), _ = _sft(_rows(row))
    prompt_ids = TOK(row["prompt"], add_special_tokens=False)["input_ids"]
    completion_ids = TOK(row["completion"], add_special_tokens=False)["input_ids"]
    assert ex.input_ids == prompt_ids + completion_ids + [EOS_TOKEN_ID]
    assert ex.loss_mask == [False] * len(prompt_ids) + [True] * (len(completion_ids) + 1)
    assert _targets(TOK, ex.input_ids, ex.loss_mask) == [" 4.<|im_end|>"]

    (full,), _ = _sft(_rows(row), completion_only_loss=False)
    assert full.input_ids == ex.input_ids and all(full.loss_mask)


def test_prompt_completion_eos_not_doubled() -> None:
    (ex,), _ = _sft(_rows({"prompt": "Q:", "completion": " A.<|im_end|>"}))
    assert ex.input_ids[-1] == EOS_TOKEN_ID and ex.input_ids[-2] != EOS_TOKEN_ID


@pytest.mark.parametrize("marker_free", [False, True], ids=["generation-markers", "prefix-rendering"])
def test_conversational_prompt_completion(marker_free: bool) -> None:
    tok = _without_generation_tags(tiny_tokenizer()) if marker_free else TOK
    row = {"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]}
    (ex,), _ = _sft(_rows(row), tok)
    assert ex.input_ids == TOK.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    # The earlier assistant turn is part of the prompt: only the completion is trained.
    assert _targets(tok, ex.input_ids, ex.loss_mask) == ["3 + 3 = 6.<|im_end|>"]

    (ex,), _ = _sft(_rows({"prompt": CONVERSATION[:2], "completion": " 4."}), tok)
    assert tok.decode(ex.input_ids).endswith("<|im_start|>assistant\n 4.<|im_end|>")
    assert _targets(tok, ex.input_ids, ex.loss_mask) == [" 4.<|im_end|>"]


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({"prompt": "", "completion": " a"}, "prompt", "is empty"),
        ({"prompt": "q", "completion": "   "}, "completion", "is empty"),
        ({"prompt": 5, "completion": " a"}, "prompt", "must be a string or a list of messages, got int"),
        ({"prompt": "q", "completion": {"a": 1}}, "completion", "got dict"),
        ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "completion", "string"),
        (
            {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
            "completion",
            "exactly one assistant message",
        ),
    ],
)
def test_bad_prompt_completion_rows(row: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(DataError) as info:
        _sft(_rows({"prompt": "ok", "completion": " ok"}, row))
    assert str(info.value).startswith(f"mem.jsonl row 2 (line 2): field '{field}' ")
    assert message in str(info.value)


# -- text ---------------------------------------------------------------------------------------------------


def test_text_trains_every_token_and_ends_with_eos() -> None:
    (ex,), _ = _sft(_rows({"text": "Once upon a time."}))
    assert ex.input_ids == TOK("Once upon a time.", add_special_tokens=False)["input_ids"] + [EOS_TOKEN_ID]
    assert all(ex.loss_mask)
    with pytest.raises(DataError, match=r"field 'text' must be a string, got list"):
        _sft(_rows({"text": ["a"]}))


# -- length, skipping ---------------------------------------------------------------------------------------


def test_too_long_row_error_names_row_and_lengths() -> None:
    rows = _rows({"text": "short"}, {"text": "word " * 50})
    n = len(_sft(rows[1:])[0][0])
    with pytest.raises(DataError) as info:
        _sft(rows, max_length=20)
    text = str(info.value)
    assert "row 2 (line 2)" in text and f"is {n} tokens long" in text and "max_length=20" in text
    assert "data.max_length" in text and "data.truncation: truncate" in text
    assert info.value.reason == "too long"


def test_truncate_keeps_first_max_length_tokens() -> None:
    rows = _rows({"messages": CONVERSATION})
    (whole,), _ = _sft(rows)
    n = whole.loss_mask.index(True) + 3  # mid-way through the first answer
    (cut,), _ = _sft(rows, max_length=n, truncation="truncate")
    assert len(cut) == n < len(whole)
    assert cut.input_ids == whole.input_ids[:n] and cut.loss_mask == whole.loss_mask[:n]


def test_truncation_that_leaves_nothing_to_train_is_a_bad_row() -> None:
    rows = _rows({"prompt": "word " * 30, "completion": " end"})
    with pytest.raises(DataError, match="no trainable token left after truncation to max_length=10"):
        _sft(rows, max_length=10, truncation="truncate")


def test_skip_bad_rows_counts_reasons() -> None:
    rows = _rows(
        {"messages": [{"role": "nobody", "content": "x"}]},  # first row bad: format comes from row 2
        {"messages": CONVERSATION},
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]},
        {"messages": CONVERSATION * 20},
        {"text": "wrong format"},
        {"messages": CONVERSATION[:3]},
    )
    examples, stats = _sft(rows, max_length=200, skip_bad_rows=True)
    assert [e.meta["row"] for e in examples] == [2, 6]
    assert stats.kept == 2 and stats.skipped == 4
    assert stats.reasons == {"unknown role": 1, "empty content": 1, "too long": 1, "missing field": 1}
    assert len(stats.examples_of) == 4 and stats.examples_of[0].startswith("mem.jsonl row 1 (line 1)")
    assert "skipped 4 of 6 rows" in stats.summary()
    with pytest.raises(DataError, match="row 1"):
        _sft(rows, max_length=200)


def test_argument_validation() -> None:
    rows = _rows({"text": "x"})
    with pytest.raises(ValueError, match="unknown SFT format"):
        _sft(rows, format="chat")
    with pytest.raises(ValueError, match="unknown truncation"):
        _sft(rows, truncation="cut")
    with pytest.raises(ValueError, match="max_length"):
        _sft(rows, max_length=0)


# -- embedded data ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sft", "sft_prompt_completion", "sft_eval"])
def test_embedded_datasets_tokenize(name: str) -> None:
    rows = load_rows(f"tiny:{name}")
    examples, stats = _sft(rows)
    assert len(examples) == len(rows) and stats.skipped == 0
    for ex in examples:
        assert 0 < len(ex) <= 2048 and len(ex.loss_mask) == len(ex)
        assert any(ex.loss_mask[1:]) and not ex.loss_mask[0]
        assert ex.input_ids[[i for i, m in enumerate(ex.loss_mask) if m][-1]] == EOS_TOKEN_ID
    if name == "sft_prompt_completion":
        # Completions start with a space: tokenizing prompt and completion apart keeps it in the target.
        assert all(
            TOK.decode([t for t, m in zip(e.input_ids, e.loss_mask, strict=True) if m])[0] == " "
            for e in examples
        )


# -- chats without {% generation %} markers: one render per row --------------------------------------------

# Written for these tests, not copied from a model repository. ChatML-style: a default system prompt when the
# chat has none, tool results wrapped in a user turn, tool calls rendered as JSON after the content.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou answer.<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for c in m['tool_calls'] %}"
    "{{ '<tool_call>' + c['name'] + c['arguments'] | tojson + '</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3-header-style: a begin-of-text token, role headers, trimmed contents closed by <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# No special token at all: "role:" headers. After "assistant: " the content's first word takes the space into
# its token, so the generation prompt is no token-prefix and every row is refused; after "assistant:\n" it is.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ':SEP' + m['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:SEP' }}{% endif %}"
)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Templates that render an earlier turn differently once later turns exist: padless must refuse them.
REWRITING_TEMPLATES = {
    # Earlier assistant turns lose their reasoning (a content-dependent rewrite).
    "drops-earlier-thinking": (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # ... or have it re-tagged, which keeps every length: only comparing texts can tell.
    "retags-earlier-thinking": (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.replace('<think>', '<prior>') %}"
        "{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Every header counts the messages left, so each earlier turn changes (same length up to 9 messages).
    "counts-down": (
        "{% for m in messages %}"
        "{{ '<|im_start|>' + m['role'] + ' ' + loop.revindex | string + '\\n' }}"
        "{{ m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant 0\\n' }}{% endif %}"
    ),
    # The last assistant turn gets an empty reasoning block the same turn loses later (a structural rewrite).
    "last-turn-differs": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        "{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}


def _marker_free(template: str):
    tok = tiny_tokenizer()
    if template == LLAMA3_TEMPLATE:  # as Llama 3 instruct models: a turn ends with <|eot_id|>, their eos
        tok.add_tokens(LLAMA3_TOKENS, special_tokens=True)
        tok.eos_token = "<|eot_id|>"
    tok.chat_template = template
    return tok


def _turns(k: int, answer: str = "Answer {i}: {i} + {i} = {j}.", question: str = "What is {i} + {i}?"):
    """A chat of k user/assistant exchanges."""
    chat = []
    for i in range(k):
        chat += [
            {"role": "user", "content": question.format(i=i)},
            {"role": "assistant", "content": answer.format(i=i, j=2 * i)},
        ]
    return chat


TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny."},
]
CHATS = {
    "one-turn": _turns(1),
    "eight-turns": _turns(8),
    "system": [{"role": "system", "content": "Be brief."}, *_turns(3)],
    "ends-with-user": [*_turns(2), {"role": "user", "content": "Thanks!"}],
    "tools": TOOL_CHAT,
    "unicode": _turns(3, answer="日本語 {i} ✓ café 🙂 naïve", question="¿Qué es {i}? Ωμέγα"),
    "leading-space": _turns(2, answer=" {i} with a space"),
    "leading-newlines": _turns(2, answer="\n\n{i} after newlines"),
    "trailing-spaces": _turns(2, answer="{i} then spaces  "),
    "tiny-contents": _turns(3, answer="{i}", question="?"),
    "special-token-text": _turns(2, answer="a <|im_end|> b <|eot_id|> c {i}"),
    "thinking": _turns(2, answer="<think>{i} + {i}</think>{j}"),
    "starts-with-assistant": [{"role": "assistant", "content": "Hi."}, *_turns(1)],
}


def _outcome(rows: list[Row], tok, **kw: Any) -> Any:
    """Each row's (ids, mask), or the error it raises (type and message)."""
    out = []
    for row in rows:
        try:
            (ex,), _ = _sft([row], tok, **kw)
            out.append((ex.input_ids, ex.loss_mask))
        except (DataError, ChatTemplateError) as e:
            out.append((type(e).__name__, str(e)))
    return out


TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    "llama3": LLAMA3_TEMPLATE,
    "plain-newline": PLAIN_TEMPLATE.replace("SEP", "\\n"),
    "plain-space": PLAIN_TEMPLATE.replace("SEP", " "),
    **REWRITING_TEMPLATES,
}

# Of the 25 rows x 2 settings below, one render serves all but those starting with the assistant (4), those
# whose contents the template changes (Llama-3 trims 3 chats, reasoning is cut out of 1), cannot render
# (tool calls without the tiny template's support), those of multi-turn shapes a template rewrites (a
# prompt/completion row checks its completion turn only: the prompt's turns are context, rendered as at
# generation) and, after "assistant: ", those whose content starts with a word (its first token takes the
# space: 6 of 12 chats). Serving a row is not training it: the plain templates end no turn with a stop token,
# so every row they render is refused, by both paths alike.
ROWS_ONE_RENDER_SERVES = {
    "tiny": 42,
    "chatml": 46,
    "llama3": 34,
    "plain-newline": 42,
    "plain-space": 24,
    "drops-earlier-thinking": 38,
    "retags-earlier-thinking": 38,
    "counts-down": 0,
    "last-turn-differs": 22,
}


@pytest.mark.parametrize("template", ["tiny", *TEMPLATES])
def test_one_render_gives_what_prefix_rendering_gives(template: str, monkeypatch) -> None:
    """Ids, masks and errors equal the prefix-by-prefix rendering (padless's former and fallback path), for
    varied chats, conversational prompt/completion rows and truncation."""
    tok = (
        _marker_free(TEMPLATES[template])
        if template in TEMPLATES
        else _without_generation_tags(tiny_tokenizer())
    )
    chats = list(CHATS.values())
    rows = _rows(
        *({"messages": c} for c in chats),
        *({"prompt": c[:-1], "completion": c[-1:]} for c in chats if c[-1]["role"] == "assistant"),
    )
    settings: list[dict[str, Any]] = [{}, {"max_length": 40, "truncation": "truncate"}]
    served = [0]
    layout = SftEncoder._chat_by_layout

    def spy(self, row, messages, last_only):
        got = layout(self, row, messages, last_only)
        served[0] += got is not None
        return got

    monkeypatch.setattr(SftEncoder, "_chat_by_layout", spy)
    fast = [_outcome(rows, tok, **kw) for kw in settings]
    monkeypatch.setattr(SftEncoder, "_chat_by_layout", lambda self, row, messages, last_only: None)
    assert [_outcome(rows, tok, **kw) for kw in settings] == fast
    assert served[0] == ROWS_ONE_RENDER_SERVES[template]


@pytest.mark.parametrize("name", list(REWRITING_TEMPLATES))
def test_templates_that_rewrite_earlier_turns_are_refused(name: str) -> None:
    tok = _marker_free(REWRITING_TEMPLATES[name])
    with pytest.raises(ChatTemplateError, match=r"mem\.jsonl row 1 .*not prefix-stable.*data\.per_turn"):
        _sft(_rows({"messages": CHATS["thinking"]}), tok, skip_bad_rows=True)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE], ids=["chatml", "llama3"])
def test_renders_per_row_do_not_grow_with_turns(template: str, monkeypatch) -> None:
    """Exactly one render per row, plus 2k+1 once for the first row of a shape (its whole and prefix
    renderings with placeholder contents) and 2 once per tokenizer (the end-of-conversation probe);
    prefix-by-prefix rendering took 2k+1 per row."""
    tok = _marker_free(template)
    calls = [0]
    apply = tok.apply_chat_template

    def counted(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        return apply(*args, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    rows_per_shape = 6
    for k in range(1, 9):
        rows = _rows(*({"messages": _turns(k, answer=f"Row {r}: {{i}}.")} for r in range(rows_per_shape)))
        calls[0] = 0
        examples, _ = _sft(rows, tok)
        assert len(examples) == rows_per_shape and all(any(e.loss_mask) for e in examples)
        assert calls[0] == rows_per_shape + 2 * k + 1 + 2 < rows_per_shape * (2 * k + 1) + 2


def test_encoder_pickles_without_its_caches() -> None:
    """Worker processes and dataset fingerprints pickle the encoder: its per-process caches stay behind."""
    enc = SftEncoder(_marker_free(CHATML_TEMPLATE))
    trained = [c for name, c in CHATS.items() if name not in ("starts-with-assistant", "special-token-text")]
    rows = _rows(*({"messages": c} for c in trained))
    before = [enc.messages_row(row) for row in rows]
    assert enc._layout.cache_info().currsize > 0
    copy = pickle.loads(pickle.dumps(enc))
    assert copy._layout.cache_info().currsize == 0
    assert [copy.messages_row(row) for row in rows] == before


# -- per-message train flags (the loss / train / weight conventions of ms-swift and axolotl datasets) and
# the message fields they sit beside (tool calls, reasoning, content parts) ------------------------------

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}, "id": "call_1"}
CALL_CHAT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "8."},
]
CALLS_TOK = templates.TEMPLATES["json-calls"].tokenizer(tiny_tokenizer())


def _mem_row(data: dict[str, Any]) -> Row:
    return Row(data, "mem.jsonl", 3, "line")


def _flagged(flags: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, **flags.get(j, {})} for j, m in enumerate(CALL_CHAT)]


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
    (whole,), _ = tokenize_sft([_mem_row({"messages": CALL_CHAT})], CALLS_TOK, max_length=512)
    spans = _turn_spans(whole.input_ids, whole.loss_mask)
    assert [CALLS_TOK.decode(whole.input_ids[a:b]) for a, b in spans] == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5.<|im_end|>",
        "8.<|im_end|>",
    ]
    for flags, off in [
        ({2: {"loss": False}}, [0]),
        ({4: {"train": False}, 6: {"weight": 0}}, [1, 2]),
        ({2: {"weight": 0.0}, 4: {"loss": True}, 6: {"weight": 1}}, [0]),
    ]:
        (ex,), _ = tokenize_sft([_mem_row({"messages": _flagged(flags)})], CALLS_TOK, max_length=512)
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
    examples, _ = tokenize_sft([_mem_row({"messages": flagged})], CALLS_TOK, max_length=512, per_turn=True)
    every, _ = tokenize_sft([_mem_row({"messages": CALL_CHAT})], CALLS_TOK, max_length=512, per_turn=True)
    assert [e.input_ids for e in examples] == [every[0].input_ids, every[2].input_ids]
    assert [e.loss_mask for e in examples] == [every[0].loss_mask, every[2].loss_mask]
    row = {"prompt": CALL_CHAT[:6], "completion": [{**CALL_CHAT[6], "weight": 0}]}
    with pytest.raises(DataError, match="no trainable token"):
        tokenize_sft([_mem_row(row)], CALLS_TOK, max_length=512)
    (ex,), _ = tokenize_sft([_mem_row(row)], CALLS_TOK, max_length=512, completion_only_loss=False)
    prompt = CALLS_TOK.apply_chat_template(CALL_CHAT[:6], add_generation_prompt=True, return_dict=True)
    prompt = prompt["input_ids"]
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
def test_bad_flags_are_refused_with_the_mem_row(flags, where, says):
    with pytest.raises(DataError) as error:
        tokenize_sft([_mem_row({"messages": _flagged(flags)})], CALLS_TOK, max_length=512)
    assert str(error.value).startswith(f"mem.jsonl row 3 (line 3): field '{where}' ") and says in str(
        error.value
    )


def test_a_flag_where_nothing_trains_turn_by_turn_is_refused():
    """A preference completion trains whole: a flag on it would do nothing, so it is refused."""
    row = {"prompt": CALL_CHAT[:2], "chosen": [{"role": "assistant", "content": "5", "loss": False}]}
    row["rejected"] = [{"role": "assistant", "content": "6"}]
    with pytest.raises(
        DataError, match=r"'chosen\[0\]\.loss' says whether a turn trains, but 'chosen' is never"
    ):
        tokenize_preference([_mem_row(row)], CALLS_TOK, max_length=512)


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
    messages = [CALL_CHAT[1], {"role": "assistant", "content": "x", **message}]
    with pytest.raises(DataError) as error:
        chat_messages(_mem_row({}), "messages", messages)
    assert f"field '{where}' " in str(error.value) and says in str(error.value)
