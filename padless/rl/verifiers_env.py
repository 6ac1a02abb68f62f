"""A verifiers task as a padless episode: its environment's turns, its tools, its rubric as the reward.

The rows come from ``data.train: verifiers:<module>:<name>`` (:mod:`padless.data.procedural`), naming a
``Taskset`` or an ``Env`` over one; with ``rollout.environment: verifiers`` each episode finds its task again
by the row's position (checked against the task's key, so a taskset that changed since the rows were made is
refused) and plays it with the policy in the seat an agent program holds in verifiers:

- a bare taskset is verifiers' single-agent case (``SingleAgentEnv``: ``agents.agent.run(task)``): the
  task's messages (its system prompt first), then model turns until one calls no tool;
- an ``Env`` runs its own ``setup(agents)``, ``run(task, agents)`` and ``finalize(task, episode)``: where it
  holds the policy's seat open with ``agents.<seat>.interaction(task)``, every ``turn(message)`` is an
  environment turn (a user message) and the model's answer comes back as the turn's ``Segment``; that is how
  verifiers writes multi-turn environments (a scripted user, a game, a teacher).

Tools are the task's and the taskset's ``Toolset`` servers (``Task.toolsets``, ``Taskset.toolsets``): the
model sees each ``@vf.tool`` under the name and JSON schema that the server's MCP ``list_tools`` gives (named
``<server>_<tool>`` as verifiers' chat harness names them, or bare with ``TOOL_PREFIX = None``), its calls
are read from its turns through the chat template like any tool call (:mod:`padless.rl.episodes`), and run
by the server's own MCP ``call_tool`` (in process, no HTTP); the result is the tool message. Task-scoped
servers are made per episode (``setup`` and ``setup_task``), taskset-scoped ones once per process.

The reward is verifiers' own scoring of the seat's whole conversation (its messages as a ``Trace``, the
model's turns marked sampled): the task's ``@vf.reward`` functions (and any it was configured with) weighted
as the rubric says, plus what ``Env.finalize`` records, the trace's total (``Trace.reward``).

Why not verifiers' agent programs and interception server: in verifiers 0.4 a seat is played by a harness
program (``verifiers/v1/harnesses``; even the tool-less ``null`` harness launches a chat script through
``uv``, which it installs and whose packages it downloads) whose model calls an interception server
(``verifiers/v1/interception/server.py``) answers through a ``Client`` (``verifiers/v1/clients/train.py``
renders prompts with the ``renderers`` library and samples from a vLLM ``/inference/v1/generate`` server).
padless samples every turn itself instead, from the very sequence it trains on, so the policy's seat is
played here (``Harness.launch``'s contract allows a harness that runs its loop in process); what verifiers
would run around the model (the Env's control flow, the task's tools, the rubric) is verifiers' own code.

Not played: a seat that ``Env.setup`` marks untrainable (another model, e.g. ``user-sim``'s simulated user):
refused; a second exchange of the policy's seat in one episode: refused (one conversation per episode);
``@vf.stop`` and interception hooks, agent limits (``rollout.max_turns`` and ``max_episode_tokens`` cut
episodes instead). ``pip install 'padless[verifiers]'``.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from padless.data.procedural import VERIFIERS, verifiers_source
from padless.errors import InputError
from padless.rl.environments import Environment, Step, Turn


class VerifiersEnvironment(Environment):
    """One verifiers task per episode, played through its Env (if any) with its tools and scored by its
    rubric. The Env's code runs on the episode's own event loop, driven from ``reset`` and ``step``: it runs
    until it asks the policy for a turn (those messages go to the model) or ends (the episode's reward)."""

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__(row)
        ref = row.get("verifiers")
        if not isinstance(ref, dict) or not {"taskset", "idx", "key"} <= set(ref):
            raise InputError(
                "rollout.environment: verifiers reads each row's 'verifiers' column (the task's taskset, "
                f"position and key); this row has {sorted(row)}; fix: set data.train: "
                "verifiers:<module>:<name>"
            )
        self.env, _, tasks = verifiers_source(ref["taskset"])
        task = tasks[ref["idx"]] if 0 <= ref["idx"] < len(tasks) else None
        if task is None or task.key != ref["key"]:
            raise InputError(
                f"{ref['taskset']}: task {ref['idx']} is not the one this row was made from (the taskset "
                "changed since); fix: make the rows again (clear the data cache) or restore the taskset"
            )
        self.task, self.spec = task, ref["taskset"]
        self.shared = shared_servers(self.spec)
        self.loop = asyncio.new_event_loop()
        self.play: asyncio.Task[None] | None = None
        self.asking: asyncio.Future[list[dict[str, Any]]] | None = None  # the Env asks the model a turn
        self.answered: asyncio.Future[None] | None = None  # the model answered it
        self.messages: list[dict[str, Any]] = []  # the seat's conversation, as verifiers keeps messages
        self.seat: str | None = None
        self.dispatch: dict[str, tuple[Any, str]] = {}  # a tool's name -> its MCP server, its name there
        self.offered: dict[str, Any] = {}  # the tools as verifiers records them (vf.Tool)
        self.trace: Any = None

    @classmethod
    def tools_for(cls, data: Sequence[str]) -> list[dict[str, Any]]:
        """The tools of the verifiers tasksets in ``data`` as the model sees them (run by ``run_tool``)."""
        schemas: dict[str, tuple[str, dict[str, Any]]] = {}
        for spec in dict.fromkeys(s for s in data if isinstance(s, str) and s.startswith(VERIFIERS)):
            for schema in tool_schemas(spec):
                other, known = schemas.setdefault(schema["function"]["name"], (spec, schema))
                if known != schema:
                    raise InputError(
                        f"{other} and {spec} both bring a tool named {schema['function']['name']!r}, as "
                        "different tools, and a call can run only one of them; fix: give the tools distinct "
                        "names (a toolset's TOOL_PREFIX)"
                    )
        return [schema for _, schema in schemas.values()]

    # -- padless's side: the episode's turns ------------------------------------------------------------

    def reset(self) -> list[dict[str, Any]]:
        self.play = self.loop.create_task(self.episode())
        first = self.advance()
        if first is None:
            raise RuntimeError(f"{self.spec}: the environment ended before the model's first turn")
        return first

    def step(self, turn: Turn) -> Step:
        calls = [
            {"id": f"call_{turn.index}_{k}", "name": c["name"], "arguments": _as_text(c["arguments"])}
            for k, c in enumerate(turn.tool_calls)
        ]
        self.messages.append({"role": "assistant", "content": turn.text, "tool_calls": calls or None})
        if turn.tool_messages:  # the seat's tool loop goes on: the results go back to the model
            ids = [c["id"] for c in calls] or ["call_parse"]  # a turn whose call syntax is broken
            self.messages += [
                {"role": "tool", "tool_call_id": i, "name": m["name"], "content": m["content"]}
                for i, m in zip(ids, turn.tool_messages, strict=False)
            ]
            return Step(messages=turn.tool_messages)
        assert self.answered is not None
        self.answered.set_result(None)
        new = self.advance()
        if new is not None:
            return Step(messages=new)
        return Step(reward=float(self.trace.reward), done=True)

    def run_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

        server, raw = self.dispatch[name]
        result = self.loop.run_until_complete(server.call_tool(raw, arguments))
        return mcp_content_to_chat_content(result.content)

    def close(self) -> None:
        if self.play is not None and not self.play.done():  # cut by max_turns or the token budget
            self.play.cancel()
            self.loop.run_until_complete(asyncio.wait([self.play]))
        self.loop.close()

    def advance(self) -> list[dict[str, Any]] | None:
        """Run the verifiers side until it asks the model for a turn (the messages it added) or ends."""
        assert self.play is not None
        self.asking = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait([self.asking, self.play], return_when="FIRST_COMPLETED"))
        if self.asking.done():
            return self.asking.result()
        self.play.result()  # what the Env, a tool server or the rubric raised
        return None

    # -- verifiers' side: the Env's control flow and the seat it asks -----------------------------------

    async def episode(self) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.configs.agent import agent_config_fields

        self.dispatch = await self.tool_servers()
        names = ["agent"] if self.env is None else list(agent_config_fields(self.env.config))
        agents = Seats({name: Seat(self, name) for name in names})
        if self.env is None:  # verifiers' SingleAgentEnv
            await agents.agent.run(self.task)
            return
        await self.env.setup(agents)
        await self.env.run(self.task, agents)
        if self.trace is None:
            raise RuntimeError(f"{type(self.env).__name__}.run() never ran the policy's seat")
        episode = vf.Episode(
            env=vf.EnvInfo(id=self.env.config.env_id), task=self.trace.task, traces=[self.trace]
        )
        await self.env.finalize(self.task, episode)
        self.trace = episode.traces[0]

    async def ask(self, new: list[dict[str, Any]]) -> None:
        """Hand ``new`` messages to the model and wait for its answer (its tool loop included)."""
        if not new:
            raise RuntimeError("the policy's seat was asked for a turn with no new message to answer")
        self.messages += new
        self.answered = self.loop.create_future()
        assert self.asking is not None
        self.asking.set_result(new)
        await self.answered

    def take(self, seat: Seat) -> None:
        if not seat.trainable:
            raise RuntimeError(
                f"seat {seat.name!r} is marked untrainable by the Env (another model: a simulated user, a "
                "judge), which padless cannot play: it samples the policy only; fix: let the Env compute "
                "that side's turns in its code, or train with verifiers' own trainer"
            )
        if self.seat is not None:
            raise RuntimeError(
                f"seat {seat.name!r} is played after seat {self.seat!r} in the same episode: padless trains "
                "one conversation per episode (the policy plays one seat, once); fix: keep one run or "
                "interaction per episode"
            )
        self.seat = seat.name

    async def finish(self, task: Any, seat: Seat) -> Any:
        """The seat's conversation as a verifiers trace, scored by the task's rubric."""
        self.trace = trace_of(task, self.messages, list(self.offered.values()), seat.name)
        await task.score(self.trace)
        return self.trace

    async def tool_servers(self) -> dict[str, tuple[Any, str]]:
        """The task's tool servers (made and set up for this task) and the taskset's (shared): each tool's
        name -> its MCP server and its name there; ``offered`` keeps them as verifiers records tools."""
        import verifiers.v1 as vf

        own = []
        for toolset in self.task.toolsets(self.task.config):
            await toolset.setup()
            await toolset.setup_task(self.task)
            own.append(toolset)
        dispatch: dict[str, tuple[Any, str]] = {}
        for toolset, server in [*served(own), *self.shared]:
            for tool in await server.list_tools():
                name = qualified(toolset, tool.name)
                dispatch[name] = (server, tool.name)
                self.offered[name] = vf.Tool(
                    name=name, description=tool.description or "", parameters=tool.input_schema
                )
        return dispatch


