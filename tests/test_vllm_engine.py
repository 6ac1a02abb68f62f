"""The vLLM engine: weights as the base model names them (LoRA merged), completions cut like HF ones, and
on a GPU with vLLM, the same greedy completions as ``generate`` before and after a weight sync."""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from padless.config import GRPOConfig
from padless.config_loading import load_config
from padless.model import load_model
from padless.rollout import HFEngine
from padless.trainers.grpo import run_grpo
from padless.trainers.rl import make_engine
from padless.vllm_engine import inference_weights, to_completions


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


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None and torch.cuda.is_available(), reason="vLLM can run here"
)
def test_vllm_engine_without_vllm_or_cuda_is_refused_clearly(tmp_path):
    cfg = load_config(GRPOConfig, None, [f"train.output_dir={tmp_path}", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match=r"rollout.engine: vllm needs .*rollout.engine: hf"):
        run_grpo(cfg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vllm_greedy_completions_follow_the_policy_through_weight_syncs(tokenizer):
    pytest.importorskip("vllm")
    from padless.vllm_engine import VLLMEngine

    cfg = load_config(GRPOConfig, None, ["rollout.max_new_tokens=12"])
    policy = load_model("tiny-qwen2", device="cuda")
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2 + 2?", "Say hi", "Count: 1 2 3")]
    hf, vllm = HFEngine(policy, tokenizer, cfg.rollout), VLLMEngine(policy, tokenizer, cfg.rollout, 64, 0)
    for change in range(2):
        if change:
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
        vllm.sync_weights()
        expected = hf.complete(prompts, 1, [0] * len(prompts), greedy=True)
        got = vllm.complete(prompts, 1, [0] * len(prompts), greedy=True)
        assert [c.completion_ids for c in got] == [c.completion_ids for c in expected], change


@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_vllm_with_sharded_weights_is_refused_at_start(strategy):
    cfg = load_config(GRPOConfig, None, ["rollout.engine=vllm"])
    with pytest.raises(ValueError, match=rf"vllm with {strategy}: .*rollout.engine: hf"):
        make_engine(cfg, torch.nn.Linear(1, 1), None, strategy)
