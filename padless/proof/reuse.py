"""The load-time proof, reused within a process only where everything it proved is the same.

A process that loads the same model several times (a policy and its reference from one checkpoint, a test
suite) would otherwise prove it each time: about a second of forwards per load on CPU. The probe's verdict
is a function of the model (its configs, every parameter and buffer bit for bit, its modules, their
instance-level forwards and hooks), of the backend and kernel pin, and of the code that runs: padless,
the modeling and attention code transformers dispatches to, and torch's functions. :func:`prove` keeps
each passed proof with a fingerprint of all of that (strong references to every function and class in
it, compared by identity, so no id is ever reused by another object) and reuses it only on an identical
fingerprint; a monkeypatched kernel, a changed weight or config, another dtype, device or thread count is
proven again (the train / eval mode is not in it: the probe runs in eval mode). Nothing is written to or
read from disk, and refusals are never kept.

Only CPU models are fingerprinted: hashing the weights reads each byte once, against the thousands of
operations per parameter the probe runs on CPU; on an accelerator the probe is cheap and the weights
would have to be copied to the host.
"""

from __future__ import annotations

import hashlib
import sys
import types
from collections import OrderedDict
from typing import Any

import torch

from padless.forward import hybrid
from padless.forward.attention import kernel_of
from padless.proof.probe import _configs, prove_packing

KEPT = 8  # proofs kept (least recently used dropped): a process holds a few distinct models at most
_PROVEN: OrderedDict[int, tuple[tuple[Any, ...], dict[str, Any]]] = OrderedDict()
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), range, torch.dtype, torch.device)

# Loaded modules whose functions a probe runs besides the model's own modeling code and padless: masks,
# attention integrations, output capturing and the base classes.
CODE_PREFIXES = (
    "padless",
    "transformers.modeling_",
    "transformers.masking_utils",
    "transformers.integrations.",
    "transformers.utils.generic",
    "transformers.utils.output_capturing",
    "transformers.pytorch_utils",
    "torch.nn.functional",
)


def prove(model: torch.nn.Module, backend: str, tree: bool = False) -> dict[str, Any]:
    """:func:`padless.proof.probe.prove_packing` (with the tree layout when ``tree``), or its result for an
    identical model, backend, layouts and code proven earlier in this process (then with ``reused: True``)."""
    key = fingerprint(model, backend, tree)
    if key is not None:
        for slot, (known, result) in _PROVEN.items():
            if _same(known, key):
                _PROVEN.move_to_end(slot)
                return {**result, "reused": True}
    result = prove_packing(model, backend, tree=tree)
    if key is not None:
        _PROVEN[id(key)] = (key, dict(result))
        while len(_PROVEN) > KEPT:
            _PROVEN.popitem(last=False)
    return result


def fingerprint(model: torch.nn.Module, backend: str, tree: bool = False) -> tuple[Any, ...] | None:
    """Everything the probe's verdict depends on (``None``: not fingerprinted, see the module)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if any(t.device.type != "cpu" for _, t in tensors):
        return None
    return (
        backend,
        tree,
        kernel_of(model),
        torch.get_num_threads(),
        _weights(tensors),
        _model_code(model),
        _code(model),
    )


def _weights(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A hash of every parameter and buffer: name, dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=32)
    for name, t in tensors:
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _model_code(model: torch.nn.Module) -> tuple[Any, ...]:
    """The model's modules (name, class), the forwards and hooks set on instances, and every config each
    module reads (its full JSON and the attention kernel it dispatches to)."""
    configs = {
        id(c): (c.to_json_string(use_diff=False), c._attn_implementation_internal) for c in _configs(model)
    }
    entries: list[Any] = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        entries += [name, type(module), configs.get(id(config), config)]
        entries.append(_callable(module.__dict__.get("forward")))
        for hooks in (
            module._forward_pre_hooks,
            module._forward_hooks,
            module._backward_hooks,
            module._backward_pre_hooks,
        ):
            entries += [_callable(h) for h in hooks.values()]
    return tuple(entries)


def _callable(fn: Any) -> Any:
    """What decides how ``fn`` runs: a bound method's function and class, a per-sequence wrapper's
    :meth:`padless.forward.hybrid._PerSequence.identity`, anything else itself."""
    if isinstance(fn, types.MethodType):
        return fn.__func__, type(fn.__self__)
    if isinstance(fn, hybrid._PerSequence):
        return fn.identity()
    return fn


def _code(model: torch.nn.Module) -> tuple[Any, ...]:
    """Every function, class and setting in the namespaces of the code a probe runs (see
    :data:`CODE_PREFIXES`, and the modules of the model's classes), with the entries of registries of
    functions and the members of classes; transformers' attention and mask registries; torch's functions
    and ``Tensor``'s methods; torch's global module hooks."""
    classes = {c for m in model.modules() for c in type(m).__mro__ if c is not object}
    names = {c.__module__ for c in classes}
    modules = [
        m
        for n, m in list(sys.modules.items())
        if m is not None and (n in names or n.startswith(CODE_PREFIXES))
    ]
    from torch.nn.modules import module as torch_module
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    entries: list[Any] = []
    for module in sorted(modules, key=lambda m: m.__name__):
        entries.append(module.__name__)
        entries += _namespace(vars(module), module.__name__)
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        entries += [cls, *_namespace(dict(vars(cls)), None)]
    for mapping in (ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        entries += [item for kv in sorted(mapping.items()) for item in kv]
    entries += _namespace(vars(torch), None) + _namespace(dict(vars(torch.Tensor)), None)
    for hooks in (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks):
        entries += [_callable(h) for h in hooks.values()]
    return tuple(entries)


def _namespace(space: dict[str, Any], owner: str | None) -> list[Any]:
    """``space``'s callables and settings in order, with the callables of its registries (dicts) and, for
    a module ``owner``, the members of the classes it defines."""
    entries: list[Any] = []
    for name, value in space.items():
        if isinstance(value, types.ModuleType):
            continue
        entries += [name, value]
        if isinstance(value, dict):
            entries += [item for k, v in value.items() if callable(v) for item in (k, v)]
        elif owner is not None and isinstance(value, type) and value.__module__ == owner:
            entries += _namespace(dict(vars(value)), None)
    return entries


def _same(known: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    """Whether two fingerprints are the same: immutable values equal, everything else the same object."""
    if len(known) != len(key):
        return False
    for a, b in zip(known, key, strict=True):
        if a is b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple):
            if not _same(a, b):
                return False
        elif not (isinstance(a, _IMMUTABLE) and type(a) is type(b) and a == b):
            return False
    return True
