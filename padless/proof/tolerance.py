"""How far two computations of the same numbers may differ from round-off alone.

Two kernels that attend over the same tokens sum in different orders, so their results differ by
round-off, and round-off is relative: a value of size ``M`` held in a dtype with machine epsilon
``eps`` is only known to about ``eps * M``. A log-prob ``z_y - logsumexp(z)`` inherits the error of the
logits ``z`` (twice at most: once through ``z_y``, once through the log-sum-exp), and the logits inherit
it from every layer below. So the bound on a per-token difference is

    bound = ROUNDING_FACTOR * eps(dtype) * max(M, 1)

with ``M`` the largest |logit| (or |log-prob|, or |hidden state|: whatever is compared) of the
reference. ``ROUNDING_FACTOR`` covers the two log-prob terms and the accumulation through the layers:
across the model zoo (``padless check --zoo``, logits scaled to |logit| 30, log-probs down to -45) the
largest difference between any two backends and layouts was 3.9 ``eps * M`` in fp32 and 3.0 in bf16
(CPU), and 9.5e-6 = 2.9 ``eps * M`` was measured on real models at |logit| 28; 16 leaves a margin of 4.
In fp32 that is still far below what one sequence attending to another moves (1e-2 and up). In bf16 it
is not: at |logit| 30 round-off alone moves log-probs by up to a nat, so only fp32 checks can see small
leaks. ``max(M, 1)``: a difference is never known more precisely than ``eps`` itself.
"""

from __future__ import annotations

import torch

ROUNDING_FACTOR = 16.0
FORMULA = f"bound = {ROUNDING_FACTOR:g} * eps(dtype) * max(M, 1), M = largest |logit| or |log-prob| compared"


def bound(dtype: torch.dtype, magnitude: float) -> float:
    """Largest |difference| allowed between two computations, in ``dtype``, of values up to ``magnitude``."""
    return ROUNDING_FACTOR * torch.finfo(dtype).eps * max(float(magnitude), 1.0)
