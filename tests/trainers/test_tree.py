"""Tree packing in the trainers: DPO and reward-model pairs give the flat packed layout's numbers while
computing each shared prompt once."""

from __future__ import annotations

import logging

import pytest
import torch

from padless.config.schema import DPOSettings, TrainSettings
from padless.data import load_rows, tokenize_preference
from padless.forward.engine import EngineSettings, ModelEngine
from padless.proof.check import gradient_delta
from padless.proof.load import load_model
from padless.proof.zoo import LOGIT_TARGET, scale_head
from padless.run.loop import MicroBatch
from padless.trainers.dpo import DPORecipe
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
