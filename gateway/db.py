"""The SQLite database behind the store: one aiosqlite writer connection, WAL, migrations.

Every write is a small function `fn(conn)` run on aiosqlite's worker thread. Writes that
arrive while a transaction is being committed are batched into the next one (group
commit): each caller still gets its own result only after its data is committed, but a
busy gateway pays one COMMIT per batch instead of one per message. A failing write
still fails alone: its batch is rolled back and run again with a savepoint per write.

Durability: `synchronous=NORMAL` in WAL mode survives a process crash (kill -9) with
every acknowledged write intact; only a power loss can drop the last few commits.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from gateway.checkpoint import SAFETY_NET_PAGES, WAL_SIZE_LIMIT, Checkpointer

T = TypeVar("T")

SCHEMA_VERSION = 4

# Index columns mirror fields of the entry JSON so look-ups and range scans stay O(log N).
_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE session_entries (
        session_key      TEXT PRIMARY KEY,
        session_id       TEXT NOT NULL,
        updated_at       REAL NOT NULL,
        active_minute    INTEGER NOT NULL,
        suspended        INTEGER NOT NULL DEFAULT 0,
        resume_pending   INTEGER NOT NULL DEFAULT 0,
        expiry_finalized INTEGER NOT NULL DEFAULT 0,
        entry            TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX session_entries_by_session_id ON session_entries(session_id);
    -- Range scans (recently active, idle, prune) go through a minute-granular copy of
    -- updated_at: a message touch rewrites this index at most once a minute per session.
    CREATE INDEX session_entries_by_minute ON session_entries(active_minute);

    CREATE TABLE sessions (
        session_id          TEXT PRIMARY KEY,
        session_key         TEXT NOT NULL,
        origin              TEXT,
        started_at          REAL NOT NULL,
        ended_at            REAL,
        end_reason          TEXT,
        title               TEXT,
        input_tokens        INTEGER NOT NULL DEFAULT 0,
        output_tokens       INTEGER NOT NULL DEFAULT 0,
        cache_read_tokens   INTEGER NOT NULL DEFAULT 0,
        cache_write_tokens  INTEGER NOT NULL DEFAULT 0,
        total_tokens        INTEGER NOT NULL DEFAULT 0,
        estimated_cost_usd  REAL NOT NULL DEFAULT 0
    ) WITHOUT ROWID;
    CREATE INDEX sessions_by_key ON sessions(session_key, started_at);

    CREATE TABLE messages (
        id          INTEGER PRIMARY KEY,
        session_id  TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
        role        TEXT NOT NULL,
        content     TEXT NOT NULL,
        message     TEXT NOT NULL,
        active      INTEGER NOT NULL DEFAULT 1,
        created_at  REAL NOT NULL
    );
    CREATE INDEX messages_by_session ON messages(session_id, active, id);

    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, content='messages', content_rowid='id'
    );
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES ('delete', old.id, old.content);
    END;
    """,
    # Durability (issue 4): every accepted inbound message, the in-flight turn markers and
    # the outbound delivery ledger.
    2: """
    CREATE TABLE inbox (
        id          INTEGER PRIMARY KEY,
        platform    TEXT NOT NULL,
        chat_id     TEXT NOT NULL,
        message_id  TEXT,
        session_key TEXT NOT NULL,
        kind        TEXT NOT NULL,
        event       TEXT NOT NULL,
        state       TEXT NOT NULL,
        accepted_at REAL NOT NULL,
        done_at     REAL
    );
    CREATE UNIQUE INDEX inbox_dedup ON inbox(platform, chat_id, message_id)
        WHERE message_id IS NOT NULL;
    CREATE INDEX inbox_open ON inbox(id) WHERE state = 'accepted';
    CREATE INDEX inbox_by_time ON inbox(accepted_at);

    CREATE TABLE turns (
        turn_id         INTEGER PRIMARY KEY,
        session_key     TEXT NOT NULL UNIQUE,
        session_id      TEXT NOT NULL,
        inbox_ids       TEXT NOT NULL,
        user_message_id INTEGER,
        event           TEXT NOT NULL,
        started_at      REAL NOT NULL
    );

    CREATE TABLE outbound (
        id                  INTEGER PRIMARY KEY,
        platform            TEXT NOT NULL,
        chat_id             TEXT NOT NULL,
        target              TEXT NOT NULL,
        text                TEXT NOT NULL,
        reply_to            TEXT,
        session_key         TEXT,
        state               TEXT NOT NULL,
        platform_message_id TEXT,
        created_at          REAL NOT NULL,
        sent_at             REAL
    );
    CREATE INDEX outbound_pending ON outbound(id) WHERE state = 'pending';
    CREATE INDEX outbound_by_chat ON outbound(platform, chat_id, id);
    """,
    # DM pairing: codes handed to unknown users, and the users the operator approved.
    3: """
    CREATE TABLE pairing_codes (
        platform    TEXT NOT NULL,
        code        TEXT NOT NULL,
        user_id     TEXT NOT NULL,
        user_name   TEXT,
        created_at  REAL NOT NULL,
        PRIMARY KEY (platform, code)
    ) WITHOUT ROWID;
    CREATE TABLE paired_users (
        platform    TEXT NOT NULL,
        user_id     TEXT NOT NULL,
        user_name   TEXT,
        approved_at REAL NOT NULL,
        PRIMARY KEY (platform, user_id)
    ) WITHOUT ROWID;
    """,
    # Full-text indexing in batches (gateway.fts): the insert trigger only notes the row.
    4: """
    CREATE TABLE fts_pending (id INTEGER PRIMARY KEY);
    DROP TRIGGER messages_fts_insert;
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT OR IGNORE INTO fts_pending(id) VALUES (new.id);
    END;
    DROP TRIGGER messages_fts_delete;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content)
        SELECT 'delete', old.id, old.content
        WHERE NOT EXISTS (SELECT 1 FROM fts_pending WHERE id = old.id);
        DELETE FROM fts_pending WHERE id = old.id;
    END;
    """,
}


