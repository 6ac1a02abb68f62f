"""Supervised fine-tuning: next-token NLL on target tokens, normalised over the whole step."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from padless.config.schema import SFTConfig, TrainSettings
from padless.data import load_rows
from padless.data.images import ImageInputs
from padless.data.prompts import tokenize_prompts
from padless.data.sft import SFTLayout
from padless.data.sources import stop_token_ids
from padless.data.tokenized import ExampleSet, as_set, load_set
from padless.faults import doing
from padless.forward.engine import BatchLayout, inner_engine
from padless.forward.packing import Example, PackedBatch, budget_batches, fixed_count_batches, pack
from padless.forward.ranks import equal_share, gather_shares
from padless.losses import sft_token_weights
from padless.proof.load import pad_token_id
from padless.rl.generate import generate
from padless.run.loop import MicroBatch, Recipe, Trainer
from padless.run.reporting import report_data
from padless.run.rundir import own
from padless.run.session import start_session


def group_examples(
    examples: ExampleSet[Example], cfg: TrainSettings, epoch: int, bins: list[list[int]] | None
) -> list[list[int]]:
    """Micro-batches for an epoch: token budget, fixed bins (offline packing), or fixed count (padded)."""
    seed = cfg.seed + epoch
    if cfg.batching == "tokens":
        return budget_batches(examples.lengths, cfg.max_tokens_per_batch, seed=seed)
    if cfg.batching == "packing":
        order = fixed_count_batches(len(bins), 1, seed=seed)
        return [bins[i[0]] for i in order]
    return fixed_count_batches(len(examples), cfg.batch_size, seed=seed)


class SFTRecipe(Recipe):
    """Micro-batches are planned from the sets' length and target columns; their examples are read from the
    set (memory-mapped Arrow, or a list) only when the micro-batch runs."""

    def __init__(
        self,
        examples: Sequence[Example],
        cfg: TrainSettings,
        tokenizer: Any,
        device: torch.device,
        eval_examples: Sequence[Example] | None = None,
        eval_prompts: list[list[int]] | None = None,
        eval_vision: list[dict[str, torch.Tensor] | None] | None = None,
    ):
        self.examples, self.cfg, self.tokenizer, self.device = as_set(examples), cfg, tokenizer, device
        self.eval_examples, self.eval_prompts = as_set(eval_examples or []), eval_prompts or []
        self.eval_vision = eval_vision  # the eval prompts' images (vision-language models)
        self.layout = BatchLayout.of(cfg, pad_token_id(tokenizer))
        self.bins = None
        if cfg.batching == "packing":  # offline: the dataset is binned once, bins are reshuffled per epoch
            self.bins = budget_batches(
                self.examples.lengths, cfg.max_tokens_per_batch, seed=cfg.seed, shuffle=False
            )

    def collate(self, examples: list[Example]) -> PackedBatch:
        return pack(examples, device=self.device)

    def plan(self, epoch: int) -> list[MicroBatch]:
        return self.micros(self.examples, group_examples(self.examples, self.cfg, epoch, self.bins))

    @staticmethod
    def micros(examples: ExampleSet[Example], groups: list[list[int]]) -> list[MicroBatch]:
        targets, lengths = examples.targets, examples.lengths
        return [
            MicroBatch(examples.select(g), units=int(targets[g].sum()), tokens=int(lengths[g].sum()))
            for g in groups
        ]

    def token_logps(
        self, model: torch.nn.Module, examples: list[Example]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and target mask ``[T]``, computed in the layout the config asks for."""
        batch = self.collate(examples)
        return model(batch, layout=self.layout, logps=True).logps, batch.loss_mask[0]

    def loss(
        self, model: torch.nn.Module, micro: MicroBatch, normaliser: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        # the loss weights are known before the forward: the head computes the gradient in it (packed)
        batch = self.collate(micro.data)
        weights = sft_token_weights(batch.loss_mask[0], normaliser)
        loss = model(batch, layout=self.layout, logps=True, logp_weights=weights).weighted
        return loss, {"loss": loss.item()}

    def eval_plan(self) -> list[MicroBatch]:
        if not self.eval_examples:
            return []
        groups = budget_batches(self.eval_examples.lengths, self.cfg.max_tokens_per_batch, shuffle=False)
        return self.micros(self.eval_examples, groups)

    def on_evaluate(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        if self.cfg.eval_generate and self.eval_prompts:
            self.write_predictions(model, step)
        return {}

    def write_predictions(self, model: torch.nn.Module, step: int) -> Path | None:
        """Greedy completions of the eval prompts, each rank on an equal share (sharded engines decode in
        lockstep), written by the main process."""
        vision = self.eval_vision or [None] * len(self.eval_prompts)
        topology = inner_engine(model).topology
        mine, real = equal_share(list(zip(self.eval_prompts, vision, strict=True)), topology)
        completions = generate(
            model,
            self.tokenizer,
            [p for p, _ in mine],
            max_new_tokens=self.cfg.eval_max_new_tokens,
            batch_size=self.cfg.eval_batch_size,
            vision=[v for _, v in mine] if self.eval_vision else None,
        )
        completions = gather_shares(completions[:real], topology)
        if not PartialState().is_main_process:
            return None
        path = Path(self.cfg.output_dir) / f"predictions-step{step}.jsonl"
        own(path.parent, path.name)
        with doing(f"writing the predictions of step {step}", path, "train.output_dir"), path.open("w") as f:
            for c in completions:
                record = {
                    "prompt": self.tokenizer.decode(c.prompt_ids),
                    "completion": self.tokenizer.decode(c.completion_ids, skip_special_tokens=True),
                    "finished": c.finished,
                }
                f.write(json.dumps(record) + "\n")
        return path


def eval_prompt_ids(rows: list[Any], tokenizer: Any) -> list[list[int]]:
    """Prompts for generation eval: the conversation up to its last assistant turn, or the prompt field."""
    prompts = []
    for row in rows:
        data = row.data
        if "messages" in data:
            last = max(i for i, m in enumerate(data["messages"]) if m["role"] == "assistant")
            ids = tokenizer.apply_chat_template(
                data["messages"][:last], add_generation_prompt=True, tokenize=True
            )
            prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
        elif "prompt" in data and isinstance(data["prompt"], str):
            prompts.append(tokenizer(data["prompt"], add_special_tokens=False)["input_ids"])
        else:
            raise ValueError(
                f"{row.where}: eval_generate needs prompts (messages or prompt/completion rows); "
                "set train.eval_generate: false for text data"
            )
    return prompts


def load_examples(
    spec: str,
    role: str,
    data: Any,
    tokenizer: Any,
    output_dir: str,
    stop_ids: Sequence[int],
    images: ImageInputs | None = None,
) -> ExampleSet[Example]:
    """The tokenized SFT examples of ``data.<role>`` (``spec``), as ``data`` says, each turn ended by one of
    the model's ``stop_ids``; skips reported."""
    layout = SFTLayout(
        max_length=data.max_length,
        format=data.format,
        truncation=data.truncation,
        completion_only_loss=data.completion_only_loss,
        per_turn=data.per_turn,
        skip_bad_rows=data.skip_bad_rows,
        stop_ids=stop_ids,
    )
    examples, stats = load_set(
        spec, layout, tokenizer, images=images, cache_dir=data.cache_dir, num_proc=data.num_proc
    )
    report_data(stats, role, spec, output_dir)
    return examples


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    # SFT examples share no prompt by construction: tree rows only where train.tree_packing: on asks
    session = start_session(cfg.model, cfg.train.seed, cfg.train.output_dir, cfg, shared_prompts=False)
    acc, tokenizer = session.accelerator, session.tokenizer
    data = cfg.data
    images = session.images
    stop_ids = stop_token_ids(cfg.model.name)  # what ends a chat turn: the model's stop tokens

    def tokenize(spec: str, role: str) -> ExampleSet[Example]:
        return load_examples(spec, role, data, tokenizer, cfg.train.output_dir, stop_ids, images)

    examples = tokenize(data.train, "train")
    eval_examples, eval_prompts, eval_vision = None, None, None
    if data.eval:
        eval_examples = tokenize(data.eval, "eval")
        eval_rows = load_rows(data.eval) if cfg.train.eval_generate else []
        if cfg.train.eval_generate and images is not None:
            cut, _ = tokenize_prompts(
                images.prompt_rows(eval_rows), tokenizer, max_prompt_length=1 << 20, images=images
            )
            eval_prompts, eval_vision = [e.prompt_ids for e in cut], [e.vision for e in cut]
        elif cfg.train.eval_generate:
            eval_prompts = eval_prompt_ids(eval_rows, tokenizer)
    recipe = SFTRecipe(
        examples,
        cfg.train,
        tokenizer,
        acc.device,
        eval_examples,
        eval_prompts,
        eval_vision,
    )
    saved = images.processor if images else tokenizer  # written beside each checkpoint
    return Trainer(recipe, session.engine(), saved, cfg.train, acc).train()
