"""Shared fixtures: the embedded tokenizer, probe sequences of very different lengths, and a reference
computation of per-token log-probs that runs each sequence alone through a plain ``model(...)`` call."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Very different lengths on purpose: a short sequence packed before a long one is where leaks show.
PROBE_LENGTHS = (3, 20, 90)

LogpsFn = Callable[[torch.nn.Module, list[list[int]]], list[torch.Tensor]]


# Tokenized sets (and anything else ``datasets`` caches) go to a folder of this test session, never into the
# user's cache: set here, before test modules copy ``os.environ`` for the processes they launch.
_DATASETS_CACHE = tempfile.mkdtemp(prefix="padless-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache() -> Iterator[None]:
    import datasets.config

    datasets.config.HF_DATASETS_CACHE = Path(_DATASETS_CACHE)  # in case datasets was imported before
    yield
    shutil.rmtree(_DATASETS_CACHE, ignore_errors=True)


_TORCH_LINEAR = torch.nn.functional.linear


@pytest.fixture(autouse=True)
def _no_leaked_linear() -> Iterator[None]:
    """DeepSpeed's ZeRO-3 linear stays in ``torch.nn.functional`` for the rest of the process (every later
    test ran slower through it): a test that leaves it there fails."""
    yield
    leaked = torch.nn.functional.linear is not _TORCH_LINEAR
    torch.nn.functional.linear = _TORCH_LINEAR
    assert not leaked, "this test left torch.nn.functional.linear patched (DeepSpeed ZeRO-3): restore it"


@pytest.fixture(scope="session")
def tokenizer():
    from padless.tiny import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id


@pytest.fixture(scope="session")
def probe_seqs(tokenizer) -> list[list[int]]:
    """Real text from the embedded corpus, tokenized, cut to :data:`PROBE_LENGTHS`."""
    from padless.proof.check import probe_sequences

    seqs = probe_sequences(tokenizer, PROBE_LENGTHS)
    assert [len(s) for s in seqs] == list(PROBE_LENGTHS)
    assert len({tuple(s) for s in seqs}) == len(seqs), "probe sequences must differ"
    return seqs


def next_token_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log p(ids[t + 1] | ids[:t + 1])`` for every ``t < L - 1`` from logits ``[L, V]`` (fp32)."""
    return torch.log_softmax(logits[:-1].float(), dim=-1).gather(-1, ids[1:, None])[:, 0]


def _alone_logps(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor(s, device=device)
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
            out.append(next_token_logps(logits, ids))
    return out


@pytest.fixture(scope="session")
def alone_logps() -> LogpsFn:
    """Reference: each sequence run alone (batch of one, no padding, no packing), ``[L_i - 1]`` each."""
    return _alone_logps


def _per_token_delta(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want), f"{len(got)} sequences, expected {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"sequence {i}: shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        assert w.numel() > 0, f"sequence {i} has no predicted tokens: nothing would be compared"
        assert torch.isfinite(g).all(), f"sequence {i}: non-finite log-probs"
        worst = max(worst, (g.float().cpu() - w.float().cpu()).abs().max().item())
    return worst


@pytest.fixture(scope="session")
def per_token_delta() -> Callable[[list[torch.Tensor], list[torch.Tensor]], float]:
    """Largest per-token |difference| over sequences, after checking every sequence has the same shape."""
    return _per_token_delta


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """tiny-qwen2 on the three cheap CPU backends, eval mode, built and probed once per test module."""
    from padless.proof.load import load_model

    return {b: load_model("tiny-qwen2", attn_implementation=b) for b in ("varlen", "sdpa", "eager")}


@pytest.fixture(scope="module")
def reference(models, probe_seqs, alone_logps) -> list[torch.Tensor]:
    """Each probe sequence alone on eager: next-token log-probs ``[L_i - 1]``."""
    return alone_logps(models["eager"], probe_seqs)


@pytest.fixture(scope="session")
def talkative_vlm(tmp_path_factory) -> str:
    """A folder holding the embedded tiny VLM whose turns end: a random model almost never
    samples its end-of-turn token, so multi-turn episodes would stop at their first turn's length. Every
    token embedding gets the same value in one hidden dimension, which the residual stream then carries at
    every text position; the end-of-turn token's (tied) output row gets a larger one there, lifting its
    logit by a similar amount everywhere (about one turn in three ends within 8 tokens at temperature
    0.7), while the other dimensions still read the images and the text."""
    from padless.data.sources import load_processor
    from padless.proof.load import load_model
    from padless.tiny import EOS_TOKEN_ID

    model = load_model("tiny-qwen2.5-vl", probe=False)
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight
        embeddings[:, 0] = TALK_LEVEL
        embeddings[EOS_TOKEN_ID, 0] = TALK_LEVEL + TALK_LIFT
    folder = tmp_path_factory.mktemp("talkative-vlm")
    model.save_pretrained(folder)
    load_processor("tiny-qwen2.5-vl").save_pretrained(folder)
    return str(folder)


TALK_LEVEL, TALK_LIFT = 0.5, 0.9


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``zoo_full`` tests (every causal-LM architecture of transformers: minutes) run only when asked
    for with ``-m zoo_full``; the suite runs CI's representative subset of the zoo."""
    if "zoo_full" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the whole zoo: run with -m zoo_full")
    for item in items:
        if "zoo_full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _library_logs_follow_stderr() -> None:
    """transformers and huggingface_hub bind their console handler to ``sys.stderr`` as it is when they are
    first configured, which may be a test's capture, closed after that test: a later warning then prints
    "I/O operation on closed file" with a traceback into another test's output. Each test points them at
    its own."""
    for name in ("transformers", "huggingface_hub"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr
                vars(handler).pop("flush", None)  # transformers pins the first stream's flush on it


@pytest.fixture
def sibling_leak(monkeypatch) -> None:
    """A planted leak: every tree row (padless.forward.tree) built in the test lets its second leaf see its
    first sibling's keys too (placed before its own, so causality still holds within each)."""
    import padless.forward.tree as tree
    import padless.proof.probe as probe

    honest = tree.share_prefixes

    def leaky(batch):
        row = honest(batch)
        cu_q, cu_k, keys = row.cu_seqlens.tolist(), row.cu_keys.tolist(), row.keys.tolist()
        lists = [keys[cu_k[s] : cu_k[s + 1]] for s in range(len(row.parents))]
        first, second = next(
            (a, b)
            for b in range(len(row.parents))
            for a in range(b)
            if row.parents[a] == row.parents[b] >= 0 and b not in row.parents and a not in row.parents
        )
        own = cu_q[second + 1] - cu_q[second]
        lists[second] = (
            lists[second][:-own] + list(range(cu_q[first], cu_q[first + 1])) + lists[second][-own:]
        )
        row.keys = torch.tensor([k for ks in lists for k in ks])
        row.cu_keys = torch.tensor([0, *itertools.accumulate(map(len, lists))], dtype=torch.int32)
        row.max_keys = max(map(len, lists))
        return row

    monkeypatch.setattr(tree, "share_prefixes", leaky)
    monkeypatch.setattr(probe, "share_prefixes", leaky)
