"""Transcript SQL: append, load, rewrite and rewind the messages of one session.

These are plain functions run by the database writer (see `gateway.store.db`). Deletes
are soft (`active = 0`) so /undo and /retry keep an audit trail.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from gateway.store import codec

ROLES = frozenset({"user", "assistant", "system", "tool"})
#: the most messages, and characters of them, `load_small` reads: few enough that
#: decoding them on the event loop's thread holds it up less than a thread hop would
SMALL_MESSAGES = 200
SMALL_CHARS = 256 * 1024


def validate_message(message: Any) -> dict[str, Any]:
    """A transcript message is a dict with a known `role` and a `content` key."""
    if not isinstance(message, dict):
        raise ValueError(f"a transcript message must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"message role must be one of {sorted(ROLES)}, got {role!r}")
    if "content" not in message:
        raise ValueError("a transcript message needs a 'content' key")
    return message


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return codec.dumps(content)


def _require_session(conn: sqlite3.Connection, session_id: str) -> None:
    if conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone():
        return
    raise KeyError(f"unknown session_id {session_id!r}")


def insert_message(conn: sqlite3.Connection, session_id: str, message: dict[str, Any]) -> int:
    cursor = conn.execute(
        "INSERT INTO messages (session_id, role, content, message, created_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (
            session_id,
            message["role"],
            _content_text(message["content"]),
            codec.dumps(message, default=str),
            time.time(),
        ),
    )
    return int(cursor.lastrowid or 0)


def update_message(conn: sqlite3.Connection, row_id: int, message: dict[str, Any]) -> None:
    """Rewrite the stored message of a row (what the model read of a message's files),
    keeping its searchable `content`: the words the user typed."""
    conn.execute(
        "UPDATE messages SET message = ? WHERE id = ?", (codec.dumps(message, default=str), row_id)
    )


def append(conn: sqlite3.Connection, session_id: str, message: dict[str, Any]) -> int:
    _require_session(conn, session_id)
    return insert_message(conn, session_id, message)


_ACTIVE = "SELECT message FROM messages WHERE session_id = ? AND active = 1 ORDER BY id"


def load(conn: sqlite3.Connection, session_id: str) -> list[dict[str, Any]]:
    return [codec.loads(message) for (message,) in conn.execute(_ACTIVE, (session_id,))]


def load_small(
    conn: sqlite3.Connection,
    session_id: str,
    max_messages: int = SMALL_MESSAGES,
    max_chars: int = SMALL_CHARS,
) -> list[dict[str, Any]] | None:
    """`load`, or None when the transcript has more than `max_messages` messages or
    more than `max_chars` characters of them: a read too long for the event loop's own
    thread (`Database.read_now`), to be made on the reader thread instead."""
    # Row by row, so a transcript past either bound is given up as soon as it is known
    # to be, not after reading it.
    kept: list[str] = []
    chars = 0
    for (message,) in conn.execute(f"{_ACTIVE} LIMIT ?", (session_id, max_messages + 1)):
        chars += len(message)
        if len(kept) == max_messages or chars > max_chars:
            return None
        kept.append(message)
    return [codec.loads(message) for message in kept]


def load_row(conn: sqlite3.Connection, row_id: int) -> dict[str, Any] | None:
    row = conn.execute("SELECT message FROM messages WHERE id = ?", (row_id,)).fetchone()
    return codec.loads(row[0]) if row else None


def count_active(conn: sqlite3.Connection, session_id: str) -> int:
    row = conn.execute(
        "SELECT COUNT(*) FROM messages WHERE session_id = ? AND active = 1", (session_id,)
    ).fetchone()
    return int(row[0])


def count_undone(conn: sqlite3.Connection, session_id: str) -> int:
    """Messages /undo, /retry or a rewrite took back (kept, inactive)."""
    row = conn.execute(
        "SELECT COUNT(*) FROM messages WHERE session_id = ? AND active = 0", (session_id,)
    ).fetchone()
    return int(row[0])


def rewrite(conn: sqlite3.Connection, session_id: str, messages: list[dict[str, Any]]) -> int:
    """Replace the active transcript; the caller's savepoint makes it all-or-nothing."""
    _require_session(conn, session_id)
    conn.execute(
        "UPDATE messages SET active = 0 WHERE session_id = ? AND active = 1", (session_id,)
    )
    for message in messages:
        insert_message(conn, session_id, message)
    return len(messages)


def rewind(conn: sqlite3.Connection, session_id: str, n: int) -> dict[str, Any]:
    """Soft-delete the last `n` user turns (each user message and everything after it)."""
    _require_session(conn, session_id)
    user_rows = conn.execute(
        "SELECT id, message FROM messages WHERE session_id = ? AND active = 1 AND role = 'user'"
        " ORDER BY id DESC LIMIT ?",
        (session_id, n),
    ).fetchall()
    if not user_rows:
        return {"rewound_count": 0, "turns_undone": 0, "target_text": None}
    first_id, first_message = user_rows[-1]
    cursor = conn.execute(
        "UPDATE messages SET active = 0 WHERE session_id = ? AND active = 1 AND id >= ?",
        (session_id, first_id),
    )
    content = codec.loads(first_message).get("content")
    return {
        "rewound_count": cursor.rowcount,
        "turns_undone": len(user_rows),
        "target_text": content if isinstance(content, str) else _content_text(content),
    }
