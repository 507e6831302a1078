"""memory.db's vector bytes: a hash embedding stored sparse, any vector read back exactly."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.memory.embeddings import HashEmbedder
from gateway.memory.vector_blob import SPARSE_MARK, decode_rows, encode_rows


def test_hash_vectors_are_stored_sparse_and_read_back_exactly() -> None:
    vectors = HashEmbedder().embed_sync(["remember the heron by the pond", "", "x"])
    blobs = encode_rows(vectors)
    assert all(blob.startswith(SPARSE_MARK) for blob in blobs)
    assert max(len(blob) for blob in blobs) < 4 * 256 // 10
    decoded = decode_rows(blobs)
    assert decoded.dtype == np.float32
    assert np.array_equal(decoded, vectors)


def test_dense_vectors_stay_dense_and_mix_with_sparse_ones() -> None:
    dense = np.random.default_rng(1).random((2, 256), dtype=np.float32)
    sparse = HashEmbedder().embed_sync(["one note"])
    blobs = encode_rows(dense) + encode_rows(sparse)
    assert [len(blob) for blob in blobs[:2]] == [1024, 1024]
    assert np.array_equal(decode_rows(blobs), np.vstack([dense, sparse]))
    # rows written before sparse storage existed: plain float32 bytes
    assert np.array_equal(decode_rows([dense[0].tobytes()]), dense[:1])


def test_vectors_of_different_sizes_in_one_set_are_refused() -> None:
    blobs = encode_rows(HashEmbedder(256).embed_sync(["a"])) + encode_rows(
        HashEmbedder(128).embed_sync(["a"])
    )
    with pytest.raises(ValueError, match="dimensions"):
        decode_rows(blobs)
