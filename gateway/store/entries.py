"""Entry-row SQL: load, save, list and prune routing entries; open, close and list the
`sessions` rows.

Plain functions run by the database writer (see `gateway.store.db`), used by
`gateway.store.session_store`. A reset ends the old session's row and starts a new one
(seed section 6, effects 1-4).
"""

from __future__ import annotations

import secrets
import sqlite3
from datetime import UTC, datetime
from typing import Any

from gateway.session import SessionEntry, SessionSource
from gateway.store import codec

#: token and cost counters, in the column order of the `sessions` table
COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "total_tokens",
    "estimated_cost_usd",
)
_COUNTER_COLUMNS = ", ".join(COUNTERS)
_SET_COUNTERS = ", ".join(f"{name} = ?" for name in COUNTERS)

END_RESET = "session_reset"
END_SWITCH = "session_switch"
END_PRUNED = "pruned"


def new_session_id(now: datetime) -> str:
    """`YYYYMMDD_HHMMSS_<8hex>` in UTC."""
    return f"{now.astimezone(UTC):%Y%m%d_%H%M%S}_{secrets.token_hex(4)}"


def load_entry(conn: sqlite3.Connection, session_key: str) -> SessionEntry | None:
    loaded = load_entry_raw(conn, session_key)
    return loaded[0] if loaded else None


def load_entry_raw(conn: sqlite3.Connection, session_key: str) -> tuple[SessionEntry, str] | None:
    """The entry and its stored JSON text (what `save_entry_if_unchanged` compares to)."""
    row = conn.execute(
        "SELECT entry FROM session_entries WHERE session_key = ?", (session_key,)
    ).fetchone()
    return (SessionEntry.from_dict(codec.loads(row[0])), row[0]) if row else None


def encode_entry(entry: SessionEntry) -> str:
    return codec.dumps(entry.to_dict())


def minute_of(moment: datetime | float) -> int:
    """The `active_minute` bucket of a time (UTC epoch minutes)."""
    epoch = moment.timestamp() if isinstance(moment, datetime) else moment
    return int(epoch // 60)


def save_entry(conn: sqlite3.Connection, entry: SessionEntry) -> None:
    """Write one entry. The common case (same session id) is a single UPDATE that leaves
    the session_id index alone and rewrites the `active_minute` index only when the
    minute changed; a new or re-pointed key needs the full upsert."""
    encoded = encode_entry(entry)
    if _update_in_place(conn, entry, encoded, "session_id = ?", entry.session_id):
        return
    conn.execute(
        "INSERT INTO session_entries"
        " (updated_at, suspended, resume_pending, expiry_finalized, entry, session_key,"
        " session_id, active_minute) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT(session_key) DO UPDATE SET session_id = excluded.session_id,"
        " updated_at = excluded.updated_at, active_minute = excluded.active_minute,"
        " suspended = excluded.suspended, resume_pending = excluded.resume_pending,"
        " expiry_finalized = excluded.expiry_finalized, entry = excluded.entry",
        (*_row_values(entry, encoded), entry.session_id, minute_of(entry.updated_at)),
    )


def save_entry_if_unchanged(conn: sqlite3.Connection, entry: SessionEntry, stored: str) -> bool:
    """Save `entry` only if its row still holds `stored` (the text it was loaded from):
    one UPDATE instead of load + decode + save when nothing else changed the entry since.
    False when something did; the caller then loads it again."""
    return _update_in_place(conn, entry, encode_entry(entry), "entry = ?", stored)


def _row_values(entry: SessionEntry, encoded: str) -> tuple[float, int, int, int, str, str]:
    """updated_at, suspended, resume_pending, expiry_finalized, entry, session_key: the
    columns both writes of an entry set, in the order their statements name them."""
    return (
        entry.updated_at.timestamp(),
        int(entry.suspended),
        int(entry.resume_pending),
        int(entry.expiry_finalized),
        encoded,
        entry.session_key,
    )


def _update_in_place(
    conn: sqlite3.Connection, entry: SessionEntry, encoded: str, guard: str, expected: str
) -> bool:
    """UPDATE the key's row where `guard` holds; False when no row matched."""
    row = conn.execute(
        "UPDATE session_entries SET updated_at = ?, suspended = ?, resume_pending = ?,"
        f" expiry_finalized = ?, entry = ? WHERE session_key = ? AND {guard}"
        " RETURNING active_minute",
        (*_row_values(entry, encoded), expected),
    ).fetchone()
    if row is None:
        return False
    minute = minute_of(entry.updated_at)
    if row[0] != minute:
        conn.execute(
            "UPDATE session_entries SET active_minute = ? WHERE session_key = ?",
            (minute, entry.session_key),
        )
    return True


def start_session_row(conn: sqlite3.Connection, entry: SessionEntry) -> None:
    # The counters matter for entries imported from sessions.json: switch_session restores
    # a session's counters from this row.
    origin = codec.dumps(entry.origin.to_dict()) if entry.origin else None
    conn.execute(
        "INSERT OR IGNORE INTO sessions (session_id, session_key, origin, started_at,"
        " input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, total_tokens,"
        " estimated_cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            entry.session_id,
            entry.session_key,
            origin,
            entry.created_at.timestamp(),
            *counters_of(entry),
        ),
    )


