"""Scheduled jobs in state.db: `schedules`, `schedule_runs` and `home_channels`.

Plain functions on a connection, run by the store's writer (`SessionStore.write`, or
inside a turn's own transaction) or reader. The rows are the one source of truth: the
scheduler (gateway.schedules.loop) keeps nothing but the earliest `next_run_at` in
memory.

A run's life: `claim` (a `running` row, unique per schedule and fire time, written in
the transaction that advances `next_run_at` and begins the run's turn) -> `settle` (in
the turn's finish transaction: ok or failed) or `interrupt` (the turn was dropped).
Fire times nobody ran become one `missed` row; one whose reply had nowhere to go
(platform not enabled, no home channel) an `undeliverable` row (`record_not_run`).
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from gateway.store import entries, purge
from gateway.store.pg import is_postgres
from gateway.util.pg_scope import NOTIFY_SQL

ACTIVE, PAUSED, DONE = "active", "paused", "done"
RUNNING, OK, FAILED, MISSED, INTERRUPTED = "running", "ok", "failed", "missed", "interrupted"
UNDELIVERABLE = "undeliverable"  # its platform not enabled, or no home channel: not run
SUMMARY_CHARS = 500  # of a run's output, kept in its history

_COLUMNS = (
    "schedule_id, agent_id, platform, chat_id, user_id, target, deliver, prompt, cadence,"
    " status, created_at, updated_at, next_run_at, last_run_at, last_run_status,"
    " consecutive_failures"
)
_NAMES = tuple(name.strip() for name in _COLUMNS.split(","))
_RUN_COLUMNS = (
    "run_id, schedule_id, fire_time, status, started_at, finished_at, output_summary,"
    " input_tokens, output_tokens"
)
_RUN_NAMES = tuple(name.strip() for name in _RUN_COLUMNS.split(","))


class AlreadyClaimed(Exception):
    """This fire time of the schedule has its run already (its transaction rolls back)."""


def _row(values: tuple[Any, ...]) -> dict[str, Any]:
    return dict(zip(_NAMES, values, strict=True))


#: PostgreSQL: a schedule added, removed, paused or resumed (by any replica, or the CLI)
#: is announced here, at commit, so the scheduler of the leader looks again at once.
CHANNEL = "hermes_schedules"


def _announce(conn: Any) -> None:
    """On SQLite the scheduler notices another process's commit by `data_version`."""
    if is_postgres(conn):
        # Not gateway.cluster.notify: importing it would load psycopg on SQLite too.
        conn.raw.execute(NOTIFY_SQL, {"channel": CHANNEL, "payload": ""})


def insert(conn: sqlite3.Connection, row: dict[str, Any]) -> None:
    _announce(conn)
    conn.execute(
        f"INSERT INTO schedules ({_COLUMNS}) VALUES ({', '.join('?' * len(_NAMES))})",
        tuple(row.get(name) for name in _NAMES),
    )


def get(conn: sqlite3.Connection, schedule_id: str) -> dict[str, Any] | None:
    found = conn.execute(
        f"SELECT {_COLUMNS} FROM schedules WHERE schedule_id = ?", (schedule_id,)
    ).fetchone()
    return _row(found) if found else None


def listed(
    conn: sqlite3.Connection,
    *,
    agent_id: str | None = None,
    platform: str | None = None,
    user_id: str | None = None,
    chat_id: str | None = None,
) -> list[dict[str, Any]]:
    """Schedules, oldest first. With `user_id`: the user's own, and those of the chat
    `chat_id` that nobody in particular made (the operator's, from the CLI)."""
    where, params = ["TRUE"], []  # TRUE, not 1: PostgreSQL wants a boolean
    if agent_id is not None:
        where.append("agent_id = ?")
        params.append(agent_id)
    if platform is not None:
        where.append("platform = ?")
        params.append(platform)
    if user_id is not None:
        where.append("(user_id = ? OR (user_id IS NULL AND chat_id = ?))")
        params += [user_id, chat_id]
    elif chat_id is not None:
        where.append("chat_id = ?")
        params.append(chat_id)
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM schedules WHERE {' AND '.join(where)}"
        " ORDER BY created_at, schedule_id",
        params,
    )
    return [_row(r) for r in rows]


def count_for_user(conn: sqlite3.Connection, platform: str, user_id: str) -> int:
    """The user's schedules that may still fire (active or paused), every agent's."""
    return conn.execute(
        "SELECT count(*) FROM schedules WHERE platform = ? AND user_id = ? AND status != ?",
        (platform, user_id, DONE),
    ).fetchone()[0]


