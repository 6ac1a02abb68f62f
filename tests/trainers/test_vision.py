"""Vision-language models in every trainer: the embedded tiny Qwen2.5-VL learns the shapes data in SFT, DPO
and reward-model metrics do not depend on the layout, and GRPO / PPO sample, score and resume with images."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import datasets
import pytest
import torch
from PIL import Image

from padless.config.loading import load_config
from padless.config.schema import DPOSettings, GRPOConfig, PPOConfig, SFTConfig, TrainSettings
from padless.data import load_rows, tokenize_preference
from padless.data.images import ImageInputs
from padless.data.sources import load_processor
from padless.errors import InputError
from padless.forward.engine import ModelEngine, sequence_scores
from padless.forward.packing import pack
from padless.proof.load import load_model
from padless.rl.environments import Environment, Step, Turn
from padless.run.checkpoint import recipe_file
from padless.run.loop import MicroBatch
from padless.tiny import PAD_TOKEN_ID, build_tiny_model, shapes
from padless.trainers.dpo import DPORecipe
from padless.trainers.grpo import run_grpo
from padless.trainers.ppo import run_ppo
from padless.trainers.rm import RMRecipe, score_file
from padless.trainers.sft import run_sft

CPU = torch.device("cpu")
VLM = "tiny-qwen2.5-vl"
EXAMPLE = "examples/vlm_sft_tiny.yaml"
FAST = ["train.logging_steps=1", "train.progress_bar=false", "train.report_to=[jsonl]"]
WEIGHT_SCALE = 4.0  # a random tiny model is nearly flat; scaled up, a leak shows far above round-off


def sharpened(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(WEIGHT_SCALE)
    return model


@pytest.fixture(scope="module")
def inputs() -> ImageInputs:
    return ImageInputs(load_processor(VLM), load_model(VLM, probe=False).config)


@pytest.fixture(scope="module")
def pairs(inputs):
    """Image pairs (chosen and rejected share the prompt's pictures) of different picture sizes."""
    rows = load_rows("tiny:shapes_preference")[:8]
    pairs, _ = tokenize_preference(rows, inputs.tokenizer, max_length=256, images=inputs)
    assert len({p.chosen.vision["image_grid_thw"][0].prod().item() for p in pairs}) > 1  # sizes differ
    return pairs


def largest_difference(a: dict[str, float], b: dict[str, float]) -> float:
    return max(abs(a[k] - b[k]) for k in a)


def test_vlm_dpo_same_for_any_layout_and_split(pairs, step_metrics):
    """DPO loss, rewards, log-probs and gradients of image pairs: packed (all at once or one pair per
    micro-batch) and padded on either side agree to fp32 round-off; a batch that drops the M-RoPE rows (2D
    ids) is stopped by the engine."""
    policy = ModelEngine(sharpened(load_model(VLM, training=True)))
    ref = ModelEngine(sharpened(load_model(VLM, seed=1)))
    dpo_settings = DPOSettings(beta=0.1)
    everything, one_each = [list(range(len(pairs)))], [[i] for i in range(len(pairs))]
    reference = None
    for batching, side in [("tokens", "right"), ("padded", "left"), ("padded", "right")]:
        padded = {"padding_side": side, "batch_size": 3} if batching == "padded" else {}
        cfg = TrainSettings(batching=batching, **padded)
        recipe = DPORecipe(pairs, cfg, dpo_settings, PAD_TOKEN_ID, CPU, ref)
        for groups in (everything, one_each):
            metrics, grads = step_metrics(recipe, policy, groups, pairs)
            if reference is None:
                reference = metrics, grads
                continue
            # log-prob sums are ~-2e3 at this weight scale: fp32 re-ordering shows at ~1e-4 of them
            scale = max(abs(reference[0]["logps/chosen"]), 1.0)
            for key, value in metrics.items():
                assert value == pytest.approx(reference[0][key], rel=1e-5, abs=1e-6 * scale), (batching, key)
            for g, r in zip(grads, reference[1], strict=True):
                torch.testing.assert_close(g, r, rtol=0, atol=2e-4 * r.abs().max().item())

    class FlatPositions(DPORecipe):  # the text row only: image tokens lose their M-RoPE rows
        def collate(self, chunk):
            batch = super().collate(chunk)
            return dataclasses.replace(batch, position_ids=batch.position_ids[0])

    leaky = FlatPositions(pairs, TrainSettings(), dpo_settings, PAD_TOKEN_ID, CPU, ref)
    with pytest.raises(ValueError, match=r"needs position ids \[4, 1, T\]"):  # the engine stops on them
        step_metrics(leaky, policy, everything, pairs)


def test_vlm_reward_model_scores_same_packed_alone_and_padded(pairs):
    """Bradley-Terry on a VLM with padless's score head: scores of image sequences packed together equal
    each alone, and the padded (left) loss equals the packed one."""
    model = ModelEngine(sharpened(load_model(VLM, task="score")))
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    with torch.no_grad():
        alone = torch.tensor([sequence_scores(model, pack([s])).item() for s in seqs])
        together = sequence_scores(model, pack(seqs))
        packed = RMRecipe(pairs, TrainSettings(), PAD_TOKEN_ID, CPU).loss(model, MicroBatch(pairs, 0, 0), 8)
        cfg = TrainSettings(batching="padded", padding_side="left", batch_size=8)
        padded = RMRecipe(pairs, cfg, PAD_TOKEN_ID, CPU).loss(model, MicroBatch(pairs, 0, 0), 8)
    assert alone.std() > 1e-3  # the scores differ between sequences: equality below means something
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    for key in packed[1]:
        assert padded[1][key] == pytest.approx(packed[1][key], rel=1e-5, abs=1e-5), key


def rollout_records(run) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "rollout/reward" in r]


