"""The divergence guard: a non-finite loss, gradient norm or weight never trains on, and is never saved.

Each micro-batch's loss is watched as it is computed; before the optimizer steps, the ranks agree (one
all-reduce of a flag) on whether any loss or the gradient norm was NaN or infinite. Then, by
``train.on_nonfinite``:

- ``stop`` (default): raise :class:`~padless.errors.DivergenceError` naming the step, the micro-batch
  and the value, before the optimizer applies the gradients, so the last checkpoint stays the last good
  state;
- ``skip``: drop the step's gradients (the optimizer does not step; the schedule and the data move on,
  so steps keep their meaning), log a warning, and count it in ``train/nonfinite_skipped``.

Before a checkpoint is written, the weights themselves are checked, so a NaN checkpoint never exists.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from padless.errors import DivergenceError, InputError, divergence_fix
from padless.run.strategy import expected_strategy

log = logging.getLogger(__name__)


class DivergenceGuard:
    def __init__(self, policy: str, accelerator: Any, float16: bool = False):
        """``float16``: the trained weights are float16 (their overflow is the first advice)."""
        self.policy, self.acc = policy, accelerator
        self.float16 = float16
        # DeepSpeed's engine applies the gradients inside backward: a step cannot be dropped afterwards
        self.steps_in_backward = expected_strategy(accelerator).startswith("zero")
        if policy == "skip" and self.steps_in_backward:
            raise InputError(
                "train.on_nonfinite=skip cannot drop a step under DeepSpeed (its engine applies the "
                "gradients inside backward, before padless sees the norm); fix: use on_nonfinite=stop, or "
                "the fsdp2 / ddp strategy"
            )
        self.step = 0  # the optimizer step being computed, 1-based; set by the loop
        self.skipped = 0
        self._bad: str | None = None  # this rank's first non-finite loss of the step

    def watch(self, loss: torch.Tensor, micro: int, micros: int) -> None:
        """Remember the first micro-batch of the step whose loss is not finite."""
        if self._bad is None and not torch.isfinite(loss.detach()).all():
            rank = f" on rank {self.acc.process_index}" if self.acc.num_processes > 1 else ""
            value = loss.detach().float().sum().item()
            self._bad = f"loss {value} in micro-batch {micro + 1} of {micros}{rank}"

    def allow_step(self, grad_norm: float | None) -> bool:
        """Whether the optimizer may apply this step's gradients; the same answer on every rank."""
        local = self._bad
        self._bad = None
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)
        flag = torch.tensor([float(local is not None or bad_norm)], device=self.acc.device)
        if self.acc.num_processes > 1:
            flag = self.acc.reduce(flag, "sum")
        if not flag.item():
            return True
        what = local or (f"gradient norm {grad_norm}" if bad_norm else "a non-finite loss on another rank")
        if self.policy == "stop":
            when = "after DeepSpeed applied it" if self.steps_in_backward else "before applying it"
            raise DivergenceError(
                f"training diverged at step {self.step}: {what}; the run stopped {when} (no checkpoint "
                f"holds this state). Fix: {divergence_fix(self.float16)}"
            )
        self.skipped += 1
        log.warning("step %d skipped: %s (%d skipped so far)", self.step, what, self.skipped)
        return False

    def metrics(self) -> dict[str, float]:
        return {"train/nonfinite_skipped": float(self.skipped)} if self.skipped else {}

    def check_weights(self, model: torch.nn.Module) -> None:
        """Refuse to save weights that are not finite (an update can overflow without a NaN loss first)."""
        bad = next((n for n, p in model.named_parameters() if not _finite(p)), None)
        flag = torch.tensor([float(bad is not None)], device=self.acc.device)
        if self.acc.num_processes > 1:
            flag = self.acc.reduce(flag, "sum")
        if flag.item():
            raise DivergenceError(
                f"training diverged by step {self.step}: weight {bad or 'on another rank'} is not finite, so "
                f"no checkpoint was written. Fix: {divergence_fix(self.float16)}"
            )


def _finite(param: torch.Tensor) -> bool:
    """This rank's part of a parameter (an FSDP2 shard; ZeRO-3 keeps its data in the optimizer)."""
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return not local.is_floating_point() or bool(torch.isfinite(local).all())
