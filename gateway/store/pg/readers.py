"""The store's read connections on PostgreSQL: a `psycopg_pool` pool, sized for the
reads that run side by side, instead of a connection per thread kept for good.

The pool keeps one connection warm and opens more while reads queue up (at most
`size`); one idle for `MAX_IDLE` seconds beyond the first is closed, and every one is
replaced after `MAX_LIFETIME` seconds (the server's memory for a backend only grows). A
connection that sat unused for `CHECK_AFTER_IDLE` seconds is checked with an empty query
before a read gets it (a server restart or a dropped link shows there, not in the read);
one in use is not checked, so a busy reader pays no round trip for it. A connection a
failed read left broken is discarded by the pool when returned.

Each read runs in one REPEATABLE READ, READ ONLY transaction (one snapshot). With
`pipeline` its BEGIN travels with its first statement (psycopg's pipeline mode): a round
trip fewer, but more of this process's CPU per read (see `gateway.store.pg.db.PIPELINE`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from gateway.store.pg.dialect import PgConn, configure, unreachable

T = TypeVar("T")

MAX_LIFETIME = 3600.0  # seconds a reader connection serves before it is replaced
MAX_IDLE = 300.0  # seconds an idle connection beyond the first is kept
CHECK_AFTER_IDLE = 5.0  # seconds unused after which a connection is checked before use
READ_ONLY = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"


class Readers:
    """A pool of read-only store connections; `read(fn)` runs `fn(conn)` on one."""

    def __init__(
        self, dsn: str, size: int, connect_timeout: float, *, pipeline: bool = False
    ) -> None:
        self._timeout = connect_timeout
        self._pipeline = pipeline
        self._last_used: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            dsn,
            kwargs={"autocommit": True, "connect_timeout": int(connect_timeout)},
            min_size=1,
            max_size=size,
            open=False,
            configure=_configure,
            check=self._check,
            name="hermes-readers",
            timeout=connect_timeout,
            max_lifetime=MAX_LIFETIME,
            max_idle=MAX_IDLE,
            num_workers=1,
        )

    def open(self) -> None:
        """Start filling the pool (in the background: a read waits for a connection)."""
        self._pool.open(wait=False)

    def close(self) -> None:
        self._pool.close(timeout=self._timeout)

    def _check(self, raw: psycopg.Connection[Any]) -> None:
        with self._lock:
            last = self._last_used.get(raw)
        if last is None or time.monotonic() - last > CHECK_AFTER_IDLE:
            ConnectionPool.check_connection(raw)

    def read(self, fn: Callable[[PgConn], T]) -> T:
        """`fn(conn)` in one read-only snapshot; a database that cannot be reached raises
        `StoreUnwritable` ("database unreachable"), as on the writer."""
        try:
            raw = self._pool.getconn()
        except psycopg.Error as exc:
            raise unreachable(exc) or exc from None
        try:
            conn = PgConn(raw)
            with conn.pipelined() if self._pipeline else contextlib.nullcontext():
                conn.execute("BEGIN")
                try:
                    value = fn(conn)
                finally:
                    if not raw.broken:
                        conn.execute("COMMIT")
            return value
        finally:
            with self._lock:
                self._last_used[raw] = time.monotonic()
            self._pool.putconn(raw)


def _configure(raw: psycopg.Connection[Any]) -> None:
    configure(raw)
    raw.execute(READ_ONLY)
