"""The distillation head: a student's logits against a frozen teacher's, over the whole vocabulary, in chunks.

A divergence between two next-token distributions needs both models' logits at the same positions; held
whole, those are two ``[tokens x vocab]`` fp32 tensors (2.4 GB for 4,096 tokens of a 152k vocabulary).
Here they are made a chunk of rows at a time and dropped: each chunk's student logits come from the
student's LM head, its teacher logits from the teacher engine's head applied to the teacher's hidden
states of the same rows (inside the teacher engine's forward, so a sharded teacher's head is gathered for
it), and the divergence of the chunk is reduced to one number per row. With gradients, a chunk is
recomputed in backward (teacher logits included) instead of kept, as the LM head's chunked log-probs are.
A chunk holds ``train.logits_memory_mb`` of logits for both models together.

:class:`padless.forward.engine.ModelEngine` runs this inside the student engine's forward (``distill=``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from padless.forward.packing import IGNORE_INDEX


class Head(Protocol):
    """What the distillation head needs of the engine's LM head (:class:`padless.forward.engine.LogitsHead`):
    its module, its vocabulary and its finishing of raw logits (scale, temperature) into fp32 logits."""

    module: torch.nn.Module

    @property
    def vocab(self) -> int: ...

    def finish(self, raw: torch.Tensor) -> torch.Tensor: ...


Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (student, teacher logits [n, V]) -> [n]


@dataclass(frozen=True)
class Distillation:
    """The teacher side of a student's forward and how the loss weighs what it measures.

    ``teacher_hidden``: the teacher's last hidden states of the very same packed batch ``[T, H_t]``;
    ``teacher``: the (prepared) teacher engine, whose forward turns hidden rows into logits (``head_of=``);
    ``divergence``: per-row divergence of (student, teacher) logits, both divided by ``temperature``;
    ``weights`` ``[T]``: the loss weight of each position's divergence (0 off the targets);
    ``nll_weights`` ``[T]``: the weight of each position's NLL of its label (offline's mix), None for none;
    ``vocab``: compare the first ``vocab`` logits only (a head padded past the tokenizer's vocabulary)."""

    teacher_hidden: torch.Tensor
    teacher: torch.nn.Module
    divergence: Divergence
    weights: torch.Tensor
    nll_weights: torch.Tensor | None = None
    temperature: float = 1.0
    vocab: int | None = None


@dataclass
class DistillOutputs:
    """Per-position results ``[T]`` (zero off the targets, values only) and the weighted loss with its
    gradient: ``sum_t w_t divergence_t - sum_t n_t logp_t``."""

    weighted: torch.Tensor
    divergence: torch.Tensor
    logps: torch.Tensor


def chunk_rows(vocab: int, logits_memory_mb: int) -> int:
    """Rows per chunk: the fp32 logits of both models for that many rows fit the budget."""
    return max(1, logits_memory_mb * 2**20 // (2 * 4 * vocab))


def _chunk(
    head: Head,
    d: Distillation,
    h: torch.Tensor,
    th: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    wn: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    student = head.finish(head.module(h))
    with torch.no_grad():
        teacher = d.teacher(head_of=th)
    v = d.vocab or student.shape[-1]
    divergence = d.divergence(student[:, :v] / d.temperature, teacher[:, :v] / d.temperature)
    logps = student.log_softmax(-1).gather(-1, y[:, None])[:, 0]
    total = (w * divergence).sum()
    if wn is not None:
        total = total - (wn * logps).sum()
    return total, divergence.detach(), logps.detach()


def distill_from_hidden(
    head: Head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    d: Distillation,
    *,
    logits_memory_mb: int,
    chunk_tokens: int | None = None,
) -> DistillOutputs:
    """The divergence (and NLL) at every labelled position of a packed row, from the student's hidden
    states ``[T, H]`` and its LM ``head``, chunk by chunk (``chunk_tokens`` forces a chunk size)."""
    keep = labels != IGNORE_INDEX
    rows = torch.nonzero(keep)[:, 0]  # one host sync: how many positions carry a label

    def take(t: torch.Tensor | None) -> Any:
        return None if t is None else t[rows]

    h = take(hidden).to(head.dtype)
    th, y, w, wn = take(d.teacher_hidden), take(labels), take(d.weights).float(), take(d.nll_weights)
    wn = None if wn is None else wn.float()
    step = chunk_tokens or chunk_rows(d.vocab or head.vocab, logits_memory_mb)
    grad = torch.is_grad_enabled() and h.requires_grad
    pieces = []
    for s in range(0, max(h.shape[0], 1), step):
        part = (h[s : s + step], th[s : s + step], y[s : s + step], w[s : s + step])
        extra = None if wn is None else wn[s : s + step]
        if grad and step < h.shape[0]:
            pieces.append(checkpoint(_chunk, head, d, *part, extra, use_reentrant=False))
        else:
            pieces.append(_chunk(head, d, *part, extra))
    weighted = torch.stack([p[0] for p in pieces]).sum()

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(labels.shape).index_copy(0, rows, values)

    return DistillOutputs(
        weighted, scatter(torch.cat([p[1] for p in pieces])), scatter(torch.cat([p[2] for p in pieces]))
    )
