"""Command line: ``padless check | doctor | generate | schema`` and the trainers.

Every failure ends in one message naming the file, row, key or path and the fix (exit 2 for input
errors, 1 for runtime faults, 130 / 143 when interrupted / terminated); ``--debug`` or ``PADLESS_DEBUG=1``
adds the traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from padless.api import TRAINERS, offline_run
from padless.api import load_target as _load
from padless.config.choices import BACKENDS, DTYPE_NAMES, VARLEN_KERNELS
from padless.errors import InputError, describe, exit_code
from padless.forward.attention import backend_problem, validate_backend_name
from padless.run.interrupts import handled, interruption
from padless.run.logs import log_failure, setup_logging
from padless.run.strategy import deepspeed_requested


def _check_data(args: argparse.Namespace) -> int:
    """``padless check --data FILE``: the data through the model's chat template, counted by behaviour."""
    from padless.data.sources import load_tokenizer, stop_token_ids
    from padless.proof.chat_data import check_data, format_report, image_inputs

    if args.zoo:
        raise InputError("--data checks data against one model's chat template; fix: give --model, not --zoo")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    report = check_data(
        args.data,
        tokenizer,
        stop_token_ids(args.model),
        per_turn=args.per_turn,
        images=image_inputs(args.model, args.trust_remote_code),
    )
    print(format_report(report, args.model))
    if report.refused:
        print(
            f"\nFAILED: padless sft would refuse {report.refused} of {report.rows} rows (see above)",
            file=sys.stderr,
        )
        return 2
    print("\nOK: every row trains")
    return 0


def pick_device(asked: str | None) -> str:
    """``--device``: as asked (cuda refused where torch has none), else cuda when there is one."""
    if asked == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise InputError(
            f"--device cuda: torch {torch.__version__} ({build}) finds no CUDA device on this machine; fix: "
            "leave --device out (or pass --device cpu), or run on a machine with an NVIDIA GPU"
        )
    return asked or ("cuda" if torch.cuda.is_available() else "cpu")


def _check(args: argparse.Namespace) -> int:
    from padless.data.sources import load_processor
    from padless.forward.vision import is_vision_config
    from padless.proof import check, check_vision
    from padless.proof.load import load_model, load_tokenizer, pad_token_id, resolve_dtype
    from padless.proof.zoo import zoo_names
    from padless.tiny import PAD_TOKEN_ID, tiny_tokenizer

    if args.data:
        return _check_data(args)
    if args.per_turn:
        raise InputError("--per-turn says how --data is tokenized; fix: add --data FILE, or leave it out")
    if args.markdown and not args.zoo:
        raise ValueError("--markdown prints the zoo's support table: add --zoo")
    device = pick_device(args.device)
    backends = tuple(b.strip() for b in args.backends.split(",")) if args.backends else BACKENDS
    if args.zoo and not args.backends and device == "cpu":
        # flex_attention compiles one kernel per shape on CPU: minutes per architecture.
        backends = tuple(b for b in backends if b != "flex_attention")
    for backend in backends:
        validate_backend_name(backend)  # an unknown name stops before any work, with a suggestion
    requested = backends if args.backends else None
    missing = {b: problem for b in backends if (problem := backend_problem(b, device))}
    if len(missing) == len(backends):  # fail before building anything
        print("FAILED: nothing was checked:", file=sys.stderr)
        print("\n".join(f"  {b}: {problem}" for b, problem in missing.items()), file=sys.stderr)
        return 1
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must mean fp32 in an fp32 check
    kernel = args.varlen_kernel or "auto"  # pinned on every model checked
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    name = "the model zoo" if args.zoo else args.model
    if args.zoo:
        seqs = check.probe_sequences(tiny_tokenizer())
        pad_id = PAD_TOKEN_ID
    else:
        tokenizer = load_tokenizer(args.model, args.trust_remote_code)
        pad_id = pad_token_id(tokenizer)
        model = load_model(
            args.model,
            attn_implementation="varlen",
            dtype=dtype,
            device=device,
            probe=False,
            trust_remote_code=args.trust_remote_code,
            varlen_kernel=kernel,
        )
        layouts: dict[str, Any] = {"layouts": check.LAYOUTS + check.TREE_LAYOUTS}
        if is_vision_config(model.config):  # image+text chats, with their pixel values and M-RoPE rows
            seqs = check_vision.probe_examples(model, load_processor(args.model))
            layouts = {"logps": check_vision.layout_logps, "alone": check_vision.alone_logps}
        else:
            seqs = check.probe_sequences(tokenizer)
    if not args.markdown:
        print(
            f"{name}  device {device}  dtype {str(dtype).removeprefix('torch.')}  "
            f"sequence lengths {[len(s) for s in seqs]}  backends {','.join(backends)}\n"
        )
    if args.zoo:
        names = None if args.zoo == "all" else tuple(n.strip() for n in args.zoo.split(","))
        unknown = sorted(set(names or ()) - set(zoo_names()))
        if unknown:  # stops before any work
            raise ValueError(
                f"unknown zoo architecture {', '.join(unknown)}; `padless check --zoo` runs them all"
            )
        results = check.run_zoo(
            seqs, pad_id, backends, names, dtype=dtype, device=device, varlen_kernel=kernel
        )
        print(check.format_zoo(results, markdown=args.markdown))
        failed = check.zoo_failures(results, requested)
    else:
        rows, _ = check.run_matrix(model, seqs, pad_id, backends, **layouts)
        print(check.format_matrix(rows, layouts.get("layouts", check.LAYOUTS)))
        failed = check.failures(rows, requested)
    if failed:
        print("\nFAILED:\n" + "\n".join(f"  {f}" for f in failed), file=sys.stderr)
        return 1
    if not args.markdown:
        print("\nOK: every cell that ran is within its bound")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from padless.proof.doctor import report

    print(report())
    return 0


