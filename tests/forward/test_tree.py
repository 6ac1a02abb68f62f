"""Tree packing (padless.forward.tree): the layout, its attention kernels, and the engine's results, per token
against each sequence alone and gradient against the flat packed row, for GRPO groups, DPO pairs and
multi-turn episodes; a planted sibling leak fails."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

import padless.forward.engine as engine_module
from padless.data import load_rows, tokenize_preference
from padless.errors import AttentionError
from padless.forward import varlen
from padless.forward.attention import kernel_of, pin_kernel, pinned
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.packing import IGNORE_INDEX, Example, pack
from padless.forward.tree import (
    TreeRow,
    resolve_tree,
    share_prefixes,
    tree_batches,
    tree_problem,
    tree_tokens,
)
from padless.forward.varlen import varlen_attention_forward
from padless.proof.check import gradient_delta
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.proof.zoo import LOGIT_TARGET, scale_head
from padless.testing.kernels import fused_kernels_on_cpu

# ----------------------------------------------------------------------------------------------------------
# The layout
# ----------------------------------------------------------------------------------------------------------


def _trained(prompt: list[int], completion: list[int]) -> Example:
    return Example(prompt + completion, [False] * len(prompt) + [True] * len(completion))


def test_nested_prefixes_become_nested_segments_that_unfold_to_the_flat_row():
    """A system prompt shared by two prompts, each shared by its completions: node, two nodes, leaves. Each
    segment continues its parent's positions; shared positions predict nothing; unfolding gives back the
    flat row's tokens, positions and labels exactly."""
    system = [1, 2, 3]
    a, b = [*system, 4, 5], [*system, 6, 7, 8]
    examples = [_trained(a, [10, 11]), _trained(b, [12]), _trained(a, [13, 14, 15]), _trained(b, [16, 17])]
    examples.append(Example([9, 9, 9]))  # shares nothing: a root of its own
    batch = pack(examples)
    row = share_prefixes(batch)
    # segments: [1,2,3] -> [4] (a less its last token) -> two leaves; [6,7] -> two leaves; [9,9,9]
    assert row.parents == (-1, 0, 1, 1, 0, 4, 4, -1)
    bounds = row.cu_seqlens.tolist()
    segments = [row.input_ids[0, s:e].tolist() for s, e in itertools.pairwise(bounds)]
    assert segments == [[1, 2, 3], [4], [5, 10, 11], [5, 13, 14, 15], [6, 7], [8, 12], [8, 16, 17], [9, 9, 9]]
    assert row.position_ids[0, bounds[2] : bounds[3]].tolist() == [4, 5, 6]  # after [1, 2, 3] and [4]
    assert row.labels[0, : bounds[2]].tolist() == [IGNORE_INDEX] * 4
    for name in ("input_ids", "position_ids", "labels"):
        assert torch.equal(getattr(row, name)[0, row.unfold], getattr(batch, name)[0]), name
    assert row.num_tokens == tree_tokens(examples) == batch.num_tokens - 3 * 3 - 1 - 2  # 3 x [1,2,3] ...
    # each leaf sees its ancestors then itself, never a sibling
    leaf = 3
    keys = row.keys[row.cu_keys[leaf] : row.cu_keys[leaf + 1]].tolist()
    assert keys == [*range(0, 4), *range(bounds[leaf], bounds[leaf + 1])]
    allowed = row.allowed()
    assert not allowed[bounds[3] :, bounds[2] : bounds[3]].any()  # nothing after leaf 2 sees it


