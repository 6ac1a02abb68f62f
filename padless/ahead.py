"""Off-policy by k steps (``rollout.max_staleness``): rollouts for the next steps are sampled in a
background thread while the current step trains.

The sampler is a copy of the policy: each job loads a snapshot of the weights taken on the training thread
when the job was queued, so training never races the sampler, and which weights a rollout was sampled from
is fixed by the schedule, not by timing: the rollout of epoch ``e + j`` (``1 <= j <= k``) is queued at the
start of epoch ``e`` from the weights trained on ``e`` rollouts, so it is ``j <= k`` updates (rollouts)
old when it trains. One worker runs the jobs in order; its samples are as reproducible as synchronous
ones (each prompt seeded on its own, see :class:`padless.rollout.SeededSampler`).
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from padless.rollout import Completion, HFEngine


class AheadSampler:
    """Queues sampling jobs on a copy of the policy; ``take(epoch)`` waits for that epoch's samples."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any):
        self.copy = copy.deepcopy(policy).eval()
        self.copy.requires_grad_(False)
        self.engine = HFEngine(self.copy, tokenizer, rollout)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="padless-sampler")
        self.jobs: dict[
            int, tuple[Future, int]
        ] = {}  # epoch -> (its completions and seconds, weights version)

    def queued(self, epoch: int) -> bool:
        return epoch in self.jobs

    def queue(
        self,
        epoch: int,
        version: int,
        policy: torch.nn.Module,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        vision: list[dict[str, torch.Tensor] | None] | None,
    ) -> None:
        """Sample epoch ``epoch``'s rollout from ``policy``'s weights as they are now (``version``)."""
        weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}

        def job() -> tuple[list[Completion], float]:
            started = time.perf_counter()
            self.copy.load_state_dict(weights)
            completions = self.engine.complete(prompts, n, seeds, vision=vision)
            return completions, time.perf_counter() - started

        self.jobs[epoch] = (self.pool.submit(job), version)

    def take(self, epoch: int) -> tuple[list[Completion], float, int]:
        """The queued rollout's completions, its sampling seconds and the weights version it used."""
        future, version = self.jobs.pop(epoch)
        completions, seconds = future.result()
        return completions, seconds, version
