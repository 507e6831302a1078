"""The durability journal: accepted inbound messages, in-flight turn markers, and the
outbound delivery ledger (SQL run by the database writer, see `gateway.store.db`).

- `inbox`: every inbound message the gateway accepted, recorded in the same transaction
  that checks its platform message id for redelivery. A row stays `accepted` until the
  turn that answers it has recorded its reply (`done`), or /stop or /new dropped it
  (`dropped`). After a crash the `accepted` rows are exactly what still needs an answer.
- `turns`: one marker per running turn, written in the transaction that appends the
  user message and removed in the one that records the reply, so an interrupted turn is
  known exactly (not guessed from a time window).
- `outbound`: each reply chunk, recorded `pending` before it is sent and marked `sent`
  once the platform acknowledged it. After a restart the pending ones are sent once.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from gateway.domain.session import SessionSource
from gateway.store import codec

ACCEPTED, DONE, DROPPED = "accepted", "done", "dropped"
#: a stuck turn's messages the guard gave up on: kept for /retry (`set_aside_rows`)
SET_ASIDE = "set_aside"


# --- inbox ---------------------------------------------------------------------------------


def encode_event(event: dict[str, Any]) -> str:
    """An event as the inbox and the turn markers store it (encoded once per message)."""
    return codec.dumps(event)


def accept(
    conn: sqlite3.Connection,
    *,
    source: SessionSource,
    message_id: str | None,
    session_key: str,
    kind: str,
    event: str,
    now: float,
    state: str = ACCEPTED,
) -> int | None:
    """Record an inbound message (`event`: its JSON); None when its platform id was
    accepted before."""
    cursor = conn.execute(
        "INSERT INTO inbox (platform, chat_id, message_id, session_key, kind, event, state,"
        " accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (platform, chat_id, message_id) WHERE message_id IS NOT NULL DO NOTHING",
        (
            source.platform.value,
            source.chat_id,
            message_id,
            session_key,
            kind,
            event,
            state,
            now,
        ),
    )
    return cursor.lastrowid if cursor.rowcount == 1 else None


_CLOSE = (
    "UPDATE inbox SET state = ?, done_at = ? WHERE id = ?"
    # Set aside: a /retry runs them again, and that turn's end settles them.
    " AND state IN ('accepted', 'set_aside')"
)


def close_inbox(conn: sqlite3.Connection, ids: list[int], state: str, now: float) -> None:
    if len(ids) == 1:  # the common case, without executemany's per-call setup
        conn.execute(_CLOSE, (state, now, ids[0]))
        return
    conn.executemany(_CLOSE, [(state, now, inbox_id) for inbox_id in ids])


def inbox_events(conn: sqlite3.Connection, ids: Sequence[int]) -> list[dict[str, Any]]:
    """The recorded events of these inbox rows, in acceptance order (missing ones left out)."""
    rows = [
        conn.execute("SELECT id, event FROM inbox WHERE id = ?", (inbox_id,)).fetchone()
        for inbox_id in sorted(ids)
    ]
    return [codec.loads(row[1]) for row in rows if row is not None]


def set_aside_rows(conn: sqlite3.Connection, session_key: str) -> list[tuple[int, dict[str, Any]]]:
    """The key's set-aside messages (id, event), oldest first."""
    rows = conn.execute(
        "SELECT id, event FROM inbox WHERE session_key = ? AND state = 'set_aside' ORDER BY id",
        (session_key,),
    )
    return [(inbox_id, codec.loads(event)) for inbox_id, event in rows]


