"""KTO and ORPO: each equals TRL 1.16's loss and gradient on identical ids (TRL pads them, padless packs
them), a step's loss and gradient do not depend on how its data is split into micro-batches, the
reference can be precomputed, and both examples learn their preference.

TRL's losses run on objects made without ``__init__`` carrying only the attributes their loss methods read
(``KTOTrainer._compute_loss``, ``ORPOTrainer.get_batch_loss_metrics``: private, pinned by ``trl==1.16.*``),
on a copy of the same tiny Llama (same seed, sdpa on padded rows). Its LM head is scaled so the largest
|logit| is about 30, where real models live and round-off is largest.

Tolerances. A summed completion log-prob of ``n`` tokens differs by at most ``n * bound(fp32, M)`` between
the padded and packed forwards (``M`` about 30, :func:`padless.proof.probe.bound`); KTO's and ORPO's losses
are sigmoids of ``beta`` times such differences (slope at most ``beta / 4``, ORPO's mean log-probs divide by
``n``), so a loss is known to ``beta * n * bound`` — about 1e-4 here, far below what a wrong pairing, KL
baseline or normaliser moves (0.01 and up). Gradients sum such terms over every token; they are compared at
1e-3 of their largest entry.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trl.experimental.orpo.orpo_trainer import ORPOTrainer
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer
from trl.trainer.utils import add_fused_lm_head

from padless.config.schema import (
    KTOConfig,
    KTOSettings,
    ModelSettings,
    ORPOSettings,
    PreferenceDataSettings,
    TrainSettings,
)
from padless.data import PairExample, load_rows, tokenize_preference
from padless.data.unpaired import UnpairedLayout, prompt_length
from padless.forward.engine import ModelEngine
from padless.forward.packing import Example
from padless.losses import orpo_loss
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.proof.zoo import scale_head
from padless.run.loop import MicroBatch
from padless.tiny import build_tiny_model
from padless.trainers.kto import KTORecipe, partners, run_kto
from padless.trainers.orpo import ORPORecipe

CPU = torch.device("cpu")
LOGIT = 30.0  # the policy's largest |logit|


def sharp(model: torch.nn.Module, factor: float) -> torch.nn.Module:
    scale_head(model, factor)
    return model


@pytest.fixture(scope="module")
def factor(tokenizer) -> float:
    """The head scale that brings the tiny Llama's largest |logit| on embedded text to :data:`LOGIT`."""
    pairs, _ = tokenize_preference(load_rows("tiny:preference_eval")[:1], tokenizer, max_length=2048)
    with torch.no_grad():
        logits = build_tiny_model("tiny-llama")(input_ids=torch.tensor([pairs[0].chosen.input_ids])).logits
    return LOGIT / logits.abs().max().item()


def policy_pair(factor: float) -> tuple[ModelEngine, torch.nn.Module]:
    """The same weights twice: padless's engine (varlen, packed) and TRL's model (sdpa, padded)."""
    ours = ModelEngine(sharp(load_model("tiny-llama", training=True), factor))
    theirs = sharp(build_tiny_model("tiny-llama", attn_implementation="sdpa"), factor).train()
    return ours, theirs


def frozen_reference(factor: float, trl: bool = False) -> torch.nn.Module:
    """A frozen reference near the policy: the same weights with a 5 % sharper head (log-ratios of a few
    nats, where the losses are not saturated and their gradients are not vanishingly small)."""
    if trl:
        return sharp(build_tiny_model("tiny-llama", attn_implementation="sdpa"), factor * 1.05)
    return ModelEngine(sharp(load_model("tiny-llama"), factor * 1.05))


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_grads(got: list[torch.Tensor], want: list[torch.Tensor], label: str) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-3 * w.abs().max().item(), msg=label)


def step(recipe, model, micros, normaliser) -> tuple[float, dict[str, float]]:
    """One optimizer step's loss and metrics accumulated over ``micros`` as the loop runs them."""
    model.zero_grad(set_to_none=True)
    total, metrics = 0.0, defaultdict(float)
    for micro in micros:
        loss, shares = recipe.loss(model, micro, normaliser)
        loss.backward()
        total += loss.item()
        for k, v in shares.items():
            metrics[k] += v
    return total, dict(metrics)


# ----------------------------------------------------------------------------------------------------------
# KTO


@pytest.fixture(scope="module")
def completions(tokenizer):
    """Unpaired completions read from preference pairs (a desirable and an undesirable one per row)."""
    items, _ = UnpairedLayout(max_length=2048).tokenize(load_rows("tiny:preference_eval")[:5], tokenizer)
    assert sorted(e.meta["desirable"] for e in items) == [False] * 5 + [True] * 5
    return items


