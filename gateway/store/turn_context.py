"""The one read of a turn's context, inside its begin transaction (`gateway.store.turnlog`).

Both strategies read newest-first through the (session_id, active, id) index, so the
cost is the rows read, never the length of the conversation. The summary strategy first
looks its checkpoint up by primary key and reads only rows after it (`id >
covered_up_to`): the rows a summary covers are never read. With no checkpoint it reads
what the window strategy reads, plus that one look-up. Both read the session's stored
token calibration (`gateway.context.tokens.Calibration`), the summary strategy in the
same statement as its checkpoint.
"""

from __future__ import annotations

import sqlite3

from gateway.context.strategy import Loaded, Plan
from gateway.store import codec

_NO_BOUND = 2**62


def load(
    conn: sqlite3.Connection, session_id: str, plan: Plan, before: int | None = None
) -> Loaded:
    """The rows (and checkpoint) `plan` may send for a turn; `before`: a re-run turn's
    own user message row (what came after it is not its history)."""
    summary, covered, epoch, factor = None, 0, 0, None
    if plan.strategy == "summary":
        # The session's row and its checkpoint: two primary-key look-ups, one statement.
        row = conn.execute(
            "SELECT s.token_factor, c.epoch, c.covered_up_to, c.summary FROM sessions s"
            " LEFT JOIN summary_checkpoints c ON c.session_id = s.session_id"
            " WHERE s.session_id = ?",
            (session_id,),
        ).fetchone()
        if row is not None:
            factor = row[0]
            if row[1] is not None:
                epoch, covered, summary = row[1:]
                if summary is None:
                    covered = 0
    else:
        row = conn.execute(
            "SELECT token_factor FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone()
        factor = row[0] if row is not None else None
    if plan.rows <= 0:
        return Loaded(summary=summary, covered_up_to=covered, epoch=epoch, token_factor=factor)
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
        full=len(rows) == plan.rows,
        token_factor=factor,
    )


def save_factor(conn: sqlite3.Connection, session_id: str, factor: float) -> None:
    """Store the session's token calibration (read back by `load`)."""
    conn.execute("UPDATE sessions SET token_factor = ? WHERE session_id = ?", (factor, session_id))
