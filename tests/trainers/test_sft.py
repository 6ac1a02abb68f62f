"""SFT on the shared loop: loss and gradients independent of layout and micro-batch split, and the
recipe end to end (checkpoints, resume, eval generation, LoRA)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from padless.config.schema import DataSettings, ModelSettings, SFTConfig, TrainSettings
from padless.data import load_rows, tokenize_sft
from padless.forward.engine import ModelEngine
from padless.forward.packing import budget_batches
from padless.proof.load import load_model
from padless.run.loop import MicroBatch
from padless.trainers.sft import SFTRecipe, run_sft


@pytest.fixture(scope="module")
def examples(tokenizer):
    rows = load_rows("tiny:sft")[:14]
    examples, _ = tokenize_sft(rows, tokenizer, max_length=1024)
    return examples


def step_loss_and_grads(model, recipe, groups, examples) -> tuple[float, list[torch.Tensor]]:
    """One step's loss and gradients, accumulated over ``groups`` of example indices."""
    model.zero_grad(set_to_none=True)
    normaliser = sum(e.num_targets for e in examples)
    total = 0.0
    for group in groups:
        chosen = [examples[i] for i in group]
        loss, _ = recipe.loss(model, MicroBatch(chosen, 0, 0), normaliser)
        loss.backward()
        total += loss.item()
    return total, [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("backend", ["varlen", "sdpa", "eager"])
def test_loss_and_grads_same_for_any_layout_and_split(backend, examples, tokenizer):
    model = ModelEngine(load_model("tiny-llama", attn_implementation=backend, training=True))
    n = len(examples)
    reference = None
    splits = {
        "one micro-batch": [list(range(n))],
        "budget 700": budget_batches([len(e) for e in examples], 700, seed=3),
        "one per example": [[i] for i in range(n)],
    }
    for batching, side in [("tokens", "right"), ("padded", "left"), ("padded", "right")]:
        cfg = TrainSettings(batching=batching, padding_side=side)
        recipe = SFTRecipe(examples, cfg, tokenizer, torch.device("cpu"))
        for name, groups in splits.items():
            loss, grads = step_loss_and_grads(model, recipe, groups, examples)
            if reference is None:
                reference = (loss, grads)
                continue
            assert loss == pytest.approx(reference[0], rel=1e-5), (batching, side, name)
            for g, r in zip(grads, reference[1], strict=True):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=f"{batching}/{side}/{name}")
    # the normaliser is the token count: a mean per micro-batch would differ for uneven splits
    assert reference[0] > 0


def test_loss_is_token_mean_not_mean_of_sequence_means(examples, tokenizer):
    model = ModelEngine(load_model("tiny-llama", training=False))
    recipe = SFTRecipe(examples, TrainSettings(), tokenizer, torch.device("cpu"))
    with torch.no_grad():
        logps, mask = recipe.token_logps(model, examples)
        loss, _ = recipe.loss(model, MicroBatch(examples, 0, 0), sum(e.num_targets for e in examples))
    assert loss.item() == pytest.approx((-(logps * mask).sum() / mask.sum()).item(), rel=1e-6)
    assert mask.sum().item() == sum(e.num_targets for e in examples)


def tiny_config(tmp_path, eval_data: str | None = None, **train) -> SFTConfig:
    return SFTConfig(
        model=ModelSettings(name="tiny-llama"),
        data=DataSettings(train="tiny:sft", eval=eval_data, max_length=1024),
        train=TrainSettings(
            output_dir=str(tmp_path / "run"),
            learning_rate=3e-3,
            max_tokens_per_batch=2048,
            logging_steps=1,
            progress_bar=False,
            **train,
        ),
    )


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_and_writes_run_directory(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "tiny:sft_eval",
        max_steps=12,
        save_steps=6,
        save_total_limit=1,
        eval_generate=True,
        eval_max_new_tokens=8,
        eval_batch_size=4,
    )
    final = run_sft(cfg)
    run = tmp_path / "run"
    records = read_metrics(run)
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    assert "eval/loss" in final and final["eval/loss"] < losses[0]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-12"]  # save_total_limit=1
    ckpt = run / "checkpoint-12"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "tokenizer_config.json").exists()
    assert not list(ckpt.rglob("*.bin")) or all("model" not in p.name for p in ckpt.rglob("*.bin"))
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "config.yaml").exists() and list((run / "tensorboard").iterdir())
    predictions = [json.loads(line) for line in (run / "predictions-step12.jsonl").read_text().splitlines()]
    assert len(predictions) == len(load_rows("tiny:sft_eval"))
    # the checkpoint loads back as a plain Hugging Face model and reproduces the trained weights
    reloaded = load_model(str(ckpt))
    assert reloaded.config.num_hidden_layers == 2


