"""The ``echo`` backend, the zero-config default: its reply shows no model is behind it."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.domain.session import TokenUsage


def _word_count(content: Any) -> int:
    return len(content.split()) if isinstance(content, str) else 0


class EchoAgent:
    """Replies ``echo: <text>``, optionally after ``delay_seconds`` (a stand-in slow model).

    Usage is counted in words so token counters move deterministically.
    """

    def __init__(self, delay_seconds: float = 0.0) -> None:
        self.delay_seconds = delay_seconds

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if self.delay_seconds > 0:
            await asyncio.sleep(self.delay_seconds)
        reply = f"echo: {request.text}"
        input_tokens = _word_count(request.text) + sum(
            _word_count(message.get("content")) for message in request.history
        )
        return TurnResult(reply, TokenUsage(input_tokens, _word_count(reply)))

    async def close(self) -> None:
        return None
