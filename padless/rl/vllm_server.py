"""vLLM as a server: generation in a process of its own (its own GPUs, or its own node), the trainer
connecting to it (``rollout.engine: vllm`` with ``rollout.vllm_mode: server``).

``padless vllm-serve --model M`` starts the server (:func:`serve`): one vLLM engine behind a small HTTP
API on ``--host:--port`` (127.0.0.1:8000 by default). Prompts go in as token ids and completions come back
as token ids with the sampled tokens' log-probs, exactly as from the colocated engine
(:mod:`padless.rl.vllm_engine`: the same sampling parameters, per-prompt seeds, stop ids and log-prob mode).
Before every rollout the trainer pushes its policy's weights (LoRA adapters merged) as one safetensors
payload over HTTP, which the server loads through vLLM's own reload (the path that works on every backend,
the CPU build included) and then empties its prefix cache.

Endpoints: ``GET /health`` (what the server runs: model config, log-prob mode, context length, weights
version), ``POST /generate`` (JSON), ``POST /weights`` (safetensors bytes). Nothing is unpickled. Requests
are served one at a time.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from accelerate import PartialState

from padless.errors import InputError
from padless.forward.engine import unwrap
from padless.proof.load import pad_token_id
from padless.rl.generate import Completion, eos_token_ids
from padless.rl.vllm_engine import (
    MIN_CPU_KV_CACHE,
    inference_weights,
    logprobs_mode,
    on_cpu,
    require_vllm,
    sampling_args,
    to_completions,
)

log = logging.getLogger(__name__)
SHAPE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
START_FIX = "start it with `padless vllm-serve --model <the policy's model>` (docs/guides/sampling.md)"


# --------------------------------------------------------------------------------------------------
# The server


class _Engine:
    """The server's vLLM engine and what /health reports about it."""

    def __init__(self, folder: Path, dtype: str, max_model_len: int, mode: str, kv_cache_mb: int, seed: int):
        vllm = require_vllm()
        # the engine in this process: weights are loaded by a function call, never pickled to a worker
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        memory: dict[str, Any] = {}
        if on_cpu():
            memory = {"enforce_eager": True}
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                memory["kv_cache_memory_bytes"] = max(kv_cache_mb << 20, MIN_CPU_KV_CACHE)
        self.vllm = vllm
        self.llm = vllm.LLM(
            model=str(folder),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,
            logprobs_mode=mode,
            **memory,
        )
        config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config", config)
        self.health = {
            "model": str(folder),
            "shape": {k: text.get(k, config.get(k)) for k in SHAPE},
            "logprobs_mode": mode,
            "max_model_len": max_model_len,
            "version": 0,
        }

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        requests = [{"prompt_token_ids": p} for p in body["prompts"]]
        params = [self.vllm.SamplingParams(**p) for p in body["params"]]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return {
            "outputs": [
                [
                    {
                        "index": o.index,
                        "token_ids": list(o.token_ids),
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason,
                        "logprobs": None
                        if o.logprobs is None
                        else [step[t].logprob for step, t in zip(o.logprobs, o.token_ids, strict=False)],
                    }
                    for o in request.outputs
                ]
                for request in outputs
            ]
        }

    def load(self, payload: bytes) -> dict[str, Any]:
        from safetensors.torch import load

        from padless.rl.vllm_engine import _reload

        weights = load(payload)
        self.llm.collective_rpc(_reload, args=(iter(weights.items()),))
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights
        self.health["version"] += 1
        return {"version": self.health["version"], "tensors": len(weights)}


def _handler(engine: _Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path != "/health":
                self._answer(404, {"error": f"no GET {self.path}; GET /health"})
                return
            self._answer(200, engine.health)

        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if self.path == "/generate":
                    self._answer(200, engine.generate(json.loads(payload)))
                elif self.path == "/weights":
                    self._answer(200, engine.load(payload))
                else:
                    self._answer(404, {"error": f"no POST {self.path}; POST /generate or /weights"})
            except Exception as e:  # the trainer reads what went wrong; the server goes on
                log.exception("POST %s failed", self.path)
                self._answer(500, {"error": f"{type(e).__name__}: {e}"})

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "auto",
    max_model_len: int = 4096,
    mode: str = "processed_logprobs",
    kv_cache_mb: int = 1024,
    seed: int = 0,
) -> None:
    """Run the server until interrupted. ``model``: an embedded name, a folder or a cached id (the weights
    it starts with; the trainer's replace them at its first sync). ``mode``: the log-probs vLLM returns,
    ``processed_logprobs`` for rollouts with top_p 1, ``raw_logprobs`` for temperature 1 (see
    :func:`padless.rl.vllm_engine.logprobs_mode`). ``kv_cache_mb``: the KV cache on a CPU build."""
    from padless.data import sources
    from padless.proof.load import load_model, load_tokenizer

    with tempfile.TemporaryDirectory(prefix="padless-vllm-serve-") as tmp:
        if sources.embedded(model):  # built in code: written out
            folder = Path(tmp)
            load_model(model, probe=False).save_pretrained(folder)
            load_tokenizer(model).save_pretrained(folder)
        else:
            folder = sources.local_folder(model)
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        engine = _Engine(folder, dtype, max_model_len, mode, kv_cache_mb, seed)
        server = HTTPServer((host, port), _handler(engine))
        log.info("vLLM server for %s on http://%s:%d (%s, %s)", model, host, server.server_port, dtype, mode)
        print(f"padless vllm-serve: ready on http://{host}:{server.server_port}", flush=True)
        try:
            server.serve_forever()
        finally:
            server.server_close()


