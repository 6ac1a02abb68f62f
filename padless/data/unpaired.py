"""Unpaired preference rows → completions labelled desirable or undesirable (KTO).

Accepted row forms (extra fields are ignored; the first row decides which, as for pairs):

* unpaired: ``prompt``, ``completion`` and ``label`` (a bool: true for a desirable completion), the prompt a
  string or a list of messages and the completion rendered exactly as a preference completion
  (:mod:`padless.data.preference`);
* preference pairs (any form :mod:`padless.data.preference` reads): each row gives two completions of one
  prompt, the chosen one desirable and the rejected one undesirable, as TRL reads pairs for KTO.

Each completion is an :class:`Example` of prompt + completion ids whose loss mask marks the completion, with
``meta["desirable"]``. Text only: images are refused with the row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from padless.data.images import ImageInputs
from padless.data.preference import (
    PairLayout,
    _fit_completion,
    _fit_prompt,
    _PairEncoder,
    _require,
    check_args,
)
from padless.data.records import Row, Truncation, present_fields, reject_images
from padless.data.tokenized import ArrowSet, ExampleSet, Layout, ids_feature
from padless.forward.packing import Example

UNPAIRED = ("prompt", "completion", "label")
Form = Literal["unpaired", "pairs"]


def unpaired_form(rows: Iterable[Row], skip_bad_rows: bool) -> tuple[Form, Row]:
    """Whether rows are unpaired completions or pairs, and the row that decided it: the first row (the first
    with 'completion' or 'chosen' when skipping bad rows) is unpaired if it has a 'completion'."""
    rows = iter(rows)
    first = next(rows)
    if skip_bad_rows and not {"completion", "chosen"} & present_fields(first):
        first = next((r for r in rows if {"completion", "chosen"} & present_fields(r)), first)
    return ("unpaired" if "completion" in present_fields(first) else "pairs"), first


def _labelled(example: Example, desirable: bool) -> Example:
    meta = {"row": example.meta["row"], "source": example.meta["source"], "desirable": desirable}
    return Example(example.input_ids, example.loss_mask, meta)


def prompt_length(example: Example) -> int:
    """Leading prompt tokens of a labelled completion (none of them a target)."""
    assert example.loss_mask is not None
    return example.loss_mask.index(True)


def desirable_flags(items: ExampleSet[Example]) -> np.ndarray:
    """Each completion's label, ``[N]`` bools, without reading the items of an on-disk set."""
    if isinstance(items, ArrowSet):
        return items.dataset.data.column("desirable").to_numpy(zero_copy_only=False).astype(bool)
    return np.array([e.meta["desirable"] for e in items], dtype=bool)


@dataclass
class UnpairedLayout(Layout[Example]):
    """Unpaired rows (or pairs, two completions each) into labelled completions; stored as ``prompt_ids``,
    ``completion_ids`` and ``desirable``. ``max_length``, ``truncation`` and bad rows as in
    :class:`~padless.data.preference.PairLayout`, which makes the completions of pairs."""

    name: ClassVar[str] = "unpaired"
    max_length: int
    truncation: Truncation = "error"
    skip_bad_rows: bool = False
    _state: tuple[_PairEncoder, str] | PairLayout | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_args(self.max_length, self.truncation)

    def prepare(self, rows: Iterable[Row], tokenizer: Any, images: ImageInputs | None = None) -> None:
        if images is not None:
            raise ValueError("unpaired (KTO) rows are text only; tokenize them without a model's image side")
        form, first = unpaired_form(rows, self.skip_bad_rows)
        if form == "pairs":
            pairs = PairLayout(max_length=self.max_length, truncation=self.truncation)
            pairs.prepare([first], tokenizer)  # the first row decides the form of every pair
            self._state = pairs
        else:
            self._state = (_PairEncoder(tokenizer), f"unpaired rows (as {first.where} has a 'completion')")

    def examples(self, row: Row) -> list[Example]:
        """The row's labelled completions (two for a pair); a bad row raises
        :class:`~padless.data.records.DataError`."""
        assert self._state is not None, "prepare() first"
        if isinstance(self._state, PairLayout):
            pair = self._state.pair(row)
            return [_labelled(pair.chosen, True), _labelled(pair.rejected, False)]
        enc, how = self._state
        _require(row, UNPAIRED, how)
        reject_images(row)
        label = row.data["label"]
        if not isinstance(label, bool):
            raise row.error(
                "label",
                f"must be true (a desirable completion) or false (an undesirable one), got {label!r}",
                reason="wrong type",
            )
        prompt_ids, messages = enc.prompt(row, row.data["prompt"])
        completion = enc.completion(row, "completion", row.data["completion"], prompt_ids, messages)
        _fit_prompt(row, prompt_ids, "prompt", self.max_length)
        completion = _fit_completion(
            row, "completion", len(prompt_ids), completion, self.max_length, self.truncation
        )
        mask = [False] * len(prompt_ids) + [True] * len(completion)
        meta = {"row": row.index, "source": row.source, "desirable": label}
        return [Example(prompt_ids + completion, mask, meta)]

    def columns(self, item: Example) -> dict[str, Any]:
        n = prompt_length(item)
        return {
            "prompt_ids": item.input_ids[:n],
            "completion_ids": item.input_ids[n:],
            "desirable": item.meta["desirable"],
        }

    def features(self) -> dict[str, Any]:
        import datasets

        return {
            "prompt_ids": ids_feature(),
            "completion_ids": ids_feature(),
            "desirable": datasets.Value("bool"),
        }

    def read_columns(self, stored: list[str]) -> list[str]:
        return ["prompt_ids", "completion_ids", "desirable"]

    def decode(self, columns: dict[str, list[Any]], source: str) -> list[Example]:
        return [
            Example(
                prompt + completion,
                [False] * len(prompt) + [True] * len(completion),
                {"row": row, "source": source, "desirable": desirable},
            )
            for row, prompt, completion, desirable in zip(
                columns["row"],
                columns["prompt_ids"],
                columns["completion_ids"],
                columns["desirable"],
                strict=True,
            )
        ]
