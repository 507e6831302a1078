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

#: What a turn changes in an entry, kept in columns as well as in its JSON: `updated_at`
#: in `session_entries`, the counters (and `last_prompt_tokens`) in the current
#: session's `sessions` row, which always holds them. The columns are the truth: a
#: continuing session's turn writes only them (`save_live`: two narrow UPDATEs, no
#: encoding), so the JSON's copies may lag until the entry is next saved whole. Every
#: reader takes them from the columns: `ENTRY_COLUMNS` from `ENTRY_FROM` with
#: `entry_from_row` in Python, `MERGED_ENTRY_SQL` in SQL. (Not more columns in
#: `session_entries`: its rows, about 1 KB of JSON, would then spill onto overflow pages,
#: which made every write of the table slower.)
LIVE = ("updated_at", *COUNTERS, "last_prompt_tokens")
_LIVE_NUMBERS = LIVE[1:]
ENTRY_FROM = "session_entries e LEFT JOIN sessions s ON s.session_id = e.session_id"
ENTRY_COLUMNS = "e.entry, e.updated_at, " + ", ".join(f"s.{name}" for name in _LIVE_NUMBERS)
#: entry fields a turn may change that have no column: a turn that changes one saves
#: the entry whole (a reset's first turn, a resumed turn, the first cost estimate)
JSON_ONLY_TURN_FIELDS = (
    "cost_status",
    "resume_pending",
    "resume_reason",
    "was_auto_reset",
    "is_fresh_reset",
)
_TOUCH = "UPDATE session_entries SET updated_at = ? WHERE session_key = ? AND session_id = ?"
_TOUCH_NEW_MINUTE = (
    "UPDATE session_entries SET updated_at = ?, active_minute = ?"
    " WHERE session_key = ? AND session_id = ?"
)
_SAVE_NUMBERS = (
    f"UPDATE sessions SET {', '.join(f'{name} = ?' for name in _LIVE_NUMBERS)},"
    " entry_lags = ? WHERE session_id = ?"
)
_MICROSECONDS = "CAST(round((e.updated_at - CAST(e.updated_at AS INTEGER)) * 1000000) AS INTEGER)"
#: `updated_at` (epoch seconds) as the entry JSON writes it (`datetime.isoformat` in UTC:
#: microseconds unless there are none)
_ISO_UPDATED_AT = (
    "strftime('%Y-%m-%dT%H:%M:%S', e.updated_at, 'unixepoch')"
    f" || CASE {_MICROSECONDS} WHEN 0 THEN '' ELSE printf('.%06d', {_MICROSECONDS}) END"
    " || '+00:00'"
)
#: the entry JSON (from `ENTRY_FROM`) with the live columns merged over it by SQLite
#: where it lags them (`sessions.entry_lags`, set by `save_live`, cleared by a whole
#: save): the mirror copies entries this way, without decoding them in Python
_MERGED = (
    f"json_set(e.entry, '$.updated_at', {_ISO_UPDATED_AT}, "
    + ", ".join(f"'$.{name}', s.{name}" for name in _LIVE_NUMBERS)
    + ")"
)
MERGED_ENTRY_SQL = f"CASE WHEN s.entry_lags THEN {_MERGED} ELSE e.entry END"

END_RESET = "session_reset"
END_SWITCH = "session_switch"
END_PRUNED = "pruned"


def new_session_id(now: datetime) -> str:
    """`YYYYMMDD_HHMMSS_<8hex>` in UTC."""
    return f"{now.astimezone(UTC):%Y%m%d_%H%M%S}_{secrets.token_hex(4)}"


def entry_from_row(row: Any) -> SessionEntry:
    """An entry from a row of `ENTRY_COLUMNS`: the JSON, with the live columns over it
    (the JSON's own numbers where its `sessions` row is missing)."""
    raw, updated_at, *numbers = row
    entry = SessionEntry.from_dict(codec.loads(raw))
    entry.updated_at = datetime.fromtimestamp(updated_at, UTC)
    if numbers[0] is None:
        return entry
    (
        entry.input_tokens,
        entry.output_tokens,
        entry.cache_read_tokens,
        entry.cache_write_tokens,
        entry.total_tokens,
        entry.estimated_cost_usd,
        entry.last_prompt_tokens,
    ) = numbers
    return entry


