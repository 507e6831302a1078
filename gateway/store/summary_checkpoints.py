"""Rolling-summary checkpoints: one row per session, written by epoch compare-and-swap.

A checkpoint says "the active messages of this session up to row `covered_up_to` are
condensed into `summary`". The summary strategy loads it and only the rows after it.
Its `epoch` rises with every change: a summarizer remembers the epoch it read and
writes only if it is still the current one (`write`), so one that finishes late, after
another summary or an /undo, changes nothing. /undo and /retry (`on_rewind`) raise the
epoch whatever they take back, and clear the summary when they reach into what it
covers (its text speaks of messages that are gone).

`told` counts the condensed messages the user was told about: an automatic summary
raises `messages` and leaves it, so the difference is owed to the user as a notice
with the session's next reply (`gateway.memory.notice`), which raises it in the reply's
own transaction (`mark_told`); /compress raises both, since its answer says what it
condensed.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from gateway.store import codec, transcript
from gateway.store.pg import is_postgres

_NO_BOUND = 2**62


@dataclass(frozen=True, slots=True)
class Checkpoint:
    epoch: int
    covered_up_to: int  # 0: no summary (never written, or cleared by a rewind)
    summary: str | None
    messages: int  # how many transcript messages the summary condenses
    told: int = 0  # how many of them the user was told about


def read(conn: sqlite3.Connection, session_id: str) -> Checkpoint | None:
    row = conn.execute(
        "SELECT epoch, covered_up_to, summary, messages, told FROM summary_checkpoints"
        " WHERE session_id = ?",
        (session_id,),
    ).fetchone()
    return Checkpoint(*row) if row else None


def write(
    conn: sqlite3.Connection,
    session_id: str,
    *,
    expected_epoch: int,
    covered_up_to: int,
    summary: str,
    messages: int,
    now: float,
    told: bool = False,
) -> bool:
    """Store a new summary if the epoch is still `expected_epoch`; False when it moved.
    `told`: the messages it adds are told to the user otherwise (/compress answers with
    them), so they are not owed a notice."""
    if expected_epoch == 0:
        cursor = conn.execute(
            "INSERT INTO summary_checkpoints"
            " (session_id, epoch, covered_up_to, summary, messages, told, updated_at)"
            " VALUES (?, 1, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO NOTHING",
            (session_id, covered_up_to, summary, messages, messages if told else 0, now),
        )
    else:
        # Both backends read the row's old values on the right of SET: `told` grows by
        # as much as `messages` does.
        cursor = conn.execute(
            "UPDATE summary_checkpoints SET epoch = epoch + 1, covered_up_to = ?, summary = ?,"
            " messages = ?, told = CASE WHEN ? = 1 THEN told + ? - messages ELSE told END,"
            " updated_at = ? WHERE session_id = ? AND epoch = ?",
            (
                covered_up_to,
                summary,
                messages,
                int(told),
                messages,
                now,
                session_id,
                expected_epoch,
            ),
        )
    return cursor.rowcount == 1


def mark_told(conn: sqlite3.Connection, session_id: str, messages: int) -> None:
    """The user was told the summary condenses `messages` messages (a reply carrying the
    notice is being recorded in this transaction). A rewind since, which cleared the
    summary (`messages` below this), leaves the row as it is."""
    conn.execute(
        "UPDATE summary_checkpoints SET told = ?"
        " WHERE session_id = ? AND told < ? AND messages >= ?",
        (messages, session_id, messages, messages),
    )


def on_rewind(conn: sqlite3.Connection, session_id: str, first_undone: int, now: float) -> bool:
    """Messages from row `first_undone` on were taken back: move the epoch (a summary
    being written from them must not land) and clear the summary if it covers any of
    them. True when a summary was cleared."""
    before = read(conn, session_id)
    invalidated = before is not None and before.covered_up_to >= first_undone
    conn.execute(
        "INSERT INTO summary_checkpoints AS c (session_id, epoch, covered_up_to, summary,"
        " messages, told, updated_at) VALUES (?, 1, 0, NULL, 0, 0, ?)"
        # Qualified: PostgreSQL reads a bare column here as ambiguous with `excluded`.
        " ON CONFLICT (session_id) DO UPDATE SET epoch = c.epoch + 1,"
        " updated_at = excluded.updated_at,"
        " covered_up_to = CASE WHEN c.covered_up_to >= ? THEN 0 ELSE c.covered_up_to END,"
        " summary = CASE WHEN c.covered_up_to >= ? THEN NULL ELSE c.summary END,"
        " messages = CASE WHEN c.covered_up_to >= ? THEN 0 ELSE c.messages END,"
        " told = CASE WHEN c.covered_up_to >= ? THEN 0 ELSE c.told END",
        (session_id, now, first_undone, first_undone, first_undone, first_undone),
    )
    return invalidated


def rewind(conn: sqlite3.Connection, session_id: str, n: int) -> dict[str, Any]:
    """`transcript.rewind` (take back the last `n` user turns) and what it means for the
    session's summary (`on_rewind`), in the caller's transaction."""
    (first,) = conn.execute(
        "SELECT MIN(id) FROM (SELECT id FROM messages WHERE session_id = ? AND active = 1"
        " AND role = 'user' ORDER BY id DESC LIMIT ?) AS recent",
        (session_id, n),
    ).fetchone()
    result = transcript.rewind(conn, session_id, n)
    if first is not None and result["turns_undone"]:
        on_rewind(conn, session_id, first, time.time())
    return result


def rewrite(conn: sqlite3.Connection, session_id: str, messages: list[dict[str, Any]]) -> int:
    """`transcript.rewrite`: every covered row is gone, and with it the summary."""
    count = transcript.rewrite(conn, session_id, messages)
    on_rewind(conn, session_id, 0, time.time())
    return count


def delete(conn: sqlite3.Connection, session_id: str) -> None:
    """Forget a session's checkpoint (its messages are being deleted)."""
    conn.execute("DELETE FROM summary_checkpoints WHERE session_id = ?", (session_id,))


