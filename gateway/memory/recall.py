"""Long-term recall: notes per user and agent, and hybrid search over them and
the user's past transcripts. `runner.recall` is a `Recall`; the agent's memory tools
and the operator's `hermes-gateway memory` commands call it.

A namespace is `memory:{agent_id}:{platform}:{user_id}`: every read and write names one,
and nothing of another namespace is scored, listed, changed or told apart from "no such
note". Notes are stored in state.db (`notes`, the data of record); their chunks, the
transcripts' chunks and all vectors in memory.db (gateway.memory.sqlite_index), which
the indexer (gateway.memory.indexer) keeps up in the background and which a search
first brings up to date. With the store on PostgreSQL, the index is the store's
`memory_*` tables instead, shared by every replica (gateway.memory.pg_index); the calls
below are the same.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gateway.domain.session import SessionSource, schedule_session_key
from gateway.memory import index
from gateway.memory.chunking import normalize_tags
from gateway.memory.embeddings import EmbeddingError, build_embedder
from gateway.memory.indexer import MemoryIndexer
from gateway.memory.retrieval import (
    Recent,
    Scored,
    hybrid,
    tags_of,
)
from gateway.store import codec, purge, schedules
from gateway.store.outage import StoreUnwritable
from gateway.store.pg import driver_errors

if TYPE_CHECKING:
    from config import GatewayConfig
    from gateway.store.session_store import SessionStore

log = structlog.get_logger("gateway.memory.recall")

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
