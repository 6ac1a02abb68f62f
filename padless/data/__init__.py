"""Loading raw data with provenance and turning it into tokenized
:class:`~padless.forward.packing.Example` s."""

from padless.data.chat import ChatEncoder, ChatTemplateError
from padless.data.preference import PairExample, tokenize_preference, tokenize_scoring
from padless.data.prompts import PromptExample, reward_inputs, tokenize_prompts
from padless.data.records import ACCEPTED_FORMATS, Row, SkipStats, load_rows
from padless.data.sft import detect_format, tokenize_sft
from padless.errors import DataError

__all__ = [
    "ACCEPTED_FORMATS",
    "ChatEncoder",
    "ChatTemplateError",
    "DataError",
    "PairExample",
    "PromptExample",
    "Row",
    "SkipStats",
    "detect_format",
    "load_rows",
    "reward_inputs",
    "tokenize_preference",
    "tokenize_prompts",
    "tokenize_scoring",
    "tokenize_sft",
]
