"""The memory index: memory.db beside state.db, with every note's and every eligible
transcript message's chunks, their full-text index (FTS5) and their vectors.

Why a file of its own (like search.db, gateway.store.fts): it is derived. Notes (the
`notes` table) and messages live in state.db; memory.db can always be rebuilt from them,
and indexing it never holds the write lock a turn needs. A turn's transaction gains
nothing: the messages' changes are read from state.db's existing `fts_log`, the notes'
from `note_log` (written by note saves, never by a turn).

How it stays exact (the functions here run on a worker thread, on memory.db with
state.db attached read-only as `st`): a round, in one memory.db transaction, reads the
log entries after the `applied_*` numbers kept in `meta`, re-indexes every message or
note they name as it is now (or drops it, when it is gone), and stores the new numbers.
A crash repeats a round at most; a repeated round changes nothing. The index tells
state.db how far it got (`log_readers`), and `fts_log` is trimmed only behind that. A
new memory.db, or one whose numbers do not continue state.db's logs (state.db rebuilt
or restored), is rebuilt: every note at once, messages a page per round.

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

import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gateway.domain.session import SessionSource, is_shared_multi_user_session
from gateway.memory.chunking import chunk_text, content_hash
from gateway.store import codec
from gateway.store.fts import connect_index

MEMORY_DB = "memory.db"
LOG_READER = "memory"  # our row in state.db's log_readers
NOTE_PAGE = 2_000  # note log entries per round
MESSAGE_PAGE = 5_000  # message log entries (or rebuilt messages) per round
INDEXED_ROLES = ("user", "assistant")
INLINE_VECTORS = 2 * MESSAGE_PAGE  # vectors made inside a round, at most (the rest wait)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS chunks (
    id         INTEGER PRIMARY KEY,
    namespace  TEXT NOT NULL,
    kind       TEXT NOT NULL,
    note_id    TEXT,
    session_id TEXT,
    hash       TEXT NOT NULL,
    text       TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_namespace ON chunks(namespace, kind);
CREATE INDEX IF NOT EXISTS chunks_by_note ON chunks(note_id) WHERE note_id IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS chunks_dedup ON chunks(session_id, hash)
    WHERE session_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS chunk_tags (
    tag TEXT NOT NULL, chunk_id INTEGER NOT NULL, PRIMARY KEY (tag, chunk_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS chunk_sources (
    message_id INTEGER NOT NULL, chunk_id INTEGER NOT NULL, PRIMARY KEY (message_id, chunk_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunk_sources_by_chunk ON chunk_sources(chunk_id);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(
    text, content='chunks', content_rowid='id'
);
-- Per word, how many chunks hold it: recall leaves out the words too common to rank by.
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_vocab USING fts5vocab(chunks_fts, 'row');
CREATE TABLE IF NOT EXISTS vectors (
    seq       INTEGER PRIMARY KEY AUTOINCREMENT,
    chunk_id  INTEGER NOT NULL UNIQUE,
    namespace TEXT NOT NULL,
    model     TEXT NOT NULL,
    vec       BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS vectors_by_namespace ON vectors(namespace, model, seq);
CREATE TABLE IF NOT EXISTS pending_vectors (chunk_id INTEGER PRIMARY KEY);
-- Vectors ever deleted (meta 'vector_deletes'): while it stays put, a cached matrix is
-- only extended by the vectors added after it (gateway.memory.retrieval).
INSERT OR IGNORE INTO meta (key, value) VALUES ('vector_deletes', 0);
-- A chunk's words enter and leave chunks_fts in statements of the code's own
-- (`_add_words`, `_delete_chunks`), not in these triggers: FTS5 written from a trigger
-- flushes its pending terms at every row's statement savepoint, a segment a row, which
-- made an insert cost three times as much. The older triggers that did are dropped.
DROP TRIGGER IF EXISTS chunks_insert;
CREATE TRIGGER IF NOT EXISTS chunks_queue_vector AFTER INSERT ON chunks BEGIN
    INSERT OR IGNORE INTO pending_vectors(chunk_id) VALUES (new.id);
END;
DROP TRIGGER IF EXISTS chunks_delete;  -- (it also wrote chunks_fts: see chunks_insert)
CREATE TRIGGER IF NOT EXISTS chunks_gone AFTER DELETE ON chunks BEGIN
    DELETE FROM chunk_tags WHERE chunk_id = old.id;
    DELETE FROM chunk_sources WHERE chunk_id = old.id;
    DELETE FROM vectors WHERE chunk_id = old.id;
    DELETE FROM pending_vectors WHERE chunk_id = old.id;
END;
CREATE TRIGGER IF NOT EXISTS vectors_delete AFTER DELETE ON vectors BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'vector_deletes';
END;
"""


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


