"""Distillation from a frozen teacher: the student learns the teacher's next-token distributions.

Modes (``distill.mode``):

* ``offline``: on the data's completions, the forward KL to the teacher's whole distribution (or its
  ``top_k``), optionally mixed with the NLL of the data's tokens;
* ``gkd``: the generalised JSD (``beta``) on the data's completions, or, for a ``lmbda`` share of the
  optimizer steps (drawn per step from ``train.seed``), on the student's own samples from the same prompts;
* ``on_policy``: the student samples rollouts, the teacher scores the sampled tokens, and each token's
  reverse KL is the signal (:class:`OnPolicyRecipe`).

The teacher is loaded and proven like every model, frozen and prepared like a reference (sharded under
FSDP2 / ZeRO-3). Every pass is packed: the teacher's hidden states of a micro-batch come from one forward of
its packed row, and the student's head compares its logits with the teacher's chunk by chunk
(:mod:`padless.forward.distill`). Losses are token means over the optimizer step (all its micro-batches and
ranks): a gkd step on samples counts the sampled tokens of the whole step, which every rank knows once the
step's samples are gathered.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from typing import Any

import torch

from padless.config.schema import DistillConfig, DistillSettings, RolloutSettings, TrainSettings
from padless.data.sources import stop_token_ids
from padless.data.tokenized import ExampleSet, as_set
from padless.errors import InputError
from padless.forward import ranks
from padless.forward.distill import Distillation
from padless.forward.packing import Example, budget_batches, pack
from padless.forward.ranks import Topology, equal_share, gather_shares
from padless.losses import generalized_jsd, top_k_kl
from padless.proof.load import load_tokenizer, tokenizer_differences
from padless.rl.generate import generate
from padless.rl.sample import Sample, per_target
from padless.rl.setup import RolloutSetup, start_rl
from padless.run.loop import MicroBatch, Recipe, Trainer
from padless.run.session import Session, start_session
from padless.trainers.rl import Pass, RolloutRecipe
from padless.trainers.sft import group_examples, load_examples

log = logging.getLogger(__name__)


def divergence_of(distill: DistillSettings) -> Any:
    """The per-token divergence of (student, teacher) logits the mode trains."""
    if distill.mode == "gkd":
        return partial(generalized_jsd, beta=distill.beta)
    if distill.top_k is not None:
        return partial(top_k_kl, k=distill.top_k)
    return partial(generalized_jsd, beta=0.0)  # forward KL(teacher || student)


class DistillRecipe(Recipe):
    """Modes offline and gkd: micro-batches of data examples (``units``: target tokens), numbered by
    optimizer step, so a gkd step on samples is sampled once, by every rank together, at its first
    micro-batch."""

    def __init__(
        self,
        examples: ExampleSet[Example] | list[Example],
        cfg: TrainSettings,
        distill: DistillSettings,
        rollout: RolloutSettings,
        tokenizer: Any,
        device: torch.device,
        teacher: torch.nn.Module,
        eval_examples: ExampleSet[Example] | list[Example] | None = None,
        vocab: int | None = None,
        topology: Topology | None = None,
    ):
        """``teacher``: the prepared frozen teacher engine; ``vocab``: compare the first ``vocab`` logits
        (when one head is padded past the tokenizer's vocabulary); ``topology``: the run's (the
        session's): steps are numbered at planning, before any engine is bound (one process's by
        default)."""
        self.examples, self.cfg, self.distill, self.rollout = as_set(examples), cfg, distill, rollout
        self.tokenizer, self.device, self.teacher, self.vocab = tokenizer, device, teacher, vocab
        self.eval_examples = as_set(eval_examples or [])
        self.topology = topology or ranks.start()
        self.divergence = divergence_of(distill)
        self.bins = None
        if cfg.batching == "packing":
            self.bins = budget_batches(
                self.examples.lengths, cfg.max_tokens_per_batch, seed=cfg.seed, shuffle=False
            )
        self.epoch = 0
        self.steps: dict[int, list[int]] = {}  # the planned epoch's examples of each step
        self.samples: tuple[tuple[int, int], dict[int, Example]] | None = None  # (epoch, step) -> samples

    def plan(self, epoch: int) -> list[MicroBatch]:
        groups = group_examples(self.examples, self.cfg, epoch, self.bins)
        per_step = self.cfg.gradient_accumulation_steps * self.topology.world
        targets, lengths = self.examples.targets, self.examples.lengths
        self.epoch, self.steps = epoch, {}
        micros = []
        for k, g in enumerate(groups):
            self.steps.setdefault(k // per_step, []).extend(g)
            units, tokens = int(targets[g].sum()), int(lengths[g].sum())
            micros.append(MicroBatch(g, units=units, tokens=tokens, step=k // per_step))
        return micros

    def eval_plan(self) -> list[MicroBatch]:
        if not self.eval_examples:
            return []
        ex = self.eval_examples
        groups = budget_batches(ex.lengths, self.cfg.max_tokens_per_batch, shuffle=False)
        return [
            MicroBatch(g, units=int(ex.targets[g].sum()), tokens=int(ex.lengths[g].sum())) for g in groups
        ]

    def on_policy_step(self, epoch: int, step: int) -> bool:
        """Whether a gkd step trains on the student's samples: a draw of its own (epoch, step) seed."""
        if self.distill.mode != "gkd" or self.distill.lmbda == 0:
            return False
        return random.Random(f"{self.cfg.seed}-{epoch}-{step}").random() < self.distill.lmbda

    def sampled(self, model: torch.nn.Module, step: int) -> dict[int, Example]:
        """The student's samples from the prompts of the step's examples (each seeded by its example, so a
        sample never depends on its micro-batch or rank), every rank sampling an equal share, gathered."""
        key = (self.epoch, step)
        if self.samples is not None and self.samples[0] == key:
            return self.samples[1]
        indices = self.steps[step]
        mine, real = equal_share(indices, self.topology)
        prompts = [prompt_of(e) for e in self.examples.take(mine)]
        r = self.rollout
        completions = generate(
            model,
            self.tokenizer,
            prompts,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            batch_size=r.generation_batch_size,
            seeds=[self.cfg.seed * 1_000_003 + self.epoch * 7_919 + i for i in mine],
        )
        drawn = gather_shares([(c.prompt_ids, c.completion_ids) for c in completions[:real]], self.topology)
        samples = {
            i: Example(p + c, [False] * len(p) + [True] * len(c))
            for i, (p, c) in zip(indices, drawn, strict=True)
        }
        self.samples = (key, samples)
        return samples

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        on_policy = micro.step is not None and self.on_policy_step(self.epoch, micro.step)
        if on_policy:
            samples = self.sampled(model, micro.step)
            examples = [samples[i] for i in micro.data]
            normaliser = max(sum(samples[i].num_targets for i in self.steps[micro.step]), 1)
        else:
            examples = (self.examples if micro.step is not None else self.eval_examples).take(micro.data)
        batch = pack(examples, device=self.device)
        with torch.no_grad():
            teacher_hidden = self.teacher(batch, hidden=True).hidden
        targets = batch.loss_mask[0].float() / normaliser
        nll = self.distill.nll_weight if self.distill.mode == "offline" else 0.0
        d = Distillation(
            teacher_hidden,
            self.teacher,
            self.divergence,
            targets * (1 - nll),
            targets * nll if nll else None,
            self.distill.temperature,
            self.vocab,
        )
        out = model(batch, distill=d)
        metrics = {
            "loss": out.weighted.item(),
            "divergence": (out.divergence * targets).sum().item(),
            "nll": -(out.logps * targets).sum().item(),
        }
        if micro.step is not None:
            metrics["on_policy"] = float(on_policy) * len(micro.data) / len(self.steps[micro.step])
        return out.weighted, metrics


class OnPolicyRecipe(RolloutRecipe):
    """Mode on_policy: GRPO's rollouts (one optimizer step each), with the teacher as the rollout's reference:
    its log-probs of the sampled tokens come from the reference pass (``sample.passes.ref_logps``), at the
    temperature the student samples at. Rewards are measured on the samples, never trained on."""

    def __init__(self, setup: RolloutSetup, vocab: int | None = None):
        super().__init__(setup)
        self.distill, self.teacher, self.vocab = self.cfg.distill, setup.ref_model, vocab

    def passes(self) -> dict[str, Pass]:
        return {"ref_logps": self.reference_pass()}

    def process(self, samples: list[Sample], epoch: int) -> dict[str, float]:
        """Nothing: the advantages are the current log-probs' reverse KL, taken in :meth:`loss`."""
        return {}

    def plan_settings(self) -> dict[str, Any]:
        return {
            **super().plan_settings(),
            **{f"distill.{k}": v for k, v in self.distill.model_dump().items()},
        }

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        samples: list[Sample] = micro.data
        batch = pack(samples, device=self.device)
        mask = batch.loss_mask[0]
        temperature = self.cfg.rollout.temperature
        teacher = per_target([s.passes.ref_logps for s in samples], self.device)
        weight = self.is_weights(samples)  # the sampler correction (None: off)
        if self.distill.loss == "reverse_kl":
            with torch.no_grad():
                hidden = self.teacher(batch, hidden=True).hidden
            weights = mask.float() / normaliser
            if weight is not None:
                weights[mask] = weights[mask] * weight
            reverse = partial(generalized_jsd, beta=1.0)
            out = model(
                batch,
                distill=Distillation(hidden, self.teacher, reverse, weights, None, temperature, self.vocab),
            )
            loss, kl = out.weighted, out.divergence[mask]
            student = per_target([s.drawn.logps for s in samples], self.device)  # at sampling
        else:
            student = model(batch, logps=True, temperature=temperature).logps[mask]
            kl = student.detach() - teacher  # each sampled token's reverse KL, its negated advantage
            per_token = kl * torch.exp(student - student.detach())  # REINFORCE: gradient kl * grad log pi
            if weight is not None:
                per_token = per_token * weight
            loss = per_token.sum() / normaliser
        return loss, {
            "loss": loss.item(),
            "distill/reverse_kl": kl.sum().item() / normaliser,
            "distill/teacher_logps": teacher.sum().item() / normaliser,
            "distill/student_logps": student.detach().sum().item() / normaliser,
        }


def run_on_policy(cfg: DistillConfig) -> dict[str, float]:
    """Mode on_policy: the RL setup (prompts, sampler, measured rewards) with the teacher as its reference."""
    session, setup = start_rl(cfg, reference=False)
    setup.ref_model, vocab = load_teacher(session, cfg.distill, cfg.model.name)
    recipe = OnPolicyRecipe(setup, vocab)
    saved = setup.images.processor if setup.images else session.tokenizer
    return Trainer(recipe, session.engine(), saved, cfg.train, session.accelerator).train()


def prompt_of(example: Example) -> list[int]:
    """The tokens before an example's first target: what gkd's on-policy steps sample a completion for."""
    assert example.loss_mask is not None and any(example.loss_mask), "an example without targets"
    return example.input_ids[: example.loss_mask.index(True)]


def load_teacher(
    session: Session, distill: DistillSettings, student_name: str
) -> tuple[torch.nn.Module, int | None]:
    """The teacher as a prepared frozen engine, after its tokenizer is found to be the student's; and the
    vocabulary both heads are compared over (None: the whole of both, which are the same size)."""
    tokenizer = load_tokenizer(distill.teacher, session.model_cfg.trust_remote_code)
    differences = tokenizer_differences(session.tokenizer, tokenizer)
    if differences:
        raise InputError(
            f"distill.teacher {distill.teacher}: its tokenizer differs from the student's (model.name "
            f"{student_name}) in {'; '.join(differences)}, so its token ids mean other text; fix: distill "
            "from a teacher of the same tokenizer family (same vocabulary, special tokens and chat template)"
        )
    teacher = session.companion(distill.teacher)
    sizes = (
        session.model.get_output_embeddings().weight.shape[0],
        teacher.get_output_embeddings().weight.shape[0],
    )
    vocab = None
    if sizes[0] != sizes[1]:
        vocab = len(session.tokenizer)
        if min(sizes) < vocab:
            raise InputError(
                f"distill.teacher {distill.teacher}: the LM heads have {sizes[1]} (teacher) and {sizes[0]} "
                f"(student) rows, fewer than the tokenizer's {vocab} tokens; fix: use models whose heads "
                "cover the tokenizer"
            )
        log.info(
            "distill: the heads have %d (student) and %d (teacher) rows; compared over the tokenizer's %d "
            "tokens (the rows past them are padding no token id reaches)",
            *sizes,
            vocab,
        )
    return session.frozen(teacher), vocab


def run_distill(cfg: DistillConfig) -> dict[str, float]:
    if cfg.distill.mode == "on_policy":
        return run_on_policy(cfg)
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg)
    acc, tokenizer, data = session.accelerator, session.tokenizer, cfg.data
    if session.images is not None:
        raise InputError(
            f"model.name {cfg.model.name} is a vision-language model, and distillation runs on text models "
            "only for now; fix: distill a text model"
        )
    teacher, vocab = load_teacher(session, cfg.distill, cfg.model.name)

    stop_ids = stop_token_ids(cfg.model.name)  # what ends a chat turn: the student's stop tokens

    def tokenize(spec: str, role: str) -> ExampleSet[Example]:
        return load_examples(spec, role, data, tokenizer, cfg.train.output_dir, stop_ids)

    recipe = DistillRecipe(
        tokenize(data.train, "train"),
        cfg.train,
        cfg.distill,
        cfg.rollout,
        tokenizer,
        acc.device,
        teacher,
        tokenize(data.eval, "eval") if data.eval else None,
        vocab,
        topology=session.settings.topology,
    )
    return Trainer(recipe, session.engine(), tokenizer, cfg.train, acc).train()
