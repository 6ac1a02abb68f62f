"""A mixture of experts trains its own objective: one padless SFT or DPO step equals one TRL 1.16 step on
the same ids with the router load-balancing term on (loss, its aux_loss metric and every gradient), and a
run logs ``train/aux_loss``, or says in its log that ``model.router_aux_loss_coef: 0`` turned it off.

Model: a tiny Qwen3-MoE (4 experts top-2, ``output_router_logits`` on, coefficient 0.02), head scaled to
|logit| 30. TRL gets the sequences right-padded with their mask on eager attention, padless packed on
varlen: the same numbers up to fp32 summation order, so gradients agree to 1e-5 of their largest entry.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from accelerate import Accelerator

from padless.config.schema import DataSettings, DPOSettings, ModelSettings, SFTConfig, TrainSettings
from padless.data.preference import PairExample
from padless.forward.engine import ModelEngine, use_backend
from padless.forward.packing import Example
from padless.proof.check import zoo_model
from padless.run.loop import Recipe, Trainer
from padless.trainers.dpo import DPORecipe
from padless.trainers.sft import SFTRecipe, run_sft

COEF = 0.02
PAIRS = {
    "prompt": ["the river runs", "a small", "every morning the baker"],
    "chosen": [" to the sea", " bird sings at dawn", " opens the shop"],
    "rejected": [" up the hill backwards", " rock", " sleeps"],
}


@pytest.fixture(scope="module")
def moe(probe_seqs) -> torch.nn.Module:
    model = zoo_model("qwen3-moe", probe_seqs)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = COEF
    return model


def trl_args(config_cls, tmp_path, batch: int):
    """One step of ``batch`` rows in fp32, unclipped, nothing saved or reported."""
    return config_cls(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=batch,
        max_steps=1,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # TRL's default on a CPU that supports it: autocast, not fp32
        gradient_checkpointing=False,
    )


def trl_step(trainer) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A TRL trainer's first step: its logged metrics and the gradients it stepped with."""
    from transformers import TrainerCallback

    grads: dict[str, torch.Tensor] = {}
    model = trainer.model

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.add_callback(Grads())
    trainer.train()
    return next(h for h in trainer.state.log_history if "loss" in h), grads


def padless_step(
    recipe: Recipe, model, tokenizer, settings
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """padless's first step of ``recipe`` (all of its data in one micro-batch): metrics and gradients."""
    use_backend(model, "varlen")
    trainer = Trainer(recipe, ModelEngine(model), tokenizer, settings, Accelerator(cpu=True))
    (step,) = trainer.steps_of(0)
    assert len(step.micros) == 1
    grads: dict[str, torch.Tensor] = {}
    trainer.optimizer.optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
    )
    return trainer._train_step(step), grads


