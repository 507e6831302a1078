"""The memory indexer: every note's and every eligible transcript message's chunks,
their words and their vectors, kept up with state.db's logs, written once for both
engines over a small SQL dialect (`IndexSql`), as recall is over `RecallSql`
(gateway.memory.retrieval).

The engines (their module docstrings say how each keeps exact):
- SQLite (gateway.memory.sqlite_index): memory.db beside state.db, derived from it; a
  round follows the logs by sequence number (one writer hands them out in commit order).
- PostgreSQL (gateway.memory.pg_index): `memory_*` tables in the store's own database,
  shared by every replica; a round consumes the log entries it applies, under an
  advisory lock.

What is written once here: a round's shape (notes, then transcripts, then the vectors an
inline embedder makes), the rebuild of transcripts a page at a time, chunking a note or
a set of messages, dropping the chunks no message links any more, re-queueing chunks for
a new embedder, storing vectors, forgetting namespaces, and the namespace a session's
transcript belongs to.

Vectors are a second phase (`pending_vectors`): chunks are searchable by text at once
and gain their vector when the embedding backend answers (a remote one may be down). A
vector carries the embedder's `model_id`; starting with another embedder queues every
chunk again, and only vectors of the current one are ever scored.

Which transcripts: a session's messages of role user and assistant, when its origin
names a user and it is not shared by several users (a group chat's common session):
one person's words go to that person's memory. Namespace:
`memory:{agent_id}:{platform}:{user_id}`, the agent id read from the session key.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gateway.domain.session import Platform, SessionSource, is_shared_multi_user_session
from gateway.memory.chunking import chunk_text, content_hash
from gateway.memory.retrieval import RecallSql
from gateway.store import codec

MEMORY_DB = "memory.db"
LOG_READER = "memory"  # our row in state.db's log_readers
NOTE_PAGE = 2_000  # note log entries per round
MESSAGE_PAGE = 5_000  # message log entries (or rebuilt messages) per round
INDEXED_ROLES = ("user", "assistant")
INLINE_VECTORS = 2 * MESSAGE_PAGE  # vectors made inside a round, at most (the rest wait)
DERIVED = " derived"  # meta 'model' of an index whose vectors recall derives
INLINE_BATCH = 256  # of those, embedded and stored at a time

# A transcript chunk to upsert: (namespace, session id, hash, text, message time).
TranscriptChunk = tuple[str, str, str, str, float]
# A message's link to a chunk of its text: (message id, session id, hash).
ChunkLink = tuple[int, str, str]


class SyncEmbedder(Protocol):
    """An embedder that works on the caller's thread (`hash`): the indexer's rounds
    give new chunks their vectors in the same transaction."""

    model_id: str

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class IndexSettings:
    chunk_size: int = 640
    chunk_overlap: int = 96
    index_transcripts: bool = True
    group_sessions_per_user: bool = True
    thread_sessions_per_user: bool = False


@dataclass(frozen=True, slots=True)
class RoundResult:
    work: int  # notes and messages (re)indexed, chunks dropped
    message_seq: int | None  # fts_log applied up to (None: transcripts not indexed)
    note_seq: int  # note_log applied up to
    more: bool  # a page was full: another round has work
    skipped: bool = False  # PostgreSQL: another replica's round held the lock (pg_index)


@dataclass(frozen=True, slots=True)
class LogPage:
    """What a round takes from a log: the ids it names, the sequence number applied up
    to, and whether more waits."""

    ids: list[Any]
    seq: int | None  # None: no entry taken (PostgreSQL's log was empty)
    more: bool


class IndexSql(RecallSql, Protocol):
    """The SQL the indexer needs, per engine; with the engine's `RecallSql`, one object.

    `mark` is the engine's parameter placeholder, for the `where` clauses the indexer
    writes itself (`delete_chunks`); `stores_vectors` False, no vector is stored
    (recall derives them, gateway.memory.vector_cache)."""

    mark: str
    stores_vectors: bool

    def round(self, conn: Any, wait: bool) -> AbstractContextManager[bool]:
        """A round's transaction; it yields False when the round is left to another
        writer (PostgreSQL without `wait`), True when it runs."""
        ...

    def writing(self, conn: Any) -> AbstractContextManager[None]:
        """A write transaction outside a round (vectors, re-queueing, forgetting)."""
        ...

    def meta(self, conn: Any, key: str) -> int | str | None: ...

    def set_meta(self, conn: Any, key: str, value: object) -> None: ...

    def notes_to_apply(self, conn: Any) -> tuple[LogPage, bool]:
        """The note log's next page, and whether every note is indexed again instead
        (a rebuild: the page names every note, and the old note chunks must go)."""
        ...

    def note(self, conn: Any, note_id: str) -> tuple[str, str, str, float, float] | None:
        """(namespace, content, tags, created, updated) of a note, None when gone."""
        ...

    def add_note_chunks(
        self,
        conn: Any,
        namespace: str,
        note_id: str,
        chunks: list[tuple[str, str]],
        created: float,
        updated: float,
        tags: list[str],
    ) -> None:
        """A note's chunks, (hash, text) each, with its tags, searchable at once."""
        ...

    def delete_chunks(self, conn: Any, where: str, params: Sequence[object] = ()) -> int:
        """Delete the chunks `where` says, with their words, tags, sources and vectors."""
        ...

    def start_transcripts(self, conn: Any) -> bool:
        """Whether the transcripts' chunks are rebuilt from the messages (a new index,
        or one whose log bookkeeping does not continue the store's)."""
        ...

    def message_ids_after(self, conn: Any, after: int, limit: int) -> list[int]: ...

    def message_log_page(self, conn: Any) -> LogPage: ...

    def stop_transcripts(self, conn: Any) -> bool:
        """Transcripts are off: forget the log bookkeeping; True when it was kept."""
        ...

    def trim_unfollowed_log(self, conn: Any) -> tuple[int, bool]:
        """Transcripts are off: (log entries dropped, whether more wait)."""
        ...

    def unlink(self, conn: Any, message_ids: list[int]) -> list[tuple[int, int]]:
        """Drop these messages' links to chunks: (message id, chunk id) each."""
        ...

    def indexable_messages(
        self, conn: Any, message_ids: list[int]
    ) -> list[tuple[int, str, str, float]]:
        """(id, session id, content, created) of those active and of an indexed role."""
        ...

    def add_transcript_chunks(
        self, conn: Any, chunks: list[TranscriptChunk], links: list[ChunkLink]
    ) -> None: ...

    def delete_orphans(self, conn: Any, chunk_ids: list[int]) -> int:
        """Delete those of these transcript chunks that no message links any more."""
        ...

    def note_purged(self, conn: Any, message_ids: list[int]) -> None:
        """These messages lost their links: remember whether any left the store."""
        ...

    def take_purged(self, conn: Any) -> bool:
        """Whether messages left the store since the last round (and forget it)."""
        ...

    def forget_words(self, conn: Any) -> None:
        """Make deleted chunks' words unreadable from the index, outside a transaction."""
        ...

    def origins(self, conn: Any, session_ids: list[str]) -> Iterable[tuple[str, str, Any]]:
        """(session id, key, origin) of these sessions."""
        ...

    def requeue_missing(self, conn: Any, model_id: str) -> int:
        """Queue every chunk without a vector of this model; how many were queued."""
        ...

    def pending_chunks(
        self, conn: Any, limit: int, namespace: str | None = None
    ) -> list[tuple[int, str]]: ...

    def put_vectors(self, conn: Any, chunk_ids: list[int], data: np.ndarray, model_id: str) -> None:
        """Vectors (float32 rows) for the chunks still there, replacing any old one;
        they leave the queue."""
        ...

    def namespaces_ending(self, conn: Any, suffix: str) -> list[str]: ...


