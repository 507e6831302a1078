"""The transcript full-text index, in a database file of its own (`search.db`, beside
`state.db`), kept up by a thread of its own.

Why a file of its own: indexing is work per message (tokenizing, writing FTS5
segments). Inside state.db it would hold the one write lock every turn needs, for
milliseconds at a time under load, and set the gateway's p99 (BENCHMARKS.md, "Round
three"). In search.db it takes no lock a turn needs, and SQLite does the work
with the GIL released, on the other core.

How it stays exact: state.db logs every insert and delete of a message in `fts_log` (a
trigger: one append in the turn's own transaction; AUTOINCREMENT, so a sequence number
is never reused). A round reads the log after `applied_seq` from a read snapshot of
state.db (attached read-only) and, for every message id it names, indexes the message
as it is now, or leaves it out if it is gone. It stores the new `applied_seq` in the
same search.db transaction, so a crash repeats a round at most, and a repeated round
changes nothing. The writer then trims the log behind it.

A missing search.db, or one that does not match state.db's log (state.db was rebuilt
or restored), is rebuilt from all messages, in the background.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import quote

import structlog

from gateway.store.background import ThreadedSqliteTask
from gateway.store.db import create_private_file
from gateway.store.outage import Outage, StoreUnwritable
from gateway.util.backoff import Backoff
from gateway.util.fsutil import set_aside

if TYPE_CHECKING:
    from gateway.store.db import Database

log = structlog.get_logger("gateway.store.fts")
T = TypeVar("T")

SEARCH_DB = "search.db"
ROUND_LIMIT = 20_000  # log entries applied per transaction

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content);
"""
# The highest sequence number ever handed out (the log itself may be trimmed empty).
_LAST_SEQ = "SELECT coalesce((SELECT seq FROM st.sqlite_sequence WHERE name = 'fts_log'), 0)"
_TOUCHED = "SELECT id FROM st.fts_log WHERE seq > :lo AND seq <= :hi"


def search_files(sessions_dir: Path) -> list[Path]:
    base = sessions_dir / SEARCH_DB
    return [base, base.with_name(base.name + "-wal"), base.with_name(base.name + "-shm")]


def connect(search_path: Path, state_path: Path) -> sqlite3.Connection:
    """search.db for writing, with state.db attached read-only as `st`."""
    return connect_index(search_path, state_path, _SCHEMA)


def connect_index(path: Path, state_path: Path, schema: str) -> sqlite3.Connection:
    """An index database derived from state.db (search.db, memory.db) for writing, its
    `schema` applied, with state.db attached read-only as `st`.

    A file SQLite finds damaged (not a database, or corrupt) is set aside with a warning
    and a fresh one is made: it only ever holds what state.db can give again, and the
    indexer rebuilds what it finds missing. A busy, unreadable or full one raises."""
    try:
        conn = _open_index(path, schema)
    except sqlite3.DatabaseError as exc:
        if not is_damaged(exc):
            raise
        moved = set_index_aside(path)
        log.warning("index_db_damaged", path=str(path), moved_to=moved, error=str(exc))
        conn = _open_index(path, schema)
    try:
        # Read-only on purpose: state.db's write lock belongs to the gateway's writer.
        conn.execute("ATTACH DATABASE ? AS st", (f"file:{quote(str(state_path))}?mode=ro",))
    except BaseException:
        conn.close()
        raise
    return conn


def _open_index(path: Path, schema: str) -> sqlite3.Connection:
    create_private_file(path)
    conn = sqlite3.connect(
        f"file:{quote(str(path))}", uri=True, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        conn.executescript(schema)
    except BaseException:
        conn.close()
        raise
    return conn


def is_damaged(exc: BaseException) -> bool:
    """SQLite found the file damaged: not a database, or corrupt. (Not: busy, locked, a
    full disk, an I/O error: those pass, and setting the file aside would not help.)"""
    name = getattr(exc, "sqlite_errorname", None) or ""
    return name == "SQLITE_NOTADB" or name.startswith("SQLITE_CORRUPT")


def set_index_aside(path: Path) -> str | None:
    """Rename an index database and its -wal and -shm to `<name>.corrupt-<time>`; the
    new name of the database file (None: it was gone already, another process moved it)."""
    moved = None
    for each in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            aside = set_aside(each)
        except FileNotFoundError:
            continue
        if each == path:
            moved = aside.name
    return moved


def apply_log(conn: sqlite3.Connection, limit: int = ROUND_LIMIT) -> tuple[int, int]:
    """One round: apply up to `limit` log entries (or rebuild); returns (entries applied
    or messages indexed by a rebuild, the sequence number now applied)."""
    # Deferred: a round with nothing new only reads, and writes not a byte (it used to
    # commit `applied_seq` unchanged four times a second: ~500 KB of search.db-wal per
    # idle 30 s). Nothing else writes search.db, so the upgrade to a write cannot be busy.
    conn.execute("BEGIN")
    try:
        last = conn.execute(_LAST_SEQ).fetchone()[0]
        row = conn.execute("SELECT value FROM meta WHERE key = 'applied_seq'").fetchone()
        first = conn.execute("SELECT min(seq) FROM st.fts_log").fetchone()[0]
        applied = row[0] if row else None
        # Rebuild when the index is new, or when state.db's log does not continue from
        # it: its numbers went backwards, or entries were trimmed that it never applied.
        if applied is None or last < applied or (first or last + 1) > applied + 1:
            conn.execute("DELETE FROM messages_fts")
            count = conn.execute(
                "INSERT INTO messages_fts(rowid, content) SELECT id, content FROM st.messages"
            ).rowcount
            hi = last
        else:
            hi = min(last, applied + limit)
            count = hi - applied
            if count:
                span = {"lo": applied, "hi": hi}
                conn.execute(f"DELETE FROM messages_fts WHERE rowid IN ({_TOUCHED})", span)
                conn.execute(
                    "INSERT INTO messages_fts(rowid, content) SELECT id, content"
                    f" FROM st.messages WHERE id IN ({_TOUCHED})",
                    span,
                )
        if hi != applied:
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('applied_seq', ?)", (hi,)
            )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # a full disk may have rolled it back already
            conn.execute("ROLLBACK")
        raise
    return count, hi


