"""The SQLite database behind the store: one writer connection on the event loop's own
thread, one reader connection on a thread of its own, WAL (the schema and its
migrations: `gateway.store.migrations`).

Every write is a small function `fn(conn)`. Writes queued during one pass of the event
loop are committed together at the end of it (group commit): each caller still gets its
own result only after its data is committed, but a busy gateway pays one COMMIT per
batch instead of one per message. A failing write still fails alone: its batch is
rolled back and run again with a savepoint per write.

A disk that cannot take a write (full, read-only, failing: `gateway.store.outage`) fails the
whole batch: each writer gets `StoreUnwritable`, nothing of it was committed. Writes of
work already acknowledged to someone (`persist=True`: a turn of an accepted message, a
delivery mark) are not failed but parked, and tried again every `retry_interval` seconds
until the disk takes them; with none parked, a one-page probe write finds out when the
disk works again. The outage is logged once a minute (`store_unwritable`) and shown by
`write_health()`.

Why the writer runs on the event loop's thread: a turn's writes are short (a few B-tree
pages, no fsync at COMMIT in WAL mode with `synchronous=NORMAL`), and Python threads
share one GIL. On a writer thread every statement handed the GIL back and forth with the
event loop, and a statement finishing while the loop held the GIL waited for it; that
convoy cost more than the writes themselves and set the tail latency (BENCHMARKS.md,
"Round three"). Reads may be long (a whole transcript, a range of sessions), so they run
on the reader thread, each in a snapshot of committed data.

Durability: `synchronous=NORMAL` in WAL mode survives a process crash (kill -9) with
every acknowledged write intact; only a power loss can drop the last few commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import secrets
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import structlog

from gateway.store.batch import Outcome, commit_batch, probe, refusal
from gateway.store.checkpoint import SAFETY_NET_PAGES, WAL_SIZE_LIMIT, Checkpointer
from gateway.store.loop_reader import LoopReadBusy, LoopReader, read_snapshot
from gateway.store.migrations import migrate
from gateway.store.outage import Outage, StoreUnwritable
from gateway.util.fsutil import fsync_dir

T = TypeVar("T")
WriteFn = Callable[[sqlite3.Connection], Any]

log = structlog.get_logger("gateway.store.db")

RETRY_SECONDS = 5.0  # while the disk cannot write: how often parked writes (or a probe) retry


class DatabaseError(RuntimeError):
    """The state database could not be opened or is not ours."""


class DatabaseUnreachable(DatabaseError):
    """The database server did not answer (PostgreSQL): worth trying again later, unlike
    a damaged or foreign database."""


def create_private_file(path: Path) -> None:
    """Create `path` with mode 0600 if absent (SQLite gives -wal/-shm the same mode)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


