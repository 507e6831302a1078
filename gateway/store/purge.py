"""Deleting one session and everything that belongs to it, in one transaction.

What goes, and why that way:

- every row of every state.db table with a `session_id` column that names the session
  (messages, the `sessions` row, turn markers, and whatever later features attach to a
  session: summary checkpoints, notes ...), found through `sqlite_master` so a new
  table is covered without touching this file. The routing tables (`session_entries*`)
  are left to `gateway.store.entries`: a routing entry whose current session this is
  goes too (`entries.drop_entry`), with no session started in its place, since a new
  one would carry the chat's origin (who wrote, their name) again; the chat's next
  message starts a session as a brand-new chat's first does.
- the search index: deleting a message appends its id to `fts_log` (a trigger), and
  the indexer drops it from search.db in its next round (at most a fraction of a second
  in the daemon; callers that must be sure call `FtsIndexer.catch_up`). A search never
  shows it meanwhile: every hit is joined to its row in state.db (`gateway.store.search`).
- the journal is keyed by chat (session_key), not by session. For one session deleted
  from a chat that goes on, its rows are kept: a finished inbox row's platform message
  id still deduplicates a redelivery, and an outbound row's id is the HTTP API's reply
  cursor. So they are scrubbed instead: finished inbox rows lose their `event` (the
  message text and its sender), sent replies their `text` and, of their `target`, all
  but the chat (`journal.delivery_target`: who was answered goes). The rows scrubbed
  are the session's key's recorded while the session could have been written to (from
  the end of the key's previous session to the end of this one, or now), and the key's
  sent replies that name the session's id. Command replies are recorded without a key,
  so those of the session's chat count as the key's. The window may also cover another
  session of the same chat (after /resume switched back and forth, or another user's
  in a shared group): those lose only delivery records, never a transcript. Pending
  replies are left to be delivered (a session cannot be deleted while its turn runs).
  When a user's data is deleted (`erase=True`) the same rows are deleted outright,
  since their chat id and key name the user: a redelivery of one of those messages is
  then a new message. `erase_user_journal` then takes the rest of theirs: what they
  sent outside any session's window (commands before a chat's first session), and all
  of their DM chats. Only the newest outbound row of all is kept, emptied of
  everything naming its chat, as `journal.expire_outbound` keeps it: SQLite would
  reuse its id, a reply cursor a client may have read past.

Refused (`SessionBusy`) while a turn marker names the session: a running (or
interrupted, not yet re-run) turn would write to it again.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.store import agent_tasks, codec, entries, journal, usage
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
    conn: sqlite3.Connection, session_id: str, now: datetime, *, erase: bool = False
) -> dict[str, Any] | None:
    """Delete the session; None when there is no such session. `erase`: the journal
    rows of its window are deleted, not scrubbed (a user's data deleted; see the
    module's docstring). Returns {session_id, session_key, messages, was_current
    (its routing entry went with it), rows (per table), scrubbed (journal rows)}."""
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
    was_current = entry is not None and entry.session_id == session_id
    if was_current:
        ended = None  # it was current until now
    window = _Window(session_id, key, _chat_of(origin), *_bounds(conn, key, started, ended, now))
    scrubbed = _erase_journal(conn, window) if erase else _scrub_journal(conn, window)
    deleted = {
        table: conn.execute(f'DELETE FROM "{table}" WHERE session_id = ?', (session_id,)).rowcount
        for table in tables_with_session_id(conn)
    }
    # An A2A context's tasks are keyed by chat, as the journal is: those of the window.
    deleted["agent_tasks"] = agent_tasks.delete_for_session(conn, key, window.lo, window.hi)
    if was_current:
        entries.drop_entry(conn, key)
        # A streamed reply's message ids, left by a turn that never finished.
        conn.execute("DELETE FROM streams WHERE session_key = ?", (key,))
        if erase:  # the chat's /model choice: its key names the user
            conn.execute("DELETE FROM chat_models WHERE session_key = ?", (key,))
    return {
        "session_id": session_id,
        "session_key": key,
        "messages": deleted.get("messages", 0),
        "was_current": was_current,
        "rows": {table: count for table, count in deleted.items() if count},
        "scrubbed": scrubbed,
    }


@dataclass(frozen=True, slots=True)
class _Window:
    """The journal rows a deleted session may have left: its key's (and its chat's
    keyless command replies) recorded from `lo` to `hi` (epoch), and its key's replies
    that name the session."""

    session_id: str
    key: str
    chat: tuple[str, str] | None
    lo: float
    hi: float

    def outbound(self) -> tuple[str, list[Any]]:
        """The WHERE clause (and its parameters) of the window's sent replies."""
        # Command replies (/status names the session and its title) are recorded without
        # a key: the chat's are included, through the (platform, chat_id, id) index.
        whose, params = "session_key = ?", [self.key]
        if self.chat is not None:
            whose = "platform = ? AND chat_id = ? AND coalesce(session_key, ?) = ?"
            params = [*self.chat, self.key, self.key]
        return (
            f"{whose} AND state = 'sent' AND (created_at BETWEEN ? AND ? OR instr(text, ?) > 0)",
            [*params, self.lo, self.hi, self.session_id],
        )


