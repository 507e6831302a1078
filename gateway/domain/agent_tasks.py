"""Agent tasks: one message to one agent and the turn that answers it, as the A2A
protocol sees it (docs/a2a.md). The A2A server (`gateway.a2a`) and the `agent_call`
tool's native delegation both reach the runner through `AgentTasks`; the runner's
implementation keeps tasks durable in the store.

A task is one turn of the session its context names (platform `a2a`, the context as the
chat, the agent from the request): the same queue, reset policy, memory, tools, crash
recovery and delivery ledger as every platform. A resent `message_id` (per agent and
caller) is the same task, never a second turn.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol

__all__ = ["AgentTasks", "TaskRecord", "TaskRefused", "TaskState", "TaskUpdate"]


class TaskState(StrEnum):
    """A task's state, named as A2A names them (`TASK_STATE_*` in 1.0, these in 0.3)."""

    SUBMITTED = "submitted"  # accepted, its turn not begun
    WORKING = "working"  # its turn runs
    INPUT_REQUIRED = "input-required"  # its turn waits for the user (a tool approval)
    COMPLETED = "completed"  # its turn answered: `result_text`
    CANCELED = "canceled"  # /stop or CancelTask
    FAILED = "failed"  # its turn failed: `error`
    REJECTED = "rejected"  # never run (queue full, the gateway stopping)

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset(
    {TaskState.COMPLETED, TaskState.CANCELED, TaskState.FAILED, TaskState.REJECTED}
)


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A task as stored: who asked what of which agent, and where it stands."""

    task_id: str
    agent_id: str
    context_id: str
    message_id: str
    #: who asked: the A2A caller ("bearer" with the HTTP API's token, else "anonymous"),
    #: or "session:<session key>" for a native delegation; tasks are listed per caller
    caller: str
    state: TaskState
    request_text: str
    created_at: datetime
    updated_at: datetime
    #: completed: the turn's reply; input-required: the question the caller answers
    #: with `/approve` or `/deny` (a message to the same context)
    result_text: str | None = None
    error: str | None = None
    #: the delegation chain that led here, outermost agent first (cycle and depth guard)
    chain: tuple[str, ...] = ()
    #: the turn's token counts once it ended, as its model reported them (None: none)
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TaskUpdate:
    """What a task's subscriber sees: the task as it now stands, and with a streamed
    reply the text added since the last update."""

    task: TaskRecord
    delta: str | None = None


class TaskRefused(Exception):
    """The request cannot become a task (unknown agent, bad context, gateway stopping,
    store unavailable); `str()` says why, for the caller. `retry_after` seconds when it
    may work later."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class AgentTasks(Protocol):
    """The runner's task service. Every read is scoped to `caller`: a caller never sees
    another caller's tasks."""

    async def send(
        self,
        agent_id: str,
        text: str,
        *,
        message_id: str,
        caller: str,
        context_id: str | None = None,
        chain: tuple[str, ...] = (),
    ) -> TaskRecord:
        """Accept a message as a task (or return the task a resent `message_id` already
        is). No `context_id`: a new context. Raises TaskRefused."""
        ...

    async def get(self, task_id: str, caller: str) -> TaskRecord | None: ...

    async def list(
        self,
        caller: str,
        *,
        agent_id: str | None = None,
        context_id: str | None = None,
        state: TaskState | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> list[TaskRecord]:
        """The caller's tasks, newest first; `after`: the last task id of the page before."""
        ...

    async def cancel(self, task_id: str, caller: str) -> TaskRecord | None:
        """Cancel the task's turn as /stop does (and whatever it delegated). A finished
        task is returned as it is. None: no such task of this caller."""
        ...

    def subscribe(self, task_id: str, caller: str) -> AsyncIterator[TaskUpdate]:
        """The task now, then each change and streamed text until it is terminal (a
        terminal task: one update). Joining late, or again after a reconnect, starts
        from the task as it stands."""
        ...

    async def running_chain(self, session_key: str) -> tuple[str, ...]:
        """The delegation chain of the task whose turn runs in `session_key`, ending with
        that task's agent; () when no task runs there (a chat platform's session). What
        `agent_call` extends and checks for depth and cycles."""
        ...

    async def wait(self, task_id: str, caller: str) -> TaskRecord | None:
        """The task once terminal (bound it with `asyncio.timeout`)."""
        ...
