"""The bound on per-token differences: the dtype's epsilon times the size of what is compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from padless.proof.tolerance import FORMULA, ROUNDING_FACTOR, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_scales_with_epsilon_and_magnitude(dtype):
    eps = torch.finfo(dtype).eps
    assert bound(dtype, 30.0) == pytest.approx(ROUNDING_FACTOR * eps * 30.0)
    assert bound(dtype, 60.0) == pytest.approx(2 * bound(dtype, 30.0))
    # Below 1 the bound stays at 16 eps: a difference is never known more precisely than eps itself.
    assert bound(dtype, 0.01) == bound(dtype, 1.0) == pytest.approx(ROUNDING_FACTOR * eps)


def test_bound_values_where_real_models_live():
    # |logit| 30: fp32 allows 5.7e-5 (contamination moves log-probs by 1e-2 and more) ...
    assert bound(torch.float32, 30.0) == pytest.approx(5.72e-5, rel=1e-2)
    # ... while bf16 round-off alone reaches a nat there: one bf16 ulp of 30 is 0.125.
    assert bound(torch.bfloat16, 30.0) == pytest.approx(3.75)


def test_docs_state_the_formula_in_use():
    page = (Path(__file__).resolve().parents[2] / "docs" / "proof.md").read_text()
    assert f"bound = {ROUNDING_FACTOR:g} · eps(dtype) · max(M, 1)" in page
    assert FORMULA.startswith(f"bound = {ROUNDING_FACTOR:g} * eps(dtype) * max(M, 1)")
