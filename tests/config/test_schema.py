"""Config loading: YAML + overrides give the right typed values, and every mistake is a clear ConfigError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import Field

from padless.cli import TRAINERS, _load, main
from padless.config.loading import (
    ConfigError,
    ConfigModel,
    from_dict,
    invalid,
    load_config,
    parse_override,
    save_config,
    to_dict,
)
from padless.config.schema import DataSettings, LoraSettings, ModelSettings, SFTConfig, TrainSettings


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error(cls: type, path: Path | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cls, path, list(overrides))
    return str(info.value)


# ---- merging and types


def test_defaults_without_file_or_overrides() -> None:
    assert load_config(SFTConfig, None) == SFTConfig()


def test_yaml_and_overrides_merge_with_right_types(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model:\n  name: my-model\n  dtype: bfloat16\n"
        "train:\n  learning_rate: 1e-4\n  num_epochs: 2\n  max_steps: 50\n  report_to: [jsonl]\n",
    )
    cfg = load_config(
        SFTConfig,
        path,
        ["train.learning_rate=3e-5", "train.report_to=[tensorboard,jsonl]", "data.max_length=512"],
    )
    assert cfg.model.name == "my-model"
    assert cfg.model.dtype == "bfloat16"
    assert cfg.train.learning_rate == pytest.approx(3e-5)
    assert type(cfg.train.learning_rate) is float
    assert cfg.train.num_epochs == 2.0 and type(cfg.train.num_epochs) is float  # int accepted for float
    assert cfg.train.max_steps == 50
    assert cfg.train.report_to == ["tensorboard", "jsonl"]
    assert cfg.data.max_length == 512
    assert cfg.data.train == "tiny:sft"  # untouched keys keep defaults


def test_exponent_floats_from_file_and_quoted_strings(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  learning_rate: 2e-5\n  adam_epsilon: '1e-6'\n  weight_decay: 1E+0\n")
    train = load_config(SFTConfig, path).train
    assert train.learning_rate == pytest.approx(2e-5)
    assert train.adam_epsilon == pytest.approx(1e-6)
    assert train.weight_decay == 1.0
    assert all(type(v) is float for v in (train.learning_rate, train.adam_epsilon, train.weight_decay))


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.max_steps=5", "train.max_steps=7"],
        ["model.lora.r=4", "model.lora=null"],
        ["model.lora={r: 4}", "model.lora.r=8"],
    ],
)
def test_an_override_that_replaces_another_on_the_command_line_is_refused(overrides, capsys) -> None:
    assert main(["sft", *overrides]) == 2
    msg = capsys.readouterr().err
    assert f"sets again what {overrides[0]!r} set" in msg and repr(overrides[1]) in msg
    assert "fix: give each key once" in msg
    cfg = load_config(SFTConfig, None, ["model.lora={}", "model.lora.r=8"], once=True)  # a section, a key
    assert cfg.model.lora is not None and cfg.model.lora.r == 8
    cfg = load_config(SFTConfig, None, ["train.max_steps=5", "train.max_steps=7"])  # the API composes lists
    assert cfg.train.max_steps == 7


def test_a_section_of_another_type_is_not_replaced_by_an_override(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  name: tiny-llama\ntrain: 5\n")
    msg = error(SFTConfig, path, "train.max_steps=3")
    assert msg.startswith(f"train in {path} (line 3) is int 5, not a section")
    assert "'train.max_steps=3'" in msg and "fix: write train as a mapping" in msg
    path = write(tmp_path, "model:\n  lora: null\n")  # null is an empty section: the override fills it
    assert load_config(SFTConfig, path, ["model.lora.r=8"]).model.lora.r == 8


def test_nested_override_creates_missing_lora_section(tmp_path: Path) -> None:
    cfg = load_config(SFTConfig, None, ["model.lora.r=8"])
    assert cfg.model.lora == LoraSettings(r=8)
    # also when the file says null explicitly
    path = write(tmp_path, "model:\n  lora: null\n")
    cfg = load_config(SFTConfig, path, ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.model.lora == LoraSettings(r=4, target_modules=["q_proj", "v_proj"])


def test_lora_section_from_file_null_override_and_empty_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  lora:\n    r: 32\n    target_modules: all-linear\n")
    assert load_config(SFTConfig, path).model.lora == LoraSettings(r=32)
    assert load_config(SFTConfig, path, ["model.lora=null"]).model.lora is None
    assert load_config(SFTConfig, None, ["model.lora={}"]).model.lora == LoraSettings()


def test_empty_sections_mean_defaults_and_an_empty_file_is_refused(tmp_path: Path) -> None:
    assert load_config(SFTConfig, write(tmp_path, "model:\ntrain:\n")) == SFTConfig()
    for text in ("", "# only a comment\n\n"):  # a file that says nothing was most likely not saved
        with pytest.raises(ConfigError, match=r"is empty.*leave the file out"):
            load_config(SFTConfig, write(tmp_path, text))


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10^9 values
    with pytest.raises(ConfigError, match="more than 100,000 values through its aliases"):
        load_config(SFTConfig, write(tmp_path, "\n".join(lines)))


def test_string_fields_keep_override_text_and_yes_no_are_not_bools(tmp_path: Path) -> None:
    cfg = load_config(SFTConfig, None, ["train.output_dir=007", "data.eval=no", "model.name=1.5"])
    assert cfg.train.output_dir == "007"
    assert cfg.data.eval == "no"
    assert cfg.model.name == "1.5"
    path = write(tmp_path, "data:\n  train: on\n  eval: 2024-01-01\n")
    cfg = load_config(SFTConfig, path)
    assert cfg.data.train == "on"
    assert cfg.data.eval == "2024-01-01"
    assert load_config(SFTConfig, None, ["data.eval=null"]).data.eval is None


def test_bool_overrides_accept_true_false() -> None:
    cfg = load_config(SFTConfig, None, ["train.progress_bar=false", "model.gradient_checkpointing=True"])
    assert cfg.train.progress_bar is False
    assert cfg.model.gradient_checkpointing is True


def test_override_value_may_contain_equals() -> None:
    assert parse_override("data.train=a=b.jsonl") == ("data.train", "a=b.jsonl")
    assert parse_override(" train.seed = 3") == ("train.seed", 3)


# ---- errors


def test_unknown_key_names_file_key_and_close_match(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  learnig_rate: 1e-4\n")
    msg = error(SFTConfig, path)
    assert "unknown key 'train.learnig_rate'" in msg
    assert "run.yaml" in msg
    assert "did you mean 'learning_rate'?" in msg
    assert "valid keys under 'train':" in msg and "max_grad_norm" in msg


def test_unknown_top_level_key_and_unknown_override(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "trian:\n  seed: 1\n"))
    assert "unknown key 'trian'" in msg and "did you mean 'train'?" in msg and "valid top-level keys" in msg
    msg = error(SFTConfig, None, "model.nmae=x")
    assert "unknown key 'model.nmae'" in msg and "command line" in msg and "'name'" in msg


def test_wrong_type_names_key_expected_and_got(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "train:\n  max_steps: ten\n"))
    assert msg.startswith("train.max_steps in ")
    assert "run.yaml: expected int, got str 'ten'" in msg
    assert "fix:" in msg


def test_int_rejects_bool_and_float(tmp_path: Path) -> None:
    assert "expected int, got bool true" in error(SFTConfig, write(tmp_path, "train:\n  max_steps: true\n"))
    msg = error(SFTConfig, None, "train.max_steps=1e3")
    assert "expected int, got float 1000.0" in msg and "1000" in msg and "command line" in msg


def test_float_rejects_non_numbers() -> None:
    assert "expected float, got str 'fast'" in error(SFTConfig, None, "train.learning_rate=fast")
    assert "expected float, got bool true" in error(SFTConfig, None, "train.learning_rate=true")


def test_str_field_from_file_rejects_number_and_says_quote_it(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "model:\n  name: 1234\n"))
    assert "model.name" in msg and "expected str, got int 1234" in msg and "quote it" in msg


def test_literal_error_lists_allowed_values() -> None:
    msg = error(SFTConfig, None, "model.dtype=bf16")
    assert "model.dtype" in msg
    for value in ("'auto'", "'float32'", "'bfloat16'", "'float16'"):
        assert value in msg
    assert "got str 'bf16'" in msg
    assert "did you mean 'bfloat16'" in msg


def test_bool_is_strict() -> None:
    for text in ("maybe", "yes", "1", "on"):
        msg = error(SFTConfig, None, f"train.progress_bar={text}")
        assert "train.progress_bar" in msg and "expected bool" in msg and "true or false" in msg


def test_list_items_are_checked() -> None:
    msg = error(SFTConfig, None, "train.report_to=[tensorboard, 3]")
    assert "train.report_to[1]" in msg and "expected str, got int 3" in msg
    assert "expected list of str" in error(SFTConfig, None, "train.report_to={a: 1}")


def test_section_of_wrong_shape(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "train: [1, 2]\n"))
    assert "train in" in msg and "expected mapping (TrainSettings), got list" in msg
    msg = error(SFTConfig, None, "model.lora=true")
    assert "model.lora" in msg and "mapping (LoraSettings) or null" in msg


@pytest.mark.parametrize("item", ["train.max_steps", "train.max_steps:5", "=5", "a..b=1", "--train.seed=1"])
def test_malformed_override(item: str) -> None:
    msg = error(SFTConfig, None, item)
    assert "malformed override" in msg and "key=value" in msg and repr(item) in msg


def test_override_value_with_bad_yaml() -> None:
    msg = error(SFTConfig, None, "train.report_to=[jsonl,")
    assert "not valid YAML" in msg and "train.report_to" in msg


def test_missing_file_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "missing.yaml"
    msg = error(SFTConfig, missing)
    assert "not found" in msg and str(missing) in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  seed: 1\n  max_steps: [1, 2\n  lr: 3\n", name="broken.yaml")
    msg = error(SFTConfig, path)
    assert "broken.yaml line " in msg and "YAML syntax error" in msg
    msg = error(SFTConfig, write(tmp_path, "train:\n  seed: 1\n   max_steps: 2\n"))
    assert "run.yaml line 3" in msg


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "train:\n  seed: 1\n  seed: 2\n"))
    assert "duplicate key 'seed'" in msg and "run.yaml line 3" in msg


def test_top_level_must_be_mapping(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "- model\n- train\n"))
    assert "run.yaml" in msg and "top level must be a mapping" in msg


def test_errors_give_the_line_a_key_was_set_on(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  name: m\ntrain:\n  seed: 1\n  learnig_rate: 1e-4\n")
    assert "unknown key 'train.learnig_rate' in " + str(path) + " (line 5);" in error(SFTConfig, path)
    path = write(tmp_path, "train:\n  report_to:\n    - jsonl\n    - 3\n")
    assert error(SFTConfig, path).startswith(
        f"train.report_to[1] in {path}: expected str, got int 3 (line 4);"
    )
    path = write(tmp_path, "data:\n  train: tiny:sft\ntrain:\n  eval_steps: 5\n  seed: 3\n")
    msg = error(SFTConfig, path)
    assert msg.startswith(f"train.eval_steps, data.eval in {path}: ") and "is not set (line 4);" in msg
    # a key the command line set again has no line in the file
    path = write(tmp_path, "model:\n  lora:\n    r: 2\n")
    msg = error(SFTConfig, path, "model.lora.r=0")
    assert (
        msg.startswith("model.lora.r on the command line ('model.lora.r=0'): must be > 0")
        and "(line" not in msg
    )
    # an unknown section given on the command line is said to come from there
    assert "unknown key 'trian' on the command line ('trian.max_steps=1')" in error(
        SFTConfig, None, "trian.max_steps=1"
    )


def test_bounds_are_checked_from_the_types() -> None:
    msg = error(SFTConfig, None, "train.adam_beta2=1")
    assert msg.startswith(
        "train.adam_beta2 on the command line ('train.adam_beta2=1'): must be in [0, 1), got 1;"
    )
    assert msg.endswith("fix: set adam_beta2 to a value in [0, 1), e.g. 0.999")
    assert "must be >= 0, got -1" in error(SFTConfig, None, "train.save_steps=-1")
    with pytest.raises(ConfigError, match=r"^lam: must be in \[0, 1\], got 1.5; fix: set lam to a value in"):
        PPOSettings(lam=1.5)


# ---- cross-field checks


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("data.max_length=0", "data.max_length"),
        ("train.max_tokens_per_batch=0", "train.max_tokens_per_batch"),
        ("train.gradient_accumulation_steps=0", "train.gradient_accumulation_steps"),
        ("train.batch_size=-1", "train.batch_size"),
        ("train.learning_rate=0", "train.learning_rate"),
        ("train.warmup_ratio=1.0", "train.warmup_ratio"),
        ("train.warmup_ratio=-0.1", "train.warmup_ratio"),
        ("train.report_to=[neptune]", "train.report_to"),
        ("model.lora.r=0", "model.lora.r"),
    ],
)
def test_value_checks_name_the_key_and_source(override: str, key: str) -> None:
    msg = error(SFTConfig, None, override)
    assert msg.startswith(key + " on the command line")
    assert repr(override) in msg and "fix:" in msg


def test_no_training_steps_names_both_keys(tmp_path: Path) -> None:
    msg = error(SFTConfig, write(tmp_path, "train:\n  num_epochs: 0\n"))
    assert "train.num_epochs, train.max_steps in" in msg and "run.yaml" in msg
    cfg = load_config(SFTConfig, None, ["train.num_epochs=0", "train.max_steps=10"])
    assert cfg.train.max_steps == 10


def test_eval_without_eval_data(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  eval_steps: 5\n")
    msg = error(SFTConfig, path)
    assert "train.eval_steps, data.eval" in msg and "run.yaml" in msg
    assert load_config(SFTConfig, path, ["data.eval=tiny:sft"]).train.eval_steps == 5
    assert "train.eval_generate" in error(SFTConfig, None, "train.eval_generate=true")


def test_sources_of_a_combination_from_file_and_command_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  varlen_kernel: flash_attn\n")
    msg = error(SFTConfig, path, "model.attn_implementation=sdpa")
    assert "model.varlen_kernel, model.attn_implementation" in msg
    assert "run.yaml" in msg and "'model.attn_implementation=sdpa'" in msg


def test_allowed_combinations() -> None:
    cfg = load_config(
        SFTConfig,
        None,
        [
            "model.gradient_checkpointing=true",
            "train.max_tokens_per_batch=16",  # smaller than max_length: checked at batching time
            "train.report_to=[]",
            "model.varlen_kernel=torch",
            "model.attn_implementation=varlen",
        ],
    )
    assert cfg.train.max_tokens_per_batch < cfg.data.max_length
    assert cfg.train.report_to == []
    assert (
        load_config(
            SFTConfig, None, ["model.attn_implementation=flex_attention"]
        ).model.gradient_checkpointing
        is False
    )


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"^warmup_ratio: must be in \[0, 1\), got 2"):
        TrainSettings(warmup_ratio=2)
    with pytest.raises(ConfigError, match="max_length"):
        DataSettings(max_length=0)
    err = invalid(("a", "b"), "cannot both be set", "unset one")
    assert str(err) == "a, b: cannot both be set; fix: unset one" and err.keys == ("a", "b")


# ---- saving


def test_save_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        SFTConfig,
        None,
        [
            "model.lora.target_modules=[q_proj,v_proj]",
            "model.name=yes",
            "data.eval=1e3",
            "train.output_dir=007",
            "train.learning_rate=3e-5",
            "train.adam_epsilon=1e-12",
            "train.resume_from_checkpoint=latest",
        ],
    )
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert path.exists()
    assert load_config(SFTConfig, path) == cfg
    # a standard YAML reader sees the same values (strings like 'yes' and '007' are quoted)
    plain = yaml.safe_load(path.read_text())
    assert plain == to_dict(cfg)
    assert (
        save_config(SFTConfig(), tmp_path / "d.yaml")
        and load_config(SFTConfig, tmp_path / "d.yaml") == SFTConfig()
    )


def test_to_dict_is_plain_and_unshared() -> None:
    cfg = SFTConfig(model=ModelSettings(lora=LoraSettings()))
    d = to_dict(cfg)
    assert d["model"]["lora"]["r"] == 16 and d["train"]["report_to"] == ["tensorboard", "jsonl"]
    d["train"]["report_to"].append("x")
    assert cfg.train.report_to == ["tensorboard", "jsonl"]
    assert from_dict(SFTConfig, to_dict(cfg)) == cfg
    with pytest.raises(TypeError):
        to_dict(SFTConfig)


# ---- the generic machinery on other config models


class Inner(ConfigModel):
    size: int = 1
    tags: list[int] = Field(default_factory=list)


class Demo(ConfigModel):
    name: str
    weights: dict[str, float] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)
    mode: Literal["a", "b"] | None = None
    inner: Inner = Field(default_factory=lambda: Inner(size=5, tags=[1]))
    maybe: Inner | None = None


def test_from_dict_generic_types() -> None:
    demo = from_dict(
        Demo,
        {"name": "x", "weights": {"a": 1, "b": 2.5}, "extra": {"k": [1, {"z": None}]}, "mode": "b"},
    )
    assert demo.weights == {"a": 1.0, "b": 2.5} and all(type(v) is float for v in demo.weights.values())
    assert demo.extra == {"k": [1, {"z": None}]}
    assert demo.mode == "b"
    assert demo.inner == Inner(size=5, tags=[1])
    assert demo.maybe is None


def test_from_dict_partial_section_keeps_nondefault_factory_values() -> None:
    demo = from_dict(Demo, {"name": "x", "inner": {"tags": [2, 3]}, "maybe": {}})
    assert demo.inner == Inner(size=5, tags=[2, 3])  # size from the field's default_factory, not Inner's
    assert demo.maybe == Inner()


def test_from_dict_errors_name_where_and_required_keys() -> None:
    with pytest.raises(ConfigError, match="missing required key 'name'"):
        from_dict(Demo, {})
    with pytest.raises(ConfigError, match=r"^weights\.a in sweep\.json: expected float, got str 'heavy'"):
        from_dict(Demo, {"name": "x", "weights": {"a": "heavy"}}, "sweep.json")
    with pytest.raises(ConfigError, match=r"inner\.tags\[0\]: expected int"):
        from_dict(Demo, {"name": "x", "inner": {"tags": ["a"]}})
    with pytest.raises(ConfigError, match=r"mode: expected one of 'a', 'b' or null"):
        from_dict(Demo, {"name": "x", "mode": "c"})
    with pytest.raises(ConfigError, match=r"^sec\.name: expected str"):
        from_dict(Demo, {"name": None}, prefix="sec")


def test_config_models_have_the_agreed_fields() -> None:
    names = set(TrainSettings.model_fields)
    assert {
        "max_tokens_per_batch",
        "batching",
        "padding_side",
        "report_to",
        "resume_from_checkpoint",
    } <= names
    assert list(SFTConfig.model_fields) == ["model", "data", "train"]


# ---- preference configs: DPO and reward models

from padless.config.schema import DPOConfig, PreferenceDataSettings, RMConfig  # noqa: E402


@pytest.mark.parametrize(
    ("cls", "output_dir", "lr"), [(DPOConfig, "runs/dpo", 5e-6), (RMConfig, "runs/rm", 1e-4)]
)
def test_preference_config_defaults_from_empty_yaml(
    tmp_path: Path, cls: type, output_dir: str, lr: float
) -> None:
    cfg = load_config(cls, write(tmp_path, "train:\n"))
    assert cfg == cls() and cfg.data == PreferenceDataSettings()
    assert (
        cfg.data.train == "tiny:preference" and cfg.data.max_length == 2048 and cfg.data.truncation == "error"
    )
    assert (cfg.train.output_dir, cfg.train.learning_rate) == (output_dir, lr)
    # A partial train section keeps the config's own defaults, not TrainSettings'.
    partial = load_config(cls, write(tmp_path, "train:\n  max_steps: 10\n"))
    assert (partial.train.output_dir, partial.train.learning_rate, partial.train.max_steps) == (
        output_dir,
        lr,
        10,
    )
    assert list(cls.model_fields)[:3] == ["model", "data", "train"]


def test_dpo_defaults_and_overrides(tmp_path: Path) -> None:
    dpo = DPOConfig().dpo
    assert (dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.rpo_alpha, dpo.simpo_gamma) == (
        0.1,
        "sigmoid",
        0.0,
        None,
        0.5,
    )
    assert (dpo.reference, dpo.ref_model, dpo.precompute_ref_logps) == ("model", None, False)
    path = write(tmp_path, "dpo:\n  beta: 0.25\n  loss_type: ipo\ndata:\n  eval: tiny:preference_eval\n")
    cfg = load_config(
        DPOConfig,
        path,
        [
            "dpo.loss_type=sigmoid",
            "dpo.label_smoothing=0.1",
            "dpo.rpo_alpha=1",
            "dpo.precompute_ref_logps=true",
            "dpo.ref_model=other-model",
            "data.truncation=truncate",
            "data.skip_bad_rows=true",
            "train.eval_steps=5",
            "train.batching=padded",
        ],
    )
    assert (cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.label_smoothing, cfg.dpo.rpo_alpha) == (
        0.25,
        "sigmoid",
        0.1,
        1.0,
    )
    assert cfg.dpo.ref_model == "other-model" and cfg.dpo.precompute_ref_logps
    assert (
        cfg.data.eval == "tiny:preference_eval"
        and cfg.data.truncation == "truncate"
        and cfg.data.skip_bad_rows
    )
    assert load_config(DPOConfig, save_config(cfg, tmp_path / "saved.yaml")) == cfg
    lora = load_config(DPOConfig, None, ["model.lora.r=8", "dpo.reference=adapters"])
    assert lora.dpo.reference == "adapters" and lora.model.lora is not None
    simpo = load_config(DPOConfig, None, ["dpo.loss_type=simpo", "dpo.simpo_gamma=1.0", "dpo.beta=2"])
    assert (simpo.dpo.loss_type, simpo.dpo.simpo_gamma) == ("simpo", 1.0)


def test_rm_overrides(tmp_path: Path) -> None:
    assert RMConfig().rm.margin is False
    cfg = load_config(
        RMConfig, write(tmp_path, "rm:\n  margin: true\n"), ["data.max_length=512", "model.lora.r=4"]
    )
    assert cfg.rm.margin and cfg.data.max_length == 512 and cfg.model.lora is not None
    assert "rm.margin" in error(RMConfig, None, "rm.margin=1") and "true or false" in error(
        RMConfig, None, "rm.margin=1"
    )


@pytest.mark.parametrize(
    ("overrides", "keys", "fragment"),
    [
        (["dpo.reference=adapters"], "dpo.reference, model.lora", "no adapters"),
        (
            ["dpo.loss_type=simpo", "dpo.ref_model=big"],
            "dpo.ref_model, dpo.loss_type",
            "simpo is reference-free",
        ),
        (
            ["dpo.loss_type=simpo", "dpo.precompute_ref_logps=true"],
            "dpo.precompute_ref_logps, dpo.loss_type",
            "simpo is reference-free",
        ),
        (
            ["model.lora.r=8", "dpo.loss_type=simpo", "dpo.reference=adapters"],
            "dpo.reference, dpo.loss_type",
            "simpo is reference-free",
        ),
        (
            ["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"],
            "dpo.label_smoothing, dpo.loss_type",
            "has no effect",
        ),
        (["dpo.label_smoothing=0.5"], "dpo.label_smoothing", "[0, 0.5)"),
        (["dpo.beta=0"], "dpo.beta", "must be > 0"),
        (["dpo.rpo_alpha=-1"], "dpo.rpo_alpha", "must be >= 0"),
        (["dpo.simpo_gamma=-1"], "dpo.simpo_gamma", "must be >= 0"),
        (["dpo.ref_model=''"], "dpo.ref_model", "empty"),
        (
            ["model.lora.r=8", "dpo.reference=adapters", "dpo.ref_model=x"],
            "dpo.ref_model, dpo.reference",
            "has no effect",
        ),
        (["dpo.loss_type=orpo"], "dpo.loss_type", "one of 'sigmoid', 'ipo', 'hinge', 'simpo'"),
        (["dpo.betta=0.2"], "unknown key 'dpo.betta'", "did you mean 'beta'"),
    ],
)
def test_dpo_cross_field_errors_name_their_keys(overrides: list[str], keys: str, fragment: str) -> None:
    msg = error(DPOConfig, None, *overrides)
    assert msg.startswith(keys), msg
    assert fragment in msg and "on the command line" in msg


@pytest.mark.parametrize("cls", [DPOConfig, RMConfig])
@pytest.mark.parametrize(
    ("overrides", "keys", "fragment"),
    [
        (["train.eval_steps=5"], "train.eval_steps, data.eval", "data.eval is not set"),
        (["train.eval_generate=true"], "train.eval_generate", "eval_generate is an SFT option"),
        (["data.eval=tiny:preference_eval", "train.eval_generate=true"], "train.eval_generate", "SFT option"),
        (["data.max_length=0"], "data.max_length", "must be > 0"),
        (["data.train=''"], "data.train", "is empty"),
        (["data.truncation=cut"], "data.truncation", "one of 'error', 'truncate'"),
    ],
)
def test_preference_data_and_eval_errors(cls: type, overrides: list[str], keys: str, fragment: str) -> None:
    msg = error(cls, None, *overrides)
    assert msg.startswith(keys + " on the command line"), msg
    assert fragment in msg and "fix:" in msg


# ---- online RL configs: GRPO and PPO

from padless.config.schema import (  # noqa: E402
    GRPOConfig,
    GRPOSettings,
    PPOConfig,
    PPOSettings,
    RewardSettings,
    RLDataSettings,
    RolloutSettings,
)


@pytest.mark.parametrize(
    ("cls", "output_dir", "generations"), [(GRPOConfig, "runs/grpo", 4), (PPOConfig, "runs/ppo", 1)]
)
def test_rl_config_defaults(tmp_path: Path, cls: type, output_dir: str, generations: int) -> None:
    cfg = load_config(cls, write(tmp_path, "train:\n"))
    assert cfg == cls() and cfg.data == RLDataSettings() and cfg.reward == RewardSettings()
    assert (cfg.data.train, cfg.data.max_prompt_length, cfg.data.chat_template) == ("tiny:rl", 512, None)
    assert (cfg.train.output_dir, cfg.train.learning_rate, cfg.train.max_steps) == (output_dir, 1e-5, 100)
    assert cfg.rollout.num_generations == generations and cfg.rollout.engine == "hf"
    assert cfg.reward.functions == ["arithmetic"] and cfg.reward.weights is None
    assert list(cls.model_fields)[:3] == ["model", "data", "train"]
    partial = load_config(cls, write(tmp_path, "train:\n  max_steps: 10\nrollout:\n  max_new_tokens: 8\n"))
    assert (partial.train.output_dir, partial.train.max_steps) == (output_dir, 10)
    assert (partial.rollout.num_generations, partial.rollout.max_new_tokens) == (generations, 8)
    assert load_config(cls, save_config(partial, tmp_path / "saved.yaml")) == partial
    assert cls.__doc__ is not None and "max_steps" in cls.__doc__ and "optimizer steps" in cls.__doc__


def test_grpo_and_ppo_settings_defaults() -> None:
    g = GRPOSettings()
    assert (g.beta, g.epsilon, g.epsilon_high, g.scale_rewards, g.group_std) == (0.04, 0.2, None, None, True)
    assert (g.loss_type, g.importance_sampling_level, g.advantage) == ("dapo", "token", "grpo")
    assert (g.cispo_max_ratio, g.max_ratio, g.dynamic_sampling_rounds) == (None, 5.0, 0)
    r = RewardSettings()
    assert (r.overlong_buffer, r.overlong_penalty, r.overlong_factor) == (0, None, 1.0)
    assert (g.updates_per_rollout, g.mini_batches_per_rollout) == (1, 1)
    p = PPOSettings()
    assert (p.value_model, p.gamma, p.lam, p.kl_coef, p.cliprange, p.cliprange_value, p.vf_coef) == (
        None,
        1.0,
        0.95,
        0.05,
        0.2,
        0.2,
        0.1,
    )
    assert p.whiten_advantages and p.critic_warmup_steps == 0 and p.value_learning_rate is None
    r = RolloutSettings()
    assert (r.prompts_per_step, r.max_new_tokens, r.temperature, r.top_p, r.generation_batch_size) == (
        16,
        64,
        1.0,
        1.0,
        32,
    )
    assert r.mask_truncated


def test_rl_allowed_combinations(tmp_path: Path) -> None:
    cfg = load_config(
        GRPOConfig,
        write(tmp_path, "reward:\n  functions: [arithmetic, 'my_rewards.py:fmt']\n  weights: [1, 0.5]\n"),
        [
            "rollout.engine=vllm",
            "rollout.num_generations=2",
            "rollout.prompts_per_step=3",
            "grpo.mini_batches_per_rollout=6",
            "grpo.updates_per_rollout=2",
            "grpo.beta=0",
            "grpo.epsilon_high=0.28",
            "reward.model=runs/rm",
            "reward.model_weight=-0.5",
            "data.eval=tiny:rl",
            "data.chat_template=false",
            "train.eval_steps=5",
            "train.batching=packing",
        ],
    )
    assert cfg.reward.weights == [1.0, 0.5] and cfg.reward.model_weight == -0.5
    assert cfg.rollout.engine == "vllm" and cfg.grpo.epsilon_high == 0.28 and cfg.data.chat_template is False
    model_only = load_config(PPOConfig, None, ["reward.functions=[]", "reward.model=runs/rm"])
    assert model_only.reward.functions == [] and model_only.rollout.num_generations == 1
    ppo = load_config(PPOConfig, None, ["ppo.mini_batches_per_rollout=4", "ppo.value_learning_rate=1e-6"])
    assert ppo.ppo.value_learning_rate == 1e-6


@pytest.mark.parametrize(
    ("overrides", "keys", "fragment"),
    [
        (["rollout.num_generations=1"], "rollout.num_generations", "at least 2"),
        (
            ["grpo.mini_batches_per_rollout=3"],
            "grpo.mini_batches_per_rollout, rollout.prompts_per_step, rollout.num_generations",
            "64 samples does not split into 3 equal mini-batches",
        ),
        (["train.batching=padded"], "train.batching", "RL scoring always runs packed"),
        (["train.eval_generate=true"], "train.eval_generate", "SFT option"),
        (["train.eval_steps=5"], "train.eval_steps, data.eval", "data.eval is not set"),
        (["reward.functions=[]"], "reward.functions, reward.model, rollout.environment", "no reward"),
        (["reward.weights=[1, 2]"], "reward.weights, reward.functions", "2 weight(s) for 1 function(s)"),
        (["reward.weights=[.nan]"], "reward.weights[0]", "finite"),
        (["reward.functions=[arithmetic, arithmetic]"], "reward.functions", "listed more than once"),
        (["reward.functions=[arithmetic, '']"], "reward.functions", "item 1 is an empty string"),
        (["reward.model=''"], "reward.model", "empty string"),
        (["reward.model_weight=2"], "reward.model_weight, reward.model", "has no effect"),
        (["rollout.temperature=0"], "rollout.temperature", "greedy decoding"),
        (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
        (["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "must be > 0"),
        (["rollout.prompts_per_step=0"], "rollout.prompts_per_step", "must be > 0"),
        (["rollout.generation_batch_size=0"], "rollout.generation_batch_size", "must be > 0"),
        (["rollout.engine=sglang"], "rollout.engine", "one of 'hf', 'vllm'"),
        (["data.max_prompt_length=0"], "data.max_prompt_length", "must be > 0"),
        (["data.train=''"], "data.train", "is empty"),
        (["data.chat_template=auto"], "data.chat_template", "expected bool or null"),
        (["grpo.beta=-0.1"], "grpo.beta", "must be >= 0"),
        (["grpo.epsilon=0"], "grpo.epsilon", "(0, 1)"),
        (["grpo.epsilon=1"], "grpo.epsilon", "(0, 1)"),
        (["grpo.epsilon_high=0.1"], "grpo.epsilon_high, grpo.epsilon", "below epsilon=0.2"),
        (["grpo.updates_per_rollout=0"], "grpo.updates_per_rollout", "must be > 0"),
        (["grpo.loss_type=bnpo"], "grpo.loss_type", "one of 'dapo', 'grpo', 'dr_grpo', 'cispo'"),
        (["grpo.importance_sampling_level=group"], "grpo.importance_sampling_level", "'token', 'sequence'"),
        (["grpo.advantage=gae"], "grpo.advantage", "one of 'grpo', 'rloo', 'reinforce_pp'"),
        (["grpo.cispo_max_ratio=4"], "grpo.cispo_max_ratio, grpo.loss_type", "cap of loss_type cispo"),
        (["grpo.cispo_max_ratio=0", "grpo.loss_type=cispo"], "grpo.cispo_max_ratio", "must be > 0"),
        (
            ["grpo.loss_type=cispo", "grpo.importance_sampling_level=sequence"],
            "grpo.importance_sampling_level, grpo.loss_type",
            "not for cispo",
        ),
        (["grpo.advantage=rloo", "grpo.scale_rewards=true"], "grpo.scale_rewards, grpo.advantage", "std"),
        (["grpo.dynamic_sampling_rounds=-1"], "grpo.dynamic_sampling_rounds", ">= 0"),
        (["reward.overlong_penalty=2"], "reward.overlong_penalty, reward.overlong_buffer", "is off"),
        (
            ["reward.overlong_buffer=65"],
            "reward.overlong_buffer, rollout.max_new_tokens",
            "longer than the 64 tokens",
        ),
    ],
)
def test_grpo_errors_name_their_keys(overrides: list[str], keys: str, fragment: str) -> None:
    msg = error(GRPOConfig, None, *overrides)
    assert msg.startswith(keys + " on the command line"), msg
    assert fragment in msg and "fix:" in msg, msg


def test_the_old_grpo_normalisation_key_points_to_loss_type() -> None:
    msg = error(GRPOConfig, None, "grpo.loss_normalisation=token")
    assert msg.startswith("unknown key 'grpo.loss_normalisation'") and "loss_type" in msg, msg


@pytest.mark.parametrize(
    ("overrides", "keys", "fragment"),
    [
        (["ppo.mini_batches_per_rollout=3"], "ppo.mini_batches_per_rollout", "16 samples does not split"),
        (["train.batching=padded"], "train.batching", "RL scoring always runs packed"),
        (["ppo.value_model=''"], "ppo.value_model", "empty string"),
        (["ppo.gamma=1.1"], "ppo.gamma", "[0, 1]"),
        (["ppo.lam=-0.1"], "ppo.lam", "[0, 1]"),
        (["ppo.cliprange=0"], "ppo.cliprange", "(0, 1)"),
        (["ppo.cliprange_value=1"], "ppo.cliprange_value", "(0, 1)"),
        (["ppo.kl_coef=-1"], "ppo.kl_coef", "must be >= 0"),
        (["ppo.vf_coef=0"], "ppo.vf_coef", "must be > 0"),
        (["ppo.critic_warmup_steps=-1"], "ppo.critic_warmup_steps", "must be >= 0"),
        (["ppo.value_learning_rate=0"], "ppo.value_learning_rate", "e.g. 1, or null"),
        (["rollout.num_generations=0"], "rollout.num_generations", "must be > 0"),
    ],
)
def test_ppo_errors_name_their_keys(overrides: list[str], keys: str, fragment: str) -> None:
    msg = error(PPOConfig, None, *overrides)
    assert msg.startswith(keys), msg
    assert "on the command line" in msg and fragment in msg and "fix:" in msg, msg


def test_rl_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    msg = error(GRPOConfig, write(tmp_path, "reward:\n  functions: [a, b]\n  weights: [1.0]\n"))
    assert msg.startswith("reward.weights, reward.functions in ") and "run.yaml" in msg
    with pytest.raises(ConfigError, match="at least 2"):
        GRPOConfig(rollout=RolloutSettings(num_generations=1))
    assert PPOConfig(rollout=RolloutSettings(num_generations=1)).rollout.num_generations == 1


# ---- JSON Schema for editors: padless schema TRAINER

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def schema_of(trainer: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["schema", trainer]) == 0
    return json.loads(capsys.readouterr().out)


def unknown_keys(
    schema: dict[str, Any], data: Any, node: dict[str, Any] | None = None, key: str = ""
) -> list[str]:
    """The keys of ``data`` that ``schema`` does not allow (the part of validation editors complete from)."""
    node = schema if node is None else node
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rpartition("/")[2]]
    objects = [n for n in node.get("anyOf", [node]) if "properties" in n or "$ref" in n]
    if not isinstance(data, dict) or not objects:
        return []
    node = schema["$defs"][objects[0]["$ref"].rpartition("/")[2]] if "$ref" in objects[0] else objects[0]
    assert node["additionalProperties"] is False, key
    bad = [f"{key}.{k}".lstrip(".") for k in data if k not in node["properties"]]
    return bad + [
        u
        for k, v in data.items()
        if k in node["properties"]
        for u in unknown_keys(schema, v, node["properties"][k], f"{key}.{k}")
    ]


def test_schema_command_prints_each_trainers_schema(capsys: pytest.CaptureFixture[str]) -> None:
    for trainer, (target, _, _) in TRAINERS.items():
        schema = schema_of(trainer, capsys)
        cls = _load(target)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["title"] == cls.__name__ and schema["additionalProperties"] is False
        assert list(schema["properties"]) == list(cls.model_fields)
        for name, section in schema["$defs"].items():
            assert section["type"] == "object" and section["additionalProperties"] is False, name
    train = schema_of("sft", capsys)["$defs"]["TrainSettings"]["properties"]
    assert train["lr_scheduler"]["enum"] == ["cosine", "linear", "constant"]
    assert train["learning_rate"]["exclusiveMinimum"] == 0 and train["learning_rate"]["type"] == "number"
    assert train["warmup_ratio"]["minimum"] == 0 and train["warmup_ratio"]["exclusiveMaximum"] == 1
    assert "evaluate only at the end" in train["eval_steps"]["description"]
    # a section whose defaults are the trainer's own says so
    assert schema_of("dpo", capsys)["properties"]["train"]["default"] == {
        "output_dir": "runs/dpo",
        "learning_rate": 5e-6,
    }
    assert main(["schema", "nope"]) == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_conform_to_their_schema_and_typos_do_not(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = next(part for part in path.stem.split("_") if part in TRAINERS)
    schema = schema_of(trainer, capsys)
    data = yaml.safe_load(path.read_text())
    typo = {**data, "train": {**data.get("train", {}), "learnig_rate": 1e-4}}
    assert unknown_keys(schema, data) == []
    assert unknown_keys(schema, typo) == ["train.learnig_rate"]
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors(data)) == []
    assert [e.validator for e in validator.iter_errors(typo)] == ["additionalProperties"]
    assert not validator.is_valid({**data, "train": {**data.get("train", {}), "learning_rate": 0}})
    assert not validator.is_valid({**data, "model": {**data.get("model", {}), "dtype": "bf16"}})


# ---- every numeric key of every trainer, out of range

from padless.config.loading import bounds  # noqa: E402


def numeric_keys(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """Every dotted key under ``cls`` whose value is a number or a list of numbers, with its field."""
    found = []
    for name, spec in cls.model_fields.items():
        key = f"{prefix}{name}"
        members = [m for m in getattr(spec.annotation, "__args__", (spec.annotation,)) if m is not type(None)]
        members = [getattr(m, "__origin__", m) if hasattr(m, "__metadata__") else m for m in members]
        section = next((m for m in members if isinstance(m, type) and issubclass(m, ConfigModel)), None)
        if section is not None:
            found += numeric_keys(section, key + ".")
        elif any(m in (int, float) or getattr(m, "__args__", ()) in ((int,), (float,)) for m in members):
            found.append((key, spec))
    return found


def out_of_range(spec: Any) -> list[str]:
    """Values outside a key's type: past each bound, and not finite (a float) or not whole (an int)."""
    b, text = bounds(spec), str(spec.annotation)
    values = [str(b[k] - 1) for k in ("gt", "ge") if k in b] + [str(b[k] + 1) for k in ("lt", "le") if k in b]
    values += [f"{b['gt']}"] if "gt" in b else []
    if "list" in text:
        return ["[.inf]", "[.nan]"]
    if "float" in text:
        return [*values, ".inf", ".nan"]
    assert b, f"{spec}: an integer key without bounds has no out-of-range value"
    return [*values, "1.5"]


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_every_numeric_key_refuses_an_out_of_range_value_naming_the_key(trainer, capsys) -> None:
    """Walks the whole schema of each trainer (sections inside sections, optional ones too): every number
    outside its bounds, not finite or not whole exits 2 with one line that starts with the key."""
    keys = numeric_keys(_load(TRAINERS[trainer][0]))
    assert len(keys) > 20 and "train.seed" in dict(keys) and "model.lora.r" in dict(keys)
    for key, spec in keys:
        for value in out_of_range(spec):
            assert main([trainer, f"{key}={value}"]) == 2, (key, value)
            err = capsys.readouterr().err
            assert err.startswith(f"padless {trainer}: error: {key}"), (key, value, err)
            assert err.partition(key)[2].startswith((" on the command line", "[0] on the command line"))
            assert err.count("\n") == 1 and "fix:" in err, err


