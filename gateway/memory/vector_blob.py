"""How a vector is stored as bytes in memory.db: dense, or sparse when that is smaller.

Dense: the float32 values, little-endian, one after another (4 bytes a dimension).

Sparse: a hash embedding has a nonzero only where the chunk's words hashed (a few dozen
of 256 dimensions), so it is stored as those only: SPARSE_MARK, the dimensions and the
count as uint16, then per nonzero its dimension (uint16) and value (float32). Writing a
vector row costs in proportion to its bytes (its b-tree page, the WAL, the checkpoint),
and a short chunk's dense vector is most of what the indexer writes for it.

The two never mix up: a sparse blob starts with a NaN, which no stored unit vector holds.
Decoding gives the same float32 matrix either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SPARSE_MARK = b"\xff\xff\xff\xff"  # a float32 NaN
_HEADER = len(SPARSE_MARK) + 4  # the mark, uint16 dimensions, uint16 count
_ENTRY = np.dtype([("dim", "<u2"), ("value", "<f4")])  # packed: 6 bytes


def encode_rows(data: np.ndarray) -> list[bytes]:
    """One blob per row of a float32 (rows, dimensions) matrix, each the smaller form."""
    data = np.ascontiguousarray(data, dtype="<f4")
    if data.ndim != 2 or not len(data):
        return []
    rows, dims = data.shape
    counts = np.count_nonzero(data, axis=1)
    sparse = _HEADER + _ENTRY.itemsize * counts < 4 * dims
    if dims > 0xFFFF or not sparse.any():
        dense = data.tobytes()
        return [dense[i * 4 * dims : (i + 1) * 4 * dims] for i in range(rows)]
    at_row, at_dim = np.nonzero(data)  # row-major: each row's entries together, in order
    entries = np.empty(len(at_row), dtype=_ENTRY)
    entries["dim"], entries["value"] = at_dim, data[at_row, at_dim]
    packed, prefix = entries.tobytes(), SPARSE_MARK + dims.to_bytes(2, "little")
    ends = (np.cumsum(counts) * _ENTRY.itemsize).tolist()
    headers: dict[int, bytes] = {}  # by count: a few distinct counts per batch
    blobs: list[bytes] = []
    start = 0
    for i, (count, small) in enumerate(zip(counts.tolist(), sparse.tolist(), strict=True)):
        end = ends[i]
        if small:
            header = headers.get(count)
            if header is None:
                header = headers[count] = prefix + count.to_bytes(2, "little")
            blobs.append(header + packed[start:end])
        else:
            blobs.append(data[i].tobytes())
        start = end
    return blobs


def decode_rows(blobs: Sequence[bytes]) -> np.ndarray:
    """The float32 (rows, dimensions) matrix of blobs `encode_rows` made (or dense ones
    written before sparse ones were); a ValueError when they differ in dimensions."""
    if not blobs:
        return np.zeros((0, 0), dtype=np.float32)
    marked = [blob[:4] == SPARSE_MARK for blob in blobs]
    if not any(marked):
        matrix = np.frombuffer(b"".join(blobs), dtype="<f4")
        return matrix.reshape(len(blobs), -1)
    dims = {
        int.from_bytes(blob[4:6], "little") if m else len(blob) // 4
        for blob, m in zip(blobs, marked, strict=True)
    }
    if len(dims) != 1:
        raise ValueError(f"vectors of {sorted(dims)} dimensions in one set")
    out = np.zeros((len(blobs), dims.pop()), dtype=np.float32)
    sparse_rows = [i for i, m in enumerate(marked) if m]
    entries = np.frombuffer(b"".join(blobs[i][_HEADER:] for i in sparse_rows), dtype=_ENTRY)
    counts = [(len(blobs[i]) - _HEADER) // _ENTRY.itemsize for i in sparse_rows]
    at_row = np.repeat(np.array(sparse_rows, dtype=np.int64), counts)
    out[at_row, entries["dim"]] = entries["value"]
    for i, m in enumerate(marked):
        if not m:
            out[i] = np.frombuffer(blobs[i], dtype="<f4")
    return out
