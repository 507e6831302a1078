"""The PostgreSQL writer's group commit in pipeline mode (gateway.store.pg.batch): a batch
is sent without waiting statement by statement, so an error may surface in a later
write's read; each write must still fail alone, and every other write of the batch commit
with its own, right result."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from gateway.runner.replica import LeaseLost, Replica, lease_name
from gateway.store.pg.db import PgDatabase
from tests.pg_support import pg_schema_dsn

__all__ = ["pg_schema_dsn"]  # the fixture, imported for pytest


@pytest.fixture
async def db(pg_schema_dsn: str) -> AsyncIterator[PgDatabase]:
    database = PgDatabase(pg_schema_dsn, pipeline=True)
    await database.open()
    yield database
    await database.close()


def add_lease(name: str, owner: str = "me") -> Any:
    def fn(conn: Any) -> None:
        conn.execute(
            "INSERT INTO leases (name, owner, expires_at, acquired_at) VALUES (?, ?, ?, ?)",
            (name, owner, time.time() + 60, time.time()),
        )

    return fn


def lease_names(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute("SELECT name FROM leases ORDER BY name")]


async def test_a_statement_failing_in_the_pipeline_fails_its_write_alone(
    db: PgDatabase, pg_schema_dsn: str
) -> None:
    def duplicate(conn: Any) -> None:
        add_lease("dup")(conn)
        add_lease("dup")(conn)  # its error is not waited for here: it shows up later

    def count_after(conn: Any) -> int:
        add_lease("c")(conn)
        return int(conn.execute("SELECT count(*) FROM leases").fetchone()[0])

    commits = db.commits
    results = await asyncio.gather(
        db.write(add_lease("a")),
        db.write(duplicate),
        db.write(count_after),
        return_exceptions=True,
    )
    assert db.commits == commits + 1  # one batch, committed once
    assert results[0] is None
    assert isinstance(results[1], psycopg.errors.UniqueViolation)
    assert results[2] == 2  # "a" and "c": the failed write's rows are gone
    assert lease_names(pg_schema_dsn) == ["a", "c"]
    # The writer goes on afterwards, pipelined again.
    await db.write(add_lease("d"))
    assert lease_names(pg_schema_dsn) == ["a", "c", "d"]


async def test_a_fence_of_a_lost_lease_fails_its_write_alone(
    db: PgDatabase, pg_schema_dsn: str
) -> None:
    replica = SimpleNamespace(ttl=30.0, owner="me")
    await db.write(add_lease(lease_name("theirs"), owner="someone else"))
    await db.write(add_lease(lease_name("mine")))

    def fenced(key: str, then: str) -> Any:
        def fn(conn: Any) -> str:
            Replica.fence(replica, conn, key)  # type: ignore[arg-type]
            add_lease(then)(conn)
            return then

        return fn

    results = await asyncio.gather(
        db.write(add_lease("x")),
        db.write(fenced("theirs", "y")),
        db.write(fenced("mine", "z")),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], LeaseLost)
    assert results[2] == "z"
    # What the write did after its failed fence was rolled back with it.
    assert lease_names(pg_schema_dsn) == sorted(
        [lease_name("mine"), lease_name("theirs"), "x", "z"]
    )
