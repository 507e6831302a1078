"""Usage per user, day, agent and model (`usage_days`), and each user's turn starts of
the last minute (`budget_pace`).

A turn is charged by `charge`, run in the turn's own finish transaction: the row counts
the turn exactly when its end is recorded, so a turn resumed after a crash (whose first
run never finished) is counted once, on whichever replica finished it. Days are local
dates (`YYYY-MM-DD`) in the gateway's time zone; a month is the days that share its
`YYYY-MM` prefix, so a month's sum is one range scan of the user's rows.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from gateway.store import codec

#: most rows `report` returns (a report groups by user, agent or model, not by turn)
MAX_REPORT_ROWS = 1000
#: what a report may be grouped by, as its callers name them -> the column
GROUPS = {"user": "user_key", "day": "day", "agent": "agent_id", "model": "model"}
DAY_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")


def local_day(now: float, zone: tzinfo) -> str:
    """The date of the epoch time `now` in `zone`, as usage rows name days."""
    return datetime.fromtimestamp(now, zone).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class Charge:
    """One turn's usage, charged to `user_key` on `day`."""

    user_key: str
    day: str
    agent_id: str
    model: str
    input_tokens: int
    output_tokens: int
    cost_usd: float
    estimated: bool = False  # the backend reported no counts; these are our estimate


@dataclass(frozen=True, slots=True)
class Totals:
    turns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def charge(conn: sqlite3.Connection, item: Charge) -> None:
    conn.execute(
        "INSERT INTO usage_days (user_key, day, agent_id, model, turns, input_tokens,"
        " output_tokens, estimated_turns, cost_usd) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?)"
        " ON CONFLICT (user_key, day, agent_id, model) DO UPDATE SET"
        " turns = usage_days.turns + 1,"
        " input_tokens = usage_days.input_tokens + excluded.input_tokens,"
        " output_tokens = usage_days.output_tokens + excluded.output_tokens,"
        " estimated_turns = usage_days.estimated_turns + excluded.estimated_turns,"
        " cost_usd = usage_days.cost_usd + excluded.cost_usd",
        (
            item.user_key,
            item.day,
            item.agent_id,
            item.model,
            item.input_tokens,
            item.output_tokens,
            1 if item.estimated else 0,
            item.cost_usd,
        ),
    )


def user_totals(conn: sqlite3.Connection, user_key: str, day: str) -> tuple[Totals, Totals]:
    """The user's (today, this month) totals over every agent and model: one scan of
    their rows of the month."""
    month_start, month_end = month_range(day)
    today = [0, 0, 0, 0.0]
    month = [0, 0, 0, 0.0]
    for row_day, turns, tokens_in, tokens_out, cost in conn.execute(
        "SELECT day, turns, input_tokens, output_tokens, cost_usd FROM usage_days"
        " WHERE user_key = ? AND day >= ? AND day < ?",
        (user_key, month_start, month_end),
    ):
        for into in (month, today) if row_day == day else (month,):
            into[0] += turns
            into[1] += tokens_in
            into[2] += tokens_out
            into[3] += cost
    return Totals(*today), Totals(*month)  # type: ignore[arg-type]


def month_range(day: str) -> tuple[str, str]:
    """The month of `day` as a half-open range of day strings."""
    year, month = int(day[:4]), int(day[5:7])
    following = f"{year + 1:04d}-01" if month == 12 else f"{year:04d}-{month + 1:02d}"
    return f"{day[:7]}-01", f"{following}-01"


def report(
    conn: sqlite3.Connection,
    *,
    since: str | None = None,
    until: str | None = None,
    user_key: str | None = None,
    agent_id: str | None = None,
    by: tuple[str, ...] = ("user", "agent", "model"),
) -> list[dict[str, Any]]:
    """Sums grouped `by` (names of `GROUPS`), largest cost first; days from `since` up
    to, not including, `until`. Each row names its groups as `by` does."""
    for name in by:
        if name not in GROUPS:
            raise ValueError(f"cannot group usage by {name!r} (one of {', '.join(GROUPS)})")
    columns = [GROUPS[name] for name in by]
    where, params = [], []
    for clause, value in (
        ("day >= ?", since),
        ("day < ?", until),
        ("user_key = ?", user_key),
        ("agent_id = ?", agent_id),
    ):
        if value is not None:
            where.append(clause)
            params.append(value)
    group = ", ".join(columns)
    sql = (
        f"SELECT {group}{', ' if by else ''}sum(turns), sum(input_tokens), sum(output_tokens),"
        " sum(estimated_turns), sum(cost_usd) FROM usage_days"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + (f" GROUP BY {group} ORDER BY sum(cost_usd) DESC, {group}" if by else "")
        + f" LIMIT {MAX_REPORT_ROWS}"
    )
    rows = []
    for row in conn.execute(sql, params):
        item = dict(zip(by, row[: len(by)], strict=True))
        turns, tokens_in, tokens_out, estimated, cost = row[len(by) :]
        if turns is None:  # no row matched: the sums of nothing
            continue
        item.update(
            turns=int(turns),
            input_tokens=int(tokens_in),
            output_tokens=int(tokens_out),
            estimated_turns=int(estimated),
            cost_usd=round(float(cost), 6),
        )
        rows.append(item)
    return rows


def delete_user(conn: sqlite3.Connection, user_key: str, agent_id: str | None) -> int:
    """Forget the user's usage (of one agent, or all of it and their pace)."""
    if agent_id is not None:
        return conn.execute(
            "DELETE FROM usage_days WHERE user_key = ? AND agent_id = ?", (user_key, agent_id)
        ).rowcount
    gone = conn.execute("DELETE FROM usage_days WHERE user_key = ?", (user_key,)).rowcount
    return gone + conn.execute("DELETE FROM budget_pace WHERE user_key = ?", (user_key,)).rowcount


# --- turns_per_minute ---------------------------------------------------------------------


def take_start(
    conn: sqlite3.Connection, user_key: str, now: float, limit: int, window: float = 60.0
) -> float | None:
    """Record a turn start of the user unless `limit` started within `window` seconds;
    None when recorded, else when the oldest of those leaves the window (epoch).

    The row is written first (an upsert that returns it), so on PostgreSQL it is
    locked for the rest of the transaction: two replicas starting the same user's turns
    take turns here, and neither counts past the other's start."""
    row = conn.execute(
        "INSERT INTO budget_pace (user_key, starts, updated_at) VALUES (?, '[]', ?)"
        " ON CONFLICT (user_key) DO UPDATE SET updated_at = excluded.updated_at"
        " RETURNING starts",
        (user_key, now),
    ).fetchone()
    starts = [t for t in _times(row[0] if row else "[]") if now - window < t <= now + window]
    if len(starts) >= limit:
        return min(starts) + window
    starts.append(now)
    conn.execute(
        "UPDATE budget_pace SET starts = ? WHERE user_key = ?",
        (codec.dumps(sorted(starts)[-limit:]), user_key),
    )
    return None


def _times(raw: str) -> list[float]:
    value = codec.loads(raw)
    return (
        [float(t) for t in value if isinstance(t, int | float)] if isinstance(value, list) else []
    )
