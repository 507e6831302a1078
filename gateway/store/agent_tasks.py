"""Agent tasks in the store: `agent_tasks`, one row per A2A task (gateway.domain.agent_tasks).

Plain functions on a connection, run by the store's writer or reader, or inside a turn's
finish transaction (`settle`): the row is the one source of truth of a task's state, shared
by every replica on PostgreSQL. A task's life: `insert` (submitted, unique per agent,
caller and message id) -> `set_state` (working, rejected, canceled) -> `settle` (completed
or failed, with the turn's reply recorded). A terminal row never changes again: every
update names the states it may leave.
"""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from typing import Any

from gateway.domain.agent_tasks import TaskRecord, TaskState
from gateway.store import codec

_COLUMNS = (
    "task_id, agent_id, context_id, message_id, caller, state, request_text, result_text,"
    " error, chain, session_key, created_at, updated_at, input_tokens, output_tokens"
)
_NAMES = tuple(name.strip() for name in _COLUMNS.split(","))
#: the states a task may still leave
OPEN = (TaskState.SUBMITTED.value, TaskState.WORKING.value, TaskState.INPUT_REQUIRED.value)
_OPEN_SQL = f"state IN ({', '.join('?' * len(OPEN))})"


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def record(values: tuple[Any, ...] | list[Any]) -> TaskRecord:
    row = dict(zip(_NAMES, values, strict=True))
    chain = codec.loads(row["chain"]) if row["chain"] else []
    return TaskRecord(
        task_id=row["task_id"],
        agent_id=row["agent_id"],
        context_id=row["context_id"],
        message_id=row["message_id"],
        caller=row["caller"],
        state=TaskState(row["state"]),
        request_text=row["request_text"],
        created_at=_when(row["created_at"]),
        updated_at=_when(row["updated_at"]),
        result_text=row["result_text"],
        error=row["error"],
        chain=tuple(str(agent) for agent in chain),
        input_tokens=row["input_tokens"],
        output_tokens=row["output_tokens"],
    )


def insert(
    conn: sqlite3.Connection,
    *,
    task_id: str,
    agent_id: str,
    context_id: str,
    message_id: str,
    caller: str,
    request_text: str,
    chain: tuple[str, ...],
    session_key: str,
    now: float,
) -> TaskRecord:
    """The task, submitted now, or the row a resent message id already is (unchanged)."""
    conn.execute(
        f"INSERT INTO agent_tasks ({_COLUMNS}) VALUES ({', '.join('?' * len(_NAMES))})"
        " ON CONFLICT DO NOTHING",
        (
            task_id,
            agent_id,
            context_id,
            message_id,
            caller,
            TaskState.SUBMITTED.value,
            request_text,
            None,
            None,
            codec.dumps(list(chain)),
            session_key,
            now,
            now,
            None,
            None,
        ),
    )
    found = get(conn, task_id)
    assert found is not None  # inserted, or there already
    return found


def get(conn: sqlite3.Connection, task_id: str) -> TaskRecord | None:
    found = conn.execute(
        f"SELECT {_COLUMNS} FROM agent_tasks WHERE task_id = ?", (task_id,)
    ).fetchone()
    return record(found) if found else None


def context_owner(conn: sqlite3.Connection, agent_id: str, context_id: str) -> str | None:
    """The caller whose tasks made the context with this agent (None: a new context)."""
    found = conn.execute(
        "SELECT caller FROM agent_tasks WHERE agent_id = ? AND context_id = ? LIMIT 1",
        (agent_id, context_id),
    ).fetchone()
    return found[0] if found else None


def session_key_of(conn: sqlite3.Connection, task_id: str) -> str | None:
    found = conn.execute(
        "SELECT session_key FROM agent_tasks WHERE task_id = ?", (task_id,)
    ).fetchone()
    return found[0] if found else None


