"""Off-policy by k steps (``rollout.max_staleness``): rollouts for the next steps are sampled in a
background thread while the current step trains.

The sampler is a copy of the policy, made before the policy is prepared (so it is whole even where FSDP2
or ZeRO-3 shard the trained one); each job loads a snapshot of the weights taken on the training thread
when the job was queued (gathered whole on every rank when sharded), so training never races the sampler,
and which weights a rollout was sampled from is fixed by the schedule, not by timing: the rollout of epoch
``e + j`` (``1 <= j <= k``) is queued at the start of epoch ``e`` from the weights trained on ``e``
rollouts, so it is ``j <= k`` updates (rollouts) old when it trains. One worker runs the jobs in order; its
samples are as reproducible as synchronous ones (each prompt seeded on its own, see
:class:`padless.rl.generate.SeededSampler`). Queued rollouts are part of a checkpoint (:meth:`pending`), so a
resumed run trains on the very samples the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from padless.rl.generate import Completion, HFEngine


def whole_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A whole copy of ``model``'s weights on this rank: FSDP2 shards (DTensors) and ZeRO-3 partitions are
    gathered, so every rank must call it at the same point (the RL loop does: it is in lockstep)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    gathered: Any = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 keeps only a partition on each rank
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        return {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }


class AheadSampler:
    """Queues sampling jobs on a copy of the policy; ``take(epoch)`` waits for that epoch's samples."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any):
        """``policy``: the unprepared model (whole on every rank)."""
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
        weights = whole_weights(policy)

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

    def pending(self) -> list[dict[str, Any]]:
        """Every queued rollout (waited for), as data a checkpoint stores: sampled ahead, not trained."""
        return [
            {"epoch": epoch, "version": version, "completions": [asdict(c) for c in future.result()[0]]}
            for epoch, (future, version) in sorted(self.jobs.items())
        ]

    def restore(self, pending: list[dict[str, Any]]) -> None:
        """Queue again, as done, the rollouts :meth:`pending` gave (a resumed run trains on them)."""
        for rollout in pending:
            future: Future = Future()
            future.set_result(([Completion(**c) for c in rollout["completions"]], 0.0))
            self.jobs[rollout["epoch"]] = (future, rollout["version"])
