"""The PostgreSQL schema (gateway.store.pg.schema): SQLite's v14, table for table and
column for column, migrated once however many replicas start together."""

from __future__ import annotations

import sqlite3
import threading

import psycopg
import pytest

from gateway.store import migrations
from gateway.store.pg import schema
from gateway.store.pg.schema import BASELINE, MIGRATION_LOCK_KEY, migrate, schema_version
from gateway.util.pg_scope import CHANNEL_SQL, LOCK_KEY_SQL
from tests.pg_support import fresh_schema, pg_available, pg_schema_dsn, schema_dsn

__all__ = ["pg_schema_dsn"]  # the fixture, imported for pytest

PG_ONLY = {
    "leases",
    "hermes_schema",
    # long-term memory's index: memory.db's tables on SQLite (gateway.memory.pg_index)
    "memory_meta",
    "memory_chunks",
    "memory_chunk_tags",
    "memory_chunk_sources",
    "memory_vectors",
    "memory_pending_vectors",
}
ONE_SESSION = "INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s', 'k', 1)"


def sqlite_tables() -> dict[str, dict[str, bool]]:
    """Every real table of a fresh state.db: {table: {column: nullable}}. Skips SQLite's
    own tables, FTS5 virtual tables and their shadow tables."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        migrations.migrate(conn)
        rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall()
        virtual = [name for name, sql in rows if sql.upper().startswith("CREATE VIRTUAL TABLE")]
        tables = {}
        for name, _sql in rows:
            if name.startswith("sqlite_") or any(name.startswith(v) for v in virtual):
                continue
            columns = conn.execute(f"PRAGMA table_info({name})").fetchall()
            # A primary key column is never NULL: a rowid alias gets a value, and a
            # WITHOUT ROWID table refuses NULL in its key.
            tables[name] = {col[1]: not (col[3] or col[5]) for col in columns}
        return tables
    finally:
        conn.close()


def pg_tables(conn: psycopg.Connection) -> dict[str, dict[str, bool]]:
    rows = conn.execute(
        "SELECT table_name, column_name, is_nullable FROM information_schema.columns"
        " WHERE table_schema = current_schema() ORDER BY table_name, ordinal_position"
    ).fetchall()
    tables: dict[str, dict[str, bool]] = {}
    for table, column, nullable in rows:
        tables.setdefault(table, {})[column] = nullable == "YES"
    return tables


def test_sqlite_v14_has_the_tables_this_test_expects() -> None:
    """The comparison below is only as good as the list it reads: it must see them all."""
    tables = sqlite_tables()
    # v14's 19, the tool-call journal (v17), agent tasks (v18), remote contexts (v19),
    # chat models (v21), usage and the pace of budgets (v22), platform cursors (v24)
    assert len(tables) == 26
    assert tables["tool_calls"]["result"] is True  # NULL: a call in flight
    assert tables["agent_tasks"]["result_text"] is True  # NULL: no reply yet
    assert tables["remote_contexts"]["context_id"] is False
    assert tables["chat_models"]["model"] is False
    assert "messages" in tables and "outbound" in tables
    assert tables["outbound"]["attachment"] is True
    assert tables["messages"]["id"] is False


def test_every_sqlite_step_has_its_postgres_twin() -> None:
    assert set(schema._STEPS) == set(range(BASELINE + 1, migrations.SCHEMA_VERSION + 1))


def test_every_sqlite_table_exists_with_the_same_columns(pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        found = pg_tables(conn)
    expected = sqlite_tables()
    for table, columns in expected.items():
        assert table in found, f"{table} missing on Postgres"
        assert found[table] == columns, table
    assert set(found) - set(expected) == PG_ONLY
    assert found["leases"] == {
        "name": False,
        "owner": False,
        "expires_at": False,
        "acquired_at": False,
    }


@pytest.mark.parametrize("autocommit", [False, True])
def test_migrate_twice_is_a_no_op(pg_schema_dsn: str, autocommit: bool) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=autocommit) as conn:
        migrate(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("INSERT INTO leases VALUES ('leader', 'r1', 10, 5)")
        conn.commit()
        migrate(conn)
        assert schema_version(conn) == migrations.SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM hermes_schema").fetchone() == (1,)
        assert conn.execute("SELECT owner FROM leases").fetchall() == [("r1",)]


def test_a_newer_store_is_refused(pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("UPDATE hermes_schema SET version = %s", (migrations.SCHEMA_VERSION + 1,))
        with pytest.raises(psycopg.DatabaseError, match="newer than this gateway"):
            migrate(conn)
        assert schema_version(conn) == migrations.SCHEMA_VERSION + 1


def test_migrate_refuses_a_transaction_left_open(pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(psycopg.ProgrammingError, match="outside a transaction"):
            migrate(conn)
        conn.rollback()
        assert schema_version(conn) == 0


def test_replicas_starting_together_migrate_once(pg_schema_dsn: str) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4, timeout=10)

    def replica() -> None:
        try:
            with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
                start.wait()
                migrate(conn)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    with psycopg.connect(pg_schema_dsn) as conn:
        assert conn.execute("SELECT version FROM hermes_schema").fetchall() == [
            (migrations.SCHEMA_VERSION,)
        ]


def test_a_migration_waits_for_no_other_schemas_store(pg_schema_dsn: str) -> None:
    """Advisory locks are per database: stores in two schemas of one (parallel test
    workers, two deployments) each lock a key of their own."""
    with fresh_schema() as other_dsn, psycopg.connect(other_dsn) as other:
        other.execute(f"SELECT pg_advisory_xact_lock({LOCK_KEY_SQL})", {"key": MIGRATION_LOCK_KEY})
        with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")  # a shared key: LockNotAvailable
            migrate(conn)
            assert schema_version(conn) == migrations.SCHEMA_VERSION
        other.rollback()


def test_the_default_schema_keeps_the_bare_lock_keys_and_channels() -> None:
    """What one deployment in `public` uses is the key and channel name as written, so
    replicas of another version of the gateway agree with it."""
    if (reason := pg_available()) is not None:
        pytest.skip(reason)
    with psycopg.connect(schema_dsn("public")) as conn:
        row = conn.execute(
            f"SELECT {LOCK_KEY_SQL}, {CHANNEL_SQL}",
            {"key": MIGRATION_LOCK_KEY, "channel": "hermes_inbox"},
        ).fetchone()
    assert row == (MIGRATION_LOCK_KEY, "hermes_inbox")


def test_triggers_log_messages_and_notes_as_on_sqlite(pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s', 'k', 1)"
        )
        conn.execute(
            "INSERT INTO messages (session_id, role, content, message, created_at)"
            " VALUES ('s', 'user', 'hello world', '{}', 1), ('s', 'assistant', 'hi', '{}', 2)"
        )
        ids = [row[0] for row in conn.execute("SELECT id FROM messages ORDER BY id")]
        conn.execute("DELETE FROM sessions WHERE session_id = 's'")  # cascades to messages
        assert conn.execute("SELECT count(*) FROM messages").fetchone() == (0,)
        assert [r[0] for r in conn.execute("SELECT id FROM fts_log ORDER BY seq")] == ids + ids

        conn.execute(
            "INSERT INTO notes (note_id, namespace, agent_id, platform, user_id, content,"
            " created_at, updated_at) VALUES ('n1', 'ns', 'main', 'http', 'u', 'x', 1, 1)"
        )
        counted = [conn.execute("SELECT count(*) FROM note_log").fetchone()[0]]
        conn.execute("UPDATE notes SET content = 'y'")
        counted.append(conn.execute("SELECT count(*) FROM note_log").fetchone()[0])
        conn.execute("DELETE FROM notes")
        logged = conn.execute("SELECT note_id FROM note_log ORDER BY seq").fetchall()
        assert counted == [1, 2]
        assert logged == [("n1",)] * 3


def test_ids_can_be_given_and_the_search_index_is_used(pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s', 'k', 1)"
        )
        conn.execute(
            "INSERT INTO messages (id, session_id, role, content, message, created_at)"
            " VALUES (41, 's', 'user', 'the quick brown fox', '{}', 1)"
        )
        conn.execute("SET enable_seqscan = off")
        plan = conn.execute(
            "EXPLAIN SELECT id FROM messages"
            " WHERE to_tsvector('simple', content) @@ plainto_tsquery('simple', 'fox')"
        ).fetchall()
        assert "messages_search" in " ".join(row[0] for row in plan)
        hit = conn.execute(
            "SELECT id FROM messages"
            " WHERE to_tsvector('simple', content) @@ plainto_tsquery('simple', 'brown fox')"
        ).fetchall()
        assert hit == [(41,)]
