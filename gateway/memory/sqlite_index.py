"""The memory index on SQLite: memory.db beside state.db, with every chunk, its
full-text entry (FTS5) and its vector; the SQL of gateway.memory.index's indexer and of
recall (`SqliteRecallSql`) for this engine.

Why a file of its own (like search.db, gateway.store.fts): it is derived. Notes (the
`notes` table) and messages live in state.db; memory.db can always be rebuilt from them,
and indexing it never holds the write lock a turn needs. A turn's transaction gains
nothing: the messages' changes are read from state.db's existing `fts_log`, the notes'
from `note_log` (written by note saves, never by a turn).

How it stays exact (the indexer runs on a worker thread, on memory.db with state.db
attached read-only as `st`): a round, in one memory.db transaction, reads the log
entries after the `applied_*` numbers kept in `meta`, re-indexes every message or note
they name as it is now (or drops it, when it is gone), and stores the new numbers. A
crash repeats a round at most; a repeated round changes nothing. The index tells
state.db how far it got (`log_readers`), and `fts_log` is trimmed only behind that. A
new memory.db, or one whose numbers do not continue state.db's logs (state.db rebuilt
or restored), is rebuilt: every note at once, messages a page per round.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from gateway.memory.index import (
    INDEXED_ROLES,
    MESSAGE_PAGE,
    NOTE_PAGE,
    ChunkLink,
    LogPage,
    MemoryIndex,
    TranscriptChunk,
)
from gateway.memory.retrieval import SqliteRecallSql
from gateway.memory.vector_blob import encode_rows
from gateway.store import codec
from gateway.store.fts import connect_index

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
-- (`add_words`, `delete_chunks`), not in these triggers: FTS5 written from a trigger
-- flushes its pending terms at every row's statement savepoint, a segment a row, which
-- made an insert cost three times as much. The older triggers that did are dropped.
-- The same for queueing a new chunk's vector (`add_words`): a row trigger cost more than
-- the statement that queues a round's new chunks at once.
DROP TRIGGER IF EXISTS chunks_insert;
DROP TRIGGER IF EXISTS chunks_queue_vector;
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
-- Chunks ever deleted (meta 'chunk_deletes'): after any, a derived vector cache
-- (gateway.memory.vector_cache) drops the vectors of the chunks gone.
INSERT OR IGNORE INTO meta (key, value) VALUES ('chunk_deletes', 0);
CREATE TRIGGER IF NOT EXISTS chunks_count_deletes AFTER DELETE ON chunks BEGIN
    UPDATE meta SET value = value + 1 WHERE key = 'chunk_deletes';
END;
"""


def connect(memory_path: Path, state_path: Path) -> sqlite3.Connection:
    """memory.db for writing, with state.db attached read-only as `st`."""
    return connect_index(memory_path, state_path, _SCHEMA)


