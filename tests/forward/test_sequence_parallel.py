"""Sequence parallelism (Ulysses) on packed rows equals one process on the whole row, per token.

The multi-process checks run ``sp_worker.py`` on 2 CPU processes over gloo: a packed row of 4 sequences
(137 tokens, padded to 138, chunk boundary inside the second sequence) through the engine split over 2
ranks against the same engine unsplit. Tolerance: :func:`padless.proof.probe.bound` (16 fp32 eps times the
largest compared magnitude): the split run attends the same tokens with the same kernel but in head
groups, so only summation order changes; a token attending across a boundary, a lost or duplicated
token or a label shifted by one moves log-probs by 1e-2 and up. Gradients: the split run's per-rank
gradients summed over the group (what the data-parallel reduction does), same bound with magnitude the
largest reference gradient entry (<1, so 16 eps = 1.9e-6; measured 3e-8 to 1.5e-7).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from padless.forward import sequence_parallel
from padless.forward.attention import SPLIT_ATTRIBUTE, VARLEN_NAME
from padless.forward.engine import EngineSettings, ModelEngine
from padless.forward.packing import IGNORE_INDEX, Example, pack
from padless.forward.ranks import Topology
from padless.forward.sequence_parallel import SequenceParallel, SequenceParallelError
from padless.forward.varlen import varlen_attention_forward
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.proof.zoo import build_zoo_model

WORKER = Path(__file__).parent / "sp_worker.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(tmp_path: Path, processes: int, degree: int) -> dict:
    out = tmp_path / "sp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(processes),
        "--master_port",
        str(free_port()),
        str(WORKER),
        str(out),
        str(degree),
    ]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def exceeded(report: dict, measured: dict) -> list[str]:
    """The compared quantities whose difference is above the fp32 round-off bound."""
    over = []
    for key, delta in measured.items():
        if not delta <= bound(torch.float32, report[key.replace("_delta", "_scale")]):
            over.append(f"{key}={delta:.3g}")
    return over


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return run_worker(tmp_path_factory.mktemp("sp2"), 2, 2)


@pytest.mark.slow
def test_split_row_equals_whole_row_per_token_and_in_losses_and_grads(two_ranks):
    assert two_ranks["degree"] == 2 and two_ranks["tokens"] == 137
    exact = two_ranks["exact"]
    assert set(exact) == {
        "logps_delta",
        "entropy_delta",
        "values_delta",
        *(f"{n}_{k}" for n in ("sft", "dpo", "grpo") for k in ("loss_delta", "grad_delta")),
    }
    assert exceeded(two_ranks, exact) == []


@pytest.mark.slow
def test_activations_recomputed_in_backward_split_as_in_forward(two_ranks):
    """Gradient checkpointing recomputes each layer in backward, outside the engine's forward: its
    attention must split again (the split is decided from the call itself)."""
    assert set(two_ranks["checkpointed"]) == set(two_ranks["exact"])
    assert exceeded(two_ranks, two_ranks["checkpointed"]) == []


@pytest.mark.slow
def test_an_off_by_one_at_the_split_fails_the_check(two_ranks):
    """Rank 1's chunk planted one token early: every compared quantity moves past the bound."""
    planted = two_ranks["planted"]
    assert len(exceeded(two_ranks, planted)) == len(planted)
    assert planted["logps_delta"] > 1e-2


# ------------------------------------------------------------------------------------------------------
# The split itself, in one process
# ------------------------------------------------------------------------------------------------------


def test_padding_is_its_own_labelless_sequence_and_chunks_keep_the_row_bounds():
    sp = sequence_parallel.SequenceParallel(degree=4, rank=2, group=None)
    batch = pack([Example(list(range(3, 10))), Example(list(range(20, 26)))])  # 13 tokens -> 16
    padded = sp.pad(batch)
    assert padded.cu_seqlens.tolist() == [0, 7, 13, 16]
    assert padded.position_ids[0, 13:].tolist() == [0, 1, 2]
    assert padded.labels[0, 12:].tolist() == [IGNORE_INDEX] * 4  # a sequence's last token predicts nothing
    chunk = sp.chunk(padded)
    assert chunk.input_ids[0].tolist() == [21, 22, 23, 24]  # tokens 8..11: the second sequence's middle
    assert chunk.position_ids[0].tolist() == [1, 2, 3, 4]  # its true positions, not 0..3
    assert chunk.labels[0].tolist() == [22, 23, 24, 25]  # shifted before the split: 25 is past the chunk
    assert chunk.cu_seqlens is padded.cu_seqlens


