"""DPO and reward modelling: invariance to layout and micro-batch split, eval that never crashes, and
training that measurably learns the embedded preferences."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from padless.config.schema import (
    DPOConfig,
    DPOSettings,
    ModelSettings,
    PreferenceDataSettings,
    RMConfig,
    TrainSettings,
)
from padless.data import load_rows, tokenize_preference
from padless.forward.engine import ModelEngine, sequence_scores
from padless.forward.packing import budget_batches, pack
from padless.forward.passes import score_examples
from padless.proof.load import load_model
from padless.run.loop import MicroBatch
from padless.tiny import build_tiny_model, tiny_tokenizer
from padless.trainers.dpo import DPORecipe, run_dpo
from padless.trainers.rm import RMRecipe, run_rm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pairs(tokenizer):
    pairs, _ = tokenize_preference(load_rows("tiny:preference")[:40], tokenizer, max_length=2048)
    return [p for p in pairs if len(p) <= 300][:14]


SPLITS = {"all at once": None, "budget": 600, "one pair each": 1}


def groups_for(split, pairs):
    if split is None:
        return [list(range(len(pairs)))]
    if split == 1:
        return [[i] for i in range(len(pairs))]
    return budget_batches([len(p) for p in pairs], split, seed=1)


def assert_same(reference, got, label, beta: float = 1.0):
    """fp32, 1e-5 relative. Rewards and margins are beta x differences of log-prob sums (~ -100 each):
    they are compared at 1e-5 relative to those sums, the precision the sums themselves have."""
    ref_metrics, ref_grads = reference
    metrics, grads = got
    assert metrics.keys() == ref_metrics.keys()
    scale = beta * max(abs(ref_metrics.get("logps/chosen", 0.0)), abs(ref_metrics.get("logps/rejected", 0.0)))
    for key in metrics:
        atol = 1e-5 * scale if key.startswith("rewards/") and key != "rewards/accuracies" else 1e-6
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=atol), (label, key)
    # Gradients are chosen-minus-rejected sums over ~2k tokens that largely cancel (the completions are
    # similar), so fp32 re-ordering shows at ~4e-5 of the result's largest entry: 2e-4 still catches a
    # wrong pairing or normaliser, which moves them by O(1).
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-4 * r.abs().max().item(), msg=label)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_dpo_same_for_any_layout_and_split(pairs, tokenizer, loss_type, step_metrics):
    policy = ModelEngine(load_model("tiny-llama", training=True))
    ref = None if loss_type == "simpo" else ModelEngine(load_model("tiny-llama", seed=1))
    dpo = DPOSettings(beta=0.5, loss_type=loss_type, rpo_alpha=0.3 if loss_type == "sigmoid" else None)
    reference = None
    for batching, side in [("tokens", "right"), ("padded", "left"), ("padded", "right")]:
        padded = {"padding_side": side, "batch_size": 4} if batching == "padded" else {}
        cfg = TrainSettings(batching=batching, **padded)
        recipe = DPORecipe(pairs, cfg, dpo, tokenizer.pad_token_id, CPU, ref)
        for name, split in SPLITS.items():
            got = step_metrics(recipe, policy, groups_for(split, pairs), pairs)
            if reference is None:
                reference = got
            else:
                assert_same(reference, got, f"{batching}/{side}/{name}", dpo.beta)
    metrics = reference[0]
    assert metrics["rewards/margins"] == pytest.approx(
        metrics["rewards/chosen"] - metrics["rewards/rejected"], abs=1e-6
    )
    assert 0.0 <= metrics["rewards/accuracies"] <= 1.0


def test_dpo_precomputed_reference_equals_live_reference(pairs, tokenizer, step_metrics):
    policy = ModelEngine(load_model("tiny-llama", training=True))
    ref = ModelEngine(load_model("tiny-llama", seed=1))
    cfg = TrainSettings()
    live = DPORecipe(pairs, cfg, DPOSettings(), tokenizer.pad_token_id, CPU, ref)
    stored_pairs = [replace(p, meta=dict(p.meta)) for p in pairs]
    settings = DPOSettings(precompute_ref_logps=True)
    stored = DPORecipe(stored_pairs, cfg, settings, tokenizer.pad_token_id, CPU, ref)
    stored.bind(policy)
    assert stored.ref_model is None and all("ref_logps" in p.meta for p in stored_pairs)
    groups = groups_for(600, pairs)
    live_step = step_metrics(live, policy, groups, pairs)
    assert_same(live_step, step_metrics(stored, policy, groups, stored_pairs), "stored", 0.1)


def test_rm_scores_invariant_to_batch_composition_and_layout(pairs, tokenizer):
    model = ModelEngine(load_model("tiny-qwen2", task="score"))
    seqs = [s for p in pairs[:6] for s in (p.chosen, p.rejected)]
    with torch.no_grad():
        alone = torch.tensor([sequence_scores(model, pack([s])).item() for s in seqs])
        together = sequence_scores(model, pack(seqs))
        reversed_ = sequence_scores(model, pack(seqs[::-1])).flip(0)
        scored = torch.tensor(score_examples(model, seqs, max_tokens=300))
    for got in (together, reversed_, scored):
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    cfg = TrainSettings(batching="padded", padding_side="left", batch_size=3)
    recipe = RMRecipe(pairs[:6], cfg, tokenizer.pad_token_id, CPU)
    packed = RMRecipe(pairs[:6], TrainSettings(), tokenizer.pad_token_id, CPU)
    with torch.no_grad():
        a = packed.loss(model, MicroBatch(pairs[:6], 0, 0), 6)[1]
        b = {}
        for group in ([0, 1, 2], [3, 4, 5]):
            for k, v in recipe.loss(model, MicroBatch([pairs[i] for i in group], 0, 0), 6)[1].items():
                b[k] = b.get(k, 0.0) + v
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny model saved with a tokenizer whose padding_side is left, and one whose is right."""
    dirs = {}
    for side in ("left", "right"):
        path = tmp_path_factory.mktemp(f"tiny-{side}")
        build_tiny_model("tiny-llama").save_pretrained(path)
        tok = tiny_tokenizer()
        tok.padding_side = side
        tok.save_pretrained(path)
        dirs[side] = str(path)
    return dirs


