"""Distillation: a step's loss and gradient do not depend on how its examples are packed and split (every
example alone in its row, a few per row, all in one), on data completions and on the student's samples; a
teacher whose tokenizer differs is refused in one line. One process against two (DDP, FSDP2, ZeRO-2/3: losses,
gradient norms, weights, resume) is ``tests/trainers/test_strategies.py``'s ``distill`` kind."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from padless.cli import main
from padless.config.loading import load_config
from padless.config.schema import DistillConfig, DistillSettings, RolloutSettings, TrainSettings
from padless.data import load_rows, tokenize_sft
from padless.forward.engine import ModelEngine
from padless.forward.packing import pack
from padless.proof.load import load_model
from padless.rl.generate import HFEngine
from padless.rl.sample import Drawn, Sample
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch
from padless.tiny import build_tiny_model, tiny_tokenizer
from padless.trainers.distill import DistillRecipe, OnPolicyRecipe

CPU = torch.device("cpu")
TEACHER = "tiny-llama-arith"


@pytest.fixture(scope="module")
def examples(tokenizer):
    examples, _ = tokenize_sft(load_rows("tiny:sft_prompt_completion")[:6], tokenizer, max_length=1024)
    return examples


def step(recipe: DistillRecipe, model: torch.nn.Module) -> tuple[dict[str, float], list[torch.Tensor]]:
    """The first optimizer step of epoch 0, accumulated over its micro-batches as the loop runs them."""
    micros = [m for m in recipe.plan(0) if m.step == 0]
    normaliser = sum(m.units for m in micros)
    model.zero_grad(set_to_none=True)
    metrics = defaultdict(float)
    for micro in micros:
        loss, shares = recipe.loss(model, micro, normaliser)
        loss.backward()
        for k, v in shares.items():
            metrics[k] += v
    return dict(metrics), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "distill",
    [
        DistillSettings(teacher=TEACHER, mode="offline", nll_weight=0.3, temperature=1.5),
        DistillSettings(teacher=TEACHER, mode="gkd", lmbda=1.0, beta=0.5),
    ],
    ids=["offline", "gkd-on-student-samples"],
)
def test_a_step_is_the_same_however_it_is_packed_and_split(examples, tokenizer, distill):
    """Six examples as one optimizer step: all in one packed row, a few per row, one per row (each alone).
    The gkd case trains on the student's samples (lmbda 1): drawn per example, so each split samples the
    same completions, and the step normalises by their tokens. Loss and divergence within 1e-5 relative,
    gradients within 1e-4 of their largest entry (fp32 sums of the same terms in other orders)."""
    student = ModelEngine(load_model("tiny-llama", training=True))
    teacher = ModelEngine(load_model(TEACHER)).requires_grad_(False)
    rollout = RolloutSettings(max_new_tokens=8, temperature=1.0)
    longest = max(len(e) for e in examples)
    reference, rows = None, []
    for budget in (8192, 2 * longest, longest):
        cfg = TrainSettings(max_tokens_per_batch=budget, gradient_accumulation_steps=64, logits_memory_mb=1)
        recipe = DistillRecipe(examples, cfg, distill, rollout, tokenizer, CPU, teacher)
        got = step(recipe, student)
        rows.append(len(recipe.plan(0)))
        if reference is None:
            reference = got
            assert got[0]["divergence"] > 0.01 and got[0]["on_policy"] == (distill.mode == "gkd")
            continue
        for key, value in reference[0].items():
            assert got[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (budget, key)
        for g, r in zip(got[1], reference[1], strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-4 * r.abs().max().item())
    assert rows[0] == 1 and rows[-1] >= 4  # one packed row, then (nearly) one example per row


@pytest.mark.parametrize("loss", ["policy_gradient", "reverse_kl"])
def test_on_policy_step_is_the_same_however_it_is_split_and_nothing_against_itself(examples, tokenizer, loss):
    """Six samples (the data's prompt + completion as if sampled) with the teacher's log-probs of their
    tokens stored, as the reference pass stores them: the step's loss and gradient are the same in one packed
    row, three, or one per sample. Against a teacher that is the student itself the reverse KL is zero to
    round-off and so is the gradient (a planted bug that compared with another model would not be)."""
    student = ModelEngine(load_model("tiny-llama", training=True))
    cfg = load_config(DistillConfig, None, [f"distill.loss={loss}", "train.logits_memory_mb=1"])
    results = {}
    for name, teacher in (("arith", ModelEngine(load_model(TEACHER))), ("itself", student)):
        samples = []
        for e in examples:
            batch = pack([e])
            with torch.no_grad():
                ref = teacher(batch, logps=True, temperature=cfg.rollout.temperature).logps[
                    batch.loss_mask[0]
                ]
            n = e.loss_mask.index(True)
            sample = Sample.of(e, Drawn(0, n, len(e) - n, True, logps=ref.tolist()))
            sample.passes.ref_logps = ref.tolist()
            samples.append(sample)
        setup = RolloutSetup([], cfg, tokenizer, student, HFEngine(student, tokenizer, cfg.rollout), CPU)
        setup.ref_model = teacher
        recipe = OnPolicyRecipe(setup)
        normaliser = sum(s.num_targets for s in samples)
        splits = ([list(range(6))], [[0, 1], [2, 3], [4, 5]], [[i] for i in range(6)])
        for groups in splits if name == "arith" else splits[:1]:
            student.zero_grad(set_to_none=True)
            metrics = defaultdict(float)
            for g in groups:
                loss_value, shares = recipe.loss(
                    student, MicroBatch([samples[i] for i in g], 0, 0), normaliser
                )
                loss_value.backward()
                for k, v in shares.items():
                    metrics[k] += v
            got = dict(metrics), [p.grad.clone() for p in student.parameters() if p.grad is not None]
            if name not in results:
                results[name] = got
                continue
            want = results[name]
            for key, value in want[0].items():
                assert got[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, groups, key)
            for g, r in zip(got[1], want[1], strict=True):
                torch.testing.assert_close(g, r, rtol=0, atol=1e-4 * r.abs().max().item())
    arith, itself = results["arith"], results["itself"]
    assert arith[0]["distill/reverse_kl"] > 0.1 and abs(itself[0]["distill/reverse_kl"]) < 1e-4
    largest = max(g.abs().max().item() for g in arith[1])
    assert max(g.abs().max().item() for g in itself[1]) < 1e-4 * largest


def test_gkd_draws_its_on_policy_steps_from_the_seed(examples, tokenizer):
    """lmbda 0.5: about half the steps sample, the same ones for the same seed and epoch."""
    cfg = TrainSettings()
    recipe = DistillRecipe(
        examples, cfg, DistillSettings(mode="gkd", lmbda=0.5), RolloutSettings(), tokenizer, CPU, None
    )
    draws = [recipe.on_policy_step(0, s) for s in range(200)]
    assert 70 < sum(draws) < 130 and draws == [recipe.on_policy_step(0, s) for s in range(200)]
    assert draws != [recipe.on_policy_step(1, s) for s in range(200)]


@pytest.mark.parametrize(
    "change, named",
    [
        ("chat_template", "the chat template"),
        ("token", "the vocabulary (4096 vs 4097 tokens, 0 only in the student's, 1 only in the teacher's"),
    ],
)
def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, capsys, change, named):
    folder = tmp_path / "teacher"
    build_tiny_model("tiny-llama").save_pretrained(folder)
    theirs = tiny_tokenizer()
    if change == "chat_template":
        theirs.chat_template = theirs.chat_template.replace("<|im_start|>", "<|im_start|> ")
    else:
        theirs.add_tokens(["<extra>"])
    theirs.save_pretrained(folder)
    capsys.readouterr()
    code = main(
        [
            "distill",
            "distill.mode=offline",
            "data.train=tiny:sft_prompt_completion[:4]",
            f"distill.teacher={folder}",
            f"train.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"distill.teacher {folder}: its tokenizer differs from the student's" in err and named in err
    assert "fix:" in err
