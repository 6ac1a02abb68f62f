"""RL prompt tokenization: prompts rendered as the assistant will see them, columns carried to the rewards."""

from __future__ import annotations

from typing import Any

import pytest

from padless.data import (
    ChatTemplateError,
    DataError,
    PromptExample,
    Row,
    load_rows,
    reward_inputs,
    tokenize_prompts,
)
from padless.tiny import tiny_tokenizer

TOK = tiny_tokenizer()
QUESTION = "What is 26 + 19? Answer with just the number."


def _rows(*data: dict[str, Any]) -> list[Row]:
    return [Row(d, "mem.jsonl", i + 1, "line") for i, d in enumerate(data)]


def _prompts(rows: list[Row], tokenizer=TOK, **kw: Any):
    kw.setdefault("max_prompt_length", 512)
    return tokenize_prompts(rows, tokenizer, **kw)


def _template(messages: list[dict[str, str]]) -> tuple[list[int], str]:
    out = TOK.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    text = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(out["input_ids"]), text


def _without_template():
    tok = tiny_tokenizer()
    tok.chat_template = None
    return tok


def test_string_prompt_is_wrapped_as_a_user_message_with_the_generation_prompt() -> None:
    for chat_template in (None, True):
        (ex,), stats = _prompts(_rows({"prompt": QUESTION, "answer": "45"}), chat_template=chat_template)
        ids, text = _template([{"role": "user", "content": QUESTION}])
        assert ex.prompt_ids == ids and ex.text == text
        assert text == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        assert TOK.decode(ex.prompt_ids) == text
        assert ex.fields == {"answer": "45"} and ex.meta == {"row": 1, "source": "mem.jsonl"}
        assert len(ex) == len(ids) and stats.kept == 1 and stats.skipped == 0


def test_raw_mode_and_tokenizer_without_template_use_the_text_as_is() -> None:
    want = TOK(QUESTION, add_special_tokens=False)["input_ids"]
    (raw,), _ = _prompts(_rows({"prompt": QUESTION}), chat_template=False)
    assert raw.prompt_ids == want and raw.text == QUESTION and raw.fields == {}
    (auto,), _ = _prompts(_rows({"prompt": QUESTION}), _without_template())
    assert auto.prompt_ids == want and auto.text == QUESTION


def test_message_prompts_render_with_the_template() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    (ex,), _ = _prompts(_rows({"prompt": messages, "answer": 45}))
    assert (ex.prompt_ids, ex.text) == _template(messages)
    assert ex.text.endswith("<|im_start|>assistant\n") and ex.fields == {"answer": 45}


def test_every_other_column_is_carried_in_fields() -> None:
    row = {"prompt": QUESTION, "answer": "45", "tests": ["assert f() == 45"], "difficulty": None, "id": 7}
    (ex,), _ = _prompts(_rows(row))
    assert ex.fields == {"answer": "45", "tests": ["assert f() == 45"], "difficulty": None, "id": 7}


def test_reward_inputs_repeat_each_prompt_and_fill_missing_columns() -> None:
    examples, _ = _prompts(_rows({"prompt": "a?", "answer": "1"}, {"prompt": "b?", "answer": "2", "id": 9}))
    prompts, fields = reward_inputs(examples, 3)
    assert prompts == [examples[0].text] * 3 + [examples[1].text] * 3
    assert fields == {"answer": ["1"] * 3 + ["2"] * 3, "id": [None] * 3 + [9] * 3}
    assert reward_inputs([], 4) == ([], {})
    with pytest.raises(ValueError, match="num_generations"):
        reward_inputs(examples, 0)


