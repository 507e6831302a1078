"""The delivery of recorded reply chunks (gateway.runner.delivery), on a real SQLite store, with
a platform stand-in that records what it was asked to send or edit."""

from __future__ import annotations

import time
from pathlib import Path

from structlog.testing import capture_logs

from adapters.base import PlatformAdapter, SendResult
from config import GatewayConfig
from gateway.ops.metrics import Metrics
from gateway.runner.delivery import Delivery
from gateway.session import Platform, SessionSource
from gateway.store import journal
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
KEY = "agent:main:local:dm:c1"


class EditingPlatform(PlatformAdapter):
    """Sends and edits, each recorded in order."""

    platform = Platform.LOCAL

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, ...]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, target, text, reply_to=None, *, delivery_id=None) -> SendResult:
        self.calls.append(("send", text))
        return SendResult(f"new-{delivery_id}")

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        self.calls.append(("edit", message_id, text))

    async def delete(self, target: SessionSource, message_id: str) -> None:
        self.calls.append(("delete", message_id))


async def test_a_streamed_chunk_edits_its_own_message_when_an_earlier_one_is_in_flight(
    tmp_path: Path,
) -> None:
    """A streamed reply's chunks replace the messages it was shown in, each its own,
    also when a chunk before it is being sent by another pass (and so left out here)."""
    config = GatewayConfig.model_validate({"timezone": "UTC"})
    async with SessionStore(tmp_path, config) as store:
        chunks = ["first part", "second part"]
        ids = await store.write(
            lambda conn: journal.record_outbound(
                conn, SOURCE, chunks, reply_to=None, session_key=KEY, now=time.time()
            )
        )
        platform = EditingPlatform()
        delivery = Delivery({Platform.LOCAL: platform}, TurnLog(store), Metrics())
        delivery._sending.add(ids[0])  # the first chunk: another pass is sending it
        sent = await delivery.send_recorded(
            SOURCE, list(zip(ids, chunks, strict=True)), None, ["m1", "m2"]
        )
        assert sent == 1
        assert platform.calls == [("edit", "m2", "second part")]


async def test_replies_for_a_platform_that_is_not_enabled_are_warned_once_not_per_pass(
    tmp_path: Path,
) -> None:
    """Replies recorded for a platform that is no longer enabled stay pending (enabling
    it again sends them); each housekeeping pass finds them again, and the log says so
    once per platform, not once per row and pass."""
    config = GatewayConfig.model_validate({"timezone": "UTC"})
    telegram = SessionSource(platform=Platform.TELEGRAM, chat_id="55", user_id="u1")
    async with SessionStore(tmp_path, config) as store:
        await store.write(
            lambda conn: journal.record_outbound(
                conn,
                telegram,
                ["one", "two", "three"],
                reply_to=None,
                session_key="agent:main:telegram:dm:55",
                now=time.time(),
            )
        )
        platform = EditingPlatform()
        delivery = Delivery({Platform.LOCAL: platform}, TurnLog(store), Metrics())
        with capture_logs() as logs:
            for _ in range(3):
                assert await delivery.resend_pending() == 0
        warnings = [e for e in logs if e["log_level"] == "warning"]
        assert [(e["event"], e["platform"], e["count"]) for e in warnings] == [
            ("pending_replies_without_adapter", "telegram", 3)
        ]
        assert platform.calls == []
        assert len(await TurnLog(store).pending_outbound(0)) == 3  # kept, not dropped