class Seat:
    """An agent seat of the Env, played by the policy: verifiers' ``Agent`` surface that an Env uses."""

    def __init__(self, game: VerifiersEnvironment, name: str) -> None:
        self.game, self.name, self.trainable = game, name, True

    async def run(self, task: Any, **resources: Any) -> Any:
        """The whole rollout of ``task``: its messages, then model turns until one calls no tool."""
        self.take(resources)
        await self.game.ask(opening(task))
        return await self.game.finish(task, self)

    @asynccontextmanager
    async def interaction(self, task: Any, **resources: Any) -> AsyncIterator[Exchange]:
        """The rollout held open turn by turn, the Env as the user; scored when the exchange closes."""
        self.take(resources)
        yield Exchange(self.game, task)
        await self.game.finish(task, self)

    def take(self, resources: dict[str, Any]) -> None:
        """The policy takes this seat; an agent program's resources (a box, tool servers, a trace watcher)
        have nothing to run in here and are refused rather than dropped."""
        given = sorted(k for k, v in resources.items() if v is not None and v is not False)
        if given:
            raise RuntimeError(
                f"seat {self.name!r} is handed {', '.join(given)}: resources of a verifiers agent program, "
                "which padless does not run (it plays the seat in process); fix: leave them out"
            )
        self.game.take(self)


