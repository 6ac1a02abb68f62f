"""Chat templates written for padless's tests, each reproducing one behaviour of real chat templates.

None is copied from a model repository: each is the smallest Jinja that does what a family of real templates
does with a message (drop its tool calls, take a function name from the call id, read the reasoning from
another field, write content parts out as Python text, end a tool call with its own stop token, end a turn
with no token at all, pre-fill the generation prompt), beside faithful ones for each format that must train
(JSON and XML tool calls, reasoning fields, thinking parts, harmony-style channels, role headers as stops).

A :class:`TestTemplate` also says which special tokens its text needs, which token is the tokenizer's eos,
and which tokens the model's ``generation_config.json`` would list as eos ids besides it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TestTemplate:
    """A chat template and the tokenizer facts that go with it."""

    __test__ = False  # not a pytest class

    template: str
    does: str  # what it reproduces
    tokens: tuple[str, ...] = ()  # special tokens the template writes
    eos: str | None = None  # the tokenizer's eos, when not the base tokenizer's
    stops: tuple[str, ...] = ()  # generation_config.json eos tokens besides the tokenizer's

    def tokenizer(self, base: Any) -> Any:
        """A copy of ``base`` with the template, its tokens and its eos."""
        tok = copy.deepcopy(base)
        if self.tokens:
            tok.add_tokens(list(self.tokens), special_tokens=True)
        if self.eos is not None:
            tok.eos_token = self.eos
        tok.chat_template = self.template
        return tok

    def stop_ids(self, tok: Any) -> tuple[int, ...]:
        return tuple(tok.convert_tokens_to_ids(t) for t in self.stops)


def _chatml(assistant: str, other: str = "m.content") -> str:
    """ChatML turns after a system turn naming the tools (when there are any); the assistant's body is the
    Jinja statements ``assistant`` (writing ``m``'s fields), other roles' the expression ``other``."""
    return (
        "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + "
        "(tools | map(attribute='function.name') | join(', ')) + '<|im_end|>\\n' }}{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        + assistant
        + "{{ '<|im_end|>\\n' }}"
        "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (" + other + ") + '<|im_end|>\\n' }}{% endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


# A call's function, in the OpenAI form or the flat one; its arguments as JSON (a string is written as is).
_FN = "{% set f = c.function if c.function is defined else c %}"
_ARGS = "(f.arguments if f.arguments is string else f.arguments | tojson)"
_JSON_CALLS = (
    "{%- for c in m.tool_calls or [] %}" + _FN + '{{ \'<tool_call>\\n{"name": "\' + f.name + '
    '\'", "arguments": \' + ' + _ARGS + " + '}\\n</tool_call>' }}{%- endfor %}"
)
_XML_CALLS = (
    "{%- for c in m.tool_calls or [] %}" + _FN + "{{ '<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for k, v in f.arguments.items() %}{{ '<parameter=' + k + '>\\n' + "
    "(v if v is string else v | tojson) + '\\n</parameter>\\n' }}{%- endfor %}"
    "{{ '</function>\\n</tool_call>' }}{%- endfor %}"
)
_CONTENT = "{{ m.content or '' }}"
_PARTS = (
    "{%- if m.content is string %}{{ m.content }}{%- else %}{%- for p in m.content or [] %}"
    "{%- if p.type == 'thinking' %}{{ '[THINK]' + p.thinking + '[/THINK]' }}"
    "{%- elif p.type == 'text' %}{{ p.text }}{% endif %}{%- endfor %}{%- endif %}"
)
_REASONING = (
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
)

# Harmony-style: channels, a tool call ending in <|call|>, the last answer in <|return|>, history in <|end|>.
_HARMONY = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- if m.reasoning_content %}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.reasoning_content + '<|end|>' }}{% endif %}"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}"
    "{{ '<|start|>assistant to=functions.' + c.function.name + '<|channel|>commentary json<|message|>' }}"
    "{{ (c.function.arguments if c.function.arguments is string else c.function.arguments | tojson) }}"
    "{{ '<|call|>' }}{%- endfor %}"
    "{%- else %}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content }}"
    "{{ '<|return|>' if loop.last else '<|end|>' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|start|>functions to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}"
    "{%- else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
# GLM-style: no end-of-turn token; the model stops by writing the next role header.
_HEADERS = (
    "{%- for m in messages %}"
    "{{ '<|' + ('observation' if m.role == 'tool' else m.role) + '|>\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ c.function.name + '\\n' + c.function.arguments | tojson }}"
    "{%- endfor %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
HEADER_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
# Pre-filled reasoning: the generation prompt opens <think>; turns after the last user message keep their
# reasoning (from reasoning_content, or from <think>...</think> in the content), earlier ones lose it.
_PREFILL = (
    "{%- set ns = namespace(last=0) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set r = m.reasoning_content if m.reasoning_content is string else '' %}{% set c = m.content %}"
    "{%- if m.reasoning_content is not string and '</think>' in c %}"
    "{%- set r = c.split('</think>')[0].split('<think>')[-1] %}{% set c = c.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last %}{{ '<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ c.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)

TEMPLATES: dict[str, TestTemplate] = {
    "json-calls": TestTemplate(
        _chatml(_REASONING + _CONTENT + _JSON_CALLS),
        "Hermes / Qwen-style: reasoning in <think>, tool calls as JSON in <tool_call> tags",
    ),
    "xml-calls": TestTemplate(
        _chatml(_CONTENT + _XML_CALLS),
        "Qwen3-Coder-style: tool calls as XML, one <parameter=...> per argument",
    ),
    "drops-calls": TestTemplate(
        _chatml(_CONTENT), "never renders tool_calls: a calling turn trains as its text only"
    ),
    "id-as-name": TestTemplate(
        _chatml(
            _CONTENT + "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + c.id + ' ' + "
            "c.function.arguments | tojson + '</tool_call>' }}{%- endfor %}"
        ),
        "Kimi-style: writes the call id (expected as functions.NAME:0) where the function name belongs",
    ),
    "xml-strings-only": TestTemplate(
        _chatml(
            _CONTENT
            + _XML_CALLS.replace(
                "{%- for k, v in f.arguments.items() %}",
                "{%- for k, v in f.arguments.items() if v is string %}",
            )
        ),
        "XML tool calls that write string arguments only: numbers and objects are dropped",
    ),
    "reads-reasoning": TestTemplate(
        _chatml("{{ '<think>' + (m.reasoning or '') + '</think>' + m.content }}"),
        "reads the reasoning from 'reasoning' and writes <think></think> when it is empty",
    ),
    "thinking-parts": TestTemplate(
        _chatml(_PARTS, other="m.content if m.content is string else m.content[0].text"),
        "Magistral-style: content parts, thinking parts in [THINK]...[/THINK]",
    ),
    "parts-as-text": TestTemplate(
        _chatml("{{ m.content | string }}", other="m.content | string"),
        "writes a list content out as Python text",
    ),
    "harmony": TestTemplate(
        _HARMONY,
        "harmony-style channels: a tool call ends in <|call|>, the last answer in <|return|>, history in "
        "<|end|>",
        tokens=HARMONY_TOKENS,
        eos="<|return|>",
        stops=("<|call|>",),
    ),
    "headers": TestTemplate(
        _HEADERS,
        "GLM-style: no end-of-turn token, the next role header (a generation-config eos id) ends a turn",
        tokens=HEADER_TOKENS,
        stops=("<|user|>", "<|observation|>"),
    ),
    "prefill-think": TestTemplate(
        _PREFILL,
        "the generation prompt pre-fills <think>\\n; reasoning before the last user message is cut out",
    ),
}
