"""Off-policy by k steps (``rollout.max_staleness``): a sampler wrapping another, which samples the next k
rollouts in a background thread while the current step trains, and owns their queue.

The background sampler runs on a copy of the policy, made before the policy is prepared (so it is whole even
where FSDP2 or ZeRO-3 shard the trained one); each job loads a snapshot of the weights taken on the training
thread when the job was queued (gathered whole on every rank when sharded), so training never races the
sampler, and which weights a rollout was sampled from is fixed by the schedule, not by timing: the rollout
of epoch ``e + j`` (``1 <= j <= k``) is queued at the start of epoch ``e`` from the weights trained on ``e``
rollouts, so it is ``j <= k`` updates (rollouts) old when it trains. One worker runs the jobs in order; its
samples are as reproducible as synchronous ones (each prompt seeded on its own, see
:class:`padless.rl.generate.SeededSampler`). Queued rollouts are part of a checkpoint (:meth:`state`), so a
resumed run trains on the very samples the uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from padless.forward.engine import inner_engine, unwrap
from padless.rl.sample import Sample
from padless.rl.sampler import Request, Sampler


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


class AheadSampler(Sampler):
    """Samples a rollout's request through ``live`` unless it was queued; queues the next ``k`` rollouts
    (``schedule(epoch)``: that rollout's request on this rank, None past the run's last) on ``behind``, a
    sampler of ``copy``, a whole copy of the policy."""

    def __init__(
        self,
        live: Sampler,
        behind: Sampler,
        copy: torch.nn.Module,
        k: int,
        schedule: Callable[[int], Request | None],
    ):
        super().__init__(live.engine, live.rollout, live.images)
        self.live, self.behind, self.copy, self.k, self.schedule = live, behind, copy, k, schedule
        self.policy: torch.nn.Module | None = None  # the prepared engine whose weights are snapshotted
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="padless-sampler")
        self.jobs: dict[int, tuple[Future, int]] = {}  # epoch -> (its samples, the weights version)

    def bind(self, policy: torch.nn.Module) -> None:
        self.live.bind(policy)
        self.policy = policy

    def sample(self, request: Request) -> list[Sample]:
        """Queue the rollouts of the next k epochs (not yet queued) from the weights as they are now, then
        take this epoch's (sampled now, on-policy, when none was queued: the first rollout, or the first
        after a resume); every sample says its staleness (updates between its weights and now) and the
        seconds waited or spent sampling. A request outside the schedule is sampled now."""
        epoch = request.epoch
        if epoch is None:
            return self.live.sample(request)
        assert self.policy is not None, "bind() hands the sampler the prepared policy first"
        model = unwrap(inner_engine(self.policy).model)
        for later in range(epoch + 1, epoch + self.k + 1):
            if later not in self.jobs and (queued := self.schedule(later)) is not None:
                self.queue(later, epoch, model, queued)
        started = time.perf_counter()
        if epoch in self.jobs:
            samples, version = self.take(epoch)
        else:
            samples, version = self.live.sample(request), epoch
        staleness = epoch - version
        if not 0 <= staleness <= self.k:
            raise RuntimeError(
                f"rollout {epoch} was sampled {staleness} updates ago, max_staleness is {self.k}"
            )
        seconds = time.perf_counter() - started
        for s in samples:
            s.drawn.staleness, s.drawn.sampling_s = staleness, seconds
        return samples

    def queue(self, epoch: int, version: int, policy: torch.nn.Module, request: Request) -> None:
        """Sample epoch ``epoch``'s rollout from ``policy``'s weights as they are now (``version``)."""
        weights = whole_weights(policy)

        def job() -> list[Sample]:
            self.copy.load_state_dict(weights)
            return self.behind.sample(request)

        self.jobs[epoch] = (self.pool.submit(job), version)

    def take(self, epoch: int) -> tuple[list[Sample], int]:
        """The queued rollout's samples (waited for) and the weights version they were sampled from."""
        future, version = self.jobs.pop(epoch)
        return future.result(), version

    def state(self) -> list[dict[str, Any]] | None:
        """Every queued rollout (waited for): sampled ahead, not trained."""
        if not self.jobs:
            return None
        return [
            {"epoch": epoch, "version": version, "samples": [s.state() for s in future.result()]}
            for epoch, (future, version) in sorted(self.jobs.items())
        ]

    def restore(self, state: list[dict[str, Any]], revive: Callable[[dict[str, Any]], Sample]) -> None:
        """Queue again, as done, the rollouts :meth:`state` gave (a resumed run trains on them)."""
        for rollout in state:
            future: Future = Future()
            future.set_result([revive(s) for s in rollout["samples"]])
            self.jobs[rollout["epoch"]] = (future, rollout["version"])
