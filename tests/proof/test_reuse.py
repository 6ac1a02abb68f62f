"""A load-time proof is reused within a process only where the model, the backend and the code that runs
are the same: a changed kernel, library function or weight is proven again, and a broken one refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

import padless.forward.varlen as varlen
from padless.forward.attention import VARLEN_NAME, AttentionError
from padless.forward.varlen import KERNEL_CALLS, varlen_attention_forward
from padless.proof.load import load_model


def _proof(model: torch.nn.Module) -> dict:
    return {k: v for k, v in model.padless_probe.items() if k != "reused"}


def test_an_identical_load_reuses_the_proof_and_runs_no_forward():
    first = load_model("tiny-llama")
    before = Counter(KERNEL_CALLS)
    second = load_model("tiny-llama", training=True)  # the probe runs in eval mode either way
    assert second.padless_probe["reused"] is True and _proof(second) == _proof(first)
    assert before == KERNEL_CALLS  # no forward ran
    assert "reused" not in load_model("tiny-llama", seed=1).padless_probe  # other weights: proven


def _counted(fn, calls: list[str]):
    def wrapper(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("owner", "name"),
    [
        (F, "scaled_dot_product_attention"),  # torch, under padless's varlen kernel
        (modeling_llama, "apply_rotary_pos_emb"),  # the model's own modeling code
        (varlen, "_grouped_causal"),  # padless
    ],
)
def test_a_replaced_function_is_proven_again(owner, name, monkeypatch):
    """The same model as a proven one, with one function the probe runs replaced (by a counting wrapper):
    the proof is not reused, the probe runs through the replacement."""
    load_model("tiny-llama")
    calls: list[str] = []
    monkeypatch.setattr(owner, name, _counted(getattr(owner, name), calls))
    model = load_model("tiny-llama")
    assert "reused" not in model.padless_probe and calls


def _leaky(module, query, key, value, attention_mask, **kwargs):
    """varlen with the sequence boundaries dropped: one causal attention over the whole row."""
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids"):
        kwargs.pop(k, None)
    return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_a_kernel_broken_after_an_identical_model_was_proven_is_refused(monkeypatch):
    load_model("tiny-llama")
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, VARLEN_NAME, _leaky)
    with pytest.raises(AttentionError, match="leaks between packed sequences"):
        load_model("tiny-llama")
