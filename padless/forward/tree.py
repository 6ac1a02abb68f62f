"""Tree packing: sequences that begin alike share the computation of their common prefix.

A GRPO group packs its prompt once per completion and a DPO pair packs its prompt twice; in a packed
row laid out as a tree the prompt is computed once. The row holds *segments*: a shared prefix, then its
branches, each continuing it. A segment's tokens take the positions that follow its parent's, and its
queries attend to its ancestors' keys and, causally, to its own; never to a sibling's. The key side of
each segment is its ancestors' tokens followed by its own (:attr:`TreeRow.keys`), so causal attention
aligned at the bottom right (as flash-attn's and PyTorch's varlen kernels align it when queries and keys
differ in length) is exactly the attention of each whole sequence, and a prefix's keys and values,
gathered by every branch, get the sum of every branch's gradient, as the copies would have.

What may be shared is decided by the tokens and labels themselves: position ``t`` of a sequence depends
on its tokens ``0..t`` only, so sequences whose first ``t + 1`` tokens agree agree there too, unless
position ``t`` is trained, for its label (the next token) is the sequence's own. A sequence's *shareable*
prefix is therefore its positions before the first one that predicts a target (a prompt, less its last
token, which predicts the first completion token and opens each branch). The tree is the radix tree of
the shareable prefixes of a batch (:func:`share_prefixes`): a node wherever two or more sequences agree,
each sequence's rest its own leaf. Nested sharing (a system prompt shared by every prompt of a batch,
each prompt shared by its group's completions) makes nested nodes.

The engine runs a packed batch as its tree and unfolds every per-token result back to the flat packed
order (:attr:`TreeRow.unfold`), so recipes see the same ``[T]`` tensors whichever layout ran.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from padless.errors import AttentionError
from padless.forward import hybrid
from padless.forward.attention import (
    ATTENTION_LAYER_TYPES,
    INDEXED_LAYER_TYPES,
    row_position_problem,
    text_config,
)
from padless.forward.packing import IGNORE_INDEX, Example, PackedBatch, budget_batches
from padless.forward.routers import defines_router_loss
from padless.forward.varlen import sequence_bounds

log = logging.getLogger(__name__)


@dataclass
class TreeRow:
    """A packed batch laid out as a prefix tree (see the module docstring).

    ``cu_seqlens`` splits the row into segments (the query side of attention); segment ``s`` attends to
    the row positions ``keys[cu_keys[s]:cu_keys[s + 1]]``: its ancestors' tokens, then its own. ``unfold``
    ``[T]`` maps each token of the flat batch to the row position that computes it.
    """

    input_ids: torch.Tensor  # [1, R]
    position_ids: torch.Tensor  # [1, R]: each token's position in its sequences
    labels: torch.Tensor  # [1, R]: IGNORE_INDEX on shared positions, which predict no target
    cu_seqlens: torch.Tensor  # [S + 1] int32: the segments
    max_seqlen: int
    keys: torch.Tensor  # [K] long: each segment's keys as row positions, segment after segment
    cu_keys: torch.Tensor  # [S + 1] int32
    max_keys: int
    parents: tuple[int, ...]  # each segment's parent segment, -1 for a root
    unfold: torch.Tensor  # [T] long
    flat_tokens: int  # T: tokens of the flat packed batch

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def attention_kwargs(self) -> dict[str, Any]:
        """The boundary kwargs for ``varlen``: query segments, key segments and which row positions the
        keys of each segment are (``tree_keys``)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_keys,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_keys,
            "tree_keys": self.keys,
        }

    def allowed(self) -> torch.Tensor:
        """``[R, R]`` bool: which row position each query sees (the mask of sdpa / eager / flex)."""
        device = self.input_ids.device
        count = len(self.parents)
        segment = torch.repeat_interleave(torch.arange(count, device=device), self.cu_seqlens.diff().long())
        owner = torch.repeat_interleave(torch.arange(count, device=device), self.cu_keys.diff().long())
        visible = torch.zeros(count, self.num_tokens, dtype=torch.bool, device=device)
        visible[owner, self.keys] = True
        position = self.position_ids[0]
        return visible[segment] & (position[None] <= position[:, None])

    def fold(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of the flat batch ``[T]`` summed onto the row positions computing them ``[R]``."""
        return values.new_zeros(self.num_tokens).index_add(0, self.unfold, values)

    def to(self, device: torch.device | str) -> TreeRow:
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids", "position_ids", "labels", "cu_seqlens", "keys", "cu_keys", "unfold")
        }
        return TreeRow(
            **moved,
            max_seqlen=self.max_seqlen,
            max_keys=self.max_keys,
            parents=self.parents,
            flat_tokens=self.flat_tokens,
        )


def shareable(labels: Sequence[int]) -> int:
    """How many leading positions of a sequence predict no target (labels as :class:`PackedBatch` shifts
    them): the positions other sequences may compute for it."""
    for t, label in enumerate(labels):
        if label != IGNORE_INDEX:
            return t
    return len(labels)


@dataclass
class _Segment:
    parent: int
    depth: int  # the position of its first token
    tokens: list[int]
    labels: list[int]
    members: list[int]  # the sequences it computes tokens of


def _common_length(arrays: list[np.ndarray]) -> int:
    """Length of the common prefix of ``arrays``."""
    first = arrays[0]
    common = min(len(a) for a in arrays)
    for a in arrays[1:]:
        differ = np.flatnonzero(a[:common] != first[:common])
        if differ.size:
            common = int(differ[0])
    return common


def _segments(seqs: list[np.ndarray], labels: list[list[int]]) -> list[_Segment] | None:
    """The radix tree of the sequences' shareable prefixes as segments in depth-first order (a node
    before its children, children in the order of their first sequence); ``None`` if nothing is shared."""
    limits = [shareable(ls) for ls in labels]
    segments: list[_Segment] = []
    shared = False

    def grow(members: list[int], depth: int, parent: int) -> None:
        nonlocal shared
        branches: dict[int, list[int]] = {}
        for i in members:
            key = int(seqs[i][depth]) if limits[i] > depth else -1 - i  # past its shareable part: alone
            branches.setdefault(key, []).append(i)
        for group in branches.values():
            if len(group) == 1:
                i = group[0]
                if depth < len(seqs[i]):  # a sequence wholly inside shared nodes has no leaf
                    segments.append(_Segment(parent, depth, seqs[i][depth:].tolist(), labels[i][depth:], [i]))
                continue
            shared = True
            length = _common_length([seqs[i][depth : limits[i]] for i in group])
            first = group[0]
            segments.append(
                _Segment(
                    parent,
                    depth,
                    seqs[first][depth : depth + length].tolist(),
                    [IGNORE_INDEX] * length,
                    group,
                )
            )
            grow(group, depth + length, len(segments) - 1)

    grow(list(range(len(seqs))), 0, -1)
    return segments if shared else None


def share_prefixes(batch: PackedBatch) -> TreeRow | None:
    """``batch`` laid out as the prefix tree of its sequences (see the module docstring); ``None`` when no
    two sequences share a position, or when the batch carries images (whose inputs belong to sequences,
    not to token positions a tree could share)."""
    if batch.vision:
        return None
    rows = batch.position_ids
    if rows.dim() == 3 and not bool((rows == rows[:1]).all()):  # M-RoPE rows other than the text row
        return None
    ids = batch.input_ids[0].cpu().numpy()
    flat_labels = batch.labels[0].tolist()
    bounds = batch.cu_seqlens.tolist()
    seqs = [ids[s:e] for s, e in pairwise(bounds)]
    labels = [flat_labels[s:e] for s, e in pairwise(bounds)]
    segments = _segments(seqs, labels)
    if segments is None:
        return None
    starts = np.cumsum([0, *(len(seg.tokens) for seg in segments)]).tolist()
    keys: list[int] = []
    cu_keys = [0]
    unfold = [0] * batch.num_tokens
    for s, seg in enumerate(segments):
        chain = [s]
        while segments[chain[-1]].parent >= 0:
            chain.append(segments[chain[-1]].parent)
        for a in reversed(chain):
            keys += range(starts[a], starts[a + 1])
        cu_keys.append(len(keys))
        for i in seg.members:
            at = bounds[i] + seg.depth
            unfold[at : at + len(seg.tokens)] = range(starts[s], starts[s + 1])
    device = batch.input_ids.device

    def tensor(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    lengths = [len(seg.tokens) for seg in segments]
    key_lengths = np.diff(cu_keys).tolist()
    return TreeRow(
        input_ids=tensor([t for seg in segments for t in seg.tokens])[None],
        position_ids=tensor([seg.depth + k for seg in segments for k in range(len(seg.tokens))])[None],
        labels=tensor([t for seg in segments for t in seg.labels])[None],
        cu_seqlens=tensor(starts, torch.int32),
        max_seqlen=max(lengths),
        keys=tensor(keys),
        cu_keys=tensor(cu_keys, torch.int32),
        max_keys=max(key_lengths),
        parents=tuple(seg.parent for seg in segments),
        unfold=tensor(unfold),
        flat_tokens=batch.num_tokens,
    )


# ----------------------------------------------------------------------------------------------------------
# Where a tree row runs, and how a model takes it
# ----------------------------------------------------------------------------------------------------------


# Backends that run a tree row: varlen through its key segments, the others through a mask of the row.
TREE_BACKENDS = ("varlen", "sdpa", "eager", "flex_attention")


def tree_problem(model: torch.nn.Module, backend: str, degree: int = 1) -> str | None:
    """Why ``model`` on ``backend`` cannot run tree rows exactly (``None``:
    it can), by category: the backend, layers that carry a state from token to token, attention that
    restarts per sequence in ways a branch does not share, images, and rows split over ranks."""
    config = text_config(model)
    types = list(getattr(config, "layer_types", None) or ())
    if backend not in TREE_BACKENDS:
        return f"{backend} takes no tree of key segments; use attn_implementation varlen"
    stateful = hybrid.installed_layers(model)
    if stateful or any(t not in ATTENTION_LAYER_TYPES for t in types):
        named = ", ".join(stateful[:2]) or ", ".join(
            sorted({t for t in types if t not in ATTENTION_LAYER_TYPES})
        )
        return (
            f"its layers that carry a state from token to token ({named}) would have to start each branch "
            "from the state at the end of its prefix, which padless does not do: each sequence runs whole"
        )
    if set(types) & INDEXED_LAYER_TYPES:
        return "its indexer chooses the keys of each query from a mask of whole sequences, not of segments"
    if "chunked_attention" in types:
        return "its chunked attention counts chunks from each sequence's start, across prefix and branch"
    if row_position_problem(model, "varlen") is not None or getattr(config, "attn_temperature_tuning", False):
        return "its NoPE layers scale queries by each token's place in the row"
    if (
        getattr(getattr(model, "module", model).config, "vision_config", None) is not None
    ):  # a vision-language model
        return (
            "a vision-language model's prompt images belong to each sequence, and a tree shares tokens only"
        )
    windowed = "sliding_attention" in types or (not types and getattr(config, "sliding_window", None))
    if backend != "varlen" and windowed:
        return f"transformers applies one custom mask to every layer on {backend}, sliding ones included"
    if defines_router_loss(model):
        return (
            "its objective's router load-balancing loss is a statistic of every token of every sequence, "
            "shared prefixes too, which a tree computes once"
        )
    if degree > 1:
        return "sequence parallelism splits a row by position, and a tree row is not split (yet)"
    return None


def resolve_tree(model: torch.nn.Module, backend: str, required: bool, degree: int = 1) -> bool:
    """Whether ``model`` runs tree rows where ``train.tree_packing`` asks for them (``off`` never asks:
    :meth:`padless.forward.engine.EngineSettings.runs_tree`): ``required`` (``on``) always, or a refusal
    with the reason (:func:`tree_problem`); else (``auto``) wherever it can, the log saying which layout
    runs and why."""
    problem = tree_problem(model, backend, degree)
    name = type(getattr(model, "module", model)).__name__
    if problem is None:
        _log_once(f"tree packing on for {name}: a prefix its packed sequences share is computed once")
        return True
    if required:
        raise AttentionError(
            f"train.tree_packing: on, but {name} on {backend!r} cannot run tree rows: {problem}; set "
            "train.tree_packing: auto (flat rows where a tree cannot run) or off"
        )
    _log_once(f"tree packing off for {name} (flat packed rows): {problem}")
    return False


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def tree_inputs(row: TreeRow, backend: str, dtype: torch.dtype) -> dict[str, Any]:
    """Forward kwargs of a tree row: its key segments for ``varlen``; for transformers' own kernels (the
    comparisons) a mask of the whole row (boolean for sdpa, additive for eager, a block mask for flex),
    which transformers uses as it is."""
    inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids}
    if backend == "varlen":
        sequence_bounds(row.cu_seqlens), sequence_bounds(row.cu_keys)  # to the host once, as model_inputs
        return {**inputs, **row.attention_kwargs()}
    allowed = row.allowed()
    if backend == "sdpa":
        mask: Any = allowed[None, None]
    elif backend == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    elif backend == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        size = row.num_tokens
        mask = create_block_mask(lambda b, h, q, k: allowed[q, k], 1, None, size, size, device=allowed.device)
    else:
        raise AttentionError(f"{backend} takes no tree of key segments; use attn_implementation varlen")
    return {**inputs, "attention_mask": mask}


# cu_seqlens tensor of a packed batch -> its tree row (None: nothing shared), built once per batch: the
# passes of one batch (old and reference log-probs, values, the update) share it.
_TREE_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def tree_row(batch: PackedBatch) -> TreeRow | None:
    """:func:`padless.forward.tree.share_prefixes` of ``batch``, remembered while its ``cu_seqlens`` lives."""
    if batch.cu_seqlens not in _TREE_ROWS:
        _TREE_ROWS[batch.cu_seqlens] = share_prefixes(batch)
    return _TREE_ROWS[batch.cu_seqlens]


# ----------------------------------------------------------------------------------------------------------
# Planning micro-batches by the tokens a tree computes
# ----------------------------------------------------------------------------------------------------------


def shareable_prefix(example: Example) -> list[int]:
    """The tokens of ``example`` that other sequences may compute for it (see :func:`shareable`)."""
    mask = example.loss_mask or [True] * len(example)
    first = next((t for t in range(1, len(mask)) if mask[t]), None)  # the first token ever predicted
    return list(example.input_ids) if first is None else example.input_ids[: first - 1]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def tree_batches(examples: Sequence[Example], max_tokens: int) -> list[list[int]]:
    """Micro-batches of ``examples`` whose tree rows hold at most ``max_tokens`` tokens each.

    Sequences are taken in the order of their shareable prefixes (those that share the most stand side by
    side) and added to a micro-batch while its tree fits: in that order a tree grows by each sequence's
    length less the prefix it shares with the one before it. A sequence longer than ``max_tokens`` stops
    with the fix, as :func:`padless.forward.packing.budget_batches` does.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens}")
    prefixes = [shareable_prefix(e) for e in examples]
    too_long = [i for i, e in enumerate(examples) if len(e) > max_tokens]
    if too_long:
        i = too_long[0]
        raise ValueError(
            f"item {i} has {len(examples[i])} tokens, more than max_tokens_per_batch={max_tokens} "
            f"({len(too_long)} item(s) too long). Raise max_tokens_per_batch to at least "
            f"{max(len(examples[j]) for j in too_long)}, or truncate with max_length."
        )
    order = sorted(range(len(examples)), key=lambda i: (prefixes[i], i))
    batches: list[list[int]] = []
    room, previous = 0, None
    for i in order:
        grows = len(examples[i]) - (_common(prefixes[i], prefixes[previous]) if previous is not None else 0)
        if not batches or grows > room:
            batches.append([])
            room, grows = max_tokens, len(examples[i])
        batches[-1].append(i)
        room -= grows
        previous = i
    return batches


def tree_tokens(examples: Sequence[Example]) -> int:
    """Tokens of the tree row of ``examples`` (as :func:`share_prefixes` lays them out)."""
    prefixes = sorted(shareable_prefix(e) for e in examples)
    lengths = sum(len(e) for e in examples)
    return lengths - sum(_common(a, b) for a, b in pairwise(prefixes))


def plan_batches(
    examples: Sequence[Example], max_tokens: int, tree: bool, seed: int = 0, shuffle: bool = False
) -> list[list[int]]:
    """Micro-batches of ``examples`` within ``max_tokens``: by the tokens of their tree rows where the
    engine runs trees (:func:`tree_batches`), else of their packed rows (best fit decreasing, see
    :func:`padless.forward.packing.budget_batches`, seeded and shuffled as asked)."""
    if tree:
        return tree_batches(examples, max_tokens)
    return budget_batches([len(e) for e in examples], max_tokens, seed=seed, shuffle=shuffle)
