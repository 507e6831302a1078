"""Hybrid recall over memory.db (seed 002): full text (FTS5, bm25) and vectors, fused.

Only the asking namespace is scored. Each signal keeps its best CANDIDATES and ranks
them; the two rankings are fused by weighted reciprocal rank (RRF): a chunk scores
`vector_weight / (RRF_K + its vector rank) + text_weight / (RRF_K + its text rank)`
(0.7 and 0.3 by default; a chunk missing from one signal's candidates scores 0 there),
scaled so that first in both is 1. Ranks, not raw scores: min-max scaling lifted the
best text match to full weight however little it matched (a question sharing only "my"
and "is" with a note), and put it above the vector's own first. With RRF_K 0 and the
vector weighing at least twice the text, the vector's first stays first (see RRF_K).
Equal scores go to the more recently updated. Tag filters are SQL (`chunk_tags`), for both signals.

The text signal ranks by the query's rare words only (`kept_words`): a word held by
more than half the index's chunks (bm25's IDF is 0 or below there: "the", "my") is
dropped unless it is the query's rarest, so a match on such words alone is no text
candidate when the query has a rarer word.

The vector math is numpy: one matrix-vector product over the namespace's vectors
(exact cosine: vectors and query are unit length), held in memory per namespace
(`gateway.memory.vector_cache`: stored vectors, or under the hash embedder on SQLite
vectors computed from the chunks' texts, none stored).
Against the alternatives (BENCHMARKS.md): usearch exact is no faster; usearch HNSW is
faster per query but takes minutes to build and answers approximately; sqlite-vec cannot
be loaded by this Python's sqlite3. Exact numpy is always right and needs no second
index kept in step with memory.db. The matrix is held dimension-major, so a sparse query
(a hash embedding of a few words) multiplies only its own dimensions' rows: the same
exact scores for a fraction of the work.

A transcript chunk is shown only while a message it came from is still in state.db and
active (an /undo takes a message back without a log entry); a note's text, tags and
times are read from state.db's `notes`, the data of record.

Two backends, one algorithm: the choice of words, the vector cache, the numpy scoring,
ranking and fusion are written once here; what differs is only SQL, behind `RecallSql`
(`SQLITE` below for memory.db, `gateway.memory.pg_index.PG` for the index in a
PostgreSQL store). PostgreSQL has no bm25, so its text score is ts_rank_cd per kept
word weighted by the word's IDF (see `PgRecallSql`); only the text ranking enters the
fusion, so the two backends differ at most in the order of the text candidates.
"""

from __future__ import annotations

import re
import sqlite3
import unicodedata
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gateway.memory.vector_cache import VectorCache, VectorSql
from gateway.store import codec

CANDIDATES = 64  # per signal, before the fusion
# Reciprocal rank fusion's constant, k in weight / (k + rank). The common 60 flattens
# the ranks' weights so far that the text's first (often one shared everyday word, on
# questions asked in other words) outweighed the vector's own order: on the paraphrase
# set (BENCHMARKS.md, "Recall quality") fused found 4 of 12 first where the vector alone
# found 11. At 0, with the default weights, the vector's first (0.7 / 1) outweighs its
# second plus the text's first (0.7 / 2 + 0.3 / 1): the text signal reorders the rest of
# the list, and decides alone when the vector has no candidate.
RRF_K = 0
MAX_POSTINGS = 1_000  # chunks a text search may rank (see kept_words)
COMMON_FLOOR = 5  # a word held by at most this many chunks is never "common"
MAX_QUERY_WORDS = 64  # a query's first distinct words the text side looks at (one count each)
_WORD = re.compile(r"\w+")
_MATH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recall-math")


@dataclass(frozen=True, slots=True)
class Recent:
    """Transcript rows a search leaves out: those of `session_id` from row `first` on (a
    turn's own messages and its session's newest before them). A chunk is shown while a
    message of its own outside them is still there."""

    session_id: str
    first: int