def test_resume_continues_exactly(tmp_path):
    straight = run_sft(tiny_config(tmp_path / "a", max_steps=6, save_steps=3))
    first = tiny_config(tmp_path / "b", max_steps=6, save_steps=3)
    run_sft(first)
    b = tmp_path / "b" / "run"
    shutil.rmtree(b / "checkpoint-6")  # as if the run had died after its step-3 checkpoint
    (b / ".tmp-checkpoint-6").mkdir()  # and left a half-written checkpoint behind
    train = first.train.model_copy(update={"resume_from_checkpoint": "latest"})
    resumed = run_sft(first.model_copy(update={"train": train}))
    assert resumed["train/loss"] == pytest.approx(straight["train/loss"], rel=1e-6, abs=1e-7)
    steps = [r["step"] for r in read_metrics(b) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_lora_trains_adapter_only_and_checkpoints_it(tmp_path):
    from padless.config.schema import LoraSettings

    cfg = tiny_config(tmp_path, max_steps=2, save_steps=2)
    lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})
    metrics = run_sft(cfg)
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").exists()
    assert not (ckpt / "model.safetensors").exists()
    assert metrics["train/loss"] > 0
    train = cfg.train.model_copy(update={"max_steps": 3, "resume_from_checkpoint": str(ckpt)})
    resumed = run_sft(cfg.model_copy(update={"train": train}))
    assert resumed["train/loss"] > 0


@pytest.mark.parametrize("name", ["llama4_text", "qwen3-next", "lfm2", "falcon_h1"])
def test_chunked_attention_and_hybrids_train_packed(tmp_path, name):
    """Llama 4 text (chunked attention, temperature-tuned NoPE layers, MoE) and hybrids (Qwen3-Next's
    gated delta-nets, LFM2's short convolutions, Falcon-H1's Mamba-2 mixers) load through the probe on varlen
    and learn with SFT on packed rows far longer than Llama 4's chunks and temperature floor."""
    from padless.proof.zoo import build_zoo_model
    from padless.tiny import tiny_tokenizer

    path = tmp_path / name
    build_zoo_model(name, "eager").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    cfg = tiny_config(tmp_path, max_steps=6)
    train = cfg.train.model_copy(update={"learning_rate": 1e-2, "max_tokens_per_batch": 1024})
    cfg = cfg.model_copy(update={"model": ModelSettings(name=str(path)), "train": train})
    run_sft(cfg)
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run") if "train/loss" in r]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "attention varlen, kernel sdpa (proved by the load-time probe" in log


def test_tree_rows_only_where_asked_and_equal_to_flat(tmp_path, monkeypatch, caplog):
    """SFT examples share only a template header: ``tree_packing: auto`` runs them flat (and says so);
    ``on`` lays them out as tree rows, which must train the same numbers as flat rows."""
    from padless.forward import engine
    from padless.proof.probe import bound

    trees = []
    real = engine.tree_row
    monkeypatch.setattr(engine, "tree_row", lambda batch: trees.append(real(batch)) or trees[-1])
    runs = {}
    for mode in ("auto", "on"):
        caplog.clear()
        trees.clear()
        with caplog.at_level("INFO", logger="padless"):
            cfg = tiny_config(tmp_path / mode, max_steps=1, tree_packing=mode)
            run_sft(cfg.model_copy(update={"data": DataSettings(train="tiny:sft_eval", max_length=1024)}))
        runs[mode] = next(r for r in read_metrics(tmp_path / mode / "run") if "train/loss" in r)
        said = "tree packing off (auto): this task's examples share no prompt" in caplog.text
        assert said == (mode == "auto"), caplog.text
        shared = [t for t in trees if t is not None]
        assert bool(shared) == (mode == "on"), (mode, len(trees))
    assert shared[0].input_ids.shape[1] < shared[0].flat_tokens  # the tree computed fewer tokens
    loss = runs["auto"]["train/loss"]
    assert runs["on"]["train/loss"] == pytest.approx(loss, abs=bound(torch.float32, 30 * loss))
    assert runs["on"]["train/grad_norm"] == pytest.approx(runs["auto"]["train/grad_norm"], rel=1e-4)