# --------------------------------------------------------------------------------------------------
# The trainer's side


class VLLMServerEngine:
    """The sampling engine of ``rollout.vllm_mode: server``: the policy's weights pushed to the server at
    every sync, prompts sampled there. Checked at start: the server answers, runs a model of the policy's
    shape, returns the log-probs the rollout needs and holds its prompts and completions."""

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any, max_prompt_length: int):
        self.policy, self.rollout = policy, rollout
        self.url = rollout.vllm_server_url.rstrip("/")
        self.eos_ids = eos_token_ids(policy, tokenizer)
        self.pad_id = pad_token_id(tokenizer)
        if PartialState().num_processes > 1:
            raise InputError(
                f"rollout.vllm_mode: server with {PartialState().num_processes} training processes: padless "
                "pushes one trainer process's weights to a vLLM server; fix: train with one process, or use "
                "rollout.vllm_mode: colocate"
            )
        health = self._call("GET", "/health", None, starting=True)
        config = unwrap(policy).config.get_text_config()
        mine = {k: getattr(config, k, None) for k in SHAPE[1:]}
        theirs = {k: health["shape"].get(k) for k in SHAPE[1:]}
        if mine != theirs:
            raise InputError(
                f"the vLLM server at {self.url} runs {health['model']} ({theirs}), not a model of the "
                f"policy's shape ({mine}); fix: start it with the policy's model"
            )
        needed = logprobs_mode(rollout) or "raw_logprobs"
        if health["logprobs_mode"] != needed:
            raise InputError(
                f"the vLLM server at {self.url} returns {health['logprobs_mode']}, and rollout.temperature "
                f"{rollout.temperature} with top_p {rollout.top_p} needs {needed}; fix: start it with "
                f"`padless vllm-serve --logprobs-mode {needed}`"
            )
        # as the colocated engine sizes its context: a turn's prompt is the episode so far
        longest = (
            rollout.max_episode_tokens if rollout.episodes() else max_prompt_length
        ) + rollout.max_new_tokens
        if health["max_model_len"] < longest:
            raise InputError(
                f"the vLLM server at {self.url} holds {health['max_model_len']} tokens per sequence, and a "
                f"rollout's prompt and completion take up to {longest}; fix: start it with --max-model-len "
                f"{longest}, or lower data.max_prompt_length / rollout.max_new_tokens"
            )
        log.info("vLLM server at %s: %s, %s", self.url, health["model"], health["logprobs_mode"])

    def _call(self, method: str, path: str, body: bytes | None, starting: bool = False) -> Any:
        """One request; every failure names the server (at start an input error: the setting or the
        server is wrong; later a fault: the server stopped)."""
        request = urllib.request.Request(self.url + path, data=body, method=method)
        request.add_header(
            "Content-Type", "application/json" if path != "/weights" else "application/octet-stream"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.rollout.vllm_server_timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            problem = f"answered {path} with HTTP {e.code}: {detail}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            problem = f"did not answer {path} ({type(reason).__name__}: {reason})"
        message = f"the vLLM server at {self.url} (rollout.vllm_server_url) {problem}"
        if starting:
            raise InputError(f"{message}; fix: {START_FIX}, or point rollout.vllm_server_url at it")
        raise RuntimeError(f"{message}; fix: check that server (its log says why it stopped), then resume")

    def sync_weights(self) -> None:
        from safetensors.torch import save

        weights = {n: t.to("cpu", copy=True).contiguous() for n, t in inference_weights(self.policy)}
        self._call("POST", "/weights", save(weights))

    def complete(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        greedy: bool = False,
        vision: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[Completion]:
        """``vision`` is never given: :mod:`padless.rl.sampling` refuses vLLM for vision-language policies."""
        params = [sampling_args(self.rollout, n, seed, greedy, self.eos_ids) for seed in seeds]
        body = json.dumps({"prompts": prompts, "params": params}).encode()
        answer = self._call("POST", "/generate", body)
        outputs = [SimpleNamespace(outputs=[_sample(o) for o in request]) for request in answer["outputs"]]
        return to_completions(outputs, prompts, self.eos_ids, self.pad_id)


def _sample(output: dict[str, Any]) -> SimpleNamespace:
    """A sample as the server sent it, shaped as vLLM's own (``logprobs``: one ``{token: logprob}`` per
    step) for :func:`padless.rl.vllm_engine.to_completions`."""
    logprobs = output["logprobs"]
    if logprobs is not None:
        steps = zip(output["token_ids"], logprobs, strict=False)
        logprobs = [{t: SimpleNamespace(logprob=lp)} for t, lp in steps]
    return SimpleNamespace(**{**output, "logprobs": logprobs})
