"""What users mean by names padless does not use: keys and values of TRL, verl and OpenRLHF configs (and
common spellings) mapped to padless's own, so that an unknown name is answered with what it is here before
any guess by spelling (``loss_type: gspo`` is a sequence-level ratio, not the loss type ``grpo`` it is
spelled like). Imports no torch, like the config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Meaning:
    """``to``: the padless keys (or values) it may be, the first that exists wins; none when padless has no
    counterpart. ``note``: where the name comes from and, when ``to`` says too little, what to do."""

    to: tuple[str, ...]
    note: str


# Keys, by their last part. Targets are looked up in the section of the unknown key first, then in the
# other sections of the config (``grpo.max_completion_length`` -> ``rollout.max_new_tokens``).
KEYS: dict[str, Meaning] = {
    "num_iterations": Meaning(("updates_per_rollout",), "TRL's num_iterations"),
    "ppo_epochs": Meaning(("updates_per_rollout",), "verl's / OpenRLHF's ppo_epochs"),
    "num_mini_batches": Meaning(("mini_batches_per_rollout",), "optimizer steps per pass over a rollout"),
    "kl_coef": Meaning(("beta",), "the KL coefficient"),
    "kl_loss_coef": Meaning(("beta", "kl_coef"), "verl's kl_loss_coef"),
    "init_kl_coef": Meaning(("kl_coef", "beta"), "OpenRLHF's init_kl_coef"),
    "beta": Meaning(("kl_coef",), "PPO's KL coefficient"),
    "clip_ratio": Meaning(("epsilon", "cliprange"), "verl's clip_ratio"),
    "clip_ratio_low": Meaning(("epsilon",), "verl's clip_ratio_low"),
    "clip_ratio_high": Meaning(("epsilon_high",), "verl's clip_ratio_high"),
    "eps_clip": Meaning(("epsilon", "cliprange"), "OpenRLHF's eps_clip"),
    "epsilon_low": Meaning(("epsilon",), "the lower clip range"),
    "cliprange": Meaning(("epsilon",), "the clip range"),
    "epsilon": Meaning(("cliprange",), "PPO's clip range"),
    "delta": Meaning(
        (),
        "TRL's delta (two-sided GRPO clipping) has no counterpart in padless: ratios are clipped to "
        "[1 - epsilon, 1 + epsilon_high]",
    ),
    "n_samples_per_prompt": Meaning(("num_generations",), "OpenRLHF's n_samples_per_prompt"),
    "n": Meaning(("num_generations",), "verl's rollout.n"),
    "max_completion_length": Meaning(("max_new_tokens",), "TRL's max_completion_length"),
    "response_length": Meaning(("max_new_tokens",), "verl's response_length"),
    "generate_max_len": Meaning(("max_new_tokens",), "OpenRLHF's generate_max_len"),
    "prompt_max_len": Meaning(("max_prompt_length",), "OpenRLHF's prompt_max_len"),
    "use_vllm": Meaning(("engine",), "TRL's use_vllm: set rollout.engine: vllm"),
    "vllm_importance_sampling_correction": Meaning(("importance_sampling_correction",), "TRL's name"),
    "vllm_importance_sampling_mode": Meaning(("importance_sampling_mode",), "TRL's name"),
    "vllm_importance_sampling_cap": Meaning(("importance_sampling_clip_max",), "TRL's name"),
    "vllm_importance_sampling_clip_max": Meaning(("importance_sampling_clip_max",), "TRL's name"),
    "vllm_importance_sampling_clip_min": Meaning(("importance_sampling_clip_min",), "TRL's name"),
    "use_bias_correction_kl": Meaning(("kl_bias_correction",), "TRL's use_bias_correction_kl"),
    "steps_per_generation": Meaning(("mini_batches_per_rollout",), "TRL's optimizer steps per generation"),
    "mask_truncated_completions": Meaning(("mask_truncated",), "TRL's mask_truncated_completions"),
    "reward_funcs": Meaning(("functions",), "TRL's reward_funcs"),
    "reward_weights": Meaning(("weights",), "TRL's reward_weights"),
    "num_train_epochs": Meaning(("num_epochs",), "the transformers / TRL name"),
    "lr": Meaning(("learning_rate",), "the learning rate"),
    "actor_learning_rate": Meaning(("learning_rate",), "OpenRLHF's actor_learning_rate"),
    "critic_learning_rate": Meaning(("value_learning_rate",), "OpenRLHF's critic_learning_rate"),
    "lr_scheduler_type": Meaning(("lr_scheduler",), "the transformers name"),
    "grad_clip": Meaning(("max_grad_norm",), "verl's grad_clip"),
    "per_device_train_batch_size": Meaning(
        ("max_tokens_per_batch",), "padless batches by tokens, not rows (batch_size is for batching padded)"
    ),
    "max_seq_length": Meaning(("max_length",), "TRL's former name"),
    "packing": Meaning(
        ("batching",), "TRL's packing: padless packs by default (batching: tokens or packing)"
    ),
    "padding_free": Meaning(("batching",), "TRL's padding_free: padless never pads (batching: tokens)"),
    "assistant_only_loss": Meaning(
        ("completion_only_loss",), "TRL's assistant_only_loss: conversations train their assistant turns"
    ),
    "loss_agg_mode": Meaning(("loss_type",), "verl's loss_agg_mode"),
    "adv_estimator": Meaning(("advantage",), "verl's adv_estimator"),
    "advantage_estimator": Meaning(("advantage",), "OpenRLHF's advantage_estimator"),
    "gae_lambda": Meaning(("lam",), "GAE's lambda"),
    "lambd": Meaning(("lam",), "verl's GAE lambda"),
    "value_clip": Meaning(("cliprange_value",), "OpenRLHF's value_clip"),
    "filter_groups": Meaning(("dynamic_sampling_rounds",), "verl's DAPO filter_groups"),
    "max_num_gen_batches": Meaning(("dynamic_sampling_rounds",), "verl's max_num_gen_batches"),
    "entropy_coef": Meaning((), "padless adds no entropy bonus to the loss (train/entropy is logged)"),
    "entropy_coeff": Meaning((), "padless adds no entropy bonus to the loss (train/entropy is logged)"),
    "top_k": Meaning((), "padless samples with temperature and top_p only"),
}

# Values of a key, by the key's last part; ``to`` holds the padless value(s), or is empty.
VALUES: dict[tuple[str, str], Meaning] = {
    ("loss_type", "gspo"): Meaning(
        (),
        "GSPO is a sequence-level ratio, not a loss type: set grpo.importance_sampling_level: sequence "
        "(with loss_type dapo, grpo or dr_grpo)",
    ),
    ("loss_type", "bnpo"): Meaning(
        ("dapo",),
        "TRL's bnpo normalises each micro-batch by its own token count; padless's dapo takes the token mean "
        "over the whole optimizer step, however it is split",
    ),
    ("loss_type", "sapo"): Meaning((), "SAPO is not implemented in padless"),
    ("loss_type", "luspo"): Meaning((), "LUSPO is not implemented in padless"),
    ("loss_type", "vespo"): Meaning((), "VESPO is not implemented in padless"),
    ("loss_type", "token-mean"): Meaning(("dapo",), "verl's loss_agg_mode token-mean"),
    ("loss_type", "seq-mean-token-mean"): Meaning(("grpo",), "verl's loss_agg_mode seq-mean-token-mean"),
    ("loss_type", "seq-mean-token-sum-norm"): Meaning(("dr_grpo",), "verl's seq-mean-token-sum-norm"),
    ("loss_type", "robust"): Meaning(("sigmoid",), "conservative DPO is sigmoid with label_smoothing"),
    ("advantage", "reinforce_plus_plus_baseline"): Meaning(("reinforce_pp",), "verl's name"),
    ("advantage", "reinforce_baseline"): Meaning(("reinforce_pp",), "OpenRLHF's name"),
    ("advantage", "reinforce_plus_plus"): Meaning(
        ("reinforce_pp",), "padless's reinforce_pp is REINFORCE++-baseline (group mean, then a global std)"
    ),
    ("advantage", "gae"): Meaning((), "GAE needs a value model: train with `padless ppo`"),
    ("importance_sampling_level", "seq"): Meaning(("sequence",), "a sequence-level ratio (GSPO)"),
    ("scale_rewards", "group"): Meaning(("true",), "TRL's scale_rewards: group"),
    ("scale_rewards", "none"): Meaning(("false",), "TRL's scale_rewards: none (Dr. GRPO)"),
    ("scale_rewards", "batch"): Meaning(
        (), "TRL's scale_rewards: batch is padless's grpo.advantage: reinforce_pp (one std over the rollout)"
    ),
    ("dtype", "bf16"): Meaning(("bfloat16",), "its full name"),
    ("dtype", "fp16"): Meaning(("float16",), "its full name"),
    ("dtype", "half"): Meaning(("float16",), "its full name"),
    ("dtype", "fp32"): Meaning(("float32",), "its full name"),
    ("dtype", "float"): Meaning(("float32",), "its full name"),
    ("lr_scheduler", "constant_with_warmup"): Meaning(("constant",), "padless's constant warms up too"),
    ("batching", "padding_free"): Meaning(("tokens",), "padless never pads"),
}


def value(name: str, given: object) -> Meaning | None:
    """What a value that key ``name`` does not take means, if it is a known one."""
    return VALUES.get((name, given.strip().lower())) if isinstance(given, str) else None