def load_entry(conn: sqlite3.Connection, session_key: str) -> SessionEntry | None:
    row = conn.execute(
        f"SELECT {ENTRY_COLUMNS} FROM {ENTRY_FROM} WHERE e.session_key = ?", (session_key,)
    ).fetchone()
    return entry_from_row(row) if row else None


def encode_entry(entry: SessionEntry) -> str:
    return codec.dumps(entry.to_dict())


def minute_of(moment: datetime | float) -> int:
    """The `active_minute` bucket of a time (UTC epoch minutes)."""
    epoch = moment.timestamp() if isinstance(moment, datetime) else moment
    return int(epoch // 60)


_SAVED = (
    "updated_at",
    "suspended",
    "resume_pending",
    "expiry_finalized",
    "entry",
)
_UPDATE_SAVED = (
    f"UPDATE session_entries SET {', '.join(f'{name} = ?' for name in _SAVED)}"
    " WHERE session_key = ? AND session_id = ? RETURNING active_minute"
)
_UPSERT_SAVED = (
    f"INSERT INTO session_entries ({', '.join(_SAVED)}, session_key, session_id,"
    f" active_minute) VALUES ({', '.join('?' * (len(_SAVED) + 3))})"
    " ON CONFLICT(session_key) DO UPDATE SET session_id = excluded.session_id,"
    " active_minute = excluded.active_minute, "
    + ", ".join(f"{name} = excluded.{name}" for name in _SAVED)
)


def save_entry(conn: sqlite3.Connection, entry: SessionEntry) -> None:
    """Write one entry whole (its JSON and every column). The common case (same session
    id) is a single UPDATE that leaves the session_id index alone and rewrites the
    `active_minute` index only when the minute changed; a new or re-pointed key needs
    the full upsert."""
    values = _row_values(entry)
    if not _update_in_place(conn, entry, values):
        conn.execute(_UPSERT_SAVED, (*values, entry.session_id, minute_of(entry.updated_at)))
    _save_numbers(conn, entry)


def _save_numbers(conn: sqlite3.Connection, entry: SessionEntry, lags: bool = False) -> None:
    numbers = tuple(getattr(entry, name) for name in _LIVE_NUMBERS)
    conn.execute(_SAVE_NUMBERS, (*numbers, int(lags), entry.session_id))


def catch_up_json(conn: sqlite3.Connection) -> int:
    """Bring the entry JSON of every entry that lags its live columns up to date (at
    close: at rest, state.db's entries are whole); returns how many."""
    count = conn.execute(
        f"UPDATE session_entries AS e SET entry = {_MERGED} FROM sessions AS s"
        " WHERE s.session_id = e.session_id AND s.entry_lags"
    ).rowcount
    if count:
        conn.execute("UPDATE sessions SET entry_lags = 0 WHERE entry_lags")
    return count


def save_live(conn: sqlite3.Connection, entry: SessionEntry, stored: SessionEntry) -> bool:
    """Write only what a turn changed (`LIVE`) of `entry`, whose row holds `stored` (the
    same session, same JSON-only fields): `updated_at` (and the `active_minute` index only
    when the minute changed) and the session's numbers, no encoding. False (nothing
    written) when the row is gone or points at another session."""
    key, session_id, updated_at = entry.session_key, entry.session_id, entry.updated_at
    minute = minute_of(updated_at)
    if minute == minute_of(stored.updated_at):
        touched = conn.execute(_TOUCH, (updated_at.timestamp(), key, session_id))
    else:
        touched = conn.execute(_TOUCH_NEW_MINUTE, (updated_at.timestamp(), minute, key, session_id))
    if touched.rowcount != 1:
        return False
    _save_numbers(conn, entry, lags=True)
    return True


def only_live_changed(entry: SessionEntry, stored: SessionEntry) -> bool:
    """Whether `save_live` can write `entry` over `stored` (no JSON-only field differs)."""
    return entry.session_id == stored.session_id and all(
        getattr(entry, name) == getattr(stored, name) for name in JSON_ONLY_TURN_FIELDS
    )


def _row_values(entry: SessionEntry) -> tuple[Any, ...]:
    """The `_SAVED` columns of an entry then its key, as both writes of an entry name them."""
    return (
        entry.updated_at.timestamp(),
        int(entry.suspended),
        int(entry.resume_pending),
        int(entry.expiry_finalized),
        encode_entry(entry),
        entry.session_key,
    )


def _update_in_place(
    conn: sqlite3.Connection, entry: SessionEntry, values: tuple[Any, ...]
) -> bool:
    """UPDATE the key's row if it holds the same session; False when no row matched."""
    row = conn.execute(_UPDATE_SAVED, (*values, entry.session_id)).fetchone()
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
    """Close the `sessions` row of `entry`'s current session (its counters are there
    already: the row holds them while the session is current, see `LIVE`)."""
    conn.execute(
        "UPDATE sessions SET ended_at = ?, end_reason = ?"
        " WHERE session_id = ? AND ended_at IS NULL",
        (now.timestamp(), reason, entry.session_id),
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
        f"SELECT {ENTRY_COLUMNS} FROM {ENTRY_FROM} WHERE e.active_minute >= ?"
        " AND e.updated_at >= ? AND e.suspended = 0 AND e.resume_pending = 0",
        (minute_of(cutoff), cutoff),
    ).fetchall()
    for row in rows:
        entry = entry_from_row(row)
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


def idle_page(
    conn: sqlite3.Connection, cutoff: float, after: tuple[int, str], page: int
) -> list[tuple[tuple[int, str], SessionEntry]]:
    """Up to `page` entries not finalized and idle since `cutoff` (epoch), after the
    (active_minute, session_key) position `after`, in that order, each with its position."""
    rows = conn.execute(
        f"SELECT e.active_minute, e.session_key, {ENTRY_COLUMNS} FROM {ENTRY_FROM}"
        " WHERE e.active_minute <= ? AND (e.active_minute, e.session_key) > (?, ?)"
        " AND e.expiry_finalized = 0 AND e.updated_at < ?"
        " ORDER BY e.active_minute, e.session_key LIMIT ?",
        (minute_of(cutoff), *after, cutoff, page),
    )
    return [((minute, key), entry_from_row(row)) for minute, key, *row in rows]


def prune(conn: sqlite3.Connection, keys: list[str], cutoff: float, now: datetime) -> int:
    """Drop the entries of `keys` still idle since `cutoff` (an entry may have been touched
    since `idle_keys` found it), ending their sessions; returns how many."""
    pruned = 0
    for key in keys:
        row = conn.execute(
            "DELETE FROM session_entries WHERE session_key = ? AND updated_at < ?"
            " AND suspended = 0 RETURNING entry, updated_at",
            (key, cutoff),
        ).fetchone()
        if row:
            end_session_row(conn, entry_from_row((*row, None)), now, END_PRUNED)
            pruned += 1
    return pruned


def list_entries(conn: sqlite3.Connection, since: float | None = None) -> list[SessionEntry]:
    """All entries (or those touched since `since`, epoch), most recently active first."""
    sql = f"SELECT {ENTRY_COLUMNS} FROM {ENTRY_FROM}"
    params: tuple[Any, ...] = ()
    if since is not None:
        sql += " WHERE e.active_minute >= ? AND e.updated_at >= ?"
        params = (minute_of(since), since)
    sql += " ORDER BY e.updated_at DESC, e.session_key"
    return [entry_from_row(row) for row in conn.execute(sql, params)]


def load_by_session_id(conn: sqlite3.Connection, session_id: str) -> SessionEntry | None:
    """The entry whose current session is `session_id`, if any."""
    row = conn.execute(
        f"SELECT {ENTRY_COLUMNS} FROM {ENTRY_FROM} WHERE e.session_id = ?", (session_id,)
    ).fetchone()
    return entry_from_row(row) if row else None


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
