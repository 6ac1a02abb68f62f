"""The run configs the trainers read: one pydantic section per part of a run, one config per trainer.

To add a key, add a field (with a default and a docstring) to its section below; cross-field rules go in
the section's ``_check`` (raise :func:`padless.config.loading.invalid`). Loading, overrides and error
messages are in :mod:`padless.config.loading`. This module imports no torch, so configs can be checked
quickly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import field
from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from padless.config.choices import REPORTERS, TRACKERS, Backend, ModelDType, TreePacking, VarlenKernel
from padless.config.loading import Applies, ConfigModel, Why, invalid

# Bounds are part of a key's type (PositiveInt, ... from pydantic, or Field(ge=..., lt=...)), so that the
# JSON Schema carries them and editors check them too; rules that need a reason or a fix of their own
# go in the section's _check.
Fraction = Annotated[float, Field(ge=0, lt=1)]
Seed = Annotated[int, Field(ge=0, lt=2**32), Why("seeds are 32-bit: numpy takes no other")]


class LoraSettings(ConfigModel):
    """LoRA adapters; present (even as ``lora: {}``) means train adapters instead of all weights."""

    r: PositiveInt = 16
    """rank of each adapter"""
    alpha: PositiveInt = 32
    """scaling numerator: adapters are scaled by alpha / r"""
    dropout: Fraction = 0.05
    """dropout on the adapters' input (RL runs switch it off)"""
    target_modules: list[str] | str = "all-linear"
    """module names, or all-linear"""

    def _check(self) -> None:
        if not self.target_modules:
            raise invalid(
                "target_modules",
                "is empty, so no layer would get an adapter",
                "list module names such as [q_proj, v_proj], or use all-linear",
            )


class ModelSettings(ConfigModel):
    """The model trained: where it comes from, its attention backend, precision, LoRA and checkpointing."""

    name: str = "tiny-qwen2"
    """embedded name, local dir or cached HF id"""
    attn_implementation: Backend = "varlen"
    """attention backend; varlen (default) isolates packed sequences by their boundaries; sdpa, eager,
    flex_attention by per-sequence masks; every backend is proven at load"""
    varlen_kernel: VarlenKernel = "auto"
    """varlen's kernel; auto: flash_attn (if installed), else torch's varlen_attn on CUDA in bf16/fp16, sdpa
    (exact) elsewhere; a kernel named here that cannot run is an error, never a fallback"""
    dtype: ModelDType = "auto"
    """auto: bf16 on CUDA, fp32 on CPU"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory"""
    lora: LoraSettings | None = None
    seed: Seed = 0
    """init seed for embedded tiny models"""
    trust_remote_code: bool = False
    """run Python code shipped in a model folder (auto_map); never a prompt"""
    router_aux_loss_coef: NonNegativeFloat | None = None
    """mixture of experts: weight of the router load-balancing loss its own objective adds (null: its
    config's router_aux_loss_coef; 0: off); refused for a model without one"""

    applies = (
        Applies(
            ("varlen_kernel",),
            ("attn_implementation",),
            lambda s: s.attn_implementation == "varlen",
            "it picks the kernel of attn_implementation varlen, and another backend is set",
            "set attn_implementation to varlen, or varlen_kernel to auto",
        ),
    )

    def _check(self) -> None:
        if not self.name:
            raise invalid("name", "is empty", "give an embedded model name, a local directory or a HF id")


class DataSettings(ConfigModel):
    """The SFT data: where rows come from, their format and how they become examples."""

    train: str = "tiny:sft"
    """jsonl/json/parquet path, a datasets dir (save_to_disk), or tiny:<name>"""
    eval: str | None = None
    """eval rows, same sources as train; null: no evaluation"""
    format: Literal["auto", "messages", "prompt_completion", "text"] = "auto"
    """auto: detected from the first row (messages, prompt/completion or text)"""
    max_length: PositiveInt = 2048
    """tokens per example; a longer one follows truncation"""
    truncation: Literal["error", "truncate"] = "error"
    """what to do with a sequence longer than max_length"""
    completion_only_loss: bool = True
    """prompt/completion rows: loss on the completion only (false: on the whole text)"""
    per_turn: bool = False
    """each assistant turn of a chat its own example (context as rendered for generation, loss on that turn):
    for templates that show earlier turns differently from the last one (e.g. Qwen3 strips their reasoning)"""
    skip_bad_rows: bool = False
    """skip and count rows that cannot be used (reported per reason) instead of stopping"""
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    applies = (
        Applies(
            ("completion_only_loss",),
            ("format",),
            lambda s: s.format in ("auto", "prompt_completion"),
            "it chooses between the completion and the whole prompt + completion of prompt_completion rows; "
            "text rows train every token and conversations their assistant turns",
            "set format: prompt_completion (or auto), or remove {key}",
        ),
        Applies(
            ("per_turn",),
            ("format",),
            lambda s: s.format in ("auto", "messages"),
            "it splits conversations (format messages) into one example per assistant turn",
            "set format: messages (or auto), or remove {key}",
        ),
    )

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