def test_only_untrained_prefixes_are_shared():
    """Identical trained tokens are each sequence's own (a shared one would count once); sequences that
    share nothing, or a batch with images, give no tree."""
    assert share_prefixes(pack([Example([1, 2, 3, 4]), Example([1, 2, 3, 5])])) is None  # all trained
    same = pack([_trained([1, 2, 3], [7, 8]), _trained([1, 2, 3], [7, 8])])
    row = share_prefixes(same)
    assert row.num_tokens == 2 + 3 + 3 and row.labels[0].tolist().count(IGNORE_INDEX) == 2 + 2 * 1
    whole = pack([Example([1, 2, 3], [False] * 3), Example([1, 2, 3, 4, 5], [False] * 3 + [True] * 2)])
    row = share_prefixes(whole)  # a sequence that is all prompt: its last token a leaf of its own
    assert row.parents == (-1, 0, 0) and torch.equal(row.input_ids[0, row.unfold], whole.input_ids[0])
    with_images = pack([_trained([1, 2, 3], [4]), _trained([1, 2, 3], [5])])
    with_images.vision = {"pixel_values": torch.zeros(1, 3)}
    assert share_prefixes(with_images) is None


def test_tree_batches_keep_what_is_shared_together_within_the_budget():
    gen = torch.Generator().manual_seed(0)
    examples = []
    for g in range(6):
        prompt = torch.randint(3, 99, (30 + 7 * g,), generator=gen).tolist()
        for length in (3, 9, 5):
            examples.append(_trained(prompt, torch.randint(3, 99, (length,), generator=gen).tolist()))
    batches = tree_batches(examples, 120)
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    for b in batches:
        assert tree_tokens([examples[i] for i in b]) <= 120
    assert len(batches) <= math.ceil(tree_tokens(examples) / 120) + 2  # fuller than one group per batch
    for g in range(6):  # a group's sequences side by side: cut at most once
        assert sum(any(i // 3 == g for i in b) for b in batches) <= 2
    with pytest.raises(ValueError, match="max_tokens_per_batch=40"):
        tree_batches(examples, 40)


# ----------------------------------------------------------------------------------------------------------
# The kernel: each segment against its keys, written out
# ----------------------------------------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    is_causal = True


def _written_out(q, k, v, row: TreeRow, scale, window=None, softcap=None, sinks=None):
    """Each segment's queries against the keys ``row.keys`` lists, written out in fp64, causal at the
    bottom right: ``[R, H, D]``."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[2], q.shape[1], v.shape[-1], dtype=torch.float64)
    cu_q, cu_k = row.cu_seqlens.tolist(), row.cu_keys.tolist()
    for s in range(len(row.parents)):
        keys = row.keys[cu_k[s] : cu_k[s + 1]]
        qs = q[0, :, cu_q[s] : cu_q[s + 1]].double()
        ks, vs = (t[0][:, keys].repeat_interleave(rep, 0).double() for t in (k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        i = torch.arange(qs.shape[1])[:, None] + (ks.shape[1] - qs.shape[1])
        j = torch.arange(ks.shape[1])[None]
        allowed = (j <= i) & ((i - j < window) if window is not None else True)
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)], -1)
            probs = scores.softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[cu_q[s] : cu_q[s + 1]] = (probs @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize("extra", ["plain", "window", "softcap+sinks"])
@pytest.mark.parametrize("kernel", ["sdpa", "torch", "flash_attn"])
def test_tree_attention_is_each_segment_against_its_ancestors_and_itself(kernel, extra):
    """Forward and q, k, v gradients against the attention written out per segment in fp64; a prefix's keys
    and values get the sum of every branch's gradient. Fused kernels run as their CPU stand-ins (fp32)."""
    if kernel != "sdpa" and extra == "softcap+sinks":
        pytest.skip("the fused kernels take no sinks: such layers run the sdpa branch")
    examples = [_trained([1, 2, 3, 4, 5, 6], [7, 8]), _trained([1, 2, 3, 4, 5, 6], [9, 10, 11, 12, 13])]
    examples += [_trained([1, 2, 3, 20], [21]), Example([30, 31, 32, 33])]
    row = share_prefixes(pack(examples))
    gen = torch.Generator().manual_seed(0)
    length = row.num_tokens
    q, k, v = (torch.randn(1, h, length, 8, generator=gen).requires_grad_() for h in (4, 2, 2))
    kw = {"window": 3} if extra == "window" else {}
    if extra == "softcap+sinks":
        kw = {"softcap": 2.0, "sinks": torch.randn(4, generator=gen)}
    want = _written_out(q, k, v, row, 0.3, **kw)
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    args = {"sliding_window": kw.get("window"), "softcap": kw.get("softcap"), "s_aux": kw.get("sinks")}
    stand_in = fused_kernels_on_cpu((torch.float32,)) if kernel != "sdpa" else contextlib.nullcontext()
    layer = _Layer()
    pin_kernel(layer, kernel)
    with stand_in:
        out, _ = varlen_attention_forward(layer, q, k, v, None, scaling=0.3, **args, **row.attention_kwargs())
    grads = torch.autograd.grad((out[0].double() * weights).sum(), (q, k, v))
    # plain attention on CPU runs as parts merged through their log-sum-exp, the rest by masks
    assert (row.cu_seqlens in varlen._TREE_PARTS) == (kernel == "sdpa" and extra == "plain")
    torch.testing.assert_close(out[0].double(), want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_tree_attention_refuses_what_a_tree_cannot_mean():
    row = share_prefixes(pack([_trained([1, 2, 3], [4]), _trained([1, 2, 3], [5])]))
    q = k = v = torch.randn(1, 2, row.num_tokens, 8)
    with pytest.raises(AttentionError, match="bidirectionally"):
        varlen_attention_forward(_Layer(), q, k, v, None, is_causal=False, **row.attention_kwargs())


# ----------------------------------------------------------------------------------------------------------
# The engine: GRPO groups, DPO pairs, episodes; per token vs alone, gradients vs flat
# ----------------------------------------------------------------------------------------------------------


def _corpus(tokenizer) -> list[int]:
    from importlib import resources

    return tokenizer(resources.files("padless.tiny").joinpath("corpus.txt").read_text())["input_ids"]


def _cases(tokenizer) -> dict[str, list[Example]]:
    """A GRPO group (a prompt, four completions), DPO pairs rendered by the chat template, and a group of
    multi-turn episodes (a first prompt, then trained turns between untrained environment turns)."""
    ids = _corpus(tokenizer)
    take = iter(range(0, len(ids), 23))

    def text(n: int) -> list[int]:
        start = next(take)
        return ids[start : start + n]

    prompt = text(50)
    group = [_trained(prompt, text(n)) for n in (4, 17, 9, 1)]
    rows = load_rows("tiny:preference")
    pairs, _ = tokenize_preference([rows[1], rows[12]], tokenizer, max_length=2048)  # prompts of 47, 37
    dpo = [side for p in pairs for side in (p.chosen, p.rejected)]
    first = text(40)
    episodes = []
    for n in (5, 12, 3):
        turns = [(text(n), True), (text(9), False), (text(n + 2), True)]
        ids_ = first + [t for turn, _ in turns for t in turn]
        mask = [False] * len(first) + [m for turn, m in turns for _ in turn]
        episodes.append(Example(ids_, mask))
    return {"grpo group": group, "dpo pairs": dpo, "episodes": episodes}


@pytest.fixture(scope="module")
def policy(tokenizer):
    """tiny-llama with realistic logits: the largest |logit| on the cases' sequences is 30."""
    model = load_model("tiny-llama", training=True, probe=False)
    model.eval()  # no dropout: tree and flat must compute the same numbers
    with torch.no_grad():
        seqs = [torch.tensor(e.input_ids) for case in _cases(tokenizer).values() for e in case]
        largest = max(model(input_ids=s[None]).logits.abs().max().item() for s in seqs)
    scale_head(model, LOGIT_TARGET / largest)
    return model


def _alone(model, examples: list[Example]) -> tuple[list[torch.Tensor], float]:
    """Each sequence alone through the model's own forward: log-probs of its trained tokens, and the
    largest |logit| or |log-prob| they came from."""
    out, magnitude = [], 0.0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor(e.input_ids)
            logits = model(input_ids=ids[None], use_cache=False).logits[0].float()
            logps = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            trained = torch.tensor(e.loss_mask[1:]) if e.loss_mask is not None else torch.ones(len(e) - 1)
            out.append(logps[trained.bool()])
            magnitude = max(magnitude, logits.abs().max().item(), logps.abs().max().item())
    return out, magnitude


def _run(model, examples, tree: bool, kernel: str | None):
    """Trained log-probs per sequence and the gradient of a loss over them, through the engine (which pins
    ``kernel`` on the model's layers: the model's own pin is back afterwards)."""
    batch = pack(examples)
    with pinned(model, kernel_of(model)):
        engine = ModelEngine(
            model, settings=EngineSettings(varlen_kernel=kernel, tree_packing="on" if tree else "off")
        )
        params = list(model.parameters())
        logps = engine(batch, logps=True).logps
        weights = torch.cos(torch.arange(batch.num_tokens, dtype=torch.float32))
        grads = torch.autograd.grad((logps * weights).sum(), params)
    mask = batch.loss_mask[0]
    return [t[m] for t, m in zip(batch.split(logps.detach()), batch.split(mask), strict=True)], grads


BACKENDS = [("varlen", "sdpa"), ("varlen", "torch"), ("sdpa", None)]


@pytest.mark.parametrize("case", ["grpo group", "dpo pairs", "episodes"])
@pytest.mark.parametrize(("backend", "kernel"), BACKENDS, ids=["varlen", "varlen-fused-stand-in", "sdpa"])
def test_tree_equals_alone_per_token_and_flat_in_gradient(policy, tokenizer, case, backend, kernel):
    examples = _cases(tokenizer)[case]
    row = share_prefixes(pack(examples))
    assert row is not None and row.num_tokens < pack(examples).num_tokens  # something is shared
    alone, magnitude = _alone(policy, examples)
    engine_module.use_backend(policy, backend)
    stand_in = fused_kernels_on_cpu((torch.float32,)) if kernel == "torch" else contextlib.nullcontext()
    try:
        with stand_in:
            tree_logps, tree_grads = _run(policy, examples, True, kernel)
            _, flat_grads = _run(policy, examples, False, kernel)
    finally:
        engine_module.use_backend(policy, "varlen")
    delta = max((t - a).abs().max().item() for t, a in zip(tree_logps, alone, strict=True))
    assert delta <= bound(torch.float32, magnitude), delta
    assert magnitude > 20  # realistic logits, not the tiny model's
    got, limit = gradient_delta(flat_grads, tree_grads, torch.float32)
    assert got <= limit, (got, limit)


def test_a_planted_sibling_leak_fails(policy, tokenizer, sibling_leak):
    """A tree row whose second leaf also sees the first leaf's keys: per-token log-probs move far past the
    bound, so the comparison above (and the load-time probe, tests/proof/test_probe.py) fails."""
    examples = _cases(tokenizer)["grpo group"]
    alone, magnitude = _alone(policy, examples)
    tree_logps, _ = _run(policy, examples, True, None)
    delta = max((t - a).abs().max().item() for t, a in zip(tree_logps, alone, strict=True))
    assert delta > 100 * bound(torch.float32, magnitude), delta


# ----------------------------------------------------------------------------------------------------------
# Where a tree cannot run: said by category, refused when asked for
# ----------------------------------------------------------------------------------------------------------


def test_stateful_layers_and_other_backends_run_flat_with_the_reason(caplog):
    hybrid = load_model("tiny-qwen3.5", probe=False)
    assert "state" in tree_problem(hybrid, "varlen")
    assert resolve_tree(hybrid, "varlen", required=False) is False
    with pytest.raises(AttentionError, match=r"tree_packing: on.*state"):
        resolve_tree(hybrid, "varlen", required=True)
    plain = load_model("tiny-llama", probe=False)
    assert tree_problem(plain, "varlen") is None and resolve_tree(plain, "varlen", required=False) is True
    assert "flash_attention_2" in tree_problem(plain, "flash_attention_2")
    assert "sequence parallelism" in tree_problem(plain, "varlen", degree=2)
    assert EngineSettings(tree_packing="off").runs_tree(plain, "varlen") is False  # nothing asked