def pair_train(tmp_path, name, **train) -> TrainSettings:
    return TrainSettings(
        output_dir=str(tmp_path / name), logging_steps=1, progress_bar=False, report_to=["jsonl"], **train
    )


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_eval_never_crashes_on_any_backend_padding_side_and_eval_batch(tmp_path, model_dirs, backend, side):
    """Eval steps with the tokenizer padded on either side, packed (budget) or padded (3 pairs) batches.
    The budget packs the 40 eval pairs into several rows (eager attention costs the square of a row)."""
    model = ModelSettings(name=model_dirs[side], attn_implementation=backend)
    data = PreferenceDataSettings(train="tiny:preference_eval", eval="tiny:preference_eval")
    extra = {"batching": "padded", "batch_size": 3} if side == "left" else {"max_tokens_per_batch": 2048}
    metrics = run_dpo(
        DPOConfig(
            model=model, data=data, train=pair_train(tmp_path, "dpo", max_steps=1, eval_steps=1, **extra)
        )
    )
    assert 0.0 <= metrics["eval/rewards/accuracies"] <= 1.0 and metrics["eval/loss"] > 0
    metrics = run_rm(
        RMConfig(model=model, data=data, train=pair_train(tmp_path, "rm", max_steps=1, eval_steps=1, **extra))
    )
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0 and metrics["eval/loss"] > 0


def test_reward_model_learns_embedded_preferences(tmp_path):
    data = PreferenceDataSettings(train="tiny:preference", eval="tiny:preference_eval")
    train = pair_train(
        tmp_path, "rm", num_epochs=2, learning_rate=1e-3, warmup_ratio=0.1, max_tokens_per_batch=4096
    )
    metrics = run_rm(RMConfig(model=ModelSettings(name="tiny-llama"), data=data, train=train))
    assert metrics["eval/accuracy"] >= 0.7, metrics
    records = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    first = [r["train/accuracy"] for r in records if "train/accuracy" in r][:3]
    assert metrics["eval/accuracy"] > sum(first) / len(first) + 0.1


def test_dpo_raises_reward_accuracy(tmp_path):
    data = PreferenceDataSettings(train="tiny:preference", eval="tiny:preference_eval")
    train = pair_train(tmp_path, "dpo", num_epochs=1, learning_rate=2e-3, max_tokens_per_batch=4096)
    cfg = DPOConfig(model=ModelSettings(name="tiny-llama"), data=data, train=train, dpo=DPOSettings(beta=0.1))
    metrics = run_dpo(cfg)
    assert metrics["eval/rewards/accuracies"] >= 0.7, metrics
    assert metrics["eval/rewards/margins"] > 0


@pytest.mark.parametrize("kind", ["dpo", "rm"])
def test_resume_continues_exactly(tmp_path, kind):
    data = PreferenceDataSettings(train="tiny:preference_eval", eval="tiny:preference_eval")
    config, run = (DPOConfig, run_dpo) if kind == "dpo" else (RMConfig, run_rm)

    def cfg(name: str, resume: str | None = None):
        train = pair_train(
            tmp_path,
            name,
            max_steps=4,
            save_steps=2,
            eval_steps=2,
            max_tokens_per_batch=2048,
            resume_from_checkpoint=resume,
        )
        return config(model=ModelSettings(name="tiny-llama"), data=data, train=train)

    straight = run(cfg("a"))
    run(cfg("b"))
    shutil.rmtree(tmp_path / "b" / "checkpoint-4")
    resumed = run(cfg("b", "latest"))
    for key in ("train/loss", "eval/loss"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-6), key