class TrainSettings(ConfigModel):
    """The shared training loop: optimizer, schedule, batching, evaluation, checkpoints and logging."""

    output_dir: str = "runs/sft"
    """the run folder: checkpoints, metrics, TensorBoard logs, log.txt (a new or empty folder)"""
    seed: Seed = 42
    """seed of data order, dropout and sampling"""
    num_epochs: NonNegativeFloat = 1.0
    """passes over the training data (fractions allowed); max_steps > 0 overrides it"""
    max_steps: Annotated[int, Field(ge=-1)] = -1
    """>0 overrides num_epochs"""
    learning_rate: PositiveFloat = 1e-4
    """peak learning rate of AdamW"""
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """learning-rate schedule after warm-up"""
    warmup_ratio: Fraction = 0.0
    """share of the steps spent warming up linearly"""
    warmup_steps: NonNegativeInt = 0
    """>0 overrides warmup_ratio"""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW decoupled weight decay"""
    adam_beta1: Fraction = 0.9
    """AdamW beta1"""
    adam_beta2: Fraction = 0.999
    """AdamW beta2"""
    adam_epsilon: PositiveFloat = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """<=0 disables clipping"""
    gradient_accumulation_steps: PositiveInt = 1
    """micro-batches per optimizer step on each process"""
    batching: Literal["tokens", "packing", "padded"] = "tokens"
    """tokens: token-budget micro-batches (best-fit decreasing, re-planned each epoch); packing: bins packed
    once; padded: padded rows, for comparisons"""
    max_tokens_per_batch: PositiveInt = 4096
    """tokens per micro-batch for batching tokens, and bin size for packing"""
    batch_size: PositiveInt = 8
    """sequences per micro-batch for "padded" (comparison mode only)"""
    padding_side: Literal["left", "right"] = "right"
    """batching padded only"""
    logits_memory_mb: PositiveInt = 1024
    """fp32 logits of a micro-batch above this many MB: the LM head runs in chunks"""
    sequence_parallel: PositiveInt = 1
    """ranks each packed row is split over (Ulysses); data parallel = processes / this"""
    tree_packing: TreePacking = "auto"
    """a prefix that packed sequences share (a DPO pair's prompt, a GRPO group's) computed once: auto (in
    tasks whose sequences share a prompt, not SFT, where the model runs it exactly; the log says which
    layout ran), on (SFT too; refused where it cannot run), off"""
    logging_steps: PositiveInt = 10
    """optimizer steps between metrics records"""
    eval_steps: NonNegativeInt = 0
    """0: evaluate only at the end (if data.eval is set)"""
    eval_generate: bool = False
    """SFT: also sample completions for the eval prompts and save them (predictions-step*.jsonl)"""
    eval_max_new_tokens: PositiveInt = 64
    """eval_generate: tokens per completion"""
    eval_batch_size: PositiveInt = 8
    """eval_generate: prompts per generate() call"""
    save_steps: NonNegativeInt = 0
    """0: save only at the end"""
    save_total_limit: NonNegativeInt = 0
    """0: keep all"""
    resume_from_checkpoint: str | None = None
    """path, "latest" (must exist) or "auto" (latest if any)"""
    overwrite_output_dir: bool = False
    """a used output_dir is refused unless resuming or this is true"""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """a NaN/inf loss or grad norm: stop, or skip the step"""
    report_to: list[str] = Field(default_factory=lambda: ["tensorboard", "jsonl"])
    """where metrics go: tensorboard and jsonl (files in output_dir), and the trackers trackio, wandb
    (offline unless WANDB_MODE says otherwise) and mlflow (a file store in output_dir/mlruns unless
    MLFLOW_TRACKING_URI says otherwise); [] for none (log.txt is always written)"""
    run_name: str | None = None
    """the run's name in the trackers of report_to (default: output_dir's folder name)"""
    project: str = "padless"
    """the trackers' project (trackio, wandb) or experiment (mlflow) the run is filed under"""
    progress_bar: bool = True
    """show a progress bar on the console (main process)"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """console and output_dir/log.txt"""

    applies = (
        Applies(
            ("num_epochs",),
            ("max_steps",),
            lambda s: s.max_steps <= 0,
            "max_steps > 0 sets the length of the run",
            "set max_steps: -1 to train num_epochs epochs",
            refuse=False,
        ),
        Applies(
            ("warmup_ratio",),
            ("warmup_steps",),
            lambda s: s.warmup_steps == 0,
            "warmup_steps > 0 sets the warm-up",
            "set warmup_steps: 0 to warm up over warmup_ratio of the steps",
            refuse=False,
        ),
        Applies(
            ("batch_size", "padding_side"),
            ("batching",),
            lambda s: s.batching == "padded",
            "it shapes the padded batches of batching padded; packed batches hold max_tokens_per_batch "
            "tokens and have no padding",
            "set train.batching: padded to compare with padding, or remove train.{key}",
        ),
        Applies(
            ("run_name", "project"),
            ("report_to",),
            lambda s: any(r in TRACKERS for r in s.report_to),
            "it names the run in an experiment tracker, and report_to lists none",
            f"add a tracker ({', '.join(TRACKERS)}) to train.report_to, or remove train.{{key}}",
        ),
        Applies(
            ("eval_max_new_tokens", "eval_batch_size"),
            ("eval_generate",),
            lambda s: s.eval_generate,
            "it shapes the completions eval_generate samples, and eval_generate is off",
            "set train.eval_generate: true (SFT), or remove train.{key}",
        ),
        Applies(
            ("tree_packing",),
            ("batching", "sequence_parallel"),
            lambda s: s.batching != "padded" and s.sequence_parallel == 1,
            "it lays whole packed rows out as prefix trees: batching padded makes no packed rows and "
            "sequence_parallel > 1 splits them (both run flat)",
            "remove train.{key}",
        ),
    )

    def _check(self) -> None:
        if not self.output_dir:
            raise invalid("output_dir", "is empty", "give a directory for checkpoints and logs, e.g. runs/x")
        if not (self.num_epochs > 0 or self.max_steps > 0):
            raise invalid(
                ("num_epochs", "max_steps"),
                f"num_epochs={self.num_epochs!r} and max_steps={self.max_steps!r} give no training steps",
                "set num_epochs > 0, or max_steps > 0",
            )
        unknown = [r for r in self.report_to if r not in REPORTERS]
        if unknown:
            raise invalid(
                "report_to",
                f"unknown reporter(s) {', '.join(map(repr, unknown))}; padless writes to "
                f"{', '.join(map(repr, REPORTERS))}",
                f"use a subset of [{', '.join(REPORTERS)}] ([] for none)",
            )
        for name in self.report_to:
            if name in TRACKERS and importlib.util.find_spec(name) is None:
                raise invalid("report_to", f"{name} is not installed", f"{TRACKERS[name]}, or remove {name}")
        if self.run_name == "" or not self.project:
            raise invalid(("run_name", "project"), "is empty", "give a name, or leave run_name out")
        if self.resume_from_checkpoint == "":
            raise invalid(
                "resume_from_checkpoint",
                "is an empty string",
                "give a checkpoint path, 'latest', 'auto', or null to start fresh",
            )
        if self.overwrite_output_dir and self.resume_from_checkpoint in ("latest", "auto"):
            raise invalid(
                ("overwrite_output_dir", "resume_from_checkpoint"),
                f"overwrite_output_dir deletes the checkpoints in output_dir that resume_from_checkpoint="
                f"{self.resume_from_checkpoint} would resume from",
                "set one of them: overwrite_output_dir=false to resume, or resume_from_checkpoint=null",
            )
        if self.sequence_parallel > 1 and self.batching == "padded":
            raise invalid(
                ("sequence_parallel", "batching"),
                f"sequence_parallel={self.sequence_parallel} splits packed rows; batching padded makes none",
                "set batching to tokens or packing, or sequence_parallel to 1",
            )


def _eval_needs_data(what: str) -> Applies:
    """``train.eval_steps`` of any trainer: when to evaluate on ``data.eval``, which must be set."""
    return Applies(
        ("train.eval_steps",),
        ("data.eval",),
        lambda c: c.data.eval is not None,
        "it says when to evaluate on data.eval, and data.eval is not set",
        f"set data.eval to {what}, or train.eval_steps to 0",
    )


def _not_for(task: str, instead: str) -> Applies:
    """``train.eval_generate``: SFT's generation eval; other trainers evaluate otherwise (``instead``)."""
    return Applies(
        ("train.eval_generate",),
        (),
        lambda c: False,
        f"eval_generate is an SFT option ({task} evaluation {instead})",
        "set train.eval_generate to false",
    )


