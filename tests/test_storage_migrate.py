"""`hermes-gateway storage migrate --to DSN`: a real home's state.db, written by the store's
own code, copied into PostgreSQL row for row with its ids, or not at all."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
from gateway.runner.pairing import Pairing
from gateway.schedules.book import ScheduleBook
from gateway.session import Platform, SessionSource
from gateway.store import (
    agent_tasks,
    chat_models,
    cursors,
    journal,
    remote_contexts,
    schedules,
    scratchpad,
    summary_checkpoints,
    tool_calls,
    usage,
)
from gateway.store.homelock import HomeLock
from gateway.store.pg.schema import migrate
from gateway.store.session_store import SessionStore
from tests.commandline import cli
from tests.pg_support import pg_dsn, pg_schema_dsn

__all__ = ["pg_schema_dsn"]  # the fixture, imported for pytest

SECRET = "s3cret-Pw_9"


def source(n: int) -> SessionSource:
    return SessionSource(platform=Platform.HTTP, chat_id=f"chat{n}", user_id=f"user{n}")


async def _fill(home: Path) -> None:
    """Sessions with transcripts, the journal (inbox, a turn, outbound), a scratchpad, a
    summary checkpoint, a schedule with a run, and notes: what a used home holds."""
    config = GatewayConfig()
    now = time.time()
    async with SessionStore(home / "sessions", config) as store:
        for n in range(3):
            entry = await store.get_or_create_session(source(n))
            for i in range(7):
                role = "user" if i % 2 == 0 else "assistant"
                message = {"role": role, "content": f"message {i} of chat {n}: ünïcode ✓"}
                await store.append_to_transcript(entry.session_id, message)
        await store.rewind_session(entry.session_id, 1)  # kept, inactive
        key = entry.session_key
        sid = entry.session_id

        def journal_rows(conn: sqlite3.Connection) -> None:
            for i in range(4):
                journal.accept(
                    conn,
                    source=source(0),
                    message_id=f"m{i}",
                    session_key=key,
                    kind="message",
                    event=journal.encode_event({"text": f"hi {i}"}),
                    now=now + i,
                )
            journal.start_turn(
                conn,
                session_key=key,
                session_id=sid,
                inbox_ids=[1, 2],
                user_message_id=3,
                event="{}",
                now=now,
            )
            journal.record_outbound(
                conn, source(0), ["part one", "part two"], reply_to="m1", session_key=key, now=now
            )
            journal.save_stream(conn, key, ["platform-msg-1"], now)
            # The interrupted turn's tool call, in flight (no result yet).
            tool_calls.record(
                conn, sid, 3, tool_calls.Row(0, tool_calls.CALL, "c1", "memory_save", "{}", None)
            )
            scratchpad.write(conn, sid, ["check the logs", "reply"])
            agent_tasks.insert(
                conn,
                task_id="t1",
                agent_id="main",
                context_id="ctx1",
                message_id="am1",
                caller="bearer",
                request_text="hello",
                chain=("main",),
                session_key="agent:main:a2a:dm:ctx1",
                now=now,
            )
            remote_contexts.save(conn, key, "partner", sid, "remote-ctx-1", now)
            chat_models.save(conn, key, "smart", now)
            usage.charge(conn, usage.Charge("http:u1", "2026-11-28", "main", "m", 90, 30, 0.0005))
            usage.take_start(conn, "http:u1", now, 6)
            cursors.save(conn, "matrix", "next_batch", "s72594_4483_1934", now)
            summary_checkpoints.write(
                conn,
                sid,
                expected_epoch=0,
                covered_up_to=2,
                summary="they said hi",
                messages=2,
                now=now,
            )

        await store.write(journal_rows)
        book = ScheduleBook(store, config, platforms=lambda: ["http"])
        added = await book.add(
            agent_id="main", target=source(1), user_id="user1", when="every 2h", prompt="ping"
        )

        def run_and_home(conn: sqlite3.Connection) -> None:
            schedules.claim(conn, added["schedule_id"], now, None, None, now)
            schedules.set_home(conn, "http", "chat1", now)

        await store.write(run_and_home)
        pairing = Pairing(store)
        for n in (5, 6):
            await pairing.request("http", f"user{n}", f"User {n}", target=source(n))
        (code,) = [r.code for r in await pairing.pending() if r.user_id == "user5"]
        await pairing.approve("http", code)
        recall = Recall(store, config)
        await recall.open()
        try:
            first = await recall.save(Namespace("main", "http", "user0"), "likes green tea")
            await recall.save(Namespace("main", "http", "user1"), "lives in Lyon", ["place"])
            await recall.save(Namespace("main", "http", "user0"), "likes black tea", [], first)
        finally:
            await recall.close()

        def trim_log(conn: sqlite3.Connection) -> None:
            # As the readers trim fts_log behind them: the largest seq given out is gone.
            conn.execute("DELETE FROM fts_log WHERE seq > (SELECT max(seq) - 3 FROM fts_log)")

        await store.write(trim_log)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    asyncio.run(_fill(home))
    return home


def sqlite_rows(home: Path) -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    conn = sqlite3.connect(home / "sessions" / "state.db")
    try:
        names = [
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        found = {}
        for name in names:
            columns = [col[1] for col in conn.execute(f"PRAGMA table_info({name})")]
            rows = conn.execute(f"SELECT * FROM {name} ORDER BY 1").fetchall()
            found[name] = (columns, rows)
        return found
    finally:
        conn.close()


def pg_rows(conn: psycopg.Connection, name: str, columns: list[str]) -> list[tuple[Any, ...]]:
    quoted = ", ".join(columns)
    return conn.execute(f"SELECT {quoted} FROM {name} ORDER BY 1").fetchall()


def url_with_password(schema_dsn: str, password: str) -> str:
    """The test server as a URL with a password (trust auth ignores it) and the schema."""
    params = conninfo_to_dict(schema_dsn)
    search_path = params["options"].replace(" ", "%20").replace("=", "%3D")
    return (
        f"postgresql://{params.get('user', 'postgres')}:{password}@{params['host']}:"
        f"{params.get('port', 5432)}/{params['dbname']}?options={search_path}"
    )


def test_every_table_is_copied_with_its_ids(home: Path, pg_schema_dsn: str) -> None:
    before = sqlite_rows(home)
    assert all(before[t][1] for t in ("messages", "inbox", "turns", "outbound", "notes"))
    empty = [name for name, (_columns, rows) in before.items() if not rows]
    # Trimmed by their readers (search.db's indexer may have taken all of fts_log by
    # now): what matters is that their sequences continue (checked below).
    assert set(empty) <= {"note_log", "fts_log"}
    given = dict(
        sqlite3.connect(home / "sessions" / "state.db")
        .execute("SELECT name, seq FROM sqlite_sequence")
        .fetchall()
    )
    assert given["fts_log"] > max((row[0] for row in before["fts_log"][1]), default=0)

    done = cli(home, "storage", "migrate", "--to", url_with_password(pg_schema_dsn, SECRET))

    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "backend: postgres" in done.stdout
    assert "${HERMES_PG_PASSWORD}@" in done.stdout
    assert "search.db and memory.db" in done.stdout
    # No memory.db on PostgreSQL: the index is the store's memory_* tables.
    assert "memory.db is rebuilt" not in done.stdout
    assert "memory_* tables at the gateway's first start" in done.stdout
    for name, (_columns, rows) in before.items():
        assert re.search(rf"^  {name} +{len(rows)} rows$", done.stdout, re.M), name
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        for name, (columns, rows) in before.items():
            assert pg_rows(conn, name, columns) == rows, name
        # New rows continue after the copied ids (and after ids a log gave out and trimmed).
        largest = max(row[0] for row in before["messages"][1])
        sid = before["sessions"][1][0][0]
        new_id = conn.execute(
            "INSERT INTO messages (session_id, role, content, message, created_at)"
            " VALUES (%s, 'user', 'after', '{}', 1) RETURNING id",
            (sid,),
        ).fetchone()
        assert new_id == (largest + 1,)
        # ... and the copy's triggers are back on: that insert was logged.
        logged = conn.execute("SELECT seq, id FROM fts_log ORDER BY seq DESC LIMIT 1").fetchone()
        assert logged == (given["fts_log"] + 1, largest + 1)
        conn.execute(
            "INSERT INTO notes (note_id, namespace, agent_id, platform, user_id, content,"
            " created_at, updated_at) VALUES ('n-pg', 'ns', 'main', 'http', 'u', 'x', 1, 1)"
        )
        assert conn.execute("SELECT seq FROM note_log").fetchall() == [(given["note_log"] + 1,)]
        run = conn.execute(
            "INSERT INTO schedule_runs (schedule_id, fire_time, status)"
            " SELECT schedule_id, 1, 'done' FROM schedules LIMIT 1 RETURNING run_id"
        ).fetchone()
        assert run == (1 + max((r[0] for r in before["schedule_runs"][1]), default=0),)


def test_a_target_with_rows_is_refused_and_left_as_it_was(home: Path, pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("INSERT INTO leases VALUES ('leader', 'replica-1', 10, 5)")

    done = cli(home, "storage", "migrate", "--to", pg_schema_dsn)

    assert done.returncode == 1
    assert "already holds rows in leases" in done.stderr
    assert "Traceback" not in done.stderr
    with psycopg.connect(pg_schema_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM sessions").fetchone() == (0,)
        assert conn.execute("SELECT name FROM leases").fetchall() == [("leader",)]


def test_a_failed_copy_leaves_no_row_behind(home: Path, pg_schema_dsn: str) -> None:
    """A row Postgres cannot take (NUL in text) fails the copy of a later table: the
    tables copied before it are rolled back too."""
    db = sqlite3.connect(home / "sessions" / "state.db")
    with db:
        db.execute("UPDATE notes SET content = 'tea' || char(0)")
    db.close()

    done = cli(home, "storage", "migrate", "--to", pg_schema_dsn)

    assert done.returncode == 1
    assert "copying notes failed, nothing was copied" in done.stderr
    assert "Traceback" not in done.stderr
    with psycopg.connect(pg_schema_dsn) as conn:
        for table in ("sessions", "messages", "inbox", "fts_log", "notes"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (0,), table


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://postgres:{SECRET}@127.0.0.1:1/test",  # nothing listens on port 1
        f"postgresql://postgres:{SECRET}@127.0.0.1:notaport/test",
        f"host=127.0.0.1 port=1 password={SECRET} dbname=test",
        f"postgresql://postgres:{SECRET}@127.0.0.1:5432/no_such_database_here",
    ],
)
def test_a_bad_dsn_is_a_clean_error_without_the_password(home: Path, dsn: str) -> None:
    done = cli(home, "storage", "migrate", "--to", dsn)

    assert done.returncode == 1
    assert done.stderr.startswith("storage migrate: ")
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stdout + done.stderr


def test_refused_while_the_gateway_runs(home: Path) -> None:
    with HomeLock.acquire(home):
        done = cli(home, "storage", "migrate", "--to", pg_dsn())
    assert done.returncode == 1
    assert "in use by another hermes-gateway" in done.stderr
    assert "stop it first" in done.stderr


def test_an_unset_variable_in_the_dsn_is_refused(home: Path) -> None:
    dsn = "postgresql://postgres:${HERMES_TEST_UNSET_VARIABLE}@127.0.0.1/test"
    done = cli(home, "storage", "migrate", "--to", dsn)
    assert done.returncode == 1
    assert "HERMES_TEST_UNSET_VARIABLE is not set" in done.stderr


def test_a_home_without_state_db_is_refused(tmp_path: Path) -> None:
    done = cli(tmp_path, "storage", "migrate", "--to", pg_dsn())
    assert done.returncode == 1
    assert "nothing to copy" in done.stderr


async def _read_back(sessions: Path, config: GatewayConfig) -> dict[str, Any]:
    """What the store shows of the three chats: their entries and transcripts."""
    shown: dict[str, Any] = {}
    async with SessionStore(sessions, config) as store:
        for n in range(3):
            entry = await store.get_entry(store.session_key_for(source(n)))
            assert entry is not None
            shown[entry.session_key] = (
                entry.to_dict(),
                await store.load_transcript(entry.session_id),
                await store.count_messages(entry.session_id),
            )
    return shown


def test_the_copied_store_opens_on_postgres_as_it_was(home: Path, pg_schema_dsn: str) -> None:
    on_sqlite = asyncio.run(_read_back(home / "sessions", GatewayConfig()))

    done = cli(home, "storage", "migrate", "--to", pg_schema_dsn)
    assert done.returncode == 0, done.stderr

    config = GatewayConfig.model_validate(
        {"storage": {"backend": "postgres", "dsn": pg_schema_dsn}}
    )
    on_postgres = asyncio.run(_read_back(home / "elsewhere", config))
    assert on_postgres == on_sqlite
    assert len(on_postgres) == 3
