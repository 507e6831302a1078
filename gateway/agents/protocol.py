"""The agent protocol: what the runner asks of an agent (one turn) and what it gets back.

An agent is any object with ``async run_turn(TurnRequest) -> TurnResult`` and
``async close()``; cancelling the task that awaits ``run_turn`` stops the turn. A failure
the user may read about is an `AgentError`. An agent backed by a model may also offer
``async summarize(SummaryRequest) -> str`` (`Summarizing`): the rolling summaries of the
summary context strategy are then written by that model, else extracted without one.

Streaming: an agent may also offer
``async stream_turn(TurnRequest, on_text) -> TurnResult`` (`Streaming`), calling
``on_text(text)`` with its reply so far as the model writes it (a new tool round starts
over from ""); the runner uses it when the reply's chat shows streamed text. The result
is the same as `run_turn`'s, and only it is stored. An agent without it answers in one
piece through `run_turn`.

Tools: a turn may carry `TurnRequest.tools` (`Tools`, None when the agent has none):
``tools.specs()`` lists them in OpenAI's function-calling format and
``await tools.call(name, arguments)`` runs one, returning its result as text (JSON); a
bad argument or a failing tool is a result too (``{"error": ...}``), never an
exception. Calls run at most once across crashes: a model-driven agent starts with
``await tools.resume()`` (the rounds an interrupted earlier run of the turn recorded)
and runs each round through ``await tools.run_round(content, calls)``. An agent that
calls tools returns the messages of its tool rounds in `TurnResult.messages` (assistant
messages with ``tool_calls``, then one ``tool`` message per call with its
``tool_call_id``, oldest first): the turn stores them before its reply, in the same
transaction.

Media: a turn may carry `TurnRequest.images` (photos the user sent, for a model that
sees: `agent.vision`); voice transcripts and text documents are already in `text`. A
reply may carry `TurnResult.attachments` (`Attachment`: a file path or URL, its kind
photo/document/voice, a caption), sent after its text through the delivery ledger.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.domain.attachments import Attachment
from gateway.domain.session import SessionSource, TokenUsage

__all__ = [
    "Agent",
    "AgentError",
    "AgentFactory",
    "Attachment",
    "ImageInput",
    "Streaming",
    "Summarizing",
    "SummaryRequest",
    "Tools",
    "TurnRequest",
    "TurnResult",
    "check_attachments",
    "check_tool_rounds",
]


@dataclass(frozen=True, slots=True)
class ImageInput:
    """A photo the user sent, stored at `path` (for the model as an image part)."""

    path: str
    mime: str = "image/jpeg"


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn for an agent: the user's text plus what came before it."""

    session_key: str
    session_id: str
    text: str  # this turn's user message ([sender]-prefixed in shared sessions)
    history: tuple[dict[str, Any], ...]  # earlier transcript messages, oldest first
    system_prompt: str  # session-context block (+ configured system prompt); may be ""
    source: SessionSource | None = None
    tools: Tools | None = None  # the tools this turn may call (None: none)
    images: tuple[ImageInput, ...] = ()  # photos sent with `text` (agent.vision only)


@dataclass(frozen=True, slots=True)
class TurnResult:
    text: str
    usage: TokenUsage = field(default_factory=TokenUsage)
    # The tool rounds before the reply (see the module's doc), stored before `text`.
    messages: tuple[dict[str, Any], ...] = ()
    # Files sent after the reply's text, each once (recorded in the delivery ledger).
    attachments: tuple[Attachment, ...] = ()


class Tools(Protocol):
    """The tools of one turn, bound to its session and user."""

    def specs(self) -> list[dict[str, Any]]:
        """``[{"type": "function", "function": {name, description, parameters}}, ...]``"""
        ...

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        """Run one tool; `arguments` as JSON text (what a model sends) or a dict. On a
        resumed turn, the n-th call with the same tool and arguments as the n-th call
        of the earlier run returns that run's recorded result without running."""
        ...

    async def resume(self) -> list[dict[str, Any]]:
        """The tool rounds an earlier run of this turn recorded before a crash, completed
        (the messages `run_round` returned, oldest first; [] for a fresh turn)."""
        ...

    async def run_round(self, content: Any, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run one round of tool calls, recorded so a resumed turn replays it: the
        assistant message (`content` and `calls`), then one ``tool`` message per call."""
        ...


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


class Streaming(Protocol):
    async def stream_turn(
        self, request: TurnRequest, on_text: Callable[[str], None]
    ) -> TurnResult: ...


class Agent(Protocol):
    async def run_turn(self, request: TurnRequest) -> TurnResult: ...

    async def close(self) -> None: ...


class AgentError(RuntimeError):
    """The backend failed; ``str()`` is a short, user-safe reason (never a key or token)."""


AgentFactory = Callable[[str], Agent]


def check_tool_rounds(messages: tuple[dict[str, Any], ...]) -> None:
    """`TurnResult.messages` as the transcript may keep them: rounds of one assistant
    message with ``tool_calls`` (each with an id and a function name) followed by exactly
    one ``tool`` result per call (by ``tool_call_id``, its content text). Anything else
    would break every later request to a chat API (a call without its result, a result
    without its call): an `AgentError`."""
    pending: set[str] = set()
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant" and not pending and "content" in message:
            ids = _call_ids(message.get("tool_calls"))
            if not ids or len(set(ids)) != len(ids):
                break
            pending = set(ids)
        elif (
            role == "tool"
            and message.get("tool_call_id") in pending
            and isinstance(message.get("content"), str)  # what every later request sends
        ):
            pending.discard(message["tool_call_id"])
        else:
            break
    else:
        if not pending:
            return
    raise AgentError(
        "the agent returned tool rounds the transcript cannot keep (each assistant message"
        " with tool_calls must be followed by one tool result per call)"
    )


def check_attachments(attachments: Any) -> None:
    """`TurnResult.attachments` as the ledger can keep them: `Attachment`s (an agent's
    mistake is an `AgentError`, the user told the turn failed, not a crashed turn)."""
    if not all(isinstance(a, Attachment) for a in attachments):
        raise AgentError("the agent returned attachments that are not Attachment objects")


def _call_ids(calls: Any) -> list[str]:
    """The ids of well-formed calls; [] when any call is not."""
    if not isinstance(calls, list):
        return []
    ids = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        call_id = call.get("id") if isinstance(call, dict) else None
        if not (isinstance(call_id, str) and call_id and isinstance(function, dict)):
            return []
        if not isinstance(function.get("name"), str):
            return []
        ids.append(call_id)
    return ids
