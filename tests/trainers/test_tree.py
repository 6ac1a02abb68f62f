"""Tree packing in the trainers: DPO and reward-model pairs, GRPO and PPO groups and groups of episodes
(every no-grad pass, the plan and the update) give the flat packed layout's numbers while computing each
shared prompt once."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from padless.config.loading import load_config
from padless.config.schema import DPOSettings, GRPOConfig, PPOConfig, TrainSettings
from padless.data import load_rows, tokenize_preference
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.packing import pack
from padless.forward.tree import share_prefixes
from padless.proof.check import gradient_delta
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.proof.zoo import LOGIT_TARGET, scale_head
from padless.rl.generate import HFEngine
from padless.rl.sample import Sample
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch
from padless.trainers.dpo import DPORecipe
from padless.trainers.grpo import GRPORecipe
from padless.trainers.ppo import PPORecipe
from padless.trainers.rm import RMRecipe

CPU = torch.device("cpu")
TREE, FLAT = EngineSettings(tree_packing="on"), EngineSettings(tree_packing="off")


def _realistic(model: torch.nn.Module, seqs: list[list[int]]) -> torch.nn.Module:
    """``model`` in eval mode (no dropout) with its largest |logit| on ``seqs`` scaled to 30."""
    model.eval()
    with torch.no_grad():
        largest = max(model(input_ids=torch.tensor([s])).logits.abs().max().item() for s in seqs)
    scale_head(model, LOGIT_TARGET / largest)
    return model


@pytest.fixture(scope="module")
def pairs(tokenizer):
    rows = load_rows("tiny:preference")
    pairs, _ = tokenize_preference([rows[i] for i in (7, 12, 13)], tokenizer, max_length=2048)
    return pairs


def _grads(recipe, engine, plan, normaliser) -> tuple[float, list[torch.Tensor]]:
    engine.zero_grad(set_to_none=True)
    total = 0.0
    for micro in plan:
        loss, _ = recipe.loss(engine, micro, normaliser)
        loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in engine.parameters() if p.grad is not None]


def test_dpo_and_reward_model_pairs_on_tree_rows_equal_flat(pairs, tokenizer, caplog):
    """The plan is blind to the layout: the same pairs make the same micro-batches in every epoch, before
    and after the recipe learns that its engine runs tree rows (a sequence-parallel group runs flat rows;
    a plan by tree tokens made it train other steps). A tree row computes each prompt once; the DPO
    step's loss and gradient, reference log-probs included, and the reward model's, equal the flat
    layout's."""
    seqs = [s.input_ids for p in pairs for s in (p.chosen, p.rejected)]
    policy = _realistic(load_model("tiny-llama", training=True, probe=False), seqs)
    ref = ModelEngine(load_model("tiny-llama", seed=1, probe=False))
    cfg = TrainSettings(max_tokens_per_batch=190)  # flat: 2 of the 3 pairs fit a micro-batch

    def pairs_of(plan: list[MicroBatch]) -> list[list[list[int]]]:
        return [[p.chosen.input_ids for p in micro.data] for micro in plan]

    results, plans = {}, {}
    for name, settings in (("flat", FLAT), ("tree", TREE)):
        engine = ModelEngine(policy, settings=settings)
        recipe = DPORecipe(pairs, cfg, DPOSettings(beta=0.5), tokenizer.pad_token_id, CPU, ref)
        before = recipe.plan(1)
        with caplog.at_level(logging.INFO):
            recipe.bind(engine)
        plan = recipe.plan(0)
        plans[name] = [pairs_of(p) for p in (plan, before, recipe.plan(1))]
        results[name] = _grads(recipe, engine, plan, len(pairs))
    assert recipe.tree and len(plan) == 2
    assert plans["tree"] == plans["flat"] and plans["tree"][1] == plans["tree"][2]
    rows = [share_prefixes(recipe.collate(micro.data)) for micro in plan]
    assert all(r is not None and r.num_tokens < r.flat_tokens for r in rows)  # each prompt once
    assert results["tree"][0] == pytest.approx(results["flat"][0], rel=1e-5)
    delta, limit = gradient_delta(results["flat"][1], results["tree"][1], torch.float32)
    assert delta <= limit, (delta, limit)

    scorer = load_model("tiny-llama", task="score", training=True, probe=False)
    rm = RMRecipe(pairs, TrainSettings(), tokenizer.pad_token_id, CPU)
    micro = MicroBatch(pairs, len(pairs), 0)
    got = {
        name: _grads(rm, ModelEngine(scorer, settings=s), [micro], len(pairs))
        for name, s in (("flat", FLAT), ("tree", TREE))
    }
    assert got["tree"][0] == pytest.approx(got["flat"][0], rel=1e-5)
    delta, limit = gradient_delta(got["flat"][1], got["tree"][1], torch.float32)
    assert delta <= limit, (delta, limit)


