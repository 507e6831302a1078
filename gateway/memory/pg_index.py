"""The memory index in a PostgreSQL store: memory.db's tables as `memory_*` tables of the
store's own database (gateway.store.pg.schema), so every replica shares one index; the
SQL of the indexer (`PgIndexSql`, for gateway.memory.index) and of recall
(`PgRecallSql`, for gateway.memory.retrieval) on this engine.

What is shared with SQLite (written once, in gateway.memory.index and .retrieval): a
round's shape, chunking, the namespace of a transcript, embeddings, the vector cache,
scoring, normalization and merging. What differs is SQL and transactions:

- The log is consumed, not followed by number. On SQLite one writer hands out the log's
  sequence numbers in commit order, so "everything up to N" is a fact. On PostgreSQL
  several replicas' writers commit concurrently: seq 41 may commit after seq 42 was
  read, and an indexer that stored "applied 42" would never see 41. Here a round
  deletes the log entries it applies (`DELETE ... RETURNING`) in the transaction that
  indexes them: an entry not yet committed is not visible, stays in the log, and is
  taken by a later round. So the memory indexer also keeps `fts_log` trimmed on
  PostgreSQL (there is no search indexer there: transcript search is a GIN index on
  `messages`), and with transcripts off it empties the log each round. `log_readers`
  still gets our row ('memory': the highest entry taken), for `doctor` and operators.
- One round at a time across all replicas: a round first takes a transaction advisory
  lock. The background loop only tries it (`pg_try_advisory_xact_lock`; another replica
  indexes meanwhile, this one skips the round); a search or a note save waits for it,
  so it sees its own writes. Vector writes and forgetting take the same lock: vectors
  then commit in the order of their `seq`, which the vector cache relies on.
- Rebuild: the index lives in the same database as the logs, so it cannot fall out of
  step with them by a restore of one file; it is built when `memory_meta` lacks
  'notes_built' / 'transcripts_built' (a new store, `storage migrate`, transcripts
  turned back on).
- Deleted chunks leave at once (their rows and index entries are dead at commit; VACUUM
  reclaims the space). Nothing like FTS5's 'optimize' is needed.

Connections: the indexer's own psycopg connection in autocommit mode, transactions by
`conn.transaction()`; every query names its namespace.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg
import structlog

from gateway.memory.index import (
    INDEXED_ROLES,
    LOG_READER,
    MESSAGE_PAGE,
    NOTE_PAGE,
    ChunkLink,
    LogPage,
    MemoryIndex,
    TranscriptChunk,
)
from gateway.memory.retrieval import CANDIDATES, MAX_POSTINGS, Recent
from gateway.store.pg.db import connect as connect_store
from gateway.util.pg_scope import LOCK_KEY_SQL

log = structlog.get_logger("gateway.memory.pg_index")

# pg_advisory_xact_lock's key for memory index writes: a fixed bigint no other code uses
# ("hermesmi" in ASCII), scoped to the store's schema (gateway.util.pg_scope).
LOCK_KEY = 0x6865726D65736D69
LOG_TRIM_PAGE = 20_000  # fts_log entries dropped per round while transcripts are off


def connect(dsn: str) -> psycopg.Connection[Any]:
    """The indexer's connection (autocommit; the store's error mapping on connect).

    Every statement planned with its values (`force_custom_plan`): psycopg prepares a
    statement run 5 times, and a generic plan of a word count cannot tell a rare word
    (the GIN index) from a common one (a sequential scan)."""
    conn = connect_store(dsn).raw
    conn.execute("SET plan_cache_mode = force_custom_plan")
    return conn


def vector_path(conn: psycopg.Connection[Any]) -> str:
    """How vectors are stored and scored here, said once at start. pgvector is only
    detected: the vectors are float32 bytes scored with numpy either way (exact, and the
    same code as on SQLite)."""
    found = conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'").fetchone()
    if found:
        return "bytea+numpy (pgvector is installed, not used yet)"
    return "bytea+numpy (no pgvector)"


# --- recall ----------------------------------------------------------------------------


class PgRecallSql:
    """`gateway.memory.retrieval.RecallSql` on the `memory_*` tables.

    The text score: PostgreSQL has no bm25. Each kept word (the rarest, as on SQLite)
    contributes ts_rank_cd(words, word, 1) (its occurrences, divided by 1 + log of the
    chunk's length) times its IDF, ln(1 + (N - n + 0.5) / (n + 0.5)) with n the chunks
    holding the word and N the table's estimated size: like bm25, more and rarer words
    rank first and long chunks are damped; unlike bm25, term frequency does not saturate
    and N is the planner's estimate. Only the resulting order enters the fusion, as on
    SQLite (gateway.memory.retrieval.fused).
    """

    def vector_deletes(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute("SELECT value FROM memory_meta WHERE key = 'vector_deletes'").fetchone()
        return int(row[0]) if row else 0

    def vectors_held(
        self, conn: psycopg.Connection[Any], namespace: str, model: str, max_seq: int
    ) -> int:
        row = conn.execute(
            "SELECT count(*) FROM memory_vectors WHERE namespace = %s AND model = %s AND seq <= %s",
            (namespace, model, max_seq),
        ).fetchone()
        return int(row[0]) if row else 0

    def vectors_after(
        self, conn: psycopg.Connection[Any], namespace: str, model: str, seq: int
    ) -> list[tuple[int, int, bytes]]:
        return conn.execute(
            "SELECT seq, chunk_id, vec FROM memory_vectors WHERE namespace = %s AND model = %s"
            " AND seq > %s ORDER BY seq",
            (namespace, model, seq),
        ).fetchall()

    def postings(self, conn: psycopg.Connection[Any], words: list[str]) -> dict[str, int]:
        """Chunks holding each word, counted up to MAX_POSTINGS + 1 (one round trip).

        A word ANALYZE found common (pg_stats' most_common_elems, times the table's
        estimated rows, above MAX_POSTINGS) is not counted at all: with statistics the
        planner counts a common word by a sequential scan, far slower than through the
        GIN index. The rest are rare by those same
        statistics, and counted through the index."""
        common = self._common_words(conn)
        known = {word: MAX_POSTINGS + 1 for word in words if word in common}
        rest = [word for word in words if word not in known]
        if rest:
            # A subquery per word, its word a parameter of its own: planned with the
            # word's value (a word of unnest() would be planned as any word).
            count = (
                "(SELECT count(*) FROM (SELECT 1 FROM memory_chunks"
                " WHERE words @@ plainto_tsquery('simple', %s) LIMIT %s) s)"
            )
            row = conn.execute(
                "SELECT " + ", ".join(count for _ in rest),
                [value for word in rest for value in (word, MAX_POSTINGS + 1)],
            ).fetchone()
            assert row is not None
            known.update((word, int(found)) for word, found in zip(rest, row, strict=True))
        return known

    def chunks_at_most(self, conn: psycopg.Connection[Any]) -> int:
        """The largest chunk id: no fewer than the chunks there are (an index's end)."""
        row = conn.execute("SELECT coalesce(max(id), 0) FROM memory_chunks").fetchone()
        return int(row[0]) if row else 0

    _common: tuple[float, frozenset[str]] = (0.0, frozenset())
    COMMON_TTL = 60.0  # seconds the common words are reused (ANALYZE runs seldom)

    def _common_words(self, conn: psycopg.Connection[Any]) -> frozenset[str]:
        """The words ANALYZE saw in more than MAX_POSTINGS chunks (none before it ran)."""
        at, words = self._common
        if time.monotonic() - at < self.COMMON_TTL:
            return words
        row = conn.execute(
            "SELECT s.most_common_elems::text::text[], s.most_common_elem_freqs,"
            " greatest(c.reltuples, 0) FROM pg_stats s JOIN pg_class c"
            " ON c.oid = 'memory_chunks'::regclass"
            " WHERE s.schemaname = current_schema() AND s.tablename = 'memory_chunks'"
            " AND s.attname = 'words'"
        ).fetchone()
        found: frozenset[str] = frozenset()
        if row and row[0] and row[1]:
            elems, freqs, total = row
            found = frozenset(
                elem
                for elem, freq in zip(elems, freqs, strict=False)
                if freq * total > MAX_POSTINGS
            )
        self._common = (time.monotonic(), found)
        return found

    def ranked(
        self,
        conn: psycopg.Connection[Any],
        namespace: str,
        words: list[str],
        held: dict[str, int],
        tags: tuple[str, ...],
    ) -> dict[int, float]:
        words = [word for word in words if held.get(word)]  # no chunk holds the others
        if not words:
            return {}
        row = conn.execute(
            "SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = 'memory_chunks'::regclass"
        ).fetchone()
        total = max(float(row[0]) if row else 0.0, float(max(held[w] for w in words)))
        idf = [math.log(1 + (total - held[w] + 0.5) / (held[w] + 0.5)) for w in words]
        where, params = _tag_filter(tags)
        word_query = "plainto_tsquery('simple', %s)"
        score = " + ".join(f"%s * ts_rank_cd(c.words, {word_query}, 1)" for _ in words)
        # The words' chunks first, through the GIN index (the kept words are held by at
        # most about MAX_POSTINGS chunks in all), then the namespace: left to itself, the
        # planner may walk the whole namespace instead, testing each chunk's words.
        rows = conn.execute(
            "WITH m AS MATERIALIZED (SELECT id, namespace, words FROM memory_chunks"
            f" WHERE words @@ ({' || '.join(word_query for _ in words)}))"
            f" SELECT c.id, {score} AS score FROM m c"
            f" WHERE c.namespace = %s{where} ORDER BY score DESC, c.id LIMIT %s",
            (
                *words,
                *[value for pair in zip(idf, words, strict=True) for value in pair],
                namespace,
                *params,
                CANDIDATES,
            ),
        ).fetchall()
        return {chunk_id: float(score) for chunk_id, score in rows}

    def tagged(
        self, conn: psycopg.Connection[Any], namespace: str, tags: tuple[str, ...]
    ) -> list[int]:
        where, params = _tag_filter(tags)
        found = conn.execute(
            f"SELECT c.id FROM memory_chunks c WHERE c.namespace = %s{where}",
            (namespace, *params),
        )
        return [row[0] for row in found]

    def rows(
        self, conn: psycopg.Connection[Any], chunk_ids: list[int], exclude: Recent | None = None
    ) -> list[tuple[Any, ...]]:
        """The chunks still alive (gateway.memory.retrieval._rows)."""
        if not chunk_ids:
            return []
        session_id, first = (exclude.session_id, exclude.first) if exclude else ("", 0)
        return conn.execute(
            "SELECT c.id, c.kind, c.note_id, c.session_id,"
            " CASE WHEN c.kind = 'note' THEN n.content ELSE c.text END, n.tags,"
            " coalesce(n.created_at, c.created_at), coalesce(n.updated_at, c.updated_at)"
            " FROM memory_chunks c LEFT JOIN notes n ON n.note_id = c.note_id"
            " WHERE c.id = ANY(%s) AND CASE WHEN c.kind = 'note' THEN n.note_id IS NOT NULL"
            # uncorrelated, on the candidates only: the planner hashed the correlated
            # EXISTS over every source and message
            " ELSE c.id IN (SELECT s.chunk_id FROM memory_chunk_sources s"
            "   JOIN messages m ON m.id = s.message_id"
            "   WHERE s.chunk_id = ANY(%s) AND m.active = 1"
            "   AND (m.session_id <> %s OR m.id < %s)) END",
            (chunk_ids, chunk_ids, session_id, first),
        ).fetchall()


def _tag_filter(tags: tuple[str, ...]) -> tuple[str, list[Any]]:
    if not tags:
        return "", []
    return (
        " AND c.id IN (SELECT chunk_id FROM memory_chunk_tags WHERE tag = ANY(%s)"
        " GROUP BY chunk_id HAVING count(*) = %s)",
        [list(tags), len(tags)],
    )


# --- the indexer's SQL -----------------------------------------------------------------

_MESSAGES = (
    "SELECT m.id, m.session_id, m.content, m.created_at FROM messages m"
    " WHERE m.id = ANY(%s) AND m.active = 1 AND m.role IN ({})".format(
        ", ".join(f"'{role}'" for role in INDEXED_ROLES)
    )
)
_UPSERT_CHUNKS = (
    "INSERT INTO memory_chunks (namespace, kind, session_id, hash, text, created_at, updated_at)"
    " SELECT ns, 'transcript', sid, h, t, ts, ts"
    " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::float8[])"
    " AS j(ns, sid, h, t, ts)"
    " ON CONFLICT (session_id, hash) WHERE session_id IS NOT NULL"
    # the same text again in its session: one chunk, as recent as its latest message
    " DO UPDATE SET updated_at = greatest(memory_chunks.updated_at, EXCLUDED.updated_at)"
)
_LINK = (
    "INSERT INTO memory_chunk_sources (message_id, chunk_id)"
    " SELECT j.mid, c.id FROM unnest(%s::bigint[], %s::text[], %s::text[]) AS j(mid, sid, h)"
    " JOIN memory_chunks c ON c.session_id = j.sid AND c.hash = j.h ON CONFLICT DO NOTHING"
)


class PgIndexSql(PgRecallSql):
    """`IndexSql` (and `RecallSql`) on the store's `memory_*` tables. Every vector is
    stored (pgvector scores them in the server when it is there)."""

    mark = "%s"
    stores_vectors = True

    @contextmanager
    def round(self, conn: psycopg.Connection[Any], wait: bool) -> Iterator[bool]:
        """A transaction holding the index's advisory lock; without `wait`, it yields
        False at once when another replica's round holds it."""
        with conn.transaction():
            yield self._lock(conn, wait)

    @contextmanager
    def writing(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Under the same lock as the rounds: vectors commit in the order of `seq`."""
        with conn.transaction():
            self._lock(conn, wait=True)
            yield

    def _lock(self, conn: psycopg.Connection[Any], wait: bool) -> bool:
        take = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
        row = conn.execute(f"SELECT {take}({LOCK_KEY_SQL})", {"key": LOCK_KEY}).fetchone()
        return wait or bool(row and row[0])  # the waiting form returns once it holds the lock

    def meta(self, conn: psycopg.Connection[Any], key: str) -> str | None:
        row = conn.execute("SELECT value FROM memory_meta WHERE key = %s", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, conn: psycopg.Connection[Any], key: str, value: object) -> None:
        if value is None:
            conn.execute("DELETE FROM memory_meta WHERE key = %s", (key,))
        else:
            conn.execute(
                "INSERT INTO memory_meta (key, value) VALUES (%s, %s)"
                " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                (key, str(value)),
            )

    def _take(
        self, conn: psycopg.Connection[Any], table: str, column: str, limit: int
    ) -> list[Any]:
        """The oldest `limit` visible entries of a log, deleted: (seq, id) each."""
        return conn.execute(
            f"DELETE FROM {table} WHERE seq IN (SELECT seq FROM {table} ORDER BY seq LIMIT %s)"
            f" RETURNING seq, {column}",
            (limit,),
        ).fetchall()

    def notes_to_apply(self, conn: psycopg.Connection[Any]) -> tuple[LogPage, bool]:
        if self.meta(conn, "notes_built") is None:
            conn.execute("DELETE FROM note_log")  # what it names is read whole below
            ids = [row[0] for row in conn.execute("SELECT note_id FROM notes")]
            self.set_meta(conn, "notes_built", 1)
            return LogPage(ids, 0, False), True
        taken = self._take(conn, "note_log", "note_id", NOTE_PAGE)
        ids = list(dict.fromkeys(row[1] for row in taken))
        seq = max((row[0] for row in taken), default=0)
        return LogPage(ids, seq, len(taken) == NOTE_PAGE), False

    def note(
        self, conn: psycopg.Connection[Any], note_id: str
    ) -> tuple[str, str, str, float, float] | None:
        return conn.execute(
            "SELECT namespace, content, tags, created_at, updated_at FROM notes WHERE note_id = %s",
            (note_id,),
        ).fetchone()

    def add_note_chunks(
        self,
        conn: psycopg.Connection[Any],
        namespace: str,
        note_id: str,
        chunks: list[tuple[str, str]],
        created: float,
        updated: float,
        tags: list[str],
    ) -> None:
        for digest, text in chunks:
            chunk = conn.execute(
                "INSERT INTO memory_chunks (namespace, kind, note_id, hash, text, created_at,"
                " updated_at) VALUES (%s, 'note', %s, %s, %s, %s, %s) RETURNING id",
                (namespace, note_id, digest, text, created, updated),
            ).fetchone()
            assert chunk is not None
            if tags:
                conn.execute(
                    "INSERT INTO memory_chunk_tags (tag, chunk_id)"
                    " SELECT DISTINCT unnest(%s::text[]), %s ON CONFLICT DO NOTHING",
                    (tags, chunk[0]),
                )

    def delete_chunks(
        self, conn: psycopg.Connection[Any], where: str, params: Sequence[object] = ()
    ) -> int:
        """Their tags, sources, vectors and queue entries go by cascade, their words
        with the row."""
        return conn.execute(f"DELETE FROM memory_chunks WHERE {where}", params).rowcount

    def start_transcripts(self, conn: psycopg.Connection[Any]) -> bool:
        if self.meta(conn, "transcripts_built") is not None:
            return False
        # Every message visible now is read by the rebuild's pages; one committed later
        # (or not yet visible) keeps its log entry for a later round.
        cleared = conn.execute(
            "WITH gone AS (DELETE FROM fts_log RETURNING seq) SELECT max(seq) FROM gone"
        ).fetchone()
        self._report_taken(conn, cleared[0] if cleared else None)
        self.set_meta(conn, "transcripts_built", 1)
        return True

    def message_ids_after(self, conn: psycopg.Connection[Any], after: int, limit: int) -> list[int]:
        return [
            row[0]
            for row in conn.execute(
                "SELECT id FROM messages WHERE id > %s ORDER BY id LIMIT %s", (after, limit)
            )
        ]

    def message_log_page(self, conn: psycopg.Connection[Any]) -> LogPage:
        taken = self._take(conn, "fts_log", "id", MESSAGE_PAGE)
        hi = max((row[0] for row in taken), default=None)
        self._report_taken(conn, hi)
        return LogPage([row[1] for row in taken], hi, len(taken) == MESSAGE_PAGE)

    def _report_taken(self, conn: psycopg.Connection[Any], hi: int | None) -> None:
        """Our row in `log_readers`: the highest fts_log entry taken so far."""
        if hi is not None:
            conn.execute(
                "INSERT INTO log_readers (name, applied) VALUES (%s, %s) ON CONFLICT (name)"
                " DO UPDATE SET applied = greatest(log_readers.applied, EXCLUDED.applied)",
                (LOG_READER, hi),
            )

    def stop_transcripts(self, conn: psycopg.Connection[Any]) -> bool:
        if self.meta(conn, "transcripts_built") is None:
            return False
        self.set_meta(conn, "transcripts_built", None)
        conn.execute("DELETE FROM log_readers WHERE name = %s", (LOG_READER,))
        return True

    def trim_unfollowed_log(self, conn: psycopg.Connection[Any]) -> tuple[int, bool]:
        """Nobody reads `fts_log` (there is no search indexer here): its entries are
        dropped, a page a round; the next start with transcripts on rebuilds them."""
        dropped = len(self._take(conn, "fts_log", "id", LOG_TRIM_PAGE))
        return dropped, dropped == LOG_TRIM_PAGE

    def unlink(
        self, conn: psycopg.Connection[Any], message_ids: list[int]
    ) -> list[tuple[int, int]]:
        return conn.execute(
            "DELETE FROM memory_chunk_sources WHERE message_id = ANY(%s)"
            " RETURNING message_id, chunk_id",
            (message_ids,),
        ).fetchall()

    def indexable_messages(
        self, conn: psycopg.Connection[Any], message_ids: list[int]
    ) -> list[tuple[int, str, str, float]]:
        return conn.execute(_MESSAGES, (message_ids,)).fetchall()

    def add_transcript_chunks(
        self, conn: psycopg.Connection[Any], chunks: list[TranscriptChunk], links: list[ChunkLink]
    ) -> None:
        # One row per (session, hash), the latest: an upsert may not touch a row twice
        # in a statement.
        unique: dict[tuple[str, str], tuple[str, str, float]] = {}
        for namespace, session_id, digest, text, created in chunks:
            seen = unique.get((session_id, digest))
            if seen is None or seen[2] < created:
                unique[(session_id, digest)] = (namespace, text, created)
        keys = list(unique)
        conn.execute(
            _UPSERT_CHUNKS,
            (
                [unique[key][0] for key in keys],
                [key[0] for key in keys],
                [key[1] for key in keys],
                [unique[key][1] for key in keys],
                [unique[key][2] for key in keys],
            ),
        )
        conn.execute(
            _LINK,
            ([link[0] for link in links], [link[1] for link in links], [link[2] for link in links]),
        )

    def delete_orphans(self, conn: psycopg.Connection[Any], chunk_ids: list[int]) -> int:
        return self.delete_chunks(
            conn,
            "id = ANY(%s) AND kind = 'transcript' AND NOT EXISTS"
            " (SELECT 1 FROM memory_chunk_sources s WHERE s.chunk_id = memory_chunks.id)",
            (chunk_ids,),
        )

    def note_purged(self, conn: psycopg.Connection[Any], message_ids: list[int]) -> None:
        """Nothing to remember: a deleted row's words are gone with it at commit."""

    def take_purged(self, conn: psycopg.Connection[Any]) -> bool:
        return False

    def forget_words(self, conn: psycopg.Connection[Any]) -> None:
        """Nothing like FTS5's 'optimize' is needed (the module docstring)."""

    def origins(
        self, conn: psycopg.Connection[Any], session_ids: list[str]
    ) -> list[tuple[str, str, str | None]]:
        return conn.execute(
            "SELECT session_id, session_key, origin FROM sessions WHERE session_id = ANY(%s)",
            (session_ids,),
        ).fetchall()

    def requeue_missing(self, conn: psycopg.Connection[Any], model_id: str) -> int:
        return conn.execute(
            "INSERT INTO memory_pending_vectors (chunk_id)"
            " SELECT id FROM memory_chunks c WHERE NOT EXISTS"
            " (SELECT 1 FROM memory_vectors v WHERE v.chunk_id = c.id AND v.model = %s)"
            " ON CONFLICT DO NOTHING",
            (model_id,),
        ).rowcount

    def pending_chunks(
        self, conn: psycopg.Connection[Any], limit: int, namespace: str | None = None
    ) -> list[tuple[int, str]]:
        sql = (
            "SELECT c.id, c.text FROM memory_pending_vectors p"
            " JOIN memory_chunks c ON c.id = p.chunk_id"
        )
        if namespace is None:
            return conn.execute(f"{sql} ORDER BY p.chunk_id LIMIT %s", (limit,)).fetchall()
        return conn.execute(
            f"{sql} WHERE c.namespace = %s ORDER BY p.chunk_id LIMIT %s", (namespace, limit)
        ).fetchall()

    def put_vectors(
        self, conn: psycopg.Connection[Any], chunk_ids: list[int], data: np.ndarray, model_id: str
    ) -> None:
        conn.execute("DELETE FROM memory_vectors WHERE chunk_id = ANY(%s)", (chunk_ids,))
        conn.execute(
            "INSERT INTO memory_vectors (chunk_id, namespace, model, vec)"
            " SELECT c.id, c.namespace, %s, j.vec"
            " FROM unnest(%s::bigint[], %s::bytea[]) WITH ORDINALITY AS j(id, vec, n)"
            " JOIN memory_chunks c ON c.id = j.id ORDER BY j.n",
            (model_id, chunk_ids, [row.tobytes() for row in data]),
        )
        conn.execute("DELETE FROM memory_pending_vectors WHERE chunk_id = ANY(%s)", (chunk_ids,))

    def namespaces_ending(self, conn: psycopg.Connection[Any], suffix: str) -> list[str]:
        return [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT namespace FROM memory_chunks WHERE right(namespace, %s) = %s",
                (len(suffix), suffix),
            )
        ]


PG = PgIndexSql()
INDEX = MemoryIndex(PG)
