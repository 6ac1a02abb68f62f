"""SFT rows → :class:`~padless.packing.Example`: which tokens are targets, checked rather than guessed.

Three row formats are accepted (detected from the first row, or given): ``messages`` (a chat; loss on what the
assistant writes), ``prompt`` + ``completion`` (loss on the completion) and ``text`` (loss on everything).

For chats the loss mask comes from the chat template's ``{% generation %}`` markers when it has them.
Otherwise it is derived by rendering the conversation prefix by prefix, and every prefix is checked to be a
token-prefix of the full rendering: a template that rewrites earlier turns (e.g. drops reasoning) would
silently mis-assign targets, so it is refused with :class:`ChatTemplateError` instead.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from padless.data.images import ImageInputs, check_parts, reject_images
from padless.data.records import DataError, Row
from padless.packing import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SftFormat = Literal["auto", "messages", "prompt_completion", "text"]
Truncation = Literal["error", "truncate"]

ROLES = ("system", "user", "assistant", "tool")
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
# Tokens that close a chat turn in common templates; the end-of-sequence token is always included too.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TEMPLATE_FIX = (
    "Use a chat template that wraps assistant content in {% generation %}...{% endgeneration %}: padless "
    "then reads the loss mask from those markers instead of rendering prefixes."
)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot give a trustworthy loss mask.

    Never skipped by ``skip_bad_rows``: the tokenizer, not the row, needs fixing.
    """


@dataclass
class SkipStats:
    """What ``skip_bad_rows`` dropped, so a run can report it instead of silently shrinking the data."""

    skipped: int = 0
    kept: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    examples_of: list[str] = field(default_factory=list)
    rows_of: dict[str, list[int]] = field(default_factory=dict)  # reason -> its first row numbers

    MAX_EXAMPLES: ClassVar[int] = 5
    MAX_ROWS: ClassVar[int] = 3

    def record(self, error: DataError) -> None:
        self.skipped += 1
        self.reasons[error.reason] += 1
        if len(self.examples_of) < self.MAX_EXAMPLES:
            self.examples_of.append(str(error))
        rows = self.rows_of.setdefault(error.reason, [])
        if error.index is not None and len(rows) < self.MAX_ROWS:
            rows.append(error.index)

    def summary(self) -> str:
        """``skipped 3 of 40 rows: too long (2) at rows 5, 17; not an object (1) at row 9``."""
        if not self.skipped:
            return f"kept all {self.kept} rows"
        causes = []
        for reason, n in self.reasons.most_common():
            rows = self.rows_of.get(reason, [])
            where = f" at row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}" if rows else ""
            causes.append(f"{reason} ({n}){where}{', ...' if n > len(rows) and rows else ''}")
        return f"skipped {self.skipped} of {self.skipped + self.kept} rows: {'; '.join(causes)}"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _present(row: Row) -> set[str]:
    # datasets/parquet fill a column missing from a row with None, so None counts as absent.
    return {k for k, v in row.data.items() if v is not None}


def _matching_format(row: Row) -> str | None:
    present = _present(row)
    for fmt, needed in FORMAT_FIELDS.items():
        if all(f in present for f in needed):
            return fmt
    return None


def detect_format(row: Row) -> str:
    """The SFT format a row's fields indicate: ``messages``, else ``prompt``/``completion``, else ``text``."""
    fmt = _matching_format(row)
    if fmt is None:
        raise row.error(
            None,
            f"matches no SFT format: expected a 'messages' field, 'prompt' + 'completion' fields or a 'text' "
            f"field, found {sorted(_present(row)) or 'no non-null fields'}",
            reason="unknown format",
            fix="Rename the fields, pass data.format explicitly, or set data.skip_bad_rows: true to skip it.",
        )
    return fmt


def _check_fields(row: Row, fmt: str, how: str) -> None:
    present = _present(row)
    missing = [f for f in FORMAT_FIELDS[fmt] if f not in present]
    if not missing:
        return
    others = sorted({f for fs in FORMAT_FIELDS.values() for f in fs} - set(FORMAT_FIELDS[fmt]) & present)
    has = f"; it has {', '.join(repr(f) for f in others)} instead" if others else ""
    raise row.error(
        missing[0],
        f"is missing: the dataset's format is {fmt!r} ({how}), which needs "
        f"{' and '.join(repr(f) for f in FORMAT_FIELDS[fmt])}{has}",
        reason="missing field",
        fix="Make every row use the same format, or set data.skip_bad_rows: true to skip it.",
    )


