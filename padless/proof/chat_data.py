"""What a model's chat template makes of a data file, before training: ``padless check --data FILE``.

Every row is tokenized as ``padless sft`` tokenizes it (the model's tokenizer, chat template and stop tokens,
the same proof of every assistant turn), and counted: by what it holds (tool calls, reasoning, thinking or
content parts, several turns, train flags) and, for those refused, by what the template or the row did,
with the first row numbers and one message each. Refused rows are tried again in per-turn mode, so the
report says when ``data.per_turn: true`` would train them. A user learns in seconds that, say, their
tool-call rows would be refused because the template drops the calls.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from padless import tiny
from padless.data import sources
from padless.data.chat import ChatTemplateError
from padless.data.images import ImageInputs
from padless.data.records import REASONING_KEYS, TRAIN_FLAGS, Row, load_rows
from padless.data.sft import SftFormat, SFTLayout
from padless.errors import DataError, InputError
from padless.forward.vision import is_vision_config

FIRST_ROWS = 5  # row numbers shown per cause
NO_LIMIT = 1 << 30  # the report is about templates, not lengths

# What a row holds, in the order the report lists it.
HOLDS = (
    "tool calls",
    "reasoning field",
    "thinking parts",
    "content parts",
    "several assistant turns",
    "train flags",
)


def holds(row: Row) -> list[str]:
    """What of :data:`HOLDS` a row's messages (or prompt and completion) carry; ``plain`` for none."""
    messages = [
        m
        for key in ("messages", "prompt", "completion")
        if isinstance(row.data.get(key), list)
        for m in row.data[key]
        if isinstance(m, dict)
    ]
    parts = [
        p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if isinstance(p, dict)
    ]
    found = {
        "tool calls": any(m.get("tool_calls") for m in messages),
        "reasoning field": any(m.get(k) for m in messages for k in REASONING_KEYS),
        "thinking parts": any(p.get("type") == "thinking" for p in parts),
        "content parts": any(p.get("type") == "text" for p in parts),
        "several assistant turns": sum(m.get("role") == "assistant" for m in messages) > 1,
        "train flags": any(k in m for m in messages for k in TRAIN_FLAGS),
    }
    return [k for k in HOLDS if found[k]] or ["plain"]


@dataclass
class Cause:
    """Rows refused for one reason: how many, the first row numbers, one message."""

    rows: int = 0
    first: list[int] = field(default_factory=list)
    message: str = ""


@dataclass
class DataReport:
    source: str
    stops: str  # the stop tokens, named
    rows: int = 0
    trained: int = 0
    by_holding: dict[str, Counter[str]] = field(default_factory=dict)  # holding -> {"rows", "train"}
    causes: dict[str, Cause] = field(default_factory=dict)
    per_turn: list[int] = field(default_factory=list)  # refused rows that per-turn mode trains
    per_turn_mode: bool = False

    @property
    def refused(self) -> int:
        return self.rows - self.trained


def check_data(
    spec: str,
    tokenizer: Any,
    stop_ids: tuple[int, ...] = (),
    *,
    per_turn: bool = False,
    format: SftFormat = "auto",
    images: ImageInputs | None = None,
) -> DataReport:
    """Every row of ``spec`` through the SFT tokenizing of ``tokenizer`` (and ``images``, a vision-language
    model's), counted; ``per_turn``: as ``data.per_turn: true`` does."""
    rows = load_rows(spec)
    layout = SFTLayout(NO_LIMIT, format=format, per_turn=per_turn, skip_bad_rows=True, stop_ids=stop_ids)
    layout.prepare(rows, tokenizer, images)
    turns = replace(layout, per_turn=True)  # the same prepared encoder, in per-turn mode
    report = DataReport(spec, layout.prepared.enc.stop_names, per_turn_mode=per_turn)
    for row in rows:
        report.rows += 1
        holding = holds(row)
        for h in holding:
            report.by_holding.setdefault(h, Counter())["rows"] += 1
        try:
            layout.examples(row)
        except (DataError, ChatTemplateError) as e:
            reason = e.reason if isinstance(e, DataError) else e.behaviour
            cause = report.causes.setdefault(reason, Cause(message=str(e)))
            cause.rows += 1
            if len(cause.first) < FIRST_ROWS:
                cause.first.append(row.index)
            if not per_turn and layout.prepared.fmt == "messages":
                try:
                    turns.examples(row)
                    report.per_turn.append(row.index)
                except (DataError, ChatTemplateError):
                    pass
            continue
        report.trained += 1
        for h in holding:
            report.by_holding[h]["train"] += 1
    return report


def _rows(numbers: list[int], total: int) -> str:
    return (
        f"row{'s' if total > 1 else ''} "
        + ", ".join(map(str, numbers))
        + (", ..." if total > len(numbers) else "")
    )


def image_inputs(name: str, trust_remote_code: bool = False) -> ImageInputs | None:
    """A vision-language model's image side (its processor and config; no weights are loaded), or None."""
    from transformers import AutoConfig

    if found := sources.embedded(name):
        config = tiny.tiny_config(found[0])
    else:
        folder = sources.local_folder(name)
        if (folder / sources.ADAPTER_CONFIG).exists():
            return image_inputs(sources.adapter_base(folder), trust_remote_code)
        try:
            config = AutoConfig.from_pretrained(
                str(folder), local_files_only=True, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as e:
            raise InputError(
                f"--model {name}: cannot read its config.json ({str(e).splitlines()[0]}); fix: pass "
                "a model folder written by save_pretrained"
            ) from None
    return ImageInputs(sources.load_processor(name), config) if is_vision_config(config) else None


def format_report(report: DataReport, model: str) -> str:
    mode = " (data.per_turn: true)" if report.per_turn_mode else ""
    lines = [
        f"{report.source} through the chat template of {model}{mode}: {report.rows} rows, {report.trained} "
        f"train, {report.refused} refused",
        f"turns end at the tokens the model stops at: {report.stops}",
        "",
        f"{'rows holding':<26}{'rows':>7}{'train':>8}{'refused':>9}",
    ]
    for h in (*HOLDS, "plain"):
        if h in report.by_holding:
            c = report.by_holding[h]
            lines.append(f"{h:<26}{c['rows']:>7}{c['train']:>8}{c['rows'] - c['train']:>9}")
    if report.causes:
        lines += ["", "refused because (rows; first rows; the first row's message):"]
        for reason, cause in sorted(report.causes.items(), key=lambda kv: -kv[1].rows):
            lines.append(f"  {reason}: {cause.rows}; {_rows(cause.first, cause.rows)}")
            lines.append(f"    {cause.message}")
    if report.per_turn:
        shown = _rows(report.per_turn[:FIRST_ROWS], len(report.per_turn))
        lines += ["", f"with data.per_turn: true, {len(report.per_turn)} of them train ({shown})"]
    return "\n".join(lines)
