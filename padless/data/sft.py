"""SFT rows → :class:`~padless.packing.Example`: which tokens are targets, checked rather than guessed.

Three row formats are accepted (detected from the first row, or given): ``messages`` (a chat; loss on what the
assistant writes), ``prompt`` + ``completion`` (loss on the completion) and ``text`` (loss on everything).

For chats the loss mask comes from the chat template's ``{% generation %}`` markers when it has them.
Otherwise an assistant turn's targets run from the end of the generation prompt (the rendering of the
messages before it with ``add_generation_prompt``) to the end of its own turn (the rendering of the messages
up to it), and both renderings must be token-prefixes of the whole conversation's: a template that rewrites
earlier turns (e.g. drops reasoning) would silently mis-assign targets, so it is refused with
:class:`ChatTemplateError` instead.

Rendering those prefixes for every row costs 2k+1 renders for k assistant turns. Instead, the prefixes are
rendered once per conversation *shape* (roles and every field but the text contents), with each content
replaced by a placeholder; that fixes where each turn's boundaries fall around the contents. A row then costs
one render: it is used only when it equals the shape's rendering with the row's contents put in place of the
placeholders (the template inserted every content verbatim), and the token-prefix checks run on the row's
own tokens. Otherwise (e.g. the template trimmed or split a content) the row is rendered prefix by prefix as
before, so errors are unchanged. What the fast path assumes and does not re-check per row: a template that
inserts this row's contents verbatim into the whole conversation also does so into each prefix of it.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
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
# Stands in for message j's content while a conversation shape is rendered. Private-use characters: no
# template writes them, so each placeholder marks where exactly one content lands.
_PLACEHOLDER = "\ue000{}\ue001"
_SHAPES_CACHED = 256  # per tokenizer; a dataset usually has a handful (one per turn count)
_GLUE_CHARS = 64  # texts around turn boundaries this short are template glue, memoised; longer hold content
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


@dataclass(frozen=True)
class _Layout:
    """Where a chat template puts the turns of one conversation shape.

    The shape renders as ``texts[0] + content[order[0]] + texts[1] + ... + texts[-1]``; ``cuts`` holds, for
    each assistant turn in order, where its generation prompt ends and where its turn ends, each as (index
    into ``texts``, offset in that text): template text, so the same for every row of the shape.
    """

    texts: tuple[str, ...]
    order: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...]


def _layout_of(
    text: Callable[[list[dict[str, Any]], bool], str], shape: list[dict[str, Any]]
) -> _Layout | None:
    """The layout of ``shape`` (contents are placeholders), rendered by ``text(messages, generation_prompt)``.

    None when the template refuses the shape or renders a prefix of it differently from the start of the whole
    (or cuts a content apart): its rows then take the prefix-by-prefix path, which reports the problem.
    """
    try:
        full = text(shape, False)
        ends = []
        for i, msg in enumerate(shape):
            if msg["role"] == "assistant":
                head, upto = text(shape[:i], True), text(shape[: i + 1], False)
                if not (len(head) < len(upto) and full.startswith(head) and full.startswith(upto)):
                    return None
                ends += [len(head), len(upto)]
    except Exception:  # user-supplied Jinja; the row-level render reports what it raises
        return None
    # A content the template leaves out has no slot; one it writes twice leaves a placeholder in the texts,
    # so that no row matches the layout.
    slots = sorted((at, j) for j in range(len(shape)) if (at := full.find(_PLACEHOLDER.format(j))) >= 0)
    texts, starts, pos = [], [], 0
    for at, j in slots:
        texts.append(full[pos:at])
        starts.append(pos)
        pos = at + len(_PLACEHOLDER.format(j))
    texts.append(full[pos:])
    starts.append(pos)
    cuts = []
    for end in ends:
        s = bisect_right(starts, end) - 1
        if end - starts[s] > len(texts[s]):  # inside a placeholder: the template cut a content apart
            return None
        cuts.append((s, end - starts[s]))
    return _Layout(tuple(texts), tuple(j for _, j in slots), tuple(cuts))


def _trainable(mask: Sequence[bool]) -> int:
    # Token 0 is never predicted (nothing precedes it), so only later targets can carry loss.
    return sum(mask[1:])


class _Encoder:
    """Tokenizer-derived facts, computed once per dataset."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tok = tokenizer
        self._start_caches()

    def _start_caches(self) -> None:
        self._layout = lru_cache(maxsize=_SHAPES_CACHED)(self._analyse)
        # The glue around turn boundaries (e.g. "<|im_start|>assistant\n") repeats from row to row.
        self._window = lru_cache(maxsize=_SHAPES_CACHED * 16)(self._window_ids)

    # Caches stay in their process: pickling (worker processes, dataset fingerprints) leaves them out.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_layout", "_window")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_caches()

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
    def added_tokens(self) -> dict[int, str]:
        """Ids of the tokens matched in text before the rest is split into words (e.g. ``<|im_start|>``)."""
        return {i: t.content for i, t in self.tok.added_tokens_decoder.items()}

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

    def _apply(
        self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool, tokenize: bool
    ) -> Any:
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=tokenize, return_dict=tokenize, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # the template is user-supplied Jinja; its raise_exception lands here
            raise row.error(
                None,
                f"the chat template cannot render this conversation ({type(e).__name__}: {e})",
                reason="chat template rejected row",
            ) from e

    def render(self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        out = self._apply(row, messages, generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"])

    # -- chats -----------------------------------------------------------------------------------------------

    def chat(self, row: Row, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and which of them the assistant wrote (content + end-of-turn token)."""
        self.require_template(row)
        if not self.has_generation_markers:
            return self._chat_by_layout(row, messages) or self._chat_by_prefixes(row, messages)
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
            self._mark_turn(full, mask, len(head), len(upto))
        return full, mask

    def _mark_turn(self, ids: list[int], mask: list[bool], head: int, upto: int) -> None:
        # Targets run to the turn's last end-of-turn token; what follows it (e.g. "\n") is template glue that
        # precedes the next header, not something the assistant generates.
        ends = [k for k in range(head, upto) if ids[k] in self.end_of_turn_ids]
        stop = ends[-1] + 1 if ends else upto
        mask[head:stop] = [True] * (stop - head)

    def _chat_by_layout(
        self, row: Row, messages: list[dict[str, Any]]
    ) -> tuple[list[int], list[bool]] | None:
        """What :meth:`_chat_by_prefixes` returns, from one render of the row and its shape's layout.

        None when the layout cannot vouch for the row; the caller then renders prefix by prefix, which also
        gives every error its usual message.
        """
        if not self.tok.is_fast or messages[0]["role"] == "assistant":
            return None
        contents = [m.get("content") for m in messages]
        if any(c is not None and not isinstance(c, str) for c in contents):
            return None  # list contents (images) keep the prefix path
        shape = [
            m if c is None else {**m, "content": _PLACEHOLDER.format(j)}
            for j, (m, c) in enumerate(zip(messages, contents, strict=True))
        ]
        try:
            layout = self._layout(json.dumps(shape))
        except (TypeError, ValueError):  # a field JSON cannot hold cannot be part of a shape's key
            return None
        if layout is None:
            return None
        text = self._apply(row, messages, generation_prompt=False, tokenize=False)
        parts, starts, pos = [], [], 0
        for s, piece in enumerate(layout.texts):
            filled = contents[layout.order[s]] if s < len(layout.order) else ""
            parts += [piece, filled]
            starts.append(pos)
            pos += len(piece) + len(filled)
        if "".join(parts) != text:
            return None  # the template changed a content (e.g. trimmed it or cut reasoning out)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        counts = self._prefix_lengths(
            text, ids, enc["offset_mapping"], [starts[s] + k for s, k in layout.cuts]
        )
        if counts is None:
            return None
        mask = [False] * len(ids)
        for head, upto in zip(counts[::2], counts[1::2], strict=True):
            if upto <= head:
                return None
            self._mark_turn(ids, mask, head, upto)
        return ids, mask

    def _window_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    def _analyse(self, key: str) -> _Layout | None:
        def text(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )

        return _layout_of(text, json.loads(key))

    def _prefix_lengths(
        self, text: str, ids: list[int], offsets: Sequence[tuple[int, int]], cuts: list[int]
    ) -> list[int] | None:
        """For each cut, ``n`` such that tokenizing ``text[:cut]`` gives ``ids[:n]``; None if one does not.

        The tokenizer splits text at added tokens (``<|im_start|>``...) before anything else and tokenizes the
        pieces apart, so only the text after the last added token before a cut needs tokenizing again: with
        that token in front, so that it is not the first piece either.
        """
        added = self.added_tokens
        anchor_ends, anchor_at = [], []
        for k, t in enumerate(ids):
            if t in added and text[offsets[k][0] : offsets[k][1]] == added[t]:
                anchor_ends.append(offsets[k][1])
                anchor_at.append(k)
        lengths = []
        for cut in cuts:
            a = bisect_right(anchor_ends, cut) - 1
            first = anchor_at[a] if a >= 0 else 0
            window = added[ids[first]] + text[anchor_ends[a] : cut] if a >= 0 else text[:cut]
            got = self._window(window) if len(window) <= _GLUE_CHARS else tuple(self.encode(window))
            if tuple(ids[first : first + len(got)]) != got:
                return None
            lengths.append(first + len(got))
        return lengths

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
