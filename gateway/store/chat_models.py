"""The model each chat picked with `/model`: one row per session key (the chat, not one
of its sessions, so `/new` keeps it), holding a name of the model catalogue. No row: the
agent's own model. Plain functions run by the database writer or reader."""

from __future__ import annotations

import sqlite3


def load(conn: sqlite3.Connection, session_key: str) -> str | None:
    """The chat's chosen model name, or None (the agent's own)."""
    row = conn.execute(
        "SELECT model FROM chat_models WHERE session_key = ?", (session_key,)
    ).fetchone()
    return row[0] if row else None


def save(conn: sqlite3.Connection, session_key: str, model: str | None, now: float) -> None:
    """Record the chat's choice; None deletes it (back to the agent's own)."""
    if model is None:
        conn.execute("DELETE FROM chat_models WHERE session_key = ?", (session_key,))
        return
    conn.execute(
        "INSERT INTO chat_models (session_key, model, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT (session_key) DO UPDATE SET model = excluded.model,"
        " updated_at = excluded.updated_at",
        (session_key, model, now),
    )
