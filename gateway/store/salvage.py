"""Rebuilding a damaged state.db: the rows it still yields, copied into a fresh one.

Tables are copied parents first, each in storage order until its first unreadable row.
Every routing entry gets its `sessions` row back, `sessions.json` (the mirror) fills in
keys nothing was salvaged for, and a key whose entry was lost gets one pointing at its
latest open session. `hermes-gateway doctor --repair` (`gateway.ops.doctor`) sets the
damaged files aside and swaps the fresh database in.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

from gateway.domain.session import SessionEntry, SessionSource
from gateway.store import entries
from gateway.store.db import Database

#: tables copied out of a damaged database, parents first; `turns` (in-flight markers of
#: a damaged run) is not trusted, the search index (search.db) is rebuilt by the
#: gateway from the copied messages, and so are the rolling summaries
#: (`summary_checkpoints`: the summary strategy writes them again as sessions grow)
SALVAGED_TABLES = (
    "sessions",
    "session_entries",
    "session_entry_docs",
    "messages",
    "inbox",
    "outbound",
)
_SCAN_ORDER = {  # WITHOUT ROWID
    "sessions": "session_id",
    "session_entries": "session_key",
    "session_entry_docs": "session_key",
}


def _copy_table(src: sqlite3.Connection, dst: sqlite3.Connection, table: str) -> str:
    """Copy rows in storage order until the first unreadable one; returns a summary."""
    # The columns both have: a damaged file from before a migration that added one
    # (outbound.edit_message_id, schema 13) still gives up its rows.
    names = [row[1] for row in dst.execute(f"PRAGMA table_info({table})")]
    with contextlib.suppress(sqlite3.DatabaseError):
        present = {row[1] for row in src.execute(f"PRAGMA table_info({table})")}
        names = [name for name in names if name in present] if present else names
    columns = ", ".join(names)
    insert = f"INSERT OR IGNORE INTO {table} ({columns}) VALUES ({', '.join('?' * len(names))})"
    copied = skipped = 0
    stopped = ""
    try:
        rows = src.execute(
            f"SELECT {columns} FROM {table} ORDER BY {_SCAN_ORDER.get(table, 'rowid')}"
        )
        while (row := rows.fetchone()) is not None:
            try:
                if dst.execute(insert, row).rowcount:
                    copied += 1
                else:
                    skipped += 1
            except sqlite3.IntegrityError:  # e.g. a message whose session row was lost
                skipped += 1
    except sqlite3.DatabaseError as exc:
        stopped = f", then stopped: {exc}"
    return f"{table} {copied}" + (f" ({skipped} skipped)" if skipped else "") + stopped


def _restore_session_rows(conn: sqlite3.Connection, mirror: dict[str, SessionEntry]) -> int:
    """Before messages are copied, every routing entry needs its `sessions` row: recreate
    it for salvaged entries whose row was lost, and import mirror entries of keys nothing
    was salvaged for (what the store does with a legacy sessions.json). Returns imports."""
    for (key,) in conn.execute("SELECT session_key FROM session_entries").fetchall():
        try:
            entry = entries.load_entry(conn, key)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, OSError):
            continue  # a garbled row (its origin, its times)
        if entry is not None:
            entries.start_session_row(conn, entry)
    known = {key for (key,) in conn.execute("SELECT DISTINCT session_key FROM sessions")}
    imported = 0
    taken = "SELECT 1 FROM sessions WHERE session_id = ?"
    for key, entry in mirror.items():
        if key not in known and not conn.execute(taken, (entry.session_id,)).fetchone():
            entries.start_session_row(conn, entry)
            entries.save_entry(conn, entry)
            imported += 1
    return imported


def _rebuild_entries(conn: sqlite3.Connection, mirror: dict[str, SessionEntry]) -> tuple[int, int]:
    """An entry for each key whose entry was lost, pointing at its latest open session.

    Keys whose sessions all ended were pruned (or lost their current row) and get none:
    their next message starts a fresh session. Returns (rebuilt, of which from mirror).
    """
    rows = conn.execute(
        f"SELECT session_key, session_id, origin, started_at, {', '.join(entries.COUNTERS)},"
        " (SELECT MAX(created_at) FROM messages m WHERE m.session_id = s.session_id)"
        " FROM sessions s WHERE ended_at IS NULL AND NOT EXISTS (SELECT 1 FROM"
        " session_entries e WHERE e.session_key = s.session_key)"
        " ORDER BY session_key, started_at DESC, session_id DESC"
    ).fetchall()
    done: set[str] = set()
    from_mirror = 0
    for key, session_id, origin, started_at, *counters, last_message in rows:
        if key in done:
            continue
        entry = mirror.get(key)
        if entry is not None and entry.session_id == session_id:
            from_mirror += 1
        else:
            try:
                entry = _entry_from_row(key, session_id, origin, started_at, last_message)
            except (TypeError, ValueError, OverflowError, OSError):
                continue  # a garbled row: that key starts afresh
            for name, value in zip(entries.COUNTERS, counters, strict=True):
                setattr(entry, name, value)
        entries.save_entry(conn, entry)
        done.add(key)
    return len(done), from_mirror


def _entry_from_row(
    key: str, session_id: str, origin: str | None, started_at: float, last: float | None
) -> SessionEntry:
    """What `entries.fresh_entry` would have made for this session, touched at `last`."""
    try:
        source = SessionSource.from_dict(json.loads(origin)) if origin else None
    except (TypeError, ValueError):
        source = None
    entry = entries.fresh_entry(key, source, datetime.fromtimestamp(started_at, UTC))
    entry.session_id = session_id
    entry.updated_at = datetime.fromtimestamp(last or started_at, UTC)
    return entry


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    try:
        return any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})"))
    except sqlite3.DatabaseError:
        return False


def _copy_v6_entries(src: sqlite3.Connection, dst: sqlite3.Connection) -> str:
    """The entries of a database damaged before it reached schema 7 (one JSON text each),
    in storage order until the first unreadable row; returns a summary."""
    copied = skipped = 0
    stopped = ""
    try:
        rows = src.execute("SELECT entry FROM session_entries ORDER BY session_key")
        while (row := rows.fetchone()) is not None:
            try:
                entries.save_entry(dst, SessionEntry.from_dict(json.loads(row[0])))
                copied += 1
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
                skipped += 1
    except sqlite3.DatabaseError as exc:
        stopped = f", then stopped: {exc}"
    return f"session_entries {copied}" + (f" ({skipped} skipped)" if skipped else "") + stopped


async def create_database(path: Path) -> None:
    db = Database(path)  # the real schema and file modes
    await db.open()
    await db.close()


def salvage(src: sqlite3.Connection, target: Path, mirror: dict[str, SessionEntry]) -> str:
    """Copy what `src` (a damaged database, read-only) still yields into the fresh
    database at `target`, then rebuild its routing index; returns a summary."""
    dst = sqlite3.connect(target, isolation_level=None)
    try:
        dst.execute("PRAGMA foreign_keys=ON")
        dst.execute("BEGIN")
        copied = [_copy_table(src, dst, table) for table in SALVAGED_TABLES[:1]]
        if _has_column(src, "session_entries", "entry"):
            copied.append(_copy_v6_entries(src, dst))
        else:
            copied += [_copy_table(src, dst, table) for table in SALVAGED_TABLES[1:3]]
        imported = _restore_session_rows(dst, mirror)
        copied += [_copy_table(src, dst, table) for table in SALVAGED_TABLES[3:]]
        rebuilt, from_mirror = _rebuild_entries(dst, mirror)
        dst.execute("COMMIT")
    finally:
        dst.close()
    return (
        f"rows salvaged: {'; '.join(copied)}. Routing entries rebuilt: {rebuilt}"
        f" ({from_mirror} from sessions.json), imported from sessions.json: {imported}"
    )
