"""Streamed replies: the reply shown in the chat while the model writes it.

    agent --on_text(text so far)--> Stream.update --(its pump task)--> send_draft / edit
    turn end: Stream.finish() -> the final reply is recorded with the stream's message
    ids (`TurnLog.finish(edits=...)`) -> `Delivery` edits them to the final text

One send-or-edit slot per chat (`ChatSlots`), taken by a stream's sends and edits and by
the chat's other replies while the stream lives: at most one call per `edit_interval`
seconds. An interim edit waits for `streaming.min_chars` new characters, is skipped
while a flood wait (429 `retry_after`) lasts, and stops for the turn after
`streaming.max_floods` of them; the pump is a task of its own, so the turn never sleeps
for a wait it could skip. The final text is never skipped (see `Delivery`).

The first message's platform id is saved in the `streams` table as soon as it is sent,
so a turn re-run after a crash edits that message instead of sending a second reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from adapters.base import FloodWait, PlatformAdapter
from config import GatewayConfig
from gateway.domain.session import Platform, SessionSource

log = structlog.get_logger("gateway.streaming")


@dataclass(slots=True)
class ChatSlot:
    """One chat's send-or-edit slot: who holds it, and when the next call may go."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_at: float = 0.0  # time.monotonic() before which no call goes out
    flood_until: float = 0.0  # the platform's last retry_after ends then
    users: int = 0

    async def wait_turn(self) -> None:
        """Sleep until the interval since the last call has passed (held lock)."""
        delay = self.next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


class ChatSlots:
    """The slots of the chats that have a streamed reply right now (none otherwise, so a
    reply to any other chat costs one dict lookup)."""

    def __init__(self) -> None:
        self._slots: dict[tuple[Platform, str], ChatSlot] = {}

    def get(self, target: SessionSource) -> ChatSlot | None:
        return self._slots.get((target.platform, target.chat_id)) if self._slots else None

    def hold(self, target: SessionSource) -> ChatSlot:
        slot = self._slots.setdefault((target.platform, target.chat_id), ChatSlot())
        slot.users += 1
        return slot

    def release(self, target: SessionSource, slot: ChatSlot) -> None:
        slot.users -= 1
        if slot.users <= 0:
            self._slots.pop((target.platform, target.chat_id), None)


