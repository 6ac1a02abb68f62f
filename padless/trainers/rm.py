"""Reward modelling: a scalar head trained with Bradley-Terry on packed pairs, read at each sequence's
last token from ``cu_seqlens`` (never from a padding side)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch

from padless.config.schema import RMConfig
from padless.data import PairExample, load_rows, tokenize_scoring
from padless.data.sources import image_inputs, require_scoring_model, stop_token_ids
from padless.errors import InputError
from padless.forward.engine import ModelEngine, sequence_scores
from padless.forward.passes import score_examples
from padless.losses import bradley_terry_loss
from padless.proof.load import load_model, load_tokenizer, pad_token_id
from padless.run.loop import MicroBatch, Trainer
from padless.run.session import start_session
from padless.trainers.pairs import PairRecipe, load_pairs, shares, split_pairs


class RMRecipe(PairRecipe):
    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        pairs: list[PairExample] = micro.data
        scores = sequence_scores(model, self.collate(pairs), self.layout)
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
    images = session.images

    def pairs(spec: str, role: str) -> list[PairExample]:
        return load_pairs(
            spec, tokenizer, data, cfg.train, role, cfg.rm.margin, images, stop_token_ids(cfg.model.name)
        )

    eval_pairs = pairs(data.eval, "eval") if data.eval else None
    recipe = RMRecipe(pairs(data.train, "train"), cfg.train, pad_id, acc.device, eval_pairs)
    saved = images.processor if images else tokenizer  # written beside each checkpoint
    return Trainer(recipe, session.engine(), saved, cfg.train, acc).train()


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
    scorer = load_model(
        model_path,
        task="score",
        device=device,
        pad_id=pad_token_id(tokenizer),
        trust_remote_code=trust_remote_code,
    )
    model = ModelEngine(scorer).eval()
    rows = load_rows(data)
    images = image_inputs(model_path, scorer)
    scores = score_examples(
        model,
        tokenize_scoring(
            rows, tokenizer, max_length=max_length, images=images, stop_ids=stop_token_ids(model_path)
        )[0],
    )
    scored = [{**row.data, "score": s} for row, s in zip(rows, scores, strict=True)]
    if out is not None and out.endswith(".parquet"):  # keeps images held as raw bytes
        datasets.Dataset.from_list(scored).to_parquet(out)
        return Path(out)
    lines = []
    for row, data in zip(rows, scored, strict=True):
        try:
            lines.append(json.dumps(data))
        except TypeError as e:
            raise InputError(
                f"{row.where}: cannot be written back as JSON ({e}; images held as raw bytes); "
                "fix: write Parquet instead, e.g. --out scored.parquet"
            ) from None
    if out is None:
        print("\n".join(lines))
        return None
    path = Path(out)
    path.write_text("\n".join(lines) + "\n")
    return path
