"""The platform of agent tasks (`a2a`), in process: where an A2A turn's reply goes.

A task's reply is recorded by its turn's finish transaction (`agent_tasks.settle`), so
the delivery ledger's chunks only need acknowledging here; what the model streams is
handed to the task's subscribers as deltas ("push"). The task is the event's
`source.message_id`, so every call names its task without a look-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.base import PlatformAdapter, SendResult
from gateway.domain.events import MessageEvent
from gateway.domain.session import Platform, SessionSource


class TaskChannel(PlatformAdapter):
    """The in-process adapter of platform `a2a`: callers are authenticated before their
    message becomes a task (the A2A server, a native delegation), so every event is
    authorized; replies are acknowledged, deltas handed to `on_delta(task_id, text)`."""

    platform = Platform.A2A
    # A task's reply is one text: the ledger keeps it whole.
    max_message_length = 1_000_000
    stream_mode = "push"

    def __init__(self, on_delta: Callable[[str, str], None]) -> None:
        super().__init__(None)
        self._on_delta = on_delta

    async def start(self) -> None:
        self.set_state("running")

    async def stop(self) -> None:
        self.set_state("stopped")

    async def authorize(self, event: MessageEvent) -> bool:
        return True

    def can_stream(self, target: SessionSource) -> bool:
        return True

    async def send(
        self, target: SessionSource, text: str, reply_to: str | None = None, **_: Any
    ) -> SendResult:
        return SendResult(message_id=reply_to)

    async def push_delta(self, target: SessionSource, text: str) -> None:
        if target.message_id is not None:
            self._on_delta(target.message_id, text)
