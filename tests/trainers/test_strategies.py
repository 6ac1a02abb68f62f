"""Every data-parallel strategy the scaling guide names, really in use, on 2 CPU processes over gloo, each
launched with its config from ``examples/accelerate/``: each of SFT (text, the embedded hybrid (not
under ZeRO-3: ``NOT_UNDER``) and the embedded VLM), DPO
(frozen reference model; reference log-probs precomputed by a pass shared between ranks; LoRA with the
adapters-off policy as reference), RM, GRPO (on-policy, one step off-policy: ``rollout.max_staleness:
1``, the rollout sampled ahead carried through a checkpoint per rank, and multi-turn calculator episodes
whose turn counts differ between ranks), PPO and GKD distillation (steps on data and on the student's
samples, the teacher sharded like a reference, its head gathered per chunk) under DDP, FSDP2, DeepSpeed
ZeRO-2 and ZeRO-3 gives the same per-step losses and final weights as one process with the same global
batch, and a run resumed from a mid-run checkpoint (mid-rollout for RL) continues exactly. The plans are
deliberately uneven: 3 RL prompts on 2 ranks (one rank samples a filler), eval sets and rollouts whose
micro-batch counts differ per rank; sharded engines would deadlock (the launch has a timeout) if ranks ran
different pass counts.

Tolerances (fp32): the 2-process runs sum the same per-token terms in a different order (each rank
packs its own micro-batches, gradients are reduced across ranks), so losses agree to ~1e-6 relative;
we allow 1e-5. Weights after a few AdamW steps at lr 1e-3: Adam divides each gradient entry by its own
running RMS, so an entry whose gradient is itself at round-off level (embedding rows of tokens seen once or
twice, and DPO's gradients, which are differences of nearly equal log-prob sums) moves by a visible
fraction of the learning rate; we allow 1e-4 absolute (10 % of one step's largest move, measured up to
6.0e-5: RM under ZeRO-3, two embedding rows whose gradients, ~1e-7, are round-off of the attention
backward; the same rows move as much between two CPU attention kernels in one process) plus 1e-5
relative. A wrong normaliser, a lost micro-batch or an unsynced rank moves
weights by a whole step (~1e-3). A resumed run repeats the very same operations: 1e-6 relative and
1e-7 absolute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from padless import cli

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
COMMON = [
    "model.name=tiny-llama",
    "train.logging_steps=1",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
    "train.learning_rate=1e-3",
    "train.max_tokens_per_batch=1024",
]
RL = [
    "data.train=tiny:rl",
    "rollout.prompts_per_step=3",  # odd: one rank gets a filler prompt
    "rollout.num_generations=2",
    "rollout.max_new_tokens=6",
    "rollout.mask_truncated=false",
    "reward.functions=[arithmetic_distance]",
    "train.max_steps=4",
    "train.save_steps=3",  # mid-rollout: 2 mini-batch steps per rollout
]
TRAINERS = {
    "sft": [
        "data.train=tiny:sft_eval",
        "data.eval=tiny:sft_eval",
        "data.max_length=1024",
        "train.eval_steps=3",
        "train.eval_generate=true",
        "train.eval_max_new_tokens=3",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "sft_vlm": [  # the embedded Qwen2.5-VL: pixel values and M-RoPE positions packed per rank
        "model.name=tiny-qwen2.5-vl",
        "data.train=tiny:shapes_eval",
        "data.max_length=256",
        "train.max_tokens_per_batch=512",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "sft_hybrid": [  # the embedded hybrid: its gated delta-net layers restart their state per sequence
        "model.name=tiny-qwen3.5",
        "data.train=tiny:sft_eval",
        "data.max_length=1024",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "dpo": [
        "data.train=tiny:preference_eval",
        "data.max_length=1024",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "dpo_pre": [  # reference log-probs precomputed: each rank runs its share of the pass, gathered
        "data.train=tiny:preference_eval",
        "data.max_length=1024",
        "dpo.precompute_ref_logps=true",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "dpo_lora": [  # LoRA adapters; the reference is the policy with its adapters off
        "data.train=tiny:preference_eval",
        "data.max_length=1024",
        "model.lora.r=8",
        "model.lora.dropout=0",  # dropout masks come from each rank's own generator: no match with 1 process
        "dpo.reference=adapters",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    "rm": [
        "data.train=tiny:preference_eval",
        "data.max_length=1024",
        "train.max_steps=3",
        "train.save_steps=2",
    ],
    # The untrained tiny-llama writes no number: every reward and advantage is 0 and the first step's
    # policy is the reference, so grpo and grpo_stale hold a rollout with nothing to learn to a gradient of
    # exactly 0 on any number of ranks (no-grad passes packed otherwise than the steps gave 1.4e-7 on 1
    # process, 0.0 on 2, and Adam made lr-sized steps of it). grpo_env's warm start holds GRPO with signal.
    "grpo": [*RL, "grpo.beta=0.1", "grpo.mini_batches_per_rollout=2"],
    "grpo_stale": [  # the second rollout sampled ahead, in a background thread, from the first's weights
        *RL,
        "grpo.mini_batches_per_rollout=2",
        "rollout.max_staleness=1",
        "train.save_steps=2",  # a rollout boundary, with the rollout sampled ahead carried per rank
    ],
    "ppo": [*RL, "ppo.mini_batches_per_rollout=2", "ppo.critic_warmup_steps=0"],
    "grpo_env": [  # multi-turn calculator episodes: ranks whose episodes run different turn counts
        *RL,
        "model.name=tiny-llama-arith",  # ends its turns, so episodes go on after a wrong answer
        "rollout.environment=calculator",
        "rollout.max_new_tokens=8",
        "grpo.mini_batches_per_rollout=2",
    ],
    "distill": [  # GKD from a frozen teacher sharded like a reference: steps on data and on student samples
        "data.train=tiny:sft_eval",
        "data.max_length=1024",
        "distill.mode=gkd",
        "distill.lmbda=0.5",
        "rollout.max_new_tokens=6",
        "train.max_steps=4",
        "train.save_steps=2",
    ],
}
# the step each kind resumes from (its own checkpoint state: full weights, LoRA adapters, value model, RL
# rollout plan); the VLM, hybrid and precomputed-reference variants add nothing to resume and are not
# resumed
RESUME_FROM = {
    "sft": 2,
    "dpo": 2,
    "dpo_lora": 2,
    "rm": 2,
    "grpo": 3,
    "grpo_stale": 2,
    "ppo": 3,
    "grpo_env": 3,
    "distill": 2,
}
# ZeRO-3 gathers a module's parameters at each call, and the hybrid's exact path calls each stateful layer
# once per group of sequence lengths, a count that differs between ranks: the collectives mismatch and gloo
# stops the run ("Received data size doesn't match expected size"). padless refuses it at start with that
# reason (padless.forward.hybrid.sharded_problem, tests/forward/test_hybrid.py); not run there until it does
# not.
NOT_UNDER = {("zero3", "sft_hybrid")}
CONFIGS = {
    "ddp": "ddp.yaml",
    "fsdp2": "fsdp2.yaml",
    "zero2": "deepspeed_zero2.yaml",
    "zero3": "deepspeed_zero3.yaml",
}


def argv(kind: str, out: Path, *extra: str) -> list[str]:
    """The command line of ``kind``: a key the kind (or ``extra``) sets replaces the common value (a key
    given twice on the command line is refused)."""
    given = [*COMMON, *TRAINERS[kind], f"train.output_dir={out}", *extra]
    last = {o.partition("=")[0]: o for o in given}
    return [kind.split("_")[0], *last.values()]


def losses(run: Path, key: str = "train/loss") -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    ckpt = run / f"checkpoint-{step}"
    found = {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}
    found.update(
        {f"value.{k}": v for k, v in load_file(ckpt / "value" / "model.safetensors").items()}
        if (ckpt / "value").exists()
        else {}
    )
    assert found, f"no weights in {ckpt}"
    return found


def assert_weights_close(got: dict, want: dict, atol: float, rtol: float, label: str) -> None:
    assert got.keys() == want.keys(), label
    for key in want:
        excess = ((got[key] - want[key]).abs() - (atol + rtol * want[key].abs())).max().item()
        worst = (got[key] - want[key]).abs().max().item()
        assert excess <= 0, f"{label}: {key} differs by up to {worst:.3g} (atol {atol}, rtol {rtol})"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    """Each trainer on one process with twice the accumulation: the same global batch as 2 x 1."""
    root = tmp_path_factory.mktemp("one")
    for kind in TRAINERS:
        assert cli.main(argv(kind, root / kind, "train.gradient_accumulation_steps=2")) == 0
    return {kind: root / kind for kind in TRAINERS}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(CONFIGS))
def test_strategy_really_runs_and_matches_one_process(strategy, one_process, tmp_path):
    runs = []
    kinds = [kind for kind in TRAINERS if (strategy, kind) not in NOT_UNDER]
    for kind in kinds:
        straight, resumed = tmp_path / kind, tmp_path / f"{kind}-resumed"
        runs.append({"argv": argv(kind, straight), "facts": str(tmp_path / f"{kind}.json")})
        if kind in RESUME_FROM:
            ckpt = straight / f"checkpoint-{RESUME_FROM[kind]}"
            runs.append(
                {
                    "argv": argv(kind, resumed, f"train.resume_from_checkpoint={ckpt}"),
                    "facts": str(tmp_path / f"{kind}-resumed.json"),
                }
            )
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    launch = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "examples" / "accelerate" / CONFIGS[strategy]),
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--main_process_port", str(_free_port()),
        str(Path(__file__).with_name("strategy_runs.py")), str(spec),
    ]  # fmt: skip
    result = subprocess.run(launch, env=ENV, capture_output=True, timeout=900)
    assert result.returncode == 0, result.stderr.decode()[-4000:]

    for kind in kinds:
        facts = json.loads((tmp_path / f"{kind}.json").read_text())
        assert facts["strategy"] == strategy and facts["world"] == 2, (kind, facts)
        if strategy == "ddp":
            assert facts["model_type"] == "DistributedDataParallel", (kind, facts)
        elif strategy == "fsdp2":
            assert facts["param_type"] == "DTensor", (kind, facts)
        else:
            assert facts["model_type"] == "DeepSpeedEngine", (kind, facts)
            assert facts["zero_stage"] == int(strategy[-1]), (kind, facts)

        one, two = losses(one_process[kind]), losses(tmp_path / kind)
        assert sorted(two) == sorted(one) and one, kind
        if kind == "grpo_stale":  # the first rollout on-policy, the second sampled one update ahead
            assert losses(tmp_path / kind, "rollout/staleness_max") == {1: 0.0, 3: 1.0}
        for step in one:
            assert two[step] == pytest.approx(one[step], rel=1e-5, abs=1e-7), (kind, step)
        # the norm every strategy clips with and logs. DeepSpeed computes its own: on these runs it came out
        # 2e-5 to 1.5e-4 above torch's (already at step 1, from identical weights; text and VLM alike), so
        # it is held to 5e-4; a lost or doubled micro-batch or rank changes a norm by 10 % or more.
        norms, want = losses(tmp_path / kind, "train/grad_norm"), losses(one_process[kind], "train/grad_norm")
        assert norms.keys() == want.keys() == one.keys(), kind
        # The hybrid's delta-rule recurrence carries weights that differ in round-off (sharded reduction
        # order, amplified by Adam on tiny gradients) further: under FSDP2 its step-3 norm differed by
        # 1.2e-4 relative while every loss matched to 1e-5; it is held to DeepSpeed's 5e-4 too.
        norm_rel = 5e-4 if strategy.startswith("zero") or kind == "sft_hybrid" else 1e-4
        for step in want:
            assert norms[step] == pytest.approx(want[step], rel=norm_rel), (kind, "grad_norm", step)
        last = max(one)
        # Adam (lr 1e-3) moves an element whose gradient is round-off by up to a whole lr per step, whichever
        # sign the round-off takes: weights are held to a fifth of one step (DPO's tree rows, run as parts
        # merged through their log-sum-exp, differ by up to 1.08e-4 on 2 processes, in one o_proj element,
        # while every loss matches to 1e-5); a lost or doubled micro-batch moves weights by whole steps
        assert_weights_close(
            weights(tmp_path / kind, last), weights(one_process[kind], last), 2e-4, 1e-5, f"{kind} vs 1 proc"
        )

        if kind not in RESUME_FROM:
            continue
        resumed = losses(tmp_path / f"{kind}-resumed")
        assert sorted(resumed) == [s for s in sorted(one) if s > RESUME_FROM[kind]], kind
        for step in resumed:
            assert resumed[step] == pytest.approx(two[step], rel=1e-6, abs=1e-9), (kind, "resume", step)
        assert_weights_close(
            weights(tmp_path / f"{kind}-resumed", last), weights(tmp_path / kind, last), 1e-7, 1e-6,
            f"{kind} resumed",
        )  # fmt: skip
    # the exported model is a plain Hugging Face checkpoint, whatever the strategy
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "sft" / "checkpoint-3")
    assert exported.state_dict().keys() >= weights(tmp_path / "sft", 3).keys()
    shutil.rmtree(tmp_path, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
