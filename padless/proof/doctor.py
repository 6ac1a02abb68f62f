"""`padless doctor`: what this machine can run, and the settings known to break packed training."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from padless.config.choices import BACKENDS, VARLEN_KERNELS
from padless.forward.attention import backend_problem, varlen_kernel, varlen_kernel_problem

PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "peft",
    "datasets",
    "tokenizers",
    "safetensors",
    "flash-attn",
    "vllm",
    "trl",
)

# (setting, what goes wrong, what padless does / what to do)
KNOWN_BREAKAGES = (
    (
        "use_cache left at its default during a packed forward (eager / sdpa / flex)",
        "transformers builds a KV cache, skips its per-sequence mask: packed sequences attend to each other",
        "padless passes use_cache=False on every packed forward; do the same if you call the model yourself",
    ),
    (
        "flash_attention_2 with position_ids packing and batch size > 1",
        "sequences are only isolated at batch size 1",
        "padless passes cu_seq_lens_q/k and max_length_q/k explicitly, which isolate any shape",
    ),
    (
        "two models built from one config object (Model._from_config(cfg, attn_implementation=X))",
        "transformers writes the kernel into the shared config, so the first model switches kernel too",
        "padless gives each model its own config and checks the kernel before every forward",
    ),
    (
        "generate() on a right-padded batch (tokenizer.padding_side='right') with FlashAttention",
        "new tokens follow the padding; Qwen2 + FA2 refuses, other kernels silently decode after pad",
        "padless left-pads prompts itself for generate(), whatever padding_side the tokenizer has",
    ),
    (
        "flex_attention training on CPU",
        "PyTorch has no flex backward on CPU",
        "train with varlen (default) or sdpa on CPU; flex is forward-only there",
    ),
    (
        "Qwen2-VL / Qwen2.5-VL packed with 2D or [3, B, T] position ids",
        "M-RoPE rows restart wrongly and sequences leak",
        "use [4, B, T] position ids (text positions stacked on the three M-RoPE rows)",
    ),
)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    lines = ["padless doctor", "", "versions"]
    lines.append(f"  {'python':<14}{platform.python_version()}")
    lines += [f"  {name:<14}{_version(name)}" for name in PACKAGES]
    lines += ["", "device"]
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"  cuda          {props.name}, compute {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB"
        )
        lines.append(f"  bf16          {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        lines.append(f"  cpu           {torch.get_num_threads()} threads (no CUDA device)")
    device = torch.device("cuda" if cuda else "cpu")
    lines += ["", f"attention backends on {device.type} (training)"]
    for backend in BACKENDS:
        problem = backend_problem(backend, device, training=True)
        lines.append(f"  {backend:<18}{'ok' if problem is None else 'missing: ' + problem}")
    lines += ["", "varlen kernels"]
    for kernel in VARLEN_KERNELS[1:]:
        problem = varlen_kernel_problem(kernel, device)
        lines.append(f"  {kernel:<18}{'ok' if problem is None else 'missing: ' + problem}")
    dtype = torch.bfloat16 if cuda else torch.float32
    picked = varlen_kernel(device, dtype)
    lines.append(f"  auto picks      {picked} for {str(dtype).removeprefix('torch.')} on {device.type}")
    lines += ["", "settings known to break packed training elsewhere"]
    for setting, harm, fix in KNOWN_BREAKAGES:
        lines += [f"  - {setting}", f"      breaks: {harm}", f"      fix:    {fix}"]
    return "\n".join(lines)