def listed(
    conn: sqlite3.Connection,
    caller: str,
    *,
    agent_id: str | None = None,
    context_id: str | None = None,
    state: str | None = None,
    limit: int = 50,
    after: str | None = None,
) -> list[TaskRecord]:
    """The caller's tasks, newest first; `after`: the last task id of the previous page
    (one that is not the caller's, or gone, ends the listing: nothing after it)."""
    where, params = ["caller = ?"], [caller]
    for column, value in (("agent_id", agent_id), ("context_id", context_id), ("state", state)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if after is not None:
        mark = conn.execute(
            "SELECT created_at FROM agent_tasks WHERE task_id = ? AND caller = ?",
            (after, caller),
        ).fetchone()
        if mark is None:
            return []
        where.append("(created_at < ? OR (created_at = ? AND task_id < ?))")
        params += [mark[0], mark[0], after]
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM agent_tasks WHERE {' AND '.join(where)}"
        " ORDER BY created_at DESC, task_id DESC LIMIT ?",
        (*params, limit),
    )
    return [record(r) for r in rows]


def set_state(conn: sqlite3.Connection, task_id: str, state: TaskState, now: float) -> bool:
    """Move an open task to `state`; False when it is terminal already (it stays so)."""
    return (
        conn.execute(
            f"UPDATE agent_tasks SET state = ?, updated_at = ? WHERE task_id = ? AND {_OPEN_SQL}",
            (state.value, now, task_id, *OPEN),
        ).rowcount
        > 0
    )


def move(
    conn: sqlite3.Connection,
    task_id: str,
    was: TaskState,
    state: TaskState,
    now: float,
    *,
    result_text: str | None = None,
) -> bool:
    """From `was` to `state` only (working <-> input-required, its question in
    `result_text` meanwhile); False when the task was not in `was`."""
    return (
        conn.execute(
            "UPDATE agent_tasks SET state = ?, result_text = ?, updated_at = ?"
            " WHERE task_id = ? AND state = ?",
            (state.value, result_text, now, task_id, was.value),
        ).rowcount
        > 0
    )


def settle(
    conn: sqlite3.Connection,
    task_id: str,
    state: TaskState,
    now: float,
    *,
    result_text: str | None = None,
    error: str | None = None,
    tokens: tuple[int, int] | None = None,
) -> bool:
    """The task's end, in its turn's finish transaction, with its turn's (input, output)
    token counts when the model reported them; False when it ended before (a cancel
    that won the race)."""
    used = tokens or (None, None)
    return (
        conn.execute(
            "UPDATE agent_tasks SET state = ?, result_text = ?, error = ?, updated_at = ?,"
            f" input_tokens = ?, output_tokens = ? WHERE task_id = ? AND {_OPEN_SQL}",
            (state.value, result_text, error, now, *used, task_id, *OPEN),
        ).rowcount
        > 0
    )


def cancel_open(conn: sqlite3.Connection, session_key: str, now: float) -> list[str]:
    """Every open task of a session whose work was stopped (its running turn and its
    queue): canceled. Returns their ids."""
    ids = [
        task_id
        for (task_id,) in conn.execute(
            f"SELECT task_id FROM agent_tasks WHERE session_key = ? AND {_OPEN_SQL}",
            (session_key, *OPEN),
        ).fetchall()
    ]
    for task_id in ids:
        set_state(conn, task_id, TaskState.CANCELED, now)
    return ids


def delete_for_session(conn: sqlite3.Connection, session_key: str, lo: float, hi: float) -> int:
    """A deleted session's tasks: those of its key created while it was current."""
    return conn.execute(
        "DELETE FROM agent_tasks WHERE session_key = ? AND created_at >= ? AND created_at <= ?",
        (session_key, lo, hi),
    ).rowcount


def delete_for_caller(conn: sqlite3.Connection, caller: str, agent_id: str | None) -> int:
    """A user's data deleted: the tasks they asked (of one agent, or every agent's)."""
    if agent_id is None:
        return conn.execute("DELETE FROM agent_tasks WHERE caller = ?", (caller,)).rowcount
    return conn.execute(
        "DELETE FROM agent_tasks WHERE caller = ? AND agent_id = ?", (caller, agent_id)
    ).rowcount