class RecallSql(VectorSql, Protocol):
    """The SQL a recall needs, per backend (the module docstring), with the stored
    vectors' (`VectorSql`)."""

    def postings(self, conn: Any, words: list[str]) -> dict[str, int]: ...

    def chunks_at_most(self, conn: Any) -> int: ...

    def ranked(
        self,
        conn: Any,
        namespace: str,
        words: list[str],
        held: dict[str, int],
        tags: tuple[str, ...],
    ) -> dict[int, float]: ...

    def tagged(self, conn: Any, namespace: str, tags: tuple[str, ...]) -> list[int]: ...

    def rows(
        self, conn: Any, chunk_ids: list[int], exclude: Recent | None = None
    ) -> list[tuple[Any, ...]]: ...


@dataclass(frozen=True, slots=True)
class Scored:
    chunk_id: int
    kind: str  # note | transcript
    note_id: str | None
    session_id: str | None
    text: str
    tags: tuple[str, ...]
    score: float
    created_at: float
    updated_at: float


def query_words(text: str) -> list[str]:
    """The query's words as the index's tokenizer (unicode61) sees them, once each."""
    return list(dict.fromkeys(_WORD.findall(unicodedata.normalize("NFKC", text).casefold())))


def kept_words(conn: Any, text: str, sql: RecallSql) -> tuple[list[str], dict[str, int]]:
    """The words worth ranking by, rarest first, and how many chunks hold each word
    (counted up to MAX_POSTINGS + 1). None kept: no word, or only words too common to
    say anything.

    bm25 scores every chunk that holds any of the words, and a word found in a large
    share of the index ("the", "is") costs the most and weighs the least (its IDF is
    near 0). So the rarest words are kept while the chunks holding them add up to at
    most MAX_POSTINGS, the rarest one always, unless it alone is held by more; and,
    besides the rarest, no word held by more than half the index's chunks (its bm25
    IDF is 0 or below: a stopword of this index, whatever the language) once more than
    COMMON_FLOOR hold it (in a handful of chunks, a shared word is still a match). The
    rarest is kept even then: a query of that one word ("herons", in every note) still
    finds every chunk holding it. Only the first MAX_QUERY_WORDS
    distinct words count (each costs a look-up; the query's vector is made from all of
    it)."""
    words = query_words(text)[:MAX_QUERY_WORDS]
    if not words:
        return [], {}
    held = sql.postings(conn, words)
    # An upper bound of the index's size (deleted chunks may still count): a word is
    # only ever kept for it, never dropped.
    common = max(sql.chunks_at_most(conn) / 2, COMMON_FLOOR)
    kept, total = [], 0
    for word in sorted(words, key=held.__getitem__):
        total += held[word]
        if total > MAX_POSTINGS or (kept and held[word] > common):
            break
        kept.append(word)
    return kept, held


def _phrase(word: str) -> str:
    return '"' + word.replace('"', '""') + '"'


def _postings(conn: sqlite3.Connection, word: str) -> int:
    """How many chunks hold `word`, counted up to MAX_POSTINGS + 1 only: walking a common
    word's whole posting list (as fts5vocab's `doc` does) costs time in proportion to
    the index; stopping there is bounded, and says the same ("too many")."""
    return conn.execute(
        "SELECT count(*) FROM (SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH ? LIMIT ?)",
        (_phrase(word), MAX_POSTINGS + 1),
    ).fetchone()[0]


def _tag_filter(tags: tuple[str, ...]) -> tuple[str, list[Any]]:
    if not tags:
        return "", []
    marks = ", ".join("?" * len(tags))
    return (
        f" AND c.id IN (SELECT chunk_id FROM chunk_tags WHERE tag IN ({marks})"
        " GROUP BY chunk_id HAVING count(*) = ?)",
        [*tags, len(tags)],
    )


def text_scores(
    conn: Any, namespace: str, query: str, tags: tuple[str, ...], sql: RecallSql | None = None
) -> dict[int, float]:
    sql = sql or SQLITE
    kept, held = kept_words(conn, query, sql)
    if not kept:
        return {}
    return sql.ranked(conn, namespace, kept, held, tags)