def memory_files(sessions_dir: Path) -> list[Path]:
    base = sessions_dir / MEMORY_DB
    return [base, base.with_name(base.name + "-wal"), base.with_name(base.name + "-shm")]


def connect(memory_path: Path, state_path: Path) -> sqlite3.Connection:
    """memory.db for writing, with state.db attached read-only as `st`."""
    return connect_index(memory_path, state_path, _SCHEMA)


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction on memory.db, taken at once (the daemon and the CLI may
    both write it), committed, or rolled back on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _meta(conn: sqlite3.Connection, key: str) -> int | str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return row[0] if row else None


def _set_meta(conn: sqlite3.Connection, key: str, value: object) -> None:
    if value is None:
        conn.execute("DELETE FROM meta WHERE key = ?", (key,))
    else:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


def apply_logs(
    conn: sqlite3.Connection,
    settings: IndexSettings,
    namespaces: NamespaceCache | None = None,
    embedder: SyncEmbedder | None = None,
) -> RoundResult:
    """One round (see the module docstring), in one transaction. With `embedder` (one
    that embeds on the caller's thread, like `hash`), the round's new chunks get their
    vectors in the same transaction, instead of waiting as `pending_vectors`."""
    with _immediate(conn):
        notes, note_seq, notes_more = _apply_notes(conn, settings)
        if settings.index_transcripts:
            messages, message_seq, messages_more = _apply_messages(
                conn, settings, namespaces or NamespaceCache()
            )
        else:
            messages, message_seq, messages_more = _drop_transcripts(conn), None, False
        if embedder is not None:
            _embed_waiting(conn, embedder, INLINE_VECTORS)
        purged = _meta(conn, "purged")
        _set_meta(conn, "purged", None)
    if purged:
        forget_tokens(conn)
    return RoundResult(notes + messages, message_seq, note_seq, notes_more or messages_more)


def forget_tokens(conn: sqlite3.Connection) -> None:
    """Merge the full-text index into one segment: FTS5 keeps a deleted row's words in
    its segments until they are merged (this SQLite predates 'secure-delete'). Run after
    messages were purged (a session deleted) and after forgetting a user; a note's
    delete or update leaves its old words to the next automatic merge."""
    conn.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('optimize')")


def _log_state(
    conn: sqlite3.Connection, table: str, applied_key: str
) -> tuple[int, int | None, bool]:
    """(last sequence number handed out, applied, whether to rebuild)."""
    last = conn.execute(
        "SELECT coalesce((SELECT seq FROM st.sqlite_sequence WHERE name = ?), 0)", (table,)
    ).fetchone()[0]
    first = conn.execute(f"SELECT min(seq) FROM st.{table}").fetchone()[0]
    applied = _meta(conn, applied_key)
    assert applied is None or isinstance(applied, int)
    rebuild = applied is None or last < applied or (first or last + 1) > applied + 1
    return last, applied, rebuild


def _apply_notes(conn: sqlite3.Connection, settings: IndexSettings) -> tuple[int, int, bool]:
    last, applied, rebuild = _log_state(conn, "note_log", "note_seq")
    if rebuild:
        _delete_chunks(conn, "kind = 'note'")
        ids = [row[0] for row in conn.execute("SELECT note_id FROM st.notes")]
        hi, more = last, False
    else:
        assert applied is not None
        hi = min(last, applied + NOTE_PAGE)
        more = hi < last
        ids = [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT note_id FROM st.note_log WHERE seq > ? AND seq <= ?", (applied, hi)
            )
        ]
    for note_id in ids:
        _index_note(conn, note_id, settings)
    if hi != applied:
        _set_meta(conn, "note_seq", hi)
    return len(ids), hi, more


