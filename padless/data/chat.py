"""Chat templates → tokens and which of them the assistant wrote: the encoder every task renders chats with.

SFT, preference pairs, reward scoring and RL prompts all render conversations through :class:`ChatEncoder`,
so a template that cannot give a trustworthy loss mask is refused the same way everywhere.

The loss mask comes from the chat template's ``{% generation %}`` markers when it has them.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from padless.data.images import check_parts
from padless.data.records import Row, type_name

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool")
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


def nonempty_str(row: Row, name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise row.error(name, f"must be a string, got {type_name(value)}", reason="wrong type")
    if not value.strip():
        raise row.error(name, "is empty; it must contain text", reason="empty content")
    return value


def chat_messages(row: Row, name: str, value: Any) -> list[dict[str, Any]]:
    """Validated copy of a message list, with null-valued keys (schema filler from datasets) dropped."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type_name(value)
        raise row.error(name, f"must be a list of {{role, content}} dicts, got {got}", reason="wrong type")
    out = []
    for j, msg in enumerate(value):
        where = f"{name}[{j}]"
        if not isinstance(msg, dict):
            raise row.error(
                where, f"must be a {{role, content}} dict, got {type_name(msg)}", reason="wrong type"
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
            nonempty_str(row, f"{where}.content", msg.get("content"))
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


class ChatEncoder:
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
