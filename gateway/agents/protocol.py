"""The agent protocol: what the runner asks of an agent (one turn) and what it gets back.

An agent is any object with ``async run_turn(TurnRequest) -> TurnResult`` and
``async close()``; cancelling the task that awaits ``run_turn`` stops the turn. A failure
the user may read about is an `AgentError`. An agent backed by a model may also offer
``async summarize(SummaryRequest) -> str`` (`Summarizing`): the rolling summaries of the
summary context strategy are then written by that model, else extracted without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.session import SessionSource, TokenUsage

__all__ = [
    "Agent",
    "AgentError",
    "AgentFactory",
    "Summarizing",
    "SummaryRequest",
    "TurnRequest",
    "TurnResult",
]


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn for an agent: the user's text plus what came before it."""

    session_key: str
    session_id: str
    text: str  # this turn's user message ([sender]-prefixed in shared sessions)
    history: tuple[dict[str, Any], ...]  # earlier transcript messages, oldest first
    system_prompt: str  # session-context block (+ configured system prompt); may be ""
    source: SessionSource | None = None


@dataclass(frozen=True, slots=True)
class TurnResult:
    text: str
    usage: TokenUsage = field(default_factory=TokenUsage)


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """Condense `messages` (oldest first) into the session's summary so far."""

    session_key: str
    session_id: str
    previous: str | None  # the rolling summary the messages follow, if any
    messages: tuple[dict[str, Any], ...]
    max_chars: int  # the answer is cut to this
    focus: str | None = None  # /compress FOCUS: what the summary should keep


class Summarizing(Protocol):
    async def summarize(self, request: SummaryRequest) -> str: ...


class Agent(Protocol):
    async def run_turn(self, request: TurnRequest) -> TurnResult: ...

    async def close(self) -> None: ...


class AgentError(RuntimeError):
    """The backend failed; ``str()`` is a short, user-safe reason (never a key or token)."""


AgentFactory = Callable[[str], Agent]
