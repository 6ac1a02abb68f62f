"""What DPO and reward modelling share: chosen / rejected pairs that always travel in one micro-batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from padless.config.schema import TrainSettings
from padless.data import PairExample
from padless.data.images import ImageInputs
from padless.data.preference import PairLayout
from padless.data.tokenized import ExampleSet, as_set, load_set
from padless.forward.engine import BatchLayout, inner_engine
from padless.forward.packing import PackedBatch, budget_batches, fixed_count_batches, pack
from padless.run.loop import MicroBatch, Recipe
from padless.run.reporting import report_data


class PairRecipe(Recipe):
    """Plans micro-batches of whole pairs, packed as ``[c1, r1, c2, r2, ...]``; ``units`` count pairs.
    Plans come from the sets' length column; a micro-batch's pairs are read when it runs.

    The plan is blind to the layout: pairs are budgeted by their flat tokens whether or not the engine
    runs tree rows (``train.tree_packing``), so the same pairs make the same optimizer steps in every
    epoch, on one rank or split over a sequence-parallel group (which runs flat rows); a tree row only
    computes fewer tokens (each pair's prompt once)."""

    tree = False  # whether the bound engine runs tree rows (set in bind): sizes no-grad passes only

    def __init__(
        self,
        pairs: Sequence[PairExample],
        cfg: TrainSettings,
        pad_id: int,
        device: torch.device,
        eval_pairs: Sequence[PairExample] | None = None,
    ):
        self.pairs, self.cfg, self.device = as_set(pairs), cfg, device
        self.layout = BatchLayout.of(cfg, pad_id)
        self.eval_pairs = as_set(eval_pairs or [])

    def bind(self, model: torch.nn.Module) -> None:
        self.tree = inner_engine(model).tree

    def lengths(self, pairs: ExampleSet[PairExample]) -> np.ndarray:
        """Tokens each pair's forward computes: both sides, their shared prompt once in a tree row. Sizes
        the rows of a no-grad pass over every pair (DPO's reference precompute), never a training plan."""
        return pairs.lengths - pairs.shared if self.tree else pairs.lengths

    def _micros(self, pairs: ExampleSet[PairExample], seed: int, shuffle: bool) -> list[MicroBatch]:
        if self.cfg.batching == "padded":
            groups = fixed_count_batches(len(pairs), self.cfg.batch_size, seed=seed, shuffle=shuffle)
        else:  # by flat tokens (see the class docstring)
            budget = self.cfg.max_tokens_per_batch
            groups = budget_batches(pairs.lengths, budget, seed=seed, shuffle=shuffle)
        return [MicroBatch(pairs.select(g), units=len(g), tokens=int(pairs.lengths[g].sum())) for g in groups]

    def plan(self, epoch: int) -> list[MicroBatch]:
        return self._micros(self.pairs, self.cfg.seed + epoch, shuffle=True)

    def eval_plan(self) -> list[MicroBatch]:
        return self._micros(self.eval_pairs, 0, shuffle=False) if self.eval_pairs else []

    def collate(self, pairs: list[PairExample]) -> PackedBatch:
        """The pairs packed as ``[c1, r1, c2, r2, ...]`` (the engine lays them out as ``self.layout``)."""
        return pack([seq for p in pairs for seq in (p.chosen, p.rejected)], device=self.device)


def load_pairs(
    spec: str,
    tokenizer: Any,
    data: Any,
    train: TrainSettings,
    role: str,
    margin: bool = False,
    images: ImageInputs | None = None,
    stop_ids: tuple[int, ...] = (),
) -> ExampleSet[PairExample]:
    """Tokenized pairs of ``data.<role>`` (skips reported); ``margin`` requires a numeric margin per row,
    else margins are dropped. ``images``: the model's image side (vision-language models). ``stop_ids``: the
    model's generation-config stop tokens, which end a chat completion."""
    layout = PairLayout(
        max_length=data.max_length,
        truncation=data.truncation,
        skip_bad_rows=data.skip_bad_rows,
        require_margin=margin,
        keep_margin=margin,
        stop_ids=stop_ids,
    )
    pairs, stats = load_set(
        spec, layout, tokenizer, images=images, cache_dir=data.cache_dir, num_proc=data.num_proc
    )
    report_data(stats, role, spec, train.output_dir)
    return pairs


def sequence_logps(
    model: torch.nn.Module, batch: PackedBatch, layout: BatchLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs and completion lengths per sequence, ``[N]`` each, through a
    (prepared) engine that lays ``batch`` out as ``layout`` says."""
    logps = model(batch, layout=layout, logps=True).logps
    return batch.sequence_sums(logps), batch.sequence_sums(batch.loss_mask[0].float())


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2P]`` in chosen / rejected order -> (chosen ``[P]``, rejected ``[P]``)."""
    return values[0::2], values[1::2]


def shares(values: dict[str, torch.Tensor], normaliser: float) -> dict[str, Any]:
    """Per-pair metrics as shares of the step mean: summed over micro-batches they give the mean."""
    return {key: (v.float().sum() / normaliser).item() for key, v in values.items()}