def trl_kto(trl_policy, trl_ref, items, partner, pad_id, kto: KTOSettings) -> float:
    add_fused_lm_head(trl_policy, outputs=("log_probs", "entropy", "mean_logits"))
    add_fused_lm_head(trl_ref)
    trainer = KTOTrainer.__new__(KTOTrainer)
    fields = {
        "model": trl_policy,
        "ref_model": trl_ref,
        "accelerator": SimpleNamespace(device=CPU, gather_for_metrics=lambda t: t),
        "calculate_KL": kto.loss_type == "kto",
        "aux_loss_enabled": False,
        "precompute_ref_logps": False,
        "args": SimpleNamespace(gradient_checkpointing_kwargs=None),
        "loss_type": kto.loss_type,
        "beta": kto.beta,
        "desirable_weight": kto.desirable_weight,
        "undesirable_weight": kto.undesirable_weight,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "_total_train_tokens": 0,
        "_tp_size": 1,
    }
    for key, value in fields.items():
        setattr(trainer, key, value)
    rows = []
    for e, j in zip(items, partner, strict=True):
        n, m = prompt_length(e), prompt_length(items[j])
        rows.append(
            {
                "prompt_ids": e.input_ids[:n],
                "completion_ids": e.input_ids[n:],
                "KL_completion_ids": items[j].input_ids[m:],  # the very KL pairs padless builds
                "label": e.meta["desirable"],
            }
        )
    trl_policy.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(
        trl_policy, DataCollatorForUnpairedPreference(pad_token_id=pad_id)(rows), False
    )
    loss.backward()
    return loss.item()


@pytest.mark.parametrize(
    "kto, splits",
    [
        (KTOSettings(beta=0.1), True),
        (KTOSettings(beta=0.5, desirable_weight=1.3, undesirable_weight=0.8), False),
        (KTOSettings(beta=0.1, loss_type="apo_zero_unpaired"), False),
    ],
    ids=["kto", "weighted", "apo_zero_unpaired"],
)
def test_kto_equals_trl_for_any_split(completions, tokenizer, factor, kto, splits):
    """The whole set is one optimizer step, in one micro-batch (against TRL), then (``splits``) in
    budget-packed ones and in padded ones of one completion each."""
    policy, trl_policy = policy_pair(factor)
    ref, trl_ref = frozen_reference(factor), frozen_reference(factor, trl=True)
    pad = tokenizer.pad_token_id
    n_tokens = max(len(e) for e in completions)
    tol = kto.beta * max(kto.desirable_weight, 1) * 2 * n_tokens * bound(torch.float32, LOGIT)
    reference = None
    for budget in (8192, 100, 1) if splits else (8192,):
        cfg = TrainSettings(max_tokens_per_batch=max(budget, n_tokens), gradient_accumulation_steps=64)
        if budget == 1:
            cfg = TrainSettings(batching="padded", batch_size=1, gradient_accumulation_steps=64)
        recipe = KTORecipe(completions, cfg, kto, pad, CPU, ref)
        micros = recipe.plan(0)
        assert {m.step for m in micros} == {0}
        got = step(recipe, policy, micros, len(completions)), grads(policy)
        if reference is None:
            want = trl_kto(trl_policy, trl_ref, completions, recipe.train.partner, pad, kto)
            assert got[0][0] == pytest.approx(want, abs=tol)
            assert_grads(got[1], grads(trl_policy), "TRL")
            reference = got
        else:
            assert got[0][0] == pytest.approx(reference[0][0], abs=tol), budget
            for key, value in reference[0][1].items():
                assert got[0][1][key] == pytest.approx(value, rel=1e-4, abs=tol), (budget, key)
            assert_grads(got[1], reference[1], f"budget {budget}")
    metrics = reference[0][1]
    assert (metrics["kl"] > 0) == (kto.loss_type == "kto")
    assert metrics["rewards/margins"] == pytest.approx(
        metrics["rewards/chosen"] - metrics["rewards/rejected"]
    )