def delete(conn: sqlite3.Connection, schedule_id: str) -> bool:
    """The schedule and its runs."""
    _announce(conn)
    conn.execute("DELETE FROM schedule_runs WHERE schedule_id = ?", (schedule_id,))
    return conn.execute("DELETE FROM schedules WHERE schedule_id = ?", (schedule_id,)).rowcount > 0


def delete_sessions(
    conn: sqlite3.Connection, session_key: str, now: datetime, *, erase: bool = False
) -> int | None:
    """A deleted schedule's session key: its routing entry and every session of it, with
    all they hold (`erase`: their journal rows too, see `gateway.store.purge`). None
    (nothing deleted) while a run's turn is in flight there."""
    if conn.execute("SELECT 1 FROM turns WHERE session_key = ?", (session_key,)).fetchone():
        return None
    entries.prune(conn, [session_key], float("inf"), now)
    deleted = 0
    for (session_id,) in conn.execute(
        "SELECT session_id FROM sessions WHERE session_key = ?", (session_key,)
    ).fetchall():
        if purge.delete_session(conn, session_id, now, erase=erase) is not None:
            deleted += 1
    return deleted


def delete_for_user(
    conn: sqlite3.Connection, platform: str, user_id: str, agent_id: str | None
) -> list[tuple[str, str]]:
    """Every schedule the user made (of one agent, or all) and their runs; returns the
    (agent_id, schedule_id) of each, whose sessions the caller deletes."""
    doomed = conn.execute(
        "SELECT agent_id, schedule_id FROM schedules WHERE platform = ? AND user_id = ?"
        # coalesce, not `? IS NULL OR`: PostgreSQL cannot type a lone NULL parameter
        " AND agent_id = coalesce(?, agent_id)",
        (platform, user_id, agent_id),
    ).fetchall()
    for _, schedule_id in doomed:
        delete(conn, schedule_id)
    return [(a, s) for a, s in doomed]


def set_status(
    conn: sqlite3.Connection, schedule_id: str, status: str, next_run_at: float | None, now: float
) -> bool:
    _announce(conn)
    return (
        conn.execute(
            "UPDATE schedules SET status = ?, next_run_at = ?, consecutive_failures = 0,"
            " updated_at = ? WHERE schedule_id = ?",
            (status, next_run_at, now, schedule_id),
        ).rowcount
        > 0
    )


# --- the scheduler's reads ----------------------------------------------------------------


def earliest(conn: sqlite3.Connection) -> tuple[str, float] | None:
    """The active schedule due first: one descent of the `schedules_due` index."""
    found = conn.execute(
        "SELECT schedule_id, next_run_at FROM schedules WHERE status = 'active'"
        " AND next_run_at IS NOT NULL ORDER BY next_run_at LIMIT 1"
    ).fetchone()
    return (found[0], found[1]) if found else None


def due(conn: sqlite3.Connection, now: float, limit: int) -> list[dict[str, Any]]:
    """Active schedules whose next fire time has come, earliest first."""
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM schedules WHERE status = 'active'"
        " AND next_run_at IS NOT NULL AND next_run_at <= ? ORDER BY next_run_at LIMIT ?",
        (now, limit),
    )
    return [_row(r) for r in rows]


def running_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Claimed runs not settled yet, with their schedule's agent and target."""
    rows = conn.execute(
        "SELECT r.run_id, r.schedule_id, r.fire_time, s.agent_id, s.target, s.cadence"
        " FROM schedule_runs r JOIN schedules s USING (schedule_id) WHERE r.status = ?",
        (RUNNING,),
    ).fetchall()
    names = ("run_id", "schedule_id", "fire_time", "agent_id", "target", "cadence")
    return [dict(zip(names, row, strict=True)) for row in rows]


# --- runs -----------------------------------------------------------------------------------


def claim(
    conn: sqlite3.Connection,
    schedule_id: str,
    fire_time: float,
    expected_next: float | None,
    next_run_at: float | None,
    now: float,
) -> int | None:
    """Claim the run of `fire_time` and move `next_run_at` on, if the row still says
    `expected_next` (None: a run now, `next_run_at` untouched). Returns the run id; None
    when the schedule changed meanwhile (paused, removed, claimed): nothing written.
    Raises AlreadyClaimed when the fire time has its run (the caller's transaction must
    roll back)."""
    if expected_next is not None:
        moved = conn.execute(
            "UPDATE schedules SET next_run_at = ?, updated_at = ? WHERE schedule_id = ?"
            " AND status = 'active' AND next_run_at = ?",
            (next_run_at, now, schedule_id, expected_next),
        ).rowcount
    else:
        moved = conn.execute(
            "SELECT count(*) FROM schedules WHERE schedule_id = ?", (schedule_id,)
        ).fetchone()[0]
    if not moved:
        return None
    cursor = conn.execute(
        "INSERT OR IGNORE INTO schedule_runs (schedule_id, fire_time, status, started_at)"
        " VALUES (?, ?, ?, ?)",
        (schedule_id, fire_time, RUNNING, now),
    )
    if not cursor.rowcount:
        raise AlreadyClaimed(f"{schedule_id} at {fire_time}")
    return cursor.lastrowid


