"""The invariance matrix: the same sequences in four layouts on every backend, compared per token, and the
tree layout (sequences sharing prefixes computed once, :mod:`padless.forward.tree`) beside them.

Reference: each sequence run alone with ``eager`` attention, transformers' own textbook kernel, which
implements every argument of its architecture and has nothing to get wrong for one unpadded sequence.
Every cell reports the largest per-token |delta log-prob| against it, beside its bound
(:func:`padless.proof.probe.bound`: the dtype's epsilon times the size of the logits compared).

A backend either produces its cells or is reported as unavailable on this machine (no CUDA, package
missing) or refused for this model (loading it would stop: padless's probe or transformers said no,
with the reason). :func:`run_zoo` runs the matrix over the tiny architectures of :mod:`padless.proof.zoo`.

The tree cells run sequences that share nested prefixes (:func:`padless.proof.probe.tree_sequences`) as one
tree row through the engine: ``tree`` compares the log-probs of every trained token with each sequence
alone; ``tree-grad`` compares the gradient of a loss over them with the flat packed layout's, parameter
by parameter. Where the model cannot run a tree (:func:`padless.forward.tree.tree_problem`) they say why.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from padless.config.choices import BACKENDS
from padless.errors import AttentionError
from padless.forward.attention import (
    attention_in_use,
    backend_problem,
    kernel_of,
    pin_kernel,
    runtime_context,
)
from padless.forward.engine import (
    EngineSettings,
    ModelEngine,
    forward_packed,
    forward_padded,
    loaded_backend,
    use_backend,
)
from padless.forward.packing import IGNORE_INDEX, Example, PackedBatch, pack, to_padded
from padless.forward.tree import tree_problem
from padless.proof.probe import (
    FORMULA,
    ReferenceForwardError,
    bound,
    model_name,
    probe_reference,
    prove_packing,
    tree_sequences,
)
from padless.proof.zoo import LOGIT_TARGET, build_zoo_model, exercises, scale_head, zoo_names

LAYOUTS = ("alone", "left", "right", "packed")
TREE_LAYOUTS = ("tree", "tree-grad")
DEFAULT_LENGTHS = (4, 19, 77, 160)


@dataclass
class Cell:
    backend: str
    layout: str
    max_delta: float | None = None
    bound: float | None = None
    error: str | None = None
    not_run: str | None = None  # a tree cell of a model or backend that runs no tree: why

    @property
    def ok(self) -> bool:
        if self.not_run is not None:
            return True
        return self.error is None and self.max_delta is not None and self.max_delta <= self.bound


@dataclass
class BackendRow:
    """One backend on one model: its cells, or why it produced none."""

    backend: str
    kernel: str | None = None
    cells: list[Cell] = field(default_factory=list)
    unavailable: str | None = None  # cannot run on this machine (device, package)
    refused: str | None = None  # loading the model on it stops, with this reason

    @property
    def ran(self) -> bool:
        return self.unavailable is None and self.refused is None


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


def next_token_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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
        return alone_logps(model, seqs).logps
    return padded_logps(model, batch, layout, pad_id)


def padded_logps(model: PreTrainedModel, batch: PackedBatch, side: str, pad_id: int) -> list[torch.Tensor]:
    """Per-sequence next-token log-probs ``[L_i - 1]`` of ``batch`` run as one batch padded on ``side``."""
    padded = to_padded(batch, side, pad_id)
    logps = forward_padded(model, padded)
    return [row[labels != IGNORE_INDEX] for row, labels in zip(logps, padded.labels, strict=True)]


@dataclass
class Alone:
    """Each sequence run alone: next-token log-probs ``[L_i - 1]`` and the sizes of what they came from."""

    logps: list[torch.Tensor]
    max_logit: float  # largest |logit| at the predicting positions
    max_logp: float  # largest |log-prob| of a next token

    @property
    def magnitude(self) -> float:
        return max(self.max_logit, self.max_logp)


def alone_logps(model: PreTrainedModel, seqs: list[list[int]]) -> Alone:
    """Each sequence run alone through a plain forward (batch of one, no padding, no packing)."""
    device = next(model.parameters()).device
    result = Alone([], 0.0, 0.0)
    for s in seqs:
        ids = torch.tensor(s, device=device)
        logits = model(
            input_ids=ids[None], position_ids=torch.arange(len(s), device=device)[None], use_cache=False
        ).logits[0]
        logps = next_token_logps(logits, ids)
        result.logps.append(logps)
        result.max_logit = max(result.max_logit, logits[:-1].float().abs().max().item())
        result.max_logp = max(result.max_logp, logps.abs().max().item())
    return result


def max_delta(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


@dataclass
class TreeCase:
    """Sequences sharing nested prefixes (:func:`padless.proof.probe.tree_sequences`), the prompt length
    of each, and each run alone (the reference of the ``tree`` cells)."""

    seqs: list[list[int]]
    prompts: list[int]
    alone: Alone

    def batch(self, device: torch.device) -> PackedBatch:
        """The sequences packed flat, the prompt of each untrained."""
        examples = [
            Example(s, [False] * p + [True] * (len(s) - p))
            for s, p in zip(self.seqs, self.prompts, strict=True)
        ]
        return pack(examples, device=device)

    def reference(self) -> list[torch.Tensor]:
        """Each sequence's log-probs of its trained tokens, alone."""
        return [x[p - 1 :] for x, p in zip(self.alone.logps, self.prompts, strict=True)]


