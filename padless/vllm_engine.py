"""Sampling with vLLM, colocated with training: one in-process engine per rank on the rank's own GPU.

The engine starts from a copy of the policy written to a temporary directory (weights, config, tokenizer),
and before every rollout the policy's current weights are loaded into it (LoRA adapters merged first), so
completions always come from the policy being trained. Prompts go in as token ids and completions come
back as token ids: nothing is re-tokenized, and no padding exists anywhere.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from safetensors.torch import save_file

from padless.model import pad_token_id
from padless.rollout import Completion, cut_at_eos, eos_token_ids
from padless.strategy import unwrap


def require_vllm() -> Any:
    """The ``vllm`` module, or an error that says how to get it: never a quiet switch to ``generate``."""
    try:
        import vllm
    except ImportError:
        raise ValueError(
            "rollout.engine: vllm needs vLLM on a CUDA machine: pip install 'padless[vllm]', "
            "or set rollout.engine: hf"
        ) from None
    if not torch.cuda.is_available():
        raise ValueError("rollout.engine: vllm needs a CUDA GPU; on this machine set rollout.engine: hf")
    return vllm


def _lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{base-layer weight name: its active adapters' delta}`` of every LoRA layer (empty for a plain
    model): merging is computed out of place, so the base weights are never written — an in-place merge
    and unmerge in bf16 does not give the base weights back, and the adapters-off reference would drift."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in unwrap(model).named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            active = [a for a in module.active_adapters if a in module.lora_A]
            if active:
                deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in active)
    return deltas


@torch.no_grad()
def inference_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as in the base model's own checkpoint, LoRA adapters merged into new tensors:
    PEFT prefixes and LoRA factors dropped, a tied weight given once. Tensors without an adapter are the
    live parameters (detached): copy them if they must outlive the next optimizer step."""
    deltas = _lora_deltas(model)
    seen: set[int] = set()
    for full, tensor in unwrap(model).state_dict().items():
        if "lora_" in full or ".original_module." in full:
            continue
        name = full.removeprefix("base_model.model.").replace(".base_layer.", ".")
        name = name.replace(".modules_to_save.default.", ".")
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        delta = deltas.get(full)
        yield name, tensor.detach() if delta is None else tensor.detach() + delta.to(tensor.dtype)


def to_completions(
    outputs: list[Any], prompts: list[list[int]], eos_ids: set[int], pad_id: int
) -> list[Completion]:
    """vLLM ``RequestOutput`` s (one per prompt, ``n`` samples each) as completions cut after the first EOS.

    A sample that vLLM stopped on one of ``eos_ids`` it left out of ``token_ids`` (vLLM names it in
    ``stop_reason``) gets that token back, so the trained sequence ends the way the model ended it; no
    token vLLM did not sample is ever added.
    """
    completions = []
    for prompt, request in zip(prompts, outputs, strict=True):
        for sample in sorted(request.outputs, key=lambda o: o.index):
            tokens, finished = cut_at_eos(list(sample.token_ids), eos_ids, pad_id)
            stop = sample.stop_reason
            if not finished and sample.finish_reason == "stop" and isinstance(stop, int) and stop in eos_ids:
                tokens, finished = [*tokens, stop], True
            completions.append(Completion(prompt, tokens, finished))
    return completions


class VLLMEngine:
    def __init__(
        self, policy: torch.nn.Module, tokenizer: Any, rollout: Any, max_prompt_length: int, seed: int
    ):
        vllm = require_vllm()
        self.policy, self.tokenizer, self.rollout, self.vllm = policy, tokenizer, rollout, vllm
        self.eos_ids = eos_token_ids(policy, tokenizer)
        self.pad_id = pad_token_id(tokenizer)
        # in-process engine: weights are loaded by a function call, not shipped to a worker process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        state = PartialState()
        self.tmp = tempfile.TemporaryDirectory(prefix="padless-vllm-")
        self._write_policy(Path(self.tmp.name))
        dtype = next(unwrap(policy).parameters()).dtype
        self.llm = vllm.LLM(
            model=self.tmp.name,
            dtype=str(dtype).removeprefix("torch."),
            gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
            max_model_len=max_prompt_length + rollout.max_new_tokens,
            seed=seed,
            # one engine per training rank, launched by accelerate / torchrun rather than by vLLM
            distributed_executor_backend="external_launcher" if state.num_processes > 1 else None,
            enable_prefix_caching=True,
        )

    def _write_policy(self, path: Path) -> None:
        weights = {n: t.to("cpu", copy=True).contiguous() for n, t in inference_weights(self.policy)}
        unwrap(self.policy).config.save_pretrained(path)  # a PEFT model answers with its base's config
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        self.tokenizer.save_pretrained(path)

    def sync_weights(self) -> None:
        weights = list(inference_weights(self.policy))
        self.llm.apply_model(lambda model: model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights

    def complete(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        greedy: bool = False,
        vision: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[Completion]:
        if vision is not None and any(v is not None for v in vision):
            raise ValueError("padless hands no images to vLLM yet; use rollout.engine: hf with image prompts")
        r = self.rollout
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = [
            self.vllm.SamplingParams(
                n=n,
                temperature=0.0 if greedy else r.temperature,
                top_p=1.0 if greedy else r.top_p,
                max_tokens=r.max_new_tokens,
                stop_token_ids=sorted(self.eos_ids),
                ignore_eos=True,  # stop on exactly padless's EOS ids (stop_token_ids), not vLLM's own
                seed=seed,  # per prompt: a prompt's samples do not depend on what it is batched with
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return to_completions(outputs, prompts, self.eos_ids, self.pad_id)
