"""Replies out: typing indicators, and reply chunks sent through the delivery ledger.

A reply is split as its platform takes it, recorded (the turn's last transaction, or
`deliver` for a reply that answers no turn), then sent chunk by chunk, in order; each is
marked sent once the platform acknowledged it. A chunk that fails stays pending with
the rest behind it, and `resend_pending` (the next start, housekeeping passes) sends it:
a restart never sends what was acknowledged again.

A streamed reply's chunks carry the platform message they replace: each is
delivered as an edit of it, when the chat's flood wait ends (a wait longer than
`streaming.max_flood_wait` sends it as a new message instead and deletes the partial).

A reply's attachments (files) are rows of the same ledger, sent after its text
(`send_attachments`) with the same guarantee: each once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import structlog

from adapters.base import FloodWait, PlatformAdapter, SendResult
from gateway.domain.attachments import Attachment
from gateway.domain.session import Platform, SessionSource
from gateway.ops.metrics import Metrics
from gateway.runner.streaming import ChatSlot, ChatSlots
from gateway.store.turnlog import TurnLog
from gateway.util.faults import crash_point

#: tries of a final edit that the platform answers with a flood wait
FINAL_EDIT_ATTEMPTS = 3

log = structlog.get_logger("gateway.delivery")

TYPING_REFRESH_SECONDS = 4.0

_Item = TypeVar("_Item")  # what a ledger row sends: a text chunk or an attachment


class Delivery:
    """What the runner sends to the platforms, through its (shared, growing) adapters."""

    def __init__(
        self,
        adapters: dict[Platform, PlatformAdapter],
        turnlog: TurnLog,
        metrics: Metrics,
        slots: ChatSlots | None = None,
        max_flood_wait: float = 45.0,
    ) -> None:
        self.adapters = adapters
        self.turnlog = turnlog
        self.metrics = metrics
        self.slots = slots if slots is not None else ChatSlots()
        self.max_flood_wait = max_flood_wait
        self._sending: set[int] = set()  # delivery ids being sent right now
        self._stranded: dict[Platform, int] = {}  # pending replies per missing platform

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
        self,
        target: SessionSource,
        chunks: list[tuple[int, str]],
        reply_to: str | None,
        edits: Sequence[str | None] = (),
    ) -> int:
        """Send recorded chunks in order, marking each once the platform acknowledged it.

        A chunk that fails stays pending in the ledger (and the rest with it, to keep the
        order); the next start or housekeeping pass sends it. `edits[i]`: the streamed
        message chunk i replaces.
        """
        slot = self.slots.get(target)  # a streamed reply in this chat: take turns with it
        # By delivery id, not position: rows already being sent elsewhere are left out
        # of `chunks` before sending, which would shift every later chunk's target.
        # (`edits` may be shorter: a final split longer than what was streamed.)
        edit_for = {i: edit for (i, _), edit in zip(chunks, edits, strict=False)}

        async def send(
            adapter: PlatformAdapter, _index: int, delivery_id: int, chunk: str
        ) -> SendResult:
            edit_of = edit_for.get(delivery_id)
            if slot is not None or edit_of is not None:
                return await self._send_in_slot(
                    adapter, target, chunk, reply_to, delivery_id, edit_of, slot
                )
            return await adapter.send(target, chunk, reply_to, delivery_id=delivery_id)

        def failed(_chunk: str, exc: Exception) -> None:
            log.error("send_failed", platform=target.platform.value, error=str(exc))

        return await self._send_in_order(target, chunks, send, failed, count_replies=True)

    async def _send_in_order(
        self,
        target: SessionSource,
        items: list[tuple[int, _Item]],
        send: Callable[[PlatformAdapter, int, int, _Item], Awaitable[SendResult]],
        failed: Callable[[_Item, Exception], None],
        count_replies: bool = False,
    ) -> int:
        """Send recorded ledger rows (`(delivery_id, item)`) in order through
        `send(adapter, position, delivery_id, item)`, each marked sent once the platform
        acknowledged it; the first that fails (`failed` logs it) stays pending with the
        rest behind it, to keep the order."""
        adapter = self.adapters.get(target.platform)
        if adapter is None:
            log.warning("no_adapter_for_reply", platform=target.platform.value)
            return 0
        # Claimed before the first await, so a housekeeping re-send never doubles them; a
        # sent row stays claimed until its ledger mark is committed.
        items = [(i, item) for i, item in items if i not in self._sending]
        self._sending.update(i for i, _ in items)
        sent = 0
        try:
            for index, (delivery_id, item) in enumerate(items):
                try:
                    result = await send(adapter, index, delivery_id, item)
                except Exception as exc:
                    self.metrics.send_errors_total += 1
                    failed(item, exc)
                    break
                crash_point("before_ledger_mark")
                self.turnlog.mark_sent_later(
                    delivery_id,
                    result.message_id,
                    lambda _, i=delivery_id: self._sending.discard(i),
                )
                sent += 1
                if count_replies:
                    self.metrics.replies_sent_total += 1
        finally:
            self._sending.difference_update(i for i, _ in items[sent:])
        return sent

    async def _send_in_slot(
        self,
        adapter: PlatformAdapter,
        target: SessionSource,
        chunk: str,
        reply_to: str | None,
        delivery_id: int,
        edit_of: str | None,
        slot: ChatSlot | None,
    ) -> SendResult:
        """One chunk through the chat's slot (after the interval since its last call); an
        edit of a streamed message waits out the chat's flood wait up to
        `max_flood_wait`, past which the chunk goes out as a new message."""
        if slot is None:
            return await self._final(adapter, target, chunk, reply_to, delivery_id, edit_of)
        async with slot.lock:
            await slot.wait_turn()
            try:
                wait = slot.flood_until - time.monotonic()
                edit_of = await self._wait_out(adapter, target, edit_of, wait)
                return await self._final(adapter, target, chunk, reply_to, delivery_id, edit_of)
            finally:
                slot.next_at = time.monotonic() + _interval(adapter)

    async def _final(
        self,
        adapter: PlatformAdapter,
        target: SessionSource,
        chunk: str,
        reply_to: str | None,
        delivery_id: int,
        edit_of: str | None,
    ) -> SendResult:
        for _ in range(FINAL_EDIT_ATTEMPTS):
            if edit_of is None:
                break
            try:
                await adapter.edit(target, edit_of, chunk)
                return SendResult(message_id=edit_of)
            except FloodWait as exc:
                edit_of = await self._wait_out(adapter, target, edit_of, exc.retry_after)
            except Exception as exc:
                # Deleted by the user, too old to edit: the final goes out as a new message.
                log.warning("stream_final_edit_failed", error=f"{type(exc).__name__}: {exc}")
                edit_of = await self._drop_partial(adapter, target, edit_of)
        return await adapter.send(target, chunk, reply_to, delivery_id=delivery_id)

    async def _wait_out(
        self, adapter: PlatformAdapter, target: SessionSource, edit_of: str | None, wait: float
    ) -> str | None:
        """A flood wait before the final: slept when within `max_flood_wait`; past it, the
        partial goes and the final is sent as a new message (None: nothing to edit)."""
        if wait > self.max_flood_wait:
            return await self._drop_partial(adapter, target, edit_of)
        if wait > 0:
            await asyncio.sleep(wait)
        return edit_of

    async def _drop_partial(
        self, adapter: PlatformAdapter, target: SessionSource, message_id: str | None
    ) -> None:
        """The final replaces a partial it cannot edit: the partial goes (best effort)."""
        if message_id is not None:
            with contextlib.suppress(Exception):
                await adapter.delete(target, message_id)
        return None

    async def delete_extra(self, target: SessionSource, message_ids: Sequence[str]) -> None:
        """Streamed messages the final reply does not need (it split shorter)."""
        adapter = self.adapters.get(target.platform)
        if adapter is not None:
            for message_id in message_ids:
                await self._drop_partial(adapter, target, message_id)

    async def send_attachments(
        self, target: SessionSource, attachments: list[tuple[int, Attachment]], reply_to: str | None
    ) -> int:
        """Send recorded attachments in order, each marked once the platform took it; the
        first that fails stays pending (with the rest) for the next pass."""

        async def send(
            adapter: PlatformAdapter, _index: int, delivery_id: int, attachment: Attachment
        ) -> SendResult:
            return await adapter.send_attachment(
                target, attachment, reply_to, delivery_id=delivery_id
            )

        def failed(attachment: Attachment, exc: Exception) -> None:
            log.error(
                "attachment_send_failed",
                platform=target.platform.value,
                kind=attachment.kind,
                error=str(exc)[:300],
            )

        return await self._send_in_order(target, attachments, send, failed)

    async def resend_pending(self, min_age_seconds: float = 0) -> int:
        """Send recorded chunks that were never acknowledged (after a crash, or refused by
        the platform), once each. Periodic passes only take chunks older than
        `min_age_seconds`, leaving fresh ones to the turn that is sending them."""
        sent = 0
        stranded: dict[Platform, int] = {}
        for row in await self.turnlog.pending_outbound(min_age_seconds):
            platform = row["target"].platform
            if platform not in self.adapters:
                stranded[platform] = stranded.get(platform, 0) + 1
                continue
            if row.get("attachment") is not None:
                attachment = Attachment.from_dict(row["attachment"])
                sent += await self.send_attachments(
                    row["target"], [(row["id"], attachment)], row["reply_to"]
                )
                continue
            sent += await self.send_recorded(
                row["target"],
                [(row["id"], row["text"])],
                row["reply_to"],
                (row["edit_message_id"],),
            )
        if sent:
            log.info("pending_replies_sent", count=sent)
        self._report_stranded(stranded)
        return sent

    def _report_stranded(self, stranded: dict[Platform, int]) -> None:
        """Warn once per platform (and again when its count changes) about replies that
        wait for a platform that is not enabled: every housekeeping pass finds them again,
        and a line per row and pass would flood the log."""
        for platform, count in stranded.items():
            if self._stranded.get(platform) != count:
                log.warning(
                    "pending_replies_without_adapter",
                    platform=platform.value,
                    count=count,
                    hint=f"enable platforms.{platform.value} to send them",
                )
        self._stranded = stranded


def _interval(adapter: PlatformAdapter) -> float:
    return float(getattr(adapter.config, "edit_interval", 0.0) or 0.0)
