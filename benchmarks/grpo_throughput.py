"""GRPO throughput: padless GRPO vs TRL GRPOTrainer, generation timed separately.

Same model (the embedded ``tiny-qwen2`` by default, fp32 on CPU, TRL with the same initial weights), same
prompts (``tiny:rl``), same reward (padless's bundled ``arithmetic``), same machine, one run. Every rollout
samples ``--num-generations`` completions for each of ``--prompts-per-step`` prompts with Hugging Face
``generate`` (left-padded prompts, KV cache, ``sdpa``; no vLLM) from the plain distribution (temperature
1.0, top_p 1.0, no top-k, no repetition penalty), scores them, and makes exactly one optimizer step on them:
clipped policy loss (epsilon 0.2, group-normalised advantages) plus beta 0.04 times the k3 KL to a frozen
reference copy of the initial model, token-level loss normalisation, the same optimizer and schedule, no
dropout. Each contender runs in a fresh subprocess with the same thread count:

* ``padless``  the real padless path, built the way ``run_grpo`` builds it: ``start_rl`` (session, prompts,
  ``HFEngine``, rewards, frozen reference) and ``GRPORecipe`` on the shared ``Trainer`` loop. Reference
  log-probs and the update run on token-budget packed rows (``varlen`` attention) laid out as trees: a
  group's prompt computed once (``train.tree_packing: auto``); one rollout is one micro-batch unless it
  exceeds ``--max-tokens-per-batch``; ``grpo.loss_type: dapo`` (token-mean).
* ``padless-flat``  the same with ``train.tree_packing: off``: every completion packs its prompt again.
* ``trl``  TRL ``GRPOTrainer`` with the transformers generation path: ``per_device_train_batch_size`` =
  one rollout of completions, ``gradient_accumulation_steps=1``, ``steps_per_generation=1``,
  ``num_iterations=1`` (one rollout = one optimizer step, no stored old log-probs, as padless);
  ``loss_type="dapo"`` (sum over the step's completion tokens / their number: padless's token
  normalisation; "bnpo" would equal it here too, but only while a step is one micro-batch);
  ``use_bias_correction_kl=False`` (plain k3 KL, as padless: TRL's default multiplies it by the ratio,
  which changes its gradient); ``mask_truncated_completions=False``; ``disable_dropout=True``; its forward
  passes run on padded ``[completions, longest prompt + longest completion]`` batches.

TRL gets the prompts in conversational form (a user message, or the row's messages), which it renders with
the same chat template and add_generation_prompt; before training the script checks with TRL's own prompt
tokenization that every prompt's ids equal padless's. Both answer the same prompts at every step: TRL gets
the rows unshuffled, in the order padless's seeded rollouts draw them (prompt lengths, 20 to 284 tokens in
``tiny:rl``, set each step's padding and work). TRL needs a reference it can load by name, so the embedded
model's initial weights are saved to a temporary directory that TRL builds its reference from.

Completion lengths depend on sampling, so by default both sides generate exactly ``--max-new-tokens`` tokens
per completion (``min_new_tokens = max_new_tokens``: padless through the policy's ``generation_config``,
which its ``generate`` does not override; TRL through ``generation_kwargs``), and ``rollout.mask_truncated``
/ ``mask_truncated_completions`` are off on both sides, since every completion is then cut at the limit.
``--sampled-lengths`` lets completions end at EOS instead; compare the mean completion lengths then.

Timing runs from the end of the last warm-up step to the end of the last timed step, so sampling, reward
scoring and the reference pass (all done once per rollout, before its step) are counted with the update.
Generation is timed on its own too: padless's ``HFEngine.complete`` and TRL's ``_generate_single_turn``
(padding the prompts, ``generate``, cutting at EOS), so "w/o gen" is step time minus that. Real tokens are
those of the policy's training forward (prompt + completion tokens of every sample; padding counted as
processed only). "computed/step" counts what the training passes (reference and update forwards) ran the
model on: padded batches with their padding, packed rows, tree rows with each shared prompt once. Nothing
is evaluated, saved or logged to disk. ``benchmarks/tree_packing.py`` runs it on prompts of 1,024 tokens.

    python benchmarks/grpo_throughput.py                 # full run on CPU (2 threads)
    python benchmarks/grpo_throughput.py --quick         # smoke run, under 3 minutes
    python benchmarks/grpo_throughput.py --device cuda   # GPU, bf16
    python benchmarks/grpo_throughput.py --json results.json --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repo root
    import common
except ModuleNotFoundError:
    from benchmarks import common

CONTENDERS = ("padless", "padless-flat", "padless-per-prompt", "padless-stale1", "trl")

# Shared by both contenders: padless's GRPO defaults (TRL's would be lr 1e-6 and a linear schedule).
OPTIM = common.optimizer_settings(learning_rate=1e-5)
BETA = 0.04
EPSILON = 0.2
TEMPERATURE = 1.0
TOP_P = 1.0


# --------------------------------------------------------------------------------------------------------
# Step recording with completions and generation time


@dataclass
class RolloutRecorder(common.StepRecorder):
    """A :class:`StepRecorder` that also counts completions, their tokens and the seconds spent generating
    them, per optimizer step (one rollout each)."""

    completion_counts: list[int] = field(default_factory=list)
    completion_lengths: list[int] = field(default_factory=list)
    generation_seconds: list[float] = field(default_factory=list)
    _pending_completions: int = 0
    _pending_completion_tokens: int = 0
    _pending_generation_s: float = 0.0

    def completions(self, count: int) -> None:
        self._pending_completions += count

    def completion_tokens(self, count: int) -> None:
        self._pending_completion_tokens += count

    def generation(self, seconds: float) -> None:
        self._pending_generation_s += seconds

    def step_end(self, loss: float | None = None) -> None:
        super().step_end(loss)
        self.completion_counts.append(self._pending_completions)
        self.completion_lengths.append(self._pending_completion_tokens)
        self.generation_seconds.append(self._pending_generation_s)
        self._pending_completions, self._pending_completion_tokens, self._pending_generation_s = 0, 0, 0.0

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        steps, seconds = out["steps"], out["seconds"]
        completions = sum(self.completion_counts[self.warmup :])
        generation = sum(self.generation_seconds[self.warmup :])
        training = seconds - generation
        out.update(
            {
                "steps_per_s": steps / seconds,
                "completions": completions,
                "completions_per_step": completions / steps,
                "completions_per_s": completions / seconds,
                "mean_completion_length": sum(self.completion_lengths[self.warmup :]) / max(1, completions),
                "generation_s_per_step": generation / steps,
                "generation_share": generation / seconds,
                "step_s_without_generation": training / steps,
                "steps_per_s_without_generation": steps / training,
                "real_tokens_per_s_without_generation": out["real_tokens"] / training,
            }
        )
        return out


def timed(fn: Callable[..., Any], sink: Callable[[float], None]) -> Callable[..., Any]:
    """``fn`` with the wall time of every call handed to ``sink`` (the generation timer of both sides)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink(time.perf_counter() - started)

    return wrapper