def test_each_model_splits_over_the_group_its_engine_put_on_it():
    """The group travels with the model, not the process: two models hold two groups (the engine puts
    its own on its model's attention layers), a deep copy keeps its model's, and the attention function
    reads the group of the layer that calls it: a chunk that fits neither is refused with each layer's
    own degree."""
    first, second = load_model("tiny-llama", probe=False), load_model("tiny-llama", probe=False)
    two, four = SequenceParallel(2, 0, group=None), SequenceParallel(4, 1, group=None)
    ModelEngine(first, settings=EngineSettings(topology=Topology(0, 1, two)))
    sequence_parallel.attach(second, four)  # what an engine of degree 4 does (tiny-llama's heads allow 2)
    layers = first.model.layers[0].self_attn, second.model.layers[0].self_attn
    assert [getattr(layer, SPLIT_ATTRIBUTE) for layer in layers] == [two, four]
    assert getattr(copy.deepcopy(first).model.layers[1].self_attn, SPLIT_ATTRIBUTE) is two
    query, cu = torch.zeros(1, 4, 3, 8), torch.tensor([0, 10], dtype=torch.int32)
    for layer, degree in zip(layers, (2, 4), strict=True):
        with pytest.raises(
            SequenceParallelError, match=f"3 queries of a 10-token row under sequence_parallel={degree}"
        ):
            varlen_attention_forward(layer, query, query, query, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_models_the_split_cannot_run_are_refused():
    model = load_model("tiny-llama", probe=False)  # 4 query heads, 2 key/value heads
    sequence_parallel.check_model(model, 2)
    with pytest.raises(SequenceParallelError, match=r"must divide .* \(4 query, 2 key/value\)"):
        sequence_parallel.check_model(model, 4)
    sdpa = load_model("tiny-llama", attn_implementation="sdpa", probe=False)
    with pytest.raises(SequenceParallelError, match="varlen attention backend only"):
        sequence_parallel.check_model(sdpa, 2)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(SequenceParallelError, match="linear_attention layers"):
        sequence_parallel.check_model(model, 2)
    hybrid = build_zoo_model("lfm2", VARLEN_NAME)  # packs exactly, but a split sequence would cut its state
    with pytest.raises(SequenceParallelError, match="carry a state from token to token"):
        sequence_parallel.check_model(hybrid, 2)


# ------------------------------------------------------------------------------------------------------
# Whole trainers: 2 processes with sequence_parallel=2 against 1 process, and resumed across degrees
# ------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "sft_long_context_sp2.yaml"
SCORER = (
    "def distinct(prompts, completions, **fields):\n    return [float(len(set(c))) for c in completions]\n"
)
COMMON = [
    "train.logging_steps=1",
    "train.progress_bar=false",
    "train.report_to=[jsonl]",
    "train.save_steps=2",
]


def trainer_runs(scorer: Path) -> dict[str, list[str]]:
    """Each trainer's argv (without output dir and degree): the long-context example on the small eval set
    (rows of up to 2,048 tokens), DPO with its reference pass shared between ranks, GRPO whose rollouts
    each sequence-parallel group samples once."""
    small = ["model.name=tiny-llama", "train.learning_rate=1e-3", "train.max_tokens_per_batch=1024"]
    sft = [
        "data.train=tiny:sft_eval",
        "train.max_tokens_per_batch=2048",
        "train.max_steps=4",
        "train.eval_steps=4",
    ]
    dpo = ["data.train=tiny:preference_eval", "data.max_length=1024", "dpo.precompute_ref_logps=true"]
    rollout = ["rollout.prompts_per_step=3", "rollout.num_generations=2", "rollout.max_new_tokens=6"]
    grpo = [
        "data.train=tiny:rl",
        *rollout,
        "rollout.mask_truncated=false",
        f"reward.functions=[{scorer}:distinct]",
        "grpo.beta=0.1",
        "grpo.mini_batches_per_rollout=2",
        "train.max_steps=2",
    ]
    return {
        "sft": ["sft", str(EXAMPLE), *COMMON, *sft],
        "dpo": ["dpo", *COMMON, *small, *dpo, "train.max_steps=2"],
        "grpo": ["grpo", *COMMON, *small, *grpo],
    }


def metrics(run: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {
        k: v
        for f in sorted((run / f"checkpoint-{step}").glob("*.safetensors"))
        for k, v in load_file(f).items()
    }


@pytest.mark.slow
def test_trainers_split_over_two_processes_equal_one_process_and_resume_across_degrees(tmp_path):
    """SFT (the long-context example), DPO and GRPO with ``sequence_parallel=2`` on 2 processes give the
    same per-step losses, eval loss and weights as 1 process; a checkpoint written at degree 1 resumes at
    degree 2 and back to the same losses. Tolerances as in ``tests/trainers/test_strategies.py``: losses
    1e-5 relative (summation order), weights after a few AdamW steps 1e-4 absolute."""
    from padless import cli

    (tmp_path / "scorer.py").write_text(SCORER)
    runs = trainer_runs(tmp_path / "scorer.py")
    one, two = tmp_path / "one", tmp_path / "two"
    for kind, argv in runs.items():
        assert cli.main([*argv, f"train.output_dir={one / kind}", "train.sequence_parallel=1"]) == 0, kind
    spec = [
        {
            "argv": [*argv, f"train.output_dir={two / k}", "train.sequence_parallel=2"],
            "facts": str(tmp_path / f"{k}.json"),
        }
        for k, argv in runs.items()
    ]
    spec.append(  # degree 1 -> 2
        {
            "argv": [
                *runs["sft"],
                f"train.output_dir={two / 'sft-resumed'}",
                "train.sequence_parallel=2",
                f"train.resume_from_checkpoint={one / 'sft' / 'checkpoint-2'}",
            ],
            "facts": str(tmp_path / "resumed.json"),
        }
    )
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(free_port()),
        str(ROOT / "tests" / "trainers" / "strategy_runs.py"), str(tmp_path / "runs.json"),
    ]  # fmt: skip
    done = subprocess.run(launch, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    back = tmp_path / "sft-back"  # degree 2 -> 1
    resume = f"train.resume_from_checkpoint={two / 'sft' / 'checkpoint-2'}"
    assert cli.main([*runs["sft"], f"train.output_dir={back}", "train.sequence_parallel=1", resume]) == 0

    for kind in runs:
        facts = json.loads((tmp_path / f"{kind}.json").read_text())
        assert facts["strategy"] == "ddp" and facts["world"] == 2, facts
        want, got = metrics(one / kind, "train/loss"), metrics(two / kind, "train/loss")
        assert sorted(got) == sorted(want) and len(want) >= 2, kind
        assert any(abs(v) > 1e-3 for v in want.values()), f"{kind}: a loss of 0 proves nothing"
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), (kind, step)
        last = max(want)
        a, b = final_weights(one / kind, last), final_weights(two / kind, last)
        assert a.keys() == b.keys()
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 1e-4, (kind, worst)
    evals = metrics(one / "sft", "eval/loss"), metrics(two / "sft", "eval/loss")
    assert evals[1][4] == pytest.approx(evals[0][4], rel=1e-5)
    straight = metrics(one / "sft", "train/loss")
    for resumed in (two / "sft-resumed", back):
        again = metrics(resumed, "train/loss")
        assert sorted(again) == [3, 4], resumed
        for step in (3, 4):
            assert again[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-7), (resumed, step)


@pytest.mark.slow
def test_four_processes_split_two_ways_under_fsdp2_equal_one_process(tmp_path):
    """SP=2 x DP=2 under FSDP2 (DTensor parameters, really in use) on 4 CPU processes: the long-context
    SFT example gives the per-step and eval losses and the weights of 1 process with twice the
    accumulation (the same global batch)."""
    from padless import cli

    argv = ["sft", str(EXAMPLE), *COMMON, "data.train=tiny:sft_eval", "train.max_tokens_per_batch=1024"]
    argv += ["train.max_steps=2", "train.eval_steps=2"]
    one = tmp_path / "one"
    assert (
        cli.main(
            [
                *argv,
                f"train.output_dir={one}",
                "train.sequence_parallel=1",
                "train.gradient_accumulation_steps=2",
            ]
        )
        == 0
    )
    four = tmp_path / "four"
    spec = [{"argv": [*argv, f"train.output_dir={four}"], "facts": str(tmp_path / "facts.json")}]
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    launch = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "examples" / "accelerate" / "fsdp2.yaml"),
        "--num_processes", "4", "--num_machines", "1", "--mixed_precision", "no",
        "--main_process_port", str(free_port()),
        str(ROOT / "tests" / "trainers" / "strategy_runs.py"), str(tmp_path / "runs.json"),
    ]  # fmt: skip
    done = subprocess.run(launch, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert (facts["strategy"], facts["param_type"], facts["world"]) == ("fsdp2", "DTensor", 4), facts
    for key in ("train/loss", "eval/loss"):
        want, got = metrics(one, key), metrics(four, key)
        assert sorted(got) == sorted(want) and want, key
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), (key, step)
    a, b = final_weights(one, 2), final_weights(four, 2)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
