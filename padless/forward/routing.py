"""Routing replay for mixtures of experts: the experts each token was routed to when it was sampled,
recorded, and forced again in the trainer's passes over the same tokens.

A sampler and a trainer compute a token's router logits from hidden states that differ by round-off
(another kernel, another batch shape, a KV cache); where two experts score alike, the top-k flips and the
token runs through other experts: its log-prob moves by far more than round-off, and the policy gradient
follows a routing that did not produce the sample. Replaying the sampler's routes removes that part of
the mismatch.

Routers are the modules whose output transformers records as ``router_logits`` (the model's own
``_can_record_outputs``); each chooses its experts with one ``torch.topk`` over ``[tokens, experts]``. A
thread-local :class:`~torch.overrides.TorchFunctionMode` entered around each router's forward sees that
call: recording keeps its indices; replaying returns the recorded indices with the values the router's own
scores give them (``scores.gather(-1, indices)``), so the router's own code computes its weights
(normalised, soft-maxed) for the replayed experts exactly as it would for experts it chose. A router that
does not choose by exactly one top-k of that shape is refused (:func:`check_replayable`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from padless.errors import InputError

_TOPK = (torch.topk, torch.Tensor.topk)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of ``model`` in layer order: instances of the class the model records
    ``router_logits`` from. Empty for a model without routers."""
    classes: set[type] = set()
    for module in model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            classes.add(target)
    return [m for m in model.modules() if classes and isinstance(m, tuple(classes))]


class _Choices(TorchFunctionMode):
    """Inside one router's forward: record the indices of its top-k, or replace them by ``forced``
    (``[rows, k]``, -1 rows: as the router chooses)."""

    def __init__(self, forced: torch.Tensor | None = None):
        super().__init__()
        self.forced = forced
        self.seen: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK:
            return out
        scores, indices = args[0], out[1]
        self.seen.append(indices)
        if self.forced is None:
            return out
        forced = self.forced.to(indices.device)
        if forced.shape != indices.shape:
            raise ValueError(
                f"routing replay: recorded routes of shape {tuple(forced.shape)} for a router choosing "
                f"{tuple(indices.shape)}"
            )
        chosen = torch.where(forced[:, :1] >= 0, forced, indices)
        return torch.return_types.topk((scores.gather(-1, chosen), chosen))


class RoutingRecorder:
    """Per router (layer order), the indices of each call's top-k ``[rows, k]``, in call order."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]


@contextlib.contextmanager
def _around(router: torch.nn.Module, mode: _Choices, sink: list[torch.Tensor]) -> Iterator[None]:
    """Run ``router``'s forward inside ``mode`` for the block; each call's indices go to ``sink``."""
    original = router.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        mode.seen.clear()
        with mode:
            out = original(*args, **kwargs)
        if len(mode.seen) != 1:
            raise InputError(
                f"routing replay: {type(router).__name__} chose its experts with {len(mode.seen)} top-k "
                "selections in one call; padless replays routers that choose with exactly one; set "
                "rollout.routing_replay: false"
            )
        sink.append(mode.seen[0].detach())
        return out

    before = router.__dict__.get("forward")  # an instance-level forward already there (nested blocks)
    router.forward = forward
    try:
        yield
    finally:
        if before is None:
            del router.forward  # the class's forward again
        else:
            router.forward = before


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[RoutingRecorder]:
    """Record every router call of ``model`` inside the block."""
    recorder = RoutingRecorder(model)
    with contextlib.ExitStack() as stack:
        for router, calls in zip(recorder.routers, recorder.calls, strict=True):
            stack.enter_context(_around(router, _Choices(), calls))
        yield recorder


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """Inside the block, one forward of ``model`` over ``T`` tokens routes token ``t`` of layer ``l`` to
    ``routes[t, l]`` (``[T, layers, k]``; -1 rows route as the router chooses)."""
    found = routers(model)
    if routes.shape[1] != len(found):
        raise ValueError(f"routing replay: routes for {routes.shape[1]} routers, the model has {len(found)}")
    with contextlib.ExitStack() as stack:
        for layer, router in enumerate(found):
            stack.enter_context(_around(router, _Choices(routes[:, layer]), []))
        yield


def check_replayable(model: torch.nn.Module) -> None:
    """Refuse ``model`` for routing replay unless it has routers and replaying each router's own choice
    reproduces its outputs exactly (one top-k per call, on the scores the router's weights come from)."""
    found = routers(model)
    if not found:
        raise InputError(
            f"rollout.routing_replay is on but {type(model).__name__} has no expert routers (not a mixture "
            "of experts); set rollout.routing_replay: false"
        )
    for router in found:
        weight = next(router.parameters())
        x = torch.randn(5, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            calls: list[torch.Tensor] = []
            with _around(router, _Choices(), calls):
                own = router(x)
            with _around(router, _Choices(calls[0]), []):
                again = router(x)
        same = isinstance(own, tuple) and all(torch.equal(a, b) for a, b in zip(own, again, strict=True))
        if not same:
            raise InputError(
                f"routing replay: {type(router).__name__} does not reproduce its own outputs when its own "
                "choice of experts is replayed, so padless cannot replay it; set "
                "rollout.routing_replay: false"
            )
