"""Packed batches: the one layout every forward pass in padless runs on.

A packed batch concatenates sequences into a single row ``[1, T]`` with positions restarting at 0 for
each sequence and explicit boundaries (``cu_seqlens``) for varlen attention kernels. Padding exists
only in the converters below, used by ``generate()`` and by tests that prove padding changes nothing.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized sequence. ``loss_mask[i]`` says whether token ``i`` is a training target.

    Vision-language samples also carry their images' model inputs (``vision``: ``pixel_values``,
    ``image_grid_thw``, ...) and, for M-RoPE models, their own position rows ``rope_positions`` ``[3, L]``.
    """

    input_ids: list[int]
    loss_mask: list[bool] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    vision: dict[str, torch.Tensor] | None = None
    rope_positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def routes(self) -> torch.Tensor | None:
        """``[L, routers, k]``: the experts each token was routed to when it was sampled (a mixture of
        experts' routing replay, :mod:`padless.forward.routing`; -1: not recorded); None for data."""
        return None

    @property
    def num_targets(self) -> int:
        """Trained predictions: target tokens after the first (the first token is never predicted)."""
        return len(self.input_ids) - 1 if self.loss_mask is None else sum(self.loss_mask[1:])


@dataclass
class PackedBatch:
    """Sequences concatenated into one row.

    ``labels[0, t]`` is the token that position ``t`` predicts (the next token of the *same* sequence),
    or ``IGNORE_INDEX``; labels are shifted per sequence so no prediction ever crosses a boundary.
    """

    input_ids: torch.Tensor  # [1, T] long
    # [1, T] long, restarting at 0 per sequence; [4, 1, T] for M-RoPE: that text row on each sample's 3 rows
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # [N + 1] int32
    max_seqlen: int
    labels: torch.Tensor  # [1, T] long, IGNORE_INDEX where no loss
    meta: list[dict[str, Any]] = field(default_factory=list)
    vision: dict[str, torch.Tensor] | None = None  # every sample's image inputs, concatenated in order
    routes: torch.Tensor | None = None  # [T, routers, k] experts to route to (routing replay), -1: any

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def seq_lens(self) -> list[int]:
        return self.cu_seqlens.diff().tolist()

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[1, T]`` bool: positions whose prediction is trained."""
        return self.labels != IGNORE_INDEX

    @property
    def last_token_index(self) -> torch.Tensor:
        """``[N]`` index of each sequence's last token (where reward and value heads are read)."""
        return self.cu_seqlens[1:].long() - 1

    @property
    def sequence_index(self) -> torch.Tensor:
        """``[T]`` which sequence each token belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_sequences, device=self.cu_seqlens.device), self.cu_seqlens.diff().long()
        )

    def sequence_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums ``[N]`` of per-token values ``[T]``, accumulated and returned in fp64.

        DPO's loss is a small difference of large sums (log-probs of hundreds of tokens): fp32 round-off
        of each sum (~1e-7 relative, in an order that depends on the kernel) would dominate its gradient.
        """
        out = torch.zeros(self.num_sequences, dtype=torch.float64, device=values.device)
        return out.index_add(0, self.sequence_index, values.double())

    def attention_kwargs(self) -> dict[str, Any]:
        """Boundary kwargs that transformers forwards to varlen-capable attention functions."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            labels=self.labels.to(device),
            vision=None if self.vision is None else {k: v.to(device) for k, v in self.vision.items()},
            routes=None if self.routes is None else self.routes.to(device),
        )

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-token tensor ``[T, ...]`` (or ``[1, T, ...]``) into one tensor per sequence."""
        if values.dim() > 1 and values.shape[0] == 1 and values.shape[1] == self.num_tokens:
            values = values[0]
        return list(values.split(self.seq_lens))


def _shifted_labels(ex: Example) -> list[int]:
    """Targets per position: token ``i + 1`` of the same sequence if it is trained, else ignore."""
    ids, mask = ex.input_ids, ex.loss_mask
    if mask is None:
        mask = [True] * len(ids)
    return [ids[i + 1] if mask[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)] + [IGNORE_INDEX]


def _validate(ex: Example, index: int) -> None:
    if len(ex.input_ids) == 0:
        raise ValueError(f"example {index} is empty: every sequence needs at least one token")
    if ex.loss_mask is not None and len(ex.loss_mask) != len(ex.input_ids):
        raise ValueError(
            f"example {index}: loss_mask has {len(ex.loss_mask)} entries but input_ids has "
            f"{len(ex.input_ids)}; they must be the same length"
        )


