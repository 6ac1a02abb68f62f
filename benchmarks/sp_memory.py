"""Peak memory per rank against the sequence-parallel degree, on one long packed row (CPU, gloo).

For each degree N (1, 2 and 4 by default) the same model and the same packed row run one forward and
backward of the SFT loss through the engine, split over N processes (``torchrun``; N = 1 is the engine
unsplit). Each rank measures the rise of its resident memory over the step: the peak-RSS high-water mark
is reset right before the step (``/proc/self/clear_refs``), so model loading and start-up do not count,
and what rises is the step's activations, logits and gradients. The loss is printed beside: it must be
the same number at every degree.

The model is built in code (Llama, hidden 256, 4 layers, 8 query / 4 key-value heads, vocabulary 4,096,
fp32) so that 4 divides its heads; the row is 4 sequences of equal length, so every split point falls
inside a sequence.

    python benchmarks/sp_memory.py            # a 16,384-token row, degrees 1, 2, 4
    python benchmarks/sp_memory.py --quick    # a 2,048-token row, degrees 1, 2 (the smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024 * 1024


def _status(key: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def worker(tokens: int, out: Path) -> None:
    """One rank: build the model, pack the row, reset the peak, run one forward and backward."""
    import gc

    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from transformers import LlamaConfig, LlamaForCausalLM

    from padless.forward import ranks
    from padless.forward.attention import hf_name
    from padless.forward.engine import EngineSettings, ModelEngine
    from padless.forward.packing import Example, pack
    from padless.losses import sft_token_weights

    state = PartialState(cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=tokens,
        use_cache=False,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation=hf_name("varlen")).train()
    gen = torch.Generator().manual_seed(1)
    length = tokens // 4
    batch = pack([Example(torch.randint(3, 4096, (length,), generator=gen).tolist()) for _ in range(4)])
    weights = sft_token_weights(batch.loss_mask[0], float(batch.loss_mask.sum()))
    topology = ranks.start(state.num_processes)
    engine = ModelEngine(model, settings=EngineSettings(topology=topology))
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    started = time.perf_counter()
    loss = engine(batch, logps=True, logp_weights=weights).weighted
    loss.backward()
    elapsed = time.perf_counter() - started
    peak = _status("VmHWM")
    record = {
        "degree": topology.degree,
        "rank": state.process_index,
        "tokens": tokens,
        "tokens_per_rank": tokens // state.num_processes,
        "peak_rise_mib": (peak - before) / MIB,
        "seconds": elapsed,
        "loss": loss.item(),
    }
    (out / f"rank{state.process_index}.json").write_text(json.dumps(record))
    if dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_degree(degree: int, tokens: int, threads: int) -> list[dict]:
    """Every rank's record for one degree (a fresh ``torchrun`` of ``degree`` processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(degree),
            "--master_port",
            str(_free_port()),
            __file__,
            "--worker",
            "--tokens",
            str(tokens),
            "--out",
            tmp,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"degree {degree} failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(degree)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 2,048-token row, degrees 1 and 2")
    parser.add_argument("--tokens", type=int, default=None, help="row length (a multiple of 16)")
    parser.add_argument("--degrees", type=int, nargs="+", default=None)
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens = args.tokens or (2048 if args.quick else 16384)
    if args.worker:
        worker(tokens, args.out)
        return {}
    degrees = args.degrees or ([1, 2] if args.quick else [1, 2, 4])
    rows = {n: run_degree(n, tokens, args.threads) for n in degrees}
    base = max(r["peak_rise_mib"] for r in rows[degrees[0]])
    print(f"one packed row of {tokens} tokens (4 sequences), forward + backward, fp32, CPU")
    print(
        f"{'SP':>3} {'tokens/rank':>11} {'peak MiB/rank (max)':>20} {'vs SP=1':>8} {'step s':>7} {'loss':>12}"
    )
    results = []
    for n, records in rows.items():
        peak = max(r["peak_rise_mib"] for r in records)
        seconds = max(r["seconds"] for r in records)
        loss = records[0]["loss"]
        assert all(r["loss"] == loss for r in records), "ranks of one group disagree on the loss"
        print(f"{n:>3} {tokens // n:>11} {peak:>20.1f} {peak / base:>7.2f}x {seconds:>7.2f} {loss:>12.7f}")
        results.append(
            {"degree": n, "peak_rise_mib": peak, "ratio": peak / base, "seconds": seconds, "loss": loss}
        )
    out = {"tokens": tokens, "results": results}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