class Exchange:
    """verifiers' ``Interaction``: ``turn(message)`` is an environment turn, the model's answer its result."""

    def __init__(self, game: VerifiersEnvironment, task: Any) -> None:
        self.game, self.task, self.started = game, task, False

    async def turn(self, message: str | None = None) -> Any:
        import verifiers.v1 as vf
        from pydantic import TypeAdapter

        new = [] if self.started else opening(self.task)
        if message is not None:
            new.append({"role": "user", "content": message})
        self.started = True
        start = len(self.game.messages) + len(new)
        await self.game.ask(new)
        read = TypeAdapter(vf.Message)
        return vf.Segment(messages=[read.validate_python(m) for m in self.game.messages[start:]])

    @property
    def trace(self) -> Any:
        """The exchange's trace: live (the conversation so far) until it closes, then the scored one."""
        game = self.game
        return game.trace or trace_of(self.task, game.messages, list(game.offered.values()), game.seat or "")


class Seats:
    """verifiers' ``Agents``: the Env's seats by name."""

    def __init__(self, seats: dict[str, Seat]) -> None:
        self.seats = seats

    def __getattr__(self, name: str) -> Seat:
        seats = self.__dict__.get("seats") or {}
        if name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats)}")
        return seats[name]


def opening(task: Any) -> list[dict[str, Any]]:
    """A task's first messages: its system prompt, then its prompt (a string is one user message)."""
    data = task.data
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*system, {"role": "user", "content": data.prompt}]
    return [*system, *(m.model_dump(mode="json", exclude_none=True) for m in data.prompt or [])]


