"""The memory indexer task: keeps the memory index (memory.db, or the `memory_*` tables
of a PostgreSQL store) up with the store's logs on a worker thread, and embeds the chunks
waiting for a vector. `Recall` owns one and brings it up to date before a search.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from gateway.memory import index, sqlite_index
from gateway.memory.embeddings import EmbeddingError, HashEmbedder
from gateway.memory.retrieval import RecallSql, VectorCache
from gateway.store.background import ThreadedSqliteTask
from gateway.store.fts import is_damaged, set_index_aside
from gateway.store.outage import Outage, StoreUnwritable
from gateway.store.pg import driver_errors
from gateway.util.backoff import Backoff

if TYPE_CHECKING:
    from collections.abc import Callable

    from gateway.memory.embeddings import Embedder
    from gateway.store.session_store import SessionStore

log = structlog.get_logger("gateway.memory.indexer")
T = TypeVar("T")

EMBED_BATCH = 256  # chunks embedded per step of the background indexer


def _pg() -> Any:
    """The index's PostgreSQL SQL (gateway.memory.pg_index), imported on first use: a
    gateway on SQLite never loads psycopg."""
    from gateway.memory import pg_index

    return pg_index


class MemoryIndexer(ThreadedSqliteTask):
    """Keeps the memory index up with the store's logs (rounds of
    `index.MemoryIndex.apply_logs`, over the engine's SQL) and embeds
    the chunks waiting for a vector, on a worker thread, when the store committed since
    the last look or vectors are waiting.

    Once a second, not four times: a recall catches up first anyway (`Recall._index`),
    so nothing waits for the interval, and a busy gateway's rounds come out larger,
    their statements' cost spread over more messages."""

    def __init__(
        self,
        store: SessionStore,
        settings: index.IndexSettings,
        embedder: Embedder,
        interval: float = 1.0,
    ) -> None:
        super().__init__(interval)
        self.store = store
        self.settings = settings
        self.embedder = embedder
        self.path = store.sessions_dir / index.MEMORY_DB
        # On PostgreSQL the index is the store's `memory_*` tables: the same rounds and
        # recall, in that backend's SQL (gateway.memory.pg_index).
        self.postgres = bool(getattr(store, "postgres", False))
        hashed = embedder if isinstance(embedder, HashEmbedder) else None
        # memory.db stores no `hash` vector: recall derives them from the chunks' texts.
        derive = hashed.embed_sync if hashed and not self.postgres else None
        self.cache = VectorCache(derive=derive)
        if self.postgres:
            self.ops: index.MemoryIndex = _pg().INDEX
        else:
            self.ops = sqlite_index.DERIVED_INDEX if derive else sqlite_index.INDEX
        self.sql: RecallSql = self.ops.sql
        self.namespaces = index.NamespaceCache()
        # `hash` on PostgreSQL embeds on the worker thread inside each round; a remote
        # one in batches after it (it may be slow or down, and text recall must not wait
        # for it).
        self.inline = hashed if self.postgres else None
        self._lock = asyncio.Lock()
        self._reported: int | None = None  # the fts_log number last told to state.db
        # PostgreSQL: the last round was left to another replica holding the lock; the
        # loop looks again next time, commits or not (what it logged may be unseen).
        self.skipped = False
        self._embed_outage = Outage(log, "memory_embedding_failed", path=str(self.path))

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(conn, *args)` on memory.db (state.db attached as `st`), or on a connection
        of the indexer's own to the PostgreSQL store, on the worker thread."""
        async with self._lock:
            if self._conn is None:
                if self.postgres:
                    dsn = self.store.config.storage.dsn or ""
                    self._conn = await self._in_thread(_pg().connect, dsn)
                else:
                    self._conn = await self._in_thread(
                        sqlite_index.connect, self.path, self.store.db_path
                    )
            try:
                return await self._in_thread(fn, self._conn, *args)
            except sqlite3.DatabaseError as exc:
                if self.postgres or not is_damaged(exc):
                    raise
                # Damage deeper in the file than opening it reads: memory.db is derived,
                # so it is set aside and rebuilt, and the call runs once on the new one.
                await self._set_aside(exc)
                self._conn = await self._in_thread(
                    sqlite_index.connect, self.path, self.store.db_path
                )
                return await self._in_thread(fn, self._conn, *args)

    async def _set_aside(self, exc: sqlite3.DatabaseError) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.cache.clear()
        self._reported = None
        moved = await asyncio.to_thread(set_index_aside, self.path)
        log.warning("index_db_damaged", path=str(self.path), moved_to=moved, error=str(exc))

    async def prepare(self) -> None:
        """Before the first round: hold state.db's fts_log for us (or let it go, with
        transcripts off), and queue every chunk for the current embedder if it changed.
        On PostgreSQL the rounds take the log themselves (gateway.memory.pg_index)."""
        if self.postgres:
            log.info("memory_index", backend="postgres", vectors=await self.run(_pg().vector_path))
        elif self.settings.index_transcripts:
            sql = "INSERT OR IGNORE INTO log_readers (name, applied) VALUES (?, 0)"
        else:
            sql = "DELETE FROM log_readers WHERE name = ?"
        if not self.postgres:
            await self.store.write(lambda conn: conn.execute(sql, (index.LOG_READER,)), dirty=False)
        queued = await self.run(self.ops.requeue_other_models, self.embedder.model_id)
        if queued:
            log.info("memory_reembedding", chunks=queued, model=self.embedder.model_id)

    async def catch_up(
        self, *, embed: bool = True, namespace: str | None = None, wait: bool = True
    ) -> int:
        """Apply everything logged so far; then (embed) vectors for the waiting chunks,
        of `namespace` only when given. A failing embedder is logged, not raised: text
        recall works meanwhile and the chunks stay queued. On PostgreSQL, with `wait`
        False, a round another replica is running is left to it (the background loop)."""
        total = 0
        apply = functools.partial(self.ops.apply_logs, wait=wait)
        while True:
            result = await self.run(apply, self.settings, self.namespaces, self.inline)
            total += result.work
            self.skipped = result.skipped
            await self._report(result)
            if not result.more:
                break
        if embed:
            total += await self.embed_pending(namespace)
        return total

    async def embed_pending(self, namespace: str | None = None) -> int:
        done = 0
        while True:
            waiting = await self.run(self.ops.pending_chunks, EMBED_BATCH, namespace)
            if not waiting:
                self._embed_outage.ended()
                return done
            ids, texts = [row[0] for row in waiting], [row[1] for row in waiting]
            try:
                vectors = await self.embedder.embed(texts)
            except EmbeddingError as exc:
                self._embed_outage.failed(str(exc))
                return done
            await self.run(self.ops.store_vectors, ids, vectors, self.embedder.model_id)
            done += len(ids)

    async def _report(self, result: index.RoundResult) -> None:
        """Tell state.db how far we got: its fts_log is trimmed behind that, and the
        note log behind us (we are its only reader). On PostgreSQL the round itself took
        its log entries (gateway.memory.pg_index)."""
        if self.postgres:
            return
        seq, note_seq = result.message_seq, result.note_seq

        def tell(conn: sqlite3.Connection) -> None:
            if seq is not None:
                conn.execute(
                    "INSERT OR REPLACE INTO log_readers (name, applied) VALUES (?, ?)",
                    (index.LOG_READER, seq),
                )
            conn.execute("DELETE FROM note_log WHERE seq <= ?", (note_seq,))

        if result.work or seq != self._reported:
            await self.store.write(tell, dirty=False)
            self._reported = seq

    def start(self) -> None:
        self._start(self._loop(), "memory-indexer")

    async def _loop(self) -> None:
        failing = Outage(log, "memory_index_failed", path=str(self.path))
        retry = Backoff(initial=2 * self.interval, maximum=60.0, jitter=0)
        seen = -1
        while True:
            commits = self.store.commits
            try:
                worked = commits != seen
                if worked:
                    worked = bool(await self.catch_up(wait=False))
                    seen = -1 if self.skipped else commits
                retry.reset()
                failing.ended()
            except (sqlite3.Error, *driver_errors(), OSError, StoreUnwritable) as exc:
                failing.failed(str(exc))
                await self._reset()
                await retry.sleep()
                continue
            await self._pause(worked)

    async def _reset(self) -> None:
        async with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.cache.clear()
