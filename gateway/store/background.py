"""A background task that does its SQLite work on worker threads, on a connection of its
own (the WAL checkpointer, the search indexer).

What the two share is the hard part: `stop()` must not close a connection under a call
still running on its thread (a cancelled `asyncio.to_thread` call runs on), and a call
that opened a connection must hand it to `stop()` even when the cancellation arrives in
the very pass the call finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: the longest pause between two looks for work once a task found none for a while
IDLE_POLL_SECONDS = 1.0


class ThreadedSqliteTask:
    """Subclasses run `_start(coroutine, name)` and do their work through `_in_thread`,
    looking for work every `interval` seconds (`_pause`)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._conn: sqlite3.Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._idle_polls = 0

    async def _pause(self, worked: bool) -> None:
        """Sleep `interval` after a pass that found work; after passes that found none,
        twice as long each time up to IDLE_POLL_SECONDS. Under load nothing changes; an
        idle gateway wakes each task once a second instead of 4-10 times, and the first
        work after a quiet spell waits at most that second."""
        self._idle_polls = 0 if worked else min(self._idle_polls + 1, 16)
        await asyncio.sleep(
            max(self.interval, min(IDLE_POLL_SECONDS, self.interval * 2**self._idle_polls))
        )

    def _start(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._task = asyncio.create_task(work, name=name)

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a worker thread, one call at a time; if we are cancelled
        meanwhile it runs on, and `stop()` waits for it."""
        self._inflight = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        # Cleared only on a normal return: cancelled, we may well be told so just as
        # the call finished, and its result (an open connection) must still reach stop().
        result = await asyncio.shield(self._inflight)
        self._inflight = None
        return result

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._inflight is not None:
            with contextlib.suppress(Exception):
                opened = await self._inflight
                # connected while we were being cancelled (memory's indexer connects to
                # a PostgreSQL store with psycopg)
                close = getattr(opened, "close", None)
                if callable(close):
                    close()
            self._inflight = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