def _train(args: argparse.Namespace) -> int:
    """``padless <trainer> CONFIG key=value ...``: the config file read, then trained by the Python API."""
    from padless.api import trainer
    from padless.config.loading import load_config

    config_target = TRAINERS[args.command][0]
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # `padless sft key=value ...`: no file
        config, overrides = None, [config, *overrides]
    if config and not Path(config).exists() and re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", config):
        raise InputError(
            f"{config!r} is neither a config file nor a key=value override; fix: write {config}=<value>, "
            "or give the path of a YAML config"
        )
    metrics = trainer(args.command, load_config(_load(config_target), config, overrides, once=True)).train()
    print(" ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
    return 0


def _schema(args: argparse.Namespace) -> int:
    from padless.config.loading import json_schema

    print(json.dumps(json_schema(_load(TRAINERS[args.trainer][0])), indent=2))
    return 0


def _rm(args: argparse.Namespace) -> int:
    """``padless rm CONFIG`` trains; ``padless rm score --model M --data FILE`` scores."""
    if args.config != "score":
        return _train(args)
    parser = argparse.ArgumentParser(prog="padless rm score", description="score prompt/response rows")
    parser.add_argument("--model", required=True, help="reward model checkpoint or directory")
    parser.add_argument("--data", required=True, help="jsonl/json/parquet with prompt and response fields")
    parser.add_argument("--out", help="write scored rows here (default: print them)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model")
    opts = parser.parse_args(args.overrides)
    from padless.trainers.rm import score_file

    if opts.max_length < 1:
        raise InputError(
            f"--max-length {opts.max_length}: must be at least 1; fix: pass e.g. --max-length 4096"
        )
    if opts.out is not None and Path(opts.out).suffix not in (".jsonl", ".parquet"):
        raise InputError(
            f"--out {opts.out}: padless writes scored rows as JSON lines (.jsonl) or Parquet (.parquet), "
            f"not {Path(opts.out).suffix or 'a file without a suffix'}; fix: name it e.g. scored.jsonl or "
            "scored.parquet"
        )
    device = pick_device(opts.device)
    path = score_file(opts.model, opts.data, opts.out, opts.max_length, device, opts.trust_remote_code)
    if path:
        print(f"wrote {path}")
    return 0


def _refuse_scorer(model: str) -> None:
    """A reward model (a sequence classifier, or a LoRA adapter of one) has no language-model head to
    generate with: loading it as one would put a random head on its body and answer nonsense."""
    folder = Path(model)
    for name, key in (("config.json", "architectures"), ("adapter_config.json", "task_type")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        found = " ".join(value) if isinstance(value, list) else str(value)
        if "SequenceClassification" in found or found == "SEQ_CLS":
            raise InputError(
                f"--model {model} is a reward model ({name}: {key} {found}): it scores text and cannot "
                "generate; fix: score with `padless rm score --model ...`, or pass a policy checkpoint"
            )


def _generate(args: argparse.Namespace) -> int:
    from padless.proof.load import load_model, load_tokenizer
    from padless.rl.generate import generate

    if not 0 <= args.temperature < float("inf"):
        raise InputError(
            f"--temperature {args.temperature}: must be a finite number >= 0; fix: pass 0 for greedy "
            "decoding or e.g. 0.7 to sample"
        )
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1; fix: pass e.g. 64")
    if not all(p.strip() for p in args.prompt):
        raise InputError("--prompt is empty; fix: pass the text to answer, e.g. --prompt 'What is 2 + 3?'")
    _refuse_scorer(args.model)
    device = pick_device(args.device)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_model(
        args.model,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        trust_remote_code=args.trust_remote_code,
    )
    messages = [{"role": "user", "content": p} for p in args.prompt]
    prompts = [
        list(
            tokenizer.apply_chat_template([m], add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
        if tokenizer.chat_template and not args.raw
        else tokenizer(m["content"], add_special_tokens=False)["input_ids"]
        for m in messages
    ]
    completions = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.temperature > 0,
        temperature=args.temperature or 1.0,
    )
    for message, c in zip(messages, completions, strict=True):
        answer = tokenizer.decode(c.completion_ids, skip_special_tokens=True).strip()
        print(f"> {message['content']}\n{answer}\n")
    return 0


def _vllm_serve(args: argparse.Namespace) -> int:
    from padless.rl.vllm_server import serve

    serve(
        args.model, args.host, args.port, args.dtype, args.max_model_len, args.logprobs_mode, args.kv_cache_mb
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="padless", description="Post-training in which padding never changes a number."
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a failure (also PADLESS_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser(
        "check",
        help="prove per-token invariance across layouts and attention backends (or, with --data, what the "
        "chat template makes of a data file)",
    )
    which = check.add_mutually_exclusive_group()
    which.add_argument(
        "--model", default="tiny-qwen2", help="embedded name, model directory or cached model id"
    )
    which.add_argument(
        "--zoo",
        nargs="?",
        const="all",
        metavar="NAMES",
        help="the model zoo: padless's hand-built tiny configs and one derived from every causal-LM "
        "architecture of the installed transformers (or a comma-separated subset of them); on CPU "
        "without --backends, flex_attention is left out (it compiles a kernel per shape)",
    )
    check.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    check.add_argument("--dtype", choices=DTYPE_NAMES, help="default: bfloat16 on cuda, else float32")
    check.add_argument("--backends", help=f"comma-separated subset of {','.join(BACKENDS)}")
    check.add_argument("--varlen-kernel", choices=VARLEN_KERNELS, help="pin varlen's kernel")
    check.add_argument("--markdown", action="store_true", help="with --zoo: print the support table only")
    check.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model")
    check.add_argument(
        "--data",
        metavar="FILE",
        help="instead of the invariance matrix: tokenize this SFT data (jsonl/json/parquet, tiny:<name>, a "
        "[start:stop] slice) through the model's chat template and stop tokens, and count the rows that "
        "train and those refused, by what they hold and why",
    )
    check.add_argument("--per-turn", action="store_true", help="with --data: as data.per_turn: true does")
    check.set_defaults(func=_check)

    for name, (_, _, title) in TRAINERS.items():
        trainer = sub.add_parser(
            name, help=f"{title} from a YAML config" + (" (or: rm score ...)" if name == "rm" else "")
        )
        trainer.add_argument("config", nargs="?", help="YAML config (omit to run every default)")
        trainer.add_argument(
            "overrides", nargs=argparse.REMAINDER, help="key=value overrides, e.g. train.learning_rate=1e-4"
        )
        trainer.set_defaults(func=_rm if name == "rm" else _train)

    gen = sub.add_parser("generate", help="answer prompts with a model or checkpoint")
    gen.add_argument(
        "--model", required=True, help="checkpoint directory, model directory, id or embedded name"
    )
    gen.add_argument("--prompt", action="append", required=True, help="a user message (repeat for several)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text as it is")
    gen.add_argument("--device", choices=["cpu", "cuda"])
    gen.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the model")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "vllm-serve",
        help="run vLLM as a server for RL runs to sample from (rollout.vllm_mode: server)",
    )
    serve.add_argument(
        "--model", required=True, help="the policy's model: embedded name, folder or cached id"
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto", help="auto: bf16 on cuda")
    serve.add_argument("--max-model-len", type=int, default=4096, help="tokens per sequence, prompt included")
    serve.add_argument(
        "--logprobs-mode",
        choices=["processed_logprobs", "raw_logprobs"],
        default="processed_logprobs",
        help="processed_logprobs for rollouts with top_p 1, raw_logprobs for temperature 1",
    )
    serve.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache on vLLM's CPU build")
    serve.set_defaults(func=_vllm_serve)

    doctor = sub.add_parser("doctor", help="versions, device, backends and the settings known to break")
    doctor.set_defaults(func=_doctor)

    schema = sub.add_parser(
        "schema", help="print the JSON Schema of a trainer's config, for editors to complete and check YAML"
    )
    schema.add_argument("trainer", choices=list(TRAINERS), help="the trainer whose config files it describes")
    schema.set_defaults(func=_schema)
    return parser


def debug_from_env() -> bool:
    """``PADLESS_DEBUG``: 1/true/yes/on or 0/false/no/off (or empty); anything else is refused, so that
    ``PADLESS_DEBUG=false`` never means "on"."""
    value = os.environ.get("PADLESS_DEBUG", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise InputError(
        f"PADLESS_DEBUG={os.environ['PADLESS_DEBUG']!r} is neither on nor off; fix: set it to 1 (show "
        "tracebacks) or 0, or unset it"
    )


def settle(commands: Iterable[str]) -> None:
    """Import the code a run of each of ``commands`` runs (DeepSpeed's too where the launcher asked for it),
    then leave every object alive now out of the garbage collector's scans (``gc.freeze``): for a process that
    holds nothing short-lived yet. Code and module state live as long as the process, yet every full
    collection would walk them again, and DeepSpeed's ZeRO-3 runs one at each engine start (the trained
    model's and each frozen model's): a 2-process ZeRO-3 launch of 20 runs took 48 s, 41 s settled."""
    for command in commands:
        _load(TRAINERS[command][1])
    if deepspeed_requested():
        import deepspeed  # noqa: F401

    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure becomes one message on stderr and an exit code, never a traceback
    (unless ``--debug`` / ``PADLESS_DEBUG=1``). ``--debug`` may stand anywhere on the line. Ctrl-C and
    SIGTERM end it with 130 / 143 (see :mod:`padless.run.interrupts`)."""
    with handled():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    with offline_run():  # padless never downloads; a run that stopped gives back its lock and log file
        return _command(argv)


def _command(argv: list[str] | None) -> int:
    own_process = argv is None  # the console script, ``python -m padless.cli``: one command per process
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = "padless"
    try:
        args = build_parser().parse_args(argv)
        command = f"padless {args.command}"
        debug = debug_from_env() or debug
        setup_logging()
        if own_process and args.command in TRAINERS:
            settle([args.command])
        return args.func(args)
    except SystemExit as e:  # argparse printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else 2
    except BrokenPipeError:  # the reader stopped early (``padless schema sft | head``): not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except BaseException as e:
        e = interruption(e)  # a library's cleanup may have replaced Ctrl-C / SIGTERM on the way out
        if debug:
            traceback.print_exc()
        message = f"{command}: error: {describe(e)}"
        print(message, file=sys.stderr)
        log_failure(message)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