# ---- every key that applies only under a choice is refused where it has no effect

from typing import get_args, get_origin  # noqa: E402

from padless.config.loading import precedence_notes  # noqa: E402


def another_value(spec: Any, default: Any) -> Any:
    """A valid value of a field other than its default."""
    tp = spec.annotation
    union = get_origin(tp) not in (Literal, list, dict)  # X | None: its members; list[str]: itself
    members = [m for m in get_args(tp) if m is not type(None)] if union else [tp]
    first = members[0] if members else tp
    first = get_args(first)[0] if hasattr(first, "__metadata__") else first
    if get_origin(first) is Literal:
        return next(v for v in get_args(first) if v != default)
    if first is bool:
        return not default
    if first in (int, float):
        b = bounds(spec)
        value = default * 2 if default is not None and default > 0 else 2
        high = b.get("lt", b.get("le"))
        low = max(default or 0, b.get("ge", b.get("gt", 0)))
        if high and value >= high:  # under the upper bound: above the default, or below it if it is the bound
            value = (low + high) / 2 if low < high else (b.get("ge", b.get("gt", 0)) + high) / 2
        return value
    if get_origin(first) is dict:
        return {"a": "b"}
    if get_origin(first) is list:
        return [0.5] if get_args(first)[0] is float else ["x:y"]
    return "x"


