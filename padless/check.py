"""The invariance matrix: the same sequences in four layouts on every backend, compared per token.

Reference: each sequence run alone with ``eager`` attention, the textbook kernel that has nothing to
get wrong for one unpadded sequence. Every cell reports the largest per-token |delta log-prob| against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from padless.attention import (
    BACKENDS,
    AttentionError,
    backend_problem,
    hf_name,
    probe_attention,
    runtime_context,
)
from padless.model import forward_packed
from padless.packing import Example, pack, to_padded

LAYOUTS = ("alone", "left", "right", "packed")
DEFAULT_LENGTHS = (4, 19, 77, 160)


def tolerance(dtype: torch.dtype) -> float:
    """Allowed max |delta log-prob| per token.

    fp32: round-off of reordered sums, measured ~1e-6 on CPU. Half precision: bf16 keeps 8 bits of
    mantissa, so kernels that sum in a different order differ by a few bf16 ulps of the logits
    (logits of magnitude ~10 have an ulp of 0.06); 0.1 is a few such ulps, far below the ~0.5-1 that
    contamination between sequences produces.
    """
    return 1e-5 if dtype == torch.float32 else 0.1


@dataclass
class Cell:
    backend: str
    layout: str
    max_delta: float | None = None
    error: str | None = None


@dataclass
class BackendRow:
    backend: str
    kernel: str | None
    kernel_ok: bool
    cells: list[Cell]
    skipped: str | None = None


def probe_sequences(
    tokenizer: PreTrainedTokenizerBase, lengths: tuple[int, ...] = DEFAULT_LENGTHS
) -> list[list[int]]:
    """Real text of very different lengths, cut from the embedded corpus with the model's own tokenizer."""
    text = resources.files("padless.tiny").joinpath("corpus.txt").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < sum(lengths):
        ids = ids * math.ceil(sum(lengths) / max(len(ids), 1))
    seqs, start = [], 0
    for n in lengths:
        seqs.append(ids[start : start + n])
        start += n
    return seqs


def _next_token_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[t + 1] | ids[: t + 1]) for t < L - 1, from logits ``[L, V]``."""
    return logits[:-1].float().log_softmax(-1).gather(-1, ids[1:, None])[:, 0]


def layout_logps(
    model: PreTrainedModel, seqs: list[list[int]], layout: str, pad_id: int
) -> list[torch.Tensor]:
    """Per-sequence next-token log-probs ``[L_i - 1]`` computed in ``layout``."""
    device = next(model.parameters()).device
    batch = pack([Example(s) for s in seqs], device=device)
    if layout == "packed":
        out = forward_packed(model, batch).logps
        return [t[:-1] for t in batch.split(out)]
    if layout == "alone":
        result = []
        for s in seqs:
            ids = torch.tensor(s, device=device)
            logits = model(
                input_ids=ids[None], position_ids=torch.arange(len(s), device=device)[None], use_cache=False
            )
            result.append(_next_token_logps(logits.logits[0], ids))
        return result
    padded = to_padded(batch, layout, pad_id)
    logits = model(
        input_ids=padded.input_ids,
        attention_mask=padded.attention_mask,
        position_ids=padded.position_ids,
        use_cache=False,
    ).logits
    real = padded.attention_mask.bool()
    return [_next_token_logps(logits[i][real[i]], padded.input_ids[i][real[i]]) for i in range(len(seqs))]


def max_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


def run_matrix(
    model: PreTrainedModel,
    seqs: list[Any],
    pad_id: int,
    backends: tuple[str, ...] = BACKENDS,
    layouts: tuple[str, ...] = LAYOUTS,
    logps: Callable[..., list[torch.Tensor]] = layout_logps,
) -> list[BackendRow]:
    """Switch ``model`` through each backend and fill the matrix. The model ends on its first backend.

    ``logps(model, seqs, layout, pad_id)`` computes one layout (image+text sequences bring their own).
    """
    device = next(model.parameters()).device
    original = getattr(model, "padless_attention", "varlen")
    was_training = model.training
    model.eval()
    rows = []
    try:
        with torch.no_grad():
            _switch(model, "eager")
            reference = logps(model, seqs, "alone", pad_id)
            for backend in backends:
                problem = backend_problem(backend, device)
                if problem:
                    rows.append(BackendRow(backend, None, False, [], skipped=problem))
                    continue
                try:
                    _switch(model, backend)
                except ValueError as e:  # transformers refuses kernels the architecture does not support
                    rows.append(BackendRow(backend, None, False, [], skipped=str(e).split(". ")[0]))
                    continue
                try:
                    info = probe_attention(model, backend, tolerance=math.inf)
                    kernel, kernel_ok = info["kernel"], True
                except AttentionError as e:
                    kernel, kernel_ok = str(e), False
                cells = []
                with runtime_context(backend, device):
                    for layout in layouts:
                        try:
                            cells.append(
                                Cell(
                                    backend,
                                    layout,
                                    max_delta(logps(model, seqs, layout, pad_id), reference),
                                )
                            )
                        except Exception as e:  # a crash is a result here: report it in the cell
                            cells.append(Cell(backend, layout, error=f"{type(e).__name__}: {e}"))
                rows.append(BackendRow(backend, kernel, kernel_ok, cells))
    finally:
        _switch(model, original)
        model.train(was_training)
    return rows


def _switch(model: PreTrainedModel, backend: str) -> None:
    model.set_attn_implementation(hf_name(backend))
    model.padless_attention = backend


def matrix_ok(rows: list[BackendRow], tol: float) -> bool:
    cells = [c for r in rows for c in r.cells]
    return all(r.kernel_ok for r in rows if not r.skipped) and all(
        c.error is None and c.max_delta is not None and c.max_delta <= tol for c in cells
    )


def format_matrix(rows: list[BackendRow], tol: float, layouts: tuple[str, ...] = LAYOUTS) -> str:
    width = 12
    head = f"{'backend':<18}{'kernel ran':<22}" + "".join(f"{lay:>{width}}" for lay in layouts)
    lines = [head, "-" * len(head)]
    notes = []
    for r in rows:
        if r.skipped:
            lines.append(f"{r.backend:<18}{'skipped':<22}" + "".join(f"{'-':>{width}}" for _ in layouts))
            notes.append(f"{r.backend}: {r.skipped}")
            continue
        kernel = (r.kernel if r.kernel_ok else "NO") or "?"
        cells = []
        for c in r.cells:
            if c.error:
                cells.append(f"{'ERROR':>{width}}")
                notes.append(f"{r.backend}/{c.layout}: {c.error[:300]}")
            else:
                mark = "" if c.max_delta <= tol else "!"
                cells.append(f"{c.max_delta:>{width - 1}.1e}{mark or ' '}")
        lines.append(f"{r.backend:<18}{kernel:<22}" + "".join(cells))
        if not r.kernel_ok:
            notes.append(f"{r.backend}: {r.kernel}")
    lines.append(
        f"\nmax |delta log-prob| per token vs. each sequence alone on eager; tolerance {tol:g} ('!' = over)"
    )
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)
