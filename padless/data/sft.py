"""SFT rows → :class:`~padless.forward.packing.Example`: which tokens are targets, checked rather than
guessed.

Three row formats are accepted (detected from the first row, or given): ``messages`` (a chat; loss on what the
assistant writes), ``prompt`` + ``completion`` (loss on the completion) and ``text`` (loss on everything).
Chats are rendered by :class:`~padless.data.chat.ChatEncoder`, which says how the loss mask is found and which
templates it refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

from padless.data.chat import ChatEncoder, trained_turns
from padless.data.images import ImageInputs
from padless.data.records import (
    Row,
    SkipStats,
    Truncation,
    chat_messages,
    nonempty_str,
    present_fields,
    reject_images,
    turn_flags,
    type_name,
)
from padless.data.tokenized import Layout, ids_feature
from padless.forward.packing import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SftFormat = Literal["auto", "messages", "prompt_completion", "text"]

FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


def _matching_format(row: Row) -> str | None:
    present = present_fields(row)
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
            f"field, found {sorted(present_fields(row)) or 'no non-null fields'}",
            reason="unknown format",
            fix="Rename the fields, pass data.format explicitly, or set data.skip_bad_rows: true to skip it.",
        )
    return fmt


def _check_fields(row: Row, fmt: str, how: str) -> None:
    present = present_fields(row)
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


def _trainable(mask: Sequence[bool]) -> int:
    # Token 0 is never predicted (nothing precedes it), so only later targets can carry loss.
    return sum(mask[1:])


class SftEncoder(ChatEncoder):
    """The chat encoder plus SFT's three row formats."""

    def messages_row(self, row: Row) -> tuple[list[int], list[bool]]:
        messages, trains = self._conversation(row)
        return self.chat(row, messages, trains=trains)

    def turn_rows(self, row: Row) -> list[tuple[list[int], list[bool], int]]:
        """Per-turn mode: for each trained assistant turn, the conversation up to it with only that turn
        trained, and how many messages it holds. Its context is rendered as the template renders it for
        generation (e.g. earlier reasoning stripped), the turn itself as the template renders a last turn."""
        messages, trains = self._conversation(row)
        turns = trained_turns(messages, trains=trains)
        return [(*self.chat(row, messages[: i + 1], last_only=True), i + 1) for i in turns]

    def _conversation(self, row: Row) -> tuple[list[dict[str, Any]], list[bool]]:
        """The row's messages and which of them are trained turns (a turn's ``loss`` / ``train`` /
        ``weight`` flag decides; an assistant turn without one trains)."""
        messages = chat_messages(row, "messages", row.data["messages"], flags=True)
        trains = turn_flags(row, "messages", row.data["messages"])
        if not any(m["role"] == "assistant" and (m.get("content") or m.get("tool_calls")) for m in messages):
            raise row.error(
                "messages",
                "has no assistant message with content, so there is nothing to train on",
                reason="no assistant message",
            )
        if not any(trains):
            raise row.error(
                "messages",
                "has no assistant turn to train: every one is flagged off (loss / train false, or weight 0)",
                reason="no trained turn",
            )
        return messages, trains

    def prompt_completion_row(self, row: Row, completion_only_loss: bool) -> tuple[list[int], list[bool]]:
        prompt, completion = row.data["prompt"], row.data["completion"]
        prompt_msgs: list[dict[str, Any]] = []
        if isinstance(prompt, list):
            prompt_msgs = chat_messages(row, "prompt", prompt)
            self.require_template(row)
            prompt_ids = self.render(row, prompt_msgs, generation_prompt=True)
        elif isinstance(prompt, str):
            prompt_ids = self.leading_specials + self.encode(nonempty_str(row, "prompt", prompt))
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
                f"must be a string or a list of messages, got {type_name(prompt)}",
                reason="wrong type",
            )

        trains = None
        if isinstance(completion, list):
            done = chat_messages(row, "completion", completion, flags=True)
            if (
                len(done) != 1
                or done[0]["role"] != "assistant"
                or not (done[0].get("content") or done[0].get("tool_calls"))
            ):
                raise row.error(
                    "completion",
                    "must be a list with exactly one assistant message with content, got "
                    f"{len(done)} message(s) with role(s) {[m['role'] for m in done]}",
                    reason="wrong type",
                )
            trains = [False] * len(prompt_msgs) + turn_flags(row, "completion", completion)
            ids, mask = self.chat(row, prompt_msgs + done, trains=trains)
            if ids[: len(prompt_ids)] != prompt_ids:
                raise self._unstable(row, "the prompt plus the generation prompt", prompt_ids, ids)
            start = len(prompt_ids)
            mask = [False] * start + mask[start:]
        elif isinstance(completion, str):
            done_ids = self.encode(nonempty_str(row, "completion", completion))
            if done_ids[-1:] != [self.eos]:
                done_ids.append(self.eos)
            ids = prompt_ids + done_ids
            mask = [False] * len(prompt_ids) + [True] * len(done_ids)
        else:
            raise row.error(
                "completion",
                f"must be a string or a list with one assistant message, got {type_name(completion)}",
                reason="wrong type",
            )
        if not completion_only_loss:  # every token, but a completion flagged off stays out
            off = trains is not None and not trains[-1]
            mask = [True] * len(prompt_ids) + [not off] * (len(ids) - len(prompt_ids))
        return ids, mask

    def text_row(self, row: Row) -> tuple[list[int], list[bool]]:
        ids = self.leading_specials + self.encode(nonempty_str(row, "text", row.data["text"]))
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


