"""Long-term recall: notes per user and agent, and hybrid search over them and
the user's past transcripts. `runner.recall` is a `Recall`; the agent's memory tools
and the operator's `hermes-gateway memory` commands call it.

A namespace is `memory:{agent_id}:{platform}:{user_id}`: every read and write names one,
and nothing of another namespace is scored, listed, changed or told apart from "no such
note". Notes are stored in state.db (`notes`, the data of record); their chunks, the
transcripts' chunks and all vectors in memory.db (gateway.memory.index), which the
indexer keeps up in the background and which a search first brings up to date. With the
store on PostgreSQL, the index is the store's `memory_*` tables instead, shared by every
replica (gateway.memory.pg_index); the calls below are the same.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from gateway.domain.session import SessionSource, schedule_session_key
from gateway.memory import index, sqlite_index
from gateway.memory.chunking import normalize_tags
from gateway.memory.embeddings import EmbeddingError, HashEmbedder, build_embedder
from gateway.memory.retrieval import (
    RecallSql,
    Recent,
    Scored,
    VectorCache,
    hybrid,
    tags_of,
)
from gateway.store import codec, purge, schedules
from gateway.store.background import ThreadedSqliteTask
from gateway.store.fts import is_damaged, set_index_aside
from gateway.store.outage import Outage, StoreUnwritable
from gateway.store.pg import driver_errors

if TYPE_CHECKING:
    from collections.abc import Callable

    from config import GatewayConfig
    from gateway.memory.embeddings import Embedder
    from gateway.store.session_store import SessionStore

log = structlog.get_logger("gateway.memory.recall")
T = TypeVar("T")

MAX_NOTE_CHARS = 8_000
MAX_K = 50
EMBED_BATCH = 256  # chunks embedded per step of the background indexer
_NO_BOUND = 2**62
# auto_recall (`Recall.for_turn`): how long a turn waits for its question's vector (past
# it the notes are ranked by words alone, and the vector is not asked for again for
# VECTOR_PAUSE_SECONDS), the question's characters looked at, and each note's in the
# prompt.
AUTO_EMBED_SECONDS = 2.0
VECTOR_PAUSE_SECONDS = 60.0
AUTO_QUERY_CHARS = 2_000
AUTO_NOTE_CHARS = 1_000
# The namespaces holding notes are read again after this long: notes another process
# saved (the CLI, another replica) reach auto_recall within it; this process's own at once.
NOTED_TTL_SECONDS = 30.0
_NOTE_ID = re.compile(r"^note-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _pg() -> Any:
    """The index's PostgreSQL SQL (gateway.memory.pg_index), imported on first use: a
    gateway on SQLite never loads psycopg."""
    from gateway.memory import pg_index

    return pg_index


@dataclass(frozen=True, slots=True)
class Namespace:
    """One user's memory with one agent: `memory:{agent_id}:{platform}:{user_id}`."""

    agent_id: str
    platform: str
    user_id: str

    @classmethod
    def of(cls, agent_id: str, source: SessionSource) -> Namespace:
        if not source.user_id:
            raise ValueError("this chat names no user: long-term memory needs a user id")
        platform = getattr(source.platform, "value", source.platform)
        return cls(agent_id, str(platform), str(source.user_id))

    def __str__(self) -> str:
        return f"memory:{self.agent_id}:{self.platform}:{self.user_id}"


@dataclass(frozen=True, slots=True)
class Asking:
    """The turn a search is made from: its session, and its own first transcript row
    (its user message; None when it has none)."""

    session_id: str
    user_row: int | None = None