def _group(prompt: list[int], completions: list[list[int]], advantages: list[float]) -> list[Sample]:
    """A group's samples; a completion given as several lists is an episode: model turns (trained) and
    environment messages between them (not trained)."""
    samples = []
    for c, a in zip(completions, advantages, strict=True):
        turns = c if isinstance(c[0], list) else [c]
        trained = [i % 2 == 0 for i, turn in enumerate(turns) for _ in turn]
        sample = Sample(prompt + [t for turn in turns for t in turn], [False] * len(prompt) + trained)
        sample.algorithm.advantages = [a] * sample.num_targets
        sample.algorithm.returns = [a / 2] * sample.num_targets  # PPO's value targets
        samples.append(sample)
    return samples


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_rl_passes_plan_and_update_on_tree_rows_equal_flat(tokenizer, trainer):
    """A GRPO group of four completions and a group of four multi-turn episodes: every stored no-grad pass
    (reference and old log-probs; PPO's old values) equals the flat layout's per token, the plan keeps
    both groups in one micro-batch, and the update's loss and gradient (two updates per rollout, so the old
    log-probs are a stored pass; PPO's policy and value losses through the one engine) equal the flat
    plan's."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 4096, (n,), generator=gen).tolist()

    prompts = [ids(60), ids(45)]
    episodes = [[ids(4), ids(6), ids(5)], [ids(2)], [ids(7), ids(3), ids(1)], [ids(3), ids(8), ids(2)]]
    completions = [[ids(n) for n in (3, 11, 7, 1)], episodes]
    advantages = [[1.0, -0.5, 0.25, -0.75], [-1.0, 0.5, 0.75, -0.25]]
    samples = [s for p, c, a in zip(prompts, completions, advantages, strict=True) for s in _group(p, c, a)]
    policy = _realistic(load_model("tiny-llama", training=True, probe=False), [s.input_ids for s in samples])
    ref = ModelEngine(copy.deepcopy(policy))  # the starting policy: a KL of round-off size, not of exp(30)
    value = load_model("tiny-llama", task="score", training=True, probe=False) if trainer == "ppo" else None
    overrides = ["train.max_tokens_per_batch=200", f"{trainer}.updates_per_rollout=2"]
    if trainer == "grpo":
        overrides.append("grpo.beta=0.04")
    cfg = load_config(PPOConfig if value else GRPOConfig, None, overrides)
    keys = ("ref_logps", "old_logps", "old_values")[: 2 + bool(value)]
    stored, results = {}, {}
    for name, settings in (("flat", FLAT), ("tree", TREE)):
        engine = ModelEngine(policy, value=value, settings=settings)
        sampler = HFEngine(engine, tokenizer, cfg.rollout)
        setup = RolloutSetup([], cfg, tokenizer, engine, sampler, CPU, ref_model=ref)
        recipe = PPORecipe(setup) if value else GRPORecipe(setup)
        recipe.bind(engine)
        assert recipe.tree == (name == "tree")
        samples = [copy.deepcopy(s) for s in samples]
        micros = recipe.micro_batches(samples, 0)
        recipe.store(samples, micros, recipe.passes())
        stored[name] = {
            key: torch.tensor([v for s in samples for v in getattr(s.passes, key)]) for key in keys
        }
        plan = [m for m in micros if m.step == 0]
        results[name] = (plan, *_grads(recipe, engine, plan, sum(m.units for m in plan)))
    for key, flat in stored["flat"].items():
        limit = bound(torch.float32, flat.abs().max().item())
        assert (stored["tree"][key] - flat).abs().max().item() <= limit, key
    (micro,) = results["tree"][0]  # both groups in one tree row: each prompt but its last token once
    shared = sum(len(p) - 1 for p in prompts) * (len(samples) // len(prompts) - 1)
    assert share_prefixes(pack(micro.data)).num_tokens == sum(map(len, samples)) - shared
    assert len(results["flat"][0]) >= 3  # flat, their 400-odd tokens need three rows of 200
    assert results["tree"][1] == pytest.approx(results["flat"][1], rel=1e-5, abs=1e-7)
    delta, limit = gradient_delta(results["flat"][2], results["tree"][2], torch.float32)
    assert delta <= limit, (delta, limit)
