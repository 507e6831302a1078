"""Deleting one session and everything that belongs to it, in one transaction.

What goes, and why that way:

- every row of every state.db table with a `session_id` column that names the session
  (messages, the `sessions` row, turn markers, and whatever later features attach to a
  session: summary checkpoints, notes ...), found through `sqlite_master` so a new
  table is covered without touching this file. The routing tables (`session_entries*`)
  are left to `gateway.store.entries`: a routing entry whose current session this is
  is pointed at a fresh session first (`entries.replace_session`), as after /new.
- the search index: deleting a message appends its id to `fts_log` (a trigger), and
  the indexer drops it from search.db in its next round (at most a fraction of a second
  in the daemon; callers that must be sure call `FtsIndexer.catch_up`). A search never
  shows it meanwhile: every hit is joined to its row in state.db (`gateway.store.search`).
- the journal is keyed by chat (session_key), not by session, and must keep its rows:
  a finished inbox row's platform message id still deduplicates a redelivery, and an
  outbound row's id is the HTTP API's reply cursor. So their texts are scrubbed
  instead: finished inbox rows (`event`, which holds the message text) and sent
  replies (`text`) of the session's key recorded while the session could have been
  written to (from the end of the key's previous session to the end of this one, or
  now), and the key's sent replies that name the session's id. Command replies are
  recorded without a key, so those of the session's chat count as the key's. The
  window may also cover another session of the same chat (after /resume switched back
  and forth, or another user's in a shared group): those lose only delivery records,
  never a transcript. Pending replies are left to be delivered (a session cannot be
  deleted while its turn runs).

Refused (`SessionBusy`) while a turn marker names the session: a running (or
interrupted, not yet re-run) turn would write to it again.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from gateway.store import codec, entries
from gateway.store.pg import is_postgres

SCRUBBED_EVENT = "{}"  # what a finished inbox row keeps of its event
# Left to gateway.store.entries (its tables are being reshaped; never raw SQL here).
_ROUTING_TABLE_PREFIX = "session_entries"
_MEMORY_INDEX_PREFIX = "memory_"  # PostgreSQL: long-term memory's index tables


class SessionBusy(Exception):
    """A turn is running in (or will re-run into) the session; it cannot be deleted."""


def tables_with_session_id(conn: sqlite3.Connection) -> list[str]:
    """Every table of state.db with a `session_id` column, `sessions` last (it is what
    the others refer to). On PostgreSQL, the store's schema's tables, but not long-term
    memory's index (`memory_*`): derived, it follows the deleted messages through
    `fts_log` as memory.db does (gateway.memory.pg_index)."""
    if is_postgres(conn):
        names = [
            name
            for (name,) in conn.execute(
                "SELECT table_name FROM information_schema.columns"
                " WHERE table_schema = current_schema() AND column_name = 'session_id'"
                " ORDER BY table_name"
            )
            if not name.startswith((_ROUTING_TABLE_PREFIX, _MEMORY_INDEX_PREFIX))
        ]
        return sorted(names, key=lambda name: name == "sessions")
    names = [
        name
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            " ORDER BY name"
        )
        if not name.startswith(_ROUTING_TABLE_PREFIX)
        and any(col[1] == "session_id" for col in conn.execute(f'PRAGMA table_info("{name}")'))
    ]
    return sorted(names, key=lambda name: name == "sessions")


def delete_session(
    conn: sqlite3.Connection, session_id: str, now: datetime
) -> dict[str, Any] | None:
    """Delete the session; None when there is no such session. Returns
    {session_id, session_key, messages, new_session_id (when it was current, else None),
    rows (per table), scrubbed (journal rows)}."""
    row = conn.execute(
        "SELECT session_key, origin, started_at, ended_at FROM sessions WHERE session_id = ?",
        (session_id,),
    ).fetchone()
    if row is None:
        return None
    key, origin, started, ended = row
    if conn.execute("SELECT 1 FROM turns WHERE session_id = ?", (session_id,)).fetchone():
        raise SessionBusy(f"a turn is running in session {session_id}")
    entry = entries.load_entry(conn, key)
    new_session_id = None
    if entry is not None and entry.session_id == session_id:
        new_session_id = entries.replace_session(conn, entry, None, now).session_id
        ended = None  # it was current until now
    scrubbed = _scrub_journal(conn, session_id, key, origin, started, ended, now.timestamp())
    deleted = {
        table: conn.execute(f'DELETE FROM "{table}" WHERE session_id = ?', (session_id,)).rowcount
        for table in tables_with_session_id(conn)
    }
    return {
        "session_id": session_id,
        "session_key": key,
        "messages": deleted.get("messages", 0),
        "new_session_id": new_session_id,
        "rows": {table: count for table, count in deleted.items() if count},
        "scrubbed": scrubbed,
    }


def _scrub_journal(
    conn: sqlite3.Connection,
    session_id: str,
    key: str,
    origin: str | None,
    started: float,
    ended: float | None,
    now: float,
) -> int:
    """Empty the texts of the key's finished inbox rows and sent replies recorded from the
    previous session's end to this one's end (see the module's docstring), and of the
    key's sent replies that name the session (/status, /resume lists)."""
    previous = conn.execute(
        "SELECT max(ended_at) FROM sessions WHERE session_key = ? AND ended_at <= ?",
        (key, started),
    ).fetchone()[0]
    lo, hi = previous or 0.0, ended if ended is not None else now
    inbox = conn.execute(
        "UPDATE inbox SET event = ? WHERE session_key = ? AND state != 'accepted'"
        " AND accepted_at BETWEEN ? AND ? AND event != ?",
        (SCRUBBED_EVENT, key, lo, hi, SCRUBBED_EVENT),
    ).rowcount
    # Command replies (/status names the session and its title) are recorded without a
    # key: the chat's are included, through the (platform, chat_id, id) index.
    chat = _chat_of(origin)
    whose, params = "session_key = ?", [key]
    if chat is not None:
        whose = "platform = ? AND chat_id = ? AND coalesce(session_key, ?) = ?"
        params = [*chat, key, key]
    outbound = conn.execute(
        f"UPDATE outbound SET text = '', attachment = NULL WHERE {whose} AND state = 'sent'"
        " AND (created_at BETWEEN ? AND ? OR instr(text, ?) > 0)"
        " AND (text != '' OR attachment IS NOT NULL)",
        (*params, lo, hi, session_id),
    ).rowcount
    return inbox + outbound


def _chat_of(origin: str | None) -> tuple[str, str] | None:
    data = codec.loads(origin) if origin else None
    if not isinstance(data, dict) or not data.get("platform") or not data.get("chat_id"):
        return None
    return str(data["platform"]), str(data["chat_id"])
