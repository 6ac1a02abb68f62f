"""Odds-ratio preference optimisation on packed pairs: the chosen completion's NLL plus an odds-ratio term,
one policy forward per micro-batch and no reference model.

Both terms are per pair, so the loss is a mean over the step's pairs, whatever the micro-batches: the NLL is
each chosen completion's mean per-token NLL (TRL 1.16 instead takes one token mean over a micro-batch, prompt
tokens included, which changes with how the pairs are batched)."""

from __future__ import annotations

import torch

from padless.config.schema import ORPOConfig, ORPOSettings, TrainSettings
from padless.data import PairExample
from padless.losses import orpo_loss
from padless.proof.load import pad_token_id
from padless.run.loop import MicroBatch, Trainer
from padless.run.session import start_session
from padless.trainers.pairs import PairRecipe, load_pairs, sequence_logps, shares, split_pairs


class ORPORecipe(PairRecipe):
    def __init__(
        self,
        pairs: list[PairExample],
        cfg: TrainSettings,
        orpo: ORPOSettings,
        pad_id: int,
        device: torch.device,
        eval_pairs: list[PairExample] | None = None,
    ):
        super().__init__(pairs, cfg, pad_id, device, eval_pairs)
        self.beta = orpo.beta

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logps, lengths = sequence_logps(model, self.collate(micro.data), self.layout)
        (chosen, rejected), (chosen_len, rejected_len) = split_pairs(logps), split_pairs(lengths)
        chosen_mean, rejected_mean = chosen / chosen_len, rejected / rejected_len
        odds, log_odds = orpo_loss(chosen_mean, rejected_mean, self.beta)
        nll = -chosen_mean
        loss = (nll + odds).sum() / normaliser
        chosen_rewards, rejected_rewards = (
            self.beta * chosen_mean.detach(),
            self.beta * rejected_mean.detach(),
        )
        metrics = {
            "nll_loss": nll.detach(),
            "odds_ratio_loss": odds.detach(),
            "log_odds_ratio": -odds.detach() / self.beta,  # log sigmoid of the log odds ratio
            "log_odds_chosen": log_odds,
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": chosen_rewards > rejected_rewards,
            "logps/chosen": chosen_mean.detach(),
            "logps/rejected": rejected_mean.detach(),
        }
        return loss, {"loss": loss.item(), **shares(metrics, normaliser)}


def run_orpo(cfg: ORPOConfig) -> dict[str, float]:
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    acc, tokenizer, data = session.accelerator, session.tokenizer, cfg.data
    images = session.images

    def pairs(spec: str, role: str):
        return load_pairs(spec, tokenizer, data, cfg.train, role, images=images)

    recipe = ORPORecipe(
        pairs(data.train, "train"),
        cfg.train,
        cfg.orpo,
        pad_token_id(tokenizer),
        acc.device,
        pairs(data.eval, "eval") if data.eval else None,
    )
    saved = images.processor if images else tokenizer  # written beside each checkpoint
    return Trainer(recipe, session.engine(), saved, cfg.train, acc).train()
