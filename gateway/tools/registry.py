"""The tool registry: each built-in tool's spec, argument model and function, and the
per-turn object an agent calls them through (`TurnTools`, the `Tools` of
`gateway.agents.protocol`).

A call never raises for the model's mistakes or a tool's failure: unknown tool, bad
JSON, arguments that do not fit the tool's model (pydantic: missing, mistyped, out of
range, unknown keys), a `ValueError` from the tool (a bad argument it found) and any
other exception all come back as ``{"error": "..."}``, which the model reads and may
act on. Only cancellation (/stop, the turn's deadline) passes through.

What a turn's tools write to state.db (the scratchpad) is held by the turn and handed
to its finish transaction (`TurnTools.writes`): the transcript of the tool rounds and
what they changed commit together. Notes go to the recall store at once (its own
writes).

At most once across crashes: every call is journaled (`gateway.tools.call_journal`)
before it runs and again when it returns, so a turn resumed after a crash replays its
recorded rounds (`TurnTools.resume`) instead of running them again. A call that was in
flight at the crash runs again only when its tool is `read_only`; otherwise the model
reads `INTERRUPTED`. A call refused by the user is recorded with its refusal, so a
resumed turn never asks again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import BaseModel, ValidationError

from gateway.context.tokens import json_tokens
from gateway.domain.session import SessionSource
from gateway.store import codec, scratchpad
from gateway.store.session_store import SessionStore
from gateway.store.tool_calls import CALL, DIRECT, ROUND, Row
from gateway.tools.approval import REFUSALS, ApprovalGate, ApprovalRequest, Verdict
from gateway.tools.call_journal import CallJournal

log = structlog.get_logger("gateway.tools")

ToolFunction = Callable[["TurnScope", Any], Awaitable[Any]]

# What the model reads for a call that was running when the gateway stopped, when its
# tool is not safe to run again.
INTERRUPTED = "interrupted by a restart: it may or may not have run"


class ToolText(str):
    """A tool's answer that is already the text the model reads (not JSON-encoded again)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    # Validates a call; its JSON schema is the spec's parameters. None: a tool whose own
    # server checks its arguments (an MCP tool): any JSON object passes, as a dict, and
    # `parameters` is its schema.
    arguments: type[BaseModel] | None
    run: ToolFunction
    # Safe to run again after a crash (it only reads, or its effect is the turn's own
    # until the turn finishes): a call in flight at a crash is run again only then.
    read_only: bool = False
    # The user answers /approve or /deny before each call runs (`TurnScope.approvals`).
    approve: bool = False
    # Its effect lives in the turn's memory until the finish (the scratchpad writes): a
    # recorded call is run again when the turn resumes, its recorded result kept.
    reapply: bool = False

    # The JSON schema of the arguments when `arguments` is None.
    parameters: dict[str, Any] | None = None

    def spec(self) -> dict[str, Any]:
        if self.arguments is not None:
            parameters = _without_titles(self.arguments.model_json_schema())
        else:
            parameters = self.parameters or {"type": "object", "properties": {}}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": parameters,
            },
        }

    def validated(self, arguments: dict[str, Any]) -> Any:
        """The arguments the tool runs with (ValidationError: they do not fit)."""
        if self.arguments is None:
            return arguments
        return self.arguments.model_validate(arguments)


class ToolSource(Protocol):
    """Tools whose list can change while the daemon runs (an MCP server's): `version`
    changes whenever `tools()` would answer differently."""

    @property
    def version(self) -> int: ...

    def tools(self) -> list[Tool]: ...


class Sources:
    """Several tool sources as one `ToolSource`: its version changes whenever any of
    theirs does."""

    def __init__(self, sources: Iterable[ToolSource]) -> None:
        self._sources = list(sources)
        self._seen: tuple[int, ...] | None = None
        self._version = 0

    @property
    def version(self) -> int:
        seen = tuple(source.version for source in self._sources)
        if seen != self._seen:
            self._seen, self._version = seen, self._version + 1
        return self._version

    def tools(self) -> list[Tool]:
        return [tool for source in self._sources for tool in source.tools()]