def concat_vision(parts: Sequence[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor] | None:
    """Concatenate per-sample vision kwargs (``pixel_values``, ``image_grid_thw``, ...) in sample order."""
    present = [p for p in parts if p]
    if not present:
        return None
    keys = set(present[0])
    for p in present[1:]:
        if set(p) != keys:
            raise ValueError(f"samples carry different vision inputs: {sorted(keys)} vs {sorted(p)}")
    return {k: torch.cat([p[k] for p in present]) for k in sorted(keys)}


def pack(examples: Sequence[Example], device: torch.device | str = "cpu") -> PackedBatch:
    """Concatenate examples into one packed row."""
    if not examples:
        raise ValueError("cannot pack an empty list of examples")
    for i, ex in enumerate(examples):
        _validate(ex, i)
    lens = [len(ex) for ex in examples]
    input_ids = torch.tensor([t for ex in examples for t in ex.input_ids], dtype=torch.long, device=device)
    labels = torch.tensor(
        [t for ex in examples for t in _shifted_labels(ex)], dtype=torch.long, device=device
    )
    position_ids = torch.cat([torch.arange(n, device=device) for n in lens])[None]
    if any(ex.rope_positions is not None for ex in examples):
        position_ids = _mrope_rows(examples, position_ids)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lens, device=device).cumsum(0)
    vision = concat_vision([ex.vision for ex in examples])
    routes = _routes(examples)
    return PackedBatch(
        input_ids=input_ids[None],
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max(lens),
        labels=labels[None],
        meta=[dict(ex.meta) for ex in examples],
        vision=None if vision is None else {k: v.to(device) for k, v in vision.items()},
        routes=None if routes is None else routes.to(device),
    )


def _routes(examples: Sequence[Example]) -> torch.Tensor | None:
    """The examples' recorded routes concatenated ``[T, routers, k]`` (-1 for an example without), or None
    where none has any."""
    recorded = [ex.routes for ex in examples]
    shape = next((r.shape[1:] for r in recorded if r is not None), None)
    if shape is None:
        return None
    return torch.cat(
        [
            r if r is not None else torch.full((len(ex), *shape), -1, dtype=torch.long)
            for r, ex in zip(recorded, examples, strict=True)
        ]
    )


def _mrope_rows(examples: Sequence[Example], text_row: torch.Tensor) -> torch.Tensor:
    """``[4, 1, T]``: the restarting text row on top of each sample's own three M-RoPE rows."""
    for i, ex in enumerate(examples):
        if ex.rope_positions is None or tuple(ex.rope_positions.shape) != (3, len(ex)):
            got = None if ex.rope_positions is None else tuple(ex.rope_positions.shape)
            raise ValueError(
                f"example {i}: M-RoPE positions must be [3, {len(ex)}] on every example, got {got}; "
                "tokenize every example with the model's rope index (padless.forward.vision.RopeIndex)"
            )
    rows = torch.cat([ex.rope_positions for ex in examples], dim=1).to(text_row.device)
    return torch.cat([text_row, rows])[:, None]


Side = Literal["left", "right"]


@dataclass
class PaddedBatch:
    """The classic ``[N, L]`` layout, kept for ``generate()`` and for comparisons."""

    input_ids: torch.Tensor  # [N, L]
    attention_mask: torch.Tensor  # [N, L] long, 1 = real token
    position_ids: torch.Tensor  # [N, L], 0.. for real tokens, 0 (left) / continued (right) for pads
    labels: torch.Tensor  # [N, L], shifted like PackedBatch.labels, IGNORE_INDEX on pads
    side: Side
    vision: dict[str, torch.Tensor] | None = None  # as in PackedBatch; position_ids [4, N, L] for M-RoPE


def to_padded(batch: PackedBatch, side: Side, pad_token_id: int) -> PaddedBatch:
    """Scatter a packed row into an ``[N, max_len]`` padded tensor on ``side``."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    n, width, device = batch.num_sequences, batch.max_seqlen, batch.input_ids.device
    lens = batch.cu_seqlens.diff().long()
    col = torch.arange(width, device=device)[None]
    real = col < lens[:, None] if side == "right" else col >= (width - lens)[:, None]
    ids = torch.full((n, width), pad_token_id, dtype=torch.long, device=device)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long, device=device)
    ids[real] = batch.input_ids[0]
    labels[real] = batch.labels[0]
    mask = real.long()
    position_ids = (mask.cumsum(1) - 1).clamp(min=0) if side == "left" else col.expand(n, -1).clone()
    if batch.position_ids.dim() == 3:  # M-RoPE rows go with their tokens; pads get 0
        rows = batch.position_ids.new_zeros(3, n, width)
        rows[:, real] = batch.position_ids[1:, 0]
        position_ids = torch.cat([position_ids[None], rows])
    return PaddedBatch(ids, mask, position_ids, labels, side, batch.vision)


def unpad(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Gather per-token values ``[N, L, ...]`` of real tokens into packed order ``[T, ...]``."""
    return values[attention_mask.bool()]