def assert_same_step(ours, our_grads, theirs, trl_grads) -> None:
    """The same aux_loss, total loss (padless logs the term apart from its loss) and gradients."""
    assert ours["aux_loss"] == pytest.approx(theirs["aux_loss"], rel=1e-5)
    assert ours["loss"] + COEF * ours["aux_loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert set(our_grads) == set(trl_grads)
    assert trl_grads["model.layers.0.mlp.gate.weight"].abs().max() > 1e-3  # routers learn from the term
    for name, grad in our_grads.items():
        scale = trl_grads[name].abs().max().item()
        assert (grad - trl_grads[name]).abs().max().item() <= 1e-5 * max(scale, 1e-3), name


def test_an_sft_step_equals_trls_with_the_router_loss(moe, probe_seqs, tokenizer, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig as TRLSFTConfig
    from trl import SFTTrainer

    data = Dataset.from_dict({"input_ids": probe_seqs})
    args = trl_args(TRLSFTConfig, tmp_path, len(probe_seqs))
    theirs = trl_step(
        SFTTrainer(copy.deepcopy(moe), args=args, train_dataset=data, processing_class=tokenizer)
    )
    settings = TrainSettings(output_dir=str(tmp_path / "padless"), max_steps=1, max_grad_norm=0)
    examples = [Example(s, [True] * len(s)) for s in probe_seqs]
    recipe = SFTRecipe(examples, settings, tokenizer, torch.device("cpu"))
    assert_same_step(*padless_step(recipe, copy.deepcopy(moe), tokenizer, settings), *theirs)


def test_a_dpo_step_equals_trls_with_the_router_loss(moe, tokenizer, tmp_path):
    """Three text pairs as TRL tokenizes them, a frozen copy as the reference of both (its forward is no
    training forward: no router term)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = trl_args(DPOConfig, tmp_path, len(PAIRS["prompt"]))
    trainer = DPOTrainer(
        copy.deepcopy(moe),
        ref_model=copy.deepcopy(moe),
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )
    theirs = trl_step(trainer)
    pairs = []
    for row in trainer.train_dataset:
        prompt = row["prompt_ids"]
        sides = (prompt + row[k] for k in ("chosen_ids", "rejected_ids"))
        pairs.append(
            PairExample(*(Example(s, [False] * len(prompt) + [True] * (len(s) - len(prompt))) for s in sides))
        )
    settings = TrainSettings(output_dir=str(tmp_path / "padless"), max_steps=1, max_grad_norm=0)
    ref = ModelEngine(copy.deepcopy(moe).requires_grad_(False))
    recipe = DPORecipe(pairs, settings, DPOSettings(), tokenizer.pad_token_id, torch.device("cpu"), ref)
    assert_same_step(*padless_step(recipe, copy.deepcopy(moe), tokenizer, settings), *theirs)


@pytest.fixture(scope="module")
def moe_folder(moe, tokenizer, tmp_path_factory):
    """The model as a folder, loaded by both runs (the second reuses the first's load-time proof)."""
    path = tmp_path_factory.mktemp("moe")
    moe.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("coef", [None, 0.0])
def test_a_run_logs_the_router_loss_or_says_it_is_off(moe_folder, tmp_path, coef):
    run = tmp_path / "run"
    settings = dict(output_dir=str(run), max_steps=1, max_tokens_per_batch=1024, progress_bar=False)
    model = ModelSettings(name=str(moe_folder), router_aux_loss_coef=coef)
    run_sft(SFTConfig(model=model, data=DataSettings(max_length=1024), train=TrainSettings(**settings)))
    records = [
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r
    ]
    log = (run / "log.txt").read_text()
    if coef is None:
        assert records and all(r["train/aux_loss"] > 1.0 for r in records)
        assert "training the router load-balancing loss, coefficient 0.02 (from the model's config" in log
    else:
        assert records and not any("train/aux_loss" in r for r in records)
        assert "the router load-balancing loss is off (model.router_aux_loss_coef: 0)" in log


class DriftedRouters:
    """The HF engine sampling with a copy of the policy whose routers (only) drifted: it routes some tokens
    to other experts than the trainer's forward does, as another engine's kernels do near a tie."""

    def __init__(self, policy, tokenizer, rollout, scale: float):
        from padless.rl.generate import HFEngine

        self.policy, self.copy = policy, copy.deepcopy(policy)
        gen = torch.Generator().manual_seed(0)
        self.noise = {
            n: scale * torch.randn(p.shape, generator=gen)
            for n, p in policy.named_parameters()
            if n.endswith("mlp.gate.weight")
        }
        self.engine = HFEngine(self.copy, tokenizer, rollout)

    @torch.no_grad()
    def sync_weights(self) -> None:
        for (n, p), q in zip(self.policy.named_parameters(), self.copy.parameters(), strict=True):
            q.copy_(p + self.noise[n] if n in self.noise else p)

    def complete(self, *args, **kwargs):
        return self.engine.complete(*args, **kwargs)


def test_routing_replay_lowers_the_mismatch_of_a_sampler_that_routes_otherwise(
    moe_folder, tmp_path, monkeypatch
):
    """One GRPO rollout of a MoE policy sampled with drifted routers, routing replay on: the trainer's
    old log-probs replay the sampler's experts (``mismatch/*``) and are compared beside the same pass
    routed by the trainer's own routers (``mismatch/unreplayed_*``): the replayed mismatch is the smaller.
    (The replayed forward takes exactly the sampler's routes: tests/forward/test_routing.py.)"""
    from padless.config.loading import load_config
    from padless.config.schema import GRPOConfig
    from padless.rl.sampling import ENGINES
    from padless.trainers.grpo import run_grpo

    drifted = lambda cfg, policy, tok: DriftedRouters(policy, tok, cfg.rollout, 0.05)  # noqa: E731
    monkeypatch.setitem(ENGINES, "hf", drifted)
    variety = tmp_path / "variety.py"
    variety.write_text(
        "def variety(prompts, completions, **fields):\n    return [len(set(c)) for c in completions]\n"
    )
    run = tmp_path / "run"
    overrides = [
        f"model.name={moe_folder}",
        "model.router_aux_loss_coef=0",
        f"train.output_dir={run}",
        "train.max_steps=1",
        "train.logging_steps=1",
        "train.progress_bar=false",
        "train.report_to=[jsonl]",
        "rollout.prompts_per_step=4",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=8",
        "rollout.mask_truncated=false",
        "rollout.routing_replay=true",
        f"reward.functions=[{variety}:variety]",
    ]
    run_grpo(load_config(GRPOConfig, None, overrides))
    record = next(
        r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "mismatch/kl" in r
    )
    assert record["mismatch/unreplayed_kl"] > 1e-4  # the drift moves routes, and log-probs with them
    assert record["mismatch/kl"] < record["mismatch/unreplayed_kl"] / 2
    assert record["mismatch/logp_diff_max"] < record["mismatch/unreplayed_logp_diff_max"]