def test_kto_baseline_is_the_steps_and_planted_mistakes_move_it(completions, tokenizer, factor):
    """Each optimizer step gets the KL baseline of its own completions; a baseline taken per micro-batch
    (TRL's), or KL pairs that are not mismatched (each completion its own partner), move it by far more
    than round-off (1e-5 here). The partners are a derangement: each completion lent once."""
    policy = ModelEngine(sharp(load_model("tiny-llama", training=True), factor))
    cfg = TrainSettings(max_tokens_per_batch=100, gradient_accumulation_steps=2)
    recipe = KTORecipe(completions, cfg, KTOSettings(), tokenizer.pad_token_id, CPU, frozen_reference(factor))
    micros = recipe.plan(0)
    assert len({m.step for m in micros}) > 1
    assert sorted(i for m in micros for i in m.data) == list(range(len(completions)))
    first, second = ([m for m in micros if m.step == s] for s in (0, 1))
    count = sum(m.units for m in first)
    metrics = step(recipe, policy, first, count)[1]
    assert metrics["kl"] > 0.05
    assert abs(step(recipe, policy, second, sum(m.units for m in second))[1]["kl"] - metrics["kl"]) > 1e-2

    own = []  # TRL's estimate: each micro-batch's own baseline
    for m in first:
        recipe.steps, recipe.baseline = {0: list(m.data)}, None
        own.append(recipe.loss(policy, m, count)[1]["kl"] * count / m.units)
    assert max(abs(z - metrics["kl"]) for z in own) > 1e-2

    recipe.steps, recipe.baseline = {0: [i for m in first for i in m.data]}, None
    recipe.train.partner = np.arange(len(completions))  # planted: matched pairs
    assert abs(step(recipe, policy, first, count)[1]["kl"] - metrics["kl"]) > 1e-2
    lent = partners(10, 3)
    assert (lent != np.arange(10)).all() and sorted(lent) == list(range(10))


