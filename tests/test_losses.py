"""Losses against hand computations on toy numbers."""

from __future__ import annotations

import math

import pytest
import torch

from padless.losses import (
    bradley_terry_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_value_loss,
    constant_groups,
    dpo_loss,
    gae,
    group_advantages,
    gspo_policy_loss,
    kl_k3,
    policy_loss_units,
    policy_token_weights,
    reinforce_pp_advantages,
    rloo_advantages,
    sft_loss,
    sft_token_weights,
    soft_overlong_penalty,
    whiten,
)


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# two pairs: summed completion log-probs of policy and reference, and completion lengths
PC, PR = torch.tensor([-10.0, -7.0]), torch.tensor([-12.0, -6.0])
RC, RR = torch.tensor([-11.0, -6.5]), torch.tensor([-11.5, -6.2])
LC, LR = torch.tensor([4.0, 2.0]), torch.tensor([5.0, 3.0])


def test_sft_loss_is_sum_over_global_count():
    logps = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert sft_loss(logps, mask, normaliser=6).item() == pytest.approx((1 + 3 + 4) / 6)


def test_sft_token_weights_give_the_sft_loss():
    """The form the LM head takes SFT's loss in before the forward pass (ModelEngine's logp_weights)."""
    logps = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    mask = torch.tensor([True, False, True, True])
    weights = sft_token_weights(mask, normaliser=6)
    assert weights.tolist() == pytest.approx([-1 / 6, 0.0, -1 / 6, -1 / 6])
    assert (weights * logps).sum().item() == pytest.approx(sft_loss(logps, mask, normaliser=6).item())


def test_dpo_sigmoid_matches_hand_computation():
    beta = 0.1
    losses, chosen_r, rejected_r = dpo_loss(PC, PR, RC, RR, LC, LR, beta=beta)
    # pair 1: (-10 - -11) - (-12 - -11.5) = 1.5
    # pair 2: (-7 - -6.5) - (-6 - -6.2) = -0.7
    expected = [-logsig(beta * 1.5), -logsig(beta * -0.7)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert chosen_r.tolist() == pytest.approx([0.1, -0.05], rel=1e-6)
    assert rejected_r.tolist() == pytest.approx([-0.05, 0.02], rel=1e-5)


def test_dpo_label_smoothing_hinge_ipo_simpo():
    beta, eps = 0.5, 0.2
    smooth, _, _ = dpo_loss(PC, PR, RC, RR, LC, LR, beta=beta, label_smoothing=eps)
    logits = [1.5, -0.7]
    assert smooth.tolist() == pytest.approx(
        [-(1 - eps) * logsig(beta * z) - eps * logsig(-beta * z) for z in logits], rel=1e-6
    )
    hinge, _, _ = dpo_loss(PC, PR, RC, RR, LC, LR, beta=beta, loss_type="hinge")
    assert hinge.tolist() == pytest.approx([max(0.0, 1 - beta * z) for z in logits], rel=1e-6)
    ipo, _, _ = dpo_loss(PC, PR, RC, RR, LC, LR, beta=beta, loss_type="ipo")
    # IPO on per-token averages: pair 1: (-10/4 - -11/4) - (-12/5 - -11.5/5) = 0.25 + 0.1 = 0.35
    ipo_logits = [(-10 / 4 + 11 / 4) - (-12 / 5 + 11.5 / 5), (-7 / 2 + 6.5 / 2) - (-6 / 3 + 6.2 / 3)]
    assert ipo.tolist() == pytest.approx([(z - 1 / (2 * beta)) ** 2 for z in ipo_logits], rel=1e-5)
    gamma = 0.5
    simpo, chosen_r, _ = dpo_loss(PC, PR, None, None, LC, LR, beta=beta, loss_type="simpo", simpo_gamma=gamma)
    simpo_logits = [-10 / 4 + 12 / 5, -7 / 2 + 6 / 3]
    assert simpo.tolist() == pytest.approx(
        [-logsig(beta * (z - gamma / beta)) for z in simpo_logits], rel=1e-5
    )
    assert chosen_r.tolist() == pytest.approx([beta * -10 / 4, beta * -7 / 2], rel=1e-6)


def test_dpo_needs_reference_unless_simpo():
    with pytest.raises(ValueError, match="reference"):
        dpo_loss(PC, PR, None, None, LC, LR, beta=0.1, loss_type="sigmoid")
    with pytest.raises(ValueError, match="unknown DPO loss_type"):
        dpo_loss(PC, PR, RC, RR, LC, LR, beta=0.1, loss_type="kto")


def test_bradley_terry_with_and_without_margin():
    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(
        [-logsig(1.0), -logsig(-1.0)], rel=1e-6
    )
    margin = torch.tensor([0.5, 1.0])
    assert bradley_terry_loss(chosen, rejected, margin).tolist() == pytest.approx(
        [-logsig(0.5), -logsig(-2.0)], rel=1e-6
    )


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0])  # three groups of two
    centred = group_advantages(rewards, group_size=2, scale=False)
    assert centred.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    scaled = group_advantages(rewards, group_size=2, scale=True, eps=0.0 + 1e-4)
    std = math.sqrt(0.5)  # unbiased std of (1, 0)
    assert scaled.tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.0, 0.0], rel=1e-6
    )


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(4)
    logps = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))  # ratios 1.5, 0.5, 1.1, 0.7
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0])
    loss, clipped = clipped_policy_loss(logps, old, adv, eps_low=0.2, eps_high=0.3)
    # -min(r A, clip(r) A): 1.5 -> clip 1.3 -> -1.3; 0.5 -> clip 0.8 -> -min(0.5, 0.8) = -0.5;
    # A<0: 1.1 -> -min(-2.2, -2.2) = 2.2; 0.7 -> clip 0.8 -> -min(-1.4, -1.6) = 1.6
    assert loss.tolist() == pytest.approx([-1.3, -0.5, 2.2, 1.6], rel=1e-5)
    assert clipped.tolist() == [True, False, False, True]


