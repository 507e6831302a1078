"""What the cluster's background tasks share: their own database connections (connect
with a deadline, close without waiting on a dead peer; they retry with
gateway.util.backoff) and their callbacks, run one at a time in the order of the events."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import structlog

log = structlog.get_logger("gateway.cluster")

Callback = Callable[[], Awaitable[None]]
T = TypeVar("T")

# What a lost or refused connection raises (OSError: a socket error before libpq wraps
# it; TimeoutError: our own deadline on a peer that does not answer).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    OSError,
    TimeoutError,
)


def describe(exc: BaseException) -> str:
    """An error for the log: its message, or its type when it has none (a timeout)."""
    return str(exc).strip() or type(exc).__name__


async def connect(dsn: str, within: float, purpose: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection, or TimeoutError after `within` seconds (libpq's own
    `connect_timeout` counts whole seconds and at least 2). `purpose` becomes its
    `application_name` (cut to Postgres's 63 bytes), so `pg_stat_activity` names it.

    `asyncio.timeout`, not `asyncio.wait_for`: on Python 3.11, `wait_for` drops a
    cancellation that arrives as the connection opens, and the task that should have
    stopped goes on (a `stop()` then waits for it forever)."""
    opening = psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=f"hermes {purpose}"[:63]
    )
    async with asyncio.timeout(within):
        return await opening


async def bounded(conn: psycopg.AsyncConnection[Any], operation: Awaitable[T], within: float) -> T:
    """`operation` on `conn`, or TimeoutError after `within` seconds with `conn` closed.

    Not `asyncio.wait_for`: cancelling a running query makes psycopg ask the server to
    cancel it and wait for the answer, up to 10 s, from a server that may be the one
    not answering. Closing the connection first abandons the query at once. The same
    holds when our caller is cancelled (`stop()` while the database hangs).
    """
    task = asyncio.ensure_future(operation)
    try:
        done, _ = await asyncio.wait({task}, timeout=within)
    except asyncio.CancelledError:
        await _abandon(conn, task)
        raise
    if not done:
        await _abandon(conn, task)
        raise TimeoutError(f"no answer from the database within {within:.1f} s")
    return task.result()


async def _abandon(conn: psycopg.AsyncConnection[Any], task: asyncio.Future[Any]) -> None:
    await conn.close()  # immediate: libpq's finish(), no round trip
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def close_quietly(conn: psycopg.AsyncConnection[Any] | None) -> None:
    if conn is None:
        return
    try:
        async with asyncio.timeout(1.0):
            await conn.close()
    except Exception:
        pass  # a dead peer: the socket goes with the object


async def nothing() -> None:
    return None


class SerialCallbacks:
    """Runs async callbacks as tasks, one at a time, in the order they were scheduled:
    an `on_lose` never overtakes the `on_gain` before it. A failing callback is logged."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = asyncio.Lock()  # FIFO among waiters
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, callback: Callback) -> None:
        async def run() -> None:
            async with self._lock:
                try:
                    await callback()
                except Exception:
                    log.exception("cluster_callback_failed", task=self.label)

        task = asyncio.create_task(run(), name=f"{self.label} callback")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until every scheduled callback has run."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
