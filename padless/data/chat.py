"""Chat templates → tokens and which of them the assistant wrote: the encoder every task renders chats with,
and the proof that what is trained for an assistant turn is the whole message, ending where the model stops.

SFT, preference pairs, reward scoring and RL prompts all render conversations through :class:`ChatEncoder`,
so a template that cannot give a trustworthy loss mask is refused the same way everywhere.

**Where a turn starts.** With ``{% generation %}`` markers the marked tokens are the candidates. Otherwise an
assistant turn's targets start at the end of the generation prompt (the rendering of the messages before it
with ``add_generation_prompt``), and the renderings of the messages before and up to it must be token-prefixes
of the whole conversation's: a template that rewrites earlier turns (e.g. drops reasoning) would silently
mis-assign targets, so it is refused with :class:`ChatTemplateError` instead. A generation prompt that ends
inside a token (one that pre-fills ``<think>\\n``) is tokenized apart from what follows it when it belongs to
the last trained turn, as at inference.

**Where it ends.** At the token the model writes to stop: one of the model's end-of-sequence ids (the
tokenizer's, plus those its ``generation_config.json`` lists, which for some models are role headers or a
tool-call token). The first stop token in the turn ends it; a turn without one ends at the next role header
when that header is a stop token (after the last turn, the header the template writes next is appended). Every
trained turn holds exactly one stop token; one that cannot end in a stop is refused with the reason.

**What it holds.** The trained tokens must render the whole message: its content (a string, or every text
part in order, not a serialised list), every tool call's name and arguments, and its reasoning (a reasoning
field or thinking parts). What a template writes is found by rendering: the message is rendered again with a
sentinel in place of every value, and each sentinel must land in the turn's trained text (see
:mod:`padless.data.sentinels`); a template that drops, renames or moves a field is refused naming the turn,
the field and what it did.

Rendering those prefixes for every row costs 2k+1 renders for k assistant turns. Instead, for rows whose
contents are strings, the prefixes are rendered once per conversation *shape* (roles and every field but the
text contents), with each content replaced by a placeholder; that fixes where each turn's boundaries fall
around the contents. A row then costs one render: it is used only when it equals the shape's rendering with
the row's contents put in place of the placeholders (the template inserted every content verbatim), and the
token-prefix checks run on the row's own tokens. Otherwise the row is rendered prefix by prefix, so errors are
unchanged. What the fast path assumes and does not re-check per row: a template that inserts this row's
contents verbatim into the whole conversation also does so into each prefix of it.
"""

from __future__ import annotations

