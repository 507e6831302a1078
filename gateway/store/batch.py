"""The writer's group commit: one transaction for a batch of writes, each write still
getting its own result, and what a disk that cannot write does to a batch.

Writes rarely fail; when one does, the batch is rolled back and run again with a
savepoint per write, so the failing write fails alone. A full, read-only or failing disk
(`gateway.store.outage`) is nobody's fault in particular and may have cost SQLite the whole
transaction: the batch is refused as a whole, each write with `StoreUnwritable`.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from typing import Any

from gateway.store.outage import StoreUnwritable, unwritable_reason

Outcome = list[tuple[bool, Any]]  # per write: (True, result) or (False, exception)


def probe(conn: sqlite3.Connection) -> None:
    """One page written and committed (the header's user_version, rewritten as it is):
    fails while the disk is full, read-only or failing, and changes nothing when it works."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version={int(version)}")


def refusal(exc: Exception) -> Exception:
    """`exc`, or the `StoreUnwritable` it means (the SQLite error kept as its cause)."""
    reason = unwritable_reason(exc)
    if reason is None or isinstance(exc, StoreUnwritable):
        return exc
    refused = StoreUnwritable(reason)
    refused.__cause__ = exc
    return refused


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction. A full or failing disk may have rolled it back already
    (SQLite does so on SQLITE_FULL and SQLITE_IOERR), or may fail the ROLLBACK itself;
    either way the next batch starts afresh (`commit_batch` ends a leftover one)."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def commit_batch(
    conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]
) -> Outcome:
    """One transaction for the whole batch, without a savepoint per write (they were a
    third of a batch's statements). Writes rarely fail; when one does, the batch is
    rolled back and run again with a savepoint per write, so the failing write fails
    alone (write functions are therefore re-runnable: they act through `conn` only). A
    disk that cannot write fails every write alike: the batch is refused as a whole."""
    _rollback(conn)
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        return [(False, refusal(exc))] * len(fns)
    results: Outcome = []
    try:
        for fn in fns:
            results.append((True, fn(conn)))
        conn.execute("COMMIT")
    except Exception as exc:
        _rollback(conn)
        if len(fns) == 1 or unwritable_reason(exc) is not None:
            return [(False, refusal(exc))] * len(fns)
        try:
            return _commit_with_savepoints(conn, fns)
        except Exception as again:
            _rollback(conn)
            return [(False, refusal(again))] * len(fns)
    return results


def _commit_with_savepoints(
    conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]
) -> Outcome:
    results: Outcome = []
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        return [(False, refusal(exc))] * len(fns)
    for fn in fns:
        conn.execute("SAVEPOINT op")
        try:
            value = fn(conn)
        except Exception as exc:
            if unwritable_reason(exc) is not None:
                raise  # the disk, not this write: SQLite may have dropped the transaction
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
            results.append((False, exc))
        else:
            conn.execute("RELEASE op")
            results.append((True, value))
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        _rollback(conn)
        return [(False, refusal(exc))] * len(fns)
    return results
