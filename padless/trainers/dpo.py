"""Direct preference optimisation (sigmoid, IPO, hinge, SimPO) on packed pairs: one policy forward per
micro-batch, reference log-probs from a frozen model, the policy without its adapters, or precomputed."""

from __future__ import annotations

from typing import Any

import torch

from padless.config.schema import DPOConfig, DPOSettings, TrainSettings
from padless.data import PairExample
from padless.data.sources import stop_token_ids
from padless.forward.engine import inner_engine, reference_engine
from padless.forward.passes import lockstep_pass
from padless.losses import dpo_loss
from padless.proof.load import pad_token_id
from padless.run.loop import MicroBatch, Trainer
from padless.run.session import start_session
from padless.trainers.pairs import PairRecipe, load_pairs, sequence_logps, shares, split_pairs


class DPORecipe(PairRecipe):
    def __init__(
        self,
        pairs: list[PairExample],
        cfg: TrainSettings,
        dpo: DPOSettings,
        pad_id: int,
        device: torch.device,
        ref_model: torch.nn.Module | None = None,
        eval_pairs: list[PairExample] | None = None,
    ):
        super().__init__(pairs, cfg, pad_id, device, eval_pairs)
        self.dpo, self.ref_model = dpo, ref_model
        self.reference_free = dpo.loss_type == "simpo"

    def reference_logps(
        self, model: torch.nn.Module, pairs: list[PairExample], batch: Any
    ) -> torch.Tensor | None:
        """``[2P]`` reference log-probs: stored, or one no-grad forward of the reference."""
        if self.reference_free:
            return None
        if "ref_logps" in pairs[0].meta:
            ref = [x for p in pairs for x in p.meta["ref_logps"]]
            return torch.tensor(ref, device=self.device, dtype=torch.float64)  # stored as fp64 sums
        ref_model = None if self.dpo.reference == "adapters" else self.ref_model
        with torch.no_grad(), reference_engine(model, ref_model) as reference:
            return sequence_logps(reference, batch, self.layout)[0]

    def bind(self, model: torch.nn.Module) -> None:
        """With ``precompute_ref_logps``, store reference log-probs in each pair's meta once, through the
        prepared engines, so training needs no reference forward; the reference model is then freed.
        The pass is split between ranks (each runs its share of the packed batches) and gathered."""
        super().bind(model)
        if not self.dpo.precompute_ref_logps or self.reference_free:
            return
        for pairs in (self.pairs, self.eval_pairs):
            if not pairs:
                continue

            def run(group: list[int], pairs=pairs) -> list[tuple[float, float]]:
                chunk = pairs.take(group)
                return [
                    tuple(r)
                    for r in self.reference_logps(model, chunk, self.collate(chunk)).view(-1, 2).tolist()
                ]

            topology, budget = inner_engine(model).topology, self.cfg.max_tokens_per_batch
            ref = lockstep_pass(range(len(pairs)), self.lengths(pairs), run, budget, share=topology)
            pairs.set_meta("ref_logps", ref)  # pairs are read from disk when used
        self.ref_model = None

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        pairs = micro.data
        batch = self.collate(pairs)
        logps, lengths = sequence_logps(model, batch, self.layout)
        ref = self.reference_logps(model, pairs, batch)
        chosen, rejected = split_pairs(logps)
        chosen_len, rejected_len = split_pairs(lengths)
        ref_chosen, ref_rejected = split_pairs(ref) if ref is not None else (None, None)
        d = self.dpo
        losses, chosen_rewards, rejected_rewards = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            chosen_len,
            rejected_len,
            beta=d.beta,
            loss_type=d.loss_type,
            label_smoothing=d.label_smoothing,
            simpo_gamma=d.simpo_gamma,
        )
        metrics = {
            "rewards/chosen": chosen_rewards,
            "rewards/rejected": rejected_rewards,
            "rewards/margins": chosen_rewards - rejected_rewards,
            "rewards/accuracies": chosen_rewards > rejected_rewards,
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
        }
        if d.rpo_alpha:
            nll = (
                -chosen / chosen_len
            )  # mean NLL per chosen token, per pair: independent of batch composition
            losses = losses + d.rpo_alpha * nll
            metrics["nll"] = nll.detach()
        loss = losses.sum() / normaliser
        return loss, {"loss": loss.item(), **shares(metrics, normaliser)}


def run_dpo(cfg: DPOConfig) -> dict[str, float]:
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    acc, tokenizer = session.accelerator, session.tokenizer
    data = cfg.data

    ref_model = None
    if cfg.dpo.loss_type != "simpo" and cfg.dpo.reference == "model":
        ref_model = session.frozen(session.companion(cfg.dpo.ref_model))
    pad_id = pad_token_id(tokenizer)
    images = session.images
    stops = stop_token_ids(cfg.model.name)
    recipe = DPORecipe(
        load_pairs(data.train, tokenizer, data, cfg.train, "train", images=images, stop_ids=stops),
        cfg.train,
        cfg.dpo,
        pad_id,
        acc.device,
        ref_model,
        load_pairs(data.eval, tokenizer, data, cfg.train, "eval", images=images, stop_ids=stops)
        if data.eval
        else None,
    )
    saved = images.processor if images else tokenizer  # written beside each checkpoint
    return Trainer(recipe, session.engine(), saved, cfg.train, acc).train()