# --------------------------------------------------------------------------------------------------------
# Reward for TRL


def arithmetic_reward(
    prompts: list[Any], completions: list[Any], answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """padless's bundled ``arithmetic`` reward as a TRL reward function: TRL hands conversational prompts and
    completions over as message lists (padless as text) and adds keyword arguments of its own."""
    from padless.rl.rewards import arithmetic

    def text(x: Any) -> str:
        return x if isinstance(x, str) else x[-1]["content"]

    return arithmetic(
        prompts=[text(p) for p in prompts], completions=[text(c) for c in completions], answer=answer
    )


# --------------------------------------------------------------------------------------------------------
# Parent: data, plan, orchestration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        default="tiny:rl",
        help="RL prompt rows with the reward's columns (jsonl/json/parquet, tiny:<name>)",
    )
    p.add_argument(
        "--max-prompt-length",
        dest="max_length",
        metavar="MAX_PROMPT_LENGTH",
        type=int,
        default=512,
        help="longest prompt in tokens (padless's data.max_prompt_length; a longer one is an error)",
    )
    p.add_argument(
        "--prompts-per-step", type=int, default=None, help="prompts per rollout (default 8; 4 with --quick)"
    )
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (group size)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="completion length limit (default 32; 16 with --quick)",
    )
    p.add_argument(
        "--sampled-lengths",
        action="store_true",
        help="let completions end at EOS instead of generating exactly --max-new-tokens on both sides",
    )
    p.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=4096,
        help="padless token budget per micro-batch (training and reference passes)",
    )
    quick = "smoke run (< 3 min): 4 prompts x 4 completions of 16 tokens, 1 warm-up + 2 timed steps"
    args = common.parse_benchmark_args(p, argv, CONTENDERS, cpu_steps=20, quick_help=quick)
    if args.prompts_per_step is None:
        args.prompts_per_step = 4 if args.quick else 8
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 32
    if min(args.prompts_per_step, args.max_new_tokens, args.max_length) < 1 or args.num_generations < 2:
        p.error(
            "--prompts-per-step, --max-new-tokens, --max-prompt-length must be >= 1, --num-generations >= 2"
        )
    return args


