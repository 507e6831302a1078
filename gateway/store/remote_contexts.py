"""The context each chat keeps with each remote A2A agent it delegated to: one row per
(calling session key, remote agent name), holding the context id the remote answered the
first message with, so every later `agent_call` in the conversation continues it and
another chat never reaches it. The row names the session that last used it
(`session_id`, a foreign key with ON DELETE CASCADE; `gateway.store.purge` finds the
table by that column), so deleting that session deletes it. Plain functions run by the
database writer or reader."""

from __future__ import annotations

import sqlite3


def load(conn: sqlite3.Connection, session_key: str, remote: str) -> tuple[str, str] | None:
    """(context id, the session that last used it), or None."""
    row = conn.execute(
        "SELECT context_id, session_id FROM remote_contexts WHERE session_key = ? AND remote = ?",
        (session_key, remote),
    ).fetchone()
    return (row[0], row[1]) if row else None


def save(
    conn: sqlite3.Connection,
    session_key: str,
    remote: str,
    session_id: str,
    context_id: str,
    now: float,
) -> None:
    conn.execute(
        "INSERT INTO remote_contexts (session_key, remote, session_id, context_id, updated_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT (session_key, remote) DO UPDATE SET"
        " session_id = excluded.session_id, context_id = excluded.context_id,"
        " updated_at = excluded.updated_at",
        (session_key, remote, session_id, context_id, now),
    )
