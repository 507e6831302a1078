"""Session titles (seed 004, "Smart Title Generation"): the `title` column of `sessions`.

A title is taken from the session's first user message (`make_title`) once, in the
transaction that stores that message, and only while the session has none
(`set_first_title`); `/title` renames (`rename`). A session without one is shown as
`DEFAULT_TITLE`. Plain functions run by the database writer or reader.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from gateway.store import codec

DEFAULT_TITLE = "New Session"
TITLE_CHARS = 40  # taken from the first user message (seed 004)
MAX_TITLE_CHARS = 100  # what /title keeps of a name given by hand


def _one_line(text: str) -> str:
    # The same as migration 7's SQL backfill (gateway.store.migrations): CR dropped, LF
    # a space.
    return text.replace("\r", "").replace("\n", " ")


def make_title(text: str | None) -> str:
    """The first 40 characters, newlines as spaces, trimmed, `...` when cut;
    `New Session` for no text."""
    if not text or not text.strip():
        return DEFAULT_TITLE
    text = text.strip()
    title = _one_line(text[:TITLE_CHARS]).strip()
    return f"{title}..." if len(text) > TITLE_CHARS else title


def clean_title(text: str) -> str:
    """A title given by hand: one line, trimmed, at most MAX_TITLE_CHARS characters."""
    return " ".join(_one_line(text).split())[:MAX_TITLE_CHARS].strip()


def shown(title: str | None) -> str:
    return title or DEFAULT_TITLE


def set_first_title(conn: sqlite3.Connection, session_id: str, text: str) -> None:
    """Title a session from its first user message, unless it has a title already."""
    conn.execute(
        "UPDATE sessions SET title = ? WHERE session_id = ? AND title IS NULL",
        (make_title(text), session_id),
    )


def rename(conn: sqlite3.Connection, session_id: str, title: str) -> bool:
    """Set a session's title; False when there is no such session."""
    return (
        conn.execute(
            "UPDATE sessions SET title = ? WHERE session_id = ?", (title, session_id)
        ).rowcount
        == 1
    )


def title_of(conn: sqlite3.Connection, session_id: str) -> str | None:
    row = conn.execute("SELECT title FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    return row[0] if row else None


def titles_for(conn: sqlite3.Connection, session_ids: Iterable[str]) -> dict[str, str]:
    """The shown title of each of `session_ids` (one query, one index look-up each)."""
    ids = list(session_ids)
    found = dict(
        conn.execute(
            "SELECT session_id, title FROM sessions"
            " WHERE session_id IN (SELECT value FROM json_each(?))",
            (codec.dumps(ids),),
        ).fetchall()
    )
    return {sid: shown(found.get(sid)) for sid in ids}


def is_session_of(conn: sqlite3.Connection, session_key: str, session_id: str) -> bool:
    return (
        conn.execute(
            "SELECT 1 FROM sessions WHERE session_id = ? AND session_key = ?",
            (session_id, session_key),
        ).fetchone()
        is not None
    )


def find(conn: sqlite3.Connection, session_key: str, text: str) -> list[tuple[str, str]]:
    """The key's sessions titled `text` (ignoring case), or else those whose title starts
    with it: [(session_id, title)], newest first. One match is the session /resume means."""
    wanted = clean_title(text)
    if not wanted:
        return []
    pattern = wanted.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    shown_title = f"coalesce(title, '{DEFAULT_TITLE}')"
    rows = conn.execute(
        # lower() on both sides, not COLLATE NOCASE: the same on SQLite and PostgreSQL.
        f"SELECT session_id, {shown_title}, lower({shown_title}) = lower(?) FROM sessions"
        f" WHERE session_key = ? AND {shown_title} LIKE ? ESCAPE '\\'"
        " ORDER BY started_at DESC, session_id DESC",
        (wanted, session_key, pattern),
    ).fetchall()
    exact = [(sid, title) for sid, title, same in rows if same]
    return exact or [(sid, title) for sid, title, _ in rows]