# A round's messages at once, each statement looping in C over a JSON list.
_MESSAGES = (
    "SELECT m.id, m.session_id, m.content, m.created_at"
    " FROM json_each(?) j JOIN st.messages m ON m.id = j.value"
    " WHERE m.active AND m.role IN ({})".format(", ".join(f"'{role}'" for role in INDEXED_ROLES))
)
_UNLINK = (
    "DELETE FROM chunk_sources WHERE message_id IN (SELECT value FROM json_each(?))"
    " RETURNING message_id, chunk_id"
)
# A round's chunks in one statement over a JSON list, [namespace, session, hash, text,
# time] each, ids from the first parameter on in the list's order: executemany binds
# every row's parameters in Python and gives the GIL back and takes it again for each.
_UPSERT_CHUNKS = (
    "INSERT INTO chunks (id, namespace, kind, session_id, hash, text, created_at, updated_at)"
    " SELECT ? + j.key, j.value ->> 0, 'transcript', j.value ->> 1, j.value ->> 2,"
    " j.value ->> 3, j.value ->> 4, j.value ->> 4 FROM json_each(?) j WHERE true"
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


class SqliteIndexSql(SqliteRecallSql):
    """`IndexSql` (and `RecallSql`) on memory.db, state.db attached as `st`.

    `stores_vectors` False: no chunk waits for a vector and none is stored; recall
    derives them from the texts (the `hash` embedder, gateway.memory.vector_cache)."""

    mark = "?"

    def __init__(self, stores_vectors: bool = True) -> None:
        self.stores_vectors = stores_vectors

    @contextmanager
    def round(self, conn: sqlite3.Connection, wait: bool) -> Iterator[bool]:
        """Every round runs: one writer of memory.db at a time (`writing`)."""
        with self.writing(conn):
            yield True

    @contextmanager
    def writing(self, conn: sqlite3.Connection) -> Iterator[None]:
        """One write transaction on memory.db, taken at once (the daemon and the CLI
        may both write it), committed, or rolled back on any error."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def meta(self, conn: sqlite3.Connection, key: str) -> int | str | None:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, conn: sqlite3.Connection, key: str, value: object) -> None:
        if value is None:
            conn.execute("DELETE FROM meta WHERE key = ?", (key,))
        else:
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def _log_state(
        self, conn: sqlite3.Connection, table: str, applied_key: str
    ) -> tuple[int, int | None, bool]:
        """(last sequence number handed out, applied, whether to rebuild)."""
        last = conn.execute(
            "SELECT coalesce((SELECT seq FROM st.sqlite_sequence WHERE name = ?), 0)", (table,)
        ).fetchone()[0]
        first = conn.execute(f"SELECT min(seq) FROM st.{table}").fetchone()[0]
        applied = self.meta(conn, applied_key)
        assert applied is None or isinstance(applied, int)
        rebuild = applied is None or last < applied or (first or last + 1) > applied + 1
        return last, applied, rebuild

    def notes_to_apply(self, conn: sqlite3.Connection) -> tuple[LogPage, bool]:
        last, applied, rebuild = self._log_state(conn, "note_log", "note_seq")
        if rebuild:
            ids = [row[0] for row in conn.execute("SELECT note_id FROM st.notes")]
            hi, more = last, False
        else:
            assert applied is not None
            hi = min(last, applied + NOTE_PAGE)
            more = hi < last
            ids = [
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT note_id FROM st.note_log WHERE seq > ? AND seq <= ?",
                    (applied, hi),
                )
            ]
        if hi != applied:
            self.set_meta(conn, "note_seq", hi)
        return LogPage(ids, hi, more), rebuild

    def note(
        self, conn: sqlite3.Connection, note_id: str
    ) -> tuple[str, str, str, float, float] | None:
        return conn.execute(
            "SELECT namespace, content, tags, created_at, updated_at FROM st.notes"
            " WHERE note_id = ?",
            (note_id,),
        ).fetchone()

    def add_note_chunks(
        self,
        conn: sqlite3.Connection,
        namespace: str,
        note_id: str,
        chunks: list[tuple[str, str]],
        created: float,
        updated: float,
        tags: list[str],
    ) -> None:
        before = self.last_chunk_id(conn)
        for chunk_id, (digest, text) in enumerate(chunks, before + 1):
            conn.execute(
                "INSERT INTO chunks"
                " (id, namespace, kind, note_id, hash, text, created_at, updated_at)"
                " VALUES (?, ?, 'note', ?, ?, ?, ?, ?)",
                (chunk_id, namespace, note_id, digest, text, created, updated),
            )
            conn.executemany(
                "INSERT OR IGNORE INTO chunk_tags (tag, chunk_id) VALUES (?, ?)",
                [(tag, chunk_id) for tag in tags],
            )
        self.add_words(conn, before, len(chunks))

    def last_chunk_id(self, conn: sqlite3.Connection) -> int:
        """The largest chunk id ever handed out. New chunks take the ids after it, never
        SQLite's largest + 1: that hands a deleted chunk's id out again, and a derived
        vector cache (gateway.memory.vector_cache) holds vectors by id."""
        return conn.execute(
            "SELECT max(coalesce((SELECT value FROM meta WHERE key = 'chunk_ids'), 0),"
            " coalesce((SELECT max(id) FROM chunks), 0))"
        ).fetchone()[0]

    def add_words(self, conn: sqlite3.Connection, after: int, handed_out: int) -> None:
        """The chunks inserted since `last_chunk_id` said `after` (with ids up to `after`
        + `handed_out`) join the full-text index, and wait for their vectors (when
        vectors are stored)."""
        self.set_meta(conn, "chunk_ids", after + handed_out)
        conn.execute(
            "INSERT INTO chunks_fts(rowid, text) SELECT id, text FROM chunks WHERE id > ?",
            (after,),
        )
        if self.stores_vectors:
            conn.execute(
                "INSERT OR IGNORE INTO pending_vectors (chunk_id)"
                " SELECT id FROM chunks WHERE id > ?",
                (after,),
            )

    def delete_chunks(
        self, conn: sqlite3.Connection, where: str, params: Sequence[object] = ()
    ) -> int:
        """Their tags, sources and vectors go by trigger; their words first leave the
        full-text index in one statement."""
        conn.execute(
            "INSERT INTO chunks_fts(chunks_fts, rowid, text)"
            f" SELECT 'delete', id, text FROM chunks WHERE {where}",
            params,
        )
        return conn.execute(f"DELETE FROM chunks WHERE {where}", params).rowcount

    def start_transcripts(self, conn: sqlite3.Connection) -> bool:
        last, _applied, rebuild = self._log_state(conn, "fts_log", "message_seq")
        if rebuild:
            self.set_meta(conn, "message_seq", last)
        return rebuild

    def message_ids_after(self, conn: sqlite3.Connection, after: int, limit: int) -> list[int]:
        return [
            row[0]
            for row in conn.execute(
                "SELECT id FROM st.messages WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
            )
        ]

    def message_log_page(self, conn: sqlite3.Connection) -> LogPage:
        last = conn.execute(
            "SELECT coalesce((SELECT seq FROM st.sqlite_sequence WHERE name = 'fts_log'), 0)"
        ).fetchone()[0]
        applied = self.meta(conn, "message_seq")
        assert isinstance(applied, int)
        hi = min(last, applied + MESSAGE_PAGE)
        ids: list[int] = []
        if hi > applied:
            ids = [
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT id FROM st.fts_log WHERE seq > ? AND seq <= ?", (applied, hi)
                )
            ]
            self.set_meta(conn, "message_seq", hi)
        return LogPage(ids, hi, hi < last)

    def stop_transcripts(self, conn: sqlite3.Connection) -> bool:
        if self.meta(conn, "message_seq") is None:
            return False
        self.set_meta(conn, "message_seq", None)
        return True

    def trim_unfollowed_log(self, conn: sqlite3.Connection) -> tuple[int, bool]:
        """Nothing here: state.db trims its log behind its readers, and we left them."""
        return 0, False

    def unlink(self, conn: sqlite3.Connection, message_ids: list[int]) -> list[tuple[int, int]]:
        return conn.execute(_UNLINK, (codec.dumps(message_ids),)).fetchall()

    def indexable_messages(
        self, conn: sqlite3.Connection, message_ids: list[int]
    ) -> list[tuple[int, str, str, float]]:
        return conn.execute(_MESSAGES, (codec.dumps(message_ids),)).fetchall()

    def add_transcript_chunks(
        self, conn: sqlite3.Connection, chunks: list[TranscriptChunk], links: list[ChunkLink]
    ) -> None:
        before = self.last_chunk_id(conn)
        conn.execute(_UPSERT_CHUNKS, (before + 1, codec.dumps(chunks)))
        self.add_words(conn, before, len(chunks))
        conn.execute(_LINK, (codec.dumps(links),))

    def delete_orphans(self, conn: sqlite3.Connection, chunk_ids: list[int]) -> int:
        return self.delete_chunks(conn, _ORPHANS, (codec.dumps(chunk_ids),))

    def note_purged(self, conn: sqlite3.Connection, message_ids: list[int]) -> None:
        """Purged from state.db: their words leave the index too, after the round
        (`forget_words`)."""
        gone = conn.execute(
            "SELECT 1 FROM json_each(?) j WHERE NOT EXISTS"
            " (SELECT 1 FROM st.messages m WHERE m.id = j.value) LIMIT 1",
            (codec.dumps(message_ids),),
        ).fetchone()
        if gone:
            self.set_meta(conn, "purged", 1)

    def take_purged(self, conn: sqlite3.Connection) -> bool:
        purged = self.meta(conn, "purged")
        self.set_meta(conn, "purged", None)
        return bool(purged)

    def forget_words(self, conn: sqlite3.Connection) -> None:
        """Merge the full-text index into one segment: FTS5 keeps a deleted row's words
        in its segments until they are merged (this SQLite predates 'secure-delete').
        Run after messages were purged (a session deleted) and after forgetting a user;
        a note's delete or update leaves its old words to the next automatic merge."""
        conn.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('optimize')")

    def origins(
        self, conn: sqlite3.Connection, session_ids: list[str]
    ) -> Iterable[tuple[str, str, Any]]:
        return conn.execute(
            "SELECT session_id, session_key, origin FROM st.sessions"
            " WHERE session_id IN (SELECT value FROM json_each(?))",
            (codec.dumps(session_ids),),
        )

    def requeue_missing(self, conn: sqlite3.Connection, model_id: str) -> int:
        if not self.stores_vectors:  # derived from now on: the stored ones go
            conn.execute("DELETE FROM pending_vectors")
            conn.execute("DELETE FROM vectors")
            return 0
        return conn.execute(
            "INSERT OR IGNORE INTO pending_vectors (chunk_id)"
            " SELECT id FROM chunks WHERE id NOT IN"
            " (SELECT chunk_id FROM vectors WHERE model = ?)",
            (model_id,),
        ).rowcount

    def pending_chunks(
        self, conn: sqlite3.Connection, limit: int, namespace: str | None = None
    ) -> list[tuple[int, str]]:
        # CROSS JOIN: from the (mostly empty) queue to its chunks, never the other way.
        sql = "SELECT c.id, c.text FROM pending_vectors p CROSS JOIN chunks c ON c.id = p.chunk_id"
        if namespace is None:
            return conn.execute(f"{sql} ORDER BY p.chunk_id LIMIT ?", (limit,)).fetchall()
        return conn.execute(
            f"{sql} WHERE c.namespace = ? ORDER BY p.chunk_id LIMIT ?",
            (namespace, limit),
        ).fetchall()

    def put_vectors(
        self, conn: sqlite3.Connection, chunk_ids: list[int], data: np.ndarray, model_id: str
    ) -> None:
        """An old vector is deleted first, which `vector_deletes` counts. Each is stored
        in its smaller form (gateway.memory.vector_blob)."""
        blobs = encode_rows(data)
        ids = codec.dumps(chunk_ids)
        conn.execute(
            "DELETE FROM vectors WHERE chunk_id IN (SELECT value FROM json_each(?))", (ids,)
        )
        # The namespaces in one statement, then plain VALUES rows: a look-up of the chunk
        # inside every row's INSERT cost more than the whole statement below.
        namespace_of = dict(
            conn.execute(
                "SELECT id, namespace FROM chunks WHERE id IN (SELECT value FROM json_each(?))",
                (ids,),
            ).fetchall()
        )
        conn.executemany(
            "INSERT INTO vectors (chunk_id, namespace, model, vec) VALUES (?, ?, ?, ?)",
            [
                (chunk_id, namespace_of[chunk_id], model_id, blob)
                for blob, chunk_id in zip(blobs, chunk_ids, strict=True)
                if chunk_id in namespace_of  # gone meanwhile: no vector
            ],
        )
        conn.execute(
            "DELETE FROM pending_vectors WHERE chunk_id IN (SELECT value FROM json_each(?))",
            (ids,),
        )

    def namespaces_ending(self, conn: sqlite3.Connection, suffix: str) -> list[str]:
        return [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT namespace FROM chunks WHERE substr(namespace, -?) = ?",
                (len(suffix), suffix),
            )
        ]


SQLITE_INDEX = SqliteIndexSql()
INDEX = MemoryIndex(SQLITE_INDEX)
DERIVED_INDEX = MemoryIndex(SqliteIndexSql(stores_vectors=False))  # the hash embedder's
