"""The writer's group commit on PostgreSQL: the whole batch (BEGIN, every write's
statements, COMMIT) sent in pipeline mode, so a batch costs one round trip plus one per
result a write reads back, instead of one per statement. Why it matters: the backend
otherwise idles inside the open transaction between our statements, and the batch's row
locks are held that much longer.

Per-write failure isolation is kept as on SQLite (`gateway.store.batch`): in a pipeline a
failing statement aborts the rest of the batch and its error may surface in a later
write's read, so a failed batch is rolled back and run again, without the pipeline, with a
savepoint per write: the failing write fails alone. A lost or unwritable database fails
every write alike (`StoreUnwritable`): the batch is refused as a whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psycopg

from gateway.store.batch import Outcome, _commit_with_savepoints, refusal
from gateway.store.outage import unwritable_reason
from gateway.store.pg.dialect import PgConn


def _rollback(conn: PgConn) -> None:
    """End a failed or leftover transaction; a lost connection has nothing to end."""
    if conn.in_transaction:
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")


def commit_pipelined(conn: PgConn, fns: list[Callable[[Any], Any]]) -> Outcome:
    """One transaction for the batch, its statements pipelined; each write gets its own
    result, a failing one fails alone (see the module's docstring)."""
    _rollback(conn)
    results: Outcome = []
    try:
        with conn.pipelined():
            conn.execute("BEGIN")
            for fn in fns:
                results.append((True, fn(conn)))
            conn.run_checks()
            conn.execute("COMMIT")
    except Exception as exc:
        _rollback(conn)
        if unwritable_reason(exc) is not None or conn.raw.broken or conn.raw.closed:
            return [(False, refusal(exc))] * len(fns)
        if len(fns) == 1:
            return [(False, exc)]
        try:
            return _commit_with_savepoints(conn, fns)  # type: ignore[arg-type]
        except Exception as again:
            _rollback(conn)
            return [(False, refusal(again))] * len(fns)
    return results
