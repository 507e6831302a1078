"""The approval port: how a tool call that needs the user's yes asks for it.

A tool with `Tool.approve` runs only after the user who started the turn (or an admin)
answers `/approve`; `/deny`, or no answer within `mcp.approval_timeout_seconds`, gives
the model an error result instead and the tool never runs. The runner implements the
gate (it sends the question to the chat and takes the answer as a command); the tool
registry only asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from gateway.domain.session import SessionSource


class Verdict(StrEnum):
    APPROVED = "approved"
    DENIED = "denied"
    TIMEOUT = "timeout"


# What the model reads for a call it may not make.
REFUSALS = {
    Verdict.DENIED: "the user denied this call",
    Verdict.TIMEOUT: "the user did not answer",
}


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """One call waiting for its yes: the turn's session and chat (`source`: where the
    question goes and whose answer counts), the tool as the model named it, and the
    call's arguments."""

    session_key: str
    source: SessionSource | None
    tool: str
    arguments: dict[str, Any]


class ApprovalGate(Protocol):
    async def ask(self, request: ApprovalRequest) -> Verdict:
        """Ask the turn's chat whether the call may run; wait for the answer (or the
        timeout). Cancelling the turn cancels the wait."""
        ...