class Stream:
    """One turn's streamed reply to one chat."""

    def __init__(
        self,
        adapter: PlatformAdapter,
        target: SessionSource,
        reply_to: str | None,
        slots: ChatSlots,
        *,
        interval: float,
        min_chars: int,
        max_floods: int,
        save: Callable[[Sequence[str]], object],
        message_ids: Sequence[str] = (),
    ) -> None:
        self.adapter = adapter
        self.target = target
        self.reply_to = reply_to
        self._slots = slots
        #: the chat's slot, held from the first text on (a turn whose agent does not
        #: stream never takes it, and its reply goes out as any other)
        self.slot: ChatSlot | None = None
        self.interval = interval
        self.min_chars = min_chars
        self.max_floods = max_floods
        self._save = save
        #: the platform messages the reply is shown in (a re-run turn starts with those
        #: its interrupted run sent), and the text each shows (None: not known)
        self.message_ids: list[str] = list(message_ids)
        self._shown: list[str | None] = [None] * len(self.message_ids)
        self._shown_chars = 0
        self.text = ""
        self.text_pushed = ""  # "push" platforms: what listeners were given
        self.edits = 0
        self.floods = 0
        self._changed = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._push = adapter.stream_mode == "push"

    # --- the agent's side -------------------------------------------------------------------

    def update(self, text: str) -> None:
        """The reply so far (called by the agent as it writes; a new tool round may start
        over). Returns at once: the pump shows it when the slot allows."""
        self.text = text
        if self._task is None and not self._closing.is_set():
            self.slot = self._slots.hold(self.target)
            self._task = asyncio.create_task(self._pump(self.slot))
        self._changed.set()

    # --- the pump ---------------------------------------------------------------------------

    async def _pump(self, slot: ChatSlot) -> None:
        try:
            while not self._closing.is_set() and self.floods < self.max_floods:
                await self._changed.wait()
                self._changed.clear()
                if abs(len(self.text) - self._shown_chars) < self.min_chars:
                    continue  # wait for more text: fewer edits, no flicker
                # The interval since the chat's last call, and any flood wait: skipped
                # time, not slept by the turn (it ends this pump early through `finish`).
                delay = max(slot.next_at, slot.flood_until) - time.monotonic()
                if delay > 0 and await self._closed_within(delay):
                    return
                async with slot.lock:
                    if self._closing.is_set():
                        return
                    await self._show_now(slot)
                self._changed.set()  # text that came meanwhile is looked at next
        except Exception as exc:  # interim text is cosmetic: the final goes out anyway
            log.warning("stream_update_failed", error=f"{type(exc).__name__}: {exc}")

    async def _closed_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()
        return self._closing.is_set()

    async def _show_now(self, slot: ChatSlot) -> None:
        text = self.text
        try:
            if self._push:
                await self._push_text(text)
            else:
                await self._edit_in_place(text)
        except FloodWait as exc:
            self.floods += 1
            slot.flood_until = time.monotonic() + exc.retry_after
            log.info("stream_flood_wait", retry_after=exc.retry_after, floods=self.floods)
        finally:
            slot.next_at = time.monotonic() + self.interval

    async def _push_text(self, text: str) -> None:
        shown = self.text_pushed
        if text.startswith(shown) and len(text) > len(shown):
            await self.adapter.push_delta(self.target, text[len(shown) :])
            self.text_pushed = text
            self._shown_chars = len(text)

    async def _edit_in_place(self, text: str) -> None:
        """Show `text` in the stream's messages: edit those whose part changed, send a
        new one when the text rolled past the platform's length limit."""
        chunks = self.adapter.split(text) if text.strip() else []
        for index, chunk in enumerate(chunks):
            if index < len(self.message_ids):
                if self._shown[index] == chunk:
                    continue  # identical text is never sent again
                await self.adapter.edit(self.target, self.message_ids[index], chunk)
                self._shown[index] = chunk
                self.edits += 1
            else:
                reply_to = self.reply_to if index == 0 else None
                sent = await self.adapter.send_draft(self.target, chunk, reply_to)
                if sent.message_id is None:
                    return
                self.message_ids.append(sent.message_id)
                self._shown.append(chunk)
                self._save(list(self.message_ids))
        self._shown_chars = len(text)

    # --- the turn's end ---------------------------------------------------------------------

    async def finish(self) -> list[str]:
        """Stop interim updates (a call in flight completes: a first message being sent
        must have its id saved) and return the messages the final reply edits."""
        self._closing.set()
        self._changed.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        return list(self.message_ids)

    def close(self) -> None:
        """The turn is over (delivered, failed or cancelled): stop at once, free the slot."""
        self._closing.set()
        if self._task is not None:
            self._task.cancel()
        if self.slot is not None:
            self._slots.release(self.target, self.slot)
            self.slot = None


class Streams:
    """Opens each turn's `Stream`, when its platform streams and someone would see it."""

    def __init__(
        self,
        adapters: dict[Platform, PlatformAdapter],
        config: GatewayConfig,
        save: Callable[[str, Sequence[str]], object],
    ) -> None:
        self.adapters = adapters
        self.config = config.streaming
        self._platforms = config.platforms
        self._save = save
        self.slots = ChatSlots()

    def open(
        self,
        session_key: str,
        target: SessionSource,
        reply_to: str | None,
        message_ids: Sequence[str] = (),
    ) -> Stream | None:
        adapter = self.adapters.get(target.platform)
        if adapter is None or not adapter.can_stream(target):
            return None
        # Agent tasks stream to A2A callers on the HTTP API's port, at its pace.
        name = "http" if target.platform is Platform.A2A else target.platform.value
        platform_config = getattr(self._platforms, name, None)
        interval = float(getattr(platform_config, "edit_interval", 1.0))
        return Stream(
            adapter,
            target,
            reply_to,
            self.slots,
            interval=interval,
            min_chars=self.config.min_chars,
            max_floods=self.config.max_floods,
            save=lambda ids: self._save(session_key, ids),
            message_ids=message_ids,
        )