class SFTConfig(ConfigModel):
    """Supervised fine-tuning: the loss on completions (or assistant turns) of packed examples."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the model trained"""
    data: DataSettings = Field(default_factory=DataSettings)
    """the training (and eval) data"""
    train: TrainSettings = Field(default_factory=TrainSettings)
    """the training loop"""

    applies = (
        _eval_needs_data("an eval data set"),
        Applies(
            ("train.eval_generate",),
            ("data.eval",),
            lambda c: c.data.eval is not None,
            "eval_generate samples completions for eval prompts, but data.eval is not set",
            "set data.eval, or train.eval_generate to false",
        ),
    )


# --------------------------------------------------------------------------------------------------
# Preference training: DPO (and its reference-free variants) and reward models


class PreferenceDataSettings(ConfigModel):
    """Preference pairs (prompt, chosen, rejected) for DPO and reward models."""

    train: str = "tiny:preference"
    """same sources as DataSettings.train"""
    eval: str | None = None
    """eval pairs, same sources as train; null: no evaluation"""
    max_length: PositiveInt = 2048
    """per side: prompt + chosen, and prompt + rejected"""
    truncation: Literal["error", "truncate"] = "error"
    """truncate cuts the completion, never the prompt"""
    skip_bad_rows: bool = False
    """skip and count rows that cannot be used (reported per reason) instead of stopping"""
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


REF_MODEL_APPLIES = Applies(
    ("ref_model",),
    ("reference",),
    lambda s: s.reference == "model",
    "reference 'adapters' uses the policy itself with adapters disabled",
    "set ref_model to null, or reference to model",
)


def _adapters_need_lora(section: str, reference: str, model: ModelSettings) -> None:
    """A reference of 'adapters' is the policy with its LoRA adapters off: there must be adapters."""
    if reference == "adapters" and model.lora is None:
        raise invalid(
            (f"{section}.reference", "model.lora"),
            "reference 'adapters' means the policy with its LoRA adapters disabled, but model.lora is "
            "not set, so there are no adapters",
            f"add a model.lora section (e.g. model.lora.r=16), or set {section}.reference to model",
        )


class DPOSettings(ConfigModel):
    """The DPO loss and its reference."""

    beta: PositiveFloat = 0.1
    """strength of the implicit KL constraint (the logits' temperature in the loss)"""
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge, or simpo (reference-free, length-normalised)"""
    label_smoothing: Annotated[
        float, Field(ge=0, lt=0.5), Why("0.5 would make chosen and rejected interchangeable")
    ] = 0.0
    """sigmoid and simpo: conservative DPO for noisy labels"""
    rpo_alpha: NonNegativeFloat | None = None
    """weight of an NLL term on chosen (RPO); null: none"""
    simpo_gamma: NonNegativeFloat = 0.5
    """SimPO target reward margin; used as gamma / beta inside the sigmoid, like TRL"""
    reference: Literal["model", "adapters"] = "model"
    """adapters: the policy with its LoRA adapters disabled"""
    ref_model: str | None = None
    """null: a frozen copy of model.name"""
    precompute_ref_logps: bool = False
    """compute the reference log-probs once before training, then free the reference model"""

    applies = (
        Applies(
            ("ref_model", "reference", "precompute_ref_logps"),
            ("loss_type",),
            lambda s: s.loss_type != "simpo",
            "simpo is reference-free (it scores length-normalized policy log-probs only)",
            "unset {key}, or choose a loss_type that uses a reference (sigmoid, ipo, hinge)",
        ),
        REF_MODEL_APPLIES,
        Applies(
            ("label_smoothing",),
            ("loss_type",),
            lambda s: s.loss_type in ("sigmoid", "simpo"),
            "it smooths the sigmoid of loss_type sigmoid and simpo",
            "set label_smoothing to 0, or loss_type to sigmoid",
        ),
        Applies(
            ("simpo_gamma",),
            ("loss_type",),
            lambda s: s.loss_type == "simpo",
            "it is the target reward margin of loss_type simpo",
            "set loss_type: simpo, or remove {key}",
        ),
    )

    def _check(self) -> None:
        if self.ref_model == "":
            raise invalid("ref_model", "is an empty string", "name a model, or null for a copy of model.name")


PREFERENCE_RUN = (
    _not_for("DPO and reward-model", "reports preference metrics on data.eval instead"),
    _eval_needs_data("an eval data set (e.g. tiny:preference_eval)"),
)


class DPOConfig(ConfigModel):
    """Direct preference optimisation (sigmoid, IPO, hinge, SimPO; optional RPO term) on preference pairs."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy"""
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    """preference pairs"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/dpo", learning_rate=5e-6)
    )
    """the training loop"""
    dpo: DPOSettings = Field(default_factory=DPOSettings)
    """the DPO loss and its reference"""

    applies = PREFERENCE_RUN

    def _check(self) -> None:
        _adapters_need_lora("dpo", self.dpo.reference, self.model)


class RMSettings(ConfigModel):
    """The reward-model loss."""

    margin: bool = False
    """add each row's "margin" field to the Bradley-Terry loss (every row must have one)"""


class RMConfig(ConfigModel):
    """A reward model: a scalar head trained with the Bradley-Terry loss on chosen/rejected pairs."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the model that gets a score head"""
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    """preference pairs"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/rm", learning_rate=1e-4)
    )
    """the training loop"""
    rm: RMSettings = Field(default_factory=RMSettings)
    """the Bradley-Terry loss"""

    applies = (
        *PREFERENCE_RUN,
        Applies(
            ("train.logits_memory_mb",),
            (),
            lambda c: False,
            "a reward model scores with a scalar head, and no language-model logits are computed",
            "remove train.logits_memory_mb",
        ),
    )


class ORPOSettings(ConfigModel):
    """The ORPO loss."""

    beta: PositiveFloat = 0.1
    """weight of the odds-ratio term beside the chosen completion's NLL (the paper's lambda, TRL's beta)"""