def create_database_file(path: Path) -> None:
    """Create the database at `path` (mode 0600) with its whole schema, or not at all.

    The schema is written to a temp file beside it, which is then linked into place, so
    a crash meanwhile leaves a stale `.state.db.tmp-*` (`doctor --repair` deletes it),
    never an empty or half-made state.db. That is why an empty state.db is damage (a
    truncation, a failed copy), reported and not silently rebuilt. Linking, not
    renaming: when another process (a CLI command opening the store at the same moment)
    made the file first, theirs is kept, never swapped out under its open connection.
    """
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size:
        # A new file would take these frames as its own: refuse rather than mix them in.
        raise DatabaseError(
            f"{path} is missing but its write-ahead log {wal.name} is not: put the "
            f"database back, or move {wal.name} aside to start afresh"
        )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        # A rollback journal here (synchronous=FULL): the file is complete once closed.
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            migrate(conn)
        finally:
            conn.close()
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class Database:
    """The writer connection (`write()`, `write_soon()`) and the reader (`read()`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: sqlite3.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._loop_reader: LoopReader | None = None  # None: every read takes `read()`
        self._pending: list[tuple[WriteFn, Settles, bool]] = []  # fn, future, persist
        self._parked: list[tuple[WriteFn, Settles]] = []  # refused, to retry
        self._flush: asyncio.Handle | None = None
        self._retry: asyncio.TimerHandle | None = None
        self.retry_interval = RETRY_SECONDS
        self.unwritable = Outage(log, "store_unwritable", path=str(path))
        self._idle = asyncio.Event()
        self._closing = False
        self._checkpointer: Checkpointer | None = None
        self._check: asyncio.Future[None] | None = None
        self.commits = 0  # batches committed (the checkpointer's change signal)

    def check_soon(self) -> None:
        """Start the integrity check of an existing database file now, on a worker thread,
        so it overlaps whatever the caller does next; `open()` then waits for it instead
        of checking again. A missing file is left alone (nothing is created here)."""
        if self._check is None and self._writer is None and self.path.exists():
            # Submitted to the executor at once (not on the loop's next pass, as a task
            # would be), so it runs even while the caller keeps the loop busy.
            loop = asyncio.get_running_loop()
            self._check = loop.run_in_executor(None, _check_file, self.path)
            # Seen here, so a check nobody awaits (start-up ended on a config error) is
            # not logged as an unretrieved exception; open() still gets it when it awaits.
            self._check.add_done_callback(_seen)

    async def open(self) -> None:
        check, self._check = self._check, None
        try:
            if check is not None:
                await check
            if not self.path.exists():
                await asyncio.to_thread(create_database_file, self.path)
            os.chmod(self.path, 0o600)
            # Checked and migrated off the loop: a large database takes a moment.
            self._writer = await asyncio.to_thread(
                _open_writer, self.path, checked=check is not None
            )
            self._reader = await aiosqlite.connect(self.path, isolation_level=None)
            await self._reader.execute("PRAGMA query_only=1")
            await self._reader.execute("PRAGMA busy_timeout=5000")
            self._loop_reader = LoopReader(self.path)
            self._checkpointer = Checkpointer(self.path, lambda: self.commits)
            self._checkpointer.start()
        except sqlite3.DatabaseError as exc:
            await self._close_connections()
            raise DatabaseError(
                f"{self.path} cannot be used ({exc}). It was left untouched. Stop the "
                "gateway, copy the file somewhere safe, then run `hermes-gateway doctor "
                "--repair` to set it aside and rebuild what can be rebuilt."
            ) from None

    async def close(self) -> None:
        if self._writer is None:
            return
        self._closing = True
        self._give_up_parked()
        while self._flush is not None:
            self._idle.clear()
            await self._idle.wait()
        if self._checkpointer is not None:
            await self._checkpointer.stop()
            self._checkpointer = None
        await self._close_connections()

    @property
    def is_open(self) -> bool:
        return self._writer is not None and not self._closing

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(conn)` on the reader thread, in one snapshot of committed data that
        includes every write queued before this call."""
        self._require_open()
        assert self._reader is not None
        await self._settle_queued()
        return await self._reader._execute(read_snapshot, self._reader._conn, fn)

    async def _settle_queued(self) -> None:
        """Before a read: every write queued so far committed (or refused)."""
        if self._pending:
            # A refused batch committed nothing before this read: it sees what is there.
            with contextlib.suppress(StoreUnwritable):
                await self.write_soon(_nothing)

    async def read_now(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`read()` on the event loop's own thread (`gateway.store.loop_reader`), for a
        read of a few rows only: the loop waits for it."""
        if self._loop_reader is None:  # PostgreSQL's reads all go to its readers
            return await self.read(fn)
        self._require_open()
        await self._settle_queued()
        reader = self._loop_reader
        try:
            if reader is not None:  # None: closed meanwhile, which read() reports
                return reader.read(fn)
        except LoopReadBusy:
            pass
        return await self.read(fn)

    async def write(self, fn: Callable[[sqlite3.Connection], T], *, persist: bool = False) -> T:
        """Run `fn(conn)` in a committed transaction; returns once it is committed.
        Raises `StoreUnwritable` when the disk cannot take it, unless `persist`."""
        return await self.write_soon(fn, persist=persist)

    def write_soon(
        self, fn: Callable[[sqlite3.Connection], T], *, persist: bool = False
    ) -> asyncio.Future[T]:
        """Queue `fn` for this loop pass's group commit without waiting for it: for writes
        whose caller has nothing to do after them (a delivery acknowledgement). The future
        settles once it is committed; `close()` waits for it. A caller cancelled while
        waiting does not take its write back: it is committed all the same.

        `persist`: the write records work already acknowledged, so a disk that cannot take
        it does not fail it; it waits (parked) and is tried again until the disk can. A
        parked write whose caller was cancelled meanwhile is dropped, and `close()` fails
        the ones still parked."""
        self._require_open()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future, persist))
        self._flush_soon()
        return future

    def write_later(
        self,
        fn: Callable[[sqlite3.Connection], object],
        done: Callable[[BaseException | None], object],
        *,
        persist: bool = False,
    ) -> None:
        """`write_soon` without a future: `done(None)` (committed) or `done(error)` is
        called from the group commit itself, with no trip through the event loop. For
        the many small writes nobody awaits (a reply chunk's "sent" mark)."""
        self._require_open()
        self._pending.append((fn, Ack(done), persist))
        self._flush_soon()

    def write_health(self) -> dict[str, Any]:
        """`{"state": "writable"}`, or why the disk refuses writes, since when and how many
        it refused (for /healthz and `hermes-gateway status`)."""
        outage = self.unwritable
        if outage.reason is None or outage.since is None:
            return {"state": "writable"}
        return {
            "state": "unwritable",
            "reason": outage.reason,
            "since": outage.since.isoformat(),
            "refused_writes": outage.failures,
            # Parked, or back in the queue for their next try (`_retry_parked`).
            "waiting_writes": len(self._parked)
            + sum(1 for _, settles, persist in self._pending if persist and not settles.done()),
        }

    def data_version(self) -> int:
        """SQLite's `PRAGMA data_version` on the writer: it changes when another
        connection (another process: the CLI) committed. Microseconds, no file read;
        between two group commits the writer has no transaction open."""
        return self._require_open().execute("PRAGMA data_version").fetchone()[0]

    def trace_writes(self, callback: Callable[[str], object] | None) -> None:
        """Hand every SQL statement the writer runs to `callback` (None stops it): how
        the tests count a turn's statements."""
        self._require_open().set_trace_callback(callback)

    # --- internals ---------------------------------------------------------------------

    def _require_open(self) -> sqlite3.Connection:
        if self._writer is None or self._closing:
            raise DatabaseError("the session store is not open")
        return self._writer

    def _flush_soon(self) -> None:
        if self._flush is None:
            # Runs after the callbacks already ready in this pass, so writes issued by
            # the turns woken together land in one transaction. In a context of its own:
            # a batch is nobody's in particular (no turn's session_key on its log lines).
            self._flush = asyncio.get_running_loop().call_soon(
                self._commit_pending, context=contextvars.Context()
            )

    def _commit_pending(self) -> None:
        assert self._writer is not None
        self._flush = None
        batch, self._pending = self._pending, []
        fns = [fn for fn, _, _ in batch]
        changes = self._writer.total_changes
        try:
            outcome = commit_batch(self._writer, fns)
        except Exception as exc:  # the connection itself failed
            outcome = [(False, refusal(exc))] * len(batch)
        refused = outcome[0][1] if outcome and isinstance(outcome[0][1], StoreUnwritable) else None
        if refused is None:
            self.commits += 1
            if self._writer.total_changes != changes or probe in fns:
                self._writable_again()
        else:
            settled = self._park(batch, refused)
            batch, outcome = settled, outcome[: len(settled)]
        _settle(batch, outcome)
        self._idle.set()

    def _park(
        self, batch: list[tuple[WriteFn, Settles, bool]], refused: StoreUnwritable
    ) -> list[tuple[WriteFn, Settles, bool]]:
        """A batch the disk refused: note the outage, park the writes that must land, and
        return the others (their writers get the refusal)."""
        self.unwritable.failed(refused.reason, count=sum(fn is not probe for fn, _, _ in batch))
        others = []
        for fn, future, persist in batch:
            if persist and not future.done():
                self._parked.append((fn, future))
            else:
                others.append((fn, future, persist))
        if self._retry is None and not self._closing:
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(
                self.retry_interval, self._retry_parked, context=contextvars.Context()
            )
        return others

    def _retry_parked(self) -> None:
        """While the disk refuses writes: try the parked ones again, or (none parked) a
        probe, whose success is how an idle gateway learns the disk works again."""
        self._retry = None
        if self._writer is None or self._closing:
            return
        parked, self._parked = self._parked, []
        live = [(fn, future, True) for fn, future in parked if not future.done()]
        if live:
            self._pending.extend(live)
        elif self.unwritable.active:
            probed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            probed.add_done_callback(_seen)
            self._pending.append((probe, probed, False))
        else:
            return
        self._flush_soon()

    def _writable_again(self) -> None:
        self.unwritable.ended()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._parked:
            parked, self._parked = self._parked, []
            self._pending.extend((fn, future, True) for fn, future in parked)
            self._flush_soon()

    def _give_up_parked(self) -> None:
        """At close: writes still parked fail (their work is re-done from the journal on
        the next start, as after a crash)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        parked, self._parked = self._parked, []
        reason = self.unwritable.reason or "the store closed"
        for _, future in parked:
            if not future.done():
                future.set_exception(StoreUnwritable(reason))

    async def _close_connections(self) -> None:
        if self._loop_reader is not None:
            self._loop_reader.close()
            self._loop_reader = None
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _open_writer(path: Path, *, checked: bool = False) -> sqlite3.Connection:
    """The writer connection, checked (unless `checked`: `Database.check_soon` did it)
    and migrated. Used from the event loop's thread after this (opened on a worker
    thread, hence `check_same_thread=False`)."""
    _check_not_empty(path)  # before WAL mode writes a header into an empty file
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=5000")
        # A 16 MiB page cache (SQLite's default is 2): the upper B-tree levels and the
        # recent rows stay in it, and the rest of a large database comes from the OS's
        # page cache, at no CPU a turn the benchmark can see, while every MiB here is
        # resident memory (BENCHMARKS.md, the default configuration).
        conn.execute("PRAGMA cache_size=-16384")
        if not checked:
            _check_integrity(conn, path)
        migrate(conn)
        # Checkpoints run beside the writer (gateway.store.checkpoint), not inside a commit.
        conn.execute(f"PRAGMA wal_autocheckpoint={SAFETY_NET_PAGES}")
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    except BaseException:
        conn.close()
        raise
    return conn


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _check_file(path: Path) -> None:
    """`_check_integrity` on a connection of its own (`Database.check_soon`)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        _check_integrity(conn, path)
    finally:
        conn.close()


def _read_ahead(path: Path) -> None:
    """Pull the database (and its WAL) into the page cache in one sequential pass before
    the integrity check, best effort.

    The check visits pages in B-tree order, which from a cold page cache (the first
    start after a boot) is random I/O, several times slower than one sequential pass,
    after which the check reads from the cache. `sendfile` into /dev/null reads without
    copying into Python, in one call that holds no GIL, and costs little when the pages
    are cached already. Where it cannot (not Linux), plain
    reads do the same. A failing read is left for the check itself to report."""
    for name in (path, path.with_name(path.name + "-wal")):
        with contextlib.suppress(OSError), open(name, "rb", buffering=0) as file:
            with open(os.devnull, "wb") as sink:
                _pull_into_cache(file.fileno(), sink.fileno())


def _pull_into_cache(fd: int, sink: int) -> None:
    size, offset = os.fstat(fd).st_size, 0
    try:
        while offset < size and (sent := os.sendfile(sink, fd, offset, size - offset)):
            offset += sent
    except OSError:
        buffer = bytearray(16 << 20)
        while (read := os.preadv(fd, [buffer], offset)) > 0:
            offset += read


def _check_not_empty(path: Path) -> None:
    """SQLite takes an empty file for an empty database; state.db is never empty when the
    gateway made it (`create_database_file`), so one that is has lost its contents."""
    if path.stat().st_size == 0:
        raise sqlite3.DatabaseError(
            "the file is empty (0 bytes): its contents were lost (truncated or copied "
            "badly); the gateway never leaves it empty"
        )


def _check_integrity(conn: sqlite3.Connection, path: Path) -> None:
    """`PRAGMA quick_check` on open: a damaged database is reported, never papered over."""
    _read_ahead(path)
    problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    if problems != ["ok"]:
        raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(problems)}")


class Ack:
    """What settles a `write_later`: the caller's callback, called once, in place of a
    future (a future costs its creation and a loop pass per done-callback)."""

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: Callable[[BaseException | None], object]) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, _value: object) -> None:
        self._finish(None)

    def set_exception(self, exc: BaseException) -> None:
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._callback(exc)
        except Exception:  # one caller's bug must not stop the others being settled
            log.exception("write_callback_failed")


Settles = asyncio.Future[Any] | Ack  # what a queued write's outcome is handed to


def _settle(batch: list[tuple[WriteFn, Settles, bool]], outcome: Outcome) -> None:
    """Hand each writer of a committed (or failed) batch its own result."""
    for (_, future, _), (ok, value) in zip(batch, outcome, strict=True):
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _nothing(conn: sqlite3.Connection) -> None:
    """A place in the write queue: `read()` waits for it to see the writes before it."""