def trim_log(conn: sqlite3.Connection, applied_seq: int) -> None:
    """Writer side: forget log entries the index has applied, and every other reader of
    the log (`log_readers`: the memory indexer, gateway.memory.index) too."""
    conn.execute(
        "DELETE FROM fts_log WHERE seq <= min(?, coalesce((SELECT min(applied)"
        " FROM log_readers), ?))",
        (applied_seq, applied_seq),
    )


class FtsIndexer(ThreadedSqliteTask):
    """Runs `apply_log` rounds on a worker thread every `interval` seconds, when the
    gateway's writer committed since the last round (every message it logs commits
    there): an idle gateway's indexer neither reads nor writes, and looks once a second."""

    def __init__(self, db: Database, sessions_dir: Path, interval: float = 0.25) -> None:
        super().__init__(interval)
        self.db = db
        self.path = sessions_dir / SEARCH_DB
        self._lock = asyncio.Lock()  # one round at a time on the one connection

    async def catch_up(self) -> int:
        """Apply everything logged so far (searches call this to see the last seconds);
        returns how many log entries (or rebuilt messages) that took."""
        total = 0
        while True:
            count, done = await self._round()
            total += count
            if done:
                return total

    async def query(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` on search.db (state.db attached read-only as `st`), on the worker thread,
        once the index has caught up with everything committed before the call (the
        searches of `gateway.store.search`)."""
        await self.catch_up()
        async with self._lock:
            if self._conn is None:
                self._conn = await self._in_thread(connect, self.path, self.db.path)
            return await self._in_thread(fn, self._conn)

    def start(self) -> None:
        self._start(self._run(), "fts-indexer")

    async def _run(self) -> None:
        # Searching is not worth a log line four times a second (a full disk): logged once
        # a minute, retried after 0.5 s, 1 s, 2 s, ... up to a minute.
        failing = Outage(log, "fts_index_failed", path=str(self.path))
        retry = Backoff(initial=2 * self.interval, maximum=60.0, jitter=0)
        seen = -1  # the writer's commit count at the last round: none since, nothing new
        while True:
            commits = self.db.commits
            try:
                if worked := commits != seen:
                    await self.catch_up()
                    seen = commits
                retry.reset()
                failing.ended()
            except (sqlite3.Error, OSError) as exc:
                failing.failed(str(exc))
                await self._reset()
                await retry.sleep()
                continue
            await self._pause(worked)

    async def _round(self) -> tuple[int, bool]:
        async with self._lock:
            if self._conn is None:
                self._conn = await self._in_thread(connect, self.path, self.db.path)
            count, applied = await self._in_thread(apply_log, self._conn)
        if count:
            self.db.write_soon(lambda conn: trim_log(conn, applied)).add_done_callback(
                _log_failed_trim
            )
        return count, count < ROUND_LIMIT

    async def _reset(self) -> None:
        """After a failed round: drop the connection; a damaged search.db is set aside
        and rebuilt (it only ever holds what state.db can give again)."""
        async with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            problem = await asyncio.to_thread(index_damage, self.path)
            if problem is not None:
                moved = await asyncio.to_thread(set_index_aside, self.path)
                log.warning("index_db_damaged", path=str(self.path), moved_to=moved, error=problem)


def index_damage(path: Path) -> str | None:
    """What SQLite's quick check finds wrong with an index database (None: nothing, or
    the file is absent, or it could not be read for a reason other than damage)."""
    if not path.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(10)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return str(exc) if is_damaged(exc) else None
    return None if problems == ["ok"] else "; ".join(problems)


def _log_failed_trim(future: asyncio.Future[None]) -> None:
    exc = None if future.cancelled() else future.exception()
    # A disk that refuses writes is reported by the store; the next round trims again.
    if exc is not None and not isinstance(exc, StoreUnwritable):
        log.warning("fts_log_trim_failed", error=str(exc))
