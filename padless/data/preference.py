"""Preference rows → :class:`PairExample` s whose two sides share exactly the same prompt token ids.

DPO and reward models compare the chosen and rejected completion *of the same prompt*, so the prompt is
tokenized once and both completions are appended to those very ids; nothing is re-tokenized across the
boundary. Accepted row forms (extra fields are ignored):

* explicit string prompt: ``prompt``, ``chosen``, ``rejected`` strings. Like TRL's "standard" format the text
  is a raw continuation: no chat template, even when the tokenizer has one. Prompt and completion are
  tokenized separately and concatenated, and the eos token is appended to the completion unless present.
* explicit conversational prompt: ``prompt`` a list of messages, ``chosen``/``rejected`` lists of one
  assistant message. The prompt is rendered with the generation prompt; a completion is what rendering the
  assistant turn adds, up to its last end-of-turn token (trailing template glue such as ``"\\n"`` is left
  out, so the sequence ends where generation stops and where a reward head is read).
* implicit conversational prompt: ``chosen``/``rejected`` whole conversations. The prompt is their longest
  common prefix of messages; after it each side must be exactly one (different) assistant message.
* implicit string prompt: ``chosen``/``rejected`` whole texts. Each text is tokenized whole and the prompt is
  their longest common *token* prefix (TRL cuts at the longest common character prefix, which can split a
  word and tokenize both halves unnaturally; a token prefix keeps each side exactly the tokenization of its
  full text).

Whether prompts are explicit is decided by the first row (the first with 'chosen' and 'rejected' when
skipping bad rows): once it has a ``prompt``, a row without one is an error rather than silently read as an
implicit pair.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow.compute as pc

from padless.data.chat import ChatEncoder, ChatTemplateError
from padless.data.images import ImageInputs
from padless.data.records import (
    DataError,
    Row,
    SkipStats,
    Truncation,
    chat_messages,
    nonempty_str,
    present_fields,
    reject_images,
    type_name,
)
from padless.data.tokenized import Layout, ids_feature
from padless.forward.packing import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SIDES = ("chosen", "rejected")
_CONTENT_FIX = "Use a chat template that renders an assistant message's content as it is."
_ASSISTANT_LIST = '[{"role": "assistant", "content": ...}]'


@dataclass
class PairExample:
    """A preference pair: both sides start with the same prompt ids, and only completions are targets.

    ``meta`` holds ``row`` and ``source`` (where the row came from) and ``margin`` when the row has one.
    """

    chosen: Example
    rejected: Example
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    @property
    def prompt_length(self) -> int:
        """Number of leading prompt tokens, shared by both sides (none of them a target)."""
        assert self.chosen.loss_mask is not None
        return self.chosen.loss_mask.index(True)

    @property
    def shared_tokens(self) -> int:
        """Tokens a tree row computes once for both sides: the prompt but its last token, whose
        prediction (each side's first completion token) is each side's own."""
        return max(self.prompt_length - 1, 0)


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _PairEncoder(ChatEncoder):
    """Prompt and completion rendering shared by preference pairs and scoring rows."""

    def prompt(self, row: Row, value: Any) -> tuple[list[int], list[dict[str, Any]] | None]:
        """Prompt ids, and the validated messages when the prompt is conversational."""
        if isinstance(value, list):
            messages = chat_messages(row, "prompt", value)
            return self.chat_prompt(row, messages), messages
        if isinstance(value, str):
            return self.leading_specials + self.encode(nonempty_str(row, "prompt", value)), None
        raise row.error(
            "prompt", f"must be a string or a list of messages, got {type_name(value)}", reason="wrong type"
        )

    def chat_prompt(self, row: Row, messages: list[dict[str, Any]]) -> list[int]:
        self.require_template(row)
        return self.render(row, messages, generation_prompt=True)

    def text_completion(self, row: Row, name: str, value: str) -> list[int]:
        ids = self.encode(nonempty_str(row, name, value))
        return ids if ids[-1:] == [self.eos] else [*ids, self.eos]

    def completion(
        self,
        row: Row,
        name: str,
        value: Any,
        prompt_ids: list[int],
        prompt_messages: list[dict[str, Any]] | None,
    ) -> list[int]:
        """The ids ``name`` adds after ``prompt_ids``, rendered the way the prompt was (text or chat)."""
        if prompt_messages is None:
            if isinstance(value, str):
                return self.text_completion(row, name, value)
            problem = (
                "is a list of messages but the prompt is a string; a conversational completion continues a "
                "conversational prompt (a list of messages)"
                if isinstance(value, list)
                else f"must be a string, got {type_name(value)}"
            )
            raise row.error(name, problem, reason="wrong type")
        if not isinstance(value, list):
            raise row.error(
                name,
                f"must be a list with one assistant message ({_ASSISTANT_LIST}) because the prompt is a list "
                f"of messages, got {type_name(value)}",
                reason="wrong type",
            )
        done = chat_messages(row, name, value)
        if (
            len(done) != 1
            or done[0]["role"] != "assistant"
            or not (done[0].get("content") or done[0].get("tool_calls"))
        ):
            raise row.error(
                name,
                f"must be a list with exactly one assistant message with content, got {len(done)} message(s) "
                f"with role(s) {[m['role'] for m in done]}",
                reason="wrong type",
            )
        messages = prompt_messages + done
        full = self.render(row, messages, generation_prompt=False)
        if full[: len(prompt_ids)] != prompt_ids:
            raise self._unstable(row, "the prompt plus the generation prompt", prompt_ids, full)
        head, end = len(prompt_ids), len(full)
        if end == head:
            raise ChatTemplateError(
                f"{row.where}: rendering the assistant message of '{name}' added no token after the "
                "generation prompt, so the completion cannot be located. Check the chat template."
            )
        stop, appended = self.turn_stop(row, messages, len(prompt_messages), full, head, end)
        full += appended
        mask = [True] * len(full)
        self.prove_turn(
            row, messages, len(prompt_messages), full, head, stop, mask, end, f"'{name}'", _CONTENT_FIX
        )
        completion = full[head : stop + 1]
        return completion

    # -- row forms -------------------------------------------------------------------------------------------

    def explicit(self, row: Row) -> tuple[list[int], list[list[int]], str]:
        prompt_ids, messages = self.prompt(row, row.data["prompt"])
        completions = [self.completion(row, s, row.data[s], prompt_ids, messages) for s in SIDES]
        return prompt_ids, completions, "prompt"

    def implicit(self, row: Row) -> tuple[list[int], list[list[int]], str]:
        chosen, rejected = row.data["chosen"], row.data["rejected"]
        if not isinstance(chosen, (str, list)):
            raise row.error(
                "chosen",
                f"must be a string or a list of messages, got {type_name(chosen)}",
                reason="wrong type",
            )
        if isinstance(chosen, str) != isinstance(rejected, str) or not isinstance(rejected, (str, list)):
            kind = "a string" if isinstance(chosen, str) else "a list of messages"
            raise row.error(
                "rejected",
                f"must be {kind} like 'chosen', got {type_name(rejected)}",
                reason="wrong type",
            )
        where = "the prompt (the prefix 'chosen' and 'rejected' share)"
        if isinstance(chosen, str):
            return (*self._implicit_text(row, chosen, rejected), where)
        return (*self._implicit_chat(row, chosen, rejected), where)

    def _implicit_text(self, row: Row, chosen: str, rejected: str) -> tuple[list[int], list[list[int]]]:
        full = [
            self.leading_specials + self.encode(nonempty_str(row, s, v))
            for s, v in zip(SIDES, (chosen, rejected), strict=True)
        ]
        if chosen == rejected:
            raise _equal(row)
        k = _common_prefix(*full)
        if k <= len(self.leading_specials):
            raise _no_shared_prompt(row, "do not start with the same token")
        for side, ids in zip(SIDES, full, strict=True):
            if len(ids) == k:
                other = "rejected" if side == "chosen" else "chosen"
                raise row.error(
                    side,
                    f"adds no token after the prefix it shares with '{other}' (the implicit prompt), so it "
                    "has no completion",
                    reason="empty content",
                )
        return full[0][:k], [ids[k:] if ids[-1] == self.eos else [*ids[k:], self.eos] for ids in full]

    def _implicit_chat(
        self, row: Row, chosen: list[Any], rejected: list[Any]
    ) -> tuple[list[int], list[list[int]]]:
        convs = [chat_messages(row, s, v) for s, v in zip(SIDES, (chosen, rejected), strict=True)]
        if convs[0] == convs[1]:
            raise _equal(row)
        k = _common_prefix(*convs)
        if k == 0:
            raise _no_shared_prompt(row, "differ from their first message on")
        for side, conv in zip(SIDES, convs, strict=True):
            rest = conv[k:]
            if len(rest) != 1 or rest[0]["role"] != "assistant":
                raise row.error(
                    side,
                    "must be the prompt messages followed by exactly one assistant message, but after the "
                    f"{k} leading message(s) it shares with the other side it has {len(rest)} message(s), "
                    f"role(s) {[m['role'] for m in rest]}",
                    reason="wrong type",
                    fix="Make 'chosen' and 'rejected' identical up to their final assistant message (or give "
                    "an explicit 'prompt'), or set data.skip_bad_rows: true to skip it.",
                )
        prompt_ids = self.chat_prompt(row, convs[0][:k])
        completions = [
            self.completion(row, s, conv[k:], prompt_ids, convs[0][:k])
            for s, conv in zip(SIDES, convs, strict=True)
        ]
        return prompt_ids, completions


def _equal(row: Row, after: str = "") -> DataError:
    return row.error(
        "rejected",
        f"equals 'chosen'{after}, so the pair carries no preference",
        reason="chosen equals rejected",
    )


def _no_shared_prompt(row: Row, how: str) -> DataError:
    return row.error(
        None,
        f"'chosen' and 'rejected' {how}, so they share no prompt (a row without 'prompt' takes the prefix "
        "both share as its prompt)",
        reason="no shared prompt",
        fix="Add a 'prompt' field, or set data.skip_bad_rows: true to skip it.",
    )


def _fit_prompt(row: Row, prompt_ids: list[int], prompt_field: str, max_length: int) -> None:
    if len(prompt_ids) >= max_length:
        subject = "field 'prompt'" if prompt_field == "prompt" else prompt_field
        raise DataError(
            f"{row.where}: {subject} is {len(prompt_ids)} tokens, which leaves no room for a completion "
            f"within max_length={max_length} (the prompt is never truncated). Raise data.max_length, shorten "
            "the prompt, or set data.skip_bad_rows: true to skip it.",
            source=row.source,
            index=row.index,
            field="prompt",
            reason="prompt too long",
        )


def _fit_completion(
    row: Row, name: str, prompt_len: int, ids: list[int], max_length: int, truncation: Truncation
) -> list[int]:
    total = prompt_len + len(ids)
    if total <= max_length:
        return ids
    if truncation == "error":
        raise row.error(
            name,
            f"makes a sequence of {total} tokens (prompt {prompt_len} + completion {len(ids)}), more than "
            f"max_length={max_length}",
            reason="too long",
            fix="Raise data.max_length, set data.truncation: truncate to cut the completion (the prompt is "
            "kept whole), or set data.skip_bad_rows: true to skip it.",
        )
    # _fit_prompt ran first, so at least one completion token always survives.
    return ids[: max_length - prompt_len]


def _margin(row: Row, required: bool) -> float | None:
    value = row.data.get("margin")
    if value is None:
        if required:
            raise row.error(
                "margin",
                "is missing, but rm.margin: true trains with a per-row margin",
                reason="missing field",
                fix="Add a numeric 'margin' to every row, set rm.margin: false, or set data.skip_bad_rows: "
                "true to skip it.",
            )
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise row.error(
            "margin", f"must be a finite number, got {type_name(value)} {value!r}", reason="wrong type"
        )
    return float(value)


def _prepare(row: Row, images: ImageInputs | None) -> tuple[Row, list[Any]]:
    """The row with its images loaded (image models), or a refusal of images (text models)."""
    if images is None:
        reject_images(row)
        return row, []
    prepared = images.prepare(row)
    return prepared.row, prepared.images


def _example(
    images: ImageInputs | None,
    ids: list[int],
    mask: list[bool] | None,
    vision: dict[str, Any] | None,
    meta: dict[str, Any],
) -> Example:
    return Example(ids, mask, meta) if images is None else images.example(ids, mask, vision, meta)


def check_args(max_length: int, truncation: str) -> None:
    if truncation not in ("error", "truncate"):
        raise ValueError(f"unknown truncation {truncation!r}; valid: error, truncate")
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")


def _require(row: Row, names: Sequence[str], how: str) -> None:
    present = present_fields(row)
    for name in names:
        if name not in present:
            found = sorted(present) or "no non-null fields"
            raise row.error(
                name,
                f"is missing: {how} need {', '.join(repr(n) for n in names)}; found {found}",
                reason="missing field",
                fix="Give every row these fields, or set data.skip_bad_rows: true to skip it.",
            )


def pair_fields(rows: Iterable[Row], skip_bad_rows: bool) -> tuple[tuple[str, ...], str]:
    """The fields every row needs and how that was decided: explicit prompts if the first row (the first
    with 'chosen' and 'rejected' when skipping bad rows) has one. Reads rows only as far as it needs to."""
    rows = iter(rows)
    first = next(rows)
    if skip_bad_rows and not set(SIDES) <= present_fields(first):
        first = next((r for r in rows if set(SIDES) <= present_fields(r)), first)
    if "prompt" in present_fields(first):
        return ("prompt", *SIDES), f"rows with explicit prompts (as {first.where} has)"
    return SIDES, "preference rows"


def tokenize_preference(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    *,
    images: ImageInputs | None = None,
    **options: Any,
) -> tuple[list[PairExample], SkipStats]:
    """Preference rows tokenized in memory by ``PairLayout(**options)`` (:meth:`Layout.tokenize`)."""
    return PairLayout(**options).tokenize(rows, tokenizer, images)


def tokenize_scoring(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    *,
    images: ImageInputs | None = None,
    **options: Any,
) -> tuple[list[Example], SkipStats]:
    """Scoring rows tokenized in memory by ``ScoringLayout(**options)`` (:meth:`Layout.tokenize`)."""
    return ScoringLayout(**options).tokenize(rows, tokenizer, images)


@dataclass
class PairLayout(Layout[PairExample]):
    """Preference rows into pairs (see the module docstring for the accepted forms); stored as the shared
    ``prompt_ids`` once, each side's completion, and ``margin``.

    Each side is one sequence of at most ``max_length`` tokens. A prompt of ``max_length`` tokens or more is a
    bad row; a longer sequence is a bad row with ``truncation="error"`` and has its *completion* cut with
    ``"truncate"``. A numeric ``margin`` field is kept in ``meta["margin"]`` (required with
    ``require_margin``, for reward models trained with ``rm.margin``; dropped with ``keep_margin=False``).
    Bad rows raise :class:`DataError` unless
    ``skip_bad_rows``, which counts them; template problems raise :class:`ChatTemplateError` regardless.
    Images (``images`` in :meth:`prepare`, the model's processor) belong to the prompt, so chosen and rejected
    share them. ``stop_ids``: the tokens the model stops at besides the tokenizer's eos (its generation
    config's), which end a chat completion.
    """

    name: ClassVar[str] = "preference"
    max_length: int
    truncation: Truncation = "error"
    skip_bad_rows: bool = False
    require_margin: bool = False
    keep_margin: bool = True
    stop_ids: tuple[int, ...] = ()
    _state: tuple[_PairEncoder, tuple[str, ...], str, ImageInputs | None] | None = field(
        default=None, repr=False
    )

    def __post_init__(self) -> None:
        check_args(self.max_length, self.truncation)

    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        needed, how = pair_fields(rows, self.skip_bad_rows)
        self._state = (_PairEncoder(tokenizer, self.stop_ids), needed, how, images)

    def examples(self, row: Row) -> list[PairExample]:
        return [self.pair(row)]

    def pair(self, row: Row) -> PairExample:
        """One row as a pair; a bad row raises :class:`DataError`. After :meth:`prepare`."""
        assert self._state is not None, "prepare() first"
        enc, needed, how, images = self._state
        _require(row, needed, how)
        row, pictures = _prepare(row, images)
        if "prompt" in present_fields(row):
            prompt_ids, completions, prompt_field = enc.explicit(row)
        else:
            prompt_ids, completions, prompt_field = enc.implicit(row)
        vision = None
        if images is not None:
            prompt_ids, _, vision = images.expand(row, prompt_ids, None, pictures)
        if completions[0] == completions[1]:
            raise _equal(row)
        _fit_prompt(row, prompt_ids, prompt_field, self.max_length)
        fitted = [
            _fit_completion(row, s, len(prompt_ids), ids, self.max_length, self.truncation)
            for s, ids in zip(SIDES, completions, strict=True)
        ]
        if fitted[0] == fitted[1]:
            raise _equal(row, f" once both are truncated to max_length={self.max_length}")
        meta: dict[str, Any] = {"row": row.index, "source": row.source}
        margin = _margin(row, self.require_margin)
        if margin is not None and self.keep_margin:
            meta["margin"] = margin
        chosen, rejected = (
            _example(
                images,
                prompt_ids + ids,
                [False] * len(prompt_ids) + [True] * len(ids),
                vision,
                {"row": row.index, "source": row.source, "side": side},
            )
            for side, ids in zip(SIDES, fitted, strict=True)
        )
        return PairExample(chosen, rejected, meta)

    def columns(self, item: PairExample) -> dict[str, Any]:
        n = item.prompt_length
        return {
            "prompt_ids": item.chosen.input_ids[:n],
            "chosen_ids": item.chosen.input_ids[n:],
            "rejected_ids": item.rejected.input_ids[n:],
            "margin": item.meta.get("margin"),
        }

    def features(self) -> dict[str, Any]:
        import datasets

        ids = ids_feature()
        return {
            "prompt_ids": ids,
            "chosen_ids": ids,
            "rejected_ids": ids,
            "margin": datasets.Value("float64"),
        }

    def read_columns(self, stored: list[str]) -> list[str]:
        return ["prompt_ids", "chosen_ids", "rejected_ids", "margin"]

    def shared(self, dataset: Any) -> np.ndarray:
        """:attr:`PairExample.shared_tokens` of every pair, from its stored prompt."""
        prompts = pc.list_value_length(dataset.data.column("prompt_ids")).to_numpy()
        return np.maximum(prompts.astype(np.int64) - 1, 0)

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[PairExample]:
        pairs = []
        for row, prompt, chosen, rejected, margin in zip(
            columns["row"],
            columns["prompt_ids"],
            columns["chosen_ids"],
            columns["rejected_ids"],
            columns["margin"],
            strict=True,
        ):
            sides = [
                Example(
                    prompt + ids,
                    [False] * len(prompt) + [True] * len(ids),
                    {"row": row, "source": source, "side": side},
                )
                for side, ids in (("chosen", chosen), ("rejected", rejected))
            ]
            meta: dict[str, Any] = {"row": row, "source": source}
            if margin is not None:
                meta["margin"] = margin
            pairs.append(PairExample(*sides, meta))
        return pairs


@dataclass
class ScoringLayout(Layout[Example]):
    """``{"prompt", "response"}`` rows into sequences for scoring with a reward model (``loss_mask`` is None);
    stored as ``input_ids``.

    A response is rendered exactly like a preference completion, so a row scores the same sequence a reward
    model was trained on; ``max_length`` and ``truncation`` cut it as :class:`PairLayout` cuts a completion.
    ``meta`` keeps ``row`` and ``source`` so scores map back to their rows, also when ``skip_bad_rows``
    leaves some out.
    """

    name: ClassVar[str] = "scoring"
    max_length: int
    truncation: Truncation = "error"
    skip_bad_rows: bool = False
    stop_ids: tuple[int, ...] = ()
    _state: tuple[_PairEncoder, ImageInputs | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_args(self.max_length, self.truncation)

    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        self._state = (_PairEncoder(tokenizer, self.stop_ids), images)

    def examples(self, row: Row) -> list[Example]:
        assert self._state is not None, "prepare() first"
        enc, images = self._state
        _require(row, ("prompt", "response"), "scoring rows")
        row, pictures = _prepare(row, images)
        prompt_ids, messages = enc.prompt(row, row.data["prompt"])
        response = enc.completion(row, "response", row.data["response"], prompt_ids, messages)
        vision = None
        if images is not None:
            prompt_ids, _, vision = images.expand(row, prompt_ids, None, pictures)
        _fit_prompt(row, prompt_ids, "prompt", self.max_length)
        response = _fit_completion(
            row, "response", len(prompt_ids), response, self.max_length, self.truncation
        )
        meta = {"row": row.index, "source": row.source}
        return [_example(images, prompt_ids + response, None, vision, meta)]

    def columns(self, item: Example) -> dict[str, Any]:
        return {"input_ids": item.input_ids}

    def features(self) -> dict[str, Any]:
        return {"input_ids": ids_feature()}

    def read_columns(self, stored: list[str]) -> list[str]:
        return ["input_ids"]

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[Example]:
        return [
            Example(ids, None, {"row": row, "source": source})
            for row, ids in zip(columns["row"], columns["input_ids"], strict=True)
        ]
