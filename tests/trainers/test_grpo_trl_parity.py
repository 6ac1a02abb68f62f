"""The GRPO recipe's loss against TRL 1.16's ``GRPOTrainer._compute_loss`` on identical inputs.

What is compared: per-token log-probs ``pi`` (a leaf tensor), stored old log-probs, reference log-probs and
per-sequence advantages, for sequences of different lengths. padless gets them as a rollout's samples
(packed, in their ``passes`` and ``algorithm`` fields), split over two micro-batches whose losses are
summed over the recipe's global normaliser, exactly as the training loop runs them; TRL gets the same
numbers right-padded with a completion mask, one batch, one process, no accumulation. TRL's loss math is
inline in ``_compute_loss``, so it runs on a ``GRPOTrainer`` made without ``__init__`` carrying only the
attributes that method reads, with the model's forward replaced by the given log-probs. Both the loss and
its gradient with respect to every log-prob must agree; inputs are fp32 values computed in fp64 on both
sides, so the only difference is summation order (1e-12).

Not compared (TRL computes them inline while generating): the advantage estimators, and the ``grpo`` mean
over a batch holding a sequence with no targets (TRL counts it as a zero in the mean, padless leaves it out:
see ``policy_loss_units``); every sequence here has targets.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.rl.sample import Algorithm, Passes, Sample
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch
from padless.trainers.grpo import GRPORecipe

LENGTHS = [5, 2, 7, 4]  # completion tokens per sequence
WIDTH = max(LENGTHS)  # TRL's padded width, and max_new_tokens (Dr.GRPO's constant)
BETA = 0.04


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded ``[B, WIDTH]`` log-probs near each other (ratios in about [0.6, 1.7]: some clipped), and
    advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1] * n + [0] * (WIDTH - n) for n in LENGTHS])
    logps = -torch.rand(len(LENGTHS), WIDTH, generator=g) * 3
    old = logps + (torch.rand(logps.shape, generator=g) - 0.5)
    ref = logps + (torch.rand(logps.shape, generator=g) - 0.5)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    return {"logps": logps * mask, "old": old * mask, "ref": ref * mask, "adv": advantages, "mask": mask}


def trl_loss(x: dict[str, torch.Tensor], loss_type: str, level: str, eps_high: float):
    """TRL's loss and d loss / d log-probs (padded)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    logps = x["logps"].double().requires_grad_(True)
    fields = {
        "loss_type": loss_type,
        "importance_sampling_level": level,
        "beta": BETA,
        "epsilon_low": 0.2,
        "epsilon_high": eps_high,
        "max_completion_length": WIDTH,
        "top_entropy_quantile": 1.0,
        "off_policy_mask_threshold": None,
        "use_vllm": False,
        "vllm_importance_sampling_correction": False,
        "_entropy_bonus_enabled": False,
        "aux_loss_enabled": False,
        "current_gradient_accumulation_steps": 1,
        "args": SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        "model": SimpleNamespace(training=True),
        "accelerator": SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t),
        "_metrics": {"train": defaultdict(list)},
        "_get_per_token_logps_and_entropies": lambda *a, **k: (logps, torch.zeros_like(logps), None),
    }
    for key, value in fields.items():
        setattr(trainer, key, value)
    b = len(LENGTHS)
    batch = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, WIDTH, dtype=torch.long),
        "completion_mask": x["mask"],
        "advantages": x["adv"].double(),
        "old_per_token_logps": x["old"].double(),
        "ref_per_token_logps": x["ref"].double(),
        "num_items_in_batch": x["mask"].sum(),
    }
    loss = trainer._compute_loss(None, batch)
    loss.backward()
    return loss.item(), logps.grad


def padless_loss(x: dict[str, torch.Tensor], overrides: list[str]):
    """The recipe's loss summed over two micro-batches of the rollout, and d loss / d log-probs (padded)."""
    cfg = load_config(
        GRPOConfig,
        None,
        [f"grpo.beta={BETA}", "grpo.updates_per_rollout=2", f"rollout.max_new_tokens={WIDTH}", *overrides],
    )
    recipe = GRPORecipe(RolloutSetup([], cfg, None, None, None, torch.device("cpu")))
    mask = x["mask"].bool()
    examples = []
    for i, n in enumerate(LENGTHS):
        prompt = [7, 8, 9]  # targets are the completion: the prompt's last token predicts the first
        stored = Passes(old_logps=x["old"][i, :n].tolist(), ref_logps=x["ref"][i, :n].tolist())
        advantage = Algorithm(advantages=[x["adv"][i].item()] * n)  # the sequence's, on each target
        ids, targets = prompt + list(range(10, 10 + n)), [False] * 3 + [True] * n
        examples.append(Sample(ids, targets, passes=stored, algorithm=advantage))
    leaf = x["logps"].double().requires_grad_(True)
    targets = leaf[mask]  # row-major: each sequence's targets in order, sequences in order

    def model(batch, **_):
        """The policy's forward: the next micro-batch's share of the given log-probs, at its targets."""
        spot = batch.loss_mask[0]
        first, used = model.offset, int(spot.sum())
        model.offset += used
        logps = torch.zeros(spot.shape, dtype=torch.float64)
        logps = logps.masked_scatter(spot, targets[first : first + used])
        return SimpleNamespace(logps=logps, entropy=torch.zeros(spot.shape))

    model.offset = 0
    parts = [examples[:2], examples[2:]]
    normaliser = sum(recipe.units(p) for p in parts)
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        micro = MicroBatch(part, recipe.units(part), 0)
        loss, _ = recipe.loss(model, micro, normaliser)
        total = total + loss
    total.backward()
    return total.item(), leaf.grad


@pytest.mark.parametrize(
    ("loss_type", "level", "overrides", "trl_eps_high"),
    [
        ("dapo", "token", ["grpo.epsilon_high=0.28"], 0.28),
        ("grpo", "token", ["grpo.loss_type=grpo"], 0.2),
        ("dr_grpo", "token", ["grpo.loss_type=dr_grpo"], 0.2),
        # TRL's cispo cap is its epsilon_high
        ("cispo", "token", ["grpo.loss_type=cispo", "grpo.cispo_max_ratio=1.3"], 1.3),
        ("grpo", "sequence", ["grpo.loss_type=grpo", "grpo.importance_sampling_level=sequence"], 0.2),
        ("dapo", "sequence", ["grpo.importance_sampling_level=sequence", "grpo.epsilon_high=0.28"], 0.28),
    ],
)
def test_grpo_loss_and_gradient_equal_trl(loss_type, level, overrides, trl_eps_high):
    x = inputs()
    expected, expected_grad = trl_loss(x, loss_type, level, trl_eps_high)
    got, grad = padless_loss(x, overrides)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    # the inputs exercise the clip (or the cap), so the comparison covers both branches
    ratio = (x["logps"] - x["old"]).exp()[x["mask"].bool()]
    assert ((ratio > 1 + trl_eps_high) | (ratio < 0.8)).any() and (ratio.sub(1).abs() < 0.2).any()


def test_soft_overlong_penalty_equals_trl():
    from trl.rewards import get_soft_overlong_punishment

    from padless.losses import soft_overlong_penalty

    lengths = list(range(0, 21))
    trl = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    expected = trl([[1] * n for n in lengths])
    got = soft_overlong_penalty(torch.tensor(lengths), max_length=20, buffer=6).tolist()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert min(got) == -1.0 and got[14] == 0.0 and got[15] < 0  # the zone is its last 6 tokens
