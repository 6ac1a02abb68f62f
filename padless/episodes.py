"""Multi-turn episodes as one packed sequence: prompt, then each model turn as the exact token ids sampled,
each environment turn as the chat template renders it, tokenized once and appended.

Nothing is re-tokenized: the ids the model sampled are the ids it is trained on, and the next turn is
sampled from the very sequence that is later trained (so the sampler's log-probs and the training forward's
compare per token). Only model tokens are targets; environment tokens are context.

Appending an environment turn asks the template to render the conversation twice: up to the model's turn,
and with the new messages after it (plus the generation prompt). Everything the second rendering writes
after the model turn's end-of-turn token is the environment turn. A template whose second rendering changes
what comes before that point (it rewrites earlier turns once later ones exist) cannot be appended to without
changing tokens already sampled, and is refused with the place where the renderings differ.

Episodes run batched across those still going, turn by turn, through the rollout's :class:`Engine` (token
ids in, token ids out): every turn is one ``complete`` call for the running episodes, each seeded by its
episode and turn alone. Under sharded engines every rank makes the same calls with as many prompts
(fillers where its episodes ended sooner).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from padless.data.chat import ChatTemplateError
from padless.environments import (
    Environment,
    Step,
    Tools,
    Turn,
    checked_messages,
    checked_step,
    user_call,
)
from padless.errors import InputError, UserCodeError
from padless.ranks import common_count
from padless.rollout import Completion, Engine, row_seed

log = logging.getLogger(__name__)


@dataclass
class Episode:
    """One episode being built: the sequence so far, which tokens the model wrote, and its bookkeeping."""

    env: Any
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)  # everything after the prompt
    model: list[bool] = field(default_factory=list)  # per id after the prompt: written by the model
    logprobs: list[float] = field(default_factory=list)  # per model token, at sampling
    text: str = ""  # the rendered prompt and everything after it, as text (the parser's prefix)
    turns: int = 0
    reward: float = 0.0
    calls: int = 0
    failed_calls: int = 0
    last_turn: str = ""
    done: bool = False
    truncated: str | None = None  # why the episode was cut: "turn_length", "max_turns", "token_budget"

    def completion(self, greedy: bool) -> Completion:
        stats = {
            "turns": self.turns,
            "tool_calls": self.calls,
            "failed_tool_calls": self.failed_calls,
            "env_tokens": self.model.count(False),
            "env_reward": self.reward,
            "truncated_by": self.truncated,
        }
        return Completion(
            self.prompt_ids,
            self.ids,
            self.truncated is None,
            None if greedy else self.logprobs,
            model_mask=self.model,
            text=self.last_turn,
            episode=stats,
        )


class EpisodeRunner:
    """Runs the episodes of a rollout: environments built per prompt row, tools, limits from ``rollout``."""

    def __init__(
        self,
        tokenizer: Any,
        rollout: Any,
        env_cls: type,
        env_spec: str,
        tools: Tools,
        eos_ids: set[int],
    ):
        self.tok, self.rollout, self.env_cls, self.spec = tokenizer, rollout, env_cls, env_spec
        self.tools, self.eos_ids = tools, eos_ids
        if tools:
            template = tokenizer.get_chat_template() if tokenizer.chat_template else ""
            if "tools" not in template:
                raise InputError(
                    "rollout.tools: the tokenizer's chat template never reads `tools`, so the model would "
                    "not see the tools' schemas; fix: use a tokenizer whose template renders tools"
                )
            if tools.response_template is None:
                raise InputError(
                    "rollout.tools: the tokenizer has no response_template, so padless cannot read tool "
                    "calls from a model turn; fix: set rollout.response_template (transformers' "
                    "response-parsing schema for the template's tool-call syntax) or use a tokenizer that "
                    "ships one"
                )

    # -- rendering --------------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools.schemas} if self.tools else {}
        try:
            return str(
                self.tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
                )
            )
        except Exception as e:  # the template is user-supplied Jinja
            raise ChatTemplateError(
                f"rollout.environment {self.spec!r}: the chat template cannot render the episode's messages "
                f"({type(e).__name__}: {e}); fix: return messages the template accepts"
            ) from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def appended(self, messages: list[dict[str, Any]], new: list[dict[str, Any]], eos: str) -> str:
        """The text the template writes after the model's last turn (ending in ``eos``) for ``new``
        messages and the next generation prompt; refused when it would change what came before."""
        before = self.render(messages, False)
        after = self.render(messages + new, True)
        end = before.rfind(eos)
        if end < 0:
            raise ChatTemplateError(
                f"the chat template does not close an assistant turn with {eos!r}, the token the model "
                "stopped at, so padless cannot tell where the sampled turn ends in its rendering; fix: use a "
                "template that ends assistant turns with the end-of-turn token generation stops at"
            )
        end += len(eos)
        if not after.startswith(before[:end]):
            k = next(
                (i for i, (a, b) in enumerate(zip(after, before[:end], strict=False)) if a != b),
                min(len(after), end),
            )
            raise ChatTemplateError(
                "the chat template cannot append an environment turn to a sampled episode without changing "
                f"earlier tokens: with the next messages it renders character {k} as {after[k : k + 40]!r} "
                f"instead of {before[k : k + 40]!r} (it rewrites earlier turns once later ones exist, e.g. "
                "drops their reasoning); fix: use a template that renders history as it was generated"
            )
        return after[end:]

    # -- running ------------------------------------------------------------------------------------------

    def start(self, row: dict[str, Any], seed: int) -> Episode:
        env = user_call(self.spec, "the constructor", self.env_cls, row)
        messages = checked_messages(self.spec, "reset()", user_call(self.spec, "reset()", env.reset))
        if not messages or messages[-1]["role"] == "assistant":
            got = "messages ending with an assistant message" if messages else "no messages"
            raise UserCodeError(
                f"environment {self.spec!r}: reset() returned {got}; fix: end with the message the model "
                "answers"
            )
        text = self.render(messages, True)
        return Episode(env, messages, self.encode(text), seed, text=text)

    def run(
        self, engine: Engine, rows: Sequence[dict[str, Any]], seeds: Sequence[int], greedy: bool
    ) -> list[Episode]:
        """One episode per row (``seeds[i]`` seeds every turn of episode ``i``), run to the end."""
        r = self.rollout
        episodes = [self.start(row, seed) for row, seed in zip(rows, seeds, strict=True)]
        budget = r.max_episode_tokens
        for turn in range(r.max_turns):
            running = [e for e in episodes if not e.done]
            for e in running:
                if budget is not None and len(e.prompt_ids) + len(e.ids) >= budget:
                    e.done, e.truncated = True, "token_budget"
            running = [e for e in running if not e.done]
            count = common_count(len(running))  # every rank samples as often, with as many prompts
            if count == 0:
                break
            filler = running[0] if running else episodes[0]
            batch = running + [filler] * (count - len(running))
            completions = engine.complete(
                [e.prompt_ids + e.ids for e in batch],
                1,
                [row_seed(e.seed, turn) for e in batch],
                greedy,
            )
            for e, c in zip(running, completions, strict=False):
                self.take_turn(e, c, turn)
        for e in episodes:
            if not e.done:
                e.done, e.truncated = True, "max_turns"
        return episodes

    def take_turn(self, e: Episode, c: Completion, turn: int) -> None:
        """Append the sampled turn; unless the episode ends, ask the environment and append its answer."""
        ids, logprobs, finished = c.completion_ids, c.logprobs, c.finished
        budget = self.rollout.max_episode_tokens
        room = None if budget is None else budget - len(e.prompt_ids) - len(e.ids)
        if room is not None and len(ids) > room:  # the same tokens a shorter generation would have given
            ids, finished = ids[:room], False
        e.ids += ids
        e.model += [True] * len(ids)
        e.logprobs += (logprobs or [])[: len(ids)]
        e.turns += 1
        body = ids[:-1] if finished else ids
        text = self.tok.decode(body, skip_special_tokens=False)
        e.last_turn = self.tok.decode(body, skip_special_tokens=True)
        prefix = e.text  # what came before the turn, for the parser
        e.text += self.tok.decode(ids, skip_special_tokens=False)
        if not finished:  # cut mid-turn: no environment answer to a half-written turn
            e.done, e.truncated = (
                True,
                "token_budget" if room is not None and len(ids) == room else "turn_length",
            )
            return
        calls, problem = self.tools.parse(text, prefix) if self.tools else ([], None)
        tool_messages = []
        if problem is not None:
            tool_messages.append({"role": "tool", "name": "parse", "content": problem})
            e.failed_calls += 1
            e.calls += 1
        for call in calls:
            message, ok = self.tools.run(call)
            tool_messages.append(message)
            e.calls += 1
            e.failed_calls += not ok
        step: Step = checked_step(
            self.spec,
            user_call(self.spec, "step()", e.env.step, Turn(turn, text, list(ids), calls, tool_messages)),
        )
        e.reward += float(step.reward)
        if step.done or turn + 1 == self.rollout.max_turns:
            e.done = True
            e.truncated = None if step.done else "max_turns"
            return
        if not step.messages:
            raise UserCodeError(
                f"environment {self.spec!r}: step() returned no messages and done=False at turn {turn}; fix: "
                "return the messages the model answers next, or done=True"
            )
        e.messages.append({"role": "assistant", "content": text})
        eos = self.tok.decode(ids[-1:], skip_special_tokens=False)
        appended = self.appended(e.messages, step.messages, eos)
        e.messages += step.messages
        new = self.encode(appended)
        if budget is not None and len(e.prompt_ids) + len(e.ids) + len(new) >= budget:
            e.done, e.truncated = True, "token_budget"  # no room left for the model to answer it
            return
        e.ids += new
        e.model += [False] * len(new)
        e.text += appended


def make_runner(tokenizer: Any, rollout: Any, eos_ids: set[int]) -> EpisodeRunner:
    from padless.environments import load_environment

    response_template = rollout.response_template or getattr(tokenizer, "response_template", None)
    env_cls = load_environment(rollout.environment)
    tools = Tools([*rollout.tools, *getattr(env_cls, "tools", ())], response_template)
    spec = rollout.environment or "tools"
    return EpisodeRunner(tokenizer, rollout, env_cls, spec, tools, eos_ids)


__all__ = ["Environment", "Episode", "EpisodeRunner", "make_runner"]
