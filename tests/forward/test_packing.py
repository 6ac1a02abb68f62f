"""Packed batches, packed <-> padded converters, and token-budget batching (padless.forward.packing)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from padless.forward.packing import (
    IGNORE_INDEX,
    Example,
    PackedBatch,
    balance_ranks,
    budget_batches,
    fixed_count_batches,
    from_padded,
    pack,
    padding_share,
    to_padded,
    unpad,
)
from padless.tiny import data_path

PAD = 0


def _examples() -> list[Example]:
    """Three sequences of different lengths; the middle one trains only on its last three tokens."""
    return [
        Example([11, 12, 13, 14], meta={"id": "a"}),
        Example([21, 22, 23, 24, 25, 26, 27], loss_mask=[False] * 4 + [True] * 3, meta={"id": "b"}),
        Example([31, 32], meta={"id": "c"}),
    ]


# ----------------------------------------------------------------------------------------------------------
# pack
# ----------------------------------------------------------------------------------------------------------


def test_pack_layout():
    batch = pack(_examples())
    assert batch.input_ids.shape == (1, 13)
    assert batch.input_ids.dtype == torch.long
    assert batch.input_ids[0].tolist() == [11, 12, 13, 14, 21, 22, 23, 24, 25, 26, 27, 31, 32]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 4, 11, 13]
    assert batch.max_seqlen == 7
    assert batch.num_sequences == 3
    assert batch.num_tokens == 13
    assert batch.seq_lens == [4, 7, 2]
    assert batch.last_token_index.tolist() == [3, 10, 12]
    assert batch.sequence_index.tolist() == [0] * 4 + [1] * 7 + [2] * 2
    assert [m["id"] for m in batch.meta] == ["a", "b", "c"]


def test_pack_labels_are_shifted_within_each_sequence():
    batch = pack(_examples())
    x = IGNORE_INDEX
    assert batch.labels[0].tolist() == [
        *(12, 13, 14, x),  # a: every next token, nothing after its last token
        *(x, x, x, 25, 26, 27, x),  # b: only the targets whose loss_mask is True (25, 26, 27)
        *(32, x),  # c
    ]
    assert batch.loss_mask[0].tolist() == (batch.labels[0] != IGNORE_INDEX).tolist()


def test_pack_labels_never_cross_a_boundary():
    rng = random.Random(0)
    examples = [Example([rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]) for _ in range(12)]
    batch = pack(examples)
    labels = batch.labels[0]
    ids = batch.input_ids[0]
    # The last token of every sequence predicts nothing (its next token belongs to another sequence).
    assert (labels[batch.last_token_index] == IGNORE_INDEX).all()
    # Every other label is the next token of the same sequence.
    seq = batch.sequence_index
    for t in range(batch.num_tokens - 1):
        if labels[t] != IGNORE_INDEX:
            assert seq[t] == seq[t + 1]
            assert labels[t] == ids[t + 1]
    assert int((labels != IGNORE_INDEX).sum()) == sum(len(e) - 1 for e in examples)


def test_pack_single_token_sequence():
    batch = pack([Example([5]), Example([6, 7])])
    assert batch.labels[0].tolist() == [IGNORE_INDEX, 7, IGNORE_INDEX]
    assert batch.position_ids[0].tolist() == [0, 0, 1]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="empty list"):
        pack([])
    with pytest.raises(ValueError, match=r"example 1 is empty"):
        pack([Example([1, 2]), Example([])])
    with pytest.raises(ValueError, match=r"example 0: loss_mask has 2 entries but input_ids has 3"):
        pack([Example([1, 2, 3], loss_mask=[True, False])])


def test_split_and_attention_kwargs():
    batch = pack(_examples())
    values = torch.arange(13.0)
    parts = batch.split(values)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12]]
    parts = batch.split(values[None, :, None])  # [1, T, 1] works as well
    assert [p.shape for p in parts] == [(4, 1), (7, 1), (2, 1)]
    kwargs = batch.attention_kwargs()
    assert kwargs["cu_seq_lens_q"] is batch.cu_seqlens
    assert kwargs["cu_seq_lens_k"] is batch.cu_seqlens
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 7


# ----------------------------------------------------------------------------------------------------------
# packed <-> padded
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
def test_to_padded_layout(side):
    batch = pack(_examples())
    padded = to_padded(batch, side, pad_token_id=PAD)
    assert padded.side == side
    assert padded.input_ids.shape == padded.attention_mask.shape == padded.labels.shape == (3, 7)
    assert padded.attention_mask.sum(1).tolist() == [4, 7, 2]
    for row, ex in enumerate(_examples()):
        real = padded.attention_mask[row].bool()
        n = len(ex)
        # Real tokens are contiguous and on the requested side.
        expected_real = [True] * n + [False] * (7 - n) if side == "right" else [False] * (7 - n) + [True] * n
        assert real.tolist() == expected_real
        assert padded.input_ids[row][real].tolist() == ex.input_ids
        assert (padded.input_ids[row][~real] == PAD).all()
        assert (padded.labels[row][~real] == IGNORE_INDEX).all()
        assert padded.position_ids[row][real].tolist() == list(range(n))


@pytest.mark.parametrize("side", ["left", "right"])
def test_packed_padded_round_trip(side):
    batch = pack(_examples())
    padded = to_padded(batch, side, pad_token_id=PAD)

    # Per-token values (here: labels and a float per token) come back in packed order via unpad.
    assert torch.equal(unpad(padded.input_ids, padded.attention_mask), batch.input_ids[0])
    assert torch.equal(unpad(padded.labels, padded.attention_mask), batch.labels[0])
    values = torch.zeros(3, 7, 2)
    values[padded.attention_mask.bool()] = torch.arange(26.0).view(13, 2)
    assert torch.equal(unpad(values, padded.attention_mask), torch.arange(26.0).view(13, 2))

    # HF-style (unshifted) labels carry the loss mask back through from_padded.
    hf_labels = torch.full_like(padded.input_ids, IGNORE_INDEX)
    real = padded.attention_mask.bool()
    mask = torch.zeros_like(real)
    mask[real] = torch.tensor([bool(m) for ex in _examples() for m in (ex.loss_mask or [True] * len(ex))])
    hf_labels[mask] = padded.input_ids[mask]
    again = from_padded(padded.input_ids, padded.attention_mask, hf_labels)
    for name in ("input_ids", "position_ids", "cu_seqlens", "labels"):
        assert torch.equal(getattr(again, name), getattr(batch, name)), name
    assert again.max_seqlen == batch.max_seqlen

    # Without labels every next token is a target.
    plain = from_padded(padded.input_ids, padded.attention_mask)
    assert torch.equal(plain.labels, pack([Example(ex.input_ids) for ex in _examples()]).labels)


def test_from_padded_mixed_sides():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    batch = from_padded(ids, mask)
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9]
    assert batch.cu_seqlens.tolist() == [0, 2, 5]


def test_to_padded_rejects_unknown_side():
    with pytest.raises(ValueError, match="'left' or 'right'"):
        to_padded(pack(_examples()), "middle", pad_token_id=PAD)


# ----------------------------------------------------------------------------------------------------------
# Token-budget batching
# ----------------------------------------------------------------------------------------------------------


def _random_lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([rng.randrange(1, 40), rng.randrange(40, 400)]) for _ in range(n)]


@pytest.mark.parametrize("budget", [400, 512, 1000])
def test_budget_batches_cover_every_item_once_within_budget(budget):
    lengths = _random_lengths(300)
    batches = budget_batches(lengths, budget, seed=3)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(b for b in batches)
    assert all(sum(lengths[i] for i in b) <= budget for b in batches)


def test_budget_batches_deterministic_per_seed():
    lengths = _random_lengths(200)
    a = budget_batches(lengths, 512, seed=7)
    assert budget_batches(lengths, 512, seed=7) == a
    assert budget_batches(lengths, 512, seed=8) != a
    # shuffle=False still gives a valid cover, in best-fit order (longest item first).
    fixed = budget_batches(lengths, 512, seed=7, shuffle=False)
    assert sorted(i for b in fixed for i in b) == list(range(200))
    assert lengths[fixed[0][0]] == max(lengths)


def _best_fit_decreasing(lengths: list[int], budget: int, seed: int, shuffle: bool) -> list[list[int]]:
    """Textbook best-fit decreasing, one scan of every open bin per item: the tightest bin that holds the
    item, among equally tight ones the one filled last; ties in length and the batch order seeded."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    order.sort(key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    filled: list[int] = []
    for t, i in enumerate(order):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], -filled[b]))
            bins[b].append(i)
            room[b] -= lengths[i]
            filled[b] = t
        else:
            bins.append([i])
            room.append(budget - lengths[i])
            filled.append(t)
    if shuffle:
        rng.shuffle(bins)
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_budget_batches_are_best_fit_decreasing(seed):
    """The bins-by-room structure (fast enough for a million rows) plans exactly the textbook way."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 400))]
    budget = rng.randint(60, 200)
    for shuffle in (True, False):
        assert budget_batches(lengths, budget, seed=seed, shuffle=shuffle) == _best_fit_decreasing(
            lengths, budget, seed, shuffle
        )


def test_budget_batches_exact_fit():
    # 6 + 4 and 7 + 3 and 5 + 5 fill budget 10 exactly; best fit decreasing finds it.
    lengths = [6, 4, 7, 3, 5, 5]
    batches = budget_batches(lengths, 10, seed=0)
    assert len(batches) == 3
    assert sorted(sum(lengths[i] for i in b) for b in batches) == [10, 10, 10]


def test_budget_batches_over_long_item():
    with pytest.raises(ValueError, match=r"item 2 has 50 tokens") as err:
        budget_batches([10, 20, 50, 60], 40)
    msg = str(err.value)
    assert "2 item(s) too long" in msg
    assert "max_tokens_per_batch to at least 60" in msg
    assert "max_length" in msg


def test_budget_batches_rejects_non_positive_budget():
    with pytest.raises(ValueError, match="must be positive"):
        budget_batches([1, 2], 0)


def test_budget_batches_empty_input():
    assert budget_batches([], 100) == []


@pytest.fixture(scope="module")
def sft_lengths(tokenizer) -> list[int]:
    """Token lengths of the embedded SFT conversations, rendered with the embedded chat template."""
    with data_path("sft").open() as f:
        rows = [json.loads(line) for line in f]
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    assert len(lengths) == len(rows) > 100
    return lengths


def test_budget_batches_pack_the_sft_data_well(sft_lengths):
    budget = 2048
    batches = budget_batches(sft_lengths, budget, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(len(sft_lengths)))
    assert all(sum(sft_lengths[i] for i in b) <= budget for b in batches)
    fill = sum(sft_lengths) / (len(batches) * budget)
    assert fill >= 0.9, f"best-fit decreasing filled only {fill:.1%} of the token budget"


def test_padding_share_hand_example():
    lengths = [2, 4, 3, 3]
    # batch [0, 1] pads to 2 x 4 = 8 for 6 real; batch [2, 3] to 6 for 6 real: 2 pad of 14.
    assert padding_share(lengths, [[0, 1], [2, 3]]) == pytest.approx(2 / 14)
    assert padding_share(lengths, [[2, 3]]) == 0.0
    assert padding_share(lengths, [[0], [1], [2], [3]]) == 0.0
    assert padding_share(lengths, [[0, 1, 2, 3]]) == pytest.approx(1 - 12 / 16)
    assert padding_share(lengths, []) == 0.0


def test_fixed_count_batches():
    batches = fixed_count_batches(10, 4, seed=1)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert fixed_count_batches(10, 4, seed=1) == batches
    assert fixed_count_batches(5, 2, shuffle=False) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="must be positive"):
        fixed_count_batches(3, 0)


def test_balance_ranks():
    tokens = [900, 100, 500, 500, 300, 700, 200]
    ranks = balance_ranks(tokens, num_ranks=2, per_rank=4)
    assert sorted(i for r in ranks for i in r) == list(range(len(tokens)))
    assert all(len(r) <= 4 for r in ranks)
    loads = [sum(tokens[i] for i in r) for r in ranks]
    assert sum(loads) == sum(tokens) and max(loads) - min(loads) <= 100
    # A rank that is full takes nothing more, even if it is the least loaded.
    ranks = balance_ranks([1000, 10, 10, 10], num_ranks=2, per_rank=2)
    assert sorted(len(r) for r in ranks) == [2, 2]
    # Fewer micro-batches than slots (the last, partial step).
    assert sorted(len(r) for r in balance_ranks([5, 5, 5], num_ranks=4, per_rank=1)) == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="5 micro-batches do not fit 2 ranks x 2"):
        balance_ranks([1] * 5, num_ranks=2, per_rank=2)


# ----------------------------------------------------------------------------------------------------------
# sequence sums
# ----------------------------------------------------------------------------------------------------------


def _logp_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, PackedBatch]:
    """Per-token fp32 log-probs (-0.01 to -12, like a model's) over packed sequences of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    batch = pack([Example(list(range(3, 3 + n))) for n in lengths])
    logps = -torch.empty(batch.input_ids.shape[1]).uniform_(0.01, 12.0, generator=gen)
    return logps, batch


def test_sequence_sums_equal_an_fp64_reference():
    """fp32 per-token values summed in fp64 match a sum taken wholly in fp64 (math.fsum of the same
    values) to fp64 round-off; an fp32 accumulation of the same values is off by ~1e-4 at these sizes."""
    lengths = [1500, 7, 900, 2400]
    logps, batch = _logp_batch(lengths)
    sums = batch.sequence_sums(logps)
    assert sums.dtype == torch.float64
    bounds = batch.cu_seqlens.tolist()
    reference = torch.tensor(
        [math.fsum(logps[a:b].double().tolist()) for a, b in itertools.pairwise(bounds)],
        dtype=torch.float64,
    )
    assert (sums - reference).abs().max().item() < 1e-9
    fp32 = torch.zeros(len(lengths)).index_add(0, batch.sequence_index, logps).double()
    assert (fp32 - reference).abs().max().item() > 1e-4  # what the fp64 accumulation buys


def test_dpo_gradient_through_sequence_sums_matches_fp64():
    """The DPO (sigmoid) gradient per token, from fp32 log-probs through sequence_sums, equals the gradient
    computed wholly in fp64 up to its rounding to fp32: the loss is a small difference of sums near 10^4,
    whose fp32 round-off (~1e-3) would otherwise give a gradient error of ~1e-5."""
    from padless.losses import dpo_loss

    lengths = [1300, 1250, 900, 1020]  # chosen, rejected, chosen, rejected
    logps, batch = _logp_batch(lengths, seed=1)
    # a reference close to the policy, as in DPO: log-ratios of order 1, where the gradient is sensitive
    ref = batch.sequence_sums(logps) + torch.tensor([-3.0, 4.0, 2.5, -1.5], dtype=torch.float64)
    pair_lengths = torch.tensor(lengths, dtype=torch.float64)

    def grad(values: torch.Tensor, sums) -> torch.Tensor:
        values = values.clone().requires_grad_(True)
        s = sums(values)
        loss, _, _ = dpo_loss(
            s[0::2], s[1::2], ref[0::2], ref[1::2], pair_lengths[0::2], pair_lengths[1::2], beta=0.1
        )
        loss.sum().backward()
        return values.grad.double()

    ours = grad(logps, batch.sequence_sums)
    fp64 = grad(
        logps.double(),
        lambda v: torch.zeros(len(lengths), dtype=torch.float64).index_add(0, batch.sequence_index, v),
    )
    fp32_sums = grad(logps, lambda v: torch.zeros(len(lengths)).index_add(0, batch.sequence_index, v))
    assert (
        ours - fp64
    ).abs().max().item() < 5e-9  # the fp64 gradient rounded to the fp32 leaf (measured 1.8e-9)
    assert (fp32_sums - fp64).abs().max().item() > 1e-6  # fp32 sums: measured 9.2e-6
