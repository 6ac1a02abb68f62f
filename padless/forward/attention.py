"""Attention backends by name: which exist, which can run here, which kernel ``varlen`` runs, and which
backend a model dispatches to.

What a layer's attention runs with travels on the layer itself, never in process state: transformers
passes the layer to the attention function, which reads there the kernel pinned behind ``varlen``
(:func:`pin_kernel`) and the sequence-parallel group the layer's rows are split over
(:func:`padless.forward.sequence_parallel.attach`). Copies of a model carry them, and two models in one
process, in two threads (a sampler beside a trainer), each run their own.

``varlen`` is padless's own backend (:mod:`padless.forward.varlen`, the kernel); transformers' own ``sdpa``,
``eager``, ``flex_attention`` and ``flash_attention_2`` are driven through position_ids that restart per
sequence, with no attention mask and no KV cache (with a cache, transformers skips its per-sequence mask
and packed sequences silently attend to each other). :mod:`padless.proof.probe` proves at load time that the
backend asked for is the one running, and computes what the model's own forward computes.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from padless.config.choices import BACKENDS, VARLEN_KERNELS
from padless.errors import AttentionError

VARLEN_NAME = "padless_varlen"  # the name under which transformers sees our backend
FUSED_DTYPES = (torch.float16, torch.bfloat16)  # all that flash-attn and PyTorch's varlen_attn take
KERNEL_ATTRIBUTE = "padless_varlen_kernel"  # the kernel pinned behind varlen, on every module of a model
SPLIT_ATTRIBUTE = "padless_sequence_parallel"  # the sequence-parallel group a layer's rows are split over


def hf_name(backend: str) -> str:
    """The ``attn_implementation`` string transformers needs for a padless backend name."""
    validate_backend_name(backend)
    return VARLEN_NAME if backend == "varlen" else backend


def validate_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        close = difflib.get_close_matches(str(backend), BACKENDS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttentionError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}.{hint}"
        )


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def torch_varlen_available() -> bool:
    """PyTorch's ``varlen_attn`` as padless calls it: with ``window_size`` (PyTorch 2.11+; 2.10's took only
    ``is_causal``). GQA without ``enable_gqa`` (before 2.13) is served by repeating the kv heads."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    from torch.nn.attention.varlen import varlen_attn

    return "window_size" in inspect.signature(varlen_attn).parameters


def backend_problem(
    backend: str, device: torch.device | str, training: bool = False, kernel: str = "auto"
) -> str | None:
    """Why ``backend`` cannot run on ``device`` (``None`` when it can), with the fix; ``kernel``: the one
    pinned behind ``varlen``."""
    validate_backend_name(backend)
    cuda = torch.device(device).type == "cuda"
    if backend == "flash_attention_2":
        if not cuda:
            return "flash_attention_2 needs a CUDA device; use attn_implementation=varlen on CPU"
        if not flash_attn_installed():
            return "flash_attention_2 needs the flash-attn package: pip install 'padless[flash]'"
    if backend == "flex_attention" and training and not cuda:
        return (
            "flex_attention has no backward pass on CPU (PyTorch: 'FlexAttention does not support backward "
            "on CPU'); train with attn_implementation=varlen or sdpa, or run on CUDA"
        )
    if backend == "varlen" and kernel != "auto":
        return varlen_kernel_problem(kernel, torch.device(device))
    return None


def require_backend(
    backend: str, device: torch.device | str, training: bool = False, kernel: str = "auto"
) -> None:
    problem = backend_problem(backend, device, training, kernel)
    if problem:
        raise AttentionError(problem)


def available_backends(device: torch.device | str, training: bool = False) -> list[str]:
    return [b for b in BACKENDS if backend_problem(b, device, training) is None]


def validate_kernel_name(kernel: str) -> None:
    if kernel not in VARLEN_KERNELS:
        raise AttentionError(f"unknown varlen kernel {kernel!r}; choose one of {', '.join(VARLEN_KERNELS)}")


def pin_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Pin the kernel behind ``varlen`` on every module of ``model`` (``auto``: picked per call from device
    and dtype): each of its layers runs it, in its forward and in a backward that recomputes it."""
    validate_kernel_name(kernel)
    for module in model.modules():
        setattr(module, KERNEL_ATTRIBUTE, kernel)


def kernel_of(module: torch.nn.Module) -> str:
    """The kernel pinned behind ``varlen`` on ``module`` (``auto`` where none was)."""
    return getattr(module, KERNEL_ATTRIBUTE, "auto")


@contextlib.contextmanager
def pinned(model: torch.nn.Module, kernel: str) -> Iterator[None]:
    """``kernel`` pinned on ``model`` inside the block, its own pin again after it."""
    before = kernel_of(model)
    pin_kernel(model, kernel)
    try:
        yield
    finally:
        pin_kernel(model, before)


def varlen_kernel_problem(kernel: str, device: torch.device) -> str | None:
    if kernel in ("torch", "flash_attn") and device.type != "cuda":
        return f"varlen kernel {kernel!r} needs a CUDA device; use varlen_kernel=sdpa (or auto) on CPU"
    if kernel == "torch" and not torch_varlen_available():
        return (
            f"varlen kernel 'torch' needs torch.nn.attention.varlen with window_size (PyTorch >= 2.11; this "
            f"is {torch.__version__}); upgrade torch, install flash-attn, or use varlen_kernel=sdpa"
        )
    if kernel == "flash_attn" and not flash_attn_installed():
        return "varlen kernel 'flash_attn' needs the flash-attn package: pip install 'padless[flash]'"
    return None


def varlen_kernel(device: torch.device, dtype: torch.dtype, choice: str = "auto") -> str:
    """Which kernel ``varlen`` runs for tensors on ``device`` in ``dtype``, ``choice`` pinned.

    CUDA half precision uses flash-attn when installed, else PyTorch's ``varlen_attn``; everything else
    (CPU, or fp32 on CUDA, which the flash kernels do not take) runs exact attention through SDPA
    (``sdpa``: sequences grouped by length, see :class:`padless.forward.varlen.SequenceGroups`). A layer that
    asks for something the fused kernel lacks runs exact too (see
    :func:`padless.forward.varlen.varlen_attention_forward`).
    """
    if choice == "auto":
        if device.type == "cuda" and dtype in FUSED_DTYPES:
            if flash_attn_installed():
                return "flash_attn"
            if torch_varlen_available():
                return "torch"
        return "sdpa"
    problem = varlen_kernel_problem(choice, device)
    if problem:
        raise AttentionError(problem)
    if choice != "sdpa" and dtype not in FUSED_DTYPES:
        raise AttentionError(f"varlen kernel {choice!r} runs fp16/bf16 only, got {dtype}; use dtype=bfloat16")
    return choice


def runtime_context(backend: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Settings a backend needs around each forward.

    flex_attention on CPU: inductor miscompiles the dynamic-shape recompile that a second packed length
    triggers (C++ compile error in the flex template, torch 2.13), so compile each length statically.
    """
    if backend == "flex_attention" and torch.device(device).type == "cpu":
        from torch._dynamo import config as dynamo_config

        return dynamo_config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()