import contextlib
import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from padless.data.records import REASONING_KEYS, Row
from padless.data.sentinels import SENTINEL, Leaf, with_sentinels
from padless.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
# What a template did to a turn, as the data report counts rows (ChatTemplateError.behaviour)
REWRITES_HISTORY = "rewrites earlier turns"
CONTENT_CHANGED = "content changed"
PARTS_AS_TEXT = "content parts written as text"
CONTENT_DROPPED = "content part dropped"
CALL_DROPPED = "tool call dropped"
CALL_RENAMED = "tool call without its name"
ARGUMENTS_DROPPED = "tool call arguments dropped"
REASONING_IGNORED = "reasoning field ignored"
THINKING_DROPPED = "thinking part dropped"
FIELD_REWRITTEN = "field rewritten"
HISTORY_CLOSING = "history-only closing token"
NO_STOP = "no stop token"
STOP_INSIDE = "stop token inside a turn"
MARKERS = "generation markers"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot give a trustworthy loss mask.

    Never skipped by ``skip_bad_rows``: the tokenizer, not the row, needs fixing. ``behaviour`` names what the
    template did (one of this module's labels), for the data report.
    """

    def __init__(self, message: str, behaviour: str = "template") -> None:
        super().__init__(message)
        self.behaviour = behaviour


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


# A conversation's tokens, where each trained turn's generation prompt and rendering end (message index,
# head, end), and the tokens a template's {% generation %} markers mark (None without markers).
Found = tuple[list[int], list[tuple[int, int, int]], list[bool] | None]


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
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


def trained_turns(
    messages: list[dict[str, Any]], last_only: bool = False, trains: Sequence[bool] | None = None
) -> tuple[int, ...]:
    """The assistant turns to train: all of them, or those ``trains`` marks; only the last with
    ``last_only``."""
    turns = tuple(
        i for i, m in enumerate(messages) if m["role"] == "assistant" and (trains is None or trains[i])
    )
    return turns[-1:] if last_only else turns


def _layout_of(
    text: Callable[[list[dict[str, Any]], bool], str],
    shape: list[dict[str, Any]],
    tail: str,
    turns: tuple[int, ...],
) -> _Layout | None:
    """The layout of ``shape`` (contents are placeholders), rendered by ``text(messages, generation_prompt)``.

    None when the template refuses the shape, renders a prefix of it differently from the start of the whole
    (or cuts a content apart), or puts an assistant content outside its own turn: its rows then take the
    prefix-by-prefix path, which reports the problem.
    """
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
    return _Layout(tuple(texts), tuple(j for _, j in slots), tuple(cuts), turns)


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


def has_fields(message: dict[str, Any]) -> bool:
    """Whether a message carries more than a string content (parts, tool calls, reasoning)."""
    return not isinstance(message.get("content", ""), str) or any(
        k in message for k in ("tool_calls", *REASONING_KEYS)
    )


def _texts(message: dict[str, Any]) -> list[str]:
    """The content texts of a message: its string content, or its text parts."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content or [] if p.get("type") == "text"]


class ChatEncoder:
    """Tokenizer-derived facts, computed once per dataset.

    ``stop_ids``: the ids the model stops generating at besides the tokenizer's eos (its
    ``generation_config.json`` ``eos_token_id``, see :func:`padless.data.sources.stop_token_ids`). ``tools``:
    the tool schemas every conversation is rendered with (an episode's tools).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_ids: Iterable[int] = (),
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.extra_stop_ids = tuple(sorted(set(stop_ids)))
        self.tools = tools or None
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
    def stop_ids(self) -> frozenset[int]:
        """Every token the model stops generating at: the tokenizer's eos and the generation config's."""
        eos = self.tok.eos_token_id
        return frozenset(self.extra_stop_ids) | ({eos} if eos is not None else set())

    @cached_property
    def stop_names(self) -> str:
        """The stop tokens as text, for messages."""
        eos = self.tok.eos_token_id
        named = [
            f"{self.tok.decode([t])!r}" + (" (tokenizer eos)" if t == eos else " (generation config)")
            for t in sorted(self.stop_ids)
        ]
        return ", ".join(named) or "none"

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
                messages,
                tokenize=tokenize,
                return_dict=tokenize,
                add_generation_prompt=generation_prompt,
                tools=self.tools,
            )

    def render(self, row: Row, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
        out = self._apply(row, messages, generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"])

    def text(self, row: Row, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return str(self._apply(row, messages, generation_prompt=generation_prompt, tokenize=False))

    # -- chats -----------------------------------------------------------------------------------------------

    @cached_property
    def conversation_tail(self) -> str:
        """Text the template writes only at the very end of a conversation (e.g. an end-of-text token after
        the last turn), found by rendering a two-exchange probe; it belongs to the last turn."""
        probe = [{"role": r, "content": f"{r} {k}"} for k in range(2) for r in ("user", "assistant")]
        try:
            upto = str(self.tok.apply_chat_template(probe[:2], tokenize=False, tools=self.tools))
            full = str(self.tok.apply_chat_template(probe, tokenize=False, tools=self.tools))
        except Exception:  # user-supplied Jinja: the rows' own renders report what it raises
            return ""
        if not self.tok.is_fast or full.startswith(upto):
            return ""
        enc = self.tok(upto, add_special_tokens=False, return_offsets_mapping=True)
        k = common_prefix(enc["input_ids"], self.encode(full))  # where they part, on a token boundary
        tail = upto[enc["offset_mapping"][k][0] :] if k < len(enc["input_ids"]) else ""
        return tail if full.endswith(tail) and "user 1" not in tail else ""

    @cached_property
    def _tail_ids(self) -> list[int]:
        return self.encode(self.conversation_tail) if self.conversation_tail.strip() else []

    def chat(
        self,
        row: Row,
        messages: list[dict[str, Any]],
        *,
        last_only: bool = False,
        trains: Sequence[bool] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Tokens of a conversation and which of them the assistant wrote (each trained turn through its stop
        token).

        Every trained assistant turn (all of them, or those ``trains`` marks) is checked: the rendering up to
        it must be a token prefix of the whole (so the turn is where the model will see it), its trained
        tokens must render the whole message and end in exactly one stop token. ``last_only`` trains (and
        checks) only the last assistant turn: the per-turn mode, whose context is rendered as the template
        renders it for generation.
        """
        self.require_template(row)
        turns = trained_turns(messages, last_only, trains)
        found = self._chat_by_layout(row, messages, turns) or self._chat_by_prefixes(row, messages, turns)
        return self._targets(row, messages, *found)

    def _render_text(self, row: Row, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and, for a template with generation markers, the spans they mark."""
        if not self.has_generation_markers:
            return self.text(row, messages), []
        from transformers.utils.chat_template_utils import render_jinja_template

        with self._rendering(row):
            texts, spans = render_jinja_template(
                conversations=[messages],
                tools=self.tools,
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
                "assistant message's content and end-of-turn token.",
                MARKERS,
            )
        return mask

    def _encoded(self, text: str, cut: int | None) -> tuple[list[int], list[tuple[int, int]]]:
        """``text`` tokenized (with offsets), in two pieces split at ``cut`` when it is given."""
        pieces = [(0, text)] if cut is None else [(0, text[:cut]), (cut, text[cut:])]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for at, piece in pieces:
            enc = self.tok(piece, add_special_tokens=False, return_offsets_mapping=self.tok.is_fast)
            ids += enc["input_ids"]
            offsets += [(a + at, b + at) for a, b in enc.get("offset_mapping", [])]
        return ids, offsets

    def _chat_by_prefixes(self, row: Row, messages: list[dict[str, Any]], turns: tuple[int, ...]) -> Found:
        if 0 in turns:
            raise row.error(
                "messages[0].role",
                "is 'assistant': the assistant header can only be told apart from the content when a "
                "message precedes it",
                reason="starts with assistant",
                fix="Start the conversation with a system or user message, or set data.skip_bad_rows: "
                "true to skip it.",
            )
        text, spans = self._render_text(row, messages)
        full, offsets = self._encoded(text, None)
        heads = {i: self.text(row, messages[:i], True) for i in turns}
        # A generation prompt that ends inside a token (it pre-fills text the turn goes on from) is tokenized
        # apart from the rest, as at inference: possible for the last trained turn (every earlier turn's
        # context must still be the token prefix the model will see).
        cut = None
        if turns and text.startswith(last := heads[turns[-1]]):
            head = self.encode(last)
            if full[: len(head)] != head:
                cut = len(last)
                full, offsets = self._encoded(text, cut)
        marked = self._marked(row, offsets, spans) if self.has_generation_markers else None
        bounds = []
        for i in turns:
            head = self.encode(heads[i])
            upto_text = self.text(row, messages[: i + 1])
            split = cut if i == turns[-1] and cut is not None and upto_text.startswith(heads[i]) else None
            upto = self._encoded(upto_text, split)[0]
            if full[: len(head)] != head:
                raise self._unstable(row, f"the first {i} message(s) plus the generation prompt", head, full)
            end = _turn_end(upto, full, self._tail_ids)
            if end is None:
                raise self._unstable(row, f"the first {i + 1} message(s)", upto, full)
            if end <= len(head):
                raise ChatTemplateError(
                    f"{row.where}: rendering messages[{i}] (assistant) added no token after the generation "
                    f"prompt, so its targets cannot be located. {_TEMPLATE_FIX}",
                    REWRITES_HISTORY,
                )
            bounds.append((i, len(head), end))
        return full, bounds, marked

    # -- the turns' targets and their proof ------------------------------------------------------------------

    def _targets(
        self,
        row: Row,
        messages: list[dict[str, Any]],
        ids: list[int],
        bounds: list[tuple[int, int, int]],
        marked: list[bool] | None,
    ) -> tuple[list[int], list[bool]]:
        """Each turn's targets, from where its generation prompt ends through its stop token; each proven to
        render its message."""
        mask = [False] * len(ids)
        for i, head, end in bounds:
            stop, appended = self.turn_stop(row, messages, i, ids, head, end)
            if appended:  # the last turn's stop is the header the template writes next
                ids, mask = [*ids, *appended], [*mask, *[True] * len(appended)]
            if marked is None:
                mask[head : stop + 1] = [True] * (stop + 1 - head)
            else:
                if stop < end and not marked[stop]:
                    raise ChatTemplateError(
                        f"{row.where}: the {{% generation %}} markers of messages[{i}] (assistant) leave out "
                        f"its stop token {self.tok.decode([ids[stop]])!r}, so a model trained on it would "
                        "not learn to stop. Put the markers around the content and the end-of-turn token.",
                        MARKERS,
                    )
                mask[head:stop] = marked[head:stop]
                mask[stop] = True
            self.prove_turn(row, messages, i, ids, head, stop, mask, end, f"messages[{i}]")
        return ids, mask

    def turn_stop(
        self, row: Row, messages: list[dict[str, Any]], i: int, ids: list[int], head: int, end: int
    ) -> tuple[int, list[int]]:
        """Where assistant turn ``i`` (rendered as ``ids[head:end]``) stops: the index of its stop token in
        ``ids`` (once the tokens returned are appended), and, when the turn is the last and its stop is the
        header the template writes next, those tokens (whitespace, then the header)."""
        stops = self.stop_ids
        at = next((k for k in range(head, end) if ids[k] in stops), None)
        if at is not None:
            return at, []
        if end < len(ids):  # the next message's header, after whitespace glue
            at = next((k for k in range(end, len(ids)) if self.tok.decode(ids[end : k + 1]).strip()), None)
            if at is not None and ids[at] in stops:
                return at, []
            raise self._no_stop(row, messages, i, ids, head, end)
        following = self._following(row, messages[: i + 1])
        if following and following[-1] in stops:
            return end + len(following) - 1, following
        raise self._no_stop(row, messages, i, ids, head, end)

    def _following(self, row: Row, messages: list[dict[str, Any]]) -> list[int] | None:
        """The tokens the template writes after the last message when the conversation goes on (whitespace,
        then the first token that is not): what the model writes to hand over the turn."""
        probe = {"role": "tool" if messages[-1].get("tool_calls") else "user", "content": "ok"}
        before, after = self.text(row, messages), self.text(row, [*messages, probe])
        if not after.startswith(before):
            return None
        rest = self.encode(after[len(before) :])
        k = next((k for k in range(len(rest)) if self.tok.decode(rest[: k + 1]).strip()), None)
        return None if k is None else rest[: k + 1]

    def _no_stop(
        self, row: Row, messages: list[dict[str, Any]], i: int, ids: list[int], head: int, end: int
    ) -> ChatTemplateError:
        closing = self.tok.decode(ids[max(head, end - 2) : end + 1])  # its last tokens and the next one
        if i < len(messages) - 1:  # as the last turn, does it end in a stop? Then only history differs.
            alone = self.render(row, messages[: i + 1], generation_prompt=False)
            k = next((k for k in range(head, len(alone)) if alone[k] in self.stop_ids), None)
            if alone[:head] == ids[:head] and k is not None:
                return ChatTemplateError(
                    f"{row.where}: the chat template ends messages[{i}] (assistant) as {closing!r} once "
                    f"later messages follow, but with {self.tok.decode([alone[k]])!r}, the token the model "
                    "stops at, when it is the last turn: history shows a closing token the model never "
                    "writes, so the turn cannot be trained in place. Set data.per_turn: true: each assistant "
                    "turn becomes its own example, rendered as the template renders it for generation.",
                    HISTORY_CLOSING,
                )
        return ChatTemplateError(
            f"{row.where}: messages[{i}] (assistant) ends as {closing!r}, and no token the model stops at "
            f"({self.stop_names}) ends it or follows it, so a model trained on it would not learn to stop. "
            "Use a template that closes assistant turns with a stop token, or list the token that ends a "
            "turn in the model's generation_config.json eos_token_id (GLM-style templates end a turn with "
            "the next role header, which the model's generation config lists).",
            NO_STOP,
        )

    def prove_turn(
        self,
        row: Row,
        messages: list[dict[str, Any]],
        i: int,
        ids: list[int],
        head: int,
        stop: int,
        mask: list[bool],
        end: int,
        label: str,
        fix: str = _TEMPLATE_FIX,
    ) -> None:
        """The tokens trained for assistant ``messages[i]`` (``ids[head:stop + 1]`` where ``mask``; the turn
        renders as ``ids[head:end]``) must render the whole message, whitespace aside; else the template
        changed it (e.g. cut its reasoning out, dropped its tool calls) and the row is refused."""
        message = messages[i]
        trained = self.tok.decode(
            [t for t, m in zip(ids[head : stop + 1], mask[head : stop + 1], strict=True) if m]
        )
        got = _normalised(trained)
        for want in (_normalised(t) for t in _texts(message)):
            if not want or want in got:
                continue
            # A generation prompt that pre-fills the start of the turn (e.g. "<think>\n") gave it already.
            given = _normalised(self._generation_prompt(row, messages, i) + trained)
            if want in given:
                continue
            if want in _normalised(self.tok.decode(ids[head:end])) and want not in _normalised(
                self.tok.decode(ids[head : stop + 1])
            ):
                raise self._stop_inside(row, label, ids[stop], "its content")
            raise ChatTemplateError(
                f"{row.where}: the chat template changed {label} (assistant): it "
                f"{_what_changed(want, got)}, so the tokens trained for that turn are not what the "
                f"message says. {fix}",
                CONTENT_CHANGED,
            )
        if has_fields(message):
            self._prove_fields(row, messages, i, trained, label)

    def _generation_prompt(self, row: Row, messages: list[dict[str, Any]], i: int) -> str:
        before, head = self.text(row, messages[:i]), self.text(row, messages[:i], True)
        return head[len(before) :] if head.startswith(before) else ""

    def _stop_inside(self, row: Row, label: str, stop: int, what: str) -> DataError:
        return row.error(
            None,
            f"{label} (assistant) holds {self.tok.decode([stop])!r}, a token the model stops at, before "
            f"{what}: a model stops there and never writes the rest",
            reason=STOP_INSIDE,
            fix="Remove the token from the text, split the turn (e.g. one tool call per turn where the "
            "template ends a call with a stop token), or set data.skip_bad_rows: true to skip the row.",
        )

    def _region(self, text: str, start: int) -> str:
        """What of ``text`` from ``start`` a turn trains: up to and including the first stop token."""
        ends = [
            at + len(name)
            for t in self.stop_ids
            if (name := self.tok.decode([t])) and (at := text.find(name, start)) >= 0
        ]
        return text[start : min(ends, default=len(text))]

    def _prove_fields(
        self, row: Row, messages: list[dict[str, Any]], i: int, trained: str, label: str
    ) -> None:
        """Content parts, tool calls and reasoning: each value, replaced by a sentinel, must land in the
        turn's trained text, the real one must be there too, and parts must render by their text."""
        message = messages[i]
        if isinstance(message.get("content"), list):
            flipped = {**message, "content": [dict(reversed(list(p.items()))) for p in message["content"]]}
            if self.text(row, [*messages[:i], flipped, *messages[i + 1 :]]) != self.text(row, messages):
                raise ChatTemplateError(
                    f"{row.where}: the chat template wrote {label}.content (a list of parts) out as a "
                    "serialised list rather than its parts' text (rendering each part with its keys in "
                    f"another order changed the text; the turn trains as {_short(trained)}), so the model "
                    "would learn to write Python or JSON. Give the content as a string, or use a template "
                    "that renders content parts.",
                    PARTS_AS_TEXT,
                )
        perturbed, leaves = with_sentinels(message, label)
        if not leaves:
            return
        head = self.text(row, messages[:i], True)
        region = self._sentinel_region(row, messages, i, perturbed, head)
        found = {leaf.sentinel for leaf in leaves if leaf.sentinel in region}
        # Reasoning under two keys with one value is rendered when either is.
        said = {leaf.writings for leaf in leaves if leaf.kind == "reasoning" and leaf.sentinel in found}
        missing = [
            leaf
            for leaf in leaves
            if leaf.required
            and leaf.sentinel not in found
            and not (leaf.kind == "reasoning" and leaf.writings in said)
        ]
        if missing:
            self._written_after_stop(row, messages, i, perturbed, head, missing, label)
            raise self._dropped(row, messages, i, leaves, missing, found, trained, head, label)
        parts = [region.index(leaf.sentinel) for leaf in leaves if leaf.kind in ("text", "thinking")]
        if parts != sorted(parts):
            raise ChatTemplateError(
                f"{row.where}: the chat template wrote the parts of {label}.content out of order, so the "
                f"tokens trained for that turn ({_short(trained)}) are not what the message says. Use a "
                "template that renders content parts in order.",
                FIELD_REWRITTEN,
            )
        got = _normalised(trained)
        for leaf in leaves:
            if leaf.sentinel in found and not any(_normalised(w) in got for w in leaf.writings):
                raise ChatTemplateError(
                    f"{row.where}: the chat template rewrote {leaf.path}: it "
                    f"{_what_changed(_normalised(leaf.writings[0]), got)}, so the tokens trained for that "
                    "turn are not what the message says. Use a template that renders the field as it is.",
                    FIELD_REWRITTEN,
                )

    def _written_after_stop(
        self,
        row: Row,
        messages: list[dict[str, Any]],
        i: int,
        perturbed: dict[str, Any],
        head: str,
        missing: list[Leaf],
        label: str,
    ) -> None:
        """Refuse the row when a value the turn misses is written after a stop token inside the turn (e.g. a
        second tool call after a call-ending stop token): the model would never write it."""
        turn = self.text(row, [*messages[:i], perturbed])[len(head) :]
        names = {t: name for t in self.stop_ids if (name := self.tok.decode([t]))}
        for leaf in missing:
            at = turn.find(leaf.sentinel)
            stop = next((t for t, name in names.items() if 0 <= turn.find(name) < at), None)
            if stop is not None:
                raise self._stop_inside(row, label, stop, leaf.path)

    def _sentinel_region(
        self, row: Row, messages: list[dict[str, Any]], i: int, perturbed: dict[str, Any], head: str
    ) -> str:
        """The text turn ``i`` trains when the conversation is rendered with ``perturbed`` in its place."""
        try:
            text = self.text(row, [*messages[:i], perturbed, *messages[i + 1 :]])
        except DataError as e:
            raise ChatTemplateError(
                f"{row.where}: messages[{i}] (assistant) cannot be checked: the chat template fails when its "
                f"fields hold other values ({e}). Use a template that renders message fields as they are.",
                FIELD_REWRITTEN,
            ) from None
        if not text.startswith(head):
            raise self._unstable_text(row, i, head, text)
        return self._region(text, len(head))

    def _unstable_text(self, row: Row, i: int, head: str, text: str) -> ChatTemplateError:
        k = common_prefix(head, text)
        return ChatTemplateError(
            f"{row.where}: the chat template renders the messages before messages[{i}] differently depending "
            f"on that turn's fields (at character {k}: {head[k : k + 30]!r} vs {text[k : k + 30]!r}), so "
            f"padless cannot tell which tokens the assistant wrote. {_TEMPLATE_FIX}",
            REWRITES_HISTORY,
        )

    def _dropped(
        self,
        row: Row,
        messages: list[dict[str, Any]],
        i: int,
        leaves: list[Leaf],
        missing: list[Leaf],
        found: set[str],
        trained: str,
        head: str,
        label: str,
    ) -> ChatTemplateError:
        """The refusal for values a template leaves out of a turn, naming the field and what it did."""
        leaf = missing[0]
        field = [x for x in leaves if x.field == leaf.field and x.required]
        whole = all(x in missing for x in field)
        shown = f"the turn trains as {_short(trained)}"
        if leaf.kind == "reasoning":
            what, behaviour = f"ignored {leaf.path} ({shown})", REASONING_IGNORED
            fix = self._reasoning_fix(row, messages, i, leaf, head)
        elif leaf.kind == "thinking":
            what, behaviour = f"did not render {leaf.field}, a thinking part ({shown})", THINKING_DROPPED
            fix = "Use a template that renders thinking parts, or move the reasoning into a field it reads."
        elif leaf.kind == "text":
            what, behaviour = f"did not render {leaf.field} ({shown})", CONTENT_DROPPED
            fix = "Use a template that renders every content part."
        elif whole:
            what, behaviour = f"did not render {leaf.field} ({shown})", CALL_DROPPED
            fix = (
                "The model would learn not to call tools. Use a template that renders tool_calls "
                "(transformers' format: {'type': 'function', 'function': {'name', 'arguments'}}), or leave "
                "the calls out."
            )
        elif leaf.kind == "name":
            ident = next((x for x in leaves if x.field == leaf.field and x.kind == "id"), None)
            instead = (
                f"; it writes the call's id {ident.writings[0]!r} where the name belongs"
                if ident is not None and ident.sentinel in found
                else ""
            )
            what = f"wrote {leaf.field} without its function name {leaf.writings[0]!r}{instead} ({shown})"
            behaviour = CALL_RENAMED
            fix = (
                "Give the calls ids the template takes the name from (e.g. 'functions.NAME:0'), or use a "
                "template that writes function.name."
            )
        else:
            names = sorted(
                {x.path[len(x.field) + 1 :].removesuffix(" (name)") for x in missing if x.field == leaf.field}
            )
            what, behaviour = f"wrote {leaf.field} without {', '.join(names)} ({shown})", ARGUMENTS_DROPPED
            fix = "Use a template that renders every argument of a call."
        return ChatTemplateError(
            f"{row.where}: the chat template {what}, so the tokens trained for {label} (assistant) are not "
            f"what the message says. {fix}",
            behaviour,
        )

    def _reasoning_fix(self, row: Row, messages: list[dict[str, Any]], i: int, leaf: Leaf, head: str) -> str:
        """Where the template reads reasoning from, found by rendering it there instead (another reasoning
        field, or a thinking part), as the fix to give."""
        base = {k: v for k, v in messages[i].items() if k not in REASONING_KEYS}
        sentinel = SENTINEL.format("r")
        content = base.get("content") or ""
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        tries = {
            f"The template reads the reasoning from '{k}': rename the field.": {**base, k: sentinel}
            for k in REASONING_KEYS
            if not leaf.path.endswith(f".{k}")
        }
        tries[
            "The template reads the reasoning from thinking parts: put it in the content as a "
            "{'type': 'thinking', 'thinking': ...} part."
        ] = {
            **base,
            "content": [{"type": "thinking", "thinking": sentinel}, *parts],
        }
        for fix, message in tries.items():
            with contextlib.suppress(ChatTemplateError, DataError):
                if sentinel in self._sentinel_region(row, messages, i, message, head):
                    return fix
        return "Use a template that renders the reasoning, or write it into the content."

    def _chat_by_layout(
        self, row: Row, messages: list[dict[str, Any]], turns: tuple[int, ...]
    ) -> Found | None:
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
            layout = self._layout(json.dumps(shape), turns)
        except (TypeError, ValueError):  # a field JSON cannot hold cannot be part of a shape's key
            return None
        if layout is None:
            return None
        text, spans = self._render_text(row, messages)
        parts, starts, pos = [], [], 0
        for s, piece in enumerate(layout.texts):
            filled = contents[layout.order[s]] if s < len(layout.order) else ""
            parts += [piece, filled]
            starts.append(pos)
            pos += len(piece) + len(filled)
        if "".join(parts) != text:
            return None  # the template changed a content (e.g. trimmed it or cut reasoning out)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        counts = self._prefix_lengths(text, ids, offsets, [starts[s] + k for s, k in layout.cuts])
        if counts is None:
            return None
        bounds = list(zip(layout.turns, counts[::2], counts[1::2], strict=True))
        if any(end <= head for _, head, end in bounds):
            return None
        marked = self._marked(row, offsets, spans) if self.has_generation_markers else None
        return ids, bounds, marked

    def _window_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    def _analyse(self, key: str, turns: tuple[int, ...]) -> _Layout | None:
        def text(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, tools=self.tools
            )

        return _layout_of(text, json.loads(key), self.conversation_tail, turns)

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
            f"the assistant wrote and refuses to guess. {_TEMPLATE_FIX}",
            REWRITES_HISTORY,
        )