@dataclass(slots=True)
class TurnScope:
    """What a tool may reach in one turn: the asking session, chat (its key) and user,
    and the stores. Every tool reads only within it."""

    store: SessionStore
    recall: Any  # gateway.memory.recall.Recall, or None where the runner has none
    session_key: str
    session_id: str
    source: SessionSource | None
    agent_id: str
    # This turn's scratchpad write (None: unchanged), committed when the turn finishes.
    pad: list[str] | None = field(default=None)
    # gateway.schedules.book.ScheduleBook (the schedule tools), or None where there is none
    schedules: Any = field(default=None)
    # The turn's own first transcript row (its user message): recall leaves out what the
    # turn itself wrote and the session's newest messages before it.
    user_row: int | None = field(default=None)
    # Asks the user before a tool with `approve` runs (gateway.tools.approval); None:
    # no one can answer, and such a call is denied.
    approvals: ApprovalGate | None = field(default=None)
    # A re-run of a turn an earlier process began: its tool-call journal may hold rows.
    resumed: bool = field(default=False)
    # Several replicas: fails a journal write once another replica holds the session.
    fence: Callable[[Any, str], None] | None = field(default=None)
    # The runner's task service (gateway.domain.agent_tasks.AgentTasks): `agent_call`
    # hands native delegations to it and reads the delegation chain from it.
    agent_tasks: Any = field(default=None)
    # The id of the call that runs now (the model's, or a direct call's ordinal): calls
    # of a turn run one at a time, and a tool derives ids that survive a resume from it.
    call_id: str | None = field(default=None)


class Toolbox:
    """An agent's tools and their specs, ready for every turn: the enabled built-ins (a
    fixed list), then what `source` offers now (MCP tools, re-read when it changes)."""

    def __init__(
        self, tools: Iterable[Tool], enabled: Sequence[str], source: ToolSource | None = None
    ) -> None:
        known = {tool.name: tool for tool in tools}
        unknown = [name for name in enabled if name not in known]
        if unknown:  # the config checks names; this is a programming error
            raise ValueError(f"unknown tools: {unknown}")
        self._builtin = {name: known[name] for name in enabled}
        self._source = source
        self._version: int | None = None
        self._refresh()

    def _refresh(self) -> None:
        """Take the source's current list (a no-op while its version is unchanged)."""
        version = self._source.version if self._source is not None else 0
        if version == self._version:
            return
        tools = dict(self._builtin)
        for tool in self._source.tools() if self._source is not None else ():
            tools.setdefault(tool.name, tool)  # a built-in's name is never taken over
        self._tools = tools
        self._specs = [tool.spec() for tool in tools.values()]
        # What the specs weigh in every request that carries them (the context budget
        # counts them): estimated once per list.
        self._spec_tokens = json_tokens(self._specs) if self._specs else 0
        self._version = version

    @property
    def tools(self) -> dict[str, Tool]:
        self._refresh()
        return self._tools

    @property
    def version(self) -> int:
        self._refresh()
        assert self._version is not None
        return self._version

    @property
    def spec_tokens(self) -> int:
        self._refresh()
        return self._spec_tokens

    def specs(self) -> list[dict[str, Any]]:
        self._refresh()
        return [dict(spec) for spec in self._specs]

    def bind(self, scope: TurnScope) -> TurnTools:
        return TurnTools(self, scope)