def record_not_run(
    conn: sqlite3.Connection,
    schedule_id: str,
    fire_time: float,
    status: str,
    summary: str,
    now: float,
    keep: int,
) -> None:
    """A run row for a fire time that did not run: `missed` (`fire_time`: the first of
    those nobody ran) or `undeliverable` (its reply had nowhere to go)."""
    conn.execute(
        "INSERT OR IGNORE INTO schedule_runs (schedule_id, fire_time, status, started_at,"
        " finished_at, output_summary) VALUES (?, ?, ?, NULL, ?, ?)",
        (schedule_id, fire_time, status, now, summary[:SUMMARY_CHARS]),
    )
    conn.execute(
        "UPDATE schedules SET last_run_status = ?, updated_at = ? WHERE schedule_id = ?",
        (status, now, schedule_id),
    )
    prune(conn, schedule_id, keep)


def advance(
    conn: sqlite3.Connection,
    schedule_id: str,
    expected_next: float,
    next_run_at: float | None,
    now: float,
) -> bool:
    """Move `next_run_at` on without a run (compare-and-set, as `claim`); a one-shot
    with no fire time left is done."""
    return (
        conn.execute(
            "UPDATE schedules SET next_run_at = ?, updated_at = ?,"
            " status = CASE WHEN ? IS NULL THEN 'done' ELSE status END"
            " WHERE schedule_id = ? AND status = 'active' AND next_run_at = ?",
            (next_run_at, now, next_run_at, schedule_id, expected_next),
        ).rowcount
        > 0
    )


def settle(
    conn: sqlite3.Connection,
    schedule_id: str,
    status: str,
    output: str,
    usage: tuple[int, int],
    now: float,
    *,
    final: str | None,
    keep: int,
) -> None:
    """End the schedule's running run as `status` (ok, failed, interrupted); `final`:
    the schedule's new status (done, paused) or None to leave it."""
    conn.execute(
        "UPDATE schedule_runs SET status = ?, finished_at = ?, output_summary = ?,"
        " input_tokens = ?, output_tokens = ? WHERE schedule_id = ? AND status = ?",
        (status, now, output[:SUMMARY_CHARS], usage[0], usage[1], schedule_id, RUNNING),
    )
    conn.execute(
        "UPDATE schedules SET last_run_at = ?, last_run_status = ?, updated_at = ?,"
        " consecutive_failures = CASE WHEN ? = 'ok' THEN 0 ELSE consecutive_failures + 1 END,"
        " status = coalesce(?, status),"
        " next_run_at = CASE WHEN ? IS NULL THEN next_run_at ELSE NULL END"
        " WHERE schedule_id = ?",
        (now, status, now, status, final, final, schedule_id),
    )
    prune(conn, schedule_id, keep)


def prune(conn: sqlite3.Connection, schedule_id: str, keep: int) -> int:
    """Keep the schedule's newest `keep` runs (by fire time)."""
    return conn.execute(
        "DELETE FROM schedule_runs WHERE schedule_id = ? AND run_id NOT IN ("
        " SELECT run_id FROM schedule_runs WHERE schedule_id = ?"
        " ORDER BY fire_time DESC LIMIT ?)",
        (schedule_id, schedule_id, keep),
    ).rowcount


def runs(conn: sqlite3.Connection, schedule_id: str, limit: int) -> list[dict[str, Any]]:
    """The schedule's newest runs, newest first."""
    rows = conn.execute(
        f"SELECT {_RUN_COLUMNS} FROM schedule_runs WHERE schedule_id = ?"
        " ORDER BY fire_time DESC LIMIT ?",
        (schedule_id, limit),
    )
    return [dict(zip(_RUN_NAMES, r, strict=True)) for r in rows]


# --- home channels (/sethome) -----------------------------------------------------------------


def set_home(conn: sqlite3.Connection, platform: str, target: str, now: float) -> None:
    conn.execute(
        "INSERT INTO home_channels (platform, target, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT (platform) DO UPDATE SET target = excluded.target,"
        " updated_at = excluded.updated_at",
        (platform, target, now),
    )


def get_home(conn: sqlite3.Connection, platform: str) -> str | None:
    found = conn.execute(
        "SELECT target FROM home_channels WHERE platform = ?", (platform,)
    ).fetchone()
    return found[0] if found else None