def grpo_overrides(run, *extra: str) -> list[str]:
    """Two optimizer steps per rollout; a reward that tells a random model's completions apart (the answer
    reward is 0 for all of them, and so would be every advantage)."""
    return [
        f"model.name={VLM}",
        "data.train=tiny:shapes_rl",
        "data.max_prompt_length=64",
        f"train.output_dir={run}",
        "train.max_steps=4",
        "train.save_steps=1",
        "train.learning_rate=1e-3",
        f"reward.functions=[{__file__}:variety]",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=2",
        "rollout.max_new_tokens=5",
        "rollout.mask_truncated=false",
        "grpo.updates_per_rollout=2",
        *FAST,
        *extra,
    ]


def test_vlm_grpo_samples_with_images_and_resumes_mid_rollout(tmp_path):
    """GRPO on image prompts: rollouts carry their prompt's pictures into every pass, the checkpoint holds
    the processor, and a run resumed mid-rollout trains on the saved samples (their images found again
    from the prompts) exactly as the uninterrupted run did."""
    straight = run_grpo(load_config(GRPOConfig, None, grpo_overrides(tmp_path / "a")))
    run = tmp_path / "a"
    assert json.loads(recipe_file(run / "checkpoint-3", 0).read_text())["rollout"]
    saved = load_processor(str(run / "checkpoint-3")).image_processor
    assert (
        saved.size
        == load_processor(VLM).image_processor.size
        == {"shortest_edge": 784, "longest_edge": 12544}
    )
    shutil.copytree(run / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    resumed = run_grpo(
        load_config(GRPOConfig, None, grpo_overrides(tmp_path / "b", "train.resume_from_checkpoint=latest"))
    )
    assert rollout_records(tmp_path / "b") == []  # nothing sampled again
    assert straight["train/loss"] != 0
    for key in ("train/loss", "train/kl", "train/clip_fraction"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-8), key


def variety(prompts: list[str], completions: list[str], **fields) -> list[float]:
    return [float(len(set(c))) for c in completions]


class LookAgain(Environment):
    """Shows the picture once more and asks again: two model turns, the second after two images."""

    def step(self, turn: Turn) -> Step:
        again = [{"type": "image", "image": self.row["images"][0]}, {"type": "text", "text": "And now?"}]
        return Step([{"role": "user", "content": again}], done=turn.index == 1)


def test_vlm_grpo_multi_turn_episodes_keep_their_images_and_resume_mid_rollout(tmp_path, talkative_vlm):
    """GRPO of a VLM policy with a multi-turn environment through the trainer: episodes of two turns sampled
    with the prompt's image and the one the environment shows, the sampler's log-probs within 1e-4 of the
    packed training forward's, and a run resumed mid-rollout (the prompt's images found again from the
    prompt rows, the environment's read back from the checkpoint) trains as the uninterrupted one did."""
    extra = (
        f"model.name={talkative_vlm}",
        f"rollout.environment={__file__}:LookAgain",
        "rollout.max_turns=2",
        "rollout.max_new_tokens=8",
        "rollout.temperature=0.7",
        "train.max_steps=2",
    )
    straight = run_grpo(load_config(GRPOConfig, None, grpo_overrides(tmp_path / "a", *extra)))
    [record] = rollout_records(tmp_path / "a")
    assert record["rollout/turns"] > 1 and record["rollout/env_tokens"] > 0
    assert record["mismatch/logp_diff_max"] < 1e-4
    plan = json.loads(recipe_file(tmp_path / "a" / "checkpoint-1", 0).read_text())["rollout"]
    assert all(len(e["drawn"]["env_images"]) == 1 for e in plan)  # saved as PNG
    shutil.copytree(tmp_path / "a" / "checkpoint-1", tmp_path / "b" / "checkpoint-1")
    resume = "train.resume_from_checkpoint=latest"
    resumed = run_grpo(load_config(GRPOConfig, None, grpo_overrides(tmp_path / "b", *extra, resume)))
    assert rollout_records(tmp_path / "b") == []  # the saved episodes, not new ones
    for key in ("train/loss", "train/kl", "train/clip_fraction"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-8), key


@pytest.fixture(scope="module")
def vlm_reward_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vlm-rm")
    build_tiny_model(VLM, seed=5, task="score").save_pretrained(path)
    load_processor(VLM).save_pretrained(path)
    return str(path)


def test_vlm_ppo_with_vlm_value_and_reward_models(tmp_path, vlm_reward_model):
    """PPO of a VLM: a VLM value model (score head) and a VLM reward model both read the pictures."""
    overrides = [
        f"model.name={VLM}",
        "data.train=tiny:shapes_rl",
        "data.max_prompt_length=64",
        f"train.output_dir={tmp_path}",
        "train.max_steps=2",
        "train.save_steps=2",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=4",
        "rollout.mask_truncated=false",
        "reward.functions=[]",
        f"reward.model={vlm_reward_model}",
        *FAST,
    ]
    metrics = run_ppo(load_config(PPOConfig, None, overrides))
    assert metrics["train/value_loss"] > 0
    records = rollout_records(tmp_path)
    assert len(records) == 2 and all(r["rollout/reward/reward_model"] != 0 for r in records)
    value = load_model(str(tmp_path / "checkpoint-2" / "value"), task="score", probe=False)
    assert value.config.padless_score_head


def test_text_reward_model_refused_for_a_vlm_policy(tmp_path):
    path = tmp_path / "text-rm"
    build_tiny_model("tiny-qwen2", task="score").save_pretrained(path)
    load_processor(VLM).tokenizer.save_pretrained(path)
    cfg = load_config(GRPOConfig, None, [*grpo_overrides(tmp_path / "run"), f"reward.model={path}"])
    with pytest.raises(ValueError, match="is a text-only model but the policy is a vision-language model"):
        run_grpo(cfg)


def test_vllm_refused_for_image_prompts(tmp_path):
    """Refused once the policy is known to read images (the sampling factory's table), not for text."""
    from padless.rl.sampling import check_sampling

    cfg = load_config(GRPOConfig, None, [*grpo_overrides(tmp_path), "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"does not hand images to vLLM yet.*torchvision"):
        run_grpo(cfg)
    check_sampling(cfg, vision=False)


@pytest.mark.slow
def test_vlm_sft_example_learns_to_read_the_pictures(tmp_path):
    """examples/vlm_sft_tiny.yaml as shipped (8 epochs of tiny:shapes_sft, about a minute on 2 CPU cores):
    eval loss falls and held-out accuracy ends far above chance.

    Measured: eval loss 0.20 -> 0.075 (8.3 at the random init; 0.156 -> 0.081 with one thread, whose
    round-off takes training elsewhere); accuracy on the 150 held-out questions
    colour 1.00 (chance 1/6), shape 0.60 (chance 1/3), all 0.81 (chance 0.25). The bounds sit well below
    the measured figures and well above chance: colour >= 0.6 (chance + 10 binomial standard deviations
    over its ~70 questions), shape >= 0.45 (chance + 2), all >= 0.55 (chance + 8). Before the data was
    made learnable (small shapes, count questions) every figure stayed at chance, which this test catches.
    """
    cfg = load_config(SFTConfig, EXAMPLE, [f"train.output_dir={tmp_path}", "train.progress_bar=false"])
    run_sft(cfg)
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(losses) >= 3 and losses[-1] < 0.7 * losses[0], losses  # measured 0.38x to 0.52x
    last = max(tmp_path.glob("predictions-step*.jsonl"), key=lambda p: int(p.stem.split("step")[1]))
    completions = [json.loads(line)["completion"] for line in last.read_text().splitlines()]
    scores = shapes.accuracy(completions)
    assert scores["colour"] >= 0.6 and scores["shape"] >= 0.45 and scores["all"] >= 0.55, scores


def test_rm_score_reads_image_rows(tmp_path, vlm_reward_model):
    """``padless rm score`` with a VLM reward model: rows with image paths are scored with their pictures
    (the same reply to two pictures of one size scores differently) and written back with a score."""
    by_size: dict[tuple[int, int], list[dict]] = {}
    for row in shapes.rows("shapes_rl"):  # two pictures of one size: the same tokens, other pixels
        by_size.setdefault(Image.open(io.BytesIO(row["images"][0]["bytes"])).size, []).append(row)
    rows = next(group for group in by_size.values() if len(group) >= 2)[:2]
    lines = []
    for i, row in enumerate(rows):
        (tmp_path / f"{i}.png").write_bytes(row["images"][0]["bytes"])
        prompt = [{"role": "user", "content": "<image>What colour is the shape?"}]
        reply = [{"role": "assistant", "content": "It is red."}]
        lines.append(json.dumps({"prompt": prompt, "response": reply, "images": [f"{i}.png"]}))
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    out = score_file(vlm_reward_model, str(tmp_path / "rows.jsonl"), str(tmp_path / "scored.jsonl"))
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["images"] for r in scored] == [["0.png"], ["1.png"]]
    assert abs(scored[0]["score"] - scored[1]["score"]) > 1e-6

    # the same rows with the pictures as raw bytes (a datasets Image column): JSON cannot hold them, so
    # JSON output stops naming the row; Parquet keeps the bytes and gives the same scores
    with_bytes = [
        {**json.loads(line), "images": [{"bytes": r["images"][0]["bytes"]}]}
        for line, r in zip(lines, rows, strict=True)
    ]
    datasets.Dataset.from_list(with_bytes).to_parquet(tmp_path / "rows.parquet")
    refusal = r"rows.parquet row 0 \(0-based\): cannot be written back as JSON .*--out scored.parquet"
    with pytest.raises(InputError, match=refusal):
        score_file(vlm_reward_model, str(tmp_path / "rows.parquet"), str(tmp_path / "bytes.jsonl"))
    assert not (tmp_path / "bytes.jsonl").exists()
    out = score_file(vlm_reward_model, str(tmp_path / "rows.parquet"), str(tmp_path / "scored.parquet"))
    back = datasets.Dataset.from_parquet(str(out)).to_list()
    assert [r["images"][0]["bytes"] for r in back] == [r["images"][0]["bytes"] for r in with_bytes]
    assert [r["score"] for r in back] == pytest.approx([r["score"] for r in scored], abs=1e-6)