def trace_of(task: Any, messages: list[dict[str, Any]], tools: list[Any] = (), seat: str = "agent") -> Any:
    """A conversation as the verifiers trace of ``seat`` playing ``task`` (the assistant's messages marked
    sampled; the tools it was offered on its first node)."""
    import verifiers.v1 as vf
    from pydantic import TypeAdapter
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    read = TypeAdapter(vf.Message)
    nodes = [
        MessageNode(
            parent=i - 1 if i else None,
            message=read.validate_python({k: v for k, v in m.items() if v is not None}),
            sampled=m["role"] == "assistant",
            tools=list(tools) if i == 0 else [],
        )
        for i, m in enumerate(messages)
    ]
    return Trace(
        task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=AgentInfo(config=vf.AgentConfig(), name=seat),
        nodes=nodes,
    )


# -- tool servers ---------------------------------------------------------------------------------------


def qualified(toolset: Any, tool: str) -> str:
    """A tool's name as the model sees it: ``<server>_<tool>``, as verifiers' chat harness names MCP tools."""
    return f"{toolset.server_name}_{tool}" if toolset.server_name else tool


def served(toolsets: Sequence[Any]) -> list[tuple[Any, Any]]:
    """Each toolset with an MCP server holding its tools (the server its HTTP app would serve)."""
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.state import State, state_cls

    pairs = []
    for toolset in toolsets:
        kept = state_cls(type(toolset))
        if kept is not State:
            raise InputError(
                f"tool server {type(toolset).__name__} keeps state between calls ({kept.__name__}), "
                "which verifiers carries through its interception server's /state channel; padless runs "
                "tools in process without it; fix: keep the state in the tool's arguments or the task"
            )
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        pairs.append((toolset, server))
    return pairs


@functools.cache
def shared_servers(spec: str) -> tuple[tuple[Any, Any], ...]:
    """The taskset's own tool servers (task-agnostic), set up once per process."""
    _, taskset, _ = verifiers_source(spec)
    toolsets = taskset.toolsets(taskset.config)
    for toolset in toolsets:
        asyncio.run(toolset.setup())
    return tuple(served(toolsets))


@functools.cache
def tool_schemas(spec: str) -> tuple[dict[str, Any], ...]:
    """The tools of ``spec``'s tasks as chat-template schemas: every task-scoped and taskset-scoped tool."""
    _, taskset, _ = verifiers_source(spec)
    servers = [*served(type(taskset).task_type().toolsets(taskset.config.task)), *shared_servers(spec)]

    async def listed() -> list[dict[str, Any]]:
        schemas = []
        for toolset, server in servers:
            for tool in await server.list_tools():
                name = qualified(toolset, tool.name)
                if any(name == s["function"]["name"] for s in schemas):
                    raise InputError(
                        f"{spec}: two tool servers bring a tool named {name!r}; fix: give one of them a "
                        "distinct TOOL_PREFIX"
                    )
                function = {
                    "name": name,
                    "description": tool.description or "",
                    "parameters": tool.input_schema,
                }
                schemas.append({"type": "function", "function": function})
        return schemas

    return tuple(asyncio.run(listed()))


def _as_text(arguments: Any) -> str:
    """A call's arguments as verifiers keeps them: the JSON text the model wrote."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
