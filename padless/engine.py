"""The one model engine: every forward of every trainer — training loss, evaluation, old / reference
log-probs, values, reward scores, reference precompute and generation — is a call of
:class:`ModelEngine`, with every head applied inside its ``forward``.

That is what makes sharded training work and keeps compared passes comparable: the engine is the module
accelerate prepares, so DDP / FSDP2 / DeepSpeed hooks fire on every pass (FSDP2's backward hooks are
registered on the outputs of the root module's forward: a head applied outside it never gets its
gradients), and the precision policy that wraps the prepared forward covers every pass alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from padless import sequence_parallel
from padless.model import forward_packed, forward_padded, forward_scores, unwrap
from padless.packing import PackedBatch, PaddedBatch


class EngineOutput(NamedTuple):
    """Per-token results (a NamedTuple so FSDP2 sees its tensors): ``[T]`` on a packed batch, ``[N, L]``
    on a padded one, fp32; ``None`` where not asked for."""

    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    weighted: torch.Tensor | None = None  # sum_t w_t logps_t for ``logp_weights`` w (packed batches)


class ModelEngine(torch.nn.Module):
    """A causal LM (policy / reference) or a scalar-head model (reward / value), optionally with a value
    model beside a policy (PPO's actor-critic: one optimizer, one wrapper, one checkpoint for both)."""

    def __init__(self, model: torch.nn.Module, value: torch.nn.Module | None = None):
        super().__init__()
        self.model = model
        self.value = value
        # FSDP2's transformer auto-wrap reads the layer classes here (the models' own lists, merged)
        self._no_split_modules = sorted(
            {name for m in (model, value) if m is not None for name in _no_split(m)}
        )
        self.config = unwrap(model).config  # DeepSpeed sizes its buckets from config.hidden_size
        # the running session's sequence-parallel group: every packed forward is split over it
        self.sequence_parallel = sequence_parallel.current()
        if self.sequence_parallel is not None:
            for m in (model, value):
                if m is not None:
                    sequence_parallel.check_model(m, self.sequence_parallel.degree)

    def forward(
        self,
        batch: PackedBatch | PaddedBatch | None = None,
        *,
        logps: bool = False,
        entropy: bool = False,
        temperature: float = 1.0,
        logp_weights: torch.Tensor | None = None,
        values: bool = False,
        generate: dict[str, Any] | None = None,
    ) -> EngineOutput | torch.Tensor:
        """Log-probs of ``batch.labels`` (and entropy) from the LM head, per-token values from the value
        model (or from this model's own scalar head), or — with ``generate`` — token ids from
        ``generate(**generate)`` (inside this forward, so sharded parameters are gathered for it).

        ``logp_weights`` ``[T]`` (a packed batch's loss weights, known before the forward: SFT) gives
        ``weighted = sum_t w_t logps_t``, whose gradient the head computes in its forward pass; the
        log-probs are then values only (see :func:`padless.model.logps_from_hidden`).

        Under sequence parallelism a packed batch runs split over the group (each rank its chunk, see
        :mod:`padless.sequence_parallel`) and every rank returns the whole row's results."""
        if generate is not None:
            return self.model.generate(**generate)
        kw = dict(logps=logps, entropy=entropy, temperature=temperature, values=values)
        if self.sequence_parallel is None:
            return self._forward(batch, logp_weights=logp_weights, **kw)
        if not isinstance(batch, PackedBatch):
            raise sequence_parallel.SequenceParallelError(
                "train.sequence_parallel > 1 runs packed batches only; set train.batching: tokens or packing"
            )
        return self.sequence_parallel.run(self._forward, batch, logp_weights, **kw)

    def _forward(
        self,
        batch: PackedBatch | PaddedBatch | None,
        *,
        logps: bool,
        entropy: bool,
        temperature: float,
        logp_weights: torch.Tensor | None,
        values: bool,
    ) -> EngineOutput:
        out = EngineOutput()
        if logps:
            if isinstance(batch, PackedBatch):
                tokens = forward_packed(
                    self.model, batch, entropy=entropy, temperature=temperature, logp_weights=logp_weights
                )
                out = out._replace(logps=tokens.logps, entropy=tokens.entropy, weighted=tokens.weighted)
            elif logp_weights is not None:
                raise ValueError("logp_weights applies to packed batches only")
            else:
                out = out._replace(logps=forward_padded(self.model, batch, temperature=temperature))
        if values:
            out = out._replace(
                values=forward_scores(self.value if self.value is not None else self.model, batch)
            )
        return out


def _no_split(model: torch.nn.Module) -> list[str]:
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return list(getattr(inner, "_no_split_modules", None) or [])


def as_engine(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` itself when it is (a prepared) :class:`ModelEngine`, else a new engine around it."""
    return model if isinstance(getattr(model, "module", model), ModelEngine) else ModelEngine(model)


def inner_engine(prepared: torch.nn.Module) -> ModelEngine:
    """The :class:`ModelEngine` inside a DDP / DeepSpeed wrapper (FSDP2 shards it in place)."""
    engine = getattr(prepared, "module", prepared)
    assert isinstance(engine, ModelEngine), f"expected a ModelEngine, got {type(engine).__name__}"
    return engine


def score_positions(batch: PackedBatch, pad_token_id: int | None) -> torch.Tensor:
    """``[N]`` where each sequence's score is read: its last token that is not ``pad_token_id``.

    This is where transformers' sequence classifiers (and reward models trained with them) read a score.
    With ``pad == eos`` a trailing EOS is skipped exactly as they skip it; a sequence made only of pad
    tokens is read at its last token.
    """
    last = batch.last_token_index
    if pad_token_id is None:
        return last
    positions = torch.arange(batch.num_tokens, device=last.device)
    marked = torch.where(batch.input_ids[0] != pad_token_id, positions, -1)
    best = torch.full_like(last, -1).scatter_reduce(0, batch.sequence_index, marked, "amax")
    return torch.where(best >= 0, best, last)


def score_pad_id(prepared: torch.nn.Module) -> int | None:
    """The pad id the scorer's config names (where its scores are read), as transformers reads it."""
    engine = inner_engine(prepared)
    scorer = engine.value if engine.value is not None else engine.model
    return unwrap(scorer).config.pad_token_id


def sequence_scores(prepared: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """One score per sequence ``[N]`` through the engine, read at :func:`score_positions`."""
    values = prepared(batch, values=True).values
    return values[score_positions(batch, score_pad_id(prepared))]