def trl_prompt(value: Any, templated: bool) -> Any:
    """A row's prompt as TRL should get it to render what padless renders: messages as they are, a string as
    one user message when padless applies the chat template to it, else the string itself."""
    if isinstance(value, list) or not templated:
        return value
    return [{"role": "user", "content": value}]


def load_prompts(args: argparse.Namespace) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """padless's prompt ids (for the lengths and TRL's check) and TRL's rows, read once in the parent."""
    from padless.data import load_rows, tokenize_prompts
    from padless.proof.load import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    rows = load_rows(args.data)
    prompts, _ = tokenize_prompts(rows, tokenizer, max_prompt_length=args.max_length)
    assert len(prompts) == len(rows)  # without skip_bad_rows a bad row raises: prompts[i] is rows[i]
    templated = tokenizer.chat_template is not None  # padless's rule for data.chat_template: null
    trl_rows = [
        {**p.fields, "prompt": trl_prompt(row.data["prompt"], templated)}
        for p, row in zip(prompts, rows, strict=True)
    ]
    return [p.prompt_ids for p in prompts], trl_rows


def rollout_order(args: argparse.Namespace, num_prompts: int) -> list[int]:
    """The prompt index of every prompt slot of the run's rollouts, in padless's order: padless's own
    ``RolloutRecipe.prompts_for`` run on the indices, so that TRL, fed these rows unshuffled, answers the same
    prompts at every step."""
    from types import SimpleNamespace

    from padless.trainers.rl import RolloutRecipe

    planner = RolloutRecipe.__new__(RolloutRecipe)  # only the ordering state: no model, no engine
    planner.prompts = list(range(num_prompts))
    planner.cfg = SimpleNamespace(
        rollout=SimpleNamespace(prompts_per_step=args.prompts_per_step),
        train=SimpleNamespace(seed=args.seed),
    )
    planner._order = None
    return [i for k in range(args.warmup + args.steps) for i in planner.prompts_for(k)]


