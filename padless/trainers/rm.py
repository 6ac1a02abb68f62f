"""Reward modelling: a scalar head trained with Bradley-Terry on packed pairs, read at each sequence's
last token from ``cu_seqlens`` (never from a padding side)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from padless.config import RMConfig
from padless.data import PairExample, load_rows, tokenize_scoring
from padless.losses import bradley_terry_loss
from padless.model import load_model, load_tokenizer, pad_token_id, padded_scores, sequence_scores
from padless.packing import Example, PackedBatch, budget_batches, pack
from padless.sources import require_scoring_model
from padless.trainers.loop import MicroBatch, Trainer
from padless.trainers.pairs import PairRecipe, load_pairs, shares, split_pairs
from padless.trainers.session import start_session


class RMRecipe(PairRecipe):
    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        pairs: list[PairExample] = micro.data
        batch = self.collate(pairs)
        scores = (
            sequence_scores(model, batch) if isinstance(batch, PackedBatch) else padded_scores(model, batch)
        )
        chosen, rejected = split_pairs(scores)
        margin = None
        if "margin" in pairs[0].meta:
            margin = torch.tensor([p.meta["margin"] for p in pairs], device=chosen.device, dtype=chosen.dtype)
        loss = bradley_terry_loss(chosen, rejected, margin).sum() / normaliser
        metrics = {
            "accuracy": chosen > rejected,
            "scores/chosen": chosen.detach(),
            "scores/rejected": rejected.detach(),
            "scores/margins": (chosen - rejected).detach(),
        }
        return loss, {"loss": loss.item(), **shares(metrics, normaliser)}


def run_rm(cfg: RMConfig) -> dict[str, float]:
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg, task="score")
    acc, tokenizer = session.accelerator, session.tokenizer
    data = cfg.data

    pad_id = pad_token_id(tokenizer)
    recipe = RMRecipe(
        load_pairs(data.train, tokenizer, data, cfg.train, "train", cfg.rm.margin),
        cfg.train,
        pad_id,
        acc.device,
        load_pairs(data.eval, tokenizer, data, cfg.train, "eval", cfg.rm.margin) if data.eval else None,
    )
    return Trainer(recipe, session.model, tokenizer, cfg.train, acc).train()


@torch.no_grad()
def score_examples(model: torch.nn.Module, examples: list[Example], max_tokens: int = 8192) -> list[float]:
    """One score per example, in order, on packed batches."""
    scores = [0.0] * len(examples)
    device = next(model.parameters()).device
    for group in budget_batches(
        [len(e) for e in examples], max(max_tokens, max(map(len, examples))), shuffle=False
    ):
        values = sequence_scores(model, pack([examples[i] for i in group], device=device)).tolist()
        for i, v in zip(group, values, strict=True):
            scores[i] = v
    return scores


def score_file(
    model_path: str,
    data: str,
    out: str | None,
    max_length: int = 4096,
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> Path | None:
    """``padless rm score``: score prompt / response rows and write them back with a ``score`` field."""
    require_scoring_model(model_path)
    tokenizer = load_tokenizer(model_path, trust_remote_code)
    model = load_model(model_path, task="score", device=device, trust_remote_code=trust_remote_code).eval()
    rows = load_rows(data)
    scores = score_examples(model, tokenize_scoring(rows, tokenizer, max_length=max_length))
    lines = [json.dumps({**row.data, "score": s}) for row, s in zip(rows, scores, strict=True)]
    if out is None:
        print("\n".join(lines))
        return None
    path = Path(out)
    path.write_text("\n".join(lines) + "\n")
    return path