class ORPOConfig(ConfigModel):
    """Odds-ratio preference optimisation: the chosen completion's NLL plus an odds-ratio term on preference
    pairs, with no reference model."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy"""
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    """preference pairs"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/orpo", learning_rate=8e-6)
    )
    """the training loop"""
    orpo: ORPOSettings = Field(default_factory=ORPOSettings)
    """the ORPO loss"""

    applies = PREFERENCE_RUN


class KTOSettings(ConfigModel):
    """The KTO loss and its reference."""

    beta: PositiveFloat = 0.1
    """scale of the implicit reward beta (log pi - log pi_ref) inside the sigmoid"""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: against the KL baseline estimated on mismatched prompt / completion pairs; apo_zero_unpaired:
    without the baseline (no KL pass)"""
    desirable_weight: PositiveFloat = 1.0
    """weight of a desirable completion's loss"""
    undesirable_weight: PositiveFloat = 1.0
    """weight of an undesirable completion's loss (KTO's Eq. 8: keep desirable_weight x desirable count
    about 1 to 1.33 x undesirable_weight x undesirable count)"""
    reference: Literal["model", "adapters"] = "model"
    """adapters: the policy with its LoRA adapters disabled"""
    ref_model: str | None = None
    """null: a frozen copy of model.name"""
    precompute_ref_logps: bool = False
    """reference log-probs (of completions and of the KL pairs) computed once before training, the
    reference then freed"""

    applies = (REF_MODEL_APPLIES,)

    def _check(self) -> None:
        if self.ref_model == "":
            raise invalid("ref_model", "is an empty string", "name a model, or null for a copy of model.name")


class KTOConfig(ConfigModel):
    """Kahneman-Tversky optimisation on unpaired completions labelled desirable or undesirable (rows with
    ``prompt``, ``completion``, ``label``; preference pairs are read as one of each)."""

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy"""
    data: PreferenceDataSettings = Field(default_factory=PreferenceDataSettings)
    """completions labelled desirable or undesirable (unpaired rows, or preference pairs)"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/kto", learning_rate=5e-6)
    )
    """the training loop"""
    kto: KTOSettings = Field(default_factory=KTOSettings)
    """the KTO loss and its reference"""

    applies = PREFERENCE_RUN

    def _check(self) -> None:
        _adapters_need_lora("kto", self.kto.reference, self.model)


# --------------------------------------------------------------------------------------------------
# Online RL: GRPO and PPO