@pytest.mark.parametrize(
    ("row", "field", "fragment", "reason"),
    [
        ({"question": QUESTION}, "prompt", "is missing: RL rows need a 'prompt'", "missing field"),
        ({"prompt": None, "answer": "1"}, "prompt", "found ['answer']", "missing field"),
        (
            {"prompt": 42},
            "prompt",
            "must be a string or a list of {role, content} messages, got int",
            "wrong type",
        ),
        ({"prompt": "   "}, "prompt", "is empty", "empty content"),
        ({"prompt": []}, "prompt", "got an empty list", "wrong type"),
        ({"prompt": [{"role": "user"}]}, "prompt[0].content", "must be a string", "wrong type"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt[0].role", "must be one of", "unknown role"),
        (
            {"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
            "prompt[1].role",
            "ends with the message the assistant replies to",
            "ends with assistant",
        ),
    ],
)
def test_bad_rows_name_row_field_and_fix(row: dict[str, Any], field: str, fragment: str, reason: str) -> None:
    rows = _rows({"prompt": "fine?"}, row)
    with pytest.raises(DataError) as info:
        _prompts(rows)
    msg = str(info.value)
    assert msg.startswith(f"mem.jsonl row 2 (line 2): field '{field}' ")
    assert fragment in msg and "data.skip_bad_rows: true" in msg
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    examples, stats = _prompts(rows, skip_bad_rows=True)
    assert [e.meta["row"] for e in examples] == [1]
    assert (stats.kept, stats.skipped, dict(stats.reasons)) == (1, 1, {reason: 1})


def test_prompt_longer_than_max_prompt_length_is_never_truncated() -> None:
    (ex,), _ = _prompts(_rows({"prompt": QUESTION}))
    n = len(ex.prompt_ids)
    assert _prompts(_rows({"prompt": QUESTION}), max_prompt_length=n)[0][0].prompt_ids == ex.prompt_ids
    with pytest.raises(DataError) as info:
        _prompts(_rows({"prompt": QUESTION}), max_prompt_length=n - 1)
    msg = str(info.value)
    assert f"is {n} tokens as rendered, more than max_prompt_length={n - 1}" in msg
    assert "never truncated" in msg and "Raise data.max_prompt_length" in msg
    assert info.value.reason == "prompt too long"
    examples, stats = _prompts(_rows({"prompt": QUESTION}), max_prompt_length=n - 1, skip_bad_rows=True)
    assert examples == [] and stats.skipped == 1 and "prompt too long (1)" in stats.summary()


def test_messages_in_raw_mode_are_a_bad_row() -> None:
    rows = _rows({"prompt": [{"role": "user", "content": QUESTION}]})
    with pytest.raises(DataError, match=r"data\.chat_template is false .* set data\.chat_template to null"):
        _prompts(rows, chat_template=False)


def test_template_problems_are_tokenizer_errors_never_skipped() -> None:
    tok = _without_template()
    with pytest.raises(ChatTemplateError, match=r"data\.chat_template is true, but the tokenizer has no"):
        _prompts(_rows({"prompt": QUESTION}), tok, chat_template=True, skip_bad_rows=True)
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        _prompts(_rows({"prompt": [{"role": "user", "content": QUESTION}]}), tok, skip_bad_rows=True)


def test_argument_checks_and_empty_input() -> None:
    examples, stats = _prompts([])
    assert examples == [] and stats.kept == stats.skipped == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_prompt_length must be a positive integer"):
            _prompts(_rows({"prompt": "x"}), max_prompt_length=bad)
    with pytest.raises(ValueError, match="chat_template must be None, True or False"):
        _prompts(_rows({"prompt": "x"}), chat_template="auto")


def test_embedded_rl_prompts_all_load_with_answers() -> None:
    rows = load_rows("tiny:rl")
    examples, stats = _prompts(rows)
    assert stats.skipped == 0 and len(examples) == len(rows) == 300
    assert all(isinstance(e, PromptExample) and set(e.fields) == {"answer"} for e in examples)
    assert all(e.text.endswith("<|im_start|>assistant\n") for e in examples)
    assert max(len(e) for e in examples) <= 512
    assert all(e.fields["answer"].lstrip("-").isdigit() for e in examples)
