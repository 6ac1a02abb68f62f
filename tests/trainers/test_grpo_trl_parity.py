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

With the switches set as TRL sets them (``grpo.kl_bias_correction``: the KL times pi / pi_old;
``grpo.token_normaliser: rollout``: dapo / cispo steps divided by the rollout's tokens over the steps it
gives) the same holds for a rollout cut into two mini-batches, step by step, against TRL with
``steps_per_generation=2``. Unscored completions (every reward function returned None) get TRL's advantages:
left out of their group's mean and std, advantage 0 (TRL's formula, with its ``nanstd``).

Not compared (TRL computes them inline while generating): the advantage estimators on scored rewards, and
the ``grpo`` mean over a batch holding a sequence with no targets (TRL counts it as a zero in the mean,
padless leaves it out: see ``policy_loss_units``); every sequence here has targets.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.rl.sample import Algorithm, Passes, Sample, Scored
from padless.rl.setup import RolloutSetup
from padless.run.loop import MicroBatch
from padless.trainers.grpo import GRPORecipe

LENGTHS = [5, 2, 7, 3]  # completion tokens per sequence (no two pairs of them of one total)
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


def trl_loss(
    x: dict[str, torch.Tensor],
    loss_type: str,
    level: str,
    eps_high: float,
    *,
    bias_correction: bool = False,
    rows: list[int] | None = None,
    steps: int = 1,
):
    """TRL's loss and d loss / d log-probs (padded) on ``rows`` of the batch (all by default), one step of
    ``steps`` per generation batch (``num_items_in_batch`` counts the whole batch)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    rows = list(range(len(LENGTHS))) if rows is None else rows
    logps = x["logps"].double().requires_grad_(True)
    mine = logps[rows]
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
        "args": SimpleNamespace(
            use_bias_correction_kl=bias_correction, delta=None, steps_per_generation=steps
        ),
        "model": SimpleNamespace(training=True),
        "accelerator": SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t),
        "_metrics": {"train": defaultdict(list)},
        "_get_per_token_logps_and_entropies": lambda *a, **k: (mine, torch.zeros_like(mine), None),
    }
    for key, value in fields.items():
        setattr(trainer, key, value)
    b = len(rows)
    batch = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, WIDTH, dtype=torch.long),
        "completion_mask": x["mask"][rows],
        "advantages": x["adv"].double()[rows],
        "old_per_token_logps": x["old"].double()[rows],
        "ref_per_token_logps": x["ref"].double()[rows],
        "num_items_in_batch": x["mask"].sum(),  # the whole generation batch
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


OBJECTIVES = [
    ("dapo", "token", ["grpo.epsilon_high=0.28"], 0.28),
    ("grpo", "token", ["grpo.loss_type=grpo"], 0.2),
    ("dr_grpo", "token", ["grpo.loss_type=dr_grpo"], 0.2),
    # TRL's cispo cap is its epsilon_high
    ("cispo", "token", ["grpo.loss_type=cispo", "grpo.cispo_max_ratio=1.3"], 1.3),
    ("grpo", "sequence", ["grpo.loss_type=grpo", "grpo.importance_sampling_level=sequence"], 0.2),
    ("dapo", "sequence", ["grpo.importance_sampling_level=sequence", "grpo.epsilon_high=0.28"], 0.28),
]


@pytest.mark.parametrize(("loss_type", "level", "overrides", "trl_eps_high"), OBJECTIVES)
def test_grpo_loss_and_gradient_equal_trl(loss_type, level, overrides, trl_eps_high):
    x = inputs()
    expected, expected_grad = trl_loss(x, loss_type, level, trl_eps_high)
    got, grad = padless_loss(x, overrides)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    # the inputs exercise the clip (or the cap), so the comparison covers both branches
    ratio = (x["logps"] - x["old"]).exp()[x["mask"].bool()]
    assert ((ratio > 1 + trl_eps_high) | (ratio < 0.8)).any() and (ratio.sub(1).abs() < 0.2).any()


def padless_steps(x: dict[str, torch.Tensor], overrides: list[str]):
    """The rollout's optimizer steps as the recipe plans them (shuffled, one step per mini-batch): each
    step's sequences, its loss summed over its micro-batches over the step's normaliser, and d loss / d
    log-probs (padded). A target's id names its sequence and position (``10 + 100 i + j``), so the fake
    forward gives each target its log-prob wherever the plan put its sequence."""
    cfg = load_config(GRPOConfig, None, [f"grpo.beta={BETA}", f"rollout.max_new_tokens={WIDTH}", *overrides])
    recipe = GRPORecipe(RolloutSetup([], cfg, None, None, None, torch.device("cpu")))
    samples = []
    for i, n in enumerate(LENGTHS):
        stored = Passes(old_logps=x["old"][i, :n].tolist(), ref_logps=x["ref"][i, :n].tolist())
        ids, targets = [7, 8, 9] + [10 + 100 * i + j for j in range(n)], [False] * 3 + [True] * n
        samples.append(Sample(ids, targets, passes=stored, algorithm=Algorithm([x["adv"][i].item()] * n)))
    micros = recipe.micro_batches(samples, epoch=0)
    steps = []
    for step in sorted({m.step for m in micros}):
        mine = [m for m in micros if m.step == step]
        leaf = x["logps"].double().requires_grad_(True)

        def model(batch, leaf=leaf, **_):
            spot = batch.loss_mask[0]  # a target's log-prob sits on the position before it
            code = batch.input_ids[0][spot.nonzero().squeeze(1) + 1] - 10
            logps = torch.zeros(spot.shape, dtype=torch.float64).masked_scatter(
                spot, leaf[code // 100, code % 100]
            )
            return SimpleNamespace(logps=logps, entropy=torch.zeros(spot.shape))

        normaliser = sum(m.units for m in mine)
        total = sum(recipe.loss(model, m, normaliser)[0] for m in mine)
        total.backward()
        rows = [(s.input_ids[3] - 10) // 100 for m in mine for s in m.data]
        steps.append((rows, total.item(), leaf.grad))
    return steps


@pytest.mark.parametrize(("loss_type", "level", "overrides", "trl_eps_high"), OBJECTIVES)
def test_with_trls_switches_each_step_of_two_mini_batches_equals_trl(
    loss_type, level, overrides, trl_eps_high
):
    """Every objective with the KL bias correction on (TRL's default), in two updates of the whole rollout
    (TRL's ``num_iterations=2``) and in two optimizer steps per rollout with (dapo, cispo) the rollout's token
    count over the steps: each step's loss and gradient equal TRL's with ``use_bias_correction_kl=True`` and
    ``steps_per_generation`` 1 / 2 on that step's rows. With the switch off (padless's default) the numbers
    differ."""
    x = inputs(1)
    switches = ["grpo.kl_bias_correction=true"]
    normaliser = ["grpo.token_normaliser=rollout"] if loss_type in ("dapo", "cispo") else []
    one = padless_steps(x, [*switches, "grpo.updates_per_rollout=2", *overrides])
    two = padless_steps(x, [*switches, "grpo.mini_batches_per_rollout=2", *normaliser, *overrides])
    assert len(one) == 2 and len(two) == 2 and sorted(r for rows, *_ in two for r in rows) == [0, 1, 2, 3]
    assert len({sum(LENGTHS[r] for r in rows) for rows, *_ in two}) == 2  # steps of different token counts
    for steps, plan in ((one, 1), (two, 2)):
        for rows, got, grad in steps:
            expected, expected_grad = trl_loss(
                x, loss_type, level, trl_eps_high, bias_correction=True, rows=rows, steps=plan
            )
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-14)
            torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    plain = padless_steps(x, ["grpo.updates_per_rollout=2", *overrides])
    assert plain[0][1] != pytest.approx(one[0][1], rel=1e-6)


def test_unscored_completions_get_trls_advantages():
    """A completion every reward function left unscored (None) leaves its group's mean and std and gets
    advantage 0, as TRL's formula computes it (its ``nanstd``, NaN for the unscored rows): here with one,
    two and all of a group unscored, and a group with a single scored sample."""
    from trl.trainer.utils import nanstd

    from padless.losses import constant_groups, group_advantages, reinforce_pp_advantages, rloo_advantages

    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 0.0, 0.5, nan, nan, 2.0, 1.0, nan, nan, nan, nan, nan, 3.0, nan, nan])
    groups = rewards.view(-1, 4)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(4)
    std = nanstd(groups, dim=1).repeat_interleave(4)
    expected = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    torch.testing.assert_close(group_advantages(rewards, 4), expected, rtol=1e-6, atol=1e-7)
    scored = torch.tensor([1.0, 0.0, 0.5])  # the first group without its unscored sample
    assert group_advantages(rewards, 4)[[0, 2, 3]].tolist() == pytest.approx(
        group_advantages(scored, 3).tolist()
    )
    assert rloo_advantages(rewards, 4)[:4].tolist() == pytest.approx([0.75, 0.0, -0.75, 0.0])
    unscored = rewards.isnan()
    for advantages in (group_advantages(rewards, 4, False), rloo_advantages(rewards, 4)):
        assert advantages[unscored].eq(0).all() and advantages.isfinite().all()
    assert reinforce_pp_advantages(rewards, 4)[unscored].eq(0).all()
    # a group with fewer than two scored samples has no signal: constant, as one with equal rewards
    assert constant_groups(rewards, 4).tolist() == [False, False, True, True]
    # the recipe reads "unscored" from the scorer's parts (every function None), whatever the total says
    recipe = GRPORecipe(
        RolloutSetup([], load_config(GRPOConfig, None, []), None, None, None, torch.device("cpu"))
    )
    samples = [
        Sample(
            [1, 2],
            [False, True],
            scored=Scored(0.0, {"f": None}) if r.isnan() else Scored(r.item(), {"f": r.item()}),
        )
        for r in rewards
    ]
    recipe.process(samples, epoch=0)
    assert [s.algorithm.advantages[0] for s in samples] == pytest.approx(
        expected.tolist(), rel=1e-6, abs=1e-7
    )


def test_soft_overlong_penalty_equals_trl():
    from trl.rewards import get_soft_overlong_punishment

    from padless.losses import soft_overlong_penalty

    lengths = list(range(0, 21))
    trl = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    expected = trl([[1] * n for n in lengths])
    got = soft_overlong_penalty(torch.tensor(lengths), max_length=20, buffer=6).tolist()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert min(got) == -1.0 and got[14] == 0.0 and got[15] < 0  # the zone is its last 6 tokens