def tree_case(model: PreTrainedModel, seqs: list[list[int]], alone: Callable[..., Alone]) -> TreeCase:
    """The tree cells' sequences, made of ``seqs``, and their reference (the model on eager)."""
    branches, prompts = tree_sequences([torch.tensor(s) for s in seqs])
    lists = [b.tolist() for b in branches]
    return TreeCase(lists, prompts, alone(model, lists))


def tree_cell(model: PreTrainedModel, backend: str, case: TreeCase, layout: str) -> Cell:
    """A ``tree`` cell (log-probs of every trained token vs alone) or a ``tree-grad`` cell (the gradient of
    a loss over those log-probs, tree row vs flat packed row, the largest difference beside its bound),
    run through the engine on ``backend``."""
    device = next(model.parameters()).device
    problem = tree_problem(model, backend) or (
        backend_problem(backend, device, training=True) if layout == "tree-grad" else None
    )
    if problem:
        return Cell(backend, layout, not_run=problem)
    dtype = next(model.parameters()).dtype
    batch = case.batch(device)
    tree = ModelEngine(model, settings=EngineSettings(tree_packing="on"))
    if layout == "tree":
        logps = tree(batch, logps=True).logps
        got = [t[mask] for t, mask in zip(batch.split(logps), batch.split(batch.loss_mask[0]), strict=True)]
        return Cell(backend, layout, max_delta(got, case.reference()), bound(dtype, case.alone.magnitude))
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.cos(torch.arange(batch.num_tokens, device=batch.input_ids.device, dtype=torch.float32))

    def grads(engine: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            loss = (engine(batch, logps=True).logps * weights).sum()
            return torch.autograd.grad(loss, params)

    flat, shared = grads(ModelEngine(model)), grads(tree)
    return Cell(backend, layout, *gradient_delta(flat, shared, dtype))


def gradient_delta(
    want: Sequence[torch.Tensor], got: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[float, float]:
    """The largest |difference| between two computations of a model's gradients, and its bound: round-off
    of the model's largest |gradient| (:func:`padless.proof.probe.bound`). A gradient is a sum over
    every token, summed in another order by another layout; parameter by parameter that order moved
    up to 10 eps times the parameter's own largest |gradient|, while a branch that sees a sibling moves
    gradients by a percent of the largest."""
    delta = max((a - b).abs().max().item() for a, b in zip(want, got, strict=True))
    return delta, bound(dtype, max(a.abs().max().item() for a in want))


def run_matrix(
    model: PreTrainedModel,
    seqs: list[Any],
    pad_id: int,
    backends: tuple[str, ...] = BACKENDS,
    layouts: tuple[str, ...] = LAYOUTS,
    logps: Callable[..., list[torch.Tensor]] | None = None,
    alone: Callable[..., Alone] | None = None,
) -> tuple[list[BackendRow], float]:
    """Switch ``model`` through each backend and fill the matrix; also returns the bound of every cell.

    A backend is probed as :func:`padless.proof.load.load_model` would (a failed probe is a refusal, with its
    message). The model ends on the backend it came with, in the mode it came in. ``logps(model, seqs,
    layout, pad_id)`` and ``alone(model, seqs)`` compute the layouts (image+text sequences bring their own:
    :mod:`padless.proof.check_vision`).
    """
    tree_layouts = [lay for lay in layouts if lay in TREE_LAYOUTS]
    if tree_layouts and logps is not None:
        raise ValueError("the tree cells run token sequences only (no images)")
    logps, alone = logps or layout_logps, alone or alone_logps
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    original = loaded_backend(model)
    was_training = model.training
    model.eval()
    rows = []
    try:
        with torch.no_grad():
            use_backend(model, "eager")
            try:
                single = alone(model, seqs)
            except Exception as e:
                raise ReferenceForwardError(
                    f"{model_name(model)}: transformers' own forward failed on eager attention, the "
                    f"reference of `padless check` for {', '.join(backends)}: {_one_line(e)[:300]}"
                ) from e
            reference, limit = single.logps, bound(dtype, single.magnitude)
            case = tree_case(model, seqs, alone) if tree_layouts else None
            purpose = f"the load-time probe of {', '.join(backends)}"
            own = probe_reference(model, purpose)
            for backend in backends:
                problem = backend_problem(backend, device, kernel=kernel_of(model))
                if problem:
                    rows.append(BackendRow(backend, unavailable=problem))
                    continue
                try:
                    _switch(model, backend)
                    kernel = prove_packing(model, backend, reference=own)["kernel"]
                except (AttentionError, ValueError) as e:  # transformers refuses with ValueError
                    rows.append(BackendRow(backend, refused=_one_line(e)))
                    continue
                except Exception as e:  # padless's probe crashed: every cell says so, never a refusal
                    error = f"the load-time probe crashed: {_one_line(e)}"
                    cells = [Cell(backend, layout, bound=limit, error=error) for layout in layouts]
                    rows.append(BackendRow(backend, cells=cells))
                    continue
                row = BackendRow(backend, kernel)
                with runtime_context(backend, device):
                    for layout in layouts:
                        try:
                            if layout in TREE_LAYOUTS:
                                row.cells.append(tree_cell(model, backend, case, layout))
                                continue
                            got = logps(model, seqs, layout, pad_id)
                            row.cells.append(Cell(backend, layout, max_delta(got, reference), limit))
                        except Exception as e:  # a crash is a result here: report it in the cell
                            row.cells.append(Cell(backend, layout, bound=limit, error=_one_line(e)))
                rows.append(row)
    finally:
        use_backend(model, original)
        model.train(was_training)
    return rows, limit


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _switch(model: PreTrainedModel, backend: str) -> None:
    """:func:`padless.forward.engine.use_backend`, then a check that transformers dispatches there."""
    use_backend(model, backend)
    running = attention_in_use(model)
    if running != backend:
        raise AttentionError(
            f"{model_name(model)} runs {running!r} attention whatever is asked: transformers does not "
            f"dispatch this architecture to {backend!r} (its attention is written into the model)"
        )


def failures(rows: list[BackendRow], requested: tuple[str, ...] | None = None) -> list[str]:
    """Why the matrix does not prove invariance (empty: it does).

    Fails when nothing was checked, when a cell is over its bound or crashed, and when a backend in
    ``requested`` did not run. By default only ``varlen``, padless's training backend, must run: another
    backend refused for this architecture (by transformers or padless's probe) is a result, as in the zoo,
    because loading the model on it stops with that reason.
    """
    requested = requested or ("varlen",)
    found = [
        f"{r.backend} did not run: {r.unavailable or r.refused}"
        for r in rows
        if r.backend in requested and not r.ran
    ]
    found += [
        f"{c.backend}/{c.layout}: " + (c.error or f"{c.max_delta:.3g} > bound {c.bound:.3g}")
        for r in rows
        for c in r.cells
        if not c.ok
    ]
    if not any(r.cells for r in rows):
        found.append("nothing was checked: no requested backend ran")
    return found


def _cell_text(c: Cell) -> str:
    if c.not_run:
        return "not run"
    if c.error:
        return "ERROR"
    return f"{c.max_delta:.1e} {'<=' if c.ok else '> '} {c.bound:.1e}"


def format_matrix(rows: list[BackendRow], layouts: tuple[str, ...] = LAYOUTS) -> str:
    width = 22
    head = f"{'backend':<18}{'kernel ran':<16}" + "".join(f"{lay:>{width}}" for lay in layouts)
    lines = [head, "-" * len(head)]
    notes = []
    for r in rows:
        if not r.ran:
            status = "unavailable" if r.unavailable else "refused"
            lines.append(f"{r.backend:<18}{status:<16}" + "".join(f"{'-':>{width}}" for _ in layouts))
            notes.append(f"{r.backend}: {r.unavailable or r.refused}")
            continue
        lines.append(
            f"{r.backend:<18}{r.kernel or '?':<16}" + "".join(f"{_cell_text(c):>{width}}" for c in r.cells)
        )
        notes += [f"{r.backend}/{c.layout}: {c.error[:300]}" for c in r.cells if c.error]
        notes += [f"{r.backend}/{c.layout}: not run: {c.not_run}" for c in r.cells if c.not_run]
    lines.append(
        f"\nmax |delta log-prob| per token vs. each sequence alone on eager, beside its bound ({FORMULA})"
    )
    if any(lay in TREE_LAYOUTS for lay in layouts):
        lines.append(
            "tree: sequences sharing nested prefixes as one tree row, trained tokens vs alone; tree-grad: "
            "the gradient of a loss over them vs the flat packed row (M: the largest |gradient|)"
        )
    lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The model zoo
# ----------------------------------------------------------------------------------------------------------


VERDICTS = ("exact", "refused", "no tiny config", "FAILED")


@dataclass
class ZooResult:
    """One zoo architecture: its matrix, or why no tiny model of it could be built and run."""

    name: str
    exercises: str
    rows: list[BackendRow]
    bound: float
    no_config: str | None = None  # building it, or transformers' own forward on it, failed: why

    @property
    def verdict(self) -> str:
        """On varlen, the backend padless trains on: ``exact`` (every cell within its bound), ``refused``
        (loading it stops, with the reason; or a layout stops with an error, said loudly),
        ``no tiny config``, or ``FAILED``: a cell over its bound although loading passed, numbers
        silently wrong, what padless must never let happen."""
        if self.no_config:
            return "no tiny config"
        row = self._varlen()
        if row is None or not row.ran:
            return "refused" if row is not None and row.refused else "no tiny config"
        if any(c.error is None and not c.ok for c in row.cells):
            return "FAILED"
        return "refused" if any(c.error for c in row.cells) else "exact"

    @property
    def reason(self) -> str | None:
        """Why it is not exact: the refusal, the first layout that stopped, or why no tiny config."""
        if self.no_config:
            return self.no_config
        row = self._varlen()
        if row is None:
            return "varlen was not run"
        errored = [f"varlen/{c.layout}: {c.error}" for c in row.cells if c.error]
        return row.refused or row.unavailable or (errored[0] if errored else None)

    def _varlen(self) -> BackendRow | None:
        return next((r for r in self.rows if r.backend == "varlen"), None)


def zoo_model(
    name: str, seqs: list[list[int]], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> PreTrainedModel:
    """The zoo's ``name`` on eager, its head scaled so the largest |logit| on ``seqs`` is ``LOGIT_TARGET``."""
    model = build_zoo_model(name, "eager", dtype).to(device)
    use_backend(model, "eager")
    with torch.no_grad():
        largest = alone_logps(model, seqs).max_logit
    scale_head(model, LOGIT_TARGET / largest)
    return model


def run_zoo(
    seqs: list[list[int]],
    pad_id: int,
    backends: tuple[str, ...] = BACKENDS,
    names: tuple[str, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layouts: tuple[str, ...] = LAYOUTS,
    varlen_kernel: str = "auto",
) -> list[ZooResult]:
    """The matrix of every zoo architecture (default: :func:`padless.proof.zoo.zoo_names`), logits scaled to
    realistic size, ``varlen_kernel`` pinned behind ``varlen``. An architecture whose tiny config cannot be
    built, or whose own forward fails on it, is a result (``no tiny config``, with transformers' reason),
    not a stop."""
    results = []
    for name in names or zoo_names():
        try:
            model = zoo_model(name, seqs, dtype, device)
            note = exercises(name, model.config)
        except Exception as e:  # transformers could not build it or run its own forward: the result
            results.append(ZooResult(name, "", [], math.nan, no_config=_one_line(e)))
            continue
        pin_kernel(model, varlen_kernel)
        try:  # padless's own crashes are the matrix's cells, never "no tiny config"
            rows, limit = run_matrix(model, seqs, pad_id, backends, layouts)
        except ReferenceForwardError as e:
            results.append(ZooResult(name, "", [], math.nan, no_config=_one_line(e)))
            continue
        results.append(ZooResult(name, note, rows, limit))
    return results


def zoo_counts(results: list[ZooResult]) -> str:
    """``211 architectures: 150 exact, 40 refused, 21 no tiny config``."""
    counts = Counter(z.verdict for z in results)
    found = ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v])
    return f"{len(results)} architectures: {found}"


def _status(row: BackendRow) -> str:
    if row.unavailable:
        return "not on this machine"
    if row.refused:
        return "refused"
    if any(c.error is None and not c.ok for c in row.cells):
        return "FAILED"
    return "error" if any(c.error for c in row.cells) else "exact"


def zoo_failures(results: list[ZooResult], requested: tuple[str, ...] | None = None) -> list[str]:
    """Why the zoo run does not prove its table (empty: it does). A refusal is a result, not a failure;
    a cell over its bound, a crash, a requested backend missing from this machine or no cell at all are."""
    rows = [(z.name, r) for z in results for r in z.rows]
    found = sorted(
        {
            f"{r.backend} is not on this machine: {r.unavailable}"
            for _, r in rows
            if r.unavailable and requested and r.backend in requested
        }
    )
    found += [
        f"{name} {c.backend}/{c.layout}: " + (c.error or f"{c.max_delta:.3g} > bound {c.bound:.3g}")
        for name, r in rows
        for c in r.cells
        if not c.ok
    ]
    if not any(r.cells for _, r in rows):
        found.append("nothing was checked: no requested backend ran on any architecture")
    return found


def format_zoo(results: list[ZooResult], markdown: bool = False) -> str:
    """One line per architecture: its verdict on varlen (:attr:`ZooResult.verdict`), then one column per
    backend: exact / refused / FAILED, each refusal or missing tiny config numbered with the first
    sentence of its reason below (``ValueError`` is transformers refusing, ``AttentionError`` padless).
    The count per verdict ends the table."""
    backends = next(([r.backend for r in z.rows] for z in results if z.rows), [])
    reasons: dict[str, int] = {}

    def numbered(reason: str) -> str:
        first = reason.split(". ")[0][:200].replace("|", "/")
        return f"[{reasons.setdefault(first, len(reasons) + 1)}]"

    def cell(row: BackendRow) -> str:
        return _status(row) + (f" {numbered(row.refused)}" if row.refused else "")

    table = []
    for z in results:
        if z.no_config:
            cells = ["-"] * len(backends)
            table.append([z.name, f"no tiny config {numbered(z.no_config)}", z.exercises, "-", *cells])
            continue
        verdict = z.verdict + (f" {numbered(z.reason)}" if z.verdict == "refused" and z.reason else "")
        table.append([z.name, verdict, z.exercises, f"{z.bound:.1e}", *(cell(r) for r in z.rows)])
    head = ["architecture", "verdict", "what its tiny config exercises", "bound", *backends]
    notes = [f"[{n}] {reason}" for reason, n in reasons.items()]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in table]
        lines += ["", zoo_counts(results), "", *(f"{note}  " for note in notes)]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in [head, *table]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in table]
    lines += ["", zoo_counts(results), "", *notes]
    return "\n".join(lines)
