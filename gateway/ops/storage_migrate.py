"""`hermes-gateway storage migrate --to postgresql://...`: copy a home's state.db into an
empty PostgreSQL database, then say what to change in hermes.yaml.

Offline only: it holds the home's lock (`gateway.store.homelock`) while it copies, so no
gateway runs on the home meanwhile. The target gets the baseline schema
(`gateway.store.pg.schema`) and must hold no rows in any of the gateway's tables. Every
table is copied with its ids (COPY, streamed in batches) in ONE transaction, each identity
sequence is moved past the largest id the table ever gave out, and the row counts are
compared before the commit: a failure anywhere commits nothing. (The schema itself is
created in transactions of its own, before the copy: an empty schema is left behind,
which the gateway would create the same way.)

search.db and memory.db are not copied: they are indexes derived from the copied tables.

The DSN's password is never printed: `${VAR}` references in `--to` are expanded from the
environment (so the password need not be on the command line, `ps` shows it), and libpq
also reads PGPASSWORD. Exit codes: 0 copied, 1 refused or failed (nothing copied).
"""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import sys
import time
from pathlib import Path

import psycopg
from psycopg import sql

from config import GatewayConfig, hermes_home
from gateway.store.homelock import HomeInUse, HomeLock
from gateway.store.migrations import SCHEMA_VERSION
from gateway.store.pg.dsn import PASSWORD_REFERENCE, passwords, redact, scrub
from gateway.store.pg.schema import TABLES, migrate
from gateway.store.session_store import STATE_DB

BATCH_ROWS = 5000
CONNECT_TIMEOUT_SECONDS = 10
#: tables whose triggers write log rows: the logs are copied as they are instead
_LOGGING_TABLES = ("messages", "notes")
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class MigrateError(Exception):
    """Why the copy was refused or failed; the message is for people (no password)."""


def cmd_storage(args: argparse.Namespace, config: GatewayConfig) -> int:
    dsn = args.to
    try:
        dsn = expand_env(args.to)
        return copy_home(hermes_home(), dsn)
    except MigrateError as exc:
        print(f"storage migrate: {scrub(str(exc), dsn)}", file=sys.stderr)
    except (psycopg.Error, sqlite3.Error) as exc:
        # libpq's messages name hosts and users, not passwords; scrubbed all the same.
        message = scrub(str(exc).strip(), dsn)
        print(f"storage migrate: failed, nothing was copied: {message}", file=sys.stderr)
    return 1


def expand_env(dsn: str) -> str:
    """`${VAR}` in the DSN replaced by the environment's value (unset: refused)."""

    def value(match: re.Match[str]) -> str:
        found = os.environ.get(match.group(1))
        if found is None:
            raise MigrateError(f"--to: environment variable {match.group(1)} is not set")
        return found

    return _ENV_REFERENCE.sub(value, dsn)


def copy_home(home: Path, dsn: str) -> int:
    """Copy `home`'s state.db into the database at `dsn`; prints the counts and the config.
    Raises MigrateError (refused), psycopg.Error or sqlite3.Error (failed)."""
    db = home / "sessions" / STATE_DB
    if not db.is_file():
        raise MigrateError(f"no {db}: nothing to copy (is --home / HERMES_HOME right?)")
    try:
        lock = HomeLock.acquire(home)
    except HomeInUse as exc:
        raise MigrateError(f"refused: {exc}; stop it first") from None
    with lock:
        source = _open_source(db)
        try:
            print(f"copying {db} (schema version {SCHEMA_VERSION}) to {redact(dsn)}")
            started = time.monotonic()
            with psycopg.connect(
                dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS
            ) as target:
                migrate(target)
                counts = _copy(source, target)
        finally:
            source.close()
    width = max(len(name) for name in counts)
    for name, count in counts.items():
        print(f"  {name:{width}}  {count:>10} rows")
    total = sum(counts.values())
    print(
        f"copied {total} rows of {len(counts)} tables in {time.monotonic() - started:.1f} s;"
        " row counts verified, id sequences continue after each table's largest id"
    )
    print(
        "not copied: search.db and memory.db, indexes derived from these tables (on"
        " PostgreSQL transcript search uses the database's own index, and long-term"
        " memory's index is built in its memory_* tables at the gateway's first start)"
    )
    _print_config(dsn)
    return 0


def _open_source(db: Path) -> sqlite3.Connection:
    source = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    source.execute("PRAGMA busy_timeout=5000")
    version = source.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        source.close()
        if version > SCHEMA_VERSION:
            raise MigrateError(
                f"{db}: schema version {version} is newer than this gateway"
                f" ({SCHEMA_VERSION}); upgrade hermes-gateway"
            )
        raise MigrateError(
            f"{db}: schema version {version}, this gateway's is {SCHEMA_VERSION}: open it"
            " once with this version first (e.g. `hermes-gateway sessions list`), then migrate"
        )
    source.execute("BEGIN")  # one snapshot for the copy and the counts
    return source