def _index_note(conn: sqlite3.Connection, note_id: str, settings: IndexSettings) -> None:
    _delete_chunks(conn, "note_id = ?", (note_id,))
    row = conn.execute(
        "SELECT namespace, content, tags, created_at, updated_at FROM st.notes WHERE note_id = ?",
        (note_id,),
    ).fetchone()
    if row is None:
        return
    namespace, content, tags, created, updated = row
    before = _last_chunk_id(conn)
    for text in chunk_text(content, settings.chunk_size, settings.chunk_overlap):
        chunk_id = conn.execute(
            "INSERT INTO chunks (namespace, kind, note_id, hash, text, created_at, updated_at)"
            " VALUES (?, 'note', ?, ?, ?, ?, ?)",
            (namespace, note_id, content_hash(text), text, created, updated),
        ).lastrowid
        conn.executemany(
            "INSERT OR IGNORE INTO chunk_tags (tag, chunk_id) VALUES (?, ?)",
            [(tag, chunk_id) for tag in codec.loads(tags)],
        )
    _add_words(conn, before)


def _last_chunk_id(conn: sqlite3.Connection) -> int:
    """Chunks inserted after this (with no delete between) have larger ids."""
    return conn.execute("SELECT coalesce(max(id), 0) FROM chunks").fetchone()[0]


def _delete_chunks(conn: sqlite3.Connection, where: str, params: tuple[object, ...] = ()) -> int:
    """Delete the chunks `where` says (their tags, sources and vectors go by trigger),
    their words first leaving the full-text index in one statement."""
    conn.execute(
        "INSERT INTO chunks_fts(chunks_fts, rowid, text)"
        f" SELECT 'delete', id, text FROM chunks WHERE {where}",
        params,
    )
    return conn.execute(f"DELETE FROM chunks WHERE {where}", params).rowcount


def _add_words(conn: sqlite3.Connection, after: int) -> None:
    """The chunks inserted since `_last_chunk_id` said `after` join the full-text index."""
    conn.execute(
        "INSERT INTO chunks_fts(rowid, text) SELECT id, text FROM chunks WHERE id > ?", (after,)
    )


def _apply_messages(
    conn: sqlite3.Connection, settings: IndexSettings, namespaces: NamespaceCache
) -> tuple[int, int, bool]:
    last, applied, rebuild = _log_state(conn, "fts_log", "message_seq")
    work = 0
    if rebuild:
        work += _delete_chunks(conn, "kind = 'transcript'")
        _set_meta(conn, "rebuild_after", 0)  # message id the rebuild has indexed up to
        applied = last
        _set_meta(conn, "message_seq", last)
    assert applied is not None
    cursor = _meta(conn, "rebuild_after")
    ids: list[int] = []
    if cursor is not None:
        ids = [
            row[0]
            for row in conn.execute(
                "SELECT id FROM st.messages WHERE id > ? ORDER BY id LIMIT ?",
                (cursor, MESSAGE_PAGE),
            )
        ]
        _set_meta(conn, "rebuild_after", ids[-1] if len(ids) == MESSAGE_PAGE else None)
    hi = min(last, applied + MESSAGE_PAGE)
    if hi > applied:
        ids += [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT id FROM st.fts_log WHERE seq > ? AND seq <= ?", (applied, hi)
            )
        ]
        _set_meta(conn, "message_seq", hi)
    work += _index_messages(conn, list(dict.fromkeys(ids)), settings, namespaces)
    more = hi < last or _meta(conn, "rebuild_after") is not None
    return work, hi, more


def _drop_transcripts(conn: sqlite3.Connection) -> int:
    """Transcript indexing is off: its chunks go (once), and the log is not followed
    (the next start with it on rebuilds them)."""
    if _meta(conn, "message_seq") is None:
        return 0
    _set_meta(conn, "message_seq", None)
    _set_meta(conn, "rebuild_after", None)
    return _delete_chunks(conn, "kind = 'transcript'")