def _bounds(
    conn: sqlite3.Connection, key: str, started: float, ended: float | None, now: datetime
) -> tuple[float, float]:
    """From the end of the key's previous session to the end of this one (or now)."""
    previous = conn.execute(
        "SELECT max(ended_at) FROM sessions WHERE session_key = ? AND ended_at <= ?",
        (key, started),
    ).fetchone()[0]
    return previous or 0.0, ended if ended is not None else now.timestamp()


def _scrub_journal(conn: sqlite3.Connection, window: _Window) -> int:
    """Empty the texts of the window's finished inbox rows and sent replies."""
    inbox = conn.execute(
        "UPDATE inbox SET event = ? WHERE session_key = ? AND state != 'accepted'"
        " AND accepted_at BETWEEN ? AND ? AND event != ?",
        (SCRUBBED_EVENT, window.key, window.lo, window.hi, SCRUBBED_EVENT),
    ).rowcount
    where, params = window.outbound()
    outbound = 0
    for delivery_id, target, holds_text in conn.execute(
        f"SELECT id, target, text != '' OR attachment IS NOT NULL FROM outbound WHERE {where}",
        params,
    ).fetchall():
        chat_only = _chat_only(target)
        if holds_text or chat_only != target:
            conn.execute(
                "UPDATE outbound SET text = '', attachment = NULL, target = ? WHERE id = ?",
                (chat_only, delivery_id),
            )
            outbound += 1
    return inbox + outbound


def _chat_only(target: str) -> str:
    """A sent reply's target without who was answered (rows recorded before
    `journal.delivery_target` kept the whole source)."""
    return journal.delivery_target(codec.loads(target) if target else None)


def _erase_journal(conn: sqlite3.Connection, window: _Window) -> int:
    """Delete the window's finished inbox rows and sent replies."""
    inbox = conn.execute(
        "DELETE FROM inbox WHERE session_key = ? AND state != 'accepted'"
        " AND accepted_at BETWEEN ? AND ?",
        (window.key, window.lo, window.hi),
    ).rowcount
    return inbox + _erase_outbound(conn, *window.outbound())


def _erase_outbound(conn: sqlite3.Connection, where: str, params: list[Any]) -> int:
    """Delete the outbound rows `where` names; the newest row of all, when it is one of
    them, is kept with nothing of its chat (see the module's docstring)."""
    newest = conn.execute("SELECT max(id) FROM outbound").fetchone()[0] or 0
    erased = conn.execute(
        f"DELETE FROM outbound WHERE {where} AND id != ?", (*params, newest)
    ).rowcount
    erased += conn.execute(
        "UPDATE outbound SET chat_id = '', target = '{}', text = '', reply_to = NULL,"
        " session_key = NULL, platform_message_id = NULL, edit_message_id = NULL,"
        f" attachment = NULL WHERE id = ? AND {where}",
        (newest, *params),
    ).rowcount
    return erased


def erase_user_journal(
    conn: sqlite3.Connection,
    platform: str,
    user_id: str,
    agent_id: str | None,
    dm_chats: set[str],
) -> int:
    """What the journal keeps of one user beyond their deleted sessions' windows (see
    `delete_session`): the finished inbox rows they sent (commands sent while their chat
    had no session, messages in a shared group), with `agent_id` only those of that
    agent's session keys. Without: also every finished inbox row and sent reply of their
    DM chats (`dm_chats`, and those their inbox rows show), which are theirs alone (such
    as rows an earlier `delete_session` only scrubbed). Returns how many rows went."""
    low, high = entries.agent_key_range(agent_id) if agent_id is not None else ("", "")
    # The tasks they asked of the agents (A2A's caller is the session's user).
    erased = agent_tasks.delete_for_caller(conn, user_id, agent_id) if platform == "a2a" else 0
    # What they used (per day, agent and model) and the times of their last turns.
    erased += usage.delete_user(conn, f"{platform}:{user_id}", agent_id)
    theirs, chats = [], set(dm_chats)
    for inbox_id, key, event in conn.execute(
        "SELECT id, session_key, event FROM inbox WHERE platform = ? AND state != 'accepted'"
        " AND instr(event, ?) > 0",
        (platform, user_id),
    ).fetchall():
        source = codec.loads(event).get("source")
        if not isinstance(source, dict) or str(source.get("user_id")) != user_id:
            continue
        if agent_id is None or low <= key < high:
            theirs.append(inbox_id)
            if source.get("chat_type") == "dm" and source.get("chat_id"):
                chats.add(str(source["chat_id"]))
    erased += sum(
        conn.execute("DELETE FROM inbox WHERE id = ?", (inbox_id,)).rowcount for inbox_id in theirs
    )
    if agent_id is not None:
        return erased
    for chat_id in sorted(chats):
        erased += conn.execute(
            "DELETE FROM inbox WHERE platform = ? AND chat_id = ? AND state != 'accepted'",
            (platform, chat_id),
        ).rowcount
        erased += _erase_outbound(
            conn, "platform = ? AND chat_id = ? AND state = 'sent'", [platform, chat_id]
        )
    return erased


def _chat_of(origin: str | None) -> tuple[str, str] | None:
    data = codec.loads(origin) if origin else None
    if not isinstance(data, dict) or not data.get("platform") or not data.get("chat_id"):
        return None
    return str(data["platform"]), str(data["chat_id"])