def load_session_row(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    """One incarnation's `sessions` row (current or ended), times as UTC ISO strings."""
    row = conn.execute(
        "SELECT session_key, started_at, ended_at, end_reason, title, total_tokens"
        " FROM sessions WHERE session_id = ?",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    key, started, ended, reason, title, tokens = row
    return {
        "session_id": session_id,
        "session_key": key,
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "ended_at": datetime.fromtimestamp(ended, UTC).isoformat() if ended else None,
        "end_reason": reason,
        "title": title,
        "total_tokens": tokens,
    }


def end_session_row(
    conn: sqlite3.Connection, entry: SessionEntry, now: datetime, reason: str
) -> None:
    """Close the `sessions` row of `entry`'s current session, with its final counters.

    The live counters are kept only in the entry while a session is current (one row
    write per turn instead of two); they reach the `sessions` row when the session ends.
    """
    conn.execute(
        f"UPDATE sessions SET ended_at = ?, end_reason = ?, {_SET_COUNTERS}"
        " WHERE session_id = ? AND ended_at IS NULL",
        (now.timestamp(), reason, *counters_of(entry), entry.session_id),
    )


def counters_of(entry: SessionEntry) -> tuple[Any, ...]:
    return tuple(getattr(entry, name) for name in COUNTERS)


def load_counters(conn: sqlite3.Connection, session_id: str, session_key: str) -> Any:
    """The stored counters and start time of one session of `session_key`, or None."""
    return conn.execute(
        f"SELECT {_COUNTER_COLUMNS}, started_at FROM sessions"
        " WHERE session_id = ? AND session_key = ?",
        (session_id, session_key),
    ).fetchone()


def fresh_entry(session_key: str, source: SessionSource | None, now: datetime) -> SessionEntry:
    return SessionEntry(
        session_key=session_key,
        session_id=new_session_id(now),
        created_at=now,
        updated_at=now,
        origin=source,
        display_name=source.chat_name if source else None,
        platform=source.platform if source else None,
        chat_type=source.chat_type if source else "dm",
    )


def replace_session(
    conn: sqlite3.Connection,
    old: SessionEntry,
    source: SessionSource | None,
    now: datetime,
    **flags: Any,
) -> SessionEntry:
    """End `old`'s session and start a new incarnation of the same key (reset effects 1-4)."""
    end_session_row(conn, old, now, END_RESET)
    new = fresh_entry(old.session_key, source or old.origin, now)
    if source is None:
        new.display_name = old.display_name
        new.platform, new.chat_type = old.platform, old.chat_type
    for name, value in flags.items():
        setattr(new, name, value)
    start_session_row(conn, new)
    save_entry(conn, new)
    return new


def mark_active_since(conn: sqlite3.Connection, cutoff: float, now: datetime) -> int:
    """Mark entries touched since `cutoff` (epoch) resume_pending ("restart_interrupted"),
    skipping those already pending or suspended; returns how many."""
    rows = conn.execute(
        "SELECT entry FROM session_entries WHERE active_minute >= ?"
        " AND updated_at >= ? AND suspended = 0 AND resume_pending = 0",
        (minute_of(cutoff), cutoff),
    ).fetchall()
    for (raw,) in rows:
        entry = SessionEntry.from_dict(codec.loads(raw))
        entry.resume_pending = True
        entry.resume_reason = "restart_interrupted"
        entry.last_resume_marked_at = now
        save_entry(conn, entry)
    return len(rows)


def idle_keys(conn: sqlite3.Connection, cutoff: float) -> list[str]:
    """Keys of the entries not touched since `cutoff` (epoch) and not suspended."""
    return [
        key
        for (key,) in conn.execute(
            "SELECT session_key FROM session_entries"
            " WHERE active_minute <= ? AND updated_at < ? AND suspended = 0",
            (minute_of(cutoff), cutoff),
        )
    ]


def prune(conn: sqlite3.Connection, keys: list[str], cutoff: float, now: datetime) -> int:
    """Drop the entries of `keys` still idle since `cutoff` (an entry may have been touched
    since `idle_keys` found it), ending their sessions; returns how many."""
    pruned = 0
    for key in keys:
        row = conn.execute(
            "DELETE FROM session_entries WHERE session_key = ? AND updated_at < ?"
            " AND suspended = 0 RETURNING entry",
            (key, cutoff),
        ).fetchone()
        if row:
            end_session_row(conn, SessionEntry.from_dict(codec.loads(row[0])), now, END_PRUNED)
            pruned += 1
    return pruned


def list_entries(conn: sqlite3.Connection, since: float | None = None) -> list[SessionEntry]:
    """All entries (or those touched since `since`, epoch), most recently active first."""
    sql = "SELECT entry FROM session_entries"
    params: tuple[Any, ...] = ()
    if since is not None:
        sql += " WHERE active_minute >= ? AND updated_at >= ?"
        params = (minute_of(since), since)
    sql += " ORDER BY updated_at DESC, session_key"
    return [SessionEntry.from_dict(codec.loads(raw)) for (raw,) in conn.execute(sql, params)]


def load_by_session_id(conn: sqlite3.Connection, session_id: str) -> SessionEntry | None:
    """The entry whose current session is `session_id`, if any."""
    row = conn.execute(
        "SELECT entry FROM session_entries WHERE session_id = ?", (session_id,)
    ).fetchone()
    return SessionEntry.from_dict(codec.loads(row[0])) if row else None


def session_history(conn: sqlite3.Connection, session_key: str, limit: int) -> list[dict[str, Any]]:
    """The sessions of one key, newest first, with their active message counts."""
    rows = conn.execute(
        "SELECT s.session_id, s.started_at, s.ended_at, s.end_reason, s.title,"
        " (SELECT COUNT(*) FROM messages m WHERE m.session_id = s.session_id"
        "  AND m.active = 1) FROM sessions s WHERE s.session_key = ?"
        " ORDER BY s.started_at DESC, s.session_id DESC LIMIT ?",
        (session_key, limit),
    )
    return [
        {
            "session_id": sid,
            "started_at": datetime.fromtimestamp(started, UTC),
            "ended_at": datetime.fromtimestamp(ended, UTC) if ended else None,
            "end_reason": reason,
            "title": title,
            "message_count": count,
        }
        for sid, started, ended, reason, title, count in rows
    ]


def replaced_by(conn: sqlite3.Connection, session_key: str, session_id: str) -> str | None:
    """The session of `session_key` (other than `session_id`) a reset ended last."""
    row = conn.execute(
        "SELECT session_id FROM sessions WHERE session_key = ? AND session_id != ?"
        " AND end_reason = ? ORDER BY ended_at DESC LIMIT 1",
        (session_key, session_id, END_RESET),
    ).fetchone()
    return row[0] if row else None
