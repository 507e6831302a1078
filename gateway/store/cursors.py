"""Where a platform's stream of events stands (`platform_cursors`): an adapter that reads
a stream by a position token (Matrix's sync `next_batch`) stores it here once the
events before it are accepted, so a restart or a failover continues from there: nothing
skipped, and what is read twice dropped by the inbox's dedup."""

from __future__ import annotations

import sqlite3

MAX_VALUE = 4096  # a cursor is a token, not data


def load(conn: sqlite3.Connection, platform: str, name: str) -> str | None:
    row = conn.execute(
        "SELECT value FROM platform_cursors WHERE platform = ? AND name = ?", (platform, name)
    ).fetchone()
    return row[0] if row else None


def save(conn: sqlite3.Connection, platform: str, name: str, value: str, now: float) -> None:
    if len(value) > MAX_VALUE:
        raise ValueError(f"a {platform} cursor longer than {MAX_VALUE} characters")
    conn.execute(
        "INSERT INTO platform_cursors (platform, name, value, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT (platform, name) DO UPDATE SET value = excluded.value,"
        " updated_at = excluded.updated_at",
        (platform, name, value, now),
    )