class RLDataSettings(ConfigModel):
    """RL prompt rows and how they are tokenized."""

    train: str = "tiny:rl"
    """rows {"prompt": str | messages, ...}; other columns go to the reward functions"""
    eval: str | None = None
    """eval prompts, same sources as train; null: no evaluation"""
    max_prompt_length: PositiveInt = 512
    """prompts are never truncated: a longer one is a bad row"""
    chat_template: bool | None = None
    """string prompts as a user message; None: when the tokenizer has one"""
    skip_bad_rows: bool = False
    """skip and count rows that cannot be used (reported per reason) instead of stopping"""
    cache_dir: str | None = None
    """tokenized sets are cached here; null: padless/ in the datasets cache"""
    num_proc: PositiveInt | None = None
    """processes that tokenize on a cache miss; null: one per core, at most 8"""

    def _check(self) -> None:
        if not self.train:
            raise invalid("train", "is empty", "give a data file, a datasets directory, or tiny:<name>")


ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class RolloutSettings(ConfigModel):
    """How rollouts are sampled: engine, sizes, temperature, the sampler correction and multi-turn
    episodes."""

    engine: Literal["hf", "vllm"] = "hf"
    """vllm: needs vLLM (a CUDA build with a GPU, or the CPU build; checked at start), colocated or a
    server (vllm_mode)"""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """engine vllm: colocate (an engine in the training process) or server (a `padless vllm-serve` process
    at vllm_server_url, sent the policy's weights before every rollout)"""
    vllm_server_url: str = "http://127.0.0.1:8000"
    """vllm_mode server: where `padless vllm-serve` listens"""
    vllm_server_timeout: PositiveFloat = 600.0
    """vllm_mode server: seconds one request (a rollout's generation, a weight push) may take"""
    prompts_per_step: PositiveInt = 16
    """prompts per rollout batch"""
    num_generations: PositiveInt = 4
    """samples per prompt (GRPO group size; PPO usually 1)"""
    max_new_tokens: PositiveInt = 64
    """tokens per completion (per model turn in episodes)"""
    temperature: Annotated[
        float,
        Field(gt=0),
        Why("RL samples completions, and greedy decoding would give every sample of a prompt the same one"),
    ] = 1.0
    """sampling temperature; log-probs are taken at it too"""
    top_p: float = Field(1.0, gt=0, le=1)
    """nucleus sampling; the recorded log-probs are those before top-p renormalisation"""
    generation_batch_size: PositiveInt = 32
    """sequences per generate() call"""
    mask_truncated: bool = True
    """completions that hit max_new_tokens without EOS: out of the loss, or kept"""
    vllm_gpu_memory_utilization: Annotated[
        float,
        Field(gt=0, lt=1),
        Why("the rest of the GPU holds the policy, its gradients and optimizer state"),
    ] = 0.3
    """engine vllm: share of GPU memory for its weights + KV cache"""
    importance_sampling_correction: bool | None = None
    """weight the policy loss by trainer / sampler probability; default: on when the sampler is not the
    training forward (engine vllm) or samples are stale (max_staleness > 0)"""
    importance_sampling_mode: ImportanceSamplingMode = "sequence_mask"
    """per token or per sequence (summed log-ratio); clip to the bounds or zero what falls outside (TRL's)"""
    importance_sampling_clip_max: PositiveFloat | None = 3.0
    """upper bound C_max of the ratio (null: none)"""
    importance_sampling_clip_min: NonNegativeFloat | None = None
    """lower bound C_min of the ratio (null: none)"""
    max_staleness: NonNegativeInt = 0
    """rollouts sampled ahead, from weights at most this many updates old (0: on-policy)"""
    routing_replay: bool = False
    """mixture of experts: record the experts each sampled token was routed to and route the same ones in
    the old-log-prob and update passes (hf engine, single completions on-policy)"""
    environment: str | None = None
    """multi-turn episodes: an environment class built per prompt row (module:Class, file.py:Class, or
    bundled: tools, the plain tool loop; calculator; verifiers, the verifiers task of each row of data.train:
    verifiers:..., played through its Env with its tool servers); max_new_tokens is then per model turn"""
    tools: list[str] = Field(default_factory=list)
    """tool functions the model may call (module:fn, file.py:fn); their JSON schemas go to the chat
    template's tools"""
    max_turns: PositiveInt = 4
    """model turns per episode (environment or tools); an episode still going then is truncated"""
    max_episode_tokens: PositiveInt | None = None
    """tokens per episode, prompt and environment turns included (null: no limit but max_turns)"""
    response_template: dict[str, Any] | None = None
    """how tool calls are read from a model turn (transformers' response_template schema); null: the
    tokenizer's own"""

    def correction(self) -> bool:
        """Whether the importance-sampling correction runs (its default resolved)."""
        if self.importance_sampling_correction is not None:
            return self.importance_sampling_correction
        return self.engine == "vllm" or self.max_staleness > 0

    def episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes (an environment or tools)."""
        return self.environment is not None or bool(self.tools)

    def model_token_budget(self) -> int:
        """The most tokens the model writes in one sample: ``max_new_tokens``, or for an episode
        ``max_new_tokens`` per turn over ``max_turns`` turns, within ``max_episode_tokens`` (dr_grpo's
        constant per sequence: an episode's model tokens, all its turns together)."""
        if not self.episodes():
            return self.max_new_tokens
        most = self.max_turns * self.max_new_tokens
        return most if self.max_episode_tokens is None else min(most, self.max_episode_tokens)

    applies = (
        Applies(
            ("max_turns", "max_episode_tokens", "response_template"),
            ("environment", "tools"),
            episodes,
            "it shapes multi-turn episodes, but neither an environment nor tools are set (a single "
            "completion is one turn of max_new_tokens)",
            "set rollout.environment (or rollout.tools), or remove rollout.{key}",
        ),
        Applies(
            ("importance_sampling_mode", "importance_sampling_clip_max", "importance_sampling_clip_min"),
            ("importance_sampling_correction", "engine", "max_staleness"),
            correction,
            "the importance-sampling correction is off (on by default with engine vllm or max_staleness > 0)",
            "set rollout.importance_sampling_correction: true, or remove rollout.{key}",
        ),
        Applies(
            ("vllm_gpu_memory_utilization",),
            ("engine", "vllm_mode"),
            lambda s: s.engine == "vllm" and s.vllm_mode == "colocate",
            "it sizes the colocated vLLM engine's share of the GPU (a server sizes its own)",
            "set rollout.engine: vllm (vllm_mode colocate), or remove rollout.{key}",
        ),
        Applies(
            ("vllm_mode",),
            ("engine",),
            lambda s: s.engine == "vllm",
            "it says where vLLM runs, and the engine is not vllm",
            "set rollout.engine: vllm, or remove rollout.{key}",
        ),
        Applies(
            ("vllm_server_url", "vllm_server_timeout"),
            ("engine", "vllm_mode"),
            lambda s: s.engine == "vllm" and s.vllm_mode == "server",
            "it reaches a vLLM server, and rollout.vllm_mode is not server",
            "set rollout.engine: vllm and rollout.vllm_mode: server, or remove rollout.{key}",
        ),
        Applies(
            ("generation_batch_size",),
            ("engine",),
            lambda s: s.engine == "hf",
            "it batches the hf engine's generate calls; vLLM schedules its own batches",
            "remove rollout.{key}",
        ),
    )

    def _check(self) -> None:
        # which engines and sampling modes go together: padless.rl.sampling (REFUSALS)
        if self.max_staleness > 0 and self.importance_sampling_correction is False:
            raise invalid(
                ("max_staleness", "importance_sampling_correction"),
                f"max_staleness={self.max_staleness} samples from weights up to that many updates old, and "
                "the loss must weight them by trainer / sampler probability, which "
                "importance_sampling_correction: false switches off",
                "remove importance_sampling_correction (or set it true), or set max_staleness: 0",
            )
        low, high = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if low is not None and high is not None and not low < high:
            raise invalid(
                ("importance_sampling_clip_min", "importance_sampling_clip_max"),
                f"clip_min={low!r} is not below clip_max={high!r}: no ratio would pass",
                "set e.g. importance_sampling_clip_min: null, importance_sampling_clip_max: 3.0",
            )
        if (
            self.correction()
            and self.importance_sampling_mode.endswith("truncate")
            and low is None
            and high is None
        ):
            raise invalid(
                ("importance_sampling_mode", "importance_sampling_clip_max", "importance_sampling_clip_min"),
                f"{self.importance_sampling_mode} clamps the ratio to its bounds, and neither bound is set",
                "set importance_sampling_clip_max (e.g. 3.0), or a *_mask mode",
            )


class RewardSettings(ConfigModel):
    """The reward: a weighted sum of ``functions`` (see :mod:`padless.rl.rewards`) and a reward model's
    score."""

    functions: list[str] = Field(default_factory=lambda: ["arithmetic"])
    """bundled, module:fn or file.py:fn"""
    weights: list[float] | None = None
    """default 1.0 each; one per function, in order"""
    model: str | None = None
    """a padless reward model checkpoint (score at each sequence's last token)"""
    model_weight: float = 1.0
    """weight of the reward model's score in the sum"""
    overlong_buffer: NonNegativeInt = 0
    """DAPO soft overlong penalty: from rollout.max_new_tokens - overlong_buffer tokens on, a penalty falling
    linearly to -overlong_penalty at max_new_tokens is added to the reward; 0 = off"""
    overlong_penalty: PositiveFloat | None = None
    """the penalty at max_new_tokens (default 1.0)"""

    applies = (
        Applies(
            ("model_weight",),
            ("model",),
            lambda s: s.model is not None,
            "it weights a reward model's score, and model is not set",
            "set model to a reward model checkpoint, or leave model_weight at 1.0",
        ),
        Applies(
            ("overlong_penalty",),
            ("overlong_buffer",),
            lambda s: s.overlong_buffer > 0,
            "it scales the soft overlong penalty, which is off (overlong_buffer: 0)",
            "set overlong_buffer to the length of the penalised zone (e.g. a quarter of max_new_tokens)",
        ),
    )

    def _check(self) -> None:
        for i, spec in enumerate(self.functions):
            if not spec.strip():
                raise invalid(
                    "functions",
                    f"item {i} is an empty string",
                    "write 'package.module:function', 'path/to/file.py:function' or a bundled name",
                )
        repeated = sorted({s for s in self.functions if self.functions.count(s) > 1})
        if repeated:
            raise invalid(
                "functions",
                f"{repeated[0]!r} is listed more than once, so it would count twice",
                "list it once and raise its weight instead",
            )
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise invalid(
                ("weights", "functions"),
                f"{len(self.weights)} weight(s) for {len(self.functions)} function(s)",
                "give one weight per function, in the same order, or null for 1.0 each",
            )
        if self.model == "":
            raise invalid("model", "is an empty string", "give a reward model checkpoint, or null for none")

    @property
    def overlong_factor(self) -> float:
        """The soft overlong penalty at ``rollout.max_new_tokens``."""
        return 1.0 if self.overlong_penalty is None else self.overlong_penalty


class GRPOSettings(ConfigModel):
    """The GRPO family: loss, clipping, advantages, KL and how a rollout is cut into steps."""

    beta: NonNegativeFloat = 0.04
    """KL (k3) coefficient; 0 disables the reference model"""
    epsilon: Annotated[float, Field(gt=0, lt=1), Why("the lower clip bound 1 - epsilon must stay > 0")] = 0.2
    """clip range: ratios are clipped to [1 - epsilon, 1 + epsilon_high]"""
    epsilon_high: PositiveFloat | None = None
    """asymmetric upper clip (DAPO); default = epsilon"""
    scale_rewards: bool | None = None
    """advantage grpo: divide group-centred rewards by the group std (default true; false = Dr.GRPO)"""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "cispo"] = "dapo"
    """dapo: token-mean over the step; grpo: mean of each sequence's token-mean; dr_grpo: sum over
    sequences x the model-token budget (max_new_tokens; an episode: x max_turns); cispo: capped,
    stop-gradient IS weight times log-prob, token-mean"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """sequence: GSPO, one length-normalised ratio per sequence (use small epsilons, e.g. 3e-4 / 4e-4)"""
    cispo_max_ratio: PositiveFloat | None = None
    """loss_type cispo: cap on the importance weight (default 5.0, ScaleRL's epsilon_max)"""
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    """grpo: group mean (and std); rloo: leave-one-out group mean; reinforce_pp: group mean, then one
    std over the whole rollout (REINFORCE++-baseline)"""
    dynamic_sampling_rounds: NonNegativeInt = 0
    """DAPO dynamic sampling: groups whose rewards are all equal are dropped and refilled with fresh
    prompts, at most this many refill rounds per rollout; 0 = off"""
    dynamic_sampling_empty_refills: PositiveInt = 3
    """refill rounds in a row that find no group with different rewards before the run stops (the policy
    or the prompts give no learning signal)"""
    updates_per_rollout: PositiveInt = 1
    """policy passes over each rollout batch (ratios from stored old log-probs)"""
    mini_batches_per_rollout: PositiveInt = 1
    """optimizer steps per pass"""
    kl_bias_correction: bool = False
    """multiply the k3 KL by the ratio pi / pi_old, as TRL does by default (use_bias_correction_kl); off:
    the plain k3 of DeepSeekMath"""
    token_normaliser: Literal["step", "rollout"] = "step"
    """dapo / cispo with several mini-batches: each step's token mean over its own tokens (step), or over
    the rollout's tokens / mini_batches_per_rollout, as TRL normalises (rollout)"""

    applies = (
        Applies(
            ("epsilon", "epsilon_high"),
            ("loss_type",),
            lambda s: s.loss_type != "cispo",
            "cispo clips no ratio: it caps the importance weight at cispo_max_ratio (TRL passes that cap as "
            "epsilon_high)",
            "set the cap with grpo.cispo_max_ratio, or remove grpo.{key}",
        ),
        Applies(
            ("cispo_max_ratio",),
            ("loss_type",),
            lambda s: s.loss_type == "cispo",
            "it is the cap of loss_type cispo; clipped losses use epsilon / epsilon_high",
            "set loss_type: cispo, or remove grpo.cispo_max_ratio",
        ),
        Applies(
            ("scale_rewards",),
            ("advantage",),
            lambda s: s.advantage == "grpo",
            "it divides by the group std of advantage grpo",
            "remove scale_rewards, or set advantage: grpo",
        ),
        Applies(
            ("kl_bias_correction",),
            ("beta",),
            lambda s: s.beta > 0,
            "it corrects the KL term, which beta: 0 switches off",
            "set grpo.beta > 0, or remove grpo.kl_bias_correction",
        ),
        Applies(
            ("token_normaliser",),
            ("loss_type", "mini_batches_per_rollout"),
            lambda s: s.loss_type in ("dapo", "cispo") and s.mini_batches_per_rollout > 1,
            "it chooses the token count of dapo / cispo steps, which differ only with several mini-batches",
            "set grpo.mini_batches_per_rollout > 1 with loss_type dapo or cispo, or remove grpo.{key}",
        ),
        Applies(
            ("dynamic_sampling_empty_refills",),
            ("dynamic_sampling_rounds",),
            lambda s: s.dynamic_sampling_rounds > 0,
            "it bounds dynamic sampling's refills, which dynamic_sampling_rounds: 0 switches off",
            "set grpo.dynamic_sampling_rounds > 0, or remove grpo.{key}",
        ),
    )

    def _check(self) -> None:
        if self.epsilon_high is not None and not self.epsilon_high >= self.epsilon:
            raise invalid(
                ("epsilon_high", "epsilon"),
                f"epsilon_high={self.epsilon_high!r} is below epsilon={self.epsilon!r}; it is the upper clip "
                "range, meant to be at least as wide as the lower one (DAPO's clip-higher: 0.28 with 0.2)",
                "set epsilon_high >= epsilon, or null for a symmetric clip",
            )
        if self.loss_type == "cispo" and self.importance_sampling_level == "sequence":
            raise invalid(
                ("importance_sampling_level", "loss_type"),
                "a sequence-level ratio (GSPO) is implemented for the clipped losses, not for cispo",
                "set importance_sampling_level: token, or a clipped loss_type (dapo, grpo, dr_grpo)",
            )

    @property
    def group_std(self) -> bool:
        """Whether GRPO advantages divide by the group std (``scale_rewards``, default true)."""
        return self.scale_rewards is not False

    @property
    def max_ratio(self) -> float:
        """CISPO's cap on the importance weight."""
        return 5.0 if self.cispo_max_ratio is None else self.cispo_max_ratio


class PPOSettings(ConfigModel):
    """PPO: value model, GAE, clipping and the per-token KL penalty."""

    value_model: str | None = None
    """default: model.name with a fresh scalar head"""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount"""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda"""
    kl_coef: NonNegativeFloat = 0.05
    """per-token KL penalty folded into the reward"""
    cliprange: float = Field(0.2, gt=0, lt=1)
    """policy ratio clipped to [1 - cliprange, 1 + cliprange]"""
    cliprange_value: float = Field(0.2, gt=0, lt=1)
    """value predictions clipped to old value +- cliprange_value"""
    vf_coef: PositiveFloat = 0.1
    """weight of the value loss beside the policy loss"""
    whiten_advantages: bool = True
    """normalise advantages over the rollout to mean 0, std 1"""
    critic_warmup_steps: NonNegativeInt = 0
    """rollouts that update only the value model first"""
    updates_per_rollout: PositiveInt = 1
    """policy passes over each rollout batch (ratios from stored old log-probs)"""
    mini_batches_per_rollout: PositiveInt = 1
    """optimizer steps per pass"""
    value_learning_rate: PositiveFloat | None = None
    """default: train.learning_rate"""

    def _check(self) -> None:
        if self.value_model == "":
            raise invalid(
                "value_model", "is an empty string", "name a model, or null for model.name with a fresh head"
            )


RL_RUN = (
    _not_for("RL", "samples completions for data.eval and reports their rewards instead"),
    _eval_needs_data("a prompt data set"),
    Applies(
        ("reward.overlong_buffer",),
        ("rollout.environment", "rollout.tools"),
        lambda c: not c.rollout.episodes(),
        "the soft overlong penalty reads one completion's length, and an episode has several model turns",
        "set reward.overlong_buffer: 0, or cap episodes with rollout.max_episode_tokens",
    ),
)


def _check_rl_run(
    train: TrainSettings,
    rollout: RolloutSettings,
    reward: RewardSettings,
    mini_batches: str,
    n_mini: int,
) -> None:
    """Cross-section checks shared by GRPO and PPO configs."""
    if not reward.functions and reward.model is None and rollout.environment is None:
        raise invalid(
            ("reward.functions", "reward.model", "rollout.environment"),
            "no reward: functions is empty, and neither model nor an environment is set",
            "list reward functions (e.g. [arithmetic]), set reward.model to a reward model checkpoint, or "
            "set rollout.environment to one whose steps give rewards",
        )
    if train.batching == "padded":
        raise invalid(
            "train.batching",
            "'padded' is a comparison mode for SFT and preference training; RL scoring always runs packed",
            "set train.batching to tokens or packing",
        )
    if reward.overlong_buffer > rollout.max_new_tokens:
        raise invalid(
            ("reward.overlong_buffer", "rollout.max_new_tokens"),
            f"the soft overlong zone of {reward.overlong_buffer} tokens is longer than the "
            f"{rollout.max_new_tokens} tokens a completion may have",
            "set reward.overlong_buffer <= rollout.max_new_tokens",
        )
    samples = rollout.prompts_per_step * rollout.num_generations
    if samples % n_mini:
        raise invalid(
            (mini_batches, "rollout.prompts_per_step", "rollout.num_generations"),
            f"a rollout of {rollout.prompts_per_step} prompts x {rollout.num_generations} generations = "
            f"{samples} samples does not split into {n_mini} equal mini-batches",
            f"choose {mini_batches.rpartition('.')[2]} dividing {samples}, or change prompts_per_step",
        )


class GRPOConfig(ConfigModel):
    """Group Relative Policy Optimization: ``num_generations`` samples per prompt, advantages within groups.

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout of
    ``rollout.prompts_per_step`` prompts gives ``grpo.updates_per_rollout x grpo.mini_batches_per_rollout``
    of them, so a run makes ``max_steps / (updates x mini-batches)`` rollouts.
    """

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy"""
    data: RLDataSettings = Field(default_factory=RLDataSettings)
    """prompt rows"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/grpo", learning_rate=1e-5, max_steps=100)
    )
    """the training loop; max_steps counts optimizer steps"""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """sampling"""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """reward functions and reward model"""
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    """the GRPO loss and advantages"""

    applies = RL_RUN

    def _check(self) -> None:
        if self.rollout.num_generations < 2:
            raise invalid(
                "rollout.num_generations",
                f"is {self.rollout.num_generations}, but GRPO's advantages compare the samples of one prompt "
                "with each other, so every group needs at least 2",
                "set rollout.num_generations to 2 or more (e.g. 4 or 8)",
            )
        n = self.grpo.mini_batches_per_rollout
        _check_rl_run(self.train, self.rollout, self.reward, "grpo.mini_batches_per_rollout", n)