def from_padded(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
) -> PackedBatch:
    """Pack a padded batch (either side, or mixed) using its attention mask.

    ``labels``, if given, are HF-style (unshifted, ``IGNORE_INDEX`` for no loss) and become the loss mask.
    """
    mask = attention_mask.bool()
    examples = []
    for i in range(input_ids.shape[0]):
        ids = input_ids[i][mask[i]].tolist()
        loss = None if labels is None else (labels[i][mask[i]] != IGNORE_INDEX).tolist()
        examples.append(Example(ids, loss))
    return pack(examples, device=input_ids.device)


# ----------------------------------------------------------------------------------------------------------
# Token-budget batching
# ----------------------------------------------------------------------------------------------------------


def budget_batches(
    lengths: Sequence[int], max_tokens: int, seed: int = 0, shuffle: bool = True
) -> list[list[int]]:
    """Group items into micro-batches of at most ``max_tokens`` tokens by best-fit decreasing.

    Each item (an example, or a group such as a chosen/rejected pair, given by its total length) lands in
    exactly one batch. Ties in length are broken by a seeded shuffle and the batch order is shuffled
    with the same seed, so the result is deterministic for a seed and varies across seeds (epochs).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens}")
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)  # a list, or a dataset's length column
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i, n = int(too_long[0]), int(lengths[too_long[0]])
        raise ValueError(
            f"item {i} has {n} tokens, more than max_tokens_per_batch={max_tokens} "
            f"({too_long.size} item(s) too long). Raise max_tokens_per_batch to at least "
            f"{int(lengths[too_long].max())}, or truncate with max_length."
        )
    rng = random.Random(seed)
    shuffled = list(range(lengths.size))
    rng.shuffle(shuffled)
    shuffled = np.array(shuffled, dtype=np.int64)
    order = shuffled[np.argsort(-lengths[shuffled], kind="stable")].tolist()  # longest first, ties shuffled
    sizes = lengths.tolist()
    # Open bins grouped by the room they have left: ``rooms`` holds the distinct rooms in ascending order
    # (at most max_tokens + 1 of them, however many bins), ``stacks[room]`` the bins with that room, the one
    # that got it last on top. The best fit is the top bin of the smallest room that holds the item.
    rooms: list[int] = []
    stacks: dict[int, list[int]] = {}
    bins: list[list[int]] = []
    for i in order:
        n = sizes[i]
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            bins.append([i])
            room, b = max_tokens - n, len(bins) - 1
        else:
            stack = stacks[rooms[k]]
            b = stack.pop()
            room = rooms[k] - n
            if not stack:
                del stacks[rooms.pop(k)]
            bins[b].append(i)
        if room in stacks:
            stacks[room].append(b)
        else:
            bisect.insort(rooms, room)
            stacks[room] = [b]
    if shuffle:
        rng.shuffle(bins)
    return bins


def fixed_count_batches(
    num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True
) -> list[list[int]]:
    """Plain batches of ``batch_size`` items (the padded comparison mode)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    order = list(range(num_items))
    if shuffle:
        random.Random(seed).shuffle(order)
    return [order[i : i + batch_size] for i in range(0, num_items, batch_size)]


def padding_share(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Fraction of a padded layout's tokens that would be padding for these batches."""
    real = sum(lengths[i] for b in batches for i in b)
    total = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return 1.0 - real / total if total else 0.0


def balance_ranks(tokens: Sequence[int], num_ranks: int, per_rank: int) -> list[list[int]]:
    """Deal one step's micro-batches (given by token counts) to data-parallel ranks.

    Longest first to the least-loaded rank that still has room for ``per_rank`` micro-batches, so
    ranks finish their step at about the same time. Returns micro-batch indices per rank (a rank may get
    fewer than ``per_rank`` on the last, partial step).
    """
    if len(tokens) > num_ranks * per_rank:
        raise ValueError(f"{len(tokens)} micro-batches do not fit {num_ranks} ranks x {per_rank}")
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min((r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += tokens[i]
    return ranks
