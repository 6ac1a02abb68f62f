"""GRPO and PPO: every scoring pass packed and equal to scoring alone, rewards that rise, and PPO with a
reward model through checkpoint and resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from padless.config import GRPOConfig, PPOConfig, SFTConfig, load_config
from padless.data import load_rows
from padless.model import forward_packed, load_model
from padless.packing import Example, pack
from padless.tiny import build_tiny_model, tiny_tokenizer
from padless.trainers.grpo import GRPORecipe, run_grpo
from padless.trainers.ppo import run_ppo
from padless.trainers.sft import run_sft

FAST = ["train.logging_steps=1", "train.progress_bar=false", "train.report_to=[jsonl]"]


def test_stored_rollout_logps_equal_scoring_each_alone(tokenizer):
    """Completions of different lengths, EOS at different places, scored in packed micro-batches."""
    model = load_model("tiny-llama")
    cfg = load_config(GRPOConfig, None, ["train.max_tokens_per_batch=64"])
    recipe = GRPORecipe([], cfg, tokenizer, model, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    eos = tokenizer.eos_token_id
    examples = []
    for prompt_len, completion_len in [(5, 1), (12, 7), (3, 20), (9, 2), (30, 11)]:
        prompt = torch.randint(3, 4096, (prompt_len,), generator=gen).tolist()
        completion = [*torch.randint(3, 4096, (completion_len - 1,), generator=gen).tolist(), eos]
        examples.append(Example(prompt + completion, [False] * prompt_len + [True] * completion_len))
    recipe.store(examples, {"ref_logps": recipe.logps_pass(model)})
    with torch.no_grad():
        for e in examples:
            batch = pack([e])
            alone = forward_packed(model, batch, temperature=cfg.rollout.temperature).logps[
                batch.loss_mask[0]
            ]
            assert len(e.meta["ref_logps"]) == e.num_targets
            torch.testing.assert_close(torch.tensor(e.meta["ref_logps"]), alone, rtol=0, atol=1e-5)


def rollout_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "rollout/reward" in r]


@pytest.fixture(scope="module")
def arithmetic_sft(tmp_path_factory):
    """A tiny model SFT-warmed on the embedded arithmetic prompts: it answers with numbers and stops."""
    root = tmp_path_factory.mktemp("rl-sft")
    with (root / "rl_sft.jsonl").open("w") as f:
        for row in load_rows("tiny:rl"):
            messages = [
                {"role": "user", "content": row.data["prompt"]},
                {"role": "assistant", "content": row.data["answer"]},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    overrides = [
        "model.name=tiny-llama",
        f"data.train={root / 'rl_sft.jsonl'}",
        f"train.output_dir={root / 'sft'}",
        "train.num_epochs=3",
        "train.learning_rate=3e-3",
        "train.max_tokens_per_batch=2048",
        *FAST,
    ]
    run_sft(load_config(SFTConfig, None, overrides))
    return str(next((root / "sft").glob("checkpoint-*")))


@pytest.mark.slow
def test_grpo_raises_mean_reward_on_arithmetic(tmp_path, arithmetic_sft):
    """Eight embedded arithmetic prompts, sampled every rollout: exact and partial-credit rewards rise."""
    with (tmp_path / "rl8.jsonl").open("w") as f:
        for row in load_rows("tiny:rl")[:8]:
            f.write(json.dumps(row.data) + "\n")
    overrides = [
        f"model.name={arithmetic_sft}",
        f"data.train={tmp_path / 'rl8.jsonl'}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=15",
        "train.learning_rate=2e-4",
        "rollout.prompts_per_step=8",
        "rollout.num_generations=8",
        "rollout.max_new_tokens=6",
        "reward.functions=[arithmetic,arithmetic_distance]",
        "grpo.beta=0.0",
        *FAST,
    ]
    run_grpo(load_config(GRPOConfig, None, overrides))
    rewards = [r["rollout/reward"] for r in rollout_records(tmp_path / "run")]
    assert len(rewards) == 15
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.02, rewards


def test_grpo_masks_and_counts_truncated_completions(tmp_path):
    overrides = [
        "model.name=tiny-llama",
        f"train.output_dir={tmp_path}",
        "train.max_steps=1",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=4",
        *FAST,
    ]
    metrics = run_grpo(load_config(GRPOConfig, None, overrides))
    record = rollout_records(tmp_path)[0]
    assert record["rollout/truncated_fraction"] == 1.0  # a random model never says EOS in 4 tokens
    assert record["rollout/completion_length"] == 4
    assert metrics["train/loss"] == 0.0  # every completion masked out of the loss


def test_vllm_engine_is_refused_clearly(tmp_path):
    cfg = load_config(GRPOConfig, None, [f"train.output_dir={tmp_path}", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout.engine: vllm"):
        run_grpo(cfg)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    build_tiny_model("tiny-llama", seed=5, task="score").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_ppo_with_reward_model_checkpoint_and_resume(tmp_path, reward_model_dir):
    def overrides(run: str, *extra: str) -> list[str]:
        return [
            "model.name=tiny-llama",
            f"train.output_dir={tmp_path / run}",
            "train.max_steps=4",
            "train.save_steps=2",
            "rollout.prompts_per_step=4",
            "rollout.max_new_tokens=6",
            "rollout.mask_truncated=false",
            "reward.functions=[]",
            f"reward.model={reward_model_dir}",
            "ppo.critic_warmup_steps=1",
            *FAST,
            *extra,
        ]

    straight = run_ppo(load_config(PPOConfig, None, overrides("a")))
    run_ppo(load_config(PPOConfig, None, overrides("b")))
    shutil.rmtree(tmp_path / "b" / "checkpoint-4")
    resumed = run_ppo(load_config(PPOConfig, None, overrides("b", "train.resume_from_checkpoint=latest")))
    for key in ("train/loss", "train/value_loss", "train/policy_loss"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-7), key
    records = rollout_records(tmp_path / "a")
    assert len(records) == 4 and all("rollout/reward/reward_model" in r for r in records)
    ckpt = tmp_path / "a" / "checkpoint-4"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "value" / "model.safetensors").exists()
    # the critic warm-up rollout trains the value model only; later ones train both (vf_coef 0.1)
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert steps[0]["train/loss"] == pytest.approx(0.1 * steps[0]["train/value_loss"], rel=1e-5)
    for later in steps[1:]:
        expected = later["train/policy_loss"] + 0.1 * later["train/value_loss"]
        assert later["train/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