class PPOConfig(ConfigModel):
    """Proximal Policy Optimization with a learned value model (GAE advantages, per-token KL penalty).

    ``train.max_steps`` counts optimizer steps of the shared training loop: each rollout gives
    ``ppo.updates_per_rollout x ppo.mini_batches_per_rollout`` of them (critic warm-up rollouts included).
    """

    model: ModelSettings = Field(default_factory=ModelSettings)
    """the policy"""
    data: RLDataSettings = Field(default_factory=RLDataSettings)
    """prompt rows"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/ppo", learning_rate=1e-5, max_steps=100)
    )
    """the training loop; max_steps counts optimizer steps"""
    rollout: RolloutSettings = Field(default_factory=lambda: RolloutSettings(num_generations=1))
    """sampling"""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """reward functions and reward model"""
    ppo: PPOSettings = Field(default_factory=PPOSettings)
    """the PPO losses and value model"""

    applies = RL_RUN

    def _check(self) -> None:
        n = self.ppo.mini_batches_per_rollout
        _check_rl_run(self.train, self.rollout, self.reward, "ppo.mini_batches_per_rollout", n)


# --------------------------------------------------------------------------------------------------
# Distillation: a student learns a frozen teacher's distributions

DistillMode = Literal["on_policy", "gkd", "offline"]
_DATA_ONLY = ("format", "max_length", "truncation", "completion_only_loss", "per_turn")
_PROMPT_ONLY = ("max_prompt_length", "chat_template")
# rollout keys gkd's on-policy steps sample with; the rest shape on_policy's rollouts only
_GKD_SAMPLING = ("max_new_tokens", "temperature", "top_p", "generation_batch_size")


class DistillDataSettings(DataSettings):
    """The rows distillation reads: prompts (mode on_policy, like GRPO's) or SFT rows whose completions the
    student learns the teacher's distribution on (modes offline and gkd; gkd's on-policy steps sample from
    their prompts)."""

    train: str = "tiny:rl"
    """on_policy: prompt rows {"prompt": ...} (other columns go to the measured rewards); offline and gkd:
    SFT rows (messages, prompt/completion or text). A path, a datasets dir, or tiny:<name>"""
    max_prompt_length: PositiveInt = 512
    """mode on_policy: prompts are never truncated; a longer one is a bad row"""
    chat_template: bool | None = None
    """mode on_policy: string prompts as a user message; None: when the tokenizer has one"""


class DistillSettings(ConfigModel):
    """The teacher and what the student learns from it."""

    teacher: str = "tiny-llama-arith"
    """the frozen teacher: an embedded name, a local dir or a cached HF id (larger than the student is the
    usual case); its tokenizer must be the student's (vocabulary, special tokens, chat template)"""
    mode: DistillMode = "on_policy"
    """on_policy: the student samples, the teacher scores the sampled tokens (reverse KL per token); gkd:
    generalised JSD over the whole vocabulary on data completions, or on student samples for a lmbda share of
    the steps; offline: forward KL to the teacher over the whole vocabulary (or its top_k) on data
    completions"""
    loss: Literal["policy_gradient", "reverse_kl"] = "policy_gradient"
    """mode on_policy: policy_gradient takes each sampled token's reverse KL (student log-prob minus
    teacher log-prob, negated) as its advantage through the policy loss with the sampler correction;
    reverse_kl minimises the exact reverse KL over the whole vocabulary at every sampled position"""
    beta: float = Field(0.5, ge=0, le=1)
    """mode gkd: the JSD's mixture weight; 0: forward KL(teacher || student), 1: reverse KL"""
    lmbda: float = Field(0.5, ge=0, le=1)
    """mode gkd: the share of optimizer steps that train on the student's own samples (drawn per step from
    train.seed); the others train on the data's completions"""
    temperature: PositiveFloat = 1.0
    """modes gkd and offline: both models' logits are divided by it before the divergence"""
    top_k: PositiveInt | None = None
    """mode offline: the teacher's distribution restricted to its top_k tokens and renormalised; null: the
    whole vocabulary"""
    nll_weight: float = Field(0.0, ge=0, le=1)
    """mode offline: loss = (1 - nll_weight) KL + nll_weight NLL of the data's tokens"""

    applies = (
        Applies(
            ("beta", "lmbda"),
            ("mode",),
            lambda s: s.mode == "gkd",
            "it shapes the generalised JSD of mode gkd",
            "set distill.mode: gkd, or remove distill.{key}",
        ),
        Applies(
            ("top_k", "nll_weight"),
            ("mode",),
            lambda s: s.mode == "offline",
            "it shapes mode offline's KL to the teacher",
            "set distill.mode: offline, or remove distill.{key}",
        ),
        Applies(
            ("temperature",),
            ("mode",),
            lambda s: s.mode != "on_policy",
            "mode on_policy takes its log-probs at rollout.temperature, the temperature it samples at",
            "set rollout.temperature instead, or remove distill.{key}",
        ),
        Applies(
            ("loss",),
            ("mode",),
            lambda s: s.mode == "on_policy",
            "it chooses mode on_policy's loss",
            "set distill.mode: on_policy, or remove distill.{key}",
        ),
    )

    def _check(self) -> None:
        if not self.teacher:
            raise invalid(
                "teacher", "is empty", "name the teacher: an embedded name, a local dir or an HF id"
            )