class MemoryIndex:
    """The indexer's operations on one engine; each takes the engine's connection first
    (MemoryIndexer runs them on its worker thread)."""

    def __init__(self, sql: IndexSql) -> None:
        self.sql = sql

    def apply_logs(
        self,
        conn: Any,
        settings: IndexSettings,
        namespaces: NamespaceCache | None = None,
        embedder: SyncEmbedder | None = None,
        wait: bool = True,
    ) -> RoundResult:
        """One round, in one transaction. With `embedder` (one that embeds on the
        caller's thread, like `hash`), the round's new chunks get their vectors in the
        same transaction, instead of waiting as `pending_vectors`. With `wait` False, no
        round at all (work 0) while another writer's round holds the engine's lock."""
        sql = self.sql
        with sql.round(conn, wait) as running:
            if not running:
                return RoundResult(0, None, 0, False, skipped=True)
            notes, note_seq, notes_more = self._apply_notes(conn, settings)
            message_seq = None
            if settings.index_transcripts:
                messages, message_seq, messages_more = self._apply_messages(
                    conn, settings, namespaces or NamespaceCache()
                )
            else:
                messages, messages_more = self._drop_transcripts(conn)
            if embedder is not None:
                self._embed_waiting(conn, embedder, INLINE_VECTORS)
            purged = sql.take_purged(conn)
        if purged:
            sql.forget_words(conn)
        return RoundResult(notes + messages, message_seq, note_seq, notes_more or messages_more)

    def _apply_notes(self, conn: Any, settings: IndexSettings) -> tuple[int, int, bool]:
        page, rebuild = self.sql.notes_to_apply(conn)
        if rebuild:
            self.sql.delete_chunks(conn, "kind = 'note'")
        for note_id in page.ids:
            self._index_note(conn, note_id, settings)
        return len(page.ids), page.seq or 0, page.more

    def _index_note(self, conn: Any, note_id: str, settings: IndexSettings) -> None:
        sql = self.sql
        sql.delete_chunks(conn, f"note_id = {sql.mark}", (note_id,))
        row = sql.note(conn, note_id)
        if row is None:
            return
        namespace, content, tags, created, updated = row
        chunks = [
            (content_hash(text), text)
            for text in chunk_text(content, settings.chunk_size, settings.chunk_overlap)
        ]
        sql.add_note_chunks(conn, namespace, note_id, chunks, created, updated, codec.loads(tags))

    def _apply_messages(
        self, conn: Any, settings: IndexSettings, namespaces: NamespaceCache
    ) -> tuple[int, int | None, bool]:
        """The rebuild's next page of messages (when one runs) and the log's next page."""
        sql = self.sql
        work = 0
        if sql.start_transcripts(conn):
            work += sql.delete_chunks(conn, "kind = 'transcript'")
            sql.set_meta(conn, "rebuild_after", 0)  # message id the rebuild has indexed up to
        ids: list[int] = []
        cursor = sql.meta(conn, "rebuild_after")
        if cursor is not None:
            ids = sql.message_ids_after(conn, int(cursor), MESSAGE_PAGE)
            sql.set_meta(conn, "rebuild_after", ids[-1] if len(ids) == MESSAGE_PAGE else None)
        page = sql.message_log_page(conn)
        ids += page.ids
        work += self._index_messages(conn, list(dict.fromkeys(ids)), settings, namespaces)
        more = page.more or sql.meta(conn, "rebuild_after") is not None
        return work, page.seq, more

    def _drop_transcripts(self, conn: Any) -> tuple[int, bool]:
        """Transcript indexing is off: its chunks go (once), and the log is not followed
        (the next start with it on rebuilds them)."""
        sql = self.sql
        work = 0
        if sql.stop_transcripts(conn):
            sql.set_meta(conn, "rebuild_after", None)
            work = sql.delete_chunks(conn, "kind = 'transcript'")
        dropped, more = sql.trim_unfollowed_log(conn)
        return work + dropped, more

    def _index_messages(
        self,
        conn: Any,
        message_ids: list[int],
        settings: IndexSettings,
        namespaces: NamespaceCache,
    ) -> int:
        """Index the messages as they are now: their old chunk links go; a chunk no
        message links any more goes; the text of those indexable (role user or
        assistant, active, in a session of one user) is chunked and linked again.
        Returns how many.

        Set-based, a round's messages at once: a statement per message costs far more
        CPU than a handful of statements per round, each looping in the engine."""
        if not message_ids:
            return 0
        sql = self.sql
        unlinked = sql.unlink(conn, message_ids)
        rows = sql.indexable_messages(conn, message_ids)
        session_ns = namespaces.lookup(conn, {row[1] for row in rows}, settings, sql)
        chunks: list[TranscriptChunk] = []
        links: list[ChunkLink] = []
        size, overlap = settings.chunk_size, settings.chunk_overlap
        for message_id, session_id, content, created in rows:
            namespace = session_ns.get(session_id)
            if namespace is None:
                continue
            for text in chunk_text(content, size, overlap):
                digest = content_hash(text)
                chunks.append((namespace, session_id, digest, text, created))
                links.append((message_id, session_id, digest))
        if chunks:
            sql.add_transcript_chunks(conn, chunks, links)
        if unlinked:
            sql.delete_orphans(conn, sorted({row[1] for row in unlinked}))
            sql.note_purged(conn, sorted({row[0] for row in unlinked}))
        return len(message_ids)

    # --- vectors -----------------------------------------------------------------------

    def requeue_other_models(self, conn: Any, model_id: str) -> int:
        """At start: when the embedder changed, every chunk is queued to be embedded
        again (its old vector stays, unscored, until the new one replaces it). Vectors
        derived, not stored, count as a model of their own: the stored ones go."""
        sql = self.sql
        if not sql.stores_vectors:
            model_id += DERIVED
        with sql.writing(conn):
            if sql.meta(conn, "model") == model_id:
                return 0
            count = sql.requeue_missing(conn, model_id)
            sql.set_meta(conn, "model", model_id)
        return count

    def pending_chunks(
        self, conn: Any, limit: int, namespace: str | None = None
    ) -> list[tuple[int, str]]:
        return self.sql.pending_chunks(conn, limit, namespace)

    def store_vectors(
        self, conn: Any, chunk_ids: list[int], vectors: np.ndarray, model_id: str
    ) -> None:
        """Vectors for chunks still there, in a transaction of their own."""
        with self.sql.writing(conn):
            self._put_vectors(conn, chunk_ids, vectors, model_id)

    def _put_vectors(
        self, conn: Any, chunk_ids: list[int], vectors: np.ndarray, model_id: str
    ) -> None:
        """Vectors as float32, little-endian, one row per chunk."""
        data = np.ascontiguousarray(vectors, dtype="<f4")
        if len(data) != len(chunk_ids):
            raise ValueError(f"{len(chunk_ids)} chunks, {len(data)} vectors")
        self.sql.put_vectors(conn, chunk_ids, data, model_id)

    def _embed_waiting(self, conn: Any, embedder: SyncEmbedder, limit: int) -> None:
        """In slices of INLINE_BATCH: a round's vectors at once would be a dense matrix
        of tens of MB, freed again at once, which leaves the allocator's heap fragmented
        (the process keeps it); a slice's is a fraction of a MB, reused round after round."""
        waiting = self.sql.pending_chunks(conn, limit)
        for first in range(0, len(waiting), INLINE_BATCH):
            batch = waiting[first : first + INLINE_BATCH]
            vectors = embedder.embed_sync([row[1] for row in batch])
            self._put_vectors(conn, [row[0] for row in batch], vectors, embedder.model_id)

    # --- forgetting --------------------------------------------------------------------

    def forget_namespaces(self, conn: Any, namespaces: list[str]) -> int:
        """Every chunk (with its words, tags, sources and vector) of these memories,
        now; returns how many chunks went."""
        sql = self.sql
        with sql.writing(conn):
            count = 0
            for namespace in namespaces:
                count += sql.delete_chunks(conn, f"namespace = {sql.mark}", (namespace,))
        sql.forget_words(conn)
        return count

    def forget_all_agents(self, conn: Any, platform: str, user_id: str) -> int:
        """Chunks of the user under any agent (a namespace ends in `:{platform}:{user_id}`)."""
        suffix = f":{platform}:{user_id}"
        namespaces = [
            namespace
            for namespace in self.sql.namespaces_ending(conn, suffix)
            # memory:AGENT + the suffix, where an agent id has no colon (a user id may)
            if namespace[: -len(suffix)].count(":") == 1 and namespace.startswith("memory:")
        ]
        return self.forget_namespaces(conn, namespaces) if namespaces else 0


