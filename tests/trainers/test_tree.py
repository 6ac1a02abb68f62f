"""Tree packing in the trainers: DPO and reward-model pairs and GRPO groups (every no-grad pass, the plan and
the update) give the flat packed layout's numbers while computing each shared prompt once."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from padless.config.loading import load_config
from padless.config.schema import DPOSettings, GRPOConfig, TrainSettings
from padless.data import load_rows, tokenize_preference
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.packing import pack
from padless.forward.tree import share_prefixes
from padless.proof.check import gradient_delta
from padless.proof.load import load_model
from padless.proof.tolerance import bound
from padless.proof.zoo import LOGIT_TARGET, scale_head
from padless.rl.generate import HFEngine
from padless.rl.sample import Sample
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch
from padless.trainers.dpo import DPORecipe
from padless.trainers.grpo import GRPORecipe
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
    """A pair's prompt counts once in the plan (more pairs per micro-batch); the DPO step's loss and
    gradient, reference log-probs included, and the reward model's, equal the flat layout's."""
    seqs = [s.input_ids for p in pairs for s in (p.chosen, p.rejected)]
    policy = _realistic(load_model("tiny-llama", training=True, probe=False), seqs)
    ref = ModelEngine(load_model("tiny-llama", seed=1, probe=False))
    cfg = TrainSettings(max_tokens_per_batch=150)
    results = {}
    for name, settings in (("flat", FLAT), ("tree", TREE)):
        engine = ModelEngine(policy, settings=settings)
        recipe = DPORecipe(pairs, cfg, DPOSettings(beta=0.5), tokenizer.pad_token_id, CPU, ref)
        with caplog.at_level(logging.INFO):
            recipe.bind(engine)
        plan = recipe.plan(0)
        results[name] = (len(plan), *_grads(recipe, engine, plan, len(pairs)))
    assert recipe.tree and results["tree"][0] < results["flat"][0]  # a prompt once: fewer micro-batches
    assert results["tree"][1] == pytest.approx(results["flat"][1], rel=1e-5)
    delta, limit = gradient_delta(results["flat"][2], results["tree"][2], torch.float32)
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
    samples = []
    for c, a in zip(completions, advantages, strict=True):
        sample = Sample(prompt + c, [False] * len(prompt) + [True] * len(c))
        sample.algorithm.advantages = [a] * len(c)
        samples.append(sample)
    return samples


def test_grpo_passes_plan_and_update_on_tree_rows_equal_flat(tokenizer):
    """Two groups of four completions: the stored reference and old log-probs equal the flat layout's per
    token, the plan keeps each group in one micro-batch, and the update's loss and gradient (two
    updates per rollout, so the old log-probs are a stored pass) equal the flat plan's."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 4096, (n,), generator=gen).tolist()

    prompts = [ids(60), ids(45)]
    completions = [[ids(n) for n in (3, 11, 7, 1)], [ids(n) for n in (9, 2, 14, 5)]]
    advantages = [[1.0, -0.5, 0.25, -0.75], [-1.0, 0.5, 0.75, -0.25]]
    seqs = [p + c for p, cs in zip(prompts, completions, strict=True) for c in cs]
    policy = _realistic(load_model("tiny-llama", training=True, probe=False), seqs)
    ref = ModelEngine(copy.deepcopy(policy))  # the starting policy: a KL of round-off size, not of exp(30)
    overrides = ["train.max_tokens_per_batch=200", "grpo.updates_per_rollout=2", "grpo.beta=0.04"]
    cfg = load_config(GRPOConfig, None, overrides)
    stored, results = {}, {}
    for name, settings in (("flat", FLAT), ("tree", TREE)):
        engine = ModelEngine(policy, settings=settings)
        sampler = HFEngine(engine, tokenizer, cfg.rollout)
        recipe = GRPORecipe(RolloutSetup([], cfg, tokenizer, engine, sampler, CPU, ref_model=ref))
        recipe.bind(engine)
        samples = [
            s for p, c, a in zip(prompts, completions, advantages, strict=True) for s in _group(p, c, a)
        ]
        recipe.store(samples, recipe.passes(), filler=samples[0])
        stored[name] = {
            key: torch.tensor([v for s in samples for v in getattr(s.passes, key)])
            for key in ("ref_logps", "old_logps")
        }
        plan = [m for m in recipe.micro_batches(samples, 0) if m.step == 0]
        results[name] = (plan, *_grads(recipe, engine, plan, sum(m.units for m in plan)))
    for key, flat in stored["flat"].items():
        limit = bound(torch.float32, flat.abs().max().item())
        assert (stored["tree"][key] - flat).abs().max().item() <= limit, key
    (micro,) = results["tree"][0]  # both groups in one row of 163 tokens; flat, 472 tokens need three
    assert share_prefixes(pack(micro.data)).num_tokens == 163 and len(results["flat"][0]) >= 3
    assert results["tree"][1] == pytest.approx(results["flat"][1], rel=1e-5, abs=1e-7)
    delta, limit = gradient_delta(results["flat"][2], results["tree"][2], torch.float32)
    assert delta <= limit, (delta, limit)
