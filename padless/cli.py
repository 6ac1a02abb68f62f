"""Command line: ``padless check | doctor`` and the trainers."""

from __future__ import annotations

import argparse
import sys

import torch

from padless.attention import BACKENDS, AttentionError, set_varlen_kernel


def _check(args: argparse.Namespace) -> int:
    from padless.check import LAYOUTS, format_matrix, matrix_ok, probe_sequences, run_matrix, tolerance
    from padless.model import load_model, load_tokenizer, resolve_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must mean fp32 in an fp32 check
    if args.varlen_kernel:
        set_varlen_kernel(args.varlen_kernel)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, attn_implementation="varlen", dtype=dtype, device=device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seqs = probe_sequences(tokenizer)
    backends = tuple(args.backends.split(",")) if args.backends else BACKENDS
    tol = args.tolerance if args.tolerance is not None else tolerance(dtype)
    print(
        f"model {args.model}  device {device}  dtype {str(dtype).removeprefix('torch.')}  "
        f"sequence lengths {[len(s) for s in seqs]}\n"
    )
    rows = run_matrix(model, seqs, pad_id, backends, LAYOUTS)
    print(format_matrix(rows, tol))
    ok = matrix_ok(rows, tol)
    print("\nOK: every cell within tolerance" if ok else "\nFAILED: see the cells marked '!' / ERROR above")
    return 0 if ok else 1


def _doctor(args: argparse.Namespace) -> int:
    from padless.doctor import report

    print(report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="padless", description="Post-training in which padding never changes a number."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="prove per-token invariance across layouts and attention backends")
    check.add_argument(
        "--model", default="tiny-qwen2", help="embedded name, model directory or cached model id"
    )
    check.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    check.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda, else float32"
    )
    check.add_argument("--backends", help=f"comma-separated subset of {','.join(BACKENDS)}")
    check.add_argument(
        "--varlen-kernel", choices=["auto", "sdpa", "torch", "flash_attn"], help="pin varlen's kernel"
    )
    check.add_argument("--tolerance", type=float, help="max |delta log-prob| per token (default by dtype)")
    check.set_defaults(func=_check)

    doctor = sub.add_parser("doctor", help="versions, device, backends and the settings known to break")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (AttentionError, ValueError, FileNotFoundError) as e:
        print(f"padless {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
