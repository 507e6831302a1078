"""Approvals: the runner's `ApprovalGate`. A tool call that needs the user's yes puts
one question to the turn's chat and waits for `/approve` or `/deny` (the commands answer
through `answer`), or for the timeout.

At most one call waits per session: a turn's calls run one at a time, and a session
runs one turn at a time. The wait stops the turn's deadline clock (the limit guards the
agent's work, not the user's answer), and cancelling the turn (/stop, /new, shutdown)
ends the wait with nothing left behind.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.domain.session import Platform
from gateway.runner.deadlines import Deadlines
from gateway.runner.ports import ApprovalObserver, ApprovalSender
from gateway.tools.approval import ApprovalRequest, Verdict

log = structlog.get_logger("gateway.approvals")

# The default of `mcp.approval_timeout_seconds`.
DEFAULT_TIMEOUT_SECONDS = 300.0
# How much of a call's arguments the question shows: enough to judge, short in a chat.
SHOWN_LINES = 6
SHOWN_CHARS = 500


@dataclass(slots=True)
class _Waiting:
    request: ApprovalRequest
    verdict: asyncio.Future[Verdict]


class Approvals:
    """`timeout`: seconds a call waits for its answer (then `Verdict.TIMEOUT`)."""

    def __init__(
        self,
        sender: ApprovalSender,
        deadlines: Deadlines,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        self._sender = sender
        self._deadlines = deadlines
        self.timeout = timeout
        self._waiting: dict[str, _Waiting] = {}
        #: told of the waits of A2A sessions' turns (their tasks are input-required)
        self.observer: ApprovalObserver | None = None

    async def ask(self, request: ApprovalRequest) -> Verdict:
        """Ask the turn's chat; wait for the answer, or `timeout` seconds. Cancelling the
        calling task (the turn) ends the wait."""
        key, source = request.session_key, request.source
        if source is None:  # no chat to ask, so nobody can answer
            log.info("approval_unasked", tool=request.tool, reason="no chat")
            return Verdict.TIMEOUT
        if key in self._waiting:  # a second call at once: not how a turn runs its calls
            log.warning("approval_already_waiting", tool=request.tool)
            return Verdict.DENIED
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self._waiting[key] = waiting
        observer = self.observer if source.platform is Platform.A2A else None
        try:
            with self._deadlines.paused(asyncio.current_task()):
                asked = question(request, self.timeout)
                if observer is not None:
                    observer.approval_waits(source, asked)
                await self._sender.deliver(source, asked)
                try:
                    async with asyncio.timeout(self.timeout):
                        verdict = await waiting.verdict
                except TimeoutError:
                    verdict = Verdict.TIMEOUT
        finally:
            if self._waiting.get(key) is waiting:
                del self._waiting[key]
            waiting.verdict.cancel()  # a no-op once answered
            if observer is not None:
                observer.approval_waits(source, None)
        log.info("approval", tool=request.tool, verdict=verdict.value)
        return verdict

    def waiting(self, key: str) -> ApprovalRequest | None:
        """The call `key`'s turn waits to run (None: nothing waits)."""
        waiting = self._waiting.get(key)
        if waiting is None or waiting.verdict.done():
            return None
        return waiting.request

    def answer(self, key: str, verdict: Verdict) -> bool:
        """Settle `key`'s waiting call; False when nothing waited (any more)."""
        waiting = self._waiting.get(key)
        if waiting is None or waiting.verdict.done():
            return False
        waiting.verdict.set_result(verdict)
        return True

    def waiting_count(self) -> int:
        return len(self._waiting)


def question(request: ApprovalRequest, timeout: float) -> str:
    """The one message a call needing approval sends its chat."""
    source = request.source
    who = (source.user_name or source.user_id) if source is not None else None
    answerer = f"{who} (who asked) or an admin" if who else "the user who asked or an admin"
    return (
        f"The agent wants to run the tool {request.tool} with:\n"
        f"{shown_arguments(request.arguments)}\n"
        f"Send /approve to run it or /deny to refuse ({answerer}; "
        f"without an answer within {_duration(timeout)} it does not run)."
    )


def shown_arguments(arguments: dict[str, Any]) -> str:
    """The arguments as JSON, cut to `SHOWN_LINES` lines and `SHOWN_CHARS` characters,
    saying so when cut."""
    text = json.dumps(arguments, indent=2, ensure_ascii=False, default=str)
    lines = text.splitlines()
    shown = "\n".join(lines[:SHOWN_LINES])[:SHOWN_CHARS]
    if shown == text:
        return text
    return f"{shown}\n… (cut: {len(text) - len(shown):,} more characters)"


def _duration(seconds: float) -> str:
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} seconds"
