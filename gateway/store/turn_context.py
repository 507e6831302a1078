"""The one read of a turn's context, inside its begin transaction (`gateway.store.turnlog`).

Both strategies read newest-first through the (session_id, active, id) index, so the
cost is the rows read, never the length of the conversation. The summary strategy first
looks its checkpoint up by primary key and reads only rows after it (`id >
covered_up_to`): the rows a summary covers are never read. With no checkpoint it reads
what the window strategy reads, plus that one look-up. The session's stored token
calibration (`gateway.context.tokens.Calibration`) comes with its entry's hot row, which
the begin reads anyway.
"""

from __future__ import annotations

import sqlite3

from gateway.context.strategy import Loaded, Plan
from gateway.store import codec

_NO_BOUND = 2**62


def load(
    conn: sqlite3.Connection,
    session_id: str,
    plan: Plan,
    token_factor: float | None = None,
    before: int | None = None,
) -> Loaded:
    """The rows (and checkpoint) `plan` may send for a turn; `token_factor`: the session's
    stored calibration, read with its entry's hot row; `before`: a re-run turn's own user
    message row (what came after it is not its history)."""
    summary, covered, epoch, condensed, told = None, 0, 0, 0, 0
    if plan.strategy == "summary":
        row = conn.execute(
            "SELECT epoch, covered_up_to, summary, messages, told FROM summary_checkpoints"
            " WHERE session_id = ?",
            (session_id,),
        ).fetchone()
        if row is not None:
            epoch, covered, summary, condensed, told = row
            if summary is None:
                covered = 0
    if plan.rows <= 0:
        return Loaded(
            summary=summary,
            covered_up_to=covered,
            epoch=epoch,
            condensed=condensed,
            told=told,
            token_factor=token_factor,
        )
    rows = conn.execute(
        "SELECT id, message FROM messages WHERE session_id = ? AND active = 1"
        " AND id > ? AND id < ? ORDER BY id DESC LIMIT ?",
        (session_id, covered, before if before is not None else _NO_BOUND, plan.rows),
    ).fetchall()
    rows.reverse()
    return Loaded(
        ids=tuple(row_id for row_id, _ in rows),
        messages=tuple(codec.loads(message) for _, message in rows),
        summary=summary,
        covered_up_to=covered,
        epoch=epoch,
        condensed=condensed,
        told=told,
        full=len(rows) == plan.rows,
        token_factor=token_factor,
    )