def _images_in(messages: list[dict[str, Any]]) -> int:
    return sum(
        p.get("type") == "image" for m in messages if isinstance(m.get("content"), list) for p in m["content"]
    )


def tokenize_sft(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    *,
    images: ImageInputs | None = None,
    **options: Any,
) -> tuple[list[Example], SkipStats]:
    """SFT rows tokenized in memory by ``SFTLayout(**options)`` (:meth:`Layout.tokenize`)."""
    return SFTLayout(**options).tokenize(rows, tokenizer, images)


class _Prepared(NamedTuple):
    """What :meth:`SFTLayout.prepare` decides once for a data set."""

    enc: SftEncoder
    fmt: str  # the format every row must have
    how: str  # how it was decided, for messages
    images: ImageInputs | None


@dataclass
class SFTLayout(Layout[Example]):
    """SFT rows into examples whose ``loss_mask`` marks the tokens to train on; stored as ``input_ids``,
    ``loss_mask`` and ``targets`` (trained predictions, for normalisers).

    ``format="auto"`` takes the format from the first row (the first well-formed one when skipping bad
    rows); every row must then have that format's fields. A row longer than ``max_length`` is a bad row with
    ``truncation="error"`` and is cut with ``"truncate"``. Bad rows raise :class:`DataError` unless
    ``skip_bad_rows``, which counts them; template problems raise :class:`ChatTemplateError` regardless. Rows
    with images need the model's image side (``images`` in :meth:`prepare`, see :mod:`padless.data.images`);
    without it they are bad rows. ``per_turn`` makes each assistant turn of a chat its own example (see
    :meth:`SftEncoder.turn_rows`). ``stop_ids``: the tokens the model stops at besides the tokenizer's eos
    (its generation config's), which end a chat turn.
    """

    name: ClassVar[str] = "sft"
    max_length: int
    format: SftFormat = "auto"
    truncation: Truncation = "error"
    completion_only_loss: bool = True
    per_turn: bool = False
    skip_bad_rows: bool = False
    stop_ids: tuple[int, ...] = ()
    _state: _Prepared | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.format not in ("auto", *FORMAT_FIELDS):
            raise ValueError(f"unknown SFT format {self.format!r}; valid: auto, {', '.join(FORMAT_FIELDS)}")
        if self.truncation not in ("error", "truncate"):
            raise ValueError(f"unknown truncation {self.truncation!r}; valid: error, truncate")
        if not isinstance(self.max_length, int) or self.max_length <= 0:
            raise ValueError(f"max_length must be a positive integer, got {self.max_length!r}")

    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        fmt, how = sft_format(rows, self.format, self.skip_bad_rows)
        self._state = _Prepared(SftEncoder(tokenizer, self.stop_ids), fmt, how, images)

    @property
    def prepared(self) -> _Prepared:
        """The encoder and the format :meth:`prepare` decided."""
        assert self._state is not None, "prepare() first"
        return self._state

    def examples(self, row: Row) -> list[Example]:
        """A row's examples: one, or with ``per_turn`` one per assistant turn of a chat."""
        enc, fmt, how, images = self.prepared
        _check_fields(row, fmt, how)
        pictures: list[Any] = []
        if images is None:
            reject_images(row)
        else:
            prepared = images.prepare(row)
            row, pictures = prepared.row, prepared.images
        if fmt == "messages" and self.per_turn:
            parts = enc.turn_rows(row)
            parts = [(ids, mask, _images_in(row.data["messages"][:n])) for ids, mask, n in parts]
        elif fmt == "messages":
            parts = [(*enc.messages_row(row), len(pictures))]
        elif fmt == "prompt_completion":
            parts = [(*enc.prompt_completion_row(row, self.completion_only_loss), len(pictures))]
        else:
            parts = [(*enc.text_row(row), len(pictures))]
        out = []
        for ids, mask, seen in parts:
            meta = {"row": row.index, "source": row.source}
            if images is None:
                out.append(Example(*_fit(row, ids, mask, self.max_length, self.truncation), meta))
                continue
            ids, mask, vision = images.expand(row, ids, mask, pictures[:seen])
            if self.truncation == "truncate":
                ids, mask, vision = images.fit(row, ids, mask, vision, self.max_length)
            ids, mask = _fit(row, ids, mask, self.max_length, self.truncation)
            out.append(images.example(ids, mask, vision, meta))
        return out

    def columns(self, item: Example) -> dict[str, Any]:
        return {"input_ids": item.input_ids, "loss_mask": item.loss_mask, "targets": item.num_targets}

    def features(self) -> dict[str, Any]:
        import datasets

        return {
            "input_ids": ids_feature(),
            "loss_mask": datasets.List(datasets.Value("bool")),
            "targets": datasets.Value("int32"),
        }

    def read_columns(self, stored: list[str]) -> list[str]:
        return ["input_ids", "loss_mask"]

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[Example]:
        return [
            Example(ids, mask, {"row": row, "source": source})
            for row, ids, mask in zip(columns["row"], columns["input_ids"], columns["loss_mask"], strict=True)
        ]
