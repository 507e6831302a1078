"""Named leases in the `leases` table: who owns a thing, until when.

Every time is the database's (`clock_timestamp()` as epoch seconds), never a replica's:
replicas whose clocks disagree still agree on who holds what. Each function is one
statement run on the caller's connection, inside the caller's transaction (or in
autocommit), so a lease can be taken in the same transaction as the work it guards.

A lease whose `expires_at` has passed is nobody's: `arenew` no longer extends it and
`try_acquire` hands it to the first replica that asks, its former owner included.

The sync functions take a `psycopg.Connection`; the `a`-prefixed ones are the same
statements on a `psycopg.AsyncConnection`, for the cluster's own background tasks.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import psycopg

# The database's clock now, as epoch seconds: `now()` would be frozen at the start of
# the caller's transaction, and a long transaction must not see a lease as live.
NOW = "extract(epoch from clock_timestamp())"

# Takes a free, expired or own lease; keeps `acquired_at` when the owner renews it.
ACQUIRE_SQL = f"""
INSERT INTO leases (name, owner, expires_at, acquired_at)
VALUES (%s, %s, {NOW} + %s, {NOW})
ON CONFLICT (name) DO UPDATE
SET owner = EXCLUDED.owner,
    expires_at = EXCLUDED.expires_at,
    acquired_at = CASE WHEN leases.owner = EXCLUDED.owner
                       THEN leases.acquired_at ELSE EXCLUDED.acquired_at END
WHERE leases.owner = EXCLUDED.owner OR leases.expires_at < {NOW}
RETURNING owner
"""

# SKIP LOCKED: a lease whose row the owner's own writer holds (a turn's transaction renews
# it too) is left to that transaction. Locking the owner's rows in one statement while the
# writer locks them one by one in its own order deadlocked (PostgreSQL broke it after its
# 1 s deadlock_timeout, holding up a batch of turns that long).
RENEW_SQL = f"""
UPDATE leases SET expires_at = {NOW} + %s
WHERE name IN (
    SELECT name FROM leases WHERE owner = %s AND expires_at >= {NOW}
    FOR UPDATE SKIP LOCKED
)
"""
RELEASE_SQL = "DELETE FROM leases WHERE name = %s AND owner = %s"
RELEASE_ALL_SQL = "DELETE FROM leases WHERE owner = %s"
HOLDER_SQL = f"SELECT owner, expires_at - {NOW} FROM leases WHERE name = %s AND expires_at >= {NOW}"
# Every live lease, one row per owner: how many sessions it holds and its other leases
# (leader roles); `left()`, not LIKE, keeps the statement free of `%`.
LIVE_SQL = f"""
SELECT owner,
       count(*) FILTER (WHERE left(name, 8) = 'session:'),
       coalesce(array_agg(name ORDER BY name) FILTER (WHERE left(name, 8) <> 'session:'),
                ARRAY[]::text[])
FROM leases WHERE expires_at >= {NOW} GROUP BY owner ORDER BY owner
"""
MAX_LIVE_OWNERS = 64  # a status view, not an inventory


def make_owner_id() -> str:
    """A replica's owner id: readable (host and pid, for `status` and the logs) and
    unique across restarts (a random part, since a pid is reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def try_acquire(conn: psycopg.Connection[Any], name: str, owner: str, ttl: float) -> bool:
    """Take lease `name` for `ttl` seconds if it is free, expired or already `owner`'s
    (then it is renewed). True when `owner` holds it afterwards."""
    return conn.execute(ACQUIRE_SQL, (name, owner, ttl)).fetchone() is not None


def release(conn: psycopg.Connection[Any], name: str, owner: str) -> bool:
    """Give up lease `name` if `owner` has it (live or expired). True if it did."""
    return conn.execute(RELEASE_SQL, (name, owner)).rowcount > 0


def release_all(conn: psycopg.Connection[Any], owner: str) -> int:
    """Give up every lease of `owner` (a clean shutdown); how many."""
    return conn.execute(RELEASE_ALL_SQL, (owner,)).rowcount


def holder(conn: psycopg.Connection[Any], name: str) -> str | None:
    """The owner of lease `name` if it is live, else None."""
    row = conn.execute(HOLDER_SQL, (name,)).fetchone()
    return None if row is None else row[0]


def live(conn: psycopg.Connection[Any]) -> list[tuple[str, int, list[str]]]:
    """Who holds live leases: (owner, sessions held, the names of its other leases),
    by owner, at most `MAX_LIVE_OWNERS`."""
    return [
        (owner, int(sessions), list(others))
        for owner, sessions, others in conn.execute(LIVE_SQL).fetchmany(MAX_LIVE_OWNERS)
    ]


async def atry_acquire(
    conn: psycopg.AsyncConnection[Any], name: str, owner: str, ttl: float
) -> bool:
    """`try_acquire` on an async connection."""
    cur = await conn.execute(ACQUIRE_SQL, (name, owner, ttl))
    return await cur.fetchone() is not None


async def arenew(conn: psycopg.AsyncConnection[Any], owner: str, ttl: float) -> int:
    """`renew` on an async connection."""
    return (await conn.execute(RENEW_SQL, (ttl, owner))).rowcount


async def arelease(conn: psycopg.AsyncConnection[Any], name: str, owner: str) -> bool:
    """`release` on an async connection."""
    return (await conn.execute(RELEASE_SQL, (name, owner))).rowcount > 0


async def aholder(conn: psycopg.AsyncConnection[Any], name: str) -> tuple[str, float] | None:
    """The live owner of lease `name` and its seconds left by the database's clock."""
    row = await (await conn.execute(HOLDER_SQL, (name,))).fetchone()
    return None if row is None else (row[0], float(row[1]))