def test_rloo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])  # two groups of three
    # each minus the mean of the other two: 1 - 0, 0 - 0.5, 0 - 0.5; 2 - 3.5, 2 - 3.5, 5 - 2
    assert rloo_advantages(rewards, 3).tolist() == pytest.approx([1.0, -0.5, -0.5, -1.5, -1.5, 3.0])


def test_reinforce_pp_advantages_use_one_std_over_the_rollout():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0, 0.0, 2.0])  # three groups of two
    # group-centred: 0.5, -0.5, 0, 0, -1, 1 (mean 0); unbiased std over all six: sqrt(2.5 / 5)
    std = math.sqrt(0.5)
    expected = [x / (std + 1e-4) for x in (0.5, -0.5, 0.0, 0.0, -1.0, 1.0)]
    assert reinforce_pp_advantages(rewards, 2).tolist() == pytest.approx(expected, rel=1e-6)
    # unlike GRPO's per-group std, which makes the first and last groups' advantages equal (+-0.707)
    grouped = group_advantages(rewards, 2)
    assert grouped[0].item() == pytest.approx(grouped[5].item(), rel=1e-3)


def test_constant_groups_are_the_ones_with_all_rewards_equal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.5, 0.5])
    assert constant_groups(rewards, 2).tolist() == [True, False, True, True]


def test_soft_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 7, 9, 10])
    # 10 tokens at most, a zone of 4: free up to 6, then -(n - 6) / 4
    assert soft_overlong_penalty(lengths, 10, 4).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0])
    assert soft_overlong_penalty(lengths, 10, 4, factor=2.0).tolist() == pytest.approx([0, 0, -0.5, -1.5, -2])
    with pytest.raises(ValueError, match=r"buffer must be in \(0, 10\]"):
        soft_overlong_penalty(lengths, 10, 11)


def test_behaviour_weight_multiplies_the_loss_without_gradient():
    logps = torch.log(torch.tensor([1.5, 0.9])).requires_grad_(True)
    weight = torch.tensor([0.5, 2.0], requires_grad=True)
    loss, _ = clipped_policy_loss(logps, torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2, 0.2, weight)
    assert loss.tolist() == pytest.approx([-1.2 * 0.5, -0.9 * 2.0], rel=1e-6)
    loss.sum().backward()
    # the clipped token has no gradient; the other: d(-r A w)/d logp = -r w = -1.8
    assert logps.grad.tolist() == pytest.approx([0.0, -1.8], rel=1e-6) and weight.grad is None


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    lengths = torch.tensor([2, 1, 2])
    ratios = [1.2, 1.5, 0.5, 1.1, 0.9]
    logps = torch.log(torch.tensor(ratios)).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 2.0])
    loss, clipped = gspo_policy_loss(logps, torch.zeros(5), adv, lengths, eps_low=0.2, eps_high=0.2)
    # s = geometric mean of each sequence's ratios: sqrt(1.8) = 1.342 (clipped to 1.2), 0.5 (A < 0: the
    # clipped 0.8 gives the larger loss), sqrt(0.99) = 0.995 (inside the range)
    s3 = math.sqrt(0.99)
    assert loss.tolist() == pytest.approx([-1.2, -1.2, 0.8, -2 * s3, -2 * s3], rel=1e-6)
    assert clipped.tolist() == [True, True, True, False, False]
    loss.sum().backward()
    # sequence 3's two tokens each carry -A s; d/d logp_t of 2 (-A s) with s = exp(mean log r) is -A s
    assert logps.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, -2 * s3, -2 * s3], rel=1e-6)