class NamespaceCache:
    """Session id -> the memory its transcript belongs to (None: no single user). A
    session's key and origin never change, so each is read and parsed once, not once
    per round; bounded (cleared when full)."""

    LIMIT = 50_000

    def __init__(self) -> None:
        self._known: dict[str, str | None] = {}

    def lookup(
        self, conn: Any, session_ids: set[str], settings: IndexSettings, sql: IndexSql
    ) -> dict[str, str | None]:
        known = self._known
        missing = [sid for sid in session_ids if sid not in known]
        if missing:
            if len(known) + len(missing) > self.LIMIT:
                known.clear()
            found: dict[str, str | None] = dict.fromkeys(missing)
            for sid, key, origin in sql.origins(conn, missing):
                if origin:
                    found[sid] = transcript_namespace(key, codec.loads(origin), settings)
            known.update(found)
        return known


def transcript_namespace(key: str, origin: object, settings: IndexSettings) -> str | None:
    """The memory a session's transcript belongs to, or None (no single user)."""
    if not isinstance(origin, dict) or not key.startswith("agent:"):
        return None
    agent_id = key.split(":", 2)[1]
    # A DM (the common case) without the SessionSource: building one cost more than the
    # rest of a new session's look-up.
    dm = plain_dm_user(origin)
    if dm is not None:
        return f"memory:{agent_id}:{dm[0]}:{dm[1]}"
    try:
        source = SessionSource.from_dict(origin)
    except (KeyError, TypeError, ValueError):
        return None
    if not source.user_id or is_shared_multi_user_session(
        source,
        group_sessions_per_user=settings.group_sessions_per_user,
        thread_sessions_per_user=settings.thread_sessions_per_user,
    ):
        return None
    platform = getattr(source.platform, "value", source.platform)
    return f"memory:{agent_id}:{platform}:{source.user_id}"


_PLATFORMS = frozenset(platform.value for platform in Platform)
_FLAGS = ("is_bot", "role_authorized")


def plain_dm_user(origin: dict[str, Any]) -> tuple[str, str] | None:
    """(platform, user id) of a DM origin (`SessionSource.to_dict()`) that `from_dict`
    would take as it is: a known platform, a chat id, every other value a string or
    absent. None for anything else, which the full parse then decides."""
    platform, user_id = origin.get("platform"), origin.get("user_id")
    if (
        origin.get("chat_type", "dm") != "dm"
        or type(user_id) is not str
        or not user_id
        or platform not in _PLATFORMS
        or "chat_id" not in origin
    ):
        return None
    for name, value in origin.items():
        if value is not None and type(value) is not str and name not in _FLAGS:
            return None
    return platform, user_id


def now() -> float:
    return time.time()