def _mode_is(*modes: str) -> Callable[[Any], bool]:
    return lambda c: c.distill.mode in modes


class DistillConfig(ConfigModel):
    """Knowledge distillation from a frozen teacher: on-policy (the student's samples scored by the teacher),
    GKD (generalised JSD, partly on the student's samples) or offline (forward KL on data completions).

    ``train.max_steps`` counts optimizer steps; in mode on_policy each rollout of ``rollout.prompts_per_step``
    prompts is one step."""

    model: ModelSettings = Field(default_factory=lambda: ModelSettings(name="tiny-llama"))
    """the student"""
    data: DistillDataSettings = Field(default_factory=DistillDataSettings)
    """prompt rows (on_policy) or SFT rows (offline, gkd)"""
    train: TrainSettings = field(
        default_factory=lambda: TrainSettings(output_dir="runs/distill", learning_rate=1e-4, max_steps=100)
    )
    """the training loop; max_steps counts optimizer steps"""
    distill: DistillSettings = Field(default_factory=DistillSettings)
    """the teacher and the divergence"""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """sampling: mode on_policy's rollouts, and gkd's on-policy steps (max_new_tokens, temperature, top_p,
    generation_batch_size)"""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """mode on_policy: rewards measured on the samples and eval prompts (logged, never trained on)"""

    applies = (
        _not_for(
            "distillation",
            "reports the divergence on data.eval, or in mode on_policy the eval prompts' measured rewards",
        ),
        _eval_needs_data("an eval data set"),
        Applies(
            tuple(f"data.{k}" for k in _DATA_ONLY),
            ("distill.mode",),
            _mode_is("offline", "gkd"),
            "mode on_policy reads prompts, not SFT rows",
            "remove {key}, or set distill.mode: offline or gkd",
        ),
        Applies(
            tuple(f"data.{k}" for k in _PROMPT_ONLY),
            ("distill.mode",),
            _mode_is("on_policy"),
            "modes offline and gkd read SFT rows, whose prompts are rendered as the data says",
            "remove {key}, or set distill.mode: on_policy",
        ),
        Applies(
            tuple(f"rollout.{k}" for k in RolloutSettings.model_fields if k not in _GKD_SAMPLING),
            ("distill.mode",),
            _mode_is("on_policy"),
            "it shapes mode on_policy's rollouts",
            "remove {key}, or set distill.mode: on_policy",
        ),
        Applies(
            tuple(f"rollout.{k}" for k in _GKD_SAMPLING),
            ("distill.mode", "distill.lmbda"),
            lambda c: c.distill.mode == "on_policy" or (c.distill.mode == "gkd" and c.distill.lmbda > 0),
            "only mode on_policy and gkd's on-policy steps (distill.lmbda > 0) sample",
            "remove {key}, or set distill.mode: on_policy, or gkd with distill.lmbda > 0",
        ),
        Applies(
            tuple(f"reward.{k}" for k in RewardSettings.model_fields),
            ("distill.mode",),
            _mode_is("on_policy"),
            "rewards are measured on mode on_policy's samples",
            "remove {key}, or set distill.mode: on_policy",
        ),
    )

    def _check(self) -> None:
        if self.train.batching == "padded":
            raise invalid(
                "train.batching",
                "'padded' is a comparison mode for SFT and preference training; distillation runs packed",
                "set train.batching to tokens or packing",
            )
        if self.train.sequence_parallel > 1:
            raise invalid(
                "train.sequence_parallel",
                "distillation runs whole packed rows (the teacher's hidden states and the divergence of each "
                "row are not split over ranks yet)",
                "set train.sequence_parallel: 1",
            )
        if self.distill.mode == "on_policy" and self.reward.overlong_buffer > self.rollout.max_new_tokens:
            raise invalid(
                ("reward.overlong_buffer", "rollout.max_new_tokens"),
                "the soft overlong zone is longer than a completion may be",
                "set reward.overlong_buffer <= rollout.max_new_tokens",
            )
