"""Preference tokenization: both sides share the exact prompt ids, and only each completion is a target."""

from __future__ import annotations

import re
from typing import Any

import pytest

from padless.data import (
    ChatTemplateError,
    DataError,
    PairExample,
    Row,
    SkipStats,
    load_rows,
    tokenize_preference,
    tokenize_scoring,
)
from padless.tiny import EOS_TOKEN_ID, tiny_tokenizer

TOK = tiny_tokenizer()

PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
]
GOOD = {"role": "assistant", "content": "2 + 2 = 4."}
BAD = {"role": "assistant", "content": "2 + 2 = 5."}


def _rows(*data: dict[str, Any]) -> list[Row]:
    return [Row(d, "mem.jsonl", i + 1, "line") for i, d in enumerate(data)]


def _encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def _without_generation_tags():
    tok = tiny_tokenizer()
    tok.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", tok.chat_template)
    assert "generation %}" not in tok.chat_template
    return tok


def _pairs(rows: list[Row], tokenizer=TOK, **kw: Any) -> tuple[list[PairExample], SkipStats]:
    kw.setdefault("max_length", 2048)
    return tokenize_preference(rows, tokenizer, **kw)


def _check(pair: PairExample) -> tuple[list[int], str, str]:
    """Assert the pair invariants; return the prompt ids and the decoded chosen and rejected targets."""
    n = pair.prompt_length
    assert n > 0
    prompt = pair.chosen.input_ids[:n]
    assert pair.rejected.input_ids[:n] == prompt, "chosen and rejected must share the prompt ids"
    targets = []
    for ex in (pair.chosen, pair.rejected):
        assert ex.loss_mask == [False] * n + [True] * (len(ex) - n), "targets: exactly the completion"
        targets.append(TOK.decode(ex.input_ids[n:]))
    assert len(pair) == len(pair.chosen) + len(pair.rejected)
    return prompt, targets[0], targets[1]


# -- the four row forms ------------------------------------------------------------------------------------


def test_explicit_string_prompt_is_raw_text_with_exact_boundary() -> None:
    row = {"prompt": "Question: What is 2 + 2?\nAnswer:", "chosen": " 4.", "rejected": " 5.", "id": 3}
    (pair,), stats = _pairs(_rows(row))
    prompt, chosen, rejected = _check(pair)
    # No chat template for plain strings (like TRL's standard format), even though the tokenizer has one.
    assert prompt == _encode(row["prompt"])
    assert pair.chosen.input_ids == prompt + _encode(" 4.") + [EOS_TOKEN_ID]
    assert (chosen, rejected) == (" 4.<|im_end|>", " 5.<|im_end|>")
    assert pair.meta == {"row": 1, "source": "mem.jsonl"}
    assert pair.chosen.meta["side"] == "chosen" and pair.rejected.meta["side"] == "rejected"
    assert stats.kept == 1 and stats.skipped == 0


def test_explicit_string_eos_not_doubled() -> None:
    (pair,), _ = _pairs(_rows({"prompt": "Q:", "chosen": " A.<|im_end|>", "rejected": " B."}))
    assert pair.chosen.input_ids[-1] == EOS_TOKEN_ID and pair.chosen.input_ids[-2] != EOS_TOKEN_ID
    assert pair.rejected.input_ids[-1] == EOS_TOKEN_ID