@dataclass(frozen=True, slots=True)
class Hit:
    id: str  # "note-<uuid>" for notes, "chunk-<n>" for transcript chunks
    kind: str  # "note" | "transcript"
    text: str
    tags: tuple[str, ...]
    score: float
    created_at: datetime
    updated_at: datetime
    session_id: str | None  # transcript chunks: the session they come from

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "text": self.text,
            "tags": list(self.tags),
            "score": round(self.score, 4),
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "session_id": self.session_id,
        }


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _hit(scored: Scored) -> Hit:
    return Hit(
        id=scored.note_id if scored.note_id is not None else f"chunk-{scored.chunk_id}",
        kind=scored.kind,
        text=scored.text,
        tags=scored.tags,
        score=scored.score,
        created_at=_utc(scored.created_at),
        updated_at=_utc(scored.updated_at),
        session_id=scored.session_id,
    )


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
        self.cache = VectorCache()
        # On PostgreSQL the index is the store's `memory_*` tables: the same rounds and
        # recall, in that backend's SQL (gateway.memory.pg_index).
        self.postgres = bool(getattr(store, "postgres", False))
        self.ops: index.MemoryIndex = _pg().INDEX if self.postgres else sqlite_index.INDEX
        self.sql: RecallSql = self.ops.sql
        self.namespaces = index.NamespaceCache()
        # `hash` embeds on the worker thread inside each round; a remote one in batches
        # after it (it may be slow or down, and text recall must not wait for it).
        self.inline = embedder if isinstance(embedder, HashEmbedder) else None
        self.embeddings_ok = True
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
        failures, seen = 0, -1
        while True:
            commits = self.store.commits
            try:
                worked = commits != seen
                if worked:
                    worked = bool(await self.catch_up(wait=False))
                    seen = -1 if self.skipped else commits
                failures = 0
                failing.ended()
            except (sqlite3.Error, *driver_errors(), OSError, StoreUnwritable) as exc:
                failures += 1
                failing.failed(str(exc))
                await self._reset()
            if failures:
                await asyncio.sleep(min(60.0, self.interval * 2**failures))
            else:
                await self._pause(worked)

    async def _reset(self) -> None:
        async with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self.cache.clear()


@dataclass(slots=True)
class Forgotten:
    """What `Recall.forget_user` deleted, by kind."""

    notes: int = 0
    sessions: int = 0  # the user's own, and their schedules' sessions
    schedules: int = 0
    index_entries: int = 0  # chunks (each with its full-text entry and vector)
    pairings: int = 0  # the user's pairing approval and pending code (all agents only)

    @property
    def total(self) -> int:
        return self.notes + self.sessions + self.schedules + self.index_entries + self.pairings