def choice_values(owner: Any, key: str) -> list[Any]:
    """The values a choice key may take (its Literal members, both bools, its lowest bound, or a
    stand-in)."""
    section, _, name = key.rpartition(".")
    owner = getattr(owner, section) if section else owner
    spec = type(owner).model_fields[name]
    candidates = [another_value(spec, getattr(owner, name))]
    tp = spec.annotation
    literal = next((m for m in (tp, *get_args(tp)) if get_origin(m) is Literal), None)
    both = [True, False] if bool in get_args(tp) else []
    lowest = [bounds(spec)["ge"]] if "ge" in bounds(spec) else []  # e.g. grpo.beta: 0 turns the KL off
    return candidates + (list(get_args(literal)) if literal else []) + both + lowest


def inert_cases(cls: type) -> list[tuple[list[str], str, bool]]:
    """For every rule of every section of ``cls`` and each of its keys: the overrides that make the key
    inert (its choices set so that the rule says it does not apply, and the key to another value)."""
    root = cls()
    owners = [("", root)] + [
        (f"{n}.", getattr(root, n)) for n in cls.model_fields if isinstance(getattr(root, n), ConfigModel)
    ]
    cases = []
    for prefix, owner in owners:
        for rule in type(owner).applies:
            for key in rule.keys:
                tried = [{}] + [{c: v} for c in rule.choices for v in choice_values(owner, c)]
                for choice in tried:
                    changed = owner
                    for c, v in choice.items():  # a choice of this section, or a dotted one of the config
                        section, _, name = c.rpartition(".")
                        inner = getattr(owner, section) if section else owner
                        inner = inner.model_copy(update={name: v})
                        changed = owner.model_copy(update={section: inner}) if section else inner
                    if not rule.when(changed):
                        break
                else:
                    raise AssertionError(f"{cls.__name__}: no choice of {rule.choices} makes {key} inert")
                section, _, name = key.rpartition(".")
                inner = getattr(owner, section) if section else owner
                value = another_value(type(inner).model_fields[name], getattr(inner, name))
                overrides = [f"{prefix}{c}={json.dumps(v)}" for c, v in choice.items()]
                cases.append(([*overrides, f"{prefix}{key}={json.dumps(value)}"], prefix + key, rule.refuse))
    return cases


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_every_key_set_where_it_has_no_effect_is_refused_or_logged(trainer, capsys) -> None:
    """Walks every applicability rule of every section of each trainer: with its choices set so that it
    does not apply, setting the key exits 2 with one line naming the key, why it does nothing and the fix
    (or, for a key another key overrides by design, is a note the run logs)."""
    cls = _load(TRAINERS[trainer][0])
    cases = inert_cases(cls)
    assert len(cases) >= 6
    for overrides, key, refused in cases:
        if not refused:
            notes = precedence_notes(load_config(cls, None, overrides, once=True))
            assert any(n.startswith(f"{key}=") and "has no effect" in n for n in notes), (overrides, notes)
            continue
        assert main([trainer, *overrides]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith(f"padless {trainer}: error: {key}"), (overrides, err)
        assert "has no effect" in err and "fix:" in err and err.count("\n") == 1, err
