"""The two schemas say the same thing: state.db (gateway.store.migrations) and memory.db
(gateway.memory.sqlite_index) on SQLite, and the PostgreSQL store
(gateway.store.pg.schema), built for real on both engines and compared table by table:
columns with equivalent types and nullability, primary keys, and indexes by their
columns (and whether unique or partial). What differs on purpose is listed below, each
with its reason; anything else that differs fails, a column added to one engine only
included (`test_a_column_added_to_one_engine_only_is_caught` proves the comparison sees
it)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from gateway.memory import sqlite_index
from gateway.store import migrations
from gateway.store.pg.schema import migrate
from tests.pg_support import fresh_schema

# On PostgreSQL, memory.db's tables are the store's, named with this prefix.
MEMORY_PREFIX = "memory_"

# --- the intended differences ----------------------------------------------------------

# Tables of one engine only (FTS5 virtual tables and their shadow tables are left out on
# SQLite, as SQLite's own `sqlite_*` tables are: PostgreSQL's full text is a column or
# an expression index instead).
SQLITE_ONLY_TABLES: dict[str, str] = {}
PG_ONLY_TABLES = {
    "leases": "replicas' leases (turns, leader roles): one process owns a SQLite store",
    "hermes_schema": "the schema version; SQLite keeps it in PRAGMA user_version",
}
# Columns of one engine only, as (table, column).
PG_ONLY_COLUMNS = {
    ("memory_chunks", "words"): "the stored tsvector a GIN index searches (FTS5 on SQLite)",
}
# Indexes of one engine only, as (table, columns): PostgreSQL does not index a foreign
# key by itself, and a cascading delete (or the lease reaper) looks rows up by it.
PG_ONLY_INDEXES = {
    ("memory_chunks", ("words",)): "full-text search through GIN (FTS5 on SQLite)",
    ("memory_chunk_tags", ("chunk_id",)): "the cascade from a chunk (a trigger on SQLite)",
    ("messages", ("<expression>",)): "full-text search over to_tsvector(content) (FTS5)",
}
SQLITE_ONLY_INDEXES: dict[tuple[str, tuple[str, ...]], str] = {}
# Types: a declared type on SQLite is an affinity; these are the same values' types on
# PostgreSQL. A column without a declared type (memory.db's `meta.value`, any value)
# is text on PostgreSQL.
SQLITE_TYPES = {"INTEGER": "integer", "REAL": "real", "TEXT": "text", "BLOB": "bytes", "": "any"}
PG_TYPES = {
    "bigint": "integer",
    "integer": "integer",
    "smallint": "integer",
    "double precision": "real",
    "text": "text",
    "bytea": "bytes",
    "tsvector": "tsvector",
}
EQUIVALENT_TYPES = {("any", "text")}


@dataclass
class Table:
    columns: dict[str, tuple[str, bool]] = field(default_factory=dict)  # (type, nullable)
    primary_key: tuple[str, ...] = ()
    # (columns, unique, partial); an expression is "<expression>"
    indexes: set[tuple[tuple[str, ...], bool, bool]] = field(default_factory=set)


# --- reading each engine's schema ------------------------------------------------------


def sqlite_schema(conn: sqlite3.Connection, prefix: str = "") -> dict[str, Table]:
    """The real tables of a SQLite database (FTS5 tables and SQLite's own left out),
    named with `prefix` to meet their PostgreSQL names."""
    rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall()
    virtual = [name for name, sql in rows if sql.upper().startswith("CREATE VIRTUAL TABLE")]
    tables: dict[str, Table] = {}
    for name, _sql in rows:
        if name.startswith("sqlite_") or any(name.startswith(v) for v in virtual):
            continue
        table = tables[prefix + name] = Table()
        pk: list[tuple[int, str]] = []
        for _cid, column, declared, notnull, _default, in_pk in conn.execute(
            f"PRAGMA table_info({name})"
        ):
            # A primary key column is never NULL: a rowid alias gets a value, and a
            # WITHOUT ROWID table refuses NULL in its key.
            table.columns[column] = (SQLITE_TYPES[declared.upper()], not (notnull or in_pk))
            if in_pk:
                pk.append((in_pk, column))
        table.primary_key = tuple(column for _, column in sorted(pk))
        for _seq, index, unique, origin, partial in conn.execute(f"PRAGMA index_list({name})"):
            if origin == "pk":
                continue
            columns = tuple(
                column if column is not None else "<expression>"
                for _seqno, _cid, column in conn.execute(f"PRAGMA index_info({index})")
            )
            table.indexes.add((columns, bool(unique), bool(partial)))
    return tables


def pg_schema(conn: psycopg.Connection) -> dict[str, Table]:
    tables: dict[str, Table] = {}
    for name, column, data_type, nullable in conn.execute(
        "SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns"
        " WHERE table_schema = current_schema() ORDER BY table_name, ordinal_position"
    ):
        table = tables.setdefault(name, Table())
        table.columns[column] = (PG_TYPES[data_type], nullable == "YES")
    for name, columns, primary, unique, partial in conn.execute(
        "SELECT t.relname,"
        " array(SELECT coalesce(a.attname, '<expression>') FROM unnest(i.indkey)"
        "   WITH ORDINALITY AS k(attnum, n) LEFT JOIN pg_attribute a"
        "   ON a.attrelid = t.oid AND a.attnum = k.attnum ORDER BY k.n),"
        " i.indisprimary, i.indisunique, i.indpred IS NOT NULL"
        " FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid"
        " WHERE t.relnamespace = current_schema()::regnamespace"
    ):
        if primary:
            tables[name].primary_key = tuple(columns)
        else:
            tables[name].indexes.add((tuple(columns), unique, partial))
    return tables


def differences(sqlite: dict[str, Table], pg: dict[str, Table]) -> list[str]:
    """What differs between the engines beyond the intended differences, one line each
    (empty: the same schema)."""
    found: list[str] = []
    for name in sorted(set(sqlite) - set(pg) - set(SQLITE_ONLY_TABLES)):
        found.append(f"table {name}: SQLite only")
    for name in sorted(set(pg) - set(sqlite) - set(PG_ONLY_TABLES)):
        found.append(f"table {name}: PostgreSQL only")
    for name in sorted(set(sqlite) & set(pg)):
        lite, post = sqlite[name], pg[name]
        for column in sorted(lite.columns.keys() | post.columns.keys()):
            if column not in post.columns:
                found.append(f"column {name}.{column}: SQLite only")
            elif column not in lite.columns:
                if (name, column) not in PG_ONLY_COLUMNS:
                    found.append(f"column {name}.{column}: PostgreSQL only")
            else:
                (lite_type, lite_null), (pg_type, pg_null) = (
                    lite.columns[column],
                    post.columns[column],
                )
                if lite_type != pg_type and (lite_type, pg_type) not in EQUIVALENT_TYPES:
                    found.append(f"column {name}.{column}: {lite_type} on SQLite, {pg_type}")
                if lite_null != pg_null:
                    found.append(f"column {name}.{column}: nullable {lite_null} on SQLite")
        if lite.primary_key != post.primary_key:
            found.append(f"table {name}: primary key {lite.primary_key} / {post.primary_key}")
        for index in sorted(lite.indexes - post.indexes):
            if (name, index[0]) not in SQLITE_ONLY_INDEXES:
                found.append(f"index {name}{index}: SQLite only")
        for index in sorted(post.indexes - lite.indexes):
            if (name, index[0]) not in PG_ONLY_INDEXES:
                found.append(f"index {name}{index}: PostgreSQL only")
    return found


# --- building both ---------------------------------------------------------------------


@pytest.fixture
def sqlite_dbs(tmp_path: Path) -> Iterator[tuple[sqlite3.Connection, sqlite3.Connection]]:
    """A fresh state.db (every migration) and the memory.db beside it."""
    state = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    migrations.migrate(state)
    memory = sqlite_index.connect(tmp_path / "memory.db", tmp_path / "state.db")
    try:
        yield state, memory
    finally:
        memory.close()
        state.close()


@pytest.fixture
def pg_conn() -> Iterator[psycopg.Connection]:
    """A fresh PostgreSQL store schema (every step)."""
    with fresh_schema() as dsn, psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        yield conn


def both_engines(
    sqlite_dbs: tuple[sqlite3.Connection, sqlite3.Connection], pg_conn: psycopg.Connection
) -> tuple[dict[str, Table], dict[str, Table]]:
    state, memory = sqlite_dbs
    lite = sqlite_schema(state)
    lite.update(sqlite_schema(memory, MEMORY_PREFIX))
    return lite, pg_schema(pg_conn)


def test_both_engines_build_the_same_schema(
    sqlite_dbs: tuple[sqlite3.Connection, sqlite3.Connection], pg_conn: psycopg.Connection
) -> None:
    lite, pg = both_engines(sqlite_dbs, pg_conn)
    assert "messages" in lite and "memory_chunks" in lite  # both SQLite files were read
    assert lite["messages"].primary_key == ("id",)
    assert differences(lite, pg) == []


def test_every_intended_difference_is_still_there(
    sqlite_dbs: tuple[sqlite3.Connection, sqlite3.Connection], pg_conn: psycopg.Connection
) -> None:
    """A difference mended on one engine leaves the list: it would hide a new one."""
    lite, pg = both_engines(sqlite_dbs, pg_conn)
    assert set(PG_ONLY_TABLES) <= set(pg) - set(lite)
    for table, column in PG_ONLY_COLUMNS:
        assert column in pg[table].columns and column not in lite[table].columns
    for table, columns in PG_ONLY_INDEXES:
        assert columns in {index[0] for index in pg[table].indexes - lite[table].indexes}


def test_a_column_added_to_one_engine_only_is_caught(
    sqlite_dbs: tuple[sqlite3.Connection, sqlite3.Connection], pg_conn: psycopg.Connection
) -> None:
    state, _memory = sqlite_dbs
    state.execute("ALTER TABLE sessions ADD COLUMN mood TEXT")
    pg_conn.execute("CREATE INDEX notes_by_agent ON notes(agent_id)")
    pg_conn.execute("ALTER TABLE memory_vectors ALTER COLUMN model DROP NOT NULL")
    assert differences(*both_engines(sqlite_dbs, pg_conn)) == [
        "column memory_vectors.model: nullable False on SQLite",
        "index notes(('agent_id',), False, False): PostgreSQL only",
        "column sessions.mood: SQLite only",
    ]
