"""A read-only connection to state.db used on the event loop's own thread, for reads
that are a few B-tree look-ups (an entry by key, a short transcript).

Why not the reader thread for those: handing a read to a thread and waking the loop
when it is done costs more CPU than the read itself (a queue put, a thread switch, the
loop's self-pipe, a GIL hand-over each way). A point query on this connection takes
microseconds, so the loop is not held up by it; anything that may take long (a whole
transcript, a range of sessions) stays on the reader thread (`Database.read`).

The connection never waits for a lock (no busy timeout): in WAL mode a reader is only
refused in rare moments (the WAL index being rebuilt), and then `LoopReader.read`
raises `LoopReadBusy` so the caller takes the reader thread, which may wait.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class LoopReadBusy(Exception):
    """The loop's reader could not start a read at once; read on the reader thread."""


class LoopReader:
    """One query-only connection, opened and used on the event loop's thread."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self._conn.execute("PRAGMA query_only=1")
            self._conn.execute("PRAGMA busy_timeout=0")
        except BaseException:
            self._conn.close()
            raise

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(conn)` in one snapshot of committed data (a read transaction)."""
        try:
            return read_snapshot(self._conn, fn)
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise LoopReadBusy(str(exc)) from exc
            raise

    def close(self) -> None:
        self._conn.close()


def read_snapshot(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """`fn(conn)` in one read transaction, so a read of several statements sees one
    state even while the writer commits beside it (the reader thread's and the loop's)."""
    conn.execute("BEGIN")
    try:
        return fn(conn)
    finally:
        conn.execute("COMMIT")
