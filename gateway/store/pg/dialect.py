"""The store's SQL on PostgreSQL: one connection object with the `sqlite3.Connection`
surface the store's write and read functions use (`execute`, `executemany`, cursors with
`fetchone`/`fetchall`/`rowcount`/`lastrowid`, `in_transaction`, `total_changes`), over a
sync psycopg 3 connection.

Why a translating connection and not a second copy of every query: the store's functions
(`fn(conn)`, gateway.store.db) are the shared code, written once; what differs between
the two engines is a handful of spellings, translated here once per distinct statement
(cached) and tested against both engines by the parametrized store suites:

- `?` placeholders become `%s` (and a literal `%` becomes `%%`);
- `INSERT OR IGNORE` becomes `INSERT ... ON CONFLICT DO NOTHING`, `INSERT OR REPLACE`
  an upsert on the table's primary key;
- `json_each(?)` becomes `json_array_elements_text(?::json)`, `json_extract(c, '$.f')`
  becomes `(c::json ->> 'f')`, `instr` becomes `strpos`, `LIKE` (case-blind in SQLite)
  becomes `ILIKE`;
- an INSERT into a table with an identity id gets `RETURNING id`, so `lastrowid` works;
- the schema-version pragmas read and write `hermes_schema` (the group commit's probe);
- `BEGIN IMMEDIATE` is `BEGIN` (every PostgreSQL write takes its row locks as it goes).

Errors that mean the database cannot be reached or cannot write (connection lost, server
shutting down, disk full, read-only) are raised as `StoreUnwritable`, so the group
commit's outage handling (parking acknowledged work, refusing new work with 503) is the
same on both engines. Error texts never hold the DSN: libpq's messages name the host and
port, never the password.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import TransactionStatus
from psycopg.types.numeric import Int8Dumper

from gateway.store.outage import StoreUnwritable

#: tables whose primary key is an identity `id`: an INSERT returns it (`lastrowid`)
IDENTITY_TABLES = frozenset(
    {
        "messages",
        "inbox",
        "turns",
        "outbound",
        "schedule_runs",
        "fts_log",
        "note_log",
    }
)

#: primary keys of the tables written with `INSERT OR REPLACE`
_REPLACE_KEYS = {"paired_users": ("platform", "user_id"), "log_readers": ("name",)}

_INSERT = re.compile(r"^\s*INSERT\s+(OR\s+(IGNORE|REPLACE)\s+)?INTO\s+(\w+)", re.IGNORECASE)
_COLUMNS = re.compile(r"INTO\s+\w+\s*\(([^)]*)\)", re.IGNORECASE)
_JSON_EACH = re.compile(r"json_each\(\?\)", re.IGNORECASE)
_JSON_EXTRACT = re.compile(r"json_extract\(([\w.]+),\s*'\$\.(\w+)'\)", re.IGNORECASE)
_INSTR = re.compile(r"\binstr\(", re.IGNORECASE)
_LIKE = re.compile(r"(?<!NOT )\bLIKE\b", re.IGNORECASE)
_PRAGMA_READ = re.compile(r"^\s*PRAGMA\s+user_version\s*$", re.IGNORECASE)
_PRAGMA_WRITE = re.compile(r"^\s*PRAGMA\s+user_version\s*=\s*(\d+)\s*$", re.IGNORECASE)


class Translated:
    """One statement in PostgreSQL's spelling, and whether it returns the new row's id."""

    __slots__ = ("returns_id", "sql", "writes")

    def __init__(self, sql: str, returns_id: bool) -> None:
        self.sql = sql
        self.returns_id = returns_id
        self.writes = sql.lstrip()[:6].upper() in ("INSERT", "UPDATE", "DELETE")


@functools.lru_cache(maxsize=4096)
def translate(sql: str) -> Translated:
    """`sql` as the store writes it for SQLite, spelled for PostgreSQL."""
    if _PRAGMA_READ.match(sql):
        return Translated("SELECT version FROM hermes_schema", False)
    if pragma := _PRAGMA_WRITE.match(sql):
        return Translated(f"UPDATE hermes_schema SET version = {int(pragma.group(1))}", False)
    if sql.strip().upper() == "BEGIN IMMEDIATE":
        return Translated("BEGIN", False)
    text = sql
    returns_id = False
    insert = _INSERT.match(text)
    if insert:
        verb, table = (insert.group(2) or "").upper(), insert.group(3).lower()
        text = text[: insert.start(1)] + text[insert.end(1) :] if verb else text
        conflict = ""
        if verb == "IGNORE":
            conflict = " ON CONFLICT DO NOTHING"
        elif verb == "REPLACE":
            conflict = _upsert(text, table)
        if conflict:
            at = _returning_at(text)
            text = text[:at].rstrip() + conflict + (" " + text[at:] if at < len(text) else "")
        if table in IDENTITY_TABLES and not re.search(r"\bRETURNING\b", text, re.IGNORECASE):
            text = text.rstrip().rstrip(";") + " RETURNING id"
            returns_id = True
    text = _JSON_EACH.sub("json_array_elements_text(?::json)", text)
    text = _JSON_EXTRACT.sub(r"(\1::json ->> '\2')", text)
    text = _INSTR.sub("strpos(", text)
    text = _LIKE.sub("ILIKE", text)
    return Translated(_placeholders(text), returns_id)


def _returning_at(sql: str) -> int:
    found = re.search(r"\bRETURNING\b", sql, re.IGNORECASE)
    return found.start() if found else len(sql)


def _upsert(sql: str, table: str) -> str:
    keys = _REPLACE_KEYS.get(table)
    columns = _COLUMNS.search(sql)
    if keys is None or columns is None:
        raise ValueError(f"INSERT OR REPLACE INTO {table}: no primary key known for PostgreSQL")
    names = [name.strip() for name in columns.group(1).split(",")]
    updates = ", ".join(f"{name} = EXCLUDED.{name}" for name in names if name not in keys)
    action = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
    return f" ON CONFLICT ({', '.join(keys)}) {action}"


def _placeholders(sql: str) -> str:
    """`?` outside string literals becomes `%s`; every `%` is doubled first."""
    out: list[str] = []
    quoted = False
    for char in sql:
        if char == "'":
            quoted = not quoted
            out.append(char)
        elif char == "%":
            out.append("%%")
        elif char == "?" and not quoted:
            out.append("%s")
        else:
            out.append(char)
    return "".join(out)


class _BoolAsInt(Int8Dumper):
    """Flags are INTEGER 0/1 columns, as in SQLite: Python's bools are sent as 0/1."""

    def dump(self, obj: Any) -> bytes:
        return b"1" if obj else b"0"