def _nonempty_str(row: Row, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise row.error(name, f"must be a string, got {_type_name(value)}", reason="wrong type")
    if not value.strip():
        raise row.error(name, "is empty; it must contain text", reason="empty content")
    return value


def _messages(row: Row, name: str, value: Any) -> list[dict[str, Any]]:
    """Validated copy of a message list, with null-valued keys (schema filler from datasets) dropped."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _type_name(value)
        raise row.error(name, f"must be a list of {{role, content}} dicts, got {got}", reason="wrong type")
    out = []
    for j, msg in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(msg, dict):
            raise row.error(
                where, f"must be a {{role, content}} dict, got {_type_name(msg)}", reason="wrong type"
            )
        msg = {k: v for k, v in msg.items() if v is not None}
        role = msg.get("role")
        if role is None:
            raise row.error(
                f"{where}.role", f"is missing; it must be one of {', '.join(ROLES)}", reason="missing field"
            )
        if role not in ROLES:
            raise row.error(
                f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}", reason="unknown role"
            )
        # An assistant turn that only calls tools may have no text; every other message must have some.
        if isinstance(msg.get("content"), list):
            check_parts(row, f"{where}.content", msg["content"])
        elif not (role == "assistant" and msg.get("tool_calls") and not msg.get("content")):
            _nonempty_str(row, f"{where}.content", msg.get("content"))
        out.append(msg)
    return out


def _trainable(mask: Sequence[bool]) -> int:
    # Token 0 is never predicted (nothing precedes it), so only later targets can carry loss.
    return sum(mask[1:])


class _Encoder:
    """Tokenizer-derived facts, computed once per dataset."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tok = tokenizer

    @cached_property
    def eos(self) -> int:
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(
                "the tokenizer has no eos_token, but 'text' and 'prompt'/'completion' rows end with it so "
                "the model learns to stop. Set tokenizer.eos_token (e.g. to the end-of-turn token)."
            )
        return eos

    @cached_property
    def leading_specials(self) -> list[int]:
        """Tokens the tokenizer puts before text (e.g. BOS), found by probing; trailing ones are not used."""
        with_sp = self.tok("a", add_special_tokens=True)["input_ids"]
        bare = self.tok("a", add_special_tokens=False)["input_ids"]
        for k in range(len(with_sp) - len(bare) + 1):
            if with_sp[k : k + len(bare)] == bare:
                return list(with_sp[:k])
        return []

    @cached_property
    def template(self) -> str | None:
        try:
            return self.tok.get_chat_template()
        except (ValueError, AttributeError):
            return None

    @cached_property
    def has_generation_markers(self) -> bool:
        return self.template is not None and _GENERATION_TAG.search(self.template) is not None

    @cached_property
    def end_of_turn_ids(self) -> set[int]:
        vocab = self.tok.get_vocab()
        ids = {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        if self.tok.eos_token_id is not None:
            ids.add(self.tok.eos_token_id)
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def require_template(self, row: Row) -> None:
        if self.template is None:
            raise ChatTemplateError(
                f"{row.where} is a conversation (list of messages), but the tokenizer has no chat_template. "
                "Set tokenizer.chat_template to a Jinja chat template (ideally one with {% generation %} "
                "markers around assistant content), or use 'prompt'/'completion' strings or 'text' rows."
            )

    def render(self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        try:
            out = self.tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template is user-supplied Jinja; its raise_exception lands here
            raise row.error(
                None,
                f"the chat template cannot render this conversation ({type(e).__name__}: {e})",
                reason="chat template rejected row",
            ) from e
        return list(out["input_ids"])

    # -- chats -----------------------------------------------------------------------------------------------

    def chat(self, row: Row, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and which of them the assistant wrote (content + end-of-turn token)."""
        self.require_template(row)
        if not self.has_generation_markers:
            return self._chat_by_prefixes(row, messages)
        try:
            out = self.tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as e:
            raise row.error(
                None,
                f"the chat template cannot render this conversation ({type(e).__name__}: {e})",
                reason="chat template rejected row",
            ) from e
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        if not any(mask):
            raise ChatTemplateError(
                f"{row.where}: the chat template has {{% generation %}} markers, but they marked no token of "
                "this conversation although it has assistant content. Put the markers around every "
                "assistant message's content and end-of-turn token."
            )
        return ids, mask

    def _chat_by_prefixes(self, row: Row, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        full = self.render(row, messages, generation_prompt=False)
        mask = [False] * len(full)
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            if i == 0:
                raise row.error(
                    "messages[0].role",
                    "is 'assistant': without {% generation %} markers in the chat template, the assistant "
                    "header can only be told apart from the content when a message precedes it",
                    reason="starts with assistant",
                    fix="Start the conversation with a system or user message, or set data.skip_bad_rows: "
                    f"true to skip it. {_TEMPLATE_FIX}",
                )
            head = self.render(row, messages[:i], generation_prompt=True)
            upto = self.render(row, messages[: i + 1], generation_prompt=False)
            for label, part in (
                (f"the first {i} message(s) plus the generation prompt", head),
                (f"the first {i + 1} message(s)", upto),
            ):
                if full[: len(part)] != part:
                    raise self._unstable(row, label, part, full)
            if len(upto) <= len(head):
                raise ChatTemplateError(
                    f"{row.where}: rendering messages[{i}] (assistant) added no token after the generation "
                    f"prompt, so its targets cannot be located. {_TEMPLATE_FIX}"
                )
            # Targets run to the turn's last end-of-turn token; what follows it (e.g. "\n") is template glue
            # that precedes the next header, not something the assistant generates.
            segment = full[len(head) : len(upto)]
            ends = [k for k, t in enumerate(segment) if t in self.end_of_turn_ids]
            stop = len(head) + (ends[-1] + 1 if ends else len(segment))
            mask[len(head) : stop] = [True] * (stop - len(head))
        return full, mask

    def _unstable(self, row: Row, label: str, part: list[int], full: list[int]) -> ChatTemplateError:
        k = next(
            (j for j, (a, b) in enumerate(zip(part, full, strict=False)) if a != b), min(len(part), len(full))
        )
        got, want = self.tok.decode(part[k : k + 12]), self.tok.decode(full[k : k + 12])
        return ChatTemplateError(
            f"{row.where}: the chat template is not prefix-stable: rendering {label} is not a token prefix "
            f"of the whole conversation (they differ at token {k}: {got!r} vs {want!r}). Such a template "
            "renders earlier turns differently once later turns exist, so padless cannot tell which tokens "
            f"the assistant wrote and refuses to guess. {_TEMPLATE_FIX}"
        )

    # -- row formats -----------------------------------------------------------------------------------------

    def messages_row(self, row: Row) -> tuple[list[int], list[bool]]:
        messages = _messages(row, "messages", row.data["messages"])
        if not any(m["role"] == "assistant" and m.get("content") for m in messages):
            raise row.error(
                "messages",
                "has no assistant message with content, so there is nothing to train on",
                reason="no assistant message",
            )
        return self.chat(row, messages)

    def prompt_completion_row(self, row: Row, completion_only_loss: bool) -> tuple[list[int], list[bool]]:
        prompt, completion = row.data["prompt"], row.data["completion"]
        prompt_msgs: list[dict[str, Any]] = []
        if isinstance(prompt, list):
            prompt_msgs = _messages(row, "prompt", prompt)
            self.require_template(row)
            prompt_ids = self.render(row, prompt_msgs, generation_prompt=True)
        elif isinstance(prompt, str):
            prompt_ids = self.leading_specials + self.encode(_nonempty_str(row, "prompt", prompt))
            if isinstance(completion, list):
                raise row.error(
                    "completion",
                    "is a list of messages but 'prompt' is a string; a conversational completion "
                    "continues a conversational prompt (a list of messages)",
                    reason="wrong type",
                )
        else:
            raise row.error(
                "prompt",
                f"must be a string or a list of messages, got {_type_name(prompt)}",
                reason="wrong type",
            )

        if isinstance(completion, list):
            done = _messages(row, "completion", completion)
            if len(done) != 1 or done[0]["role"] != "assistant" or not done[0].get("content"):
                raise row.error(
                    "completion",
                    "must be a list with exactly one assistant message with content, got "
                    f"{len(done)} message(s) with role(s) {[m['role'] for m in done]}",
                    reason="wrong type",
                )
            ids, mask = self.chat(row, prompt_msgs + done)
            if ids[: len(prompt_ids)] != prompt_ids:
                raise self._unstable(row, "the prompt plus the generation prompt", prompt_ids, ids)
            start = len(prompt_ids)
            mask = [False] * start + mask[start:]
        elif isinstance(completion, str):
            done_ids = self.encode(_nonempty_str(row, "completion", completion))
            if done_ids[-1:] != [self.eos]:
                done_ids.append(self.eos)
            ids = prompt_ids + done_ids
            mask = [False] * len(prompt_ids) + [True] * len(done_ids)
        else:
            raise row.error(
                "completion",
                f"must be a string or a list with one assistant message, got {_type_name(completion)}",
                reason="wrong type",
            )
        if not completion_only_loss:
            mask = [True] * len(ids)
        return ids, mask

    def text_row(self, row: Row) -> tuple[list[int], list[bool]]:
        ids = self.leading_specials + self.encode(_nonempty_str(row, "text", row.data["text"]))
        if ids[-1:] != [self.eos]:
            ids.append(self.eos)
        return ids, [True] * len(ids)


def _fit(
    row: Row, ids: list[int], mask: list[bool], max_length: int, truncation: Truncation
) -> tuple[list[int], list[bool]]:
    if _trainable(mask) == 0:
        raise row.error(
            None, "the row has no trainable token (no token is a target)", reason="no trainable token"
        )
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "error":
        raise row.error(
            None,
            f"the row is {len(ids)} tokens long, more than max_length={max_length}",
            reason="too long",
            fix="Raise data.max_length, set data.truncation: truncate to keep the first max_length tokens, "
            "or set data.skip_bad_rows: true to skip it.",
        )
    ids, mask = ids[:max_length], mask[:max_length]
    if _trainable(mask) == 0:
        raise row.error(
            None,
            f"the row has no trainable token left after truncation to max_length={max_length}",
            reason="no trainable token after truncation",
            fix="Raise data.max_length, shorten the prompt, or set data.skip_bad_rows: true to skip it.",
        )
    return ids, mask


def check_sft_args(format: str, max_length: int, truncation: str) -> None:
    if format not in ("auto", *FORMAT_FIELDS):
        raise ValueError(f"unknown SFT format {format!r}; valid: auto, {', '.join(FORMAT_FIELDS)}")
    if truncation not in ("error", "truncate"):
        raise ValueError(f"unknown truncation {truncation!r}; valid: error, truncate")
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")


def sft_format(rows: Iterable[Row], format: SftFormat, skip_bad_rows: bool) -> tuple[str, str]:
    """The format every row must have and how it was decided (for messages): ``format`` unless ``"auto"``,
    else detected from the first row (the first well-formed one when skipping bad rows). Reads rows only
    as far as it needs to."""
    if format != "auto":
        return format, "set by data.format"
    rows = iter(rows)
    first = next(rows)
    chosen = first
    if skip_bad_rows and not _matching_format(first):
        chosen = next((r for r in rows if _matching_format(r)), first)
    return detect_format(chosen), f"detected from {chosen.where}"


def sft_example(
    row: Row,
    enc: _Encoder,
    fmt: str,
    how: str,
    *,
    max_length: int,
    truncation: Truncation,
    completion_only_loss: bool,
    images: ImageInputs | None = None,
) -> Example:
    """One row as an example; a bad row raises :class:`DataError` (see :func:`tokenize_sft`)."""
    _check_fields(row, fmt, how)
    if images is None:
        reject_images(row)
    else:
        prepared = images.prepare(row)
        row = prepared.row
    if fmt == "messages":
        ids, mask = enc.messages_row(row)
    elif fmt == "prompt_completion":
        ids, mask = enc.prompt_completion_row(row, completion_only_loss)
    else:
        ids, mask = enc.text_row(row)
    if images is not None:
        ids, mask, vision = images.expand(row, ids, mask, prepared.images)
        if truncation == "truncate":
            ids, mask, vision = images.fit(row, ids, mask, vision, max_length)
    ids, mask = _fit(row, ids, mask, max_length, truncation)
    meta = {"row": row.index, "source": row.source}
    return Example(ids, mask, meta) if images is None else images.example(ids, mask, vision, meta)


def tokenize_sft(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    *,
    format: SftFormat = "auto",
    max_length: int,
    truncation: Truncation = "error",
    completion_only_loss: bool = True,
    skip_bad_rows: bool = False,
    images: ImageInputs | None = None,
) -> tuple[list[Example], SkipStats]:
    """Tokenize SFT rows into examples whose ``loss_mask`` marks the tokens to train on.

    ``format="auto"`` takes the format from the first row (the first well-formed one when skipping bad
    rows); every row must then have that format's fields. Bad rows raise :class:`DataError` unless
    ``skip_bad_rows``, in which case they are counted in the returned :class:`SkipStats`.
    Template problems raise :class:`ChatTemplateError` regardless. Rows with images need ``images`` (the
    model's processor, see :mod:`padless.data.images`); without it they are bad rows.
    """
    check_sft_args(format, max_length, truncation)
    stats = SkipStats()
    if not rows:
        return [], stats
    fmt, how = sft_format(rows, format, skip_bad_rows)
    enc = _Encoder(tokenizer)
    examples = []
    for row in rows:
        try:
            example = sft_example(
                row,
                enc,
                fmt,
                how,
                max_length=max_length,
                truncation=truncation,
                completion_only_loss=completion_only_loss,
                images=images,
            )
        except DataError as e:
            if not skip_bad_rows:
                raise
            stats.record(e)
            continue
        examples.append(example)
        stats.kept += 1
    return examples, stats