@pytest.mark.parametrize("marker_free", [False, True], ids=["generation-markers", "prefix-rendering"])
def test_conversational_prompt(marker_free: bool) -> None:
    tok = _without_generation_tags() if marker_free else TOK
    (pair,), _ = _pairs(_rows({"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]}), tok)
    prompt, chosen, rejected = _check(pair)
    assert (
        prompt == TOK.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    assert (chosen, rejected) == ("2 + 2 = 4.<|im_end|>", "2 + 2 = 5.<|im_end|>")
    # The sequence is the rendered conversation, ending at the end-of-turn token (the trailing "\n" is glue).
    full = TOK.apply_chat_template([*PROMPT, GOOD], return_dict=True)["input_ids"]
    assert pair.chosen.input_ids == full[: len(pair.chosen)] and TOK.decode(full[len(pair.chosen) :]) == "\n"


def test_implicit_conversational_prompt_equals_explicit() -> None:
    implicit = {"chosen": [*PROMPT, GOOD], "rejected": [*PROMPT, BAD]}
    explicit = {"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]}
    (a,), _ = _pairs(_rows(implicit))
    (b,), _ = _pairs(_rows(explicit))
    _check(a)
    assert a.chosen.input_ids == b.chosen.input_ids and a.chosen.loss_mask == b.chosen.loss_mask
    assert a.rejected.input_ids == b.rejected.input_ids and a.rejected.loss_mask == b.rejected.loss_mask


def test_implicit_string_prompt_is_longest_common_token_prefix() -> None:
    row = {"chosen": "The sky is blue.", "rejected": "The sky is bluish green."}
    (pair,), _ = _pairs(_rows(row))
    prompt, chosen, rejected = _check(pair)
    # Each side is exactly the tokenization of its whole text, plus eos.
    assert pair.chosen.input_ids == [*_encode(row["chosen"]), EOS_TOKEN_ID]
    assert pair.rejected.input_ids == [*_encode(row["rejected"]), EOS_TOKEN_ID]
    assert TOK.decode(prompt) + chosen == row["chosen"] + "<|im_end|>"
    assert TOK.decode(prompt) + rejected == row["rejected"] + "<|im_end|>"
    assert pair.chosen.input_ids[len(prompt)] != pair.rejected.input_ids[len(prompt)]


def test_margin_kept_as_float() -> None:
    (pair,), _ = _pairs(_rows({"prompt": "Q:", "chosen": " a", "rejected": " b", "margin": 2}))
    assert pair.meta["margin"] == 2.0 and type(pair.meta["margin"]) is float
    (pair,), _ = _pairs(_rows({"prompt": "Q:", "chosen": " a", "rejected": " b", "margin": None}))
    assert "margin" not in pair.meta


# -- bad rows ----------------------------------------------------------------------------------------------

FIRST = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
IMPLICIT_FIRST = {"chosen": "Q: a", "rejected": "Q: b"}


@pytest.mark.parametrize(
    ("first", "row", "field", "message", "reason"),
    [
        (FIRST, {"chosen": "Q: a", "rejected": "Q: b"}, "prompt", "is missing", "missing field"),
        (FIRST, {"prompt": "Q:", "rejected": " b"}, "chosen", "is missing", "missing field"),
        (FIRST, {"prompt": "Q:", "chosen": " a"}, "rejected", "is missing", "missing field"),
        (FIRST, {"prompt": 5, "chosen": " a", "rejected": " b"}, "prompt", "got int", "wrong type"),
        (FIRST, {"prompt": "Q:", "chosen": 3, "rejected": " b"}, "chosen", "got int", "wrong type"),
        (FIRST, {"prompt": "", "chosen": " a", "rejected": " b"}, "prompt", "is empty", "empty content"),
        (FIRST, {"prompt": "Q:", "chosen": "  ", "rejected": " b"}, "chosen", "is empty", "empty content"),
        (
            FIRST,
            {"prompt": "Q:", "chosen": " a", "rejected": " a"},
            "rejected",
            "equals 'chosen'",
            "chosen equals rejected",
        ),
        (
            FIRST,
            {"prompt": "Q:", "chosen": [GOOD], "rejected": " b"},
            "chosen",
            "prompt is a string",
            "wrong type",
        ),
        (
            FIRST,
            {"prompt": PROMPT, "chosen": [GOOD], "rejected": " b"},
            "rejected",
            "one assistant",
            "wrong type",
        ),
        (
            FIRST,
            {"prompt": PROMPT, "chosen": [GOOD, GOOD], "rejected": [BAD]},
            "chosen",
            "exactly one assistant message",
            "wrong type",
        ),
        (
            FIRST,
            {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": ""}], "rejected": [BAD]},
            "chosen[0].content",
            "is empty",
            "empty content",
        ),
        (
            FIRST,
            {"prompt": PROMPT, "chosen": [GOOD], "rejected": [GOOD]},
            "rejected",
            "equals 'chosen'",
            "chosen equals rejected",
        ),
        (FIRST, {**FIRST, "margin": "big"}, "margin", "must be a finite number", "wrong type"),
        (FIRST, {**FIRST, "margin": True}, "margin", "must be a finite number", "wrong type"),
        (IMPLICIT_FIRST, {"chosen": "Q: a", "rejected": [BAD]}, "rejected", "must be a string", "wrong type"),
        (IMPLICIT_FIRST, {"chosen": 1, "rejected": "b"}, "chosen", "got int", "wrong type"),
        (
            IMPLICIT_FIRST,
            {"chosen": "Q: a", "rejected": "Q: a"},
            "rejected",
            "equals",
            "chosen equals rejected",
        ),
        (
            IMPLICIT_FIRST,
            {"chosen": "Q: a", "rejected": "Q: a b"},
            "chosen",
            "adds no token",
            "empty content",
        ),
        (
            IMPLICIT_FIRST,
            {"chosen": [*PROMPT, GOOD], "rejected": [PROMPT[0], {"role": "user", "content": "Hi"}, BAD]},
            "chosen",
            "exactly one assistant message",
            "wrong type",
        ),
        (
            IMPLICIT_FIRST,
            {"chosen": [*PROMPT, GOOD], "rejected": [*PROMPT, GOOD]},
            "rejected",
            "equals",
            "chosen equals rejected",
        ),
        (
            IMPLICIT_FIRST,
            {"chosen": [*PROMPT, GOOD], "rejected": PROMPT},
            "rejected",
            "exactly one assistant message",
            "wrong type",
        ),
    ],
)
def test_bad_rows_name_row_and_field(
    first: dict[str, Any], row: dict[str, Any], field: str, message: str, reason: str
) -> None:
    rows = _rows(first, row)
    with pytest.raises(DataError) as info:
        _pairs(rows)
    text = str(info.value)
    assert text.startswith(f"mem.jsonl row 2 (line 2): field '{field}' "), text
    assert message in text and "skip_bad_rows" in text
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    # ... and skip_bad_rows counts it instead.
    pairs, stats = _pairs(rows, skip_bad_rows=True)
    assert len(pairs) == 1 and stats.skipped == 1 and stats.reasons == {reason: 1}


@pytest.mark.parametrize(
    "row",
    [{"chosen": "apple", "rejected": "banana"}, {"chosen": [GOOD], "rejected": [BAD]}],
    ids=["text", "messages"],
)
def test_implicit_pair_without_shared_prefix(row: dict[str, Any]) -> None:
    with pytest.raises(
        DataError, match=r"row 1 .*'chosen' and 'rejected' .*share no prompt.*'prompt'"
    ) as info:
        _pairs(_rows(row))
    assert info.value.reason == "no shared prompt"


def test_missing_margin_when_required() -> None:
    with pytest.raises(DataError, match=r"row 1 .*field 'margin' is missing.*rm\.margin") as info:
        _pairs(_rows(FIRST), require_margin=True)
    assert info.value.field == "margin"
    (pair,), _ = _pairs(_rows({**FIRST, "margin": -0.5}), require_margin=True)
    assert pair.meta["margin"] == -0.5


def test_chat_template_problems_are_not_skipped() -> None:
    tok = tiny_tokenizer()
    # The generation prompt opens a reasoning block the rendered assistant turn does not have.
    tok.chat_template = tok.chat_template.replace(
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}",
    )
    assert "<think>" in tok.chat_template
    row = {"prompt": PROMPT, "chosen": [GOOD], "rejected": [BAD]}
    with pytest.raises(ChatTemplateError, match=r"row 1 .*not prefix-stable"):
        _pairs(_rows(row), tok, skip_bad_rows=True)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        _pairs(_rows(row), tok, skip_bad_rows=True)


# -- lengths -----------------------------------------------------------------------------------------------

LONG = {
    "prompt": "Question: What is two plus two?\nAnswer:",
    "chosen": " " + "four " * 40,
    "rejected": " five.",
}


def test_too_long_error_names_side_and_lengths() -> None:
    prompt_len = len(_encode(LONG["prompt"]))
    with pytest.raises(DataError) as info:
        _pairs(_rows(LONG), max_length=30)
    text = str(info.value)
    assert text.startswith("mem.jsonl row 1 (line 1): field 'chosen' makes a sequence of ")
    assert f"prompt {prompt_len} + completion" in text and "max_length=30" in text
    assert "data.truncation: truncate" in text and "data.max_length" in text
    assert info.value.reason == "too long"


def test_truncate_cuts_the_completion_and_keeps_the_prompt() -> None:
    (full,), _ = _pairs(_rows(LONG))
    (cut,), _ = _pairs(_rows(LONG), max_length=30, truncation="truncate")
    prompt, _, _ = _check(cut)
    assert prompt == _encode(LONG["prompt"]) and cut.prompt_length == full.prompt_length
    assert len(cut.chosen) == 30 and cut.chosen.input_ids == full.chosen.input_ids[:30]
    assert cut.rejected.input_ids == full.rejected.input_ids  # short enough already


def test_prompt_too_long_is_a_bad_row_even_when_truncating() -> None:
    prompt_len = len(_encode(LONG["prompt"]))
    for truncation in ("error", "truncate"):
        with pytest.raises(
            DataError, match=rf"row 1 .*field 'prompt' is {prompt_len} tokens.*no room"
        ) as info:
            _pairs(_rows(LONG), max_length=prompt_len, truncation=truncation)
        assert (info.value.field, info.value.reason) == ("prompt", "prompt too long")
    implicit = {"chosen": LONG["prompt"] + " four.", "rejected": LONG["prompt"] + " five."}
    with pytest.raises(DataError, match=r"the prompt \(the prefix 'chosen' and 'rejected' share\) is"):
        _pairs(_rows(implicit), max_length=5, truncation="truncate")


def test_truncation_that_makes_both_sides_equal() -> None:
    row = {"prompt": "Q:", "chosen": " same same same yes", "rejected": " same same same no"}
    with pytest.raises(DataError, match=r"field 'rejected' equals 'chosen' once both are truncated") as info:
        _pairs(_rows(row), max_length=4, truncation="truncate")
    assert info.value.reason == "chosen equals rejected"


def test_skip_bad_rows_counts_reasons() -> None:
    rows = _rows(
        FIRST,
        {"prompt": "Q:", "chosen": " a", "rejected": " a"},
        {"prompt": "Q:", "rejected": " b"},
        LONG,
        {"prompt": "Q:", "chosen": " c", "rejected": " d"},
    )
    pairs, stats = _pairs(rows, max_length=30, skip_bad_rows=True)
    assert [p.meta["row"] for p in pairs] == [1, 5]
    assert stats.kept == 2 and stats.skipped == 3
    assert stats.reasons == {"chosen equals rejected": 1, "missing field": 1, "too long": 1}
    assert "skipped 3 of 5 rows" in stats.summary()


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="truncation"):
        _pairs(_rows(FIRST), truncation="cut")
    with pytest.raises(ValueError, match="max_length"):
        _pairs(_rows(FIRST), max_length=0)
    assert _pairs([]) == ([], SkipStats())


@pytest.mark.parametrize("name", ["preference", "preference_eval"])
def test_embedded_datasets_tokenize(name: str) -> None:
    rows = load_rows(f"tiny:{name}")
    pairs, stats = _pairs(rows)
    assert len(pairs) == len(rows) and stats.skipped == 0
    for pair, row in zip(pairs, rows, strict=True):
        prompt, chosen, _ = _check(pair)
        assert prompt == _encode(row.data["prompt"]) and chosen == row.data["chosen"] + "<|im_end|>"
        assert max(len(pair.chosen), len(pair.rejected)) <= 2048


# -- scoring -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [("Question: What is 2 + 2?\nAnswer:", " 4."), (PROMPT, [GOOD])],
    ids=["text", "messages"],
)
def test_scoring_sequence_equals_the_chosen_sequence(prompt: Any, completion: Any) -> None:
    other = " 5." if isinstance(completion, str) else [BAD]
    (pair,), _ = _pairs(_rows({"prompt": prompt, "chosen": completion, "rejected": other}))
    (scored,), _ = tokenize_scoring(_rows({"prompt": prompt, "response": completion}), TOK, max_length=2048)
    assert scored.input_ids == pair.chosen.input_ids
    assert scored.loss_mask is None and scored.meta == {"row": 1, "source": "mem.jsonl"}


def test_scoring_errors_and_skips() -> None:
    rows = _rows({"prompt": "Q:", "response": " a"}, {"prompt": "Q:", "chosen": " a"}, LONG)
    with pytest.raises(DataError, match=r"row 2 .*field 'response' is missing") as info:
        tokenize_scoring(rows, TOK, max_length=2048)
    assert info.value.field == "response"
    scored, stats = tokenize_scoring(rows, TOK, max_length=2048, skip_bad_rows=True)
    assert [e.meta["row"] for e in scored] == [1] and stats.skipped == 2
    assert stats.reasons == {"missing field": 2}  # LONG has no 'response' either
    long_row = _rows({"prompt": LONG["prompt"], "response": LONG["chosen"]})
    (cut,), _ = tokenize_scoring(long_row, TOK, max_length=30, truncation="truncate")
    assert len(cut) == 30