class DatabaseError(RuntimeError):
    """The state database could not be opened or is not ours."""


def create_private_file(path: Path) -> None:
    """Create `path` with mode 0600 if absent (SQLite gives -wal/-shm the same mode)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


class Database:
    """One writer connection to `state.db`; `read()` and group-committed `write()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: aiosqlite.Connection | None = None
        self._pending: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]] = []
        self._driver: asyncio.Task[Any] | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._closing = False
        self._checkpointer: Checkpointer | None = None
        self.commits = 0  # batches run on the writer (the checkpointer's change signal)

    async def open(self) -> None:
        create_private_file(self.path)
        try:
            self._conn = await aiosqlite.connect(self.path, isolation_level=None)
            await self._conn.execute("PRAGMA journal_mode=WAL")
            await self._conn.execute("PRAGMA synchronous=NORMAL")
            await self._conn.execute("PRAGMA foreign_keys=ON")
            await self._conn.execute("PRAGMA busy_timeout=5000")
            # 32 MiB page cache: the hot B-tree pages of 100k sessions stay in memory.
            await self._conn.execute("PRAGMA cache_size=-32768")
            await self._conn._execute(_check_integrity, self._conn._conn, self.path)
            await self._conn._execute(self._migrate, self._conn._conn)
            # Checkpoints run beside the writer (gateway.checkpoint), not inside a commit.
            await self._conn.execute(f"PRAGMA wal_autocheckpoint={SAFETY_NET_PAGES}")
            await self._conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self._checkpointer = Checkpointer(self.path, lambda: self.commits)
            self._checkpointer.start()
        except sqlite3.DatabaseError as exc:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            raise DatabaseError(
                f"{self.path} cannot be used ({exc}). It was left untouched. Stop the "
                "gateway, copy the file somewhere safe, then run `hermes-gateway doctor "
                "--repair` to set it aside and rebuild what can be rebuilt."
            ) from None

    async def close(self) -> None:
        if self._conn is None:
            return
        self._closing = True
        while self._pending or self._driver is not None:
            self._idle.clear()
            await self._idle.wait()
        await asyncio.gather(*self._settling)
        if self._checkpointer is not None:
            await self._checkpointer.stop()
            self._checkpointer = None
        await self._conn.close()
        self._conn = None

    @property
    def is_open(self) -> bool:
        return self._conn is not None and not self._closing

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` on the connection thread, outside any explicit transaction."""
        conn = self._require_open()
        return await conn._execute(fn, conn._conn)

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` in a committed transaction; returns once it is durable."""
        self._require_open()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        if self._driver is None:
            # Nobody is committing: this caller drives the batch itself (no extra task hop).
            await self._drive(future)
        return await future

    def write_soon(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue `fn` for the next group commit without waiting for it: for writes whose
        caller has nothing to do after them (a delivery acknowledgement). The future
        settles once it is committed; `close()` waits for it."""
        self._require_open()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        if self._driver is None:
            self._driver = asyncio.create_task(self._drive(None), name="db-group-commit")
        return future

    # --- internals ---------------------------------------------------------------------

    def _require_open(self) -> aiosqlite.Connection:
        if self._conn is None or self._closing:
            raise DatabaseError("the session store is not open")
        return self._conn

    async def _settle_later(
        self, batch: list[tuple[Any, asyncio.Future[Any]]], outcome: list[tuple[bool, Any]]
    ) -> None:
        assert self._conn is not None
        await self._conn._execute(lambda: None)  # the worker thread is FIFO
        _settle(batch, outcome)

    async def _drive(self, own: asyncio.Future[Any] | None) -> None:
        """Commit batches until `own` is done (or the queue is empty), then hand over."""
        assert self._conn is not None
        self._driver = asyncio.current_task()
        try:
            while self._pending and not (own is not None and own.done()):
                batch, self._pending = self._pending, []
                outcome: list[tuple[bool, Any]] = []
                try:
                    await self._conn._execute(
                        _run_batch, self._conn._conn, [fn for fn, _ in batch], outcome
                    )
                except asyncio.CancelledError:
                    # The driving caller was cancelled (/stop), yet its batch still runs on
                    # the worker thread; settle it once the thread has moved past it.
                    settling = asyncio.create_task(self._settle_later(batch, outcome))
                    self._settling.add(settling)
                    settling.add_done_callback(self._settling.discard)
                    raise
                except Exception as exc:  # the connection itself failed
                    outcome[:] = [(False, exc)] * len(batch)
                self.commits += 1
                _settle(batch, outcome)
        finally:
            if self._pending:
                # Writes queued behind ours: a task of their own finishes them. It is the
                # driver from this instant, so no second driver can start in between.
                self._driver = asyncio.create_task(self._drive(None), name="db-group-commit")
            else:
                self._driver = None
                self._idle.set()

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"schema version {current} is newer than this gateway ({SCHEMA_VERSION}); "
                "upgrade hermes-gateway"
            )
        for version in range(current + 1, SCHEMA_VERSION + 1):
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _split_sql(_MIGRATIONS[version]):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version={version}")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise


def _check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """`PRAGMA quick_check` on open: a damaged database is reported, never papered over."""
    problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    if problems != ["ok"]:
        raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(problems)}")


def _settle(batch: list[tuple[Any, asyncio.Future[Any]]], outcome: list[tuple[bool, Any]]) -> None:
    """Hand each writer of a committed (or failed) batch its own result."""
    for (_, future), (ok, value) in zip(batch, outcome, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _split_sql(script: str) -> list[str]:
    """Split a migration into statements, keeping trigger bodies whole."""
    statements, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            statements.append(buf.strip())
            buf = ""
    if buf.strip():
        statements.append(buf.strip())
    return statements


def _run_batch(
    conn: sqlite3.Connection,
    fns: list[Callable[[sqlite3.Connection], Any]],
    outcome: list[tuple[bool, Any]],
) -> None:
    """Worker-thread side of group commit: one transaction, one savepoint per write.

    Results go into `outcome` (not a return value) so a cancelled caller can still read them.
    """
    outcome[:] = _commit_batch(conn, fns)


def _commit_batch(
    conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]
) -> list[tuple[bool, Any]]:
    """One transaction for the whole batch, without a savepoint per write: every
    statement the writer thread runs is a GIL hand-off, and savepoints were a third of
    them. Writes rarely fail; when one does, the batch is rolled back and run again with
    a savepoint per write, so the failing write fails alone (write functions are
    therefore re-runnable: they act through `conn` only)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        return [(False, exc)] * len(fns)
    results: list[tuple[bool, Any]] = []
    try:
        for fn in fns:
            results.append((True, fn(conn)))
        conn.execute("COMMIT")
    except Exception as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if len(fns) == 1:
            return [(False, exc)]
        return _commit_with_savepoints(conn, fns)
    return results


def _commit_with_savepoints(
    conn: sqlite3.Connection, fns: list[Callable[[sqlite3.Connection], Any]]
) -> list[tuple[bool, Any]]:
    results: list[tuple[bool, Any]] = []
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        return [(False, exc)] * len(fns)
    for fn in fns:
        conn.execute("SAVEPOINT op")
        try:
            value = fn(conn)
        except Exception as exc:
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
            results.append((False, exc))
        else:
            conn.execute("RELEASE op")
            results.append((True, value))
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        conn.execute("ROLLBACK")
        return [(False, exc)] * len(fns)
    return results