class SqliteRecallSql:
    """`RecallSql` on memory.db (state.db attached as `st`)."""

    def vector_deletes(self, conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT value FROM meta WHERE key = 'vector_deletes'").fetchone()
        return row[0] if row else 0

    def chunk_deletes(self, conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT value FROM meta WHERE key = 'chunk_deletes'").fetchone()
        return row[0] if row else 0

    def chunk_texts_after(
        self, conn: sqlite3.Connection, namespace: str, after: int, batch: int
    ) -> Iterator[list[tuple[int, str]]]:
        """The namespace's chunks after id `after`, `batch` at a time (a large
        namespace's texts are never all in memory at once), in one statement (one
        snapshot). The kinds spelled out: the namespace index then seeks each kind's ids
        past `after`. In no overall order: sorting the texts cost more than the rest."""
        found = conn.execute(
            "SELECT id, text FROM chunks WHERE namespace = ?"
            " AND kind IN ('note', 'transcript') AND id > ?",
            (namespace, after),
        )
        while rows := found.fetchmany(batch):
            yield rows

    def chunk_ids_upto(self, conn: sqlite3.Connection, namespace: str, last: int) -> np.ndarray:
        """The namespace's chunk ids up to `last` (read off its index alone)."""
        found = conn.execute(
            "SELECT id FROM chunks WHERE namespace = ?"
            " AND kind IN ('note', 'transcript') AND id <= ?",
            (namespace, last),
        ).fetchall()
        return np.fromiter((row[0] for row in found), np.int64, len(found))

    def vectors_held(
        self, conn: sqlite3.Connection, namespace: str, model: str, max_seq: int
    ) -> int:
        return conn.execute(
            "SELECT count(*) FROM vectors WHERE namespace = ? AND model = ? AND seq <= ?",
            (namespace, model, max_seq),
        ).fetchone()[0]

    def vectors_after(
        self, conn: sqlite3.Connection, namespace: str, model: str, seq: int
    ) -> list[tuple[int, int, bytes]]:
        return conn.execute(
            "SELECT seq, chunk_id, vec FROM vectors WHERE namespace = ? AND model = ?"
            " AND seq > ? ORDER BY seq",
            (namespace, model, seq),
        ).fetchall()

    def postings(self, conn: sqlite3.Connection, words: list[str]) -> dict[str, int]:
        return {word: _postings(conn, word) for word in words}

    def chunks_at_most(self, conn: sqlite3.Connection) -> int:
        """The largest chunk id: no fewer than the chunks there are, read off the
        primary key's end (counting them walks the table)."""
        return conn.execute("SELECT coalesce(max(id), 0) FROM chunks").fetchone()[0]

    def ranked(
        self,
        conn: sqlite3.Connection,
        namespace: str,
        words: list[str],
        held: dict[str, int],
        tags: tuple[str, ...],
    ) -> dict[int, float]:
        where, params = _tag_filter(tags)
        # FTS5's `rank` (bm25 here) orders the matches inside FTS5, each scored once; the
        # chunks are then read in that order only until CANDIDATES of the namespace are
        # found, instead of every match read, scored and sorted outside it.
        rows = conn.execute(
            "SELECT c.id, -f.rank FROM chunks_fts f"
            " JOIN chunks c ON c.id = f.rowid"
            f" WHERE f.chunks_fts MATCH ? AND c.namespace = ?{where}"
            " ORDER BY f.rank LIMIT ?",
            (" OR ".join(_phrase(word) for word in words), namespace, *params, CANDIDATES),
        ).fetchall()
        return dict(rows)

    def tagged(self, conn: sqlite3.Connection, namespace: str, tags: tuple[str, ...]) -> list[int]:
        where, params = _tag_filter(tags)
        found = conn.execute(
            f"SELECT c.id FROM chunks c WHERE c.namespace = ?{where}", (namespace, *params)
        )
        return [row[0] for row in found]

    def rows(
        self, conn: sqlite3.Connection, chunk_ids: list[int], exclude: Recent | None = None
    ) -> list[tuple[Any, ...]]:
        return _rows(conn, chunk_ids, exclude)


SQLITE = SqliteRecallSql()


def vector_rows(
    conn: Any,
    cache: VectorCache,
    namespace: str,
    model: str,
    query_vec: np.ndarray | None,
    tags: tuple[str, ...],
    sql: RecallSql | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The SQL half of vector scoring: the namespace's (chunk ids, vectors), narrowed to
    the tagged chunks when tags are given; None when there is nothing to score."""
    if query_vec is None:
        return None
    sql = sql or SQLITE
    ids, matrix = cache.get(conn, namespace, model, sql)
    if not len(ids) or matrix.shape[0] != query_vec.shape[0]:
        return None
    if tags:
        allowed = np.fromiter(sql.tagged(conn, namespace, tags), np.int64)
        rows = np.flatnonzero(np.isin(ids, allowed))
        if not len(rows):
            return None
        ids, matrix = ids[rows], matrix[:, rows]
    return ids, matrix


def is_sparse(query_vec: np.ndarray) -> bool:
    """Whether a query has few enough nonzero dimensions (a hash embedding of a few
    words) to be scored row by row (`vector_scores`)."""
    return np.count_nonzero(query_vec) * 4 <= len(query_vec)


def vector_scores(
    rows: tuple[np.ndarray, np.ndarray] | None, query_vec: np.ndarray | None, min_similarity: float
) -> dict[int, float]:
    """The numpy half: cosine of every chunk (unit vectors: a dot product), the best
    CANDIDATES of those at or above `min_similarity`.

    A sparse query (`is_sparse`) adds up its own dimensions' rows, each scaled by its
    weight: the same sums with the zero terms left out, in numpy's own loops. Not a
    matrix product of those rows: that copies them first, and BLAS hands a product this
    size to its thread pool, whose threads wait for cores the gateway's own threads hold
    (a product of a few rows then took 20 times its own time on a busy machine). Only
    the chunks at or above the floor are ranked (a hash query's floor leaves out most)."""
    if rows is None or query_vec is None:
        return {}
    ids, matrix = rows
    if is_sparse(query_vec):
        sims = np.zeros(matrix.shape[1], dtype=np.float32)
        term = np.empty_like(sims)
        for dim in np.flatnonzero(query_vec):
            sims += np.multiply(matrix[dim], query_vec[dim], out=term)
    else:
        sims = query_vec @ matrix
    found = np.flatnonzero(sims >= max(min_similarity, np.nextafter(np.float32(0), 1)))
    if len(found) > CANDIDATES:
        found = found[np.argpartition(sims[found], -CANDIDATES)[-CANDIDATES:]]
    return {int(ids[i]): float(sims[i]) for i in found}


def ranks(scores: dict[int, float]) -> dict[int, int]:
    """1 for the best score, 2 for the next, ...; equal scores by chunk id."""
    order = sorted(scores, key=lambda chunk_id: (-scores[chunk_id], chunk_id))
    return {chunk_id: rank for rank, chunk_id in enumerate(order, 1)}


def fused(
    vector: dict[int, float],
    text: dict[int, float],
    vector_weight: float,
    text_weight: float,
) -> dict[int, float]:
    """Weighted reciprocal rank fusion of the two signals' candidates (the module
    docstring), scaled so that first in both scores 1."""
    scale = (RRF_K + 1) / ((vector_weight + text_weight) or 1.0)
    vector_ranks, text_ranks = ranks(vector), ranks(text)
    out = dict.fromkeys(vector_ranks.keys() | text_ranks.keys(), 0.0)
    for weight, ranked in ((vector_weight, vector_ranks), (text_weight, text_ranks)):
        for chunk_id, rank in ranked.items():
            out[chunk_id] += scale * weight / (RRF_K + rank)
    return out


def hybrid(
    conn: Any,
    cache: VectorCache,
    *,
    namespace: str,
    query: str,
    query_vec: np.ndarray | None,
    model: str,
    tags: tuple[str, ...],
    k: int,
    vector_weight: float,
    text_weight: float,
    min_similarity: float,
    sql: RecallSql | None = None,
    exclude: Recent | None = None,
    notes_only: bool = False,
) -> list[Scored]:
    """The namespace's best `k` chunks for the query, one per note; none made only of
    the `exclude` rows; with `notes_only`, notes' chunks only (of the candidates)."""
    sql = sql or SQLITE
    rows = (
        vector_rows(conn, cache, namespace, model, query_vec, tags, sql) if vector_weight else None
    )
    scoring = None
    if rows is not None and query_vec is not None and not is_sparse(query_vec):
        # A dense product releases the GIL for long: it runs on a thread of its own while
        # SQLite (which releases it too) ranks the text on this one. A sparse one costs
        # less than the hand-off and runs here.
        scoring = _MATH.submit(vector_scores, rows, query_vec, min_similarity)
    text = text_scores(conn, namespace, query, tags, sql) if text_weight > 0 else {}
    vector = scoring.result() if scoring else vector_scores(rows, query_vec, min_similarity)
    merged = fused(vector, text, vector_weight, text_weight)
    # Best first; the rows (is each still alive, its times) are read a slice at a time,
    # a tie always whole (its order is the rows' times), until `k` are found.
    order = sorted(merged, key=lambda chunk_id: -round(merged[chunk_id], 9))
    hits: list[Scored] = []
    start, size = 0, 2 * k
    while start < len(order):
        end = min(start + size, len(order))
        while end < len(order) and _tied(merged, order[end - 1], order[end]):
            end += 1
        hits += _scored(sql.rows(conn, order[start:end], exclude), merged, notes_only)
        start, size = end, 4 * size
        best = _best(hits, k)
        if len(best) == k:
            return best
    return _best(hits, k)


def _tied(scores: dict[int, float], one: int, other: int) -> bool:
    return round(scores[one], 9) == round(scores[other], 9)


def _scored(
    found: list[tuple[Any, ...]], scores: dict[int, float], notes_only: bool
) -> list[Scored]:
    return [
        Scored(
            chunk_id,
            kind,
            note_id,
            session_id,
            body,
            tags_of(note_tags),
            scores[chunk_id],
            created,
            updated,
        )
        for chunk_id, kind, note_id, session_id, body, note_tags, created, updated in found
        if kind == "note" or not notes_only
    ]


def _best(hits: list[Scored], k: int) -> list[Scored]:
    """The best `k` of `hits`, one per note: equal scores by the newer update, then the
    newer chunk."""
    ordered = sorted(hits, key=lambda hit: (-round(hit.score, 9), -hit.updated_at, -hit.chunk_id))
    out: list[Scored] = []
    notes_seen: set[str] = set()
    for hit in ordered:
        if hit.note_id is not None:
            if hit.note_id in notes_seen:
                continue
            notes_seen.add(hit.note_id)
        out.append(hit)
        if len(out) == k:
            break
    return out


def tags_of(raw: str | None) -> tuple[str, ...]:
    return tuple(codec.loads(raw)) if raw else ()


def _rows(
    conn: sqlite3.Connection, chunk_ids: list[int], exclude: Recent | None = None
) -> list[tuple[Any, ...]]:
    """The chunks still alive: notes with their record in state.db, transcript chunks
    with an active message of theirs still there (outside `exclude`)."""
    if not chunk_ids:
        return []
    marks = ", ".join("?" * len(chunk_ids))
    # No exclusion: no session id is the empty string.
    session_id, first = (exclude.session_id, exclude.first) if exclude else ("", 0)
    return conn.execute(
        "SELECT c.id, c.kind, c.note_id, c.session_id,"
        " CASE WHEN c.kind = 'note' THEN n.content ELSE c.text END, n.tags,"
        " coalesce(n.created_at, c.created_at), coalesce(n.updated_at, c.updated_at)"
        f" FROM chunks c LEFT JOIN st.notes n ON n.note_id = c.note_id WHERE c.id IN ({marks})"
        " AND CASE WHEN c.kind = 'note' THEN n.note_id IS NOT NULL ELSE EXISTS ("
        "   SELECT 1 FROM chunk_sources s JOIN st.messages m ON m.id = s.message_id"
        "   WHERE s.chunk_id = c.id AND m.active = 1"
        "   AND (m.session_id != ? OR m.id < ?)) END",
        (*chunk_ids, session_id, first),
    ).fetchall()
