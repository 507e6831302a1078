"""The tool-call journal: what a running turn's tool calls did, so that a turn resumed
after a crash, a kill -9 or a replica takeover replays them instead of running them again.

A turn is (session_id, user_row): its session and its user message's transcript row,
what its marker (`turns`) names. Its rows, in `seq` order:

    round   an assistant message that calls tools (`payload`: the message as JSON),
            written before any of its calls runs
    call    one call of the round before it (`call_id` as the model named it, `tool`,
            `payload`: the arguments as sent), written just before the call runs;
            `result` NULL while it runs, set when it returns
    direct  a call made through `Tools.call` (a custom agent): `call_id` is its ordinal
            in the turn

The rows go in the turn's finish transaction, whatever its outcome, and with the session
(a foreign key with ON DELETE CASCADE; `gateway.store.purge` finds the table by its
`session_id` column). Plain functions run by the database writer or reader.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

ROUND, CALL, DIRECT = "round", "call", "direct"


@dataclass(frozen=True, slots=True)
class Row:
    seq: int
    kind: str
    call_id: str | None
    tool: str | None
    payload: str
    result: str | None  # None: the call was in flight when the turn stopped


def load(conn: sqlite3.Connection, session_id: str, user_row: int) -> list[Row]:
    rows = conn.execute(
        "SELECT seq, kind, call_id, tool, payload, result FROM tool_calls"
        " WHERE session_id = ? AND user_row = ? ORDER BY seq",
        (session_id, user_row),
    ).fetchall()
    return [Row(*row) for row in rows]


def record(
    conn: sqlite3.Connection,
    session_id: str,
    user_row: int,
    row: Row,
) -> None:
    conn.execute(
        "INSERT INTO tool_calls (session_id, user_row, seq, kind, call_id, tool, payload,"
        " result) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (session_id, user_row, row.seq, row.kind, row.call_id, row.tool, row.payload, row.result),
    )


def complete(
    conn: sqlite3.Connection, session_id: str, user_row: int, seq: int, result: str
) -> None:
    """Set the result of a call recorded as started."""
    conn.execute(
        "UPDATE tool_calls SET result = ? WHERE session_id = ? AND user_row = ? AND seq = ?",
        (result, session_id, user_row, seq),
    )


def forget(conn: sqlite3.Connection, session_id: str, user_row: int) -> None:
    """The turn ended (finished, failed, stopped): its record goes."""
    conn.execute(
        "DELETE FROM tool_calls WHERE session_id = ? AND user_row = ?", (session_id, user_row)
    )


def forget_marked(conn: sqlite3.Connection, session_key: str) -> None:
    """The record of the turn the key's marker names (a turn ended without its finish:
    /stop, the stuck-loop guard); run before the marker goes."""
    marker = conn.execute(
        "SELECT session_id, user_message_id FROM turns WHERE session_key = ?", (session_key,)
    ).fetchone()
    if marker is not None and marker[1] is not None:
        forget(conn, marker[0], marker[1])