def _sqlite_tables(source: sqlite3.Connection) -> dict[str, list[str]]:
    """The tables to copy, parents first, with their columns. A table the Postgres schema
    does not know (a newer SQLite step without its twin) is refused, not skipped."""
    names = [
        name
        for (name,) in source.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    ]
    unknown = sorted(set(names) - set(TABLES))
    if unknown:
        raise MigrateError(f"state.db has tables the PostgreSQL schema lacks: {unknown}")
    return {
        name: [col[1] for col in source.execute(f'PRAGMA table_info("{name}")')]
        for name in TABLES
        if name in names
    }


def _copy(source: sqlite3.Connection, target: psycopg.Connection) -> dict[str, int]:
    """Every table in one transaction; returns the row counts (verified) by table."""
    tables = _sqlite_tables(source)
    with target.transaction():
        # No gateway on the target may write while we copy, or find a half-copied store.
        target.execute(
            sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(
                sql.SQL(", ").join(sql.Identifier(name) for name in TABLES)
            )
        )
        busy = [name for name in TABLES if _has_rows(target, name)]
        if busy:
            raise MigrateError(
                f"refused: the target already holds rows in {', '.join(busy)}; migrate into"
                " an empty database (or schema), nothing was changed"
            )
        _check_columns(target, tables)
        for name in _LOGGING_TABLES:
            target.execute(
                sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(sql.Identifier(name))
            )
        counts = {
            name: _copy_table(source, target, name, columns) for name, columns in tables.items()
        }
        for name in _LOGGING_TABLES:
            target.execute(
                sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(sql.Identifier(name))
            )
        _continue_sequences(source, target)
        for name, copied in counts.items():
            (stored,) = target.execute(
                sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(name))
            ).fetchone() or (0,)
            (expected,) = source.execute(f'SELECT count(*) FROM "{name}"').fetchone()
            if not stored == copied == expected:
                raise MigrateError(
                    f"{name}: {expected} rows in state.db, {copied} copied, {stored} stored;"
                    " nothing was copied"
                )
    return counts


def _has_rows(target: psycopg.Connection, name: str) -> bool:
    query = sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(sql.Identifier(name))
    row = target.execute(query).fetchone()
    return bool(row and row[0])


def _check_columns(target: psycopg.Connection, tables: dict[str, list[str]]) -> None:
    found: dict[str, set[str]] = {}
    for table, column in target.execute(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = current_schema()"
    ):
        found.setdefault(table, set()).add(column)
    for name, columns in tables.items():
        if found.get(name) != set(columns):
            raise MigrateError(f"{name}: the PostgreSQL table's columns differ from state.db's")


def _copy_table(
    source: sqlite3.Connection, target: psycopg.Connection, name: str, columns: list[str]
) -> int:
    """Stream one table through COPY, BATCH_ROWS at a time; returns the rows written."""
    quoted = ", ".join(f'"{column}"' for column in columns)
    rows = source.execute(f'SELECT {quoted} FROM "{name}"')
    statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
        sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    )
    written = 0
    try:
        with target.cursor() as cursor, cursor.copy(statement) as copy:
            while batch := rows.fetchmany(BATCH_ROWS):
                for row in batch:
                    copy.write_row(row)
                written += len(batch)
    except psycopg.Error as exc:
        raise MigrateError(f"copying {name} failed, nothing was copied: {exc}") from None
    return written


def _continue_sequences(source: sqlite3.Connection, target: psycopg.Connection) -> None:
    """Each identity column's next value: one past the largest id, or past the largest
    AUTOINCREMENT ever gave out (sqlite_sequence: an id trimmed away, like an applied
    log entry, must not come back)."""
    given = dict(source.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    identities = target.execute(
        "SELECT table_name, column_name FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND is_identity = 'YES'"
    ).fetchall()
    for table, column in identities:
        query = sql.SQL("SELECT coalesce(max({}), 0) FROM {}").format(
            sql.Identifier(column), sql.Identifier(table)
        )
        (largest,) = target.execute(query).fetchone() or (0,)
        following = max(int(largest), int(given.get(table) or 0)) + 1
        target.execute(
            "SELECT setval(pg_get_serial_sequence(%s, %s), %s, false)",
            (sql.Identifier(table).as_string(target), column, following),
        )


def _print_config(dsn: str) -> None:
    shown = redact(dsn, PASSWORD_REFERENCE)
    print("\nNow set in hermes.yaml (and start the gateway):\n")
    print(f"storage:\n  backend: postgres\n  dsn: {shown}")
    if passwords(dsn):
        print(
            f"\nwith the password in the environment variable {PASSWORD_REFERENCE[2:-1]}"
            " (for the service: in HOME/.env, mode 0600)"
        )
