"""Kahneman-Tversky optimisation on packed, unpaired completions labelled desirable or undesirable, against
a reference from a frozen model, the policy without its adapters, or precomputed.

The KL baseline ``z`` (KTO's reference point) is estimated on mismatched prompt / completion pairs: each
completion's prompt followed by the completion of its *partner*, a fixed derangement of the set drawn from
``train.seed`` (so the reference's log-probs of these pairs can be precomputed like the others). ``z`` is
``max(0, mean of log pi - log pi_ref)`` over the KL pairs of the whole optimizer step, computed by every
rank together in one no-grad pass before the step's first micro-batch: the step's loss is the same however
its completions are split into micro-batches and processes (TRL 1.16 averages over each micro-batch and
rank). The loss is a mean over the step's completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from padless.config.schema import KTOConfig, KTOSettings, TrainSettings
from padless.data.tokenized import ExampleSet, as_set, load_set
from padless.data.unpaired import UnpairedLayout, desirable_flags, prompt_length
from padless.errors import InputError
from padless.forward import ranks
from padless.forward.engine import BatchLayout, reference_engine
from padless.forward.packing import Example, PackedBatch, budget_batches, fixed_count_batches, pack
from padless.forward.passes import lockstep_pass
from padless.forward.ranks import Topology
from padless.losses import kto_loss
from padless.proof.load import pad_token_id
from padless.run.loop import MicroBatch, Recipe, Trainer
from padless.run.reporting import report_data
from padless.run.session import start_session
from padless.trainers.pairs import sequence_logps


def partners(n: int, seed: int) -> np.ndarray:
    """Whose completion each of ``n`` completions is mismatched with: one seeded cycle through all of them,
    so no completion is its own partner (when ``n > 1``) and each is borrowed exactly once."""
    order = np.random.default_rng(seed).permutation(n)
    out = np.empty(n, dtype=np.int64)
    out[order] = np.roll(order, -1)
    return out


@dataclass
class Completions:
    """One set of labelled completions (train or eval) with each one's label and KL partner."""

    items: ExampleSet[Example]
    desirable: np.ndarray
    partner: np.ndarray

    @classmethod
    def of(cls, items: ExampleSet[Example], seed: int) -> Completions:
        return cls(items, desirable_flags(items), partners(len(items), seed))

    def kl_pairs(self, indices: list[int]) -> list[Example]:
        """Each completion's prompt followed by its partner's completion (targets: that completion); the
        completion's stored reference log-prob of its pair comes along as ``ref_logps``."""
        own, lent = self.items.take(indices), self.items.take(self.partner[indices])
        pairs = []
        for e, other in zip(own, lent, strict=True):
            n, m = prompt_length(e), prompt_length(other)
            meta = {"ref_logps": e.meta["ref_kl_logps"]} if "ref_kl_logps" in e.meta else {}
            ids = e.input_ids[:n] + other.input_ids[m:]
            pairs.append(Example(ids, [False] * n + [True] * (len(other) - m), meta))
        return pairs