def test_cispo_weights_tokens_by_the_capped_ratio_without_gradient_through_it():
    logps = torch.log(torch.tensor([1.5, 0.5, 7.0])).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 1.0])
    loss, capped = cispo_policy_loss(logps, torch.zeros(3), adv, max_ratio=5.0)
    # -min(r, 5) A log pi: -1.5 ln 1.5, -0.5 (-2) ln 0.5, -5 ln 7
    expected = [-1.5 * math.log(1.5), 1.0 * math.log(0.5), -5.0 * math.log(7.0)]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert capped.tolist() == [False, False, True]
    loss.sum().backward()
    assert logps.grad.tolist() == pytest.approx([-1.5, 1.0, -5.0], rel=1e-6)  # every token keeps a gradient


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_policy_loss_reduction_is_the_same_for_any_split(loss_type):
    """Three sequences' per-token losses (one sequence without targets), summed with the loss type's weights
    over a global normaliser: one micro-batch or two give the loss worked out by hand."""
    lengths = [3, 0, 2]
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0])
    max_new = 4
    by_hand = {
        "dapo": 16.0 / 5,  # token-mean over the step
        "cispo": 16.0 / 5,
        "grpo": (6.0 / 3 + 10.0 / 2) / 2,  # mean of each sequence's mean, over sequences with targets
        "dr_grpo": 16.0 / (3 * 4),  # every sequence times max_new_tokens
    }[loss_type]
    normaliser = policy_loss_units(lengths, loss_type, max_new)
    whole = (per_token * policy_token_weights(torch.tensor(lengths), loss_type)).sum() / normaliser
    assert whole.item() == pytest.approx(by_hand, rel=1e-6)
    split = sum(
        (part * policy_token_weights(torch.tensor(ls), loss_type)).sum() / normaliser
        for part, ls in ((per_token[:3], [3, 0]), (per_token[3:], [2]))
    )
    assert normaliser == policy_loss_units([3, 0], loss_type, max_new) + policy_loss_units([2], loss_type, 4)
    assert split.item() == pytest.approx(by_hand, rel=1e-6)


def test_kl_k3_by_hand():
    logps, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -1.5])
    d = [0.0, 1.0, -1.0]
    assert kl_k3(logps, ref).tolist() == pytest.approx([math.exp(x) - x - 1 for x in d], rel=1e-6)
    assert (kl_k3(logps, ref) >= 0).all()


def test_gae_by_hand():
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.7])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 + 0 - 0.7
    d1 = 0.0 + gamma * 0.7 - 0.6
    d0 = 0.0 + gamma * 0.6 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(rewards, values, gamma, lam)
    assert adv.tolist() == pytest.approx([a0, a1, a2], rel=1e-6)
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7], rel=1e-6)
    # gamma = lam = 1: advantages are reward-to-go minus value
    adv, _ = gae(rewards, values, 1.0, 1.0)
    assert adv.tolist() == pytest.approx([1 - 0.5, 1 - 0.6, 1 - 0.7], rel=1e-6)


def test_clipped_value_loss_and_whiten_by_hand():
    values, old, returns = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.0])
    # token 0: unclipped (1-2)^2 = 1, clipped v = 0.5+0.2 = 0.7 -> (0.7-2)^2 = 1.69 -> 0.5*1.69
    # token 1: unclipped 0, clipped v = 0.5-0.2 = 0.3 -> 0.09 -> 0.5*0.09
    assert clipped_value_loss(values, old, returns, 0.2).tolist() == pytest.approx([0.845, 0.045], rel=1e-5)
    w = whiten(torch.tensor([1.0, 2.0, 3.0]))
    assert w.tolist() == pytest.approx([-1.0, 0.0, 1.0], rel=1e-6)


def _gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """The textbook recursion, one step per token, in Python floats (fp64)."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (0.5, 0.0)])
def test_vectorised_gae_equals_the_loop_per_sequence(gamma, lam):
    """Sequences concatenated, crossing block boundaries (block 8, lengths up to 37), including a sequence
    of one target: every advantage equals the per-sequence recursion. Both are fp64 sums of the same terms
    in a different order, so they agree to ~1e-15 relative; 1e-12 of the largest advantage is allowed."""
    g = torch.Generator().manual_seed(0)
    lengths = [1, 37, 8, 9, 16, 3]
    rewards = torch.randn(sum(lengths), generator=g, dtype=torch.float64) * 3
    values = torch.randn(sum(lengths), generator=g, dtype=torch.float64) * 2
    adv, ret = gae(rewards, values, gamma, lam, lengths, block=8)
    want = [
        a
        for r, v in zip(rewards.split(lengths), values.split(lengths), strict=True)
        for a in _gae_loop(r.tolist(), v.tolist(), gamma, lam)
    ]
    scale = max(abs(a) for a in want)
    assert (adv - torch.tensor(want, dtype=torch.float64)).abs().max().item() <= 1e-12 * scale
    assert torch.equal(ret, adv + values)
    # one sequence without lengths, fp32 in -> fp32 out: computed in fp64 and rounded once, so within one
    # fp32 rounding (2^-24 relative) of the fp64 recursion on the same fp32 inputs
    r32, v32 = rewards[1:38].float(), values[1:38].float()
    one, _ = gae(r32, v32, gamma, lam)
    want32 = torch.tensor(_gae_loop(r32.tolist(), v32.tolist(), gamma, lam), dtype=torch.float64)
    assert one.dtype == torch.float32
    assert ((one.double() - want32).abs() <= 2**-24 * want32.abs() + 1e-300).all()
    with pytest.raises(ValueError, match="lengths sum to 73, but 74 rewards were given"):
        gae(rewards, values, gamma, lam, [*lengths[:-1], 2])
