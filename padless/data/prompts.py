"""RL prompt rows → :class:`PromptExample` s: prompt ids to sample from, plus the columns rewards need.

A row is ``{"prompt": ..., <any other columns>}``. The prompt is what the policy answers, so it is rendered
the way the assistant will see it at generation time:

* a list of messages is rendered with the chat template and the generation prompt (the assistant header),
  and must end with the message the assistant replies to (not with an assistant message);
* a string is wrapped as one user message and rendered the same way when the tokenizer has a chat template
  (``chat_template=None``, the default) or when ``chat_template=True`` demands one; with
  ``chat_template=False`` it is raw text, tokenized as is after the tokenizer's leading specials (BOS).

Every other column (``answer``, a test case, a rubric, ...) is kept in ``fields`` and handed to reward
functions by name, one value per sample. Prompts are never truncated: cutting a question changes what the
right answer is, so a prompt longer than ``max_prompt_length`` is a bad row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from padless.data.chat import ChatEncoder, ChatTemplateError
from padless.data.images import ImageInputs
from padless.data.records import (
    RawRows,
    Row,
    SkipStats,
    chat_messages,
    nonempty_str,
    reject_images,
    type_name,
)
from padless.data.tokenized import Layout, ids_feature

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT = "prompt"


@dataclass
class PromptExample:
    """One prompt to sample completions for, and the row's other columns for the reward functions.

    ``text`` is exactly the string that was tokenized (the rendered template, or the raw prompt without the
    tokenizer's leading special tokens), so reward functions and logs see what the policy saw.
    """

    prompt_ids: list[int]
    fields: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # {"row", "source"}
    text: str = ""
    vision: dict[str, Any] | None = None  # the prompt's image inputs (vision-language models)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def row(self) -> int:
        """The prompt's row in its data set."""
        return self.meta["row"]

    @property
    def source(self) -> str:
        """The data set the prompt was read from."""
        return self.meta["source"]


class _PromptEncoder(ChatEncoder):
    """Renders one prompt to (ids, text) according to ``chat_template``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: bool | None) -> None:
        super().__init__(tokenizer)
        self.chat_template = chat_template

    @property
    def use_template_for_strings(self) -> bool:
        if self.chat_template is None:
            return self.template is not None
        return self.chat_template

    def prompt(self, row: Row) -> tuple[list[int], str]:
        value = row.data.get(PROMPT)
        if value is None:
            found = sorted(k for k, v in row.data.items() if v is not None) or "no non-null fields"
            raise row.error(
                PROMPT,
                f"is missing: RL rows need a 'prompt' (a string or a list of messages); found {found}",
                reason="missing field",
                fix="Add a 'prompt' to every row (rename the column if it has another name), or set "
                "data.skip_bad_rows: true to skip it.",
            )
        if isinstance(value, str):
            text = nonempty_str(row, PROMPT, value)
            if not self.use_template_for_strings:
                return self.leading_specials + self.encode(text), text
            return self.render_prompt(row, [{"role": "user", "content": text}])
        if isinstance(value, list):
            if self.chat_template is False:
                raise row.error(
                    PROMPT,
                    "is a list of messages, but data.chat_template is false (raw text); messages can only "
                    "be rendered with the chat template",
                    reason="wrong type",
                    fix="Give the prompt as a string, set data.chat_template to null (or true), or set "
                    "data.skip_bad_rows: true to skip it.",
                )
            messages = chat_messages(row, PROMPT, value)
            if messages[-1]["role"] == "assistant":
                raise row.error(
                    f"{PROMPT}[{len(messages) - 1}].role",
                    "is 'assistant': an RL prompt ends with the message the assistant replies to, and the "
                    "completion is sampled after the generation prompt",
                    reason="ends with assistant",
                    fix="Drop the final assistant message (or move it into the reward columns), or set "
                    "data.skip_bad_rows: true to skip it.",
                )
            return self.render_prompt(row, messages)
        raise row.error(
            PROMPT,
            f"must be a string or a list of {{role, content}} messages, got {type_name(value)}",
            reason="wrong type",
        )

    def render_prompt(self, row: Row, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        self.require_template(row)
        ids = self.render(row, messages, generation_prompt=True)
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return ids, str(text)


def tokenize_prompts(
    rows: Sequence[Row],
    tokenizer: PreTrainedTokenizerBase,
    *,
    images: ImageInputs | None = None,
    **options: Any,
) -> tuple[list[PromptExample], SkipStats]:
    """RL prompt rows tokenized in memory by ``PromptLayout(**options)`` (:meth:`Layout.tokenize`)."""
    return PromptLayout(**options).tokenize(rows, tokenizer, images)


def reward_inputs(
    examples: Sequence[PromptExample], num_generations: int = 1
) -> tuple[list[str], dict[str, list[Any]]]:
    """Per-sample prompt texts and reward columns, each example repeated ``num_generations`` times in a row.

    This is the layout reward functions receive (one entry per completion, a prompt's samples adjacent).
    A column some rows lack is filled with None for them, so every list has one value per sample.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations!r}")
    names = list(dict.fromkeys(k for ex in examples for k in ex.fields))
    prompts = [ex.text for ex in examples for _ in range(num_generations)]
    columns = {
        name: [ex.fields.get(name) for ex in examples for _ in range(num_generations)] for name in names
    }
    return prompts, columns


@dataclass
class PromptLayout(Layout[PromptExample]):
    """RL prompt rows into prompts (see the module docstring for how they are rendered); stored as
    ``prompt_ids``, the rendered ``text`` and the row's other columns for reward functions.

    Bad rows (missing, mistyped or empty prompt, a prompt longer than ``max_prompt_length`` tokens) raise
    :class:`DataError` unless ``skip_bad_rows``, which counts them. Tokenizer problems (``chat_template=True``
    or message prompts without a template) raise :class:`ChatTemplateError` regardless, since no row can fix
    them. Rows read from JSON keep their other columns as one JSON text (``fields``, exact for JSON values);
    rows read from Arrow keep them as columns of their own types (``field.<name>``).
    """

    name: ClassVar[str] = "prompts"
    max_prompt_length: int
    chat_template: bool | None = None
    skip_bad_rows: bool = False
    _state: tuple[_PromptEncoder, ImageInputs | None] | None = field(default=None, repr=False)
    _fields: dict[str, Any] | None = field(default=None, repr=False)  # Arrow rows: name -> feature

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_prompt_length, bool)
            or not isinstance(self.max_prompt_length, int)
            or self.max_prompt_length <= 0
        ):
            raise ValueError(f"max_prompt_length must be a positive integer, got {self.max_prompt_length!r}")
        if self.chat_template not in (None, True, False):
            raise ValueError(f"chat_template must be None, True or False, got {self.chat_template!r}")

    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        enc = _PromptEncoder(tokenizer, self.chat_template)
        if self.chat_template is True and enc.template is None:
            raise ChatTemplateError(
                "data.chat_template is true, but the tokenizer has no chat_template. Set "
                "tokenizer.chat_template to a Jinja chat template, or set data.chat_template to false (raw "
                "text) or null (template only when the tokenizer has one)."
            )
        self._state = (enc, images)

    def store(self, raw: RawRows) -> None:
        self._fields = (
            {k: v for k, v in raw.dataset.features.items() if k != PROMPT}
            if raw.decoder.numbering is None
            else None
        )

    def examples(self, row: Row) -> list[PromptExample]:
        assert self._state is not None, "prepare() first"
        enc, images = self._state
        vision = None
        if images is None:
            reject_images(row)
            ids, text = enc.prompt(row)
        else:
            prepared = images.prepare(row)
            row = prepared.row
            ids, text = enc.prompt(row)
            ids, _, vision = images.expand(row, ids, None, prepared.images)
        if len(ids) > self.max_prompt_length:
            raise row.error(
                PROMPT,
                f"is {len(ids)} tokens as rendered, more than max_prompt_length={self.max_prompt_length} "
                "(prompts are never truncated: a cut question no longer matches its answer)",
                reason="prompt too long",
                fix="Raise data.max_prompt_length, shorten the prompt, or set data.skip_bad_rows: true "
                "to skip it.",
            )
        fields = {k: v for k, v in row.data.items() if k != PROMPT}
        return [PromptExample(ids, fields, {"row": row.index, "source": row.source}, text, vision)]

    def columns(self, item: PromptExample) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_ids": item.prompt_ids, "text": item.text}
        if self._fields is None:
            out["fields"] = json.dumps(item.fields, ensure_ascii=False)
        else:
            out.update({f"field.{k}": item.fields.get(k) for k in self._fields})
        return out

    def features(self) -> dict[str, Any]:
        import datasets

        out = {"prompt_ids": ids_feature(), "text": datasets.Value("string")}
        if self._fields is None:
            return out | {"fields": datasets.Value("string")}
        return out | {f"field.{k}": v for k, v in self._fields.items()}

    def read_columns(self, stored: list[str]) -> list[str]:
        return ["prompt_ids", "text", *(c for c in stored if c == "fields" or c.startswith("field."))]

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[PromptExample]:
        own = [c for c in columns if c.startswith("field.")]
        out = []
        for k, (row, ids, text) in enumerate(
            zip(columns["row"], columns["prompt_ids"], columns["text"], strict=True)
        ):
            if "fields" in columns:
                fields = json.loads(columns["fields"][k])
            else:
                fields = {c.removeprefix("field."): columns[c][k] for c in own}
            out.append(PromptExample(ids, fields, {"row": row, "source": source}, text))
        return out