def test_kto_precomputed_reference_equals_live_reference(completions, tokenizer, factor):
    policy = ModelEngine(sharp(load_model("tiny-llama", training=True), factor))
    ref = frozen_reference(factor)
    cfg = TrainSettings(max_tokens_per_batch=400, gradient_accumulation_steps=64)
    live = KTORecipe(completions, cfg, KTOSettings(), tokenizer.pad_token_id, CPU, ref)
    copies = [type(e)(e.input_ids, e.loss_mask, dict(e.meta)) for e in completions]
    stored = KTORecipe(copies, cfg, KTOSettings(precompute_ref_logps=True), tokenizer.pad_token_id, CPU, ref)
    stored.bind(policy)
    assert stored.ref_model is None and all("ref_kl_logps" in e.meta for e in copies)
    a = step(live, policy, live.plan(0), len(completions))
    b = step(stored, policy, stored.plan(0), len(completions))
    assert b[0] == pytest.approx(a[0], rel=1e-6) and b[1]["kl"] == pytest.approx(a[1]["kl"], rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# ORPO


@pytest.fixture(scope="module")
def pairs(tokenizer):
    pairs, _ = tokenize_preference(load_rows("tiny:preference_eval")[:6], tokenizer, max_length=2048)
    return pairs


def trl_orpo(model, pairs, pad_id: int, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    trainer = ORPOTrainer.__new__(ORPOTrainer)
    fields = {
        "is_encoder_decoder": False,
        "padding_value": pad_id,
        "aux_loss_enabled": False,
        "beta": beta,
        "accelerator": SimpleNamespace(device=CPU, gather_for_metrics=lambda t: t),
    }
    for key, value in fields.items():
        setattr(trainer, key, value)
    batch = {}
    for side in ("chosen", "rejected"):
        seqs = [getattr(p, side) for p in pairs]
        width = max(map(len, seqs))
        ids = torch.tensor([s.input_ids + [pad_id] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        target = torch.tensor([list(s.loss_mask) + [False] * (width - len(s)) for s in seqs])
        batch |= {
            f"{side}_input_ids": ids,
            f"{side}_attention_mask": mask,
            f"{side}_labels": ids.masked_fill(~target, -100),
        }
    model.zero_grad(set_to_none=True)
    loss, metrics = trainer.get_batch_loss_metrics(model, batch)
    loss.backward()
    return loss, metrics


def test_orpo_equals_trl(pairs, tokenizer, factor):
    """The odds-ratio term and the mean log-probs equal TRL's on six pairs of different lengths; TRL's NLL
    is a token mean over the micro-batch with prompt tokens included, padless's the mean of each chosen
    completion's NLL (a mean over pairs, whatever the batching). On a pair whose prompt is one token the two
    coincide, and there the whole loss and its gradient equal TRL's."""
    beta, pad = 0.2, tokenizer.pad_token_id
    policy, trl_policy = policy_pair(factor)
    recipe = ORPORecipe(pairs, TrainSettings(), ORPOSettings(beta=beta), pad, CPU)
    _, metrics = step(recipe, policy, [MicroBatch(pairs, len(pairs), 0)], len(pairs))
    _, theirs = trl_orpo(trl_policy, pairs, pad, beta)
    tol = 4 * bound(torch.float32, LOGIT)  # a mean per token: the per-token bound, twice for both sides
    for ours, trl in [
        ("logps/chosen", "logps/chosen"),
        ("logps/rejected", "logps/rejected"),
        ("log_odds_chosen", "log_odds_chosen"),
        ("log_odds_ratio", "log_odds_ratio"),
        ("rewards/accuracies", "rewards/accuracies"),
    ]:
        assert metrics[ours] == pytest.approx(theirs[trl], abs=tol), ours
    assert metrics["loss"] == pytest.approx(metrics["nll_loss"] + metrics["odds_ratio_loss"], rel=1e-6)

    p = pairs[0]
    start = p.prompt_length
    one = [
        PairExample(
            Example(p.chosen.input_ids[start - 1 :], [False] + [True] * (len(p.chosen) - start)),
            Example(p.rejected.input_ids[start - 1 :], [False] + [True] * (len(p.rejected) - start)),
        )
    ]
    loss, _ = step(recipe, policy, [MicroBatch(one, 1, 0)], 1)
    trl_loss, _ = trl_orpo(trl_policy, one, pad, beta)
    assert loss == pytest.approx(trl_loss.item(), abs=tol)
    assert_grads(grads(policy), grads(trl_policy), "one pair")


def test_orpo_same_for_any_split_and_layout(pairs, tokenizer, factor):
    policy = ModelEngine(sharp(load_model("tiny-llama", training=True), factor))
    reference = None
    for cfg, groups in [
        (TrainSettings(), [list(range(6))]),
        (TrainSettings(), [[0, 3], [1], [2, 4, 5]]),
        (TrainSettings(batching="padded", padding_side="left"), [[0, 1, 2], [3, 4, 5]]),
    ]:
        recipe = ORPORecipe(pairs, cfg, ORPOSettings(beta=0.3), tokenizer.pad_token_id, CPU)
        got = step(recipe, policy, [MicroBatch([pairs[i] for i in g], len(g), 0) for g in groups], 6)
        got = (got, grads(policy))
        if reference is None:
            reference = got
            continue
        assert got[0][0] == pytest.approx(reference[0][0], rel=1e-5)
        assert_grads(got[1], reference[1], str(groups))


def test_orpo_loss_function_matches_its_definition():
    """The odds-ratio term against a direct fp64 evaluation of ``log(p / (1 - p))`` at mean log-probs down to
    -1e-6 (where the naive form loses every digit) and a planted swap of chosen and rejected."""
    chosen = torch.tensor([-1e-6, -0.1, -0.69, -0.7, -3.0, -20.0], dtype=torch.float64)
    rejected = torch.tensor([-2.0, -0.05, -0.8, -0.6, -3.5, -19.0], dtype=torch.float64)
    losses, log_odds = orpo_loss(chosen, rejected, beta=0.5)

    def odds(lp):
        return lp - torch.log(-torch.expm1(lp))

    want = (odds(chosen) - odds(rejected)).float()
    torch.testing.assert_close(log_odds, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(losses, -0.5 * F.logsigmoid(want), rtol=1e-6, atol=1e-7)
    swapped, _ = orpo_loss(rejected, chosen, beta=0.5)
    assert not torch.allclose(swapped, losses)


# ----------------------------------------------------------------------------------------------------------
# The trainers end to end


def preference_run(tmp_path, name: str, **train):
    return dict(
        model=ModelSettings(name="tiny-llama"),
        data=PreferenceDataSettings(train="tiny:preference", eval="tiny:preference_eval"),
        train=TrainSettings(
            output_dir=str(tmp_path / name),
            logging_steps=1,
            progress_bar=False,
            report_to=["jsonl"],
            max_tokens_per_batch=4096,
            **train,
        ),
    )


@pytest.mark.slow
def test_kto_learns_the_embedded_preferences(tmp_path):
    """One epoch of KTO on 160 embedded pairs read as 320 labelled completions: on the held-out pairs the
    desirable completions' implied rewards end above the undesirable ones', and the KL baseline is logged."""
    cfg = preference_run(tmp_path, "kto", num_epochs=1, learning_rate=2e-3)
    cfg["data"] = PreferenceDataSettings(train="tiny:preference[:160]", eval="tiny:preference_eval")
    metrics = run_kto(KTOConfig(**cfg))
    assert metrics["eval/rewards/margins"] > 0, metrics
    lines = (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()
    assert any("train/kl" in json.loads(line) for line in lines)
