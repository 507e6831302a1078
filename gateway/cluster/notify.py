"""LISTEN/NOTIFY: one replica wakes the others when it commits something they wait for
(a reply a long-poll client waits on, a message for a session another replica runs).

`notify(conn, channel, payload)` is sent inside the writer's transaction and delivered
when it commits, never before. `Listener` holds one connection that LISTENs on every
registered channel and hands each payload to that channel's callbacks. A notification
sent while the listener was disconnected is lost: after every reconnection it calls
`on_reconnect()`, for its owner to re-read what it may have missed from the tables.

Channels are per database, not per schema: a channel's name on the server is scoped to
the store's schema (gateway.util.pg_scope), so stores in two schemas of one database do
not hear each other.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import structlog
from psycopg import sql

from gateway.cluster._support import (
    CONNECTION_ERRORS,
    Callback,
    SerialCallbacks,
    bounded,
    close_quietly,
    connect,
    describe,
    nothing,
)
from gateway.util.backoff import Backoff
from gateway.util.pg_scope import CHANNEL_SQL, NOTIFY_SQL

log = structlog.get_logger("gateway.cluster.notify")

Handler = Callable[[str], Awaitable[None] | None]


def notify(conn: psycopg.Connection[Any], channel: str, payload: str = "") -> None:
    """Queue `payload` on `channel`, delivered to listeners when `conn`'s transaction
    commits (at once in autocommit). Keep payloads to ids: the rows are the truth."""
    conn.execute(NOTIFY_SQL, {"channel": channel, "payload": payload})


class Listener:
    """One connection LISTENing on every channel that has a handler.

    Handlers take the payload; a sync one runs inline, an async one as a task of its
    own (so a slow one does not hold up the others). The connection is checked every
    `ping_seconds` when quiet, and replaced with a bounded backoff when lost.
    """

    def __init__(
        self,
        dsn: str,
        *,
        on_reconnect: Callback = nothing,
        label: str = "",
        ping_seconds: float = 5.0,
        backoff_cap: float = 5.0,
        poll_seconds: float = 0.2,
    ) -> None:
        self.dsn = dsn
        self.on_reconnect = on_reconnect
        self.label = label  # in its application_name: the replica's owner id, say
        self.ping_seconds = ping_seconds
        self.backoff_cap = backoff_cap
        # How long a handler added while running waits for its LISTEN, at most: the
        # connection is busy waiting for notifications and is freed this often.
        self.poll_seconds = poll_seconds
        self.connections = 0
        self._handlers: dict[str, list[Handler]] = {}
        self._listening: set[str] = set()
        self._names: dict[str, str] = {}  # a channel's scoped name on the server -> channel
        self._synced = asyncio.Event()
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._callbacks = SerialCallbacks("listener")
        self._handler_tasks: set[asyncio.Task[Any]] = set()

    def add(self, channel: str, handler: Handler) -> None:
        """Call `handler(payload)` for every notification on `channel` from now on
        (once `subscribed()` returns when the listener is already running)."""
        self._handlers.setdefault(channel, []).append(handler)
        if channel not in self._listening:
            self._synced.clear()

    async def subscribed(self) -> None:
        """Until every channel added so far is LISTENed on a live connection."""
        await self._synced.wait()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._callbacks.wait()
        for task in list(self._handler_tasks):
            task.cancel()
        await asyncio.gather(*self._handler_tasks, return_exceptions=True)
        await close_quietly(self._conn)
        self._conn = None

    async def _run(self) -> None:
        backoff = Backoff(initial=0.1, maximum=self.backoff_cap, jitter=0.2)
        while True:
            try:
                await self._connect_and_listen()
                backoff.reset()
                await self._receive()
            except CONNECTION_ERRORS as exc:
                log.warning("listener_disconnected", error=describe(exc))
            self._synced.clear()
            self._listening.clear()
            await close_quietly(self._conn)
            self._conn = None
            await asyncio.sleep(backoff.delay())

    async def _connect_and_listen(self) -> None:
        self._conn = await connect(
            self.dsn, max(self.ping_seconds, 1.0), f"listener {self.label}".strip()
        )
        await self._listen_missing()
        self.connections += 1
        if self.connections > 1:
            log.info("listener_reconnected", channels=sorted(self._listening))
            self._callbacks.schedule(self.on_reconnect)

    async def _listen_missing(self) -> None:
        assert self._conn is not None
        for channel in [c for c in self._handlers if c not in self._listening]:
            name = await bounded(self._conn, self._scoped(channel), self.ping_seconds)
            listening = self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(name)))
            await bounded(self._conn, listening, self.ping_seconds)
            self._names[name] = channel
            self._listening.add(channel)
        if all(c in self._listening for c in self._handlers):
            self._synced.set()

    async def _scoped(self, channel: str) -> str:
        assert self._conn is not None
        cursor = await self._conn.execute(f"SELECT {CHANNEL_SQL}", {"channel": channel})
        row = await cursor.fetchone()
        assert row is not None
        return str(row[0])

    async def _receive(self) -> None:
        assert self._conn is not None
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while True:
            async for note in self._conn.notifies(timeout=self.poll_seconds):
                quiet_since = loop.time()
                self._dispatch(self._names.get(note.channel, note.channel), note.payload)
            await self._listen_missing()
            if loop.time() - quiet_since >= self.ping_seconds:
                # A peer that vanished without closing the socket shows here.
                await bounded(self._conn, self._conn.execute("SELECT 1"), self.ping_seconds)
                quiet_since = loop.time()

    def _dispatch(self, channel: str, payload: str) -> None:
        for handler in self._handlers.get(channel, ()):
            try:
                result = handler(payload)
            except Exception:
                log.exception("listener_handler_failed", channel=channel)
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._handler_tasks.add(task)
                task.add_done_callback(self._handler_done)

    def _handler_done(self, task: asyncio.Task[Any]) -> None:
        self._handler_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("listener_handler_failed", error=repr(task.exception()))
