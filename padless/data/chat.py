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

import contextlib
import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
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
    "If the template shows earlier turns differently from the last one (e.g. strips their reasoning, as "
    "Qwen3's does), set data.per_turn: true: each assistant turn becomes its own example, its context "
    "rendered as the template renders it for generation and the loss on the turn's full content. If it "
    "changes every turn, use a template that renders assistant messages as they are."
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
    each assistant turn checked (``turns``, message indices), where its generation prompt ends and where its
    turn ends, each as (index into ``texts``, offset in that text): template text, so the same for every row
    of the shape.
    """

    texts: tuple[str, ...]
    order: tuple[int, ...]
    cuts: tuple[tuple[int, int], ...]
    turns: tuple[int, ...]


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _turn_end(upto: Sequence[Any], full: Sequence[Any], tail: Sequence[Any]) -> int | None:
    """Where a turn ends in ``full`` given ``upto``, the rendering of the conversation up to it: its length
    when it is a prefix of ``full``; for a template that closes every conversation with ``tail`` (e.g. an
    end-of-text token), where ``upto`` ends without it; else None."""
    if len(upto) <= len(full) and full[: len(upto)] == upto:
        return len(upto)
    end = len(upto) - len(tail)
    if (
        len(tail)
        and upto[end:] == tail
        and full[len(full) - len(tail) :] == tail
        and full[:end] == upto[:end]
    ):
        return end
    return None


def _assistant_turns(messages: list[dict[str, Any]], last_only: bool) -> list[int]:
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return turns[-1:] if last_only else turns


def _layout_of(
    text: Callable[[list[dict[str, Any]], bool], str], shape: list[dict[str, Any]], tail: str, last_only: bool
) -> _Layout | None:
    """The layout of ``shape`` (contents are placeholders), rendered by ``text(messages, generation_prompt)``.

    None when the template refuses the shape, renders a prefix of it differently from the start of the whole
    (or cuts a content apart), or puts an assistant content outside its own turn: its rows then take the
    prefix-by-prefix path, which reports the problem.
    """
    turns = _assistant_turns(shape, last_only)
    try:
        full = text(shape, False)
        ends = []
        for i in turns:
            head, upto = text(shape[:i], True), text(shape[: i + 1], False)
            end = _turn_end(upto, full, tail)
            if not (full.startswith(head) and end is not None and len(head) < end):
                return None
            at = full.find(_PLACEHOLDER.format(i))
            if isinstance(shape[i].get("content"), str) and not len(head) <= at < end:
                return None  # the content lands outside its turn
            ends += [len(head), end]
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
    return _Layout(tuple(texts), tuple(j for _, j in slots), tuple(cuts), tuple(turns))


# A conversation every chat template renders: one that fails on it fails on every row.
PLAIN = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]


def template_source(tokenizer: Any) -> str:
    """Where a tokenizer's chat template was read from: the file in its folder, or the tokenizer itself."""
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if str(folder) and (folder / name).is_file():
            return str(folder / name)
    return "the tokenizer's chat_template"


def _normalised(text: str) -> str:
    return " ".join(text.split())


def _short(text: str, n: int = 24) -> str:
    return repr(text if len(text) <= 2 * n + 3 else f"{text[:n]}...{text[-n:]}")


