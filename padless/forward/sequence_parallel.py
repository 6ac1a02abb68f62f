"""Sequence parallelism on packed rows (Ulysses): one packed row split over the N ranks of a group.

The world's W processes form W / N data-parallel groups of N consecutive ranks. Every rank of a group
holds the same packed row (the data is dealt by data-parallel rank: :class:`padless.forward.ranks.Topology`,
made at run start). The group is the engine's (its topology's), not the process's. Its labels
were shifted per sequence when it was packed (:func:`padless.forward.packing.pack`), before any split, so no
prediction crosses a sequence or a chunk. The row is padded at its end to a multiple of N with tokens
that form a sequence of their own and carry no label, then cut into N equal contiguous chunks; each rank
embeds and runs the MLPs of its chunk with the chunk's own position ids. At every attention call an
all-to-all trades the chunk's heads for the whole row's tokens (``[chunk, H]`` -> ``[T, H / N]``), the
varlen backend attends within each sequence of the FULL row's ``cu_seqlens`` (a sequence straddling a
chunk boundary is attended exactly), and a second all-to-all trades back (:meth:`SequenceParallel.attend`,
which the ``varlen`` backend calls for a layer that carries a group; it passes whole rows through
untouched). The attention layers find the group on themselves (:func:`attach`, done by the engine): it
travels with the model, so two models in one process can split over two groups.

Outputs are gathered so every rank of a group returns the whole row's per-token results, and computes
the same loss. The gather's backward hands each rank the gradient of its own chunk only (every rank
holds the identical upstream gradient), so each rank's parameter gradients are its chunk's share of the
whole, and the loop's DDP / FSDP2 reduction (a mean over the world, which the loop undoes by scaling
the loss by the world size) sums them: exactly the gradient one process gives on the whole row.
Parameters stay whole or data-parallel-sharded as without SP: nothing saved depends on N.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from accelerate import PartialState

from padless.forward import hybrid
from padless.forward.attention import SPLIT_ATTRIBUTE, attention_in_use, row_position_problem
from padless.forward.packing import IGNORE_INDEX, PackedBatch
from padless.forward.varlen import sequence_bounds


class SequenceParallelError(ValueError):
    """Sequence parallelism cannot run as asked."""


@dataclass(frozen=True)
class SequenceParallel:
    """This process's place in its sequence-parallel group: ``degree`` ranks, this one ``rank``."""

    degree: int
    rank: int
    group: Any  # a torch.distributed ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceParallel:
        """Itself: a copy of a model (a sampler's, a reference's) splits over the same process group."""
        return self

    # ------------------------------------------------------------------------------------------------
    # The row split
    # ------------------------------------------------------------------------------------------------

    def padded_length(self, tokens: int) -> int:
        return math.ceil(tokens / self.degree) * self.degree

    def pad(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` padded at its end to a multiple of ``degree``: the padding is a sequence of its own
        (position ids from 0, no label), so it is attended by nothing else and trains nothing."""
        extra = self.padded_length(batch.num_tokens) - batch.num_tokens
        if extra == 0:
            return batch
        ids = batch.input_ids
        positions = torch.arange(extra, device=ids.device).expand(*batch.position_ids.shape[:-1], extra)
        end = torch.tensor([batch.num_tokens + extra], dtype=batch.cu_seqlens.dtype, device=ids.device)
        return replace(
            batch,
            input_ids=torch.cat([ids, ids.new_zeros(1, extra)], 1),
            position_ids=torch.cat([batch.position_ids, positions.to(batch.position_ids)], -1),
            cu_seqlens=torch.cat([batch.cu_seqlens, end]),
            max_seqlen=max(batch.max_seqlen, extra),
            labels=torch.cat([batch.labels, batch.labels.new_full((1, extra), IGNORE_INDEX)], 1),
        )

    def chunk(self, padded: PackedBatch) -> PackedBatch:
        """This rank's contiguous chunk of a padded row: its tokens, position ids and labels, and the
        whole row's boundaries (which the attention reads after its all-to-all)."""
        start, end = chunk_bounds(padded.num_tokens, self.degree, self.rank)
        return replace(
            padded,
            input_ids=padded.input_ids[:, start:end],
            position_ids=padded.position_ids[..., start:end],
            labels=padded.labels[:, start:end],
        )

    # ------------------------------------------------------------------------------------------------
    # Collectives
    # ------------------------------------------------------------------------------------------------

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, chunk, D]`` -> ``[B, H / N, T, D]``: this rank's head group over the whole row."""
        b, h, c, d = x.shape
        parts = x.reshape(b, self.degree, h // self.degree, c, d).transpose(0, 1)
        got = _AllToAll.apply(parts, self.group)  # [N source chunks, B, H/N, c, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.degree, self.degree * c, d)

    def tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H / N, D]`` -> ``[B, chunk, H, D]``: every head group back on this rank's chunk."""
        b, t, hn, d = x.shape
        parts = x.reshape(b, self.degree, t // self.degree, hn, d).transpose(0, 1)
        got = _AllToAll.apply(parts, self.group)  # [N source head groups, B, c, H/N, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, t // self.degree, self.degree * hn, d)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The group's chunks ``[chunk, ...]`` concatenated in rank order; backward: this chunk's slice."""
        return _Gather.apply(x, self.group, self.degree, self.rank)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group; backward: the upstream gradient as it is (the same on every rank)."""
        return _Sum.apply(x, self.group)

    # ------------------------------------------------------------------------------------------------
    # The forward
    # ------------------------------------------------------------------------------------------------

    def run(self, forward: Callable[..., Any], batch: PackedBatch, logp_weights: torch.Tensor | None, **kw):
        """``forward(chunk_batch, logp_weights=..., **kw)`` (the engine's own packed forward, returning an
        ``EngineOutput`` of per-token ``[chunk]`` tensors) on this rank's chunk, its outputs gathered to
        the whole row ``[T]`` and ``weighted`` summed over the group."""
        if batch.vision:
            raise SequenceParallelError(
                "train.sequence_parallel > 1 runs text rows only: image tokens are merged into the "
                "embeddings of whichever chunk holds them; set train.sequence_parallel: 1 for vision models"
            )
        padded = self.pad(batch)
        local = self.chunk(padded)
        if logp_weights is not None:
            extra = padded.num_tokens - batch.num_tokens
            start, end = chunk_bounds(padded.num_tokens, self.degree, self.rank)
            logp_weights = torch.cat([logp_weights, logp_weights.new_zeros(extra)])[start:end]
        out = forward(local, logp_weights=logp_weights, **kw)
        whole = {
            name: None if value is None else self.gather(value)[: batch.num_tokens]
            for name, value in out._asdict().items()
            if name != "weighted"
        }
        weighted = None if out.weighted is None else self.sum(out.weighted)
        return out._replace(weighted=weighted, **whole)

    def attend(
        self,
        within: Callable[..., Any],
        module: torch.nn.Module,
        query,
        key,
        value,
        attention_mask,
        *args,
        **kwargs,
    ):
        """``within`` (the ``varlen`` backend's per-sequence attention) for a layer of this group: on a
        chunk of a row (queries fewer than the row's ``cu_seq_lens_q`` span), all-to-all, exact
        per-sequence attention over the whole row, all-to-all back; on anything else, ``within`` as it is."""
        cu = kwargs.get("cu_seq_lens_q")
        row = sequence_bounds(cu)[-1] if cu is not None else query.shape[2]
        if row == query.shape[2]:
            return within(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None or row != query.shape[2] * self.degree:
            raise SequenceParallelError(
                f"attention got {query.shape[2]} queries of a {row}-token row under sequence_parallel="
                f"{self.degree}: only packed rows split by the engine run split; report this with "
                "`padless doctor`"
            )
        if kwargs.get("s_aux") is not None:  # per-head sinks: this rank's head group
            kwargs["s_aux"] = kwargs["s_aux"].chunk(self.degree)[self.rank]
        q, k, v = (self.heads_to_tokens(t) for t in (query, key, value))
        out, weights = within(module, q, k, v, None, *args, **kwargs)
        return self.tokens_to_heads(out), weights


def chunk_bounds(tokens: int, degree: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s chunk of a row of ``tokens`` (a multiple of ``degree``)."""
    size = tokens // degree
    return rank * size, (rank + 1) * size


class _AllToAll(torch.autograd.Function):
    """Block ``j`` of dim 0 goes to rank ``j``; block ``j`` of the result came from rank ``j``. Its own
    inverse, so the backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, degree: int, rank: int) -> torch.Tensor:
        ctx.degree, ctx.rank = degree, rank
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.degree)[ctx.rank], None, None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# ----------------------------------------------------------------------------------------------------------
# Groups
# ----------------------------------------------------------------------------------------------------------

_GROUPS: dict[tuple[int, int], Any] = {}  # (world, degree) -> this process's group; made once per process


def attach(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Give the attention layers of ``model`` the group ``sp`` their chunks are split over: every module
    that holds a config (transformers picks a layer's attention function from its ``config``). transformers
    keeps one attention function per backend name in a process, and layers recomputed in backward (gradient
    checkpointing) call it outside any engine pass: the group is the layer's own. A model attends with the
    group of the last engine that split its rows; whole rows pass through any group."""
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            setattr(module, SPLIT_ATTRIBUTE, sp)


def start(degree: int) -> SequenceParallel:
    """This process's sequence-parallel group of ``degree`` > 1, for the engines that split their rows over
    it (part of the run's :class:`padless.forward.ranks.Topology`, put on their models' attention layers
    by :func:`attach`). Every process must call it (groups are collective)."""
    state = PartialState()
    world = state.num_processes
    if world % degree:
        raise SequenceParallelError(
            f"train.sequence_parallel={degree} does not divide the {world} process(es): launch a multiple of "
            f"{degree} processes (data parallel = processes / sequence_parallel)"
        )
    key = (world, degree)
    if key not in _GROUPS:
        for first in range(0, world, degree):  # every process creates every group, in the same order
            group = dist.new_group(list(range(first, first + degree)))
            if first <= state.process_index < first + degree:
                _GROUPS[key] = group
    return SequenceParallel(degree, state.process_index % degree, _GROUPS[key])


def check_model(model: torch.nn.Module, degree: int) -> None:
    """Refuse a model sequence parallelism of ``degree`` cannot split exactly (one line, with the fix)."""
    if degree == 1:
        return
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    config = inner.config.get_text_config()
    name = getattr(config, "model_type", type(inner).__name__)
    problem = hybrid.packing_problem(inner) or row_position_problem(inner, "varlen", sequence_parallel=True)
    if problem:
        raise SequenceParallelError(problem)
    stateful = hybrid.installed_layers(inner)
    if stateful:
        raise SequenceParallelError(
            f"train.sequence_parallel={degree}: {name} has layers that carry a state from token to token "
            f"({stateful[0]}, ...), which would have to pass from rank to rank where a sequence is split; "
            "set train.sequence_parallel: 1"
        )
    if inner.config is not config or getattr(inner.config, "vision_config", None) is not None:
        raise SequenceParallelError(
            f"train.sequence_parallel={degree}: {name} is a vision-language model, whose image tokens would "
            "be split from their images; set train.sequence_parallel: 1"
        )
    if attention_in_use(inner) != "varlen":
        raise SequenceParallelError(
            f"train.sequence_parallel={degree} runs on the varlen attention backend only, but {name} runs "
            f"{attention_in_use(inner)!r}; set model.attn_implementation: varlen"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % degree or kv_heads % degree:
        raise SequenceParallelError(
            f"train.sequence_parallel={degree} must divide {name}'s attention heads ({heads} query, "
            f"{kv_heads} key/value): each rank attends with 1/{degree} of them; pick a divisor of {kv_heads}"
        )