class Recall:
    """The memory API (see the module docstring). Validation errors are ValueError."""

    def __init__(self, store: SessionStore, config: GatewayConfig) -> None:
        memory = config.memory
        self.store = store
        self.embedder = build_embedder(config)
        self.weights = (memory.weights.vector, memory.weights.text)
        self.exclude_recent = memory.exclude_recent_messages
        self.indexer = MemoryIndexer(
            store,
            index.IndexSettings(
                chunk_size=memory.chunk_size,
                chunk_overlap=memory.chunk_overlap,
                index_transcripts=memory.index_transcripts,
                group_sessions_per_user=config.group_sessions_per_user,
                thread_sessions_per_user=config.thread_sessions_per_user,
            ),
            self.embedder,
        )
        self._prepared = False
        self.auto_recall = memory.auto_recall
        # auto_recall's cheap "has this user any note" (`has_notes`): the namespaces
        # holding notes, as last read, and when.
        self._noted: set[str] = set()
        self._noted_at: float | None = None
        self._noted_lock = asyncio.Lock()
        self._vectors_paused_until = 0.0

    @property
    def path(self) -> Path:
        return self.indexer.path

    async def open(self) -> None:
        """Check the embedder once (an unreachable one is logged; vectors wait for it) and
        get memory.db ready; no background work (the CLI's use)."""
        try:
            await self.embedder.check()
        except EmbeddingError as exc:
            log.error("memory_embedding_unavailable", error=str(exc))
        await self.indexer.prepare()
        self._prepared = True

    async def start(self) -> None:
        """`open()`, then the background indexer (the daemon's use)."""
        await self.open()
        self.indexer.start()

    async def close(self) -> None:
        await self.indexer.stop()
        await self.embedder.close()

    # --- notes -------------------------------------------------------------------------

    async def save(
        self,
        ns: Namespace,
        content: str,
        tags: Sequence[str] = (),
        note_id: str | None = None,
    ) -> str:
        """Store a note; returns its id. With `note_id`: that note of this namespace is
        replaced (content and tags; created_at kept)."""
        if not isinstance(content, str) or not content.strip():
            raise ValueError("a note needs some text")
        if len(content) > MAX_NOTE_CHARS:
            raise ValueError(f"a note holds at most {MAX_NOTE_CHARS} characters ({len(content)})")
        clean_tags = normalize_tags(tags)
        namespace = str(ns)
        new_id = note_id if note_id is not None else f"note-{uuid.uuid4()}"
        if note_id is not None and not _NOTE_ID.match(note_id):
            raise ValueError(f"{note_id!r} is not a note id (note-<uuid>)")
        now = index.now()
        tags_json = codec.dumps(list(clean_tags))

        def write(conn: sqlite3.Connection) -> None:
            if note_id is None:
                conn.execute(
                    "INSERT INTO notes (note_id, namespace, agent_id, platform, user_id,"
                    " content, tags, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        new_id,
                        namespace,
                        ns.agent_id,
                        ns.platform,
                        ns.user_id,
                        content,
                        tags_json,
                        now,
                        now,
                    ),
                )
                return
            changed = conn.execute(
                # CASE, not SQLite's two-argument max(): PostgreSQL spells that greatest().
                "UPDATE notes SET content = ?, tags = ?,"
                " updated_at = CASE WHEN ? > created_at THEN ? ELSE created_at END"
                " WHERE note_id = ? AND namespace = ?",
                (content, tags_json, now, now, note_id, namespace),
            ).rowcount
            if not changed:
                raise ValueError(f"there is no note {note_id} in this memory")

        await self.store.write(write, dirty=False)
        self._noted.add(namespace)
        await self._index()
        return new_id

    async def delete(self, ns: Namespace, note_id: str) -> bool:
        """Delete one note of this namespace; False when it has no such note."""
        namespace = str(ns)
        deleted = await self.store.write(
            lambda conn: (
                conn.execute(
                    "DELETE FROM notes WHERE note_id = ? AND namespace = ?", (note_id, namespace)
                ).rowcount
            ),
            dirty=False,
        )
        if deleted:
            await self._index()
        return bool(deleted)

    async def list_notes(self, ns: Namespace) -> list[Hit]:
        """Every note of the namespace, newest first (score 0)."""
        namespace = str(ns)
        rows = await self.store.read(
            lambda conn: conn.execute(
                "SELECT note_id, content, tags, created_at, updated_at FROM notes"
                " WHERE namespace = ? ORDER BY updated_at DESC, note_id",
                (namespace,),
            ).fetchall()
        )
        return [
            Hit(note_id, "note", content, tags_of(tags), 0.0, _utc(created), _utc(updated), None)
            for note_id, content, tags, created, updated in rows
        ]

    # --- recall ------------------------------------------------------------------------

    async def search(
        self,
        ns: Namespace,
        query: str,
        tags: Sequence[str] = (),
        k: int = 5,
        asking: Asking | None = None,
        *,
        notes_only: bool = False,
        embed_within: float | None = None,
        index_first: bool = True,
    ) -> list[Hit]:
        """The namespace's best `k` notes and transcript chunks for `query` (hybrid).
        From a turn (`asking`), none of the turn's own messages nor of the newest
        `memory.exclude_recent_messages` of its session before them. With
        `embed_within`, the embedder is given that long for the query's vector and
        nothing else (chunks waiting for theirs are found by their words meanwhile).
        `index_first` False searches the index as the background indexer left it (at
        most about a second behind) instead of catching it up first."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("a search needs some words")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be a whole number from 1 to {MAX_K}")
        clean_tags = normalize_tags(tags)
        namespace = str(ns)
        exclude = await self._recent(asking) if asking is not None else None
        if index_first:
            await self._index(namespace, embed=embed_within is None)
        query_vec = None
        if self.weights[0] > 0 and time.monotonic() >= self._vectors_paused_until:
            try:
                async with asyncio.timeout(embed_within):
                    query_vec = (await self.embedder.embed([query]))[0]
            except EmbeddingError as exc:
                log.warning("memory_query_embedding_failed", error=str(exc))
            except TimeoutError:
                self._vectors_paused_until = time.monotonic() + VECTOR_PAUSE_SECONDS
                log.warning("memory_query_embedding_slow", seconds=embed_within)
        vector_weight, text_weight = self.weights
        sql = self.indexer.sql
        cache, model, floor = (
            self.indexer.cache,
            self.embedder.model_id,
            self.embedder.min_similarity,
        )
        scored = await self.indexer.run(
            lambda conn: hybrid(
                conn,
                cache,
                namespace=namespace,
                query=query,
                query_vec=query_vec,
                model=model,
                tags=clean_tags,
                k=k,
                vector_weight=vector_weight,
                text_weight=text_weight,
                min_similarity=floor,
                sql=sql,
                exclude=exclude,
                notes_only=notes_only,
            )
        )
        return [_hit(item) for item in scored]

    # --- auto_recall -------------------------------------------------------------------

    async def has_notes(self, ns: Namespace) -> bool:
        """Whether the namespace held a note when last looked (NOTED_TTL_SECONDS): a set
        look-up per turn, one query for all users per interval."""
        if self._noted_at is None or time.monotonic() - self._noted_at > NOTED_TTL_SECONDS:
            async with self._noted_lock:
                at = self._noted_at
                if at is None or time.monotonic() - at > NOTED_TTL_SECONDS:
                    asked = time.monotonic()
                    before = set(self._noted)
                    rows = await self.store.read(
                        lambda conn: conn.execute("SELECT DISTINCT namespace FROM notes").fetchall()
                    )
                    # A save while the query ran may be missing from its answer.
                    self._noted = {row[0] for row in rows} | (self._noted - before)
                    # Fresh only once answered: a turn meanwhile waits on the lock for
                    # the answer (in its order) rather than reading the set unrefreshed.
                    self._noted_at = asked
        return str(ns) in self._noted

    async def for_turn(self, ns: Namespace, text: str) -> list[Hit]:
        """auto_recall: the namespace's best `memory.auto_recall` notes for a turn's
        text, for its system prompt. Never fails the turn: an error is logged and no note
        returned, and a slow embedder costs it AUTO_EMBED_SECONDS at most (the words
        rank alone then)."""
        if not self.auto_recall or not text.strip():
            return []
        try:
            if not await self.has_notes(ns):
                return []
            return await self.search(
                ns,
                text[:AUTO_QUERY_CHARS],
                k=self.auto_recall,
                # No `asking`: what it leaves out are transcript rows, and notes only
                # are looked for.
                notes_only=True,
                embed_within=AUTO_EMBED_SECONDS,
                # A note saved in this process was indexed by its save; one saved
                # elsewhere waits for the background indexer (about a second).
                index_first=False,
            )
        except (sqlite3.Error, *driver_errors(), OSError, StoreUnwritable, ValueError) as exc:
            log.warning("auto_recall_failed", error=f"{type(exc).__name__}: {exc}")
            return []

    async def _recent(self, asking: Asking) -> Recent | None:
        """What a search from `asking` leaves out: its session's rows from the oldest of
        its newest `exclude_recent` messages before the turn's own (or from the turn's
        own, when there are none), on."""
        session_id, own, count = asking.session_id, asking.user_row, self.exclude_recent
        oldest = None
        if count:
            before = own if own is not None else _NO_BOUND
            oldest = await self.store.read(
                lambda conn: conn.execute(
                    "SELECT min(id) FROM (SELECT id FROM messages WHERE session_id = ?"
                    " AND active = 1 AND id < ? ORDER BY id DESC LIMIT ?) AS recent",
                    (session_id, before, count),
                ).fetchone()[0]
            )
        bounds = [row for row in (oldest, own) if row is not None]
        return Recent(session_id, min(bounds)) if bounds else None

    async def forget_user(
        self, platform: str, user_id: str, agent_id: str | None = None
    ) -> Forgotten:
        """Everything of one user (of one agent, or of all): notes, the user's own
        sessions (not shared group sessions) with their transcripts, routing entries and
        journal rows, their schedules, every chunk and vector of theirs, and (of all
        agents) their pairing. No session is started in place of a current one deleted:
        nothing naming the user is left, and a second run finds nothing. Returns what
        went, counted by kind. Raises `purge.SessionBusy` naming the sessions a running
        turn kept (the rest is gone)."""
        now = datetime.now(UTC)
        settings = self.indexer.settings
        gone = Forgotten()

        def write(conn: sqlite3.Connection) -> tuple[list[str], list[str]]:
            namespaces = {
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT namespace FROM notes WHERE platform = ? AND user_id = ?"
                    " AND agent_id = coalesce(?, agent_id)",
                    (platform, user_id, agent_id),
                )
            }
            gone.notes = conn.execute(
                "DELETE FROM notes WHERE platform = ? AND user_id = ?"
                " AND agent_id = coalesce(?, agent_id)",
                (platform, user_id, agent_id),
            ).rowcount
            gone.sessions = gone.schedules = 0  # a retried transaction counts afresh
            busy, dm_chats = [], set()
            for session_id, key, origin in conn.execute(
                "SELECT session_id, session_key, origin FROM sessions"
                " WHERE json_extract(origin, '$.platform') = ?"
                " AND json_extract(origin, '$.user_id') = ?",
                (platform, user_id),
            ).fetchall():
                source = codec.loads(origin)
                namespace = index.transcript_namespace(key, source, settings)
                if namespace is None or (
                    agent_id is not None and not key.startswith(f"agent:{agent_id}:")
                ):
                    continue
                namespaces.add(namespace)
                if isinstance(source, dict) and source.get("chat_type") == "dm":
                    dm_chats.add(str(source.get("chat_id")))
                try:
                    if purge.delete_session(conn, session_id, now, erase=True) is not None:
                        gone.sessions += 1
                except purge.SessionBusy:
                    busy.append(session_id)
            # Their schedules, with their runs and their sessions.
            for agent, schedule_id in schedules.delete_for_user(conn, platform, user_id, agent_id):
                gone.schedules += 1
                key = schedule_session_key(agent, schedule_id)
                deleted = schedules.delete_sessions(conn, key, now, erase=True)
                if deleted is None:
                    busy.append(key)
                else:
                    gone.sessions += deleted
            purge.erase_user_journal(conn, platform, user_id, agent_id, dm_chats)
            if agent_id is not None:
                namespaces.add(f"memory:{agent_id}:{platform}:{user_id}")
            else:  # pairing is the gateway's, not one agent's
                gone.pairings = sum(
                    conn.execute(
                        f"DELETE FROM {table} WHERE platform = ? AND user_id = ?",
                        (platform, user_id),
                    ).rowcount
                    for table in ("paired_users", "pairing_codes")
                )
            return sorted(namespaces), busy

        namespaces, busy = await self.store.write(write)
        gone.index_entries = await self.indexer.run(self.indexer.ops.forget_namespaces, namespaces)
        await self._index()
        if agent_id is None:
            forget_all = self.indexer.ops.forget_all_agents
            gone.index_entries += await self.indexer.run(forget_all, platform, user_id)
        self.indexer.cache.clear()
        if not self.indexer.postgres:
            # search.db forgets the messages now, their words included (forget_words);
            # on PostgreSQL the deleted rows are gone with their GIN entries at commit.
            await self.store.search_index.query(_forget_search_tokens)
        if busy:
            raise purge.SessionBusy(
                "a turn is running in session(s) " + ", ".join(busy) + "; they were kept"
            )
        return gone

    async def export(
        self, platform: str, user_id: str, agent_id: str | None = None
    ) -> list[dict[str, Any]]:
        """A user's notes (all agents, or one), for `hermes-gateway memory export`."""
        rows = await self.store.read(
            lambda conn: conn.execute(
                "SELECT note_id, agent_id, content, tags, created_at, updated_at FROM notes"
                " WHERE platform = ? AND user_id = ? AND agent_id = coalesce(?, agent_id)"
                " ORDER BY agent_id, created_at, note_id",
                (platform, user_id, agent_id),
            ).fetchall()
        )
        return [
            {
                "id": note_id,
                "agent": agent,
                "namespace": str(Namespace(agent, platform, user_id)),
                "text": content,
                "tags": list(tags_of(tags)),
                "created_at": _utc(created).isoformat(),
                "updated_at": _utc(updated).isoformat(),
            }
            for note_id, agent, content, tags, created, updated in rows
        ]

    async def _index(self, namespace: str | None = None, embed: bool = True) -> None:
        if not self._prepared:
            await self.indexer.prepare()
            self._prepared = True
        await self.indexer.catch_up(embed=embed, namespace=namespace)


def notes_prompt(hits: Sequence[Hit]) -> str:
    """auto_recall's block of the system prompt ("" for no note)."""
    if not hits:
        return ""
    lines = [
        "## Notes you saved about this user (best match for their message first;"
        " memory_search finds more)"
    ]
    for hit in hits:
        text = " ".join(hit.text.split())
        if len(text) > AUTO_NOTE_CHARS:
            text = text[: AUTO_NOTE_CHARS - 1] + "…"
        lines.append(f"- {text}")
    return "\n".join(lines)


def _forget_search_tokens(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('optimize')")
