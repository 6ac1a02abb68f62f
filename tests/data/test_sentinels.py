"""The sentinels a turn's proof renders a message with: one per value the turn must hold."""

from __future__ import annotations

from padless.data.sentinels import SENTINEL, with_sentinels

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}, "id": "call_1"}


def test_sentinels_stand_in_for_every_value_a_turn_must_render():
    """Content parts, reasoning, each call's name, argument keys and values (numbers stay numbers); an id
    that names the function carries the name's sentinel, any other id its own (not required)."""
    message = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Sum:"}],
        "reasoning_content": "adding",
        "tool_calls": [
            {**CALL, "function": {"name": "add", "arguments": {"a": 2, "b": "3", "opts": {"exact": True}}}},
            {"id": "functions.mul:1", "function": {"name": "mul", "arguments": '{"a": 1}'}},
        ],
    }
    perturbed, leaves = with_sentinels(message, "messages[2]")
    assert [(leaf.path, leaf.required) for leaf in leaves] == [
        ("messages[2].content[0].thinking", True),
        ("messages[2].content[1].text", True),
        ("messages[2].reasoning_content", True),
        ("messages[2].tool_calls[0].function.name", True),
        ("messages[2].tool_calls[0].function.arguments.a (name)", True),
        ("messages[2].tool_calls[0].function.arguments.a", True),
        ("messages[2].tool_calls[0].function.arguments.b (name)", True),
        ("messages[2].tool_calls[0].function.arguments.b", True),
        ("messages[2].tool_calls[0].function.arguments.opts (name)", True),
        ("messages[2].tool_calls[0].function.arguments.opts.exact (name)", True),
        ("messages[2].tool_calls[0].id", False),
        ("messages[2].tool_calls[1].function.name", True),
        ("messages[2].tool_calls[1].function.arguments", True),
    ]
    first = perturbed["tool_calls"][0]["function"]["arguments"]
    assert isinstance(first[SENTINEL.format(4)], int) and first[SENTINEL.format(6)] == SENTINEL.format(7)
    assert list(first[SENTINEL.format(8)].values()) == [True]  # true / false / null stay: their key stands
    assert perturbed["tool_calls"][1]["id"] == f"functions.{SENTINEL.format(11)}:1"
    assert message["tool_calls"][1]["id"] == "functions.mul:1"  # the row itself is untouched
