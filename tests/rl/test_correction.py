"""Importance weights against hand-computed cases, and the mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from padless.rl.correction import importance_weights, mismatch_metrics

# two sequences: 2 tokens and 1 token; per-token log-ratios trainer - sampler = [ln 4, ln 0.5 | ln 0.1]
TRAINER = torch.tensor([math.log(0.4), math.log(0.2), math.log(0.01)])
SAMPLER = torch.tensor([math.log(0.1), math.log(0.4), math.log(0.1)])
LENGTHS = [2, 1]


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "weights", "changed"),
    [
        ("token_truncate", None, 3.0, [3.0, 0.5, 0.1], [True, False, False]),
        ("token_truncate", 0.2, 3.0, [3.0, 0.5, 0.2], [True, False, True]),
        ("token_mask", None, 3.0, [0.0, 0.5, 0.1], [True, False, False]),
        ("token_mask", 0.2, None, [4.0, 0.5, 0.0], [False, False, True]),
        # sequence ratios: 4 * 0.5 = 2 for both tokens of the first, 0.1 for the second
        ("sequence_truncate", 0.5, 3.0, [2.0, 2.0, 0.5], [False, False, True]),
        ("sequence_mask", None, 1.5, [0.0, 0.0, 0.1], [True, True, False]),
        ("sequence_mask", None, 3.0, [2.0, 2.0, 0.1], [False, False, False]),
    ],
)
def test_importance_weights_by_hand(mode, clip_min, clip_max, weights, changed):
    got, outside = importance_weights(TRAINER, SAMPLER, LENGTHS, mode, clip_min, clip_max)
    torch.testing.assert_close(got, torch.tensor(weights), rtol=1e-6, atol=1e-7)
    assert outside.tolist() == changed


def test_mismatch_metrics_by_hand():
    """Ratios 4, 0.5, 0.1: k3 = r - 1 - ln r per token, averaged; the largest |log-ratio| is ln 10."""
    weights, changed = importance_weights(TRAINER, SAMPLER, LENGTHS, "token_truncate", None, 3.0)
    m = mismatch_metrics(TRAINER, SAMPLER, weights, changed)
    k3 = [r - 1 - math.log(r) for r in (4.0, 0.5, 0.1)]
    assert m["mismatch/kl"] == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert m["mismatch/logp_diff_max"] == pytest.approx(math.log(10), rel=1e-6)
    assert m["mismatch/ratio_mean"] == pytest.approx(4.6 / 3, rel=1e-6)
    assert m["mismatch/ratio_max"] == pytest.approx(4.0, rel=1e-6)
    assert m["mismatch/ratio_min"] == pytest.approx(0.1, rel=1e-5)
    assert m["mismatch/is_weight_max"] == pytest.approx(3.0, rel=1e-6)
    assert m["mismatch/is_weight_mean"] == pytest.approx(3.6 / 3, rel=1e-6)
    assert m["mismatch/corrected_fraction"] == pytest.approx(1 / 3)
    same = mismatch_metrics(TRAINER, TRAINER.clone())
    assert (
        same["mismatch/kl"] == 0.0
        and same["mismatch/ratio_max"] == 1.0
        and "mismatch/is_weight_max" not in same
    )
