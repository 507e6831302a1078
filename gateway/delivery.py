"""Replies out: typing indicators, and reply chunks sent through the delivery ledger.

A reply is split as its platform takes it, recorded (the turn's last transaction, or
`deliver` for a reply that answers no turn), then sent chunk by chunk, in order; each is
marked sent once the platform acknowledged it. A chunk that fails stays pending with
the rest behind it, and `resend_pending` (the next start, housekeeping passes) sends it:
a restart never sends what was acknowledged again. A reply's attachments (files) are
rows of the same ledger, sent after its text (`send_attachments`) with the same
guarantee: each once.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from adapters.base import Attachment, PlatformAdapter
from gateway.faults import crash_point
from gateway.ops.metrics import Metrics
from gateway.session import Platform, SessionSource
from gateway.store.turnlog import TurnLog

log = structlog.get_logger("gateway.delivery")

TYPING_REFRESH_SECONDS = 4.0


class Delivery:
    """What the runner sends to the platforms, through its (shared, growing) adapters."""

    def __init__(
        self, adapters: dict[Platform, PlatformAdapter], turnlog: TurnLog, metrics: Metrics
    ) -> None:
        self.adapters = adapters
        self.turnlog = turnlog
        self.metrics = metrics
        self._sending: set[int] = set()  # delivery ids being sent right now

    def start_typing(self, source: SessionSource) -> asyncio.Task[None] | None:
        """Keep a typing indicator up while the agent works, on platforms that have one
        (no task per turn for those that do not, such as the HTTP API)."""
        adapter = self.adapters.get(source.platform)
        if adapter is None or type(adapter).send_typing is PlatformAdapter.send_typing:
            return None
        return asyncio.create_task(self._keep_typing(adapter, source))

    async def _keep_typing(self, adapter: PlatformAdapter, source: SessionSource) -> None:
        with contextlib.suppress(Exception):  # typing is cosmetic; never fail a turn on it
            while True:
                await adapter.send_typing(source)
                await asyncio.sleep(TYPING_REFRESH_SECONDS)

    def split(self, target: SessionSource, text: str) -> list[str]:
        """`text` in chunks as the target's platform takes them."""
        adapter = self.adapters.get(target.platform)
        return adapter.split(text) if adapter is not None else [text]

    async def deliver(self, target: SessionSource, text: str, reply_to: str | None = None) -> int:
        """Record a reply that answers no turn (commands, notices) and send it; with
        `reply_to`, as an answer to that platform message."""
        chunks = self.split(target, text)
        ids = await self.turnlog.record_reply(target, chunks, None, reply_to=reply_to)
        return await self.send_recorded(target, list(zip(ids, chunks, strict=True)), reply_to)

    async def send_recorded(
        self, target: SessionSource, chunks: list[tuple[int, str]], reply_to: str | None
    ) -> int:
        """Send recorded chunks in order, marking each once the platform acknowledged it.

        A chunk that fails stays pending in the ledger (and the rest with it, to keep the
        order); the next start or housekeeping pass sends it.
        """
        adapter = self.adapters.get(target.platform)
        if adapter is None:
            log.warning("no_adapter_for_reply", platform=target.platform.value)
            return 0
        # Claimed before the first await, so a housekeeping re-send never doubles them; a
        # sent chunk stays claimed until its ledger mark is committed.
        chunks = [(i, text) for i, text in chunks if i not in self._sending]
        self._sending.update(i for i, _ in chunks)
        sent = 0
        try:
            for delivery_id, chunk in chunks:
                try:
                    result = await adapter.send(target, chunk, reply_to, delivery_id=delivery_id)
                except Exception as exc:
                    self.metrics.send_errors_total += 1
                    log.error("send_failed", platform=target.platform.value, error=str(exc))
                    break
                crash_point("before_ledger_mark")
                self.turnlog.mark_sent_later(
                    delivery_id,
                    result.message_id,
                    lambda _, i=delivery_id: self._sending.discard(i),
                )
                sent += 1
                self.metrics.replies_sent_total += 1
        finally:
            self._sending.difference_update(i for i, _ in chunks[sent:])
        return sent

    async def send_attachments(
        self, target: SessionSource, attachments: list[tuple[int, Attachment]], reply_to: str | None
    ) -> int:
        """Send recorded attachments in order, each marked once the platform took it; the
        first that fails stays pending (with the rest) for the next pass."""
        adapter = self.adapters.get(target.platform)
        if adapter is None:
            log.warning("no_adapter_for_reply", platform=target.platform.value)
            return 0
        attachments = [(i, a) for i, a in attachments if i not in self._sending]
        self._sending.update(i for i, _ in attachments)
        sent = 0
        try:
            for delivery_id, attachment in attachments:
                try:
                    result = await adapter.send_attachment(
                        target, attachment, reply_to, delivery_id=delivery_id
                    )
                except Exception as exc:
                    self.metrics.send_errors_total += 1
                    log.error(
                        "attachment_send_failed",
                        platform=target.platform.value,
                        kind=attachment.kind,
                        error=str(exc)[:300],
                    )
                    break
                crash_point("before_ledger_mark")
                self.turnlog.mark_sent_later(
                    delivery_id,
                    result.message_id,
                    lambda _, i=delivery_id: self._sending.discard(i),
                )
                sent += 1
        finally:
            self._sending.difference_update(i for i, _ in attachments[sent:])
        return sent

    async def resend_pending(self, min_age_seconds: float = 0) -> int:
        """Send recorded chunks that were never acknowledged (after a crash, or refused by
        the platform), once each. Periodic passes only take chunks older than
        `min_age_seconds`, leaving fresh ones to the turn that is sending them."""
        sent = 0
        for row in await self.turnlog.pending_outbound(min_age_seconds):
            if row.get("attachment") is not None:
                attachment = Attachment.from_dict(row["attachment"])
                sent += await self.send_attachments(
                    row["target"], [(row["id"], attachment)], row["reply_to"]
                )
                continue
            sent += await self.send_recorded(
                row["target"], [(row["id"], row["text"])], row["reply_to"]
            )
        if sent:
            log.info("pending_replies_sent", count=sent)
        return sent