# Set-based, a round's messages at once: a statement per message made indexing cost
# about 120 µs of CPU a message (two a turn), on the gateway's two cores; a handful of
# statements per round, each looping in C, cost a fraction of that.
_MESSAGES = (
    "SELECT m.id, m.session_id, m.content, m.created_at"
    " FROM json_each(?) j JOIN st.messages m ON m.id = j.value"
    " WHERE m.active AND m.role IN ({})".format(", ".join(f"'{role}'" for role in INDEXED_ROLES))
)
_UNLINK = (
    "DELETE FROM chunk_sources WHERE message_id IN (SELECT value FROM json_each(?))"
    " RETURNING message_id, chunk_id"
)
_UPSERT_CHUNK = (
    "INSERT INTO chunks (namespace, kind, session_id, hash, text, created_at, updated_at)"
    " VALUES (?, 'transcript', ?, ?, ?, ?, ?)"
    " ON CONFLICT (session_id, hash) WHERE session_id IS NOT NULL"
    # the same text again in its session: one chunk, as recent as its latest message
    " DO UPDATE SET updated_at = max(updated_at, excluded.updated_at)"
)
_LINK = (
    "INSERT OR IGNORE INTO chunk_sources (message_id, chunk_id)"
    " SELECT j.value ->> 0, c.id FROM json_each(?) j"
    " JOIN chunks c ON c.session_id = j.value ->> 1 AND c.hash = j.value ->> 2"
)
_ORPHANS = (
    "id IN (SELECT value FROM json_each(?)) AND kind = 'transcript'"
    " AND NOT EXISTS (SELECT 1 FROM chunk_sources s WHERE s.chunk_id = chunks.id)"
)


def _index_messages(
    conn: sqlite3.Connection,
    message_ids: list[int],
    settings: IndexSettings,
    namespaces: NamespaceCache,
) -> int:
    """Index the messages as they are now: their old chunk links go; a chunk no message
    links any more goes; the text of those indexable (role user or assistant, active,
    in a session of one user) is chunked and linked again. Returns how many."""
    if not message_ids:
        return 0
    id_list = codec.dumps(message_ids)
    unlinked = conn.execute(_UNLINK, (id_list,)).fetchall()
    rows = conn.execute(_MESSAGES, (id_list,)).fetchall()
    session_ns = namespaces.lookup(conn, {row[1] for row in rows}, settings)
    chunks: list[tuple[str, str, str, str, float, float]] = []
    links: list[tuple[int, str, str]] = []
    size, overlap = settings.chunk_size, settings.chunk_overlap
    for message_id, session_id, content, created in rows:
        namespace = session_ns.get(session_id)
        if namespace is None:
            continue
        for text in chunk_text(content, size, overlap):
            digest = content_hash(text)
            chunks.append((namespace, session_id, digest, text, created, created))
            links.append((message_id, session_id, digest))
    if chunks:
        before = _last_chunk_id(conn)
        conn.executemany(_UPSERT_CHUNK, chunks)
        _add_words(conn, before)
        conn.execute(_LINK, (codec.dumps(links),))
    if unlinked:
        _delete_chunks(conn, _ORPHANS, (codec.dumps(sorted({row[1] for row in unlinked})),))
        gone = conn.execute(  # purged from state.db: their words leave the index too
            "SELECT 1 FROM json_each(?) j WHERE NOT EXISTS"
            " (SELECT 1 FROM st.messages m WHERE m.id = j.value) LIMIT 1",
            (codec.dumps(sorted({row[0] for row in unlinked})),),
        ).fetchone()
        if gone:
            _set_meta(conn, "purged", 1)
    return len(message_ids)


class NamespaceCache:
    """Session id -> the memory its transcript belongs to (None: no single user). A
    session's key and origin never change, so each is read and parsed once, not once
    per round; bounded (cleared when full)."""

    LIMIT = 50_000

    def __init__(self) -> None:
        self._known: dict[str, str | None] = {}

    def lookup(
        self, conn: Any, session_ids: set[str], settings: IndexSettings
    ) -> dict[str, str | None]:
        known = self._known
        missing = [sid for sid in session_ids if sid not in known]
        if missing:
            if len(known) + len(missing) > self.LIMIT:
                known.clear()
            found: dict[str, str | None] = dict.fromkeys(missing)
            for sid, key, origin in self._origins(conn, missing):
                if origin:
                    found[sid] = transcript_namespace(key, codec.loads(origin), settings)
            known.update(found)
        return known

    def _origins(self, conn: Any, session_ids: list[str]) -> Iterable[tuple[str, str, Any]]:
        """(session id, key, origin) of these sessions, from state.db (attached as `st`)."""
        return conn.execute(
            "SELECT session_id, session_key, origin FROM st.sessions"
            " WHERE session_id IN (SELECT value FROM json_each(?))",
            (codec.dumps(session_ids),),
        )


