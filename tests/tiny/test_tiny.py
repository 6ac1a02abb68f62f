"""Tests for the embedded tiny tokenizer, models and datasets (padless.tiny)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from padless.tiny import (
    DATASETS,
    SHIPPED_MODELS,
    TINY_MODELS,
    VISION_MODELS,
    build_tiny_model,
    data_path,
    tiny_config,
    tiny_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_tiny.py"
EXPECTED_ROWS = {
    "sft": 400,
    "sft_prompt_completion": 200,
    "preference": 300,
    "rl": 300,
    "sft_eval": 40,
    "preference_eval": 40,
}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And the colour of grass?"},
    {"role": "assistant", "content": "Grass is usually green."},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


def load_rows(name: str) -> list[dict]:
    with data_path(name).open() as f:
        return [json.loads(line) for line in f]


def chat_ids(tok: PreTrainedTokenizerFast, messages: list[dict], **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def assistant_mask(tok: PreTrainedTokenizerFast, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------


def test_tokenizer_loads_cleanly(capfd: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = tiny_tokenizer()
    err = capfd.readouterr().err
    assert not caught, [str(w.message) for w in caught]
    assert "warn" not in err.lower(), err
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.model_max_length == 2048


def test_vocab_and_special_tokens(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) == 4096
    assert tok.vocab_size == 4096
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.bos_token is None
    assert set(tok.all_special_ids) == {0, 1, 2}
    # Special tokens are atomic and never produced from ordinary text.
    assert tok("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 1
    assert not {0, 1, 2} & set(tok("im_start im_end endoftext <| |>", add_special_tokens=False)["input_ids"])
    # No BOS/EOS is added implicitly.
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]


def test_digits_are_single_tokens(tok: PreTrainedTokenizerFast) -> None:
    pieces = tok.convert_ids_to_tokens(tok("17 + 25 = 42", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if p.isdigit()] == ["1", "7", "2", "5", "4", "2"]


def test_round_trip(tok: PreTrainedTokenizerFast) -> None:
    text = 'Once upon a time, Mira counted 12 shells.\n\nShe said: "That\'s plenty!"'
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_tiny_tokenizer_returns_fresh_objects() -> None:
    first = tiny_tokenizer()
    first.padding_side = "left"
    second = tiny_tokenizer()
    assert second is not first
    assert second.padding_side == "right"


def test_chat_template_renders_chatml(tok: PreTrainedTokenizerFast) -> None:
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
        "<|im_start|>user\nAnd the colour of grass?<|im_end|>\n"
        "<|im_start|>assistant\nGrass is usually green.<|im_end|>\n"
    )
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == expected
    prompt = tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    # No default system message is injected.
    assert tok.apply_chat_template(CONVERSATION[1:2], tokenize=False).startswith("<|im_start|>user\n")


def test_assistant_mask_covers_content_and_im_end(tok: PreTrainedTokenizerFast) -> None:
    ids, mask = assistant_mask(tok, CONVERSATION)
    assert len(mask) == len(ids)
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(masked) == "2 + 3 = 5.<|im_end|>Grass is usually green.<|im_end|>"
    # Exactly two contiguous spans, each ending on <|im_end|> and followed by an unmasked "\n".
    starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
    ends = [k for k in range(len(mask)) if mask[k] and (k == len(mask) - 1 or not mask[k + 1])]
    assert len(starts) == len(ends) == 2
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for s, e in zip(starts, ends, strict=True):
        assert ids[s - len(header) : s] == header  # the header is just before the span, and unmasked
        assert ids[e] == tok.eos_token_id
        assert tok.decode(ids[e + 1 : e + 2]) == "\n"


def test_assistant_mask_on_every_sft_row(tok: PreTrainedTokenizerFast) -> None:
    for name in ("sft", "sft_eval"):
        for row in load_rows(name):
            ids, mask = assistant_mask(tok, row["messages"])
            expected = "".join(
                m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"
            )
            assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == expected


def test_generation_prompt_is_a_token_prefix(tok: PreTrainedTokenizerFast) -> None:
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert (
        tok("<|im_start|>assistant\nThe sky is blue.", add_special_tokens=False)["input_ids"][: len(header)]
        == header
    )
    for row in load_rows("sft")[:200]:
        messages = row["messages"]
        full = chat_ids(tok, messages)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = chat_ids(tok, messages[:k], add_generation_prompt=True)
            assert full[: len(prompt)] == prompt
            assert prompt[-len(header) :] == header


def test_prompt_completion_tokenizes_additively(tok: PreTrainedTokenizerFast) -> None:
    """Tokenizing prompt and completion separately must give the ids of the concatenation."""
    for row in load_rows("sft_prompt_completion"):
        p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        c = tok(row["completion"], add_special_tokens=False)["input_ids"]
        assert p + c == tok(row["prompt"] + row["completion"], add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------------------------------
# Models (the vision-language ones are tested in test_vlm.py)
# --------------------------------------------------------------------------------------------------

TEXT_MODELS = sorted(set(TINY_MODELS) - set(VISION_MODELS))


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_config(name: str) -> None:
    cfg = tiny_config(name)
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.vocab_size == 4096
    assert (cfg.pad_token_id, cfg.eos_token_id) == (0, 2)
    assert cfg.max_position_embeddings == 2048
    assert cfg.initializer_range == 0.02
    assert cfg.dtype in ("float32", torch.float32)
    assert tiny_config(name) is not cfg
    cfg.hidden_size = 8  # mutation must not leak into the next config
    assert tiny_config(name).hidden_size != 8


def test_config_shapes() -> None:
    q, ll = tiny_config("tiny-qwen2"), tiny_config("tiny-llama")
    assert (
        q.model_type,
        q.hidden_size,
        q.num_hidden_layers,
        q.num_attention_heads,
        q.num_key_value_heads,
    ) == ("qwen2", 256, 4, 8, 2)
    assert (q.intermediate_size, q.tie_word_embeddings) == (688, True)
    assert (
        ll.model_type,
        ll.hidden_size,
        ll.num_hidden_layers,
        ll.num_attention_heads,
        ll.num_key_value_heads,
    ) == ("llama", 128, 2, 4, 2)
    assert (ll.intermediate_size, ll.tie_word_embeddings) == (344, False)
    h = tiny_config("tiny-qwen3.5")  # Qwen3.5's 3:1 pattern of gated delta-net and attention layers
    assert (h.model_type, h.hidden_size, h.num_hidden_layers) == ("qwen3_5_text", 256, 4)
    assert h.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_unknown_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="tiny-qwen2"):
        tiny_config("gpt2")
    with pytest.raises(ValueError, match="causal-lm"):
        build_tiny_model("tiny-llama", task="seq2seq")
    with pytest.raises(ValueError, match="preference_eval"):
        data_path("dpo")


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_build_is_deterministic_and_keeps_global_rng(name: str) -> None:
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a = build_tiny_model(name, seed=0).state_dict()
    b = build_tiny_model(name, seed=0).state_dict()
    c = build_tiny_model(name, seed=1).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert abs(a["model.embed_tokens.weight"].std().item() - 0.02) < 0.002


def test_causal_lm_forward_and_kwargs() -> None:
    model = build_tiny_model("tiny-qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, 4096)
    assert logits.dtype == torch.float32
    llama = build_tiny_model("tiny-llama", dtype=torch.bfloat16, attn_implementation="eager")
    assert type(llama).__name__ == "LlamaForCausalLM"
    assert next(llama.parameters()).dtype == torch.bfloat16
    assert llama.config._attn_implementation == "eager"


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_score_model(name: str) -> None:
    model = build_tiny_model(name, task="score")
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == 0
    out = model(torch.tensor([[1, 5, 9, 2, 0, 0], [1, 7, 2, 0, 0, 0]]))
    assert out.logits.shape == (2, 1)


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------


def row_length(tok: PreTrainedTokenizerFast, row: dict) -> int:
    if "messages" in row:
        return len(chat_ids(tok, row["messages"]))
    second = row.get("completion", row.get("chosen", row.get("answer")))
    return len(tok(row["prompt"] + second, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_shape(name: str) -> None:
    path = data_path(name)
    assert path.stat().st_size < 300_000
    rows = load_rows(name)
    assert len(rows) == EXPECTED_ROWS[name]
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)  # no duplicates
    keys = {
        "sft": {"messages"},
        "sft_eval": {"messages"},
        "sft_prompt_completion": {"prompt", "completion"},
        "preference": {"prompt", "chosen", "rejected"},
        "preference_eval": {"prompt", "chosen", "rejected"},
        "rl": {"prompt", "answer"},
    }[name]
    for row in rows:
        assert set(row) == keys
        for key in keys - {"messages"}:
            assert isinstance(row[key], str) and row[key].strip()


@pytest.mark.parametrize("name", ["sft", "sft_eval"])
def test_sft_conversations(name: str) -> None:
    rows = load_rows(name)
    n_system = n_multi = 0
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert all(isinstance(m["content"], str) and m["content"] for m in row["messages"])
        if roles[0] == "system":
            n_system += 1
            roles = roles[1:]
        assert roles in (["user", "assistant"], ["user", "assistant", "user", "assistant"])
        n_multi += len(roles) == 4
    assert n_system >= len(rows) // 10
    assert n_multi >= len(rows) // 10


@pytest.mark.parametrize("name", ["preference", "preference_eval"])
def test_preference_pairs_differ(name: str) -> None:
    rows = load_rows(name)
    assert all(r["chosen"] != r["rejected"] for r in rows)
    assert sum(len(r["chosen"]) != len(r["rejected"]) for r in rows) >= len(rows) // 4


def test_rl_answers_are_correct_integers() -> None:
    ops = {"+": int.__add__, "plus": int.__add__, "-": int.__sub__, "minus": int.__sub__, "x": int.__mul__}
    pattern = re.compile(r"^(?:What is|Compute) (\d+) (\+|-|x|plus|minus) (\d+)[?.] ")
    checked = 0
    for row in load_rows("rl"):
        assert re.fullmatch(r"-?\d+", row["answer"])
        if m := pattern.match(row["prompt"]):
            assert int(row["answer"]) == ops[m.group(2)](int(m.group(1)), int(m.group(3)))
            checked += 1
    assert checked >= 150


def test_eval_splits_do_not_repeat_train_rows() -> None:
    for train, ev in (("sft", "sft_eval"), ("preference", "preference_eval")):
        seen = {json.dumps(r, sort_keys=True) for r in load_rows(train)}
        assert not seen & {json.dumps(r, sort_keys=True) for r in load_rows(ev)}


@pytest.mark.parametrize("name", DATASETS)
def test_lengths_are_long_tailed(tok: PreTrainedTokenizerFast, name: str) -> None:
    lengths = sorted(row_length(tok, row) for row in load_rows(name))
    median = statistics.median(lengths)
    assert 10 <= median <= 120
    assert lengths[-1] >= 6 * median
    assert lengths[-1] <= 1024


# --------------------------------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------------------------------


def test_build_script_reproduces_committed_files(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--out", str(tmp_path)], check=True, capture_output=True
    )
    tiny = data_path("sft").parent.parent
    for rel in [
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        *(f"data/{name}.jsonl" for name in DATASETS),
    ]:
        assert (tmp_path / rel).read_bytes() == (tiny / rel).read_bytes(), rel


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny-llama-arith", 0.15, 0.6), ("tiny-llama-arith-rl", 0.5, 1.0)],
)
def test_the_shipped_arithmetic_models_earn_their_reward(name, low, high) -> None:
    """tiny-llama-arith answers some of the embedded arithmetic prompts right (greedy: 5 of the first 16,
    measured), and not all: RL examples start from a policy with reward to gain. tiny-llama-arith-rl, its
    GRPO-sharpened copy (the distillation example's teacher), answers more (9 of 16, measured)."""
    from padless.data import load_rows
    from padless.proof.load import load_model, load_tokenizer
    from padless.rl.generate import generate
    from padless.rl.rewards import arithmetic

    tok, model = load_tokenizer(name), load_model(name)
    assert model.name_or_path == name and model.dtype == torch.float32
    assert (SHIPPED_MODELS[name] / "model.safetensors").stat().st_size < 3_000_000
    rows = [r.data for r in load_rows("tiny:rl[:16]")]
    user = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    prompts = [chat_ids(tok, messages, add_generation_prompt=True) for messages in user]
    completions = generate(model, tok, prompts, max_new_tokens=8)
    texts = [tok.decode(c.completion_ids, skip_special_tokens=True) for c in completions]
    exact = sum(arithmetic(None, texts, [r["answer"] for r in rows])) / len(rows)
    assert low <= exact <= high, texts


def build_script():
    """scripts/build_tiny.py as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_tiny"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_calculator_warm_start_data_call_the_tool_as_the_template_writes_it() -> None:
    """The conversations tiny-llama-calc is trained on: every two-number tiny:rl prompt has a call whose
    result is its answer (the build asserts it per row), the template's own <call>{json}</call> turn (its
    tools preamble standing in as a system message, checked by the build per conversation), and direct
    answers on those prompts too."""
    from padless.rl.environments import Tools, calculate

    build = build_script()
    rows = [json.loads(line) for line in data_path("rl").read_text().splitlines()]
    tok = tiny_tokenizer()
    fresh, direct = build.TOOL_STAGES[0][:2]
    chats = build.tool_chats(rows, tok, fresh, direct)
    calling = [c for c in chats if len(c) == 5]
    known = {r["prompt"] for r in rows}
    seen = [c for c in calling if c[1]["content"] in known]
    assert len(seen) == sum(build.tool_expression(r["prompt"]) is not None for r in rows) == 285
    assert len(calling) - len(seen) == fresh[1]
    assert len(chats) == 300 + 285 * direct - 285 + len(calling)
    text = tok.apply_chat_template(calling[0][:3], tokenize=False)
    turn = text[text.rindex("<|im_start|>assistant\n") :].removesuffix("\n").removesuffix("<|im_end|>")
    calls, problem = Tools([calculate], tok.response_template).parse(turn, "")
    assert problem is None and calls == [calling[0][2]["tool_calls"][0]["function"]]


def test_the_calculator_warm_start_calls_the_tool_on_some_episodes() -> None:
    """tiny-llama-calc, sampled at temperature 1 in calculator episodes on the first 16 tiny:rl prompts
    (2 each, the first turn): some episodes call the tool and most of those calls run, but not all
    episodes call it, so GRPO has tool use to learn (measured: 5 of 32 call, all 5 calls run)."""
    from padless.config.loading import load_config
    from padless.config.schema import GRPOConfig
    from padless.data import load_rows
    from padless.forward.engine import ModelEngine
    from padless.proof.load import load_model, load_tokenizer
    from padless.rl.episodes import make_runner
    from padless.rl.generate import HFEngine

    tok, model = load_tokenizer("tiny-llama-calc"), load_model("tiny-llama-calc")
    assert (SHIPPED_MODELS["tiny-llama-calc"] / "model.safetensors").stat().st_size < 3_000_000
    overrides = ["rollout.environment=calculator", "rollout.max_new_tokens=64", "rollout.max_turns=1"]
    rollout = load_config(GRPOConfig, None, overrides).rollout
    rows = [r.data for r in load_rows("tiny:rl[:16]")] * 2
    episodes = make_runner(tok, rollout, {tok.eos_token_id}).run(
        HFEngine(ModelEngine(model), tok, rollout), rows, list(range(len(rows))), greedy=False
    )
    calling = sum(e.calls > 0 for e in episodes) / len(episodes)
    ran = sum(e.calls - e.failed_calls for e in episodes) / sum(e.calls for e in episodes)
    assert 0.05 <= calling <= 0.6 and ran > 0.5, (calling, ran)
