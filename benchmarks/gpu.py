"""The GPU run prepared in advance: run it first whenever a GPU is lent. Under 8 minutes on one H100.

    python benchmarks/gpu.py --out gpu-results.json    # on the lent GPU
    python benchmarks/gpu.py --quick                    # the same steps on CPU, a miniature, padless only

It builds a Qwen2.5-0.5B-shaped model in code (hidden 896, 24 layers, 14 query / 2 key-value heads, MLP
4,864, vocabulary 151,936, tied embeddings; random weights from seed 0, bf16; nothing is downloaded) and
saves it with the embedded tokenizer, then records, each side by side in one run:

1. ``padless check`` on the GPU (bf16): the invariance matrix on varlen (the real fused kernel) and sdpa,
   with the tree cells: a tree row's branches, run through the kernel's own bottom-right causal alignment,
   against each sequence alone, and its gradient against the flat packed row.
2. SFT throughput, padless packed vs TRL padding-free (``benchmarks/sft_throughput.py``).
3. DPO and GRPO throughput on prompts of about 1,024 tokens, padless tree rows vs padless flat vs TRL
   (``benchmarks/tree_packing.py``): tokens computed, steps/s with and without generation, peak memory.
4. For every contender its model FLOPs utilisation: 6 N FLOPs per token for the passes that train (forward
   and backward), 2 N for the no-grad ones (a reference forward), N the parameters every token's forward
   multiplies (the LM head included, embeddings looked up not), over the GPU's dense bf16 peak; attention
   FLOPs are not counted, so it is a lower bound, and a padded batch's padding counts as computed.

Everything printed is also written to ``--out`` (JSON). ``docs/development/gpu.md`` keeps the latest figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
    import sft_throughput
    import tree_packing
except ModuleNotFoundError:
    from benchmarks import common, sft_throughput, tree_packing

# Dense bf16 peak FLOP/s by GPU name (vendor datasheets, no sparsity): MFU's denominator.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# --quick: the same shape in miniature (GQA 2:1, q/k/v biases, tied embeddings), fast on a CPU
MINIATURE = {
    **QWEN25_05B,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 4096,
}


def build_model(folder: Path, shape: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A Qwen2 model of ``shape`` from seed 0 saved in ``folder`` with the embedded tokenizer; its facts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from padless.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(
        **shape,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    # what each token's forward multiplies: every weight but the embedding lookup, plus the (tied) head
    flop_params = total - embedding + model.get_output_embeddings().weight.numel()
    return {"parameters": total, "flop_parameters": flop_params, "shape": shape, "dtype": dtype}


def run_check(folder: Path, device: str) -> dict[str, Any]:
    """``padless check`` on the model: the matrix with tree cells, its exit status and how long it took."""
    from padless import cli

    started = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(["check", "--model", str(folder), "--device", device, "--backends", "varlen,sdpa"])
    print(printed.getvalue(), flush=True)
    return {"returncode": status, "output": printed.getvalue(), "seconds": time.perf_counter() - started}


def mfu(result: dict[str, Any], flop_params: int, peak: float | None, trained_share: float) -> float | None:
    """Model FLOPs utilisation of one contender's timed window (see the module docstring): ``trained_share``
    of the computed tokens ran forward and backward, the rest forward only."""
    computed = result.get("computed_tokens_per_step")
    if not peak or not computed:
        return None
    seconds = result["seconds"] / result["steps"]
    if "generation_s_per_step" in result:  # GRPO: the training passes only
        seconds -= result["generation_s_per_step"]
    flops = flop_params * computed * (6 * trained_share + 2 * (1 - trained_share))
    return flops / seconds / peak


def peak_flops(device: str) -> tuple[str, float | None]:
    if device != "cuda":
        return "cpu", None
    name = common.gpu_name() or "?"
    return name, next((v for k, v in PEAK_BF16.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a miniature of the model, on CPU: the suite's smoke")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="cuda, or cpu with --quick")
    p.add_argument("--out", default="gpu-results.json", help="write every result here (JSON)")
    args = p.parse_args(argv)
    device = args.device or ("cpu" if args.quick else "cuda")
    common.hide_devices_for_cpu(device)
    started = time.perf_counter()
    status = 0
    results: dict[str, Any] = {"environment": common.environment()}
    gpu, peak = peak_flops(device)
    results["environment"].update({"gpu": gpu, "peak_bf16_flops": peak})
    with tempfile.TemporaryDirectory(prefix="padless-gpu-") as folder:
        model_dir = Path(folder) / "qwen2.5-0.5b-shaped"
        shape = MINIATURE if args.quick else QWEN25_05B
        facts = build_model(model_dir, shape, "float32" if device == "cpu" else "bfloat16")
        results["model"] = facts
        print(f"model: Qwen2.5-0.5B-shaped, {facts['parameters'] / 1e6:.1f}M parameters, {gpu}", flush=True)
        results["check"] = run_check(model_dir, device)
        status = max(status, results["check"]["returncode"])

        steps = ["--warmup", "0", "--steps", "1"] if args.quick else ["--warmup", "1", "--steps", "5"]
        sft_json = Path(folder) / "sft.json"
        contenders = "padless-packed" if args.quick else "padless-packed,trl-padding-free"
        sft_args = ["--model", str(model_dir), "--device", device, "--contenders", contenders, *steps]
        sft_args += ["--json", str(sft_json), *(["--quick"] if args.quick else [])]
        status = max(status, sft_throughput.main(sft_args))
        tree_json = Path(folder) / "tree.json"
        tree_args = ["--model", str(model_dir), "--device", device, "--json", str(tree_json)]
        tree_args += ["--quick", "--no-flat"] if args.quick else ["--steps", "3", "--pairs", "32"]
        status = max(status, tree_packing.main(tree_args))
        for name, path in (("sft", sft_json), ("tree", tree_json)):
            if path.exists():
                results[name] = json.loads(path.read_text())

    print(f"\nMFU on {gpu} (dense bf16 peak {peak / 1e12:.0f} TFLOP/s)" if peak else f"\nMFU: n/a on {gpu}")
    utilisation: dict[str, float | None] = {}
    sft_runs = results.get("sft", {}).get("runs", {})
    for name, runs in sft_runs.items():
        utilisation[f"SFT {name}"] = mfu(runs[0], facts["flop_parameters"], peak, 1.0) if runs else None
    for workload, found in results.get("tree", {}).get("workloads", {}).items():
        for name, runs in found.get("runs", {}).items():  # policy update and reference forward: half each
            utilisation[f"{workload.upper()} {name}"] = (
                mfu(runs[0], facts["flop_parameters"], peak, 0.5) if runs else None
            )
    for label, value in utilisation.items():
        print(f"  {label:32s} {'-' if value is None else f'{100 * value:.1f}%'}")
    results["mfu"] = utilisation
    results["seconds"] = time.perf_counter() - started
    common.write_json(args.out, results)
    print(f"\n{results['seconds']:.0f} s in all; wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