def open_inbox(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Accepted messages not answered yet, in acceptance order."""
    rows = conn.execute(
        "SELECT id, session_key, kind, event FROM inbox WHERE state = 'accepted' ORDER BY id"
    )
    return [
        {"id": i, "session_key": key, "kind": kind, "event": codec.loads(event)}
        for i, key, kind, event in rows
    ]


#: rows deleted per housekeeping write: writes run on the event loop's thread, so a
#: day's worth of rows is forgotten in short steps (a few ms each), not in one long one
EXPIRE_PAGE = 1_000


def expire_inbox(conn: sqlite3.Connection, before: float, limit: int = EXPIRE_PAGE) -> int:
    """Forget up to `limit` finished messages older than `before` (their ids no longer
    dedup); returns how many."""
    return conn.execute(
        "DELETE FROM inbox WHERE id IN (SELECT id FROM inbox"
        " WHERE state != 'accepted' AND accepted_at < ? LIMIT ?)",
        (before, limit),
    ).rowcount


# --- turn markers --------------------------------------------------------------------------


def start_turn(
    conn: sqlite3.Connection,
    *,
    session_key: str,
    session_id: str,
    inbox_ids: list[int],
    user_message_id: int | None,
    event: str,
    now: float,
    running: bool = True,
) -> int:
    """`running`: the turn's work begins now (False: it waits; `mark_running` later)."""
    cursor = conn.execute(
        "INSERT INTO turns (session_key, session_id, inbox_ids, user_message_id, event,"
        " started_at, running) VALUES (?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (session_key) DO UPDATE SET session_id = excluded.session_id,"
        " inbox_ids = excluded.inbox_ids, user_message_id = excluded.user_message_id,"
        " event = excluded.event, started_at = excluded.started_at,"
        " running = excluded.running",
        (
            session_key,
            session_id,
            codec.dumps(inbox_ids),
            user_message_id,
            event,
            now,
            int(running),
        ),
    )
    return int(cursor.lastrowid or 0)


def mark_running(
    conn: sqlite3.Connection, session_key: str, user_message_id: int, running: bool
) -> None:
    """Whether the key's turn (the one that asked `user_message_id`) is running or waits."""
    conn.execute(
        "UPDATE turns SET running = ? WHERE session_key = ? AND user_message_id = ?",
        (int(running), session_key, user_message_id),
    )


def all_waiting(conn: sqlite3.Connection) -> None:
    """At start-up: no turn of an earlier process runs any more."""
    conn.execute("UPDATE turns SET running = 0 WHERE running != 0")


def end_turn(conn: sqlite3.Connection, session_key: str) -> list[int]:
    """Remove the key's marker; returns the inbox ids it covered (none if no marker)."""
    row = conn.execute(
        "DELETE FROM turns WHERE session_key = ? RETURNING inbox_ids", (session_key,)
    ).fetchone()
    return codec.loads(row[0]) if row else []


_TURN_COLUMNS = (
    "turn_id, session_key, session_id, inbox_ids, user_message_id, event, started_at, running"
)


def get_turn(conn: sqlite3.Connection, session_key: str) -> dict[str, Any] | None:
    row = conn.execute(
        f"SELECT {_TURN_COLUMNS} FROM turns WHERE session_key = ?",
        (session_key,),
    ).fetchone()
    return _turn(row) if row else None


def open_turns(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(f"SELECT {_TURN_COLUMNS} FROM turns ORDER BY turn_id")
    return [_turn(row) for row in rows]


def _turn(row: tuple[Any, ...]) -> dict[str, Any]:
    turn_id, key, session_id, inbox_ids, user_message_id, event, started_at, running = row
    return {
        "turn_id": turn_id,
        "session_key": key,
        "session_id": session_id,
        "inbox_ids": codec.loads(inbox_ids),
        "user_message_id": user_message_id,
        "event": codec.loads(event),
        "started_at": started_at,
        "running": bool(running),
    }


# --- delivery ledger -------------------------------------------------------------------------


#: what an outbound row keeps of its target: the chat a reply goes to (all a delivery
#: after a restart reads), never who it answers (user id and name, a DM's chat name), so
#: the delivery ledger names no user beyond the chat itself
DELIVERY_FIELDS = (
    "platform",
    "chat_id",
    "chat_type",
    "thread_id",
    "parent_chat_id",
    "guild_id",
    "chat_id_alt",
)


def delivery_target(data: object) -> str:
    """A target (`SessionSource.to_dict()`, or an outbound row's decoded `target`) as the
    outbound ledger stores it: its `DELIVERY_FIELDS` that are set."""
    if not isinstance(data, dict):
        return "{}"
    return codec.dumps({name: data[name] for name in DELIVERY_FIELDS if data.get(name)})


def encoded_target(target: SessionSource) -> str:
    """`delivery_target` of a reply's target, encoded once per chat and reused: every
    reply of a conversation goes to the same chat, and only the chat's fields (not the
    message or its sender) make the key."""
    return _encoded_target(
        target.platform.value,
        target.chat_id,
        target.chat_type,
        target.thread_id,
        target.parent_chat_id,
        target.guild_id,
        target.chat_id_alt,
    )


@lru_cache(maxsize=4096)
def _encoded_target(*fields: str | None) -> str:
    return delivery_target(dict(zip(DELIVERY_FIELDS, fields, strict=True)))


def record_outbound(
    conn: sqlite3.Connection,
    target: SessionSource,
    chunks: list[str],
    *,
    reply_to: str | None,
    session_key: str | None,
    now: float,
    edits: Sequence[str] = (),
) -> list[int]:
    """Record reply chunks as pending, in order; returns their delivery ids.

    `edits`: the platform messages a streamed reply showed so far; chunk i is delivered
    as an edit of `edits[i]` (the rest as new messages)."""
    target_json = encoded_target(target)
    ids = []
    for index, chunk in enumerate(chunks):
        cursor = conn.execute(
            "INSERT INTO outbound (platform, chat_id, target, text, reply_to, session_key,"
            " state, created_at, edit_message_id) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
            (
                target.platform.value,
                target.chat_id,
                target_json,
                chunk,
                reply_to,
                session_key,
                now,
                edits[index] if index < len(edits) else None,
            ),
        )
        ids.append(int(cursor.lastrowid or 0))
    return ids


def record_attachments(
    conn: sqlite3.Connection,
    target: SessionSource,
    attachments: list[dict[str, Any]],
    *,
    reply_to: str | None,
    session_key: str | None,
    now: float,
) -> list[int]:
    """Record a reply's attachments (`Attachment.to_dict()`) as pending, after its text
    chunks; returns their delivery ids."""
    target_json = encoded_target(target)
    ids = []
    for attachment in attachments:
        cursor = conn.execute(
            "INSERT INTO outbound (platform, chat_id, target, text, reply_to, session_key,"
            " state, created_at, attachment) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)",
            (
                target.platform.value,
                target.chat_id,
                target_json,
                attachment.get("caption") or "",
                reply_to,
                session_key,
                now,
                codec.dumps(attachment),
            ),
        )
        ids.append(int(cursor.lastrowid or 0))
    return ids


def mark_sent(
    conn: sqlite3.Connection, delivery_id: int, platform_message_id: str | None, now: float
) -> None:
    conn.execute(
        "UPDATE outbound SET state = 'sent', platform_message_id = ?, sent_at = ?"
        " WHERE id = ? AND state = 'pending'",
        (platform_message_id, now, delivery_id),
    )


def pending_outbound(conn: sqlite3.Connection, created_before: float) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT id, target, text, reply_to, edit_message_id, attachment FROM outbound"
        " WHERE state = 'pending' AND created_at < ? ORDER BY id",
        (created_before,),
    )
    return [
        {
            "id": delivery_id,
            "target": SessionSource.from_dict(codec.loads(target)),
            "text": text,
            "reply_to": reply_to,
            "edit_message_id": edit_message_id,
            "attachment": codec.loads(attachment) if attachment else None,
        }
        for delivery_id, target, text, reply_to, edit_message_id, attachment in rows
    ]


def last_reply_seq(conn: sqlite3.Connection, platform: str, chat_id: str) -> int:
    """The newest delivery id recorded for one chat (0: none)."""
    row = conn.execute(
        "SELECT max(id) FROM outbound WHERE platform = ? AND chat_id = ?", (platform, chat_id)
    ).fetchone()
    return int(row[0] or 0)


# --- streamed messages -------------------------------------------------------------------------


def save_stream(
    conn: sqlite3.Connection, session_key: str, message_ids: Sequence[str], now: float
) -> None:
    """The platform messages a running turn's streamed reply is shown in (upsert)."""
    conn.execute(
        "INSERT INTO streams (session_key, message_ids, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT (session_key) DO UPDATE SET message_ids = excluded.message_ids,"
        " updated_at = excluded.updated_at",
        (session_key, codec.dumps(list(message_ids)), now),
    )


def get_stream(conn: sqlite3.Connection, session_key: str) -> list[str]:
    row = conn.execute(
        "SELECT message_ids FROM streams WHERE session_key = ?", (session_key,)
    ).fetchone()
    return list(codec.loads(row[0])) if row else []


def end_stream(conn: sqlite3.Connection, session_key: str) -> None:
    conn.execute("DELETE FROM streams WHERE session_key = ?", (session_key,))


def replies_after(
    conn: sqlite3.Connection, platform: str, chat_id: str, after: int, limit: int
) -> list[dict[str, Any]]:
    """Recorded replies to one chat with delivery id > `after` (the HTTP API's outbox)."""
    rows = conn.execute(
        "SELECT id, text, target, reply_to, attachment FROM outbound WHERE platform = ?"
        " AND chat_id = ? AND id > ? ORDER BY id LIMIT ?",
        (platform, chat_id, after, limit),
    )
    replies = []
    for delivery_id, text, target, reply_to, attachment in rows:
        reply = {
            "seq": delivery_id,
            "text": text,
            "thread_id": codec.loads(target).get("thread_id"),
            "in_reply_to": reply_to,
        }
        if attachment:  # a file the reply carries (its caption is `text`)
            reply["attachment"] = codec.loads(attachment)
        replies.append(reply)
    return replies


def expire_outbound(conn: sqlite3.Connection, before: float, limit: int = EXPIRE_PAGE) -> int:
    """Forget up to `limit` sent replies older than `before`; returns how many.

    The newest row is always kept: its id is the reply `seq` of the HTTP API, and SQLite
    hands out max(id) + 1, so deleting it would let the next reply reuse a seq a client
    already read past."""
    return conn.execute(
        "DELETE FROM outbound WHERE id IN (SELECT id FROM outbound"
        " WHERE state = 'sent' AND created_at < ?"
        " AND id < (SELECT max(id) FROM outbound) LIMIT ?)",
        (before, limit),
    ).rowcount
