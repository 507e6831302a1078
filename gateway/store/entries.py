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

from gateway.domain.session import Platform, SessionEntry, SessionSource, TokenUsage
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


#: the hot row's columns a save writes besides session_key, session_id and active_minute,
#: in the order `_hot_values` gives them
_HOT = (
    "created_at",
    "updated_at",
    "suspended",
    "resume_pending",
    "expiry_finalized",
    "was_auto_reset",
    "is_fresh_reset",
    "reset_had_activity",
    "auto_reset_reason",
    "resume_reason",
    "last_resume_marked_at",
    "cost_status",
    *COUNTERS,
    "last_prompt_tokens",
)
_HOT_SET = ", ".join(f"{name} = ?" for name in _HOT)
_HOT_UPSERT = (
    f"INSERT INTO session_entries ({', '.join(_HOT)}, session_key, session_id, active_minute)"
    f" VALUES ({', '.join('?' * (len(_HOT) + 3))}) ON CONFLICT(session_key) DO UPDATE SET"
    " session_id = excluded.session_id, active_minute = excluded.active_minute, "
    + ", ".join(f"{name} = excluded.{name}" for name in _HOT)
)
_COLD_UPSERT = (
    "INSERT INTO session_entry_docs (session_key, origin, display_name, platform, chat_type)"
    " VALUES (?, ?, ?, ?, ?) ON CONFLICT(session_key) DO UPDATE SET origin = excluded.origin,"
    " display_name = excluded.display_name, platform = excluded.platform,"
    " chat_type = excluded.chat_type"
)
#: a whole entry: hot row and cold row, in the field order of `SessionEntry`
_SELECT_ENTRY = (
    "SELECT h.session_key, h.session_id, h.created_at, h.updated_at, d.origin,"
    f" d.display_name, d.platform, d.chat_type, {', '.join('h.' + c for c in COUNTERS)},"
    " h.cost_status, h.last_prompt_tokens, h.was_auto_reset, h.auto_reset_reason,"
    " h.reset_had_activity, h.is_fresh_reset, h.expiry_finalized, h.suspended,"
    " h.resume_pending, h.resume_reason, h.last_resume_marked_at"
    " FROM session_entries h LEFT JOIN session_entry_docs d ON d.session_key = h.session_key"
)
_SELECT_ENTRY_AND_MINUTE = _SELECT_ENTRY.replace(" FROM ", ", h.active_minute FROM ", 1)
#: the hot fields of one key's entry, in the field order of `SessionEntry`, and the row's
#: active_minute last
_SELECT_HOT = (
    f"SELECT session_id, created_at, updated_at, {_COUNTER_COLUMNS}, cost_status,"
    " last_prompt_tokens, was_auto_reset, auto_reset_reason, reset_had_activity,"
    " is_fresh_reset, expiry_finalized, suspended, resume_pending, resume_reason,"
    " last_resume_marked_at, active_minute, token_factor FROM session_entries"
    " WHERE session_key = ?"
)
_from_epoch = datetime.fromtimestamp


def load_entry(conn: sqlite3.Connection, session_key: str) -> SessionEntry | None:
    """The whole entry of `session_key` (hot row and cold row)."""
    row = conn.execute(f"{_SELECT_ENTRY} WHERE h.session_key = ?", (session_key,)).fetchone()
    return _entry_of(row) if row else None


def load_hot(
    conn: sqlite3.Connection, session_key: str, source: SessionSource
) -> tuple[SessionEntry, int, float | None] | None:
    """A turn's entry, from the hot row alone (one primary-key look-up, no JSON), the
    row's active_minute and its stored token calibration. `platform` and `chat_type` come
    from `source` (the key was built from it); `origin` and `display_name`, which a turn
    neither reads nor changes, are None.
    """
    row = conn.execute(_SELECT_HOT, (session_key,)).fetchone()
    if row is None:
        return None
    (sid, created, updated, i, o, cr, cw, total, cost, status, prompt, auto, reason, activity,
     fresh, finalized, suspended, pending, resume, marked, minute, factor) = row  # fmt: skip
    entry = SessionEntry(
        session_key, sid, _from_epoch(created, UTC), _from_epoch(updated, UTC), None, None,
        source.platform, source.chat_type, i, o, cr, cw, total, cost, status, prompt,
        bool(auto), reason, bool(activity), bool(fresh), bool(finalized), bool(suspended),
        bool(pending), resume, None if marked is None else _from_epoch(marked, UTC),
    )  # fmt: skip
    return entry, minute, factor