class TurnTools:
    """One turn's tools (`gateway.agents.protocol.Tools`), journaled: see the module."""

    def __init__(self, box: Toolbox, scope: TurnScope) -> None:
        self._box = box
        self.scope = scope
        # No store or no user row (a scope built outside a turn): nothing is journaled.
        self._journal = (
            CallJournal(
                scope.store,
                scope.session_key,
                scope.session_id,
                scope.user_row,
                resumed=scope.resumed,
                fence=scope.fence,
            )
            if scope.store is not None and scope.user_row is not None
            else None
        )
        self._direct_calls = 0  # ordinal of the next `call`

    def specs(self) -> list[dict[str, Any]]:
        return self._box.specs()

    @property
    def spec_tokens(self) -> int:
        """The estimated tokens of `specs()` as a request carries them."""
        return self._box.spec_tokens

    @property
    def names(self) -> list[str]:
        return list(self._box.tools)

    async def resume(self) -> list[dict[str, Any]]:
        """The tool rounds an earlier run of this turn recorded, completed (see the
        module): recorded results as they were, calls in flight re-run (read-only) or
        answered `INTERRUPTED`, calls never started run now."""
        if self._journal is None:
            return []
        rounds: list[tuple[dict[str, Any], dict[str, Row]]] = []
        for row in await self._journal.recorded():
            if row.kind == ROUND:
                rounds.append((codec.loads(row.payload), {}))
            elif row.kind == CALL and rounds and row.call_id is not None:
                rounds[-1][1][row.call_id] = row
        messages: list[dict[str, Any]] = []
        for message, calls in rounds:
            messages.append(message)
            for call in message["tool_calls"]:
                function = call["function"]
                row = calls.get(call["id"])
                if row is None:
                    result = await self._journaled(
                        CALL, call["id"], function["name"], function["arguments"]
                    )
                else:
                    result = await self._replayed(row)
                messages.append(_tool_message(call, result))
        return messages

    async def run_round(self, content: Any, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One round: the assistant message with its calls (recorded before any of them
        runs), then each call's result, in the model's order."""
        message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
        if self._journal is not None:
            await self._journal.round(message)
        messages = [message]
        for call in calls:
            function = call["function"]
            result = await self._journaled(
                CALL, call["id"], function["name"], function["arguments"]
            )
            messages.append(_tool_message(call, result))
        if self._journal is not None:
            await self._journal.flush()
        return messages

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Run one tool (a custom agent's call), journaled by its ordinal in the turn: a
        resumed turn's n-th call with the same tool and arguments gets its recorded
        result without running."""
        ordinal, self._direct_calls = self._direct_calls, self._direct_calls + 1
        if self._journal is not None:
            await self._journal.recorded()
            row = self._journal.direct(ordinal)
            if row is not None and row.tool == name and row.payload == _as_text(arguments):
                return await self._replayed(row)
        return await self._journaled(DIRECT, str(ordinal), name, arguments)

    def writes(self) -> list[Callable[[Any], object]]:
        """What the turn's finish transaction must write for its tools when it succeeds
        (the scratchpad)."""
        pad, session_id = self.scope.pad, self.scope.session_id
        if pad is None:
            return []
        return [lambda conn: scratchpad.write(conn, session_id, pad)]

    def settles(self) -> list[Callable[[Any], object]]:
        """What the finish transaction must write whatever the turn's outcome: the tool-call
        journal goes ([] when the turn recorded nothing)."""
        forget = self._journal.forget() if self._journal is not None else None
        return [forget] if forget is not None else []

    async def _journaled(self, kind: str, call_id: str, name: str, arguments: Any) -> str:
        """Validate, ask (a tool with `approve`), record as started, run, record the result."""
        tool = self._box.tools.get(name)
        if tool is None:
            return _error(f"no tool named {name!r}; the tools are: {', '.join(self.names)}")
        try:
            decoded = _decoded(arguments)
            args = tool.validated(decoded)
        except (ValueError, ValidationError) as exc:
            return _error(f"{name}: bad arguments: {_reason(exc)}")
        journal, text = self._journal, _as_text(arguments)
        if tool.approve:
            verdict = await self._ask(name, decoded)
            if verdict is not Verdict.APPROVED:
                refused = _error(REFUSALS[verdict])
                if journal is not None:
                    await journal.settled(kind, call_id, name, text, refused)
                return refused
        seq = await journal.start(kind, call_id, name, text) if journal is not None else None
        self.scope.call_id = call_id
        result = await self._run(tool, args)
        if journal is not None and seq is not None:
            await journal.finish(seq, result)
        return result

    async def _replayed(self, row: Row) -> str:
        """A call an earlier run recorded: its result, or (in flight then) a re-run of a
        read-only tool or `INTERRUPTED`, recorded now."""
        tool = self._box.tools.get(row.tool or "")
        if row.result is not None:
            if tool is not None and tool.reapply:
                # Its effect was the crashed run's memory: applied again, not recorded again.
                await self._rerun(tool, row.payload)
            return row.result
        if tool is not None and tool.read_only:
            self.scope.call_id = row.call_id
            result = await self._rerun(tool, row.payload)
        else:
            result = _error(INTERRUPTED)
        assert self._journal is not None
        await self._journal.finish(row.seq, result)
        return result

    async def _rerun(self, tool: Tool, arguments: str) -> str:
        try:
            args = tool.validated(_decoded(arguments))
        except (ValueError, ValidationError) as exc:  # recorded by an older version
            return _error(f"{tool.name}: bad arguments: {_reason(exc)}")
        return await self._run(tool, args)

    async def _ask(self, name: str, arguments: dict[str, Any]) -> Verdict:
        gate = self.scope.approvals
        if gate is None:
            return Verdict.DENIED
        return await gate.ask(
            ApprovalRequest(self.scope.session_key, self.scope.source, name, arguments)
        )

    async def _run(self, tool: Tool, args: BaseModel) -> str:
        """The tool's answer as text; its failures are results too."""
        started = time.monotonic()
        try:
            result = await tool.run(self.scope, args)
        except ValueError as exc:  # the tool found an argument it cannot use
            outcome, text = "refused", _error(f"{tool.name}: {exc}")
        except Exception as exc:
            log.exception("tool_failed", tool=tool.name)
            outcome = "failed"
            text = _error(f"{tool.name} failed ({type(exc).__name__}); the error was logged")
        else:
            outcome = "ok"
            if isinstance(result, ToolText):
                text = str(result)
            else:
                text = json.dumps(result, ensure_ascii=False, default=str)
        log.info(
            "tool_call",
            tool=tool.name,
            outcome=outcome,
            ms=round(1000 * (time.monotonic() - started)),
        )
        return text


def agent_id_of(session_key: str) -> str:
    """The agent id of an ``agent:{id}:...`` session key (notes are per agent)."""
    prefix, _, rest = session_key.partition(":")
    agent_id = rest.partition(":")[0]
    if prefix != "agent" or not agent_id:
        raise ValueError(f"not an agent session key: {session_key!r}")
    return agent_id


def _tool_message(call: dict[str, Any], result: str) -> dict[str, Any]:
    return {
        "role": "tool",
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
        "content": result,
    }


def _as_text(arguments: str | dict[str, Any]) -> str:
    """A call's arguments as recorded: the model's text as sent, a dict as sorted JSON."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True, default=str)


def _decoded(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():
        return {}  # some models send "" for a call without arguments
    try:
        decoded = json.loads(arguments)
    except ValueError:
        raise ValueError("the arguments are not valid JSON") from None
    if not isinstance(decoded, dict):
        raise ValueError("the arguments must be a JSON object")
    return decoded


def _reason(exc: ValueError | ValidationError) -> str:
    if not isinstance(exc, ValidationError):
        return str(exc)
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'arguments'}: {error['msg']}"
        for error in exc.errors()
    )


def _error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)


def _without_titles(schema: Any) -> Any:
    """pydantic's schema without its `title` keys (noise in every request's tools)."""
    if isinstance(schema, dict):
        return {
            key: _without_titles(value)
            for key, value in schema.items()
            if not (key == "title" and isinstance(value, str))
        }
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    return schema