def transcript_namespace(key: str, origin: object, settings: IndexSettings) -> str | None:
    """The memory a session's transcript belongs to, or None (no single user)."""
    if not isinstance(origin, dict) or not key.startswith("agent:"):
        return None
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
    agent_id = key.split(":", 2)[1]
    platform = getattr(source.platform, "value", source.platform)
    return f"memory:{agent_id}:{platform}:{source.user_id}"


# --- vectors ---------------------------------------------------------------------------


def requeue_other_models(conn: sqlite3.Connection, model_id: str) -> int:
    """At start: when the embedder changed, every chunk is queued to be embedded again
    (its old vector stays, unscored, until the new one replaces it)."""
    with _immediate(conn):
        count = 0
        if _meta(conn, "model") != model_id:
            count = conn.execute(
                "INSERT OR IGNORE INTO pending_vectors (chunk_id)"
                " SELECT id FROM chunks WHERE id NOT IN"
                " (SELECT chunk_id FROM vectors WHERE model = ?)",
                (model_id,),
            ).rowcount
            _set_meta(conn, "model", model_id)
    return count


def pending_chunks(
    conn: sqlite3.Connection, limit: int, namespace: str | None = None
) -> list[tuple[int, str]]:
    # CROSS JOIN: from the (mostly empty) queue to its chunks, never the other way round.
    sql = "SELECT c.id, c.text FROM pending_vectors p CROSS JOIN chunks c ON c.id = p.chunk_id"
    if namespace is None:
        return conn.execute(f"{sql} ORDER BY p.chunk_id LIMIT ?", (limit,)).fetchall()
    return conn.execute(
        f"{sql} WHERE c.namespace = ? ORDER BY p.chunk_id LIMIT ?",
        (namespace, limit),
    ).fetchall()


def store_vectors(
    conn: sqlite3.Connection, chunk_ids: list[int], vectors: np.ndarray, model_id: str
) -> None:
    """Vectors for chunks still there, in a transaction of their own."""
    with _immediate(conn):
        _put_vectors(conn, chunk_ids, vectors, model_id)


def _put_vectors(
    conn: sqlite3.Connection, chunk_ids: list[int], vectors: np.ndarray, model_id: str
) -> None:
    """Vectors (float32, little-endian) for chunks still there (an old one is deleted
    first, which `vector_deletes` counts); they leave the queue."""
    data = np.ascontiguousarray(vectors, dtype="<f4")
    if len(data) != len(chunk_ids):
        raise ValueError(f"{len(chunk_ids)} chunks, {len(data)} vectors")
    blob, width = data.tobytes(), data.shape[1] * 4 if data.ndim == 2 else 0
    ids = codec.dumps(chunk_ids)
    conn.execute("DELETE FROM vectors WHERE chunk_id IN (SELECT value FROM json_each(?))", (ids,))
    conn.executemany(
        "INSERT INTO vectors (chunk_id, namespace, model, vec)"
        " SELECT id, namespace, ?, ? FROM chunks WHERE id = ?",
        [
            (model_id, blob[i * width : (i + 1) * width], chunk_id)
            for i, chunk_id in enumerate(chunk_ids)
        ],
    )
    conn.execute(
        "DELETE FROM pending_vectors WHERE chunk_id IN (SELECT value FROM json_each(?))", (ids,)
    )


def _embed_waiting(conn: sqlite3.Connection, embedder: SyncEmbedder, limit: int) -> None:
    waiting = pending_chunks(conn, limit)
    if waiting:
        vectors = embedder.embed_sync([row[1] for row in waiting])
        _put_vectors(conn, [row[0] for row in waiting], vectors, embedder.model_id)


# --- forgetting ------------------------------------------------------------------------


def forget_namespaces(conn: sqlite3.Connection, namespaces: list[str]) -> int:
    """Every chunk (with its full-text entry, tags, sources and vector) of these
    memories, now; returns how many chunks went."""
    with _immediate(conn):
        count = 0
        for namespace in namespaces:
            count += _delete_chunks(conn, "namespace = ?", (namespace,))
    forget_tokens(conn)
    return count


def now() -> float:
    return time.time()