class KTORecipe(Recipe):
    """Micro-batches of completions (``units``: completions), numbered by optimizer step, so that each
    step's KL baseline is computed once over all of its completions."""

    def __init__(
        self,
        items: ExampleSet[Example] | list[Example],
        cfg: TrainSettings,
        kto: KTOSettings,
        pad_id: int,
        device: torch.device,
        ref_model: torch.nn.Module | None = None,
        eval_items: ExampleSet[Example] | list[Example] | None = None,
        topology: Topology | None = None,
    ):
        """``topology``: the run's (the session's); steps are numbered at planning, before any engine is
        bound, so the data-parallel world is handed down here (one process's by default)."""
        self.cfg, self.kto, self.device, self.ref_model = cfg, kto, device, ref_model
        self.topology = topology or ranks.start()
        self.layout = BatchLayout.of(cfg, pad_id)
        self.train = Completions.of(as_set(items), cfg.seed)
        self.eval = Completions.of(as_set(eval_items), cfg.seed) if eval_items else None
        self.steps: dict[int, list[int]] = {}  # the planned epoch's completions of each step
        self.plans = self.evals = 0  # how many plans / evaluations so far: the baseline's cache key
        self.baseline: tuple[Any, float] | None = None  # (key, z)

    def _groups(self, lengths: np.ndarray, seed: int, shuffle: bool) -> list[list[int]]:
        if self.cfg.batching == "padded":
            return fixed_count_batches(len(lengths), self.cfg.batch_size, seed=seed, shuffle=shuffle)
        return budget_batches(lengths, self.cfg.max_tokens_per_batch, seed=seed, shuffle=shuffle)

    def plan(self, epoch: int) -> list[MicroBatch]:
        lengths = self.train.items.lengths
        groups = self._groups(lengths, self.cfg.seed + epoch, shuffle=True)
        per_step = self.cfg.gradient_accumulation_steps * self.topology.world
        self.plans += 1
        self.steps = {}
        micros = []
        for k, g in enumerate(groups):
            self.steps.setdefault(k // per_step, []).extend(g)
            micros.append(MicroBatch(g, units=len(g), tokens=int(lengths[g].sum()), step=k // per_step))
        return micros

    def eval_plan(self) -> list[MicroBatch]:
        if self.eval is None:
            return []
        lengths = self.eval.items.lengths
        groups = self._groups(lengths, 0, shuffle=False)
        return [MicroBatch(g, units=len(g), tokens=int(lengths[g].sum())) for g in groups]

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        self.evals += 1  # the next evaluation estimates its baseline again (the weights moved)
        return {}

    def reference_logps(
        self, model: torch.nn.Module, examples: list[Example], batch: PackedBatch, key: str = "ref_logps"
    ) -> torch.Tensor:
        """``[N]`` summed reference log-probs of the completions: stored under ``key``, or one no-grad
        forward of the reference."""
        if key in examples[0].meta:
            return torch.tensor([e.meta[key] for e in examples], device=self.device, dtype=torch.float64)
        ref_model = None if self.kto.reference == "adapters" else self.ref_model
        with torch.no_grad(), reference_engine(model, ref_model) as reference:
            return sequence_logps(reference, batch, self.layout)[0]

    def kl_baseline(self, model: torch.nn.Module, side: Completions, indices: list[int], key: Any) -> float:
        """``z = max(0, mean log pi / pi_ref)`` over the KL pairs of ``indices``, every rank running its share
        of them in lockstep; cached under ``key`` (the step, or the evaluation)."""
        if self.kto.loss_type != "kto":
            return 0.0
        if self.baseline is not None and self.baseline[0] == key:
            return self.baseline[1]

        def run(group: list[int]) -> list[float]:
            pairs = side.kl_pairs([indices[i] for i in group])
            batch = pack(pairs, device=self.device)
            with torch.no_grad():
                logps = sequence_logps(model, batch, self.layout)[0]
            return (logps - self.reference_logps(model, pairs, batch)).tolist()

        lengths, budget = side.items.lengths[indices], self.cfg.max_tokens_per_batch
        ratios = lockstep_pass(range(len(indices)), lengths, run, budget, share=self.topology)
        z = max(torch.tensor(ratios, dtype=torch.float64).mean().item(), 0.0)
        self.baseline = (key, z)
        return z

    def bind(self, model: torch.nn.Module) -> None:
        """With ``precompute_ref_logps``, store the reference log-probs of every completion and of its KL
        pair once, through the prepared engines (each rank its share), and free the reference model."""
        if not self.kto.precompute_ref_logps:
            return
        for side in (self.train, self.eval):
            if side is None:
                continue

            def run(group: list[int], side: Completions = side) -> list[tuple[float, float]]:
                own, pairs = side.items.take(group), side.kl_pairs(group)
                batches = pack(own, device=self.device), pack(pairs, device=self.device)
                ref = (
                    self.reference_logps(model, own, batches[0]),
                    self.reference_logps(model, pairs, batches[1]),
                )
                return list(zip(ref[0].tolist(), ref[1].tolist(), strict=True))

            budget = self.cfg.max_tokens_per_batch
            ref = lockstep_pass(range(len(side.items)), side.items.lengths, run, budget, share=self.topology)
            side.items.set_meta("ref_logps", [own for own, _ in ref])
            side.items.set_meta("ref_kl_logps", [kl for _, kl in ref])
        self.ref_model = None

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if micro.step is None:  # an evaluation: its baseline over the whole eval set
            assert self.eval is not None
            side, indices, key = self.eval, list(range(len(self.eval.items))), ("eval", self.evals)
        else:
            side, indices, key = self.train, self.steps[micro.step], (self.plans, micro.step)
        z = self.kl_baseline(model, side, indices, key)
        examples = side.items.take(micro.data)
        batch = pack(examples, device=self.device)
        logps = sequence_logps(model, batch, self.layout)[0]
        desirable = torch.from_numpy(side.desirable[micro.data]).to(self.device)
        k = self.kto
        losses, rewards = kto_loss(
            logps,
            self.reference_logps(model, examples, batch),
            desirable,
            z,
            beta=k.beta,
            desirable_weight=k.desirable_weight,
            undesirable_weight=k.undesirable_weight,
            loss_type=k.loss_type,
        )
        loss = losses.sum() / normaliser
        metrics = {"loss": loss.item(), "kl": z * len(micro.data) / normaliser}
        # per-class means over the step: each class's sum over this micro-batch / its count in the step
        in_step = side.desirable[indices]
        for name, mask, count in (
            ("chosen", desirable, in_step.sum()),
            ("rejected", ~desirable, (~in_step).sum()),
        ):
            if count:
                metrics[f"rewards/{name}"] = rewards[mask].sum().item() / count
                metrics[f"logps/{name}"] = logps.detach()[mask].sum().item() / count
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        return loss, metrics


def load_completions(
    spec: str, tokenizer: Any, data: Any, train: TrainSettings, role: str
) -> ExampleSet[Example]:
    """Tokenized labelled completions of ``data.<role>`` (skips reported)."""
    layout = UnpairedLayout(
        max_length=data.max_length, truncation=data.truncation, skip_bad_rows=data.skip_bad_rows
    )
    items, stats = load_set(spec, layout, tokenizer, cache_dir=data.cache_dir, num_proc=data.num_proc)
    report_data(stats, role, spec, train.output_dir)
    return items


def run_kto(cfg: KTOConfig) -> dict[str, float]:
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    acc, tokenizer, data = session.accelerator, session.tokenizer, cfg.data
    if session.images is not None:
        raise InputError(
            f"model.name {cfg.model.name} is a vision-language model, and KTO runs on text models only for "
            "now (a KL pair borrows another row's completion, and its images would not follow); fix: use a "
            "text model, or DPO (padless dpo) for image preference pairs"
        )
    ref_model = None
    if cfg.kto.reference == "model":
        ref_model = session.frozen(session.companion(cfg.kto.ref_model))
    recipe = KTORecipe(
        load_completions(data.train, tokenizer, data, cfg.train, "train"),
        cfg.train,
        cfg.kto,
        pad_token_id(tokenizer),
        acc.device,
        ref_model,
        load_completions(data.eval, tokenizer, data, cfg.train, "eval") if data.eval else None,
        topology=session.settings.topology,
    )
    return Trainer(recipe, session.engine(), tokenizer, cfg.train, acc).train()
