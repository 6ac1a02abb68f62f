"""What DPO and reward modelling share: chosen / rejected pairs that always travel in one micro-batch."""

from __future__ import annotations

from typing import Any

import torch

from padless.config import TrainSettings
from padless.data import PairExample, load_rows, tokenize_preference
from padless.data.images import ImageInputs
from padless.packing import (
    IGNORE_INDEX,
    PackedBatch,
    PaddedBatch,
    budget_batches,
    fixed_count_batches,
    pack,
    to_padded,
)
from padless.trainers.loop import MicroBatch
from padless.trainers.reporting import report_data


class PairRecipe:
    """Plans micro-batches of whole pairs, packed as ``[c1, r1, c2, r2, ...]``; ``units`` count pairs."""

    def __init__(
        self,
        pairs: list[PairExample],
        cfg: TrainSettings,
        pad_id: int,
        device: torch.device,
        eval_pairs: list[PairExample] | None = None,
    ):
        self.pairs, self.cfg, self.pad_id, self.device = pairs, cfg, pad_id, device
        self.eval_pairs = eval_pairs or []

    def _groups(self, pairs: list[PairExample], seed: int, shuffle: bool) -> list[list[int]]:
        if self.cfg.batching == "padded":
            return fixed_count_batches(len(pairs), self.cfg.batch_size, seed=seed, shuffle=shuffle)
        return budget_batches(
            [len(p) for p in pairs], self.cfg.max_tokens_per_batch, seed=seed, shuffle=shuffle
        )

    @staticmethod
    def micro(pairs: list[PairExample]) -> MicroBatch:
        return MicroBatch(pairs, units=len(pairs), tokens=sum(len(p) for p in pairs))

    def plan(self, epoch: int) -> list[MicroBatch]:
        groups = self._groups(self.pairs, self.cfg.seed + epoch, shuffle=True)
        return [self.micro([self.pairs[i] for i in g]) for g in groups]

    def eval_plan(self) -> list[MicroBatch]:
        if not self.eval_pairs:
            return []
        return [
            self.micro([self.eval_pairs[i] for i in g])
            for g in self._groups(self.eval_pairs, 0, shuffle=False)
        ]

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        return {}

    def pack(self, pairs: list[PairExample]) -> PackedBatch:
        return pack([seq for p in pairs for seq in (p.chosen, p.rejected)], device=self.device)

    def collate(self, pairs: list[PairExample]) -> PackedBatch | PaddedBatch:
        batch = self.pack(pairs)
        if self.cfg.batching == "padded":
            return to_padded(batch, self.cfg.padding_side, self.pad_id)
        return batch


def load_pairs(
    spec: str,
    tokenizer: Any,
    data: Any,
    train: TrainSettings,
    role: str,
    margin: bool = False,
    images: ImageInputs | None = None,
) -> list[PairExample]:
    """Tokenized pairs of ``data.<role>`` (skips reported); ``margin`` requires a numeric margin per row,
    else margins are dropped. ``images``: the model's image side (vision-language models)."""
    pairs, stats = tokenize_preference(
        load_rows(spec),
        tokenizer,
        max_length=data.max_length,
        truncation=data.truncation,
        skip_bad_rows=data.skip_bad_rows,
        require_margin=margin,
        images=images,
    )
    report_data(stats, role, spec, train.output_dir)
    if not margin:
        for p in pairs:
            p.meta.pop("margin", None)
    return pairs


def sequence_logps(
    model: torch.nn.Module, batch: PackedBatch | PaddedBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and completion lengths per sequence, ``[N]`` each, in either layout,
    through a (prepared) engine."""
    logps = model(batch, logps=True).logps
    if isinstance(batch, PackedBatch):
        return batch.sequence_sums(logps), batch.sequence_sums(batch.loss_mask[0].float())
    return logps.sum(1), (batch.labels != IGNORE_INDEX).sum(1).float()


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2P]`` in chosen / rejected order -> (chosen ``[P]``, rejected ``[P]``)."""
    return values[0::2], values[1::2]


def shares(values: dict[str, torch.Tensor], normaliser: float) -> dict[str, Any]:
    """Per-pair metrics as shares of the step mean: summed over micro-batches they give the mean."""
    return {key: (v.float().sum() / normaliser).item() for key, v in values.items()}
