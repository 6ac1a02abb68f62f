"""Proof, at load time, that the requested attention backend is the one running and that packed
sequences stay apart on it."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from padless.attention import VARLEN_NAME, assert_attention, runtime_context, text_config
from padless.errors import AttentionError
from padless.tolerance import bound
from padless.varlen import KERNEL_CALLS
from padless.vision import uses_mrope


@contextlib.contextmanager
def count_attention_calls() -> Iterator[Counter[str]]:
    """Count calls of every function registered in transformers' AttentionInterface, by name."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    counts: Counter[str] = Counter()
    originals = dict(mapping)

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        mapping[name] = counted(name, fn)
    try:
        yield counts
    finally:
        mapping.clear()
        mapping.update(originals)


PROBE_MAX_LENGTH = 64  # the probe's longer sequence outgrows sliding windows up to this size


def _probe_inputs(config: Any, device: torch.device) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Two random sequences and the kwargs of their packed row. The first outgrows the model's sliding
    window when that is short enough to afford (longer windows are covered by tests, not at load)."""
    gen = torch.Generator().manual_seed(0)
    window = getattr(config, "sliding_window", None) or 0
    lens = (max(11, min(window + 3, PROBE_MAX_LENGTH)), 5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(device) for n in lens]
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=device)
    return seqs, {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(n, device=device) for n in lens])[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lens),
        "max_length_k": max(lens),
    }


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every config object the model and its modules read their attention kernel from."""
    found: dict[int, Any] = {}
    stack = [model.config, *(getattr(m, "config", None) for m in model.modules())]
    while stack:
        config = stack.pop()
        if config is None or not hasattr(config, "_attn_implementation_internal") or id(config) in found:
            continue
        found[id(config)] = config
        stack += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())


@contextlib.contextmanager
def _eager(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` on transformers' eager attention inside the block; afterwards every config (and
    sub-config) dispatches exactly where it did before."""
    saved = [(config, config._attn_implementation_internal) for config in _configs(model)]
    try:
        for config, _ in saved:
            config._attn_implementation_internal = "eager"
        yield
    finally:
        for config, implementation in saved:
            config._attn_implementation_internal = implementation


def probe_attention(model: torch.nn.Module, backend: str, tolerance: float | None = None) -> dict[str, Any]:
    """Prove ``backend`` runs and computes what eager computes on packed sequences; raise if not.

    Runs two random sequences packed on ``backend``, counting calls of the registered attention
    functions, and compares per-token hidden states with each sequence run alone on transformers'
    eager attention: an independent reference, so a kernel that is consistent but wrong (a dropped
    soft-cap, sink or window) fails here as surely as one that leaks between sequences. The bound
    scales with the hidden states' size (:mod:`padless.tolerance`); ``tolerance`` overrides it.
    """
    assert_attention(model, backend)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    config = text_config(model)
    layers = config.num_hidden_layers
    seqs, packed_kwargs = _probe_inputs(config, device)
    if uses_mrope(model.config):  # packed M-RoPE ids: the text row on 3 rope rows (all equal for text)
        packed_kwargs["position_ids"] = packed_kwargs["position_ids"].expand(4, 1, -1)
    decoder = model.get_decoder()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), runtime_context(backend, device):
            kernels_before = Counter(KERNEL_CALLS)
            with count_attention_calls() as counts:
                packed = decoder(**packed_kwargs, use_cache=False).last_hidden_state[0].float()
            kernels = sorted((KERNEL_CALLS - kernels_before).keys())
            with _eager(model):
                alone = torch.cat(
                    [
                        decoder(
                            input_ids=s[None],
                            position_ids=torch.arange(len(s), device=device)[None],
                            use_cache=False,
                        )
                        .last_hidden_state[0]
                        .float()
                        for s in seqs
                    ]
                )
    finally:
        model.train(was_training)
    expected = {VARLEN_NAME if backend == "varlen" else backend: layers} if backend != "eager" else {}
    if dict(counts) != expected:
        got = ", ".join(f"{k}: {v}" for k, v in counts.items()) or "no registered function"
        raise AttentionError(
            f"requested attention {backend!r} but a packed forward called {got} "
            f"(expected {expected or 'the eager default'} over {layers} layers). transformers chose "
            "another kernel; check attn_implementation and that the kernel's package is installed."
        )
    delta = (packed - alone).abs().max().item()
    limit = tolerance if tolerance is not None else bound(dtype, alone.abs().max().item())
    if not delta <= limit:
        raise AttentionError(
            f"attention {backend!r} leaks between packed sequences or drops an attention argument: packed, "
            f"its hidden states differ from each sequence alone on eager by {delta:.3g} > {limit:.3g}; "
            "report this with `padless doctor` output."
        )
    kernel = ",".join(k.removeprefix("varlen:") for k in kernels) if backend == "varlen" else backend
    return {
        "backend": backend,
        "kernel": kernel,
        "calls": sum(counts.values()),
        "max_delta_hidden": delta,
        "bound": limit,
    }
