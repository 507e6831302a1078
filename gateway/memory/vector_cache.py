"""The namespaces' vectors in memory, as recall scores them (gateway.memory.retrieval).

Reading 100,000 blobs from SQLite takes longer than scoring them, so each namespace's
vectors are held as one matrix, least recently used dropped past CACHE_BYTES, and kept
exact against the index (also when another process wrote it) at every look-up.

Where they come from depends on the embedder:
- stored (a model server's, a local model's, and every vector in PostgreSQL): the
  index's `vectors` rows. New ones are appended by their sequence number; after any
  vector was deleted, a namespace whose count changed is read again.
- derived (the `hash` embedder on SQLite): none is stored. A hash vector is a function of
  its chunk's words alone, which the full-text index holds already, so computing it
  costs less than writing, queueing and reading it back, and most chunks are never
  recalled. The chunks' texts are read and embedded here the first time a namespace is
  scored; after that only the chunks added since (ids past the largest held: memory.db
  never hands a chunk id out twice). A chunk's text never changes in place (a changed
  note or message is a new chunk), so after a chunk was deleted anywhere (memory.db's
  `chunk_deletes`) the namespace's ids are read, and the vectors of those gone dropped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gateway.memory.vector_blob import decode_rows

CACHE_BYTES = 512 * 1024 * 1024  # vectors held in memory across namespaces
DERIVE_BATCH = 1_024  # chunks read and embedded at a time when vectors are derived

Derive = Callable[[Sequence[str]], np.ndarray]  # texts -> unit vectors, one row each


class VectorSql(Protocol):
    """What the cache reads, per backend (stored vectors)."""

    def vector_deletes(self, conn: Any) -> int: ...

    def vectors_held(self, conn: Any, namespace: str, model: str, max_seq: int) -> int: ...

    def vectors_after(
        self, conn: Any, namespace: str, model: str, seq: int
    ) -> list[tuple[int, int, bytes]]: ...


class ChunkTextSql(Protocol):
    """What the cache reads when it derives the vectors (memory.db only)."""

    def chunk_deletes(self, conn: Any) -> int: ...

    def chunk_texts_after(
        self, conn: Any, namespace: str, after: int, batch: int
    ) -> Iterator[list[tuple[int, str]]]: ...

    def chunk_ids_upto(self, conn: Any, namespace: str, last: int) -> np.ndarray: ...


@dataclass(slots=True)
class _Matrix:
    deletes: int  # the index's delete count when this was loaded or last checked
    max_seq: int  # the newest vector held: vectors.seq, or the chunk id when derived
    count: int = 0
    ids: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int64))
    # (dimensions, capacity): column j is chunk ids[j]'s vector, columns 0..count-1 used.
    # Dimension-major, so that a sparse query (a hash embedding has a few words) reads
    # only its own dimensions' rows: 2 MB instead of 100 MB at 100,000 chunks.
    cols: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0), np.float32))

    def append(self, ids: np.ndarray, rows: np.ndarray, max_seq: int, namespace: str) -> None:
        if self.count and rows.shape[1] != self.cols.shape[0]:
            raise ValueError(f"vectors of {namespace} differ in size within one model")
        need = self.count + len(ids)
        if need > len(self.ids):  # grow by doubling: appends cost O(1) amortized
            size = max(need, 2 * len(self.ids), 64)
            self.ids = np.resize(self.ids, size)
            grown = np.zeros((rows.shape[1], size), dtype=np.float32)
            if self.count:
                grown[:, : self.count] = self.cols[:, : self.count]
            self.cols = grown
        self.ids[self.count : need] = ids
        self.cols[:, self.count : need] = rows.T
        self.count, self.max_seq = need, max_seq

    def keep(self, ids: np.ndarray) -> None:
        """Only the columns of these chunk ids are kept, in their order."""
        kept = np.flatnonzero(np.isin(self.ids[: self.count], ids))
        if len(kept) < self.count:
            self.ids[: len(kept)] = self.ids[kept]
            self.cols[:, : len(kept)] = self.cols[:, kept]
            self.count = len(kept)

    @property
    def nbytes(self) -> int:
        return int(self.cols.nbytes + self.ids.nbytes)


class VectorCache:
    """The namespaces' vectors as matrices (the module docstring); `derive` makes them
    from the chunks' texts instead of reading stored ones."""

    def __init__(self, max_bytes: int = CACHE_BYTES, derive: Derive | None = None) -> None:
        self.max_bytes = max_bytes
        self.derive = derive
        self._entries: OrderedDict[tuple[str, str], _Matrix] = OrderedDict()

    def clear(self) -> None:
        self._entries.clear()

    def get(self, conn: Any, namespace: str, model: str, sql: Any) -> tuple[np.ndarray, np.ndarray]:
        """(chunk ids, their unit vectors as the columns of a dimensions x chunks
        matrix) of the namespace, current as of this call. `sql` is the backend's
        `VectorSql` (with `derive`, its `ChunkTextSql`)."""
        key = (namespace, model)
        try:
            if self.derive is None:
                entry = self._stored(conn, namespace, model, sql, self._entries.get(key))
            else:
                entry = self._derived(conn, namespace, sql, self.derive, self._entries.get(key))
        except BaseException:
            # A matrix is extended in place: one that failed half-way is not kept.
            self._entries.pop(key, None)
            raise
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._evict()
        return entry.ids[: entry.count], entry.cols[:, : entry.count]

    @staticmethod
    def _stored(
        conn: Any, namespace: str, model: str, sql: VectorSql, entry: _Matrix | None
    ) -> _Matrix:
        deletes = sql.vector_deletes(conn)
        if entry is not None and entry.deletes != deletes:
            held = sql.vectors_held(conn, namespace, model, entry.max_seq)
            entry.deletes = deletes
            if held != entry.count:
                entry = None
        rows = sql.vectors_after(conn, namespace, model, entry.max_seq if entry else 0)
        entry = entry or _Matrix(deletes, 0)
        if rows:
            entry.append(
                np.fromiter((r[1] for r in rows), np.int64, len(rows)),
                decode_rows([bytes(row[2]) for row in rows]),
                rows[-1][0],
                namespace,
            )
        return entry

    @staticmethod
    def _derived(
        conn: Any, namespace: str, sql: ChunkTextSql, derive: Derive, entry: _Matrix | None
    ) -> _Matrix:
        deletes = sql.chunk_deletes(conn)
        if entry is None:
            entry = _Matrix(deletes, 0)
        elif entry.deletes != deletes:
            entry.keep(sql.chunk_ids_upto(conn, namespace, entry.max_seq))
            entry.deletes = deletes
        for batch in sql.chunk_texts_after(conn, namespace, entry.max_seq, DERIVE_BATCH):
            ids = np.fromiter((row[0] for row in batch), np.int64, len(batch))
            top = max(entry.max_seq, int(ids.max()))
            entry.append(ids, derive([row[1] for row in batch]), top, namespace)
        return entry

    def _evict(self) -> None:
        total = sum(entry.nbytes for entry in self._entries.values())
        while total > self.max_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            total -= dropped.nbytes
