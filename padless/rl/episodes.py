"""Multi-turn episodes as one packed sequence: prompt, then each model turn as the exact token ids sampled,
each environment turn as the chat template renders it, tokenized once and appended.

Nothing is re-tokenized: the ids the model sampled are the ids it is trained on, and the next turn is
sampled from the very sequence that is later trained (so the sampler's log-probs and the training forward's
compare per token). Only model tokens are targets; environment tokens are context.

A sampled turn that calls tools is also read back as the message it parses to (content and tool calls, as an
API or a dataset keeps it) and proven under the template like a data row's turn
(:meth:`ChatEncoder.chat`): where the template would render that message other than as the ids the model
sampled (it drops a call, writes it without its name, re-serialises its arguments), the episode is marked
(``template_differs``, a rollout metric) and the log says why once per cause. The ids stay as sampled: the
policy is trained on what it wrote; the mark says that a conversation replayed through the template would
show it another turn.

Appending an environment turn asks the template to render the conversation twice: up to the model's turn,
and with the new messages after it (plus the generation prompt). Everything the second rendering writes
after the model turn's stop token (the first after the turn's start) is the environment turn; a model that
stops by writing the next role header (a template without an end-of-turn token) wrote the header the second
rendering writes right after its turn, and the environment turn is what follows that header. A template
whose second rendering changes what comes before that point (it rewrites earlier turns once later ones
exist) cannot be appended to without changing tokens already sampled, and is refused with the place where
the renderings differ.

Episodes run batched across those still going, turn by turn, through the rollout's :class:`Engine` (token
ids in, token ids out): every turn is one ``complete`` call for the running episodes, each seeded by its
episode and turn alone. Under sharded engines every rank makes the same calls with as many prompts
(fillers where its episodes ended sooner).

With a vision-language policy an episode keeps its prompt's images: ``reset()``'s messages are read with the
prompt row's image column (:meth:`ImageInputs.prepare`), rendered, and their image tokens expanded
(:meth:`ImageInputs.expand`); every turn's ``complete`` gets those image inputs with the whole sequence so
far, from which the model computes the M-RoPE positions of prompt, earlier turns and environment turns, and
the training example gets the same images and per-sample positions. An environment turn may show images too
(image parts holding their image, as in data rows): they are appended to the episode's image inputs in
order, and saved with a rollout checkpointed mid-way (as PNG). ``reset()``'s images must be the prompt row's
(a resumed run finds them there again): others are refused in one line.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from padless.data.chat import ChatEncoder, ChatTemplateError, common_prefix
from padless.data.records import IMAGE_COLUMNS, Row, chat_messages, load_rows
from padless.errors import DataError, InputError, UserCodeError
from padless.forward.packing import concat_vision
from padless.forward.ranks import agreed, common_count
from padless.rl.environments import (
    Environment,
    Step,
    Tools,
    Turn,
    checked_messages,
    checked_step,
    user_call,
)
from padless.rl.generate import Completion, Engine, row_seed
from padless.rl.sample import EpisodeStats, Sample
from padless.rl.sampler import Request, Sampler

if TYPE_CHECKING:
    from padless.data import PromptExample
    from padless.data.images import ImageInputs

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
    template_differs: str | None = None  # why the template would render a sampled turn otherwise
    # vision-language policies: the image inputs of the episode's images, the prompt's then those the
    # environment showed (kept, too, to be saved with the rollout), and the prompt row's (source, index)
    vision: dict[str, torch.Tensor] | None = None
    env_images: list[Any] = field(default_factory=list)
    origin: tuple[str, int] = ("", 0)

    def completion(self, greedy: bool) -> Completion:
        stats = EpisodeStats(
            turns=self.turns,
            tool_calls=self.calls,
            failed_tool_calls=self.failed_calls,
            env_tokens=self.model.count(False),
            env_reward=self.reward,
            truncated_by=self.truncated,
            template_differs=self.template_differs is not None,
        )
        return Completion(
            self.prompt_ids,
            self.ids,
            self.truncated is None,
            None if greedy else self.logprobs,
            model_mask=self.model,
            text=self.last_turn,
            episode=stats,
            vision=self.vision,
            env_images=self.env_images,
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
        images: ImageInputs | None = None,
    ):
        """``images``: the policy's image side (a vision-language policy), whose episodes keep their prompt's
        images in every turn."""
        self.tok, self.rollout, self.env_cls, self.spec = tokenizer, rollout, env_cls, env_spec
        self.tools, self.eos_ids, self.images = tools, eos_ids, images
        self.chat = ChatEncoder(tokenizer, eos_ids, tools.schemas if tools else None)
        self.told: set[str] = set()  # the causes of template_differs the log has said
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
            self.check_call_syntax()

    def check_call_syntax(self) -> None:
        """A tool call as the chat template writes it must read back as the same call through the response
        template; otherwise every model turn would be a failed tool call and every episode would run to
        ``max_turns``. Checked once, before any rollout, on a call to the first tool."""
        schema = self.tools.schemas[0]["function"]
        properties = schema.get("parameters", {}).get("properties", {})
        call = {
            "name": schema["name"],
            "arguments": {k: EXAMPLE_ARGUMENT.get(v.get("type"), "a") for k, v in properties.items()},
        }
        user = [{"role": "user", "content": "Hello."}]
        prefix = self.render(user, True)
        written = self.render(
            [
                *user,
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            ],
            False,
        )
        turn = written[len(prefix) :] if written.startswith(prefix) else ""
        ends = [i for eos in self.eos_ids if (i := turn.find(self.tok.decode([eos]))) >= 0]
        turn = turn[: min(ends)] if ends else turn
        own = self.tools.response_template is getattr(self.tok, "response_template", None)
        source = "the tokenizer's response_template" if own else "rollout.response_template"
        if schema["name"] not in turn:
            log.warning(
                "rollout.tools: the chat template writes no tool call into an assistant turn, so the call "
                "syntax %s reads cannot be checked against it",
                source,
            )
            return
        calls, problem = self.tools.parse(turn, prefix)
        read = [{**c, "arguments": _as_object(c["arguments"])} for c in calls]
        if read != [call]:
            raise InputError(
                f"{source} cannot read the tool calls the chat template writes: a call to {schema['name']} "
                f"is written as {turn!r} and read back as {problem or calls or 'no call'}, so every model "
                "turn would be a failed tool call; fix: set rollout.response_template to transformers' "
                "response schema for the template's call syntax (or remove it to use the tokenizer's own)"
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
        # the sampled turn starts where its generation prompt ends (or where the rendering parts from it)
        end = before.find(eos, common_prefix(self.render(messages[:-1], True), before))
        if end >= 0:
            end += len(eos)
        elif after.startswith(before + eos):  # the stop token is the header the template writes next
            before, end = before + eos, len(before) + len(eos)
        else:
            raise ChatTemplateError(
                f"the chat template does not close an assistant turn with {eos!r}, the token the model "
                "stopped at, nor write it next for the environment's messages, so padless cannot tell where "
                "the sampled turn ends in its rendering; fix: use a template that ends assistant turns with "
                "the end-of-turn token generation stops at"
            )
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

    def check_rendering(self, e: Episode, parsed: dict[str, Any], ids: list[int], turn: int) -> None:
        """Mark ``e`` when the template would render the sampled turn (``ids``), kept as the message it
        parses to, as other text; the log says why, once per cause. Two renders when it renders the same;
        otherwise the turn is proven like a data row's (:meth:`ChatEncoder.chat`) to name what differs."""
        history = [*e.messages, {**parsed, "role": "assistant"}]
        row = Row({"messages": history}, f"environment {self.spec!r}", turn, skippable=False)
        sampled = self.tok.decode(ids, skip_special_tokens=False)
        try:
            head = self.chat.text(row, e.messages, True)
            turn_text = self.chat.text(row, history)[len(head) :]
            if turn_text.startswith(sampled):
                return
            self.chat.chat(row, chat_messages(row, "messages", history), last_only=True)
            k = common_prefix(turn_text, sampled)
            why = (
                f"re-serialises it: it writes {turn_text[k : k + 30]!r} where the model wrote "
                f"{sampled[k : k + 30]!r} (character {k} of the turn)"
            )
            cause = "re-serialised"
        except (ChatTemplateError, DataError) as error:
            why = str(error).split(": ", 1)[-1]
            cause = getattr(error, "behaviour", None) or getattr(error, "reason", "")
        e.template_differs = e.template_differs or why
        if cause not in self.told:
            self.told.add(cause)
            log.warning(
                "environment %r: at turn %d the model called tools in a form the chat template would render "
                "differently (the turn is trained as sampled; the rollout metric template_differs counts "
                "such episodes): the template %s",
                self.spec,
                turn,
                why.removeprefix("the chat template "),
            )

    # -- running ------------------------------------------------------------------------------------------

    def start(self, row: dict[str, Any], seed: int, prompt: PromptExample | None = None) -> Episode:
        """The episode of ``row``: its environment and first messages; ``prompt``: the row as tokenized for
        the policy, whose image inputs (vision-language policies) the episode's images must equal."""
        env = user_call(self.spec, "the constructor", self.env_cls, row)
        parts = self.images is not None
        messages = checked_messages(self.spec, "reset()", user_call(self.spec, "reset()", env.reset), parts)
        if not messages or messages[-1]["role"] == "assistant":
            got = "messages ending with an assistant message" if messages else "no messages"
            raise UserCodeError(
                f"environment {self.spec!r}: reset() returned {got}; fix: end with the message the model "
                "answers"
            )
        if self.images is None:
            text = self.render(messages, True)
            return Episode(env, messages, self.room(self.encode(text), prompt), seed, text=text)
        if prompt is None:
            raise ValueError("a vision-language policy's episodes start from their tokenized prompts")
        messages, ids, vision = self.with_images(row, messages, prompt)
        text = self.render(messages, True)
        origin = (prompt.source, prompt.row)
        return Episode(env, messages, self.room(ids, prompt), seed, text=text, vision=vision, origin=origin)

    def room(self, ids: list[int], prompt: PromptExample | None) -> list[int]:
        """An episode's first ids, refused when they leave the model no token of ``max_episode_tokens``
        (every episode would end before its first turn, and the rollout train on nothing)."""
        budget = self.rollout.max_episode_tokens
        if budget is not None and len(ids) >= budget:
            row = f" of row {prompt.row} of {prompt.source}" if prompt is not None else ""
            raise InputError(
                f"rollout.max_episode_tokens={budget}: the first messages{row} (reset() of environment "
                f"{self.spec!r}) take {len(ids)} tokens, leaving the model no room to answer; fix: raise "
                f"rollout.max_episode_tokens above {len(ids)} (e.g. by max_turns x max_new_tokens), or "
                "shorten the prompts"
            )
        return ids

    def with_images(
        self, row: dict[str, Any], messages: list[dict[str, Any]], prompt: PromptExample
    ) -> tuple[list[dict[str, Any]], list[int], dict[str, torch.Tensor] | None]:
        """``reset()``'s messages read with the row's image column (image parts without an image of their
        own, or ``<image>`` placeholders, take the next one): the messages as parts, the rendered ids with
        each image's tokens expanded, and the image inputs, checked equal to the prompt's."""
        assert self.images is not None
        columns = {k: row[k] for k in IMAGE_COLUMNS if row.get(k) is not None}
        where = Row({"prompt": messages, **columns}, prompt.source, prompt.row, skippable=False)
        try:
            prepared = self.images.prepare(where)
            messages = prepared.row.data["prompt"]
            ids = self.encode(self.render(messages, True))
            ids, _, vision = self.images.expand(prepared.row, ids, None, prepared.images)
        except DataError as e:
            raise UserCodeError(f"environment {self.spec!r}: the images of reset()'s messages: {e}") from None
        if not same_vision(vision, prompt.vision):
            raise UserCodeError(
                f"environment {self.spec!r}: reset() of row {prompt.row} of {prompt.source} "
                "returns images other than the prompt row's; an episode's images are its prompt row's (a "
                "run resumed mid-rollout finds them there again); fix: return the row's prompt images, or "
                "put the images the episode needs in the row's prompt and images column"
            )
        return messages, ids, vision

    def run(
        self,
        engine: Engine,
        rows: Sequence[dict[str, Any]],
        seeds: Sequence[int],
        greedy: bool,
        prompts: Sequence[PromptExample] | None = None,
    ) -> list[Episode]:
        """One episode per row (``seeds[i]`` seeds every turn of episode ``i``), run to the end;
        ``prompts[i]``: row ``i`` as tokenized (needed by a vision-language policy, for its images)."""
        r = self.rollout
        starts = prompts if prompts is not None else [None] * len(rows)
        # what the environment raises on one rank stops every rank here, together (they then checkpoint)
        who = f"environment {self.spec!r}"
        episodes = agreed(lambda: [self.start(*a) for a in zip(rows, seeds, starts, strict=True)], who)
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
                None if self.images is None else [e.vision for e in batch],
            )
            agreed(partial(self.take_turns, running, completions, turn), who)
        for e in episodes:
            if not e.done:
                e.done, e.truncated = True, "max_turns"
        ended = [e.env for e in episodes if hasattr(e.env, "close")]  # cut ones too: nothing left running
        agreed(lambda: [user_call(self.spec, "close()", env.close) for env in ended], who)
        return episodes

    def take_turns(self, running: list[Episode], completions: list[Completion], turn: int) -> None:
        for e, c in zip(running, completions, strict=False):
            self.take_turn(e, c, turn)

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
        parsed, problem = self.tools.read(text, prefix) if self.tools else (None, None)
        calls, problem = self.tools.calls(parsed) if parsed is not None else ([], problem)
        if calls:
            self.check_rendering(e, parsed, ids, turn)
        tool_messages = []
        if problem is not None:
            tool_messages.append({"role": "tool", "name": "parse", "content": problem})
            e.failed_calls += 1
            e.calls += 1
        for call in calls:
            message, ok = self.tools.run(call, e.env)
            tool_messages.append(message)
            e.calls += 1
            e.failed_calls += not ok
        step: Step = checked_step(
            self.spec,
            user_call(self.spec, "step()", e.env.step, Turn(turn, text, list(ids), calls, tool_messages)),
            self.images is not None,
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
        messages, shown, vision = step.messages, [], None
        where = Row({"prompt": messages}, *e.origin, skippable=False)
        try:  # a vision-language policy: image parts hold their images, read as a data row's are
            if self.images is not None:
                prepared = self.images.prepare(where)
                messages, shown = prepared.row.data["prompt"], prepared.images
            appended = self.appended(e.messages, messages, eos)
            new = self.encode(appended)
            if self.images is not None:  # each image's tokens expanded, its inputs after the episode's
                new, _, vision = self.images.expand(where, new, None, shown)
        except DataError as error:
            raise UserCodeError(
                f"environment {self.spec!r}: the images of step()'s messages at turn {turn}: {error} (an "
                "image part of an environment turn holds its image: 'image', 'path' or 'url' key)"
            ) from None
        e.messages += messages
        if budget is not None and len(e.prompt_ids) + len(e.ids) + len(new) >= budget:
            e.done, e.truncated = True, "token_budget"  # no room left for the model to answer it
            return
        if vision is not None:
            e.vision = concat_vision([e.vision, vision])
            e.env_images += shown
        e.ids += new
        e.model += [False] * len(new)
        e.text += appended


EXAMPLE_ARGUMENT: dict[str | None, Any] = {"string": "a", "integer": 1, "number": 1.5, "boolean": True}


def _as_object(arguments: Any) -> Any:
    """A call's arguments as a mapping when a parser gave them as JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def same_vision(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    """Whether two image inputs are the same images (same keys, equal tensors)."""
    if not a or not b:
        return not a and not b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class EpisodeSampler(Sampler):
    """Samples multi-turn episodes through ``runner``: ``group`` per prompt (a prompt's consecutive), each
    built from the prompt's data row, read again from ``specs`` (the data sets the prompts came from)."""

    def __init__(
        self,
        engine: Engine,
        rollout: Any,
        runner: EpisodeRunner,
        specs: Sequence[str],
        images: ImageInputs | None = None,
    ):
        super().__init__(engine, rollout, images)
        self.runner, self.specs = runner, list(specs)
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}

    def sample(self, request: Request) -> list[Sample]:
        """Logs how many episodes were truncated and why (they are masked unless mask_truncated is off)."""
        started = time.perf_counter()
        self.engine.sync_weights()
        prompts, group = request.prompts, request.group
        rows = [self.row_of(p) for p in prompts for _ in range(group)]
        seeds = [row_seed(s, k) for s in request.seeds for k in range(group)]
        starts = [p for p in prompts for _ in range(group)]
        episodes = self.runner.run(self.engine, rows, seeds, request.greedy, starts)
        cut = Counter(e.truncated for e in episodes if e.truncated is not None)
        if cut:
            what = "masked from the loss" if self.rollout.mask_truncated else "trained (mask_truncated off)"
            reasons = ", ".join(f"{n} by {why}" for why, n in sorted(cut.items()))
            log.warning(
                "rollout: %d of %d episodes truncated (%s); %s", cut.total(), len(episodes), reasons, what
            )
        seconds = time.perf_counter() - started
        return [
            self.record(e.completion(request.greedy), prompts[j // group], request.greedy, seconds)
            for j, e in enumerate(episodes)
        ]

    def row_of(self, prompt: PromptExample) -> dict[str, Any]:
        """The data row a prompt was read from, as the environment receives it."""
        key = (prompt.source, prompt.row)
        if key not in self.rows:
            for spec in self.specs:
                self.rows.update({(r.source, r.index): r.data for r in load_rows(spec)})
        return self.rows[key]


def make_runner(
    tokenizer: Any,
    rollout: Any,
    eos_ids: set[int],
    images: ImageInputs | None = None,
    data: Sequence[str] = (),
) -> EpisodeRunner:
    """``data``: the run's data sets (an environment may bring tools that depend on them)."""
    from padless.rl.environments import load_environment

    response_template = rollout.response_template or getattr(tokenizer, "response_template", None)
    env_cls = load_environment(rollout.environment)
    spec = rollout.environment or "tools"
    brought = env_cls.tools_for(data) if hasattr(env_cls, "tools_for") else getattr(env_cls, "tools", ())
    tools = Tools(rollout.tools, response_template, (spec, brought))
    return EpisodeRunner(tokenizer, rollout, env_cls, spec, tools, eos_ids, images)


__all__ = ["Environment", "Episode", "EpisodeRunner", "EpisodeSampler", "make_runner"]
