"""Environments and tools as users give them: loaded from specs, schemas from type hints, refused in one
line when they cannot work; the bundled calculator."""

from __future__ import annotations

import copy

import pytest

from padless.config.loading import ConfigError, load_config
from padless.config.schema import GRPOConfig
from padless.errors import InputError
from padless.rl.environments import Calculator, Environment, Tools, calculate, load_environment
from padless.rl.episodes import make_runner
from padless.rl.rewards import RewardError


@pytest.mark.parametrize(
    ("expression", "value"),
    [("26 + 19", "45"), ("47 minus 35", "12"), ("6 x 6", "36"), ("7 / 2", "3.5"), ("-3 times 4", "-12")],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


def test_calculate_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"write two numbers and an operator"):
        calculate("twenty + 1")
    with pytest.raises(ValueError, match=r"division by zero"):
        calculate("1 / 0")


def test_tool_schemas_come_from_type_hints_and_docstrings():
    [schema] = Tools(["calculate"], None).schemas
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"

    def undocumented(x):
        return x

    with pytest.raises(
        InputError, match=r"its JSON schema cannot be read .* fix: give every argument a type hint"
    ):
        Tools([undocumented], None)


def test_environment_specs_are_refused_in_one_line(tmp_path):
    assert load_environment(None) is Environment and load_environment("calculator") is Calculator
    (tmp_path / "envs.py").write_text("class NoStep:\n    pass\n\nvalue = 3\n")
    with pytest.raises(InputError, match=r"is not a class with a step\(turn\) method"):
        load_environment(f"{tmp_path / 'envs.py'}:NoStep")
    with pytest.raises(RewardError, match=r"^environment .*has no attribute 'Missing'"):
        load_environment(f"{tmp_path / 'envs.py'}:Missing")
    with pytest.raises(
        RewardError, match=r"^environment 'calculater': not a bundled environment .*did you mean"
    ):
        load_environment("calculater")


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.max_episode_tokens=100"], "neither an environment nor tools are set"),
        (
            ["rollout.environment=calculator", "reward.overlong_buffer=4"],
            "an episode has several model turns",
        ),
    ],
)
def test_episode_keys_are_checked_with_the_config(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(GRPOConfig, None, overrides)


def test_tools_need_a_template_that_renders_them_and_a_way_to_read_calls(tokenizer):
    cfg = load_config(GRPOConfig, None, ["rollout.environment=calculator"])
    runner = make_runner(tokenizer, cfg.rollout, {tokenizer.eos_token_id})  # the embedded one does both
    assert list(runner.tools.functions) == ["calculate"]
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    with pytest.raises(InputError, match=r"never reads `tools`"):
        make_runner(plain, cfg.rollout, {tokenizer.eos_token_id})
    silent = copy.deepcopy(tokenizer)
    silent.response_template = None
    with pytest.raises(InputError, match=r"no response_template"):
        make_runner(silent, cfg.rollout, {tokenizer.eos_token_id})


def test_a_response_template_that_cannot_read_the_templates_calls_is_refused_at_start(tokenizer):
    """A call to the first tool is written by the chat template and read back before any rollout: a parser
    looking for another syntax would turn every model turn into a failed call."""
    cfg = load_config(GRPOConfig, None, ["rollout.environment=calculator"])
    fields = tokenizer.response_template["fields"]
    other = {**fields["tool_calls"], "open": "<tool>", "close": "</tool>"}
    cfg.rollout.response_template = {**tokenizer.response_template, "fields": {**fields, "tool_calls": other}}
    with pytest.raises(InputError) as info:
        make_runner(tokenizer, cfg.rollout, {tokenizer.eos_token_id})
    message = str(info.value)
    assert message.startswith("rollout.response_template cannot read the tool calls the chat template writes")
    assert '<call>{"name": "calculate", "arguments": {"expression": "a"}}</call>' in message
    assert "read back as no call" in message and "fix: set rollout.response_template" in message
    broken = copy.deepcopy(tokenizer)
    broken.response_template = cfg.rollout.response_template
    cfg.rollout.response_template = None
    with pytest.raises(InputError, match=r"^the tokenizer's response_template cannot read"):
        make_runner(broken, cfg.rollout, {tokenizer.eos_token_id})


def test_a_tool_brought_twice_names_where_each_comes_from(tokenizer):
    cfg = load_config(GRPOConfig, None, ["rollout.environment=calculator", "rollout.tools=[calculate]"])
    with pytest.raises(InputError) as info:
        make_runner(tokenizer, cfg.rollout, {tokenizer.eos_token_id})
    assert str(info.value) == (
        "rollout.tools: rollout.tools[0] ('calculate') and environment 'calculator' both bring a tool named "
        "'calculate', and a call can run only one of them; fix: the environment brings it already: remove it "
        "from rollout.tools"
    )
    with pytest.raises(InputError, match=r"rollout.tools\[0\] .* and rollout.tools\[1\] .* own name$"):
        Tools(["calculate", calculate], None)