def _what_changed(content: str, rendered: str) -> str:
    """What the template did to ``content`` (both whitespace-normalised), for the refusal message."""
    if not content.strip():
        return "left out its content"
    for p in range(1, len(content)):
        if content[p:].strip() and content[p:] in rendered:
            return f"dropped the text before {_short(content[p:])}: {_short(content[:p])}"
    for p in range(len(content) - 1, 0, -1):
        if content[:p] in rendered:
            return f"dropped the text after {_short(content[:p])}: {_short(content[p:])}"
    return f"rendered it as {_short(rendered)}"


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

    @cached_property
    def broken(self) -> str | None:
        """Why the template fails on a plain question and answer (:data:`PLAIN`), or None if it renders it."""
        try:
            self.tok.apply_chat_template(PLAIN, tokenize=False)
        except Exception as e:
            return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        return None

    @contextlib.contextmanager
    def _rendering(self, row: Row) -> Iterator[None]:
        """A render of ``row``'s conversation. The template is user-supplied Jinja (its ``raise_exception``
        lands here too): what it raises is the row's error, unless the template fails on a plain question
        and answer too, which makes it the template's."""
        try:
            yield
        except Exception as e:
            if self.broken is not None:
                source = template_source(self.tok)
                raise ChatTemplateError(
                    f"the chat template ({source}) cannot render even a plain question and answer "
                    f"({self.broken}), so no row can be rendered; fix: correct the template in {source}, or "
                    "use a model folder whose tokenizer has a working chat template"
                ) from e
            raise row.error(
                None,
                f"the chat template cannot render this conversation ({type(e).__name__}: {e})",
                reason="chat template rejected row",
            ) from e

    def _apply(
        self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool, tokenize: bool
    ) -> Any:
        with self._rendering(row):
            return self.tok.apply_chat_template(
                messages, tokenize=tokenize, return_dict=tokenize, add_generation_prompt=generation_prompt
            )

    def render(self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        out = self._apply(row, messages, generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"])

    # -- chats -----------------------------------------------------------------------------------------------

    @cached_property
    def conversation_tail(self) -> str:
        """Text the template writes only at the very end of a conversation (e.g. an end-of-text token after
        the last turn), found by rendering a two-exchange probe; it belongs to the last turn."""
        probe = [{"role": r, "content": f"{r} {k}"} for k in range(2) for r in ("user", "assistant")]
        try:
            upto = str(self.tok.apply_chat_template(probe[:2], tokenize=False))
            full = str(self.tok.apply_chat_template(probe, tokenize=False))
        except Exception:  # user-supplied Jinja: the rows' own renders report what it raises
            return ""
        if not self.tok.is_fast or full.startswith(upto):
            return ""
        enc = self.tok(upto, add_special_tokens=False, return_offsets_mapping=True)
        k = _common_prefix(enc["input_ids"], self.encode(full))  # where they part, on a token boundary
        tail = upto[enc["offset_mapping"][k][0] :] if k < len(enc["input_ids"]) else ""
        return tail if full.endswith(tail) and "user 1" not in tail else ""

    @cached_property
    def _tail_ids(self) -> list[int]:
        return self.encode(self.conversation_tail) if self.conversation_tail.strip() else []

    def chat(
        self, row: Row, messages: list[dict[str, Any]], *, last_only: bool = False
    ) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and which of them the assistant wrote (content + end-of-turn token).

        Every assistant turn is checked: the rendering up to it must be a token prefix of the whole (so the
        turn is where the model will see it) and its trained tokens must render its content. ``last_only``
        trains (and checks) only the last assistant turn: the per-turn mode, whose context is rendered as the
        template renders it for generation.
        """
        self.require_template(row)
        return self._chat_by_layout(row, messages, last_only) or self._chat_by_prefixes(
            row, messages, last_only
        )

    def _render_text(self, row: Row, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and, for a template with generation markers, the spans they mark."""
        if not self.has_generation_markers:
            return str(self._apply(row, messages, generation_prompt=False, tokenize=False)), []
        from transformers.utils.chat_template_utils import render_jinja_template

        with self._rendering(row):
            texts, spans = render_jinja_template(
                conversations=[messages],
                chat_template=self.template,
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
            )
        return texts[0], [tuple(s) for s in spans[0]]

    def _marked(
        self, row: Row, offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
    ) -> list[bool]:
        """Tokens overlapping a marked span (as transformers' ``return_assistant_tokens_mask``)."""
        starts, ends = [a for a, _ in offsets], [b for _, b in offsets]
        mask = [False] * len(offsets)
        for s, e in spans:  # the tokens that end after s and start before e
            first, stop = bisect_right(ends, s), bisect_left(starts, e)
            mask[first:stop] = [True] * max(0, stop - first)
        if not any(mask):
            raise ChatTemplateError(
                f"{row.where}: the chat template has {{% generation %}} markers, but they marked no token of "
                "this conversation although it has assistant content. Put the markers around every "
                "assistant message's content and end-of-turn token."
            )
        return mask

    def _chat_by_prefixes(
        self, row: Row, messages: list[dict[str, Any]], last_only: bool
    ) -> tuple[list[int], list[bool]]:
        if self.has_generation_markers:
            text, spans = self._render_text(row, messages)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            full = list(enc["input_ids"])
            marked = self._marked(row, enc["offset_mapping"], spans)
        else:
            full = self.render(row, messages, generation_prompt=False)
        mask = [False] * len(full)
        for i in _assistant_turns(messages, last_only):
            if i == 0:
                raise row.error(
                    "messages[0].role",
                    "is 'assistant': the assistant header can only be told apart from the content when a "
                    "message precedes it",
                    reason="starts with assistant",
                    fix="Start the conversation with a system or user message, or set data.skip_bad_rows: "
                    "true to skip it.",
                )
            head = self.render(row, messages[:i], generation_prompt=True)
            upto = self.render(row, messages[: i + 1], generation_prompt=False)
            if full[: len(head)] != head:
                raise self._unstable(row, f"the first {i} message(s) plus the generation prompt", head, full)
            end = _turn_end(upto, full, self._tail_ids)
            if end is None:
                raise self._unstable(row, f"the first {i + 1} message(s)", upto, full)
            if end <= len(head):
                raise ChatTemplateError(
                    f"{row.where}: rendering messages[{i}] (assistant) added no token after the generation "
                    f"prompt, so its targets cannot be located. {_TEMPLATE_FIX}"
                )
            if self.has_generation_markers:
                mask[len(head) : end] = marked[len(head) : end]
            else:
                self._mark_turn(full, mask, len(head), end, last=end == len(full))
            trained = [t for t, m in zip(full[len(head) : end], mask[len(head) : end], strict=True) if m]
            self.check_content(row, messages[i], f"messages[{i}]", self.tok.decode(trained))
        return full, mask

    def check_content(
        self, row: Row, message: dict[str, Any], label: str, trained: str, fix: str = _TEMPLATE_FIX
    ) -> None:
        """The tokens trained for an assistant ``message`` (decoded: ``trained``) must render its content,
        whitespace aside; else the template changed it (e.g. cut its reasoning out) and the row is refused."""
        content = message.get("content")
        texts = (
            [p.get("text", "") for p in content if p.get("type") == "text"]
            if isinstance(content, list)
            else []
        )
        texts = [content] if isinstance(content, str) else texts
        got = _normalised(trained)
        for want in (_normalised(t) for t in texts):
            if want and want not in got:
                raise ChatTemplateError(
                    f"{row.where}: the chat template changed {label} (assistant): it "
                    f"{_what_changed(want, got)}, so the tokens trained for that turn are not what the "
                    f"message says. {fix}"
                )

    def _mark_turn(self, ids: list[int], mask: list[bool], head: int, upto: int, last: bool) -> None:
        # Targets run to the turn's last end-of-turn token; what follows it (e.g. "\n") is template glue that
        # precedes the next header, not something the assistant generates. What the template writes only at
        # the end of a conversation (e.g. an end-of-text token) belongs to the last turn.
        tail = self._tail_ids
        if last and tail and ids[len(ids) - len(tail) :] == tail:
            stop = upto
        else:
            ends = [k for k in range(head, upto) if ids[k] in self.end_of_turn_ids]
            stop = ends[-1] + 1 if ends else upto
        mask[head:stop] = [True] * (stop - head)

    def _chat_by_layout(
        self, row: Row, messages: list[dict[str, Any]], last_only: bool
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
            layout = self._layout(json.dumps(shape), last_only)
        except (TypeError, ValueError):  # a field JSON cannot hold cannot be part of a shape's key
            return None
        if layout is None:
            return None
        text, spans = self._render_text(row, messages)
        parts, starts, pos = [], [], 0
        where = {}  # message index -> (start, end) of its content in the text
        for s, piece in enumerate(layout.texts):
            filled = contents[layout.order[s]] if s < len(layout.order) else ""
            parts += [piece, filled]
            starts.append(pos)
            pos += len(piece) + len(filled)
            if s < len(layout.order):
                where[layout.order[s]] = (pos - len(filled), pos)
        if "".join(parts) != text:
            return None  # the template changed a content (e.g. trimmed it or cut reasoning out)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        counts = self._prefix_lengths(text, ids, offsets, [starts[s] + k for s, k in layout.cuts])
        if counts is None:
            return None
        marked = self._marked(row, offsets, spans) if spans or self.has_generation_markers else None
        mask, token_starts = [False] * len(ids), [a for a, _ in offsets]
        for i, head, upto in zip(layout.turns, counts[::2], counts[1::2], strict=True):
            if upto <= head:
                return None
            if marked is None:
                self._mark_turn(ids, mask, head, upto, last=upto == len(ids))
            else:
                mask[head:upto] = marked[head:upto]
            if i in where and not self._covers(mask, token_starts, head, upto, *where[i]):
                return None  # the prefix path names the turn and what the template did to it
        return ids, mask

    @staticmethod
    def _covers(
        mask: list[bool], token_starts: list[int], head: int, upto: int, start: int, end: int
    ) -> bool:
        """Whether the tokens of characters ``start:end`` lie in ``head:upto`` and are all trained."""
        first, last = bisect_right(token_starts, start) - 1, bisect_left(token_starts, end) - 1
        return head <= first <= last < upto and all(mask[first : last + 1])

    def _window_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    def _analyse(self, key: str, last_only: bool) -> _Layout | None:
        def text(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )

        return _layout_of(text, json.loads(key), self.conversation_tail, last_only)

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