def prepare(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The spec, and TRL's rows in padless's rollout order with padless's ids for them; prints one step."""
    prompt_ids, rows = load_prompts(args)
    lengths = [len(ids) for ids in prompt_ids]
    order = rollout_order(args, len(rows))
    completions = args.prompts_per_step * args.num_generations
    spec = {
        **common.base_spec(args, OPTIM),  # max_length: the longest prompt allowed
        "max_tokens_per_batch": args.max_tokens_per_batch,
        "batch_size": completions,  # TRL's per_device_train_batch_size: one rollout per optimizer step
        "beta": BETA,
        "epsilon": EPSILON,
        "rollout": {
            "prompts_per_step": args.prompts_per_step,
            "num_generations": args.num_generations,
            "max_new_tokens": args.max_new_tokens,
            "fixed_length": not args.sampled_lengths,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
        },
        "data": {
            "spec": args.data,
            "prompts": len(lengths),
            "prompt_tokens": sum(lengths),
            "mean_prompt_len": statistics.mean(lengths),
            "median_prompt_len": statistics.median(lengths),
            "max_prompt_len": max(lengths),
            "run_mean_prompt_len": statistics.mean(lengths[i] for i in order),
        },
    }
    length = "exactly" if spec["rollout"]["fixed_length"] else "up to"
    d = spec["data"]
    print(
        f"{len(lengths)} prompts (median {d['median_prompt_len']:.0f} / max {max(lengths)} tokens; "
        f"{d['run_mean_prompt_len']:.1f} on average over this run's rollouts); per step: "
        f"{args.prompts_per_step} prompts x {args.num_generations} completions of {length} "
        f"{args.max_new_tokens} tokens",
        flush=True,
    )
    return spec, {"prompt_ids": [prompt_ids[i] for i in order], "rows": [rows[i] for i in order]}


def run_contender(
    name: str, spec: dict[str, Any], prompt_ids: list[list[int]], rows: list[dict[str, Any]]
) -> dict:
    """Entry point of a contender's subprocess (``prompt_ids`` and ``rows``: TRL's, in rollout order)."""
    runner = {
        "padless": lambda: run_padless(spec),
        "padless-flat": lambda: run_padless(spec, tree="off"),
        "padless-per-prompt": lambda: run_padless(spec, per_prompt=True),
        "padless-stale1": lambda: run_padless(spec, staleness=1),
        "trl": lambda: run_trl(spec, prompt_ids, rows),
    }[name]
    return common.contender_main(runner, spec, profile_name=f"grpo-{name}")


# --------------------------------------------------------------------------------------------------------
# Contender: padless (GRPORecipe on the shared Trainer loop, built as run_grpo builds it)


def run_padless(
    spec: dict[str, Any], per_prompt: bool = False, staleness: int = 0, tree: str = "auto"
) -> dict[str, Any]:
    """``per_prompt``: one ``generate`` call per prompt (its samples only), the cost padless had before
    seeded sampling was batched again (issue 22); the samples are the same, only the batching differs.
    ``staleness``: ``rollout.max_staleness`` (the next rollout sampled in a background thread while the step
    trains); its generation time counts only sampling on the training thread (the first rollout) and
    waiting for the background sampler. ``tree``: ``train.tree_packing``."""
    import padless.run.loop as loop
    from padless.config.schema import (
        GRPOConfig,
        GRPOSettings,
        RewardSettings,
        RLDataSettings,
        RolloutSettings,
    )
    from padless.rl.sample import Sample
    from padless.rl.setup import start_rl
    from padless.trainers.grpo import GRPORecipe

    r = spec["rollout"]
    recorder = RolloutRecorder(spec["warmup"], cuda=spec["device"] == "cuda")
    run = common.Measurement(spec, recorder)
    with tempfile.TemporaryDirectory(prefix="padless-grpo-bench-") as out:
        model, train = common.padless_settings(spec, out, "tokens")
        train = train.model_copy(update={"tree_packing": tree})
        cfg = GRPOConfig(
            model=model,
            data=RLDataSettings(train=spec["data"]["spec"], max_prompt_length=spec["max_length"]),
            train=train,
            rollout=RolloutSettings(
                prompts_per_step=r["prompts_per_step"],
                num_generations=r["num_generations"],
                max_new_tokens=r["max_new_tokens"],
                temperature=r["temperature"],
                top_p=r["top_p"],
                # one generate() call per rollout, as TRL; per_prompt: one per prompt
                generation_batch_size=r["num_generations"] if per_prompt else spec["batch_size"],
                mask_truncated=False,
                max_staleness=staleness,
            ),
            reward=RewardSettings(functions=["arithmetic"]),
            grpo=GRPOSettings(beta=spec["beta"], epsilon=spec["epsilon"], loss_type="dapo"),
        )
        session, parts = start_rl(cfg, reference=cfg.grpo.beta > 0)
        common.require_device(session, spec["device"])
        if r["fixed_length"]:  # padless's generate leaves min_new_tokens to the generation config
            session.model.generation_config.min_new_tokens = r["max_new_tokens"]
        engine = parts.engine
        engine.complete = timed(engine.complete, recorder.generation)
        if staleness:  # the training thread's wait for the background sampler
            import padless.rl.ahead

            sampler = padless.rl.ahead.AheadSampler
            sampler.take = timed(sampler.take, recorder.generation)
        recipe = GRPORecipe(parts)

        trainer = loop.Trainer(recipe, session.engine(), session.tokenizer, cfg.train, session.accelerator)
        common.count_passes(recorder)

        def count(micro: loop.MicroBatch) -> None:
            examples: list[Sample] = micro.data
            real = sum(len(e) for e in examples)
            recorder.tokens(real, real, int(micro.units))
            recorder.completions(len(examples))
            recorder.completion_tokens(sum(e.drawn.length for e in examples))

        common.train_padless(trainer, run, count)
    return run.result(
        session.model,
        common.padless_layout(trainer, f"packed, budget {spec['max_tokens_per_batch']} tok"),
        common.padless_attention(run.cuda),
        reference="frozen copy (start_rl), packed forward per rollout",
    )


# --------------------------------------------------------------------------------------------------------
# Contender: TRL GRPOTrainer


def run_trl(spec: dict[str, Any], prompt_ids: list[list[int]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    import datasets
    import transformers

    trl = common.import_trl()
    model, tokenizer, attn = common.trl_model(spec)
    transformers.utils.logging.disable_progress_bar()  # saving and reloading the reference's weights
    dataset = datasets.Dataset.from_list(rows)
    r = spec["rollout"]
    recorder = RolloutRecorder(spec["warmup"], cuda=spec["device"] == "cuda")
    run = common.Measurement(spec, recorder)
    shapes: set[tuple[int, int]] = set()

    def count_rows(batch: list[dict[str, Any]]) -> None:
        # TRL's micro-batch arrives as dataset rows, each prompt repeated num_generations times: one row per
        # completion. Its tokens exist only after generation, inside the step: counted in compute_loss.
        recorder.completions(len(batch))

    def count_tokens(inputs: dict[str, Any]) -> None:
        prompt, completion = inputs["prompt_mask"], inputs["completion_mask"]
        real = int(prompt.sum()) + int(completion.sum())
        recorder.tokens(real, prompt.numel() + completion.numel(), int(completion.sum()))
        # the update's forward and the reference's, both on this padded batch
        recorder.passes((2 if spec["beta"] else 1) * (prompt.numel() + completion.numel()))
        recorder.completion_tokens(int(completion.sum()))
        shapes.add((prompt.shape[1], completion.shape[1]))

    class TimedGRPOTrainer(common.counting_trainer(trl.GRPOTrainer, run, count_rows)):
        def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            count_tokens(inputs)
            return super().compute_loss(model, inputs, *args, **kwargs)

    with tempfile.TemporaryDirectory(prefix="trl-grpo-bench-") as out:
        if not os.path.isdir(model.config._name_or_path):
            # TRL builds its reference with from_pretrained(name_or_path); unless that is a directory (the
            # embedded model has none), the initial weights (the policy's, as padless's reference) go to one.
            initial = os.path.join(out, "initial")
            model.save_pretrained(initial)
            model.config._name_or_path = initial
        args = trl.GRPOConfig(
            **common.trl_args(spec, out),
            num_generations=r["num_generations"],
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=r["max_new_tokens"],
            temperature=r["temperature"],
            top_p=r["top_p"],
            top_k=0,
            min_p=None,
            repetition_penalty=1.0,
            generation_kwargs={"min_new_tokens": r["max_new_tokens"]} if r["fixed_length"] else None,
            beta=spec["beta"],
            epsilon=spec["epsilon"],
            loss_type="dapo",
            scale_rewards="group",
            use_bias_correction_kl=False,
            mask_truncated_completions=False,
            disable_dropout=True,
            shuffle_dataset=False,  # the rows already come in padless's rollout order
            log_completions=False,
        )
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=arithmetic_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        # The same prompts, token for token: TRL's own prompt tokenization against padless's ids.
        tokenized, _, _ = trainer._tokenize_prompts([row["prompt"] for row in rows])
        mismatched = sum(list(a) != b for a, b in zip(tokenized, prompt_ids, strict=True))
        if mismatched:
            raise RuntimeError(f"TRL tokenizes {mismatched} of {len(rows)} prompts differently from padless")
        trainer._generate_single_turn = timed(trainer._generate_single_turn, recorder.generation)
        common.train_trl(trainer, run)
    widest = max(shapes, key=sum)
    return run.result(
        model,
        f"padded [{spec['batch_size']}, up to {widest[0]}+{widest[1]}]",
        attn,
        reference="frozen copy (from the initial weights), padded forward per rollout",
        trl_version=trl.__version__,
        batch_shapes=sorted(shapes),
    )


# --------------------------------------------------------------------------------------------------------
# Report


def report(spec: dict[str, Any], runs: common.Runs, env: dict[str, Any]) -> dict:
    """Print the table (median run of each contender), the padless / TRL ratios and length checks."""
    results = common.Results(spec, runs)
    cuda, chosen = results.cuda, results.chosen
    table = results.table(
        before=[
            ("compl/step", lambda r: common.fmt_number(r["completions_per_step"])),
            ("mean len", lambda r: common.fmt_number(r["mean_completion_length"], 1)),
            ("computed/step", lambda r: common.fmt_number(r["computed_tokens_per_step"])),
            ("steps/s", lambda r: common.fmt_number(r["steps_per_s"], 3)),
            ("compl/s", lambda r: common.fmt_number(r["completions_per_s"], 1)),
        ],
        after=[
            ("gen s/step", lambda r: f"{r['generation_s_per_step']:.2f}"),
            ("gen share", lambda r: f"{100 * r['generation_share']:.0f}%"),
            ("s/step w/o gen", lambda r: f"{r['step_s_without_generation']:.2f}"),
            ("tok/s w/o gen", lambda r: common.fmt_number(r["real_tokens_per_s_without_generation"])),
        ],
    )
    memory_key = "cuda_peak_mib" if cuda else "peak_rss_mib"
    ratios = {}
    if "padless" in chosen and "padless-flat" in chosen:
        ratios["padless tree / padless flat"] = {
            "fewer_tokens": results.ratio("padless-flat", "padless", "computed_tokens_per_step"),
            "steps_per_s": results.ratio("padless", "padless-flat", "steps_per_s"),
            "completions_per_s": results.ratio("padless", "padless-flat", "completions_per_s"),
            "real_tokens_per_s": results.ratio("padless", "padless-flat", "real_tokens_per_s"),
            "without_generation": results.ratio("padless", "padless-flat", "steps_per_s_without_generation"),
            "generation": results.ratio("padless-flat", "padless", "generation_s_per_step"),
            "memory": results.ratio("padless", "padless-flat", memory_key),
        }
    if "padless" in chosen and "padless-per-prompt" in chosen:
        ratios["padless / padless per-prompt generate"] = {
            "steps_per_s": results.ratio("padless", "padless-per-prompt", "steps_per_s"),
            "completions_per_s": results.ratio("padless", "padless-per-prompt", "completions_per_s"),
            "real_tokens_per_s": results.ratio("padless", "padless-per-prompt", "real_tokens_per_s"),
            "without_generation": results.ratio(
                "padless", "padless-per-prompt", "steps_per_s_without_generation"
            ),
            "generation": results.ratio("padless-per-prompt", "padless", "generation_s_per_step"),
            "memory": results.ratio("padless", "padless-per-prompt", memory_key),
        }
    if "padless-stale1" in chosen and "padless" in chosen:
        ratios["padless stale 1 / padless on-policy"] = {
            "steps_per_s": results.ratio("padless-stale1", "padless", "steps_per_s"),
            "completions_per_s": results.ratio("padless-stale1", "padless", "completions_per_s"),
            "real_tokens_per_s": results.ratio("padless-stale1", "padless", "real_tokens_per_s"),
            "without_generation": None,
            "generation": results.ratio("padless", "padless-stale1", "generation_s_per_step"),
            "memory": results.ratio("padless-stale1", "padless", memory_key),
        }
    if "padless" in chosen and "trl" in chosen:
        ratios["padless / TRL"] = {
            "fewer_tokens": results.ratio("trl", "padless", "computed_tokens_per_step"),
            "steps_per_s": results.ratio("padless", "trl", "steps_per_s"),
            "completions_per_s": results.ratio("padless", "trl", "completions_per_s"),
            "real_tokens_per_s": results.ratio("padless", "trl", "real_tokens_per_s"),
            "without_generation": results.ratio("padless", "trl", "steps_per_s_without_generation"),
            "generation": results.ratio("trl", "padless", "generation_s_per_step"),  # speed: time inverted
            "memory": results.ratio("padless", "trl", memory_key),
        }

    d, r = spec["data"], spec["rollout"]
    print()
    print(
        f"GRPO throughput on {common.machine_line(spec, env)}, data {d['spec']} ({d['prompts']} prompts, "
        f"median {d['median_prompt_len']:.0f} / max {d['max_prompt_len']} tokens), reward arithmetic, beta "
        f"{spec['beta']}, frozen reference model"
    )
    print(results.runs_line(spec))
    lengths = "exactly (min_new_tokens = max_new_tokens)" if r["fixed_length"] else "up to (ending at EOS)"
    print(
        f"per step: {r['prompts_per_step']} prompts x {r['num_generations']} completions of {lengths} "
        f"{r['max_new_tokens']} tokens, temperature {r['temperature']}, top_p {r['top_p']}, HF generate; one "
        f"optimizer step per rollout; padless token budget {spec['max_tokens_per_batch']}"
    )
    print()
    print(table)
    print()
    columns = [
        ("fewer computed", "fewer_tokens", 14),
        ("steps/s", "steps_per_s", 8),
        ("compl/s", "completions_per_s", 8),
        ("real tok/s", "real_tokens_per_s", 10),
        ("steps/s w/o gen", "without_generation", 15),
        ("gen speed", "generation", 9),
        ("peak CUDA" if cuda else "peak RSS", "memory", 9),
    ]
    common.print_ratios(ratios, columns)
    if "padless" in chosen and "trl" in chosen:
        means = {name: chosen[name]["mean_completion_length"] for name in ("padless", "trl")}
        if abs(means["padless"] - means["trl"]) > 0.02 * max(means.values()):
            print(
                f"note: mean completion lengths differ (padless {means['padless']:.1f}, TRL "
                f"{means['trl']:.1f} tokens): generation and training work per step are not the same"
            )
    results.print_failures()
    return {"ratios": ratios, "table": table}


def progress(r: dict[str, Any]) -> str:
    return (
        f"{r['steps_per_s']:.3f} steps/s, {r['completions_per_s']:.1f} compl/s (mean length "
        f"{r['mean_completion_length']:.1f}), generation {100 * r['generation_share']:.0f}% of step time, "
        f"{common.throughput_line(r)}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return common.run_benchmark(args, prepare, run_contender, progress, report)


if __name__ == "__main__":
    sys.exit(main())
