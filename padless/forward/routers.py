"""A mixture of experts' own training objective: the router load-balancing loss its forward adds.

transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, Qwen3-Next, ...) define
``load_balancing_loss_func`` in their modeling module and, given labels and ``output_router_logits``,
return ``NLL + router_aux_loss_coef * load_balancing_loss``. padless trains the same term
(:func:`padless.losses.load_balancing_loss`) from the router logits of the packed forward, over real
tokens only, with the config's coefficient or ``model.router_aux_loss_coef`` (0 turns it off), as TRL
does. The load-time probe (:mod:`padless.proof.probe`) compares padless's loss with the model's own
``forward(labels=...).loss`` on each sequence alone, so a term padless does not reproduce is refused.

The loss is a statistic of a batch, not a sum over tokens. The engine computes it for each training
forward (one micro-batch) and records it (:class:`RouterRecord`); the loop adds each forward's value
weighted by its share of the step's real tokens, over accumulation and data-parallel ranks: with one
micro-batch per step it is the model's own value on that batch, and equal micro-batches average as
TRL's accumulation does.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from padless.errors import InputError
from padless.losses import load_balancing_loss

log = logging.getLogger(__name__)

# why sequence parallelism is refused with the term on (a chunk's routers see part of each row)
SPLIT_ROWS = (
    "the router load-balancing loss is a statistic of whole rows, which train.sequence_parallel > 1 splits; "
    "set model.router_aux_loss_coef: 0 or train.sequence_parallel: 1"
)
# the config keys of the coefficient, as modeling code names it (JetMoe: aux_loss_coef)
COEF_KEYS = ("router_aux_loss_coef", "aux_loss_coef")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / PEFT wrappers."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def defines_router_loss(model: torch.nn.Module) -> bool:
    """Whether the model's own modeling code adds a load-balancing loss: its module defines
    ``load_balancing_loss_func`` and its config declares ``output_router_logits``."""
    inner = base_model(model)
    module = sys.modules.get(type(inner).__module__)
    text = inner.config.get_text_config()
    return hasattr(module, "load_balancing_loss_func") and hasattr(text, "output_router_logits")


def _count(model: torch.nn.Module, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` set to an int on the model (what its own forward passes), else its config."""
    text = model.config.get_text_config()
    for owner in (model, text):
        for key in keys:
            if isinstance(value := getattr(owner, key, None), int) and not isinstance(value, bool):
                return value
    return None


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing term of one model: ``coef * load_balancing_loss(router logits)``."""

    coef: float
    num_experts: int
    top_k: int
    configured: float  # the model config's coefficient (what its own forward uses)

    @classmethod
    def of(cls, model: torch.nn.Module, override: float | None = None) -> RouterLoss | None:
        """The term ``model``'s own objective adds, at ``override`` (``model.router_aux_loss_coef``) or its
        config's coefficient; ``None`` where its objective has none. An override on such a model would do
        nothing: refused."""
        inner = base_model(model)
        if not defines_router_loss(inner):
            if override is not None:
                raise InputError(
                    f"model.router_aux_loss_coef is {override} but {type(inner).__name__} adds no router "
                    "load-balancing loss to its objective (not a mixture of experts whose modeling code "
                    "defines one), so it would change nothing; remove model.router_aux_loss_coef"
                )
            return None
        text = inner.config.get_text_config()
        configured = float(next((v for k in COEF_KEYS if (v := getattr(text, k, None)) is not None), 0.0))
        experts, top_k = _count(inner, EXPERT_KEYS), _count(inner, TOP_K_KEYS)
        if experts is None or top_k is None:
            raise InputError(
                f"{type(inner).__name__} defines a router load-balancing loss but its config names no number "
                f"of experts ({' / '.join(EXPERT_KEYS)}) or experts per token ({' / '.join(TOP_K_KEYS)}); "
                "set model.router_aux_loss_coef: 0 to train without it"
            )
        return cls(configured if override is None else float(override), experts, top_k, configured)

    def __call__(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The load-balancing loss (without the coefficient) over the given router logits."""
        return load_balancing_loss(tuple(router_logits), self.num_experts, self.top_k)

    def describe(self, name: str, override: float | None) -> str:
        """What the run log says about the term."""
        if self.coef == 0:
            why = "model.router_aux_loss_coef: 0" if override is not None else "its config's coefficient is 0"
            return f"{name}: the router load-balancing loss is off ({why})"
        source = "model.router_aux_loss_coef" if override is not None else "the model's config"
        return (
            f"{name}: training the router load-balancing loss, coefficient {self.coef:g} (from {source}; "
            f"the config says {self.configured:g}), {self.num_experts} experts top-{self.top_k}, each "
            "micro-batch weighted by its share of the step's tokens; logged as train/aux_loss"
        )


class RouterRecord:
    """The router terms of one micro-batch's training forwards: ``sum_f coef * aux_f * tokens_f`` (the
    gradient carrier) and ``sum_f aux_f * tokens_f`` (the metric); the loop divides both by the step's
    tokens."""

    def __init__(self) -> None:
        self.weighted: torch.Tensor | None = None
        self.plain = 0.0

    def add(self, aux: torch.Tensor, coef: float, tokens: int) -> torch.Tensor:
        """Record one forward's loss ``aux`` over ``tokens`` real tokens; returns ``coef * aux``."""
        term = coef * aux
        self.weighted = term * tokens if self.weighted is None else self.weighted + term * tokens
        self.plain += aux.item() * tokens
        return term
