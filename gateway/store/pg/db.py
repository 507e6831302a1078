"""The store on PostgreSQL: the same `Database` (group commit, parked writes while the
database is away, reads that see every write queued before them), with the writer and the
readers on threads of their own, on sync psycopg connections (`PgConn`).

Why threads and not the event loop's own thread (as for SQLite): a PostgreSQL statement is
a network round trip, and psycopg releases the GIL while it waits, so the loop keeps
serving while a batch commits. Writes queued while one batch is in flight form the next
one: a busy gateway still pays one COMMIT per batch.

The readers take their connections from a pool (`gateway.store.pg.readers`). With
`pipeline` the writer sends a batch's statements in psycopg's pipeline mode
(`gateway.store.pg.batch`) and each read its BEGIN with its first statement.

A lost connection fails the batch with `StoreUnwritable` ("database unreachable"): new
messages are refused (HTTP 503, platforms redeliver), acknowledged work is parked and
tried again every `retry_interval` seconds on a fresh connection, exactly as for a full
disk under SQLite. Nothing of a failed batch was committed, so the retry is safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
import structlog

from gateway.store.batch import commit_batch, probe, refusal
from gateway.store.db import Database, DatabaseError, DatabaseUnreachable, _settle
from gateway.store.outage import Outage, StoreUnwritable
from gateway.store.pg import schema
from gateway.store.pg.batch import commit_pipelined
from gateway.store.pg.dialect import PgConn, configure, unreachable
from gateway.store.pg.dsn import redact
from gateway.store.pg.readers import Readers

T = TypeVar("T")

log = structlog.get_logger("gateway.store.pg")

READERS = 4  # reader connections: reads of different turns run side by side
# Pipeline mode saves round trips but costs this process more CPU per statement, and most
# of a turn's writes read their result back (a new row's id, a row count), which waits
# anyway: measured on a loaded 2-core machine with the server on 127.0.0.1, the store
# spent more CPU per write and did fewer turns with it. Off by default; worth turning on
# where a round trip costs more than that CPU (a server across a network).
PIPELINE = False
CONNECT_TIMEOUT = 5  # seconds


def connect(dsn: str, *, read_only: bool = False) -> PgConn:
    """A store connection: autocommit (transactions by statement, as with sqlite3's
    `isolation_level=None`), bools as integers, reads in one snapshot each."""
    try:
        raw = psycopg.connect(dsn, autocommit=True, connect_timeout=CONNECT_TIMEOUT)
    except psycopg.Error as exc:
        raise unreachable(exc) or exc from None
    configure(raw)
    if read_only:
        raw.execute(
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        )
    return PgConn(raw)


class PgDatabase(Database):
    """`Database` on PostgreSQL (see the module's docstring)."""

    def __init__(self, dsn: str, readers: int = READERS, *, pipeline: bool = PIPELINE) -> None:
        super().__init__(path=None)  # type: ignore[arg-type]
        self.dsn = dsn
        self.pipeline = pipeline
        self.unwritable = Outage(log, "store_unwritable", database=redact(dsn))
        self._writer_pool = ThreadPoolExecutor(1, thread_name_prefix="pg-writer")
        self._reader_pool = ThreadPoolExecutor(readers, thread_name_prefix="pg-reader")
        self._readers = Readers(dsn, readers, CONNECT_TIMEOUT, pipeline=pipeline)
        self._readers_open = False
        self._local = threading.local()
        self._conns: list[PgConn] = []  # the writer's connections, closed at close()
        self._conns_lock = threading.Lock()
        self._in_flight = False  # a batch is committing on the writer thread
        self._trace: Callable[[str], object] | None = None

    def check_soon(self) -> None:
        """Nothing to check ahead: the server keeps its own files sound."""

    async def open(self) -> None:
        try:
            conn = await asyncio.get_running_loop().run_in_executor(
                self._writer_pool, self._open_writer
            )
        except (psycopg.Error, StoreUnwritable) as exc:
            await self._close_connections()
            # Not answering is a passing state (a restart of the server, the network):
            # the service manager tries again. Anything else is for the operator.
            error = DatabaseUnreachable if isinstance(exc, StoreUnwritable) else DatabaseError
            raise error(
                f"the PostgreSQL store at {redact(self.dsn)} cannot be used ({_reason(exc)})"
            ) from None
        self._writer = conn  # type: ignore[assignment]
        self._readers.open()
        self._readers_open = True

    def _open_writer(self) -> PgConn:
        conn = self._connection()
        schema.migrate(conn.raw)
        return conn

    def _connection(self) -> PgConn:
        """The writer thread's connection, (re)opened when absent or broken."""
        conn: PgConn | None = getattr(self._local, "conn", None)
        if conn is not None and not conn.raw.closed and not conn.raw.broken:
            return conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        conn = connect(self.dsn)
        if self._trace is not None:
            conn.set_trace_callback(self._trace)
        self._local.conn = conn
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    async def read(self, fn: Callable[[Any], T]) -> T:
        self._require_open()
        if self._pending or self._in_flight:
            with contextlib.suppress(StoreUnwritable):
                await self.write_soon(_nothing)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._reader_pool, self._readers.read, fn)

    def data_version(self) -> int:
        """Counts this replica's commits: on PostgreSQL other writers are announced by
        NOTIFY (gateway.cluster), not by a file header."""
        return self.commits

    def trace_writes(self, callback: Callable[[str], object] | None) -> None:
        self._trace = callback
        self._require_open().set_trace_callback(callback)

    # --- the group commit, on the writer thread -----------------------------------------

    def _flush_soon(self) -> None:
        if self._flush is None and not self._in_flight:
            self._flush = asyncio.get_running_loop().call_soon(
                self._commit_pending, context=contextvars.Context()
            )

    def _commit_pending(self) -> None:
        self._flush = None
        if not self._pending:
            self._idle.set()
            return
        batch, self._pending = self._pending, []
        self._in_flight = True
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(
            self._writer_pool, self._commit_batch, [fn for fn, _, _ in batch]
        )
        done.add_done_callback(lambda outcome: self._committed(batch, outcome))

    def _commit_batch(self, fns: list[Callable[[Any], Any]]) -> tuple[Any, int]:
        try:
            conn = self._connection()
        except (psycopg.Error, StoreUnwritable) as exc:
            return [(False, refusal(unreachable(exc) or exc))] * len(fns), 0
        before = conn.total_changes
        outcome = commit_pipelined(conn, fns) if self.pipeline else commit_batch(conn, fns)  # type: ignore[arg-type]
        return outcome, conn.total_changes - before

    def _committed(self, batch: list[Any], done: asyncio.Future[Any]) -> None:
        self._in_flight = False
        fns = [fn for fn, _, _ in batch]
        try:
            outcome, changes = done.result()
        except Exception as exc:  # the writer thread itself failed
            outcome, changes = [(False, refusal(exc))] * len(batch), 0
        refused = outcome[0][1] if outcome and isinstance(outcome[0][1], StoreUnwritable) else None
        if refused is None:
            self.commits += 1
            if changes or probe in fns:
                self._writable_again()
        else:
            settled = self._park(batch, refused)
            batch, outcome = settled, outcome[: len(settled)]
        _settle(batch, outcome)
        if self._pending:
            self._flush_soon()
        else:
            self._idle.set()

    async def close(self) -> None:
        if self._writer is None:
            return
        self._closing = True
        self._give_up_parked()
        while self._flush is not None or self._in_flight:
            self._idle.clear()
            await self._idle.wait()
        await self._close_connections()

    async def _close_connections(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self._writer = None
        self._writer_pool.shutdown(wait=False)
        self._reader_pool.shutdown(wait=False)
        if self._readers_open:
            self._readers_open = False
            await asyncio.get_running_loop().run_in_executor(None, self._readers.close)


def _nothing(conn: Any) -> None:
    """A place in the write queue: `read()` waits for it to see the writes before it."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, StoreUnwritable):
        return exc.reason
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