def text_config(model: torch.nn.Module) -> Any:
    """The config of the language model (a vision-language model's text config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_in_use(model: torch.nn.Module) -> str:
    """The padless backend name the model's config dispatches to."""
    impl = text_config(model)._attn_implementation
    return "varlen" if impl == VARLEN_NAME else str(impl)


# Layer kinds that mix tokens only through attention, which padless isolates per sequence (chunked
# attention, Llama 4: varlen attends within each chunk of each sequence, see
# padless.forward.varlen.attention_chunk; transformers' masks count chunks from the packed position ids).
# Attention whose keys an indexer chooses per query (DeepSeek-V3.2 / GLM-5 sparse attention): varlen takes
# the chosen keys as ``indices`` and keeps them within each sequence (padless.forward.varlen).
INDEXED_LAYER_TYPES = frozenset({"indexed_attention"})
ATTENTION_LAYER_TYPES = (
    frozenset({"full_attention", "sliding_attention", "chunked_attention"}) | INDEXED_LAYER_TYPES
)


# Layer kinds that call the attention function once each: attention layers, and Falcon-H1's hybrid blocks
# (attention beside a Mamba mixer). Stateful and token-wise kinds call none.
CALLS_ATTENTION = ATTENTION_LAYER_TYPES | {"hybrid"}


def attention_layers(model: torch.nn.Module) -> int:
    """How many calls of the attention function one forward of ``model`` makes: one per layer, except
    the layers ``layer_types`` names as stateful or token-wise (a hybrid's delta-net, Mamba, MLP blocks)."""
    config = text_config(model)
    types = getattr(config, "layer_types", None)
    if not types:
        return config.num_hidden_layers
    return sum(t in CALLS_ATTENTION for t in types)


def row_position_problem(model: torch.nn.Module, backend: str, sequence_parallel: bool = False) -> str | None:
    """Why ``backend`` would see each token's place in the packed row instead of in its sequence
    (``None``: it would not).

    Llama 4's NoPE layers with ``attn_temperature_tuning`` scale queries by a token's position taken
    from ``arange`` over the row the layer receives (not from ``position_ids``): packed, from
    ``floor_scale`` tokens on, later sequences would be scaled by their place in the row. Only
    ``varlen`` moves each scale to the token's place in its sequence, and only on whole rows (under
    sequence parallelism each rank's layer sees its own chunk of the row).
    """
    config = text_config(model)
    if not getattr(config, "attn_temperature_tuning", False) or 0 not in (
        getattr(config, "no_rope_layers", None) or ()
    ):
        return None
    if backend == "varlen" and not sequence_parallel:
        return None
    where = "under sequence parallelism" if sequence_parallel else f"on {backend!r}"
    fix = "set train.sequence_parallel: 1" if sequence_parallel else "use attn_implementation=varlen"
    name = getattr(config, "model_type", type(model).__name__)
    return (
        f"{name} scales the queries of its NoPE layers by each token's place in the whole row "
        f"(attn_temperature_tuning, from {config.floor_scale} tokens on), which padless cannot move to "
        f"the token's place in its own sequence {where}; {fix}"
    )


def assert_attention(model: torch.nn.Module, backend: str) -> None:
    """Cheap guard before each forward, on what can change between forwards: the config. It still
    dispatches to ``backend`` (transformers writes ``attn_implementation`` into config objects, so a
    second model built from a shared config can silently switch this one's kernel), and ``backend`` does
    not see row positions (:func:`row_position_problem`). Which layers carry a state across sequences is
    the model's structure, refused once where it is loaded and proven
    (:func:`padless.forward.hybrid.require_packing`), not walked at every forward.
    """
    problem = row_position_problem(model, backend)
    if problem:
        raise AttentionError(problem)
    running = attention_in_use(model)
    if running != backend:
        raise AttentionError(
            f"model was loaded with attention {backend!r} but its config now dispatches to {running!r}. "
            "Another model built from the same config object switched it: give every model its own config "
            "(padless.proof.load.load_model does)."
        )
