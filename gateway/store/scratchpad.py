"""The scratchpad of a session (seed 002): the model's working notes for a long task.

Session-scoped (a new session starts with an empty pad), at most `MAX_ITEMS` items of
at most `MAX_ITEM_CHARS` characters each, and a write replaces the whole pad. One row
per session in `scratchpads`, its items a JSON list. Plain functions run by the
database reader or writer; `check` is the limits, applied before anything is written.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from gateway.store import codec

MAX_ITEMS = 32
MAX_ITEM_CHARS = 240


def check(items: Sequence[str]) -> list[str]:
    """The items as a pad may hold them; ValueError (saying which limit) otherwise."""
    if len(items) > MAX_ITEMS:
        raise ValueError(
            f"the scratchpad holds at most {MAX_ITEMS} items, got {len(items)};"
            " merge or drop some (a write replaces the whole pad)"
        )
    for number, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise ValueError(f"item {number} is not text")
        if len(item) > MAX_ITEM_CHARS:
            raise ValueError(
                f"item {number} has {len(item)} characters; at most {MAX_ITEM_CHARS} each"
            )
    return list(items)


def read(conn: sqlite3.Connection, session_id: str) -> list[str]:
    row = conn.execute(
        "SELECT items FROM scratchpads WHERE session_id = ?", (session_id,)
    ).fetchone()
    return list(codec.loads(row[0])) if row is not None else []


def write(conn: sqlite3.Connection, session_id: str, items: Sequence[str]) -> None:
    """Replace the pad (an empty list clears it)."""
    items = check(items)
    if not items:
        clear(conn, session_id)
        return
    conn.execute(
        "INSERT INTO scratchpads (session_id, items, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT(session_id) DO UPDATE SET items = excluded.items,"
        " updated_at = excluded.updated_at",
        (session_id, codec.dumps(items), time.time()),
    )


def clear(conn: sqlite3.Connection, session_id: str) -> bool:
    """Empty the pad; True if it held anything."""
    return conn.execute("DELETE FROM scratchpads WHERE session_id = ?", (session_id,)).rowcount > 0