def _entry_of(row: tuple[Any, ...]) -> SessionEntry:
    """A `SessionEntry` from a row of `_SELECT_ENTRY`. A hot row without its cold row
    (which every write makes together) reads as an entry of no known origin."""
    (key, sid, created, updated, origin, display_name, platform, chat_type, i, o, cr, cw,
     total, cost, status, prompt, auto, reason, activity, fresh, finalized, suspended,
     pending, resume, marked) = row  # fmt: skip
    return SessionEntry(
        key, sid, _from_epoch(created, UTC), _from_epoch(updated, UTC),
        SessionSource.from_dict(codec.loads(origin)) if origin else None, display_name,
        Platform(platform) if platform else None, chat_type or "dm", i, o, cr, cw, total,
        cost, status, prompt, bool(auto), reason, bool(activity), bool(fresh),
        bool(finalized), bool(suspended), bool(pending), resume,
        None if marked is None else _from_epoch(marked, UTC),
    )  # fmt: skip


def minute_of(moment: datetime | float) -> int:
    """The `active_minute` bucket of a time (UTC epoch minutes)."""
    epoch = moment.timestamp() if isinstance(moment, datetime) else moment
    return int(epoch // 60)


def save_entry(conn: sqlite3.Connection, entry: SessionEntry) -> None:
    """Write one whole entry: its hot row and its cold row (for a new session, a reset, an
    import: whatever may change origin, display name, platform or chat type)."""
    save_hot(conn, entry)
    origin = codec.dumps(entry.origin.to_dict()) if entry.origin else None
    platform = entry.platform.value if entry.platform else None
    conn.execute(
        _COLD_UPSERT, (entry.session_key, origin, entry.display_name, platform, entry.chat_type)
    )


def save_hot(conn: sqlite3.Connection, entry: SessionEntry) -> None:
    """Write the hot row of an entry whose cold fields did not change. The common case
    (same session id) is a single UPDATE that leaves the session_id index alone and
    rewrites the `active_minute` index only when the minute changed; a new or re-pointed
    key needs the full upsert."""
    values = _hot_values(entry)
    row = conn.execute(
        f"UPDATE session_entries SET {_HOT_SET} WHERE session_key = ? AND session_id = ?"
        " RETURNING active_minute",
        (*values, entry.session_key, entry.session_id),
    ).fetchone()
    minute = minute_of(entry.updated_at)
    if row is None:
        conn.execute(_HOT_UPSERT, (*values, entry.session_key, entry.session_id, minute))
    elif row[0] != minute:
        conn.execute(
            "UPDATE session_entries SET active_minute = ? WHERE session_key = ?",
            (minute, entry.session_key),
        )


def load_to_touch(conn: sqlite3.Connection, session_key: str) -> tuple[SessionEntry, int] | None:
    """`load_entry`, and the row's active_minute for `touch`."""
    row = conn.execute(
        f"{_SELECT_ENTRY_AND_MINUTE} WHERE h.session_key = ?", (session_key,)
    ).fetchone()
    return (_entry_of(row[:-1]), row[-1]) if row else None


def touch(conn: sqlite3.Connection, entry: SessionEntry, minute: int, now: datetime) -> None:
    """`entry.updated_at` moved to `now` and nothing else (a session that continues, loaded
    by `load_to_touch` in this transaction, its row's active_minute `minute`): one UPDATE
    of that column, not the whole hot row, and of active_minute (whose index it rewrites)
    only when the minute changed."""
    entry.updated_at = now
    moment, new_minute = now.timestamp(), minute_of(now)
    if new_minute == minute:
        conn.execute(
            "UPDATE session_entries SET updated_at = ? WHERE session_key = ?",
            (moment, entry.session_key),
        )
    else:
        conn.execute(
            "UPDATE session_entries SET active_minute = ?, updated_at = ? WHERE session_key = ?",
            (new_minute, moment, entry.session_key),
        )


def _hot_values(entry: SessionEntry) -> tuple[Any, ...]:
    """The values of `_HOT` for one entry."""
    marked = entry.last_resume_marked_at
    return (
        entry.created_at.timestamp(),
        entry.updated_at.timestamp(),
        int(entry.suspended),
        int(entry.resume_pending),
        int(entry.expiry_finalized),
        int(entry.was_auto_reset),
        int(entry.is_fresh_reset),
        int(entry.reset_had_activity),
        entry.auto_reset_reason,
        entry.resume_reason,
        None if marked is None else marked.timestamp(),
        entry.cost_status,
        *counters_of(entry),
        entry.last_prompt_tokens,
    )


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
    _end_session(conn, entry.session_id, counters_of(entry), now, reason)


def _end_session(
    conn: sqlite3.Connection, session_id: str, counters: tuple[Any, ...], now: datetime, reason: str
) -> None:
    conn.execute(
        f"UPDATE sessions SET ended_at = ?, end_reason = ?, {_SET_COUNTERS}"
        " WHERE session_id = ? AND ended_at IS NULL",
        (now.timestamp(), reason, *counters, session_id),
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


def drop_entry(conn: sqlite3.Connection, session_key: str) -> bool:
    """Remove `session_key`'s routing entry (hot row and cold row), starting no session
    in its place: the key's next message routes as a brand-new chat's first. Returns
    whether there was one."""
    dropped = conn.execute(
        "DELETE FROM session_entries WHERE session_key = ?", (session_key,)
    ).rowcount
    conn.execute("DELETE FROM session_entry_docs WHERE session_key = ?", (session_key,))
    return dropped > 0


def mark_active_since(conn: sqlite3.Connection, cutoff: float, now: datetime) -> int:
    """Mark entries touched since `cutoff` (epoch) resume_pending ("restart_interrupted"),
    skipping those already pending or suspended; returns how many."""
    return conn.execute(
        "UPDATE session_entries SET resume_pending = 1, resume_reason = 'restart_interrupted',"
        " last_resume_marked_at = ? WHERE active_minute >= ? AND updated_at >= ?"
        " AND suspended = 0 AND resume_pending = 0",
        (now.timestamp(), minute_of(cutoff), cutoff),
    ).rowcount


def settle_turn(
    conn: sqlite3.Connection,
    session_key: str,
    session_id: str,
    now: float,
    minute: int | None,
    usage: TokenUsage | None,
    succeeded: bool,
    token_factor: float | None = None,
) -> None:
    """A turn's end, as one UPDATE of the hot row (nothing loaded, nothing encoded):
    touched at `now`, the turn's usage added, the session's token calibration stored when
    it moved (`token_factor`), and when it succeeded its resume and reset flags consumed.
    `minute` is the new active_minute, None when the row holds it already
    (its index is then left alone). Only while `session_id` is still the key's session: a
    reset or switch since the turn began is left as it is."""
    sets = ["updated_at = ?"]
    params: list[Any] = [now]
    if minute is not None:
        sets.append("active_minute = ?")
        params.append(minute)
    if usage is not None:
        sets += [f"{name} = {name} + ?" for name in COUNTERS]
        params += [getattr(usage, name) for name in COUNTERS]
        if usage.estimated_cost_usd:
            sets.append("cost_status = 'estimated'")
        sets.append("last_prompt_tokens = ?")
        params.append(usage.input_tokens)
    if token_factor is not None:
        sets.append("token_factor = ?")
        params.append(token_factor)
    if succeeded:
        sets.append(
            "resume_pending = 0, resume_reason = NULL, was_auto_reset = 0, is_fresh_reset = 0"
        )
    conn.execute(
        f"UPDATE session_entries SET {', '.join(sets)} WHERE session_key = ? AND session_id = ?",
        (*params, session_key, session_id),
    )


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
            f" AND suspended = 0 RETURNING session_id, {_COUNTER_COLUMNS}",
            (key, cutoff),
        ).fetchone()
        if row:
            conn.execute("DELETE FROM session_entry_docs WHERE session_key = ?", (key,))
            _end_session(conn, row[0], tuple(row[1:]), now, END_PRUNED)
            pruned += 1
    return pruned


def agent_key_range(agent_id: str) -> tuple[str, str]:
    """The bounds [low, high) of every session key of one agent (`agent:{id}:...`): ';'
    is the character after ':', so `key >= low AND key < high` is the key prefix, as a
    range the primary-key and `sessions_by_key` indexes can seek."""
    prefix = f"agent:{agent_id}:"
    return prefix, prefix[:-1] + ";"


def list_entries(
    conn: sqlite3.Connection, since: float | None = None, agent_id: str | None = None
) -> list[SessionEntry]:
    """All entries (or those touched since `since`, epoch; of one agent), most recently
    active first."""
    terms: list[str] = []
    params: tuple[Any, ...] = ()
    if since is not None:
        terms.append("h.active_minute >= ? AND h.updated_at >= ?")
        params = (minute_of(since), since)
    if agent_id is not None:
        terms.append("h.session_key >= ? AND h.session_key < ?")
        params += agent_key_range(agent_id)
    sql = _SELECT_ENTRY + (" WHERE " + " AND ".join(terms) if terms else "")
    sql += " ORDER BY h.updated_at DESC, h.session_key"
    return [_entry_of(row) for row in conn.execute(sql, params)]


def list_entries_page(
    conn: sqlite3.Connection,
    after: str | None,
    limit: int,
    since: float | None = None,
    agent_id: str | None = None,
) -> list[SessionEntry]:
    """Up to `limit` entries with a key after `after`, in session-key order (the primary
    key's index on both engines: a page costs its rows however deep it is, and a key
    never moves, so a paging client sees every entry once); only those of one agent
    (a key range) and touched since `since` (epoch; a filter on the walk) when given."""
    terms: list[str] = []
    params: tuple[Any, ...] = ()
    if after is not None:
        terms.append("h.session_key > ?")
        params += (after,)
    if agent_id is not None:
        terms.append("h.session_key >= ? AND h.session_key < ?")
        params += agent_key_range(agent_id)
    if since is not None:
        terms.append("h.active_minute >= ? AND h.updated_at >= ?")
        params += (minute_of(since), since)
    sql = _SELECT_ENTRY + (" WHERE " + " AND ".join(terms) if terms else "")
    sql += " ORDER BY h.session_key LIMIT ?"
    return [_entry_of(row) for row in conn.execute(sql, (*params, limit))]


def idle_page(
    conn: sqlite3.Connection, cutoff: float, after: tuple[int, str], page: int
) -> list[tuple[int, str, SessionEntry]]:
    """(active_minute, key, entry) of up to `page` entries not finalized and untouched since
    `cutoff` (epoch), in (active_minute, key) order after `after`."""
    rows = conn.execute(
        f"SELECT h.active_minute, {_SELECT_ENTRY.removeprefix('SELECT ')}"
        " WHERE h.active_minute <= ? AND (h.active_minute, h.session_key) > (?, ?)"
        " AND h.expiry_finalized = 0 AND h.updated_at < ?"
        " ORDER BY h.active_minute, h.session_key LIMIT ?",
        (minute_of(cutoff), *after, cutoff, page),
    ).fetchall()
    return [(row[0], row[1], _entry_of(row[1:])) for row in rows]


def load_by_session_id(conn: sqlite3.Connection, session_id: str) -> SessionEntry | None:
    """The entry whose current session is `session_id`, if any."""
    row = conn.execute(f"{_SELECT_ENTRY} WHERE h.session_id = ?", (session_id,)).fetchone()
    return _entry_of(row) if row else None


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


def import_entries(conn: sqlite3.Connection, imported: dict[str, SessionEntry]) -> int:
    """Entries read from a legacy sessions.json, each with its session row."""
    for key, entry in imported.items():
        entry.session_key = key
        start_session_row(conn, entry)
        save_entry(conn, entry)
    return len(imported)