@dataclass(frozen=True, slots=True)
class Unsummarized:
    """The oldest active rows after a checkpoint, and the size of all of them."""

    checkpoint: Checkpoint | None
    ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...]
    total_messages: int
    total_chars: int
    total_bytes: int  # of the same, UTF-8 encoded (what a token estimate needs besides)


def unsummarized(conn: sqlite3.Connection, session_id: str, limit: int) -> Unsummarized:
    """What a summarizer works on: the checkpoint, up to `limit` of the oldest rows it
    does not cover, and the count and characters of every row it does not cover."""
    checkpoint = read(conn, session_id)
    after = checkpoint.covered_up_to if checkpoint is not None else 0
    # A turn in flight (or interrupted, to be re-run) owns its user message and what
    # follows it: never condensed under it.
    (running,) = conn.execute(
        "SELECT MIN(user_message_id) FROM turns WHERE session_id = ?", (session_id,)
    ).fetchone()
    until = running if running is not None else _NO_BOUND
    # SQLite 3.40 has no octet_length(); a BLOB's length is its bytes.
    octets = "octet_length(content)" if is_postgres(conn) else "length(CAST(content AS BLOB))"
    count, chars, octet_count = conn.execute(
        f"SELECT COUNT(*), COALESCE(SUM(length(content)), 0), COALESCE(SUM({octets}), 0)"
        " FROM messages WHERE session_id = ? AND active = 1 AND id > ? AND id < ?",
        (session_id, after, until),
    ).fetchone()
    rows = rows_between(conn, session_id, after, until, limit)
    return Unsummarized(
        checkpoint=checkpoint,
        ids=tuple(row_id for row_id, _ in rows),
        messages=tuple(message for _, message in rows),
        total_messages=int(count),
        total_chars=int(chars),
        total_bytes=int(octet_count),
    )


def rows_between(
    conn: sqlite3.Connection, session_id: str, after: int, until: int, limit: int
) -> list[tuple[int, dict[str, Any]]]:
    """Up to `limit` of the oldest active rows with `after` < id < `until`, with their ids."""
    rows = conn.execute(
        "SELECT id, message FROM messages WHERE session_id = ? AND active = 1"
        " AND id > ? AND id < ? ORDER BY id LIMIT ?",
        (session_id, after, until, limit),
    ).fetchall()
    return [(row_id, codec.loads(message)) for row_id, message in rows]