def configure(conn: psycopg.Connection[Any]) -> None:
    """What every store connection needs: bools as integers."""
    conn.adapters.register_dumper(bool, _BoolAsInt)


def unreachable(exc: BaseException) -> StoreUnwritable | None:
    """`StoreUnwritable` for an error meaning the database cannot take writes now."""
    if isinstance(
        exc, pg_errors.DiskFull | pg_errors.ReadOnlySqlTransaction | pg_errors.AdminShutdown
    ):
        return StoreUnwritable(f"database cannot write: {_first_line(exc)}")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and not isinstance(
        exc, pg_errors.QueryCanceled | pg_errors.LockNotAvailable
    ):
        return StoreUnwritable(f"database unreachable: {_first_line(exc)}")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class PgCursor:
    """The part of `sqlite3.Cursor` the store uses."""

    __slots__ = ("_cursor", "lastrowid", "rowcount")

    def __init__(self, cursor: psycopg.Cursor[Any], rowcount: int, lastrowid: int | None) -> None:
        self._cursor = cursor
        self.rowcount = rowcount
        self.lastrowid = lastrowid

    def fetchone(self) -> Any:
        if self._cursor.description is None:
            return None
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        if self._cursor.description is None:
            return []
        return self._cursor.fetchall()

    def fetchmany(self, size: int) -> list[Any]:
        if self._cursor.description is None:
            return []
        return self._cursor.fetchmany(size)

    def __iter__(self) -> Iterator[Any]:
        if self._cursor.description is None:
            return iter(())
        return iter(self._cursor)


class PgConn:
    """A psycopg connection spoken to like the store's `sqlite3.Connection`: statements
    translated (`translate`), transactions by `BEGIN`/`COMMIT` statements (the
    connection is in autocommit mode, as `isolation_level=None` is for sqlite3)."""

    dialect = "postgres"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.raw = conn
        self.total_changes = 0
        self._trace: Callable[[str], object] | None = None

    @property
    def in_transaction(self) -> bool:
        return self.raw.info.transaction_status != TransactionStatus.IDLE

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> PgCursor:
        statement = translate(sql)
        if self._trace is not None:
            self._trace(statement.sql)
        try:
            cursor = self.raw.execute(statement.sql, params or None)
        except psycopg.Error as exc:
            refused = unreachable(exc)
            if refused is not None:
                raise refused from exc
            raise
        rowcount = cursor.rowcount
        lastrowid = None
        if statement.returns_id:
            row = cursor.fetchone()
            lastrowid = row[0] if row else None
        if statement.writes and rowcount > 0:
            self.total_changes += rowcount
        return PgCursor(cursor, rowcount, lastrowid)

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> PgCursor:
        statement = translate(sql)
        if self._trace is not None:
            self._trace(statement.sql)
        sql_text = statement.sql
        if statement.returns_id:
            sql_text = sql_text[: sql_text.rindex(" RETURNING id")]
        try:
            with self.raw.cursor() as cursor:
                cursor.executemany(sql_text, list(seq))
                rowcount = cursor.rowcount
        except psycopg.Error as exc:
            refused = unreachable(exc)
            if refused is not None:
                raise refused from exc
            raise
        self.total_changes += max(rowcount, 0)
        return PgCursor(self.raw.cursor(), rowcount, None)

    def set_trace_callback(self, callback: Callable[[str], object] | None) -> None:
        self._trace = callback

    def close(self) -> None:
        self.raw.close()


def is_postgres(conn: object) -> bool:
    """Whether a store function was handed a PostgreSQL connection (`PgConn`)."""
    return getattr(conn, "dialect", None) == "postgres"
