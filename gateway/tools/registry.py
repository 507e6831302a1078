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
writes); a turn re-run after a crash may save them again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError

from gateway.context.tokens import json_tokens
from gateway.domain.session import SessionSource
from gateway.store import scratchpad
from gateway.store.session_store import SessionStore
from gateway.tools.approval import REFUSALS, ApprovalGate, ApprovalRequest, Verdict

log = structlog.get_logger("gateway.tools")

ToolFunction = Callable[["TurnScope", Any], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    arguments: type[BaseModel]  # validates a call; its JSON schema is the spec's parameters
    run: ToolFunction
    # Safe to run again after a crash (it only reads, or its effect is the turn's own
    # until the turn finishes): a call in flight at a crash is run again only then.
    read_only: bool = False
    # The user answers /approve or /deny before each call runs (`TurnScope.approvals`).
    approve: bool = False

    def spec(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": _without_titles(self.arguments.model_json_schema()),
            },
        }


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


class Toolbox:
    """The enabled tools (built once) and their specs, ready for every turn."""

    def __init__(self, tools: Iterable[Tool], enabled: Sequence[str]) -> None:
        known = {tool.name: tool for tool in tools}
        unknown = [name for name in enabled if name not in known]
        if unknown:  # the config checks names; this is a programming error
            raise ValueError(f"unknown tools: {unknown}")
        self.tools = {name: known[name] for name in enabled}
        self._specs = [tool.spec() for tool in self.tools.values()]
        # What the specs weigh in every request that carries them (the context budget
        # counts them): estimated once, the list never changes.
        self.spec_tokens = json_tokens(self._specs) if self._specs else 0

    def specs(self) -> list[dict[str, Any]]:
        return [dict(spec) for spec in self._specs]

    def bind(self, scope: TurnScope) -> TurnTools:
        return TurnTools(self, scope)


class TurnTools:
    """One turn's tools (`gateway.agents.protocol.Tools`)."""

    def __init__(self, box: Toolbox, scope: TurnScope) -> None:
        self._box = box
        self.scope = scope

    def specs(self) -> list[dict[str, Any]]:
        return self._box.specs()

    @property
    def spec_tokens(self) -> int:
        """The estimated tokens of `specs()` as a request carries them."""
        return self._box.spec_tokens

    @property
    def names(self) -> list[str]:
        return list(self._box.tools)

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        tool = self._box.tools.get(name)
        if tool is None:
            return _error(f"no tool named {name!r}; the tools are: {', '.join(self.names)}")
        try:
            decoded = _decoded(arguments)
            args = tool.arguments.model_validate(decoded)
        except (ValueError, ValidationError) as exc:
            return _error(f"{name}: bad arguments: {_reason(exc)}")
        if tool.approve:
            verdict = await self._approval(name, decoded)
            if verdict is not Verdict.APPROVED:
                return _error(REFUSALS[verdict])
        started = time.monotonic()
        try:
            result = await tool.run(self.scope, args)
        except ValueError as exc:  # the tool found an argument it cannot use
            outcome, text = "refused", _error(f"{name}: {exc}")
        except Exception as exc:
            log.exception("tool_failed", tool=name)
            outcome = "failed"
            text = _error(f"{name} failed ({type(exc).__name__}); the error was logged")
        else:
            outcome, text = "ok", json.dumps(result, ensure_ascii=False, default=str)
        log.info(
            "tool_call", tool=name, outcome=outcome, ms=round(1000 * (time.monotonic() - started))
        )
        return text

    async def _approval(self, name: str, arguments: dict[str, Any]) -> Verdict:
        gate, scope = self.scope.approvals, self.scope
        if gate is None:
            return Verdict.DENIED
        return await gate.ask(ApprovalRequest(scope.session_key, scope.source, name, arguments))

    def writes(self) -> list[Callable[[Any], object]]:
        """What the turn's finish transaction must write for its tools (the scratchpad)."""
        pad, session_id = self.scope.pad, self.scope.session_id
        if pad is None:
            return []
        return [lambda conn: scratchpad.write(conn, session_id, pad)]


def agent_id_of(session_key: str) -> str:
    """The agent id of an ``agent:{id}:...`` session key (notes are per agent)."""
    prefix, _, rest = session_key.partition(":")
    agent_id = rest.partition(":")[0]
    if prefix != "agent" or not agent_id:
        raise ValueError(f"not an agent session key: {session_key!r}")
    return agent_id


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
