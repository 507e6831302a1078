"""memory.db's vector bytes: a hash embedding stored sparse, any vector read back exactly."""

from __future__ import annotations

import hashlib
import re

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


def test_a_hash_vector_is_its_words_signed_counts_made_unit_length() -> None:
    """The batched embedding against the definition, word by word: each lowercased word
    adds its sign to its dimension (both from blake2b of the word); the row is scaled to
    length 1. Repeated words, a word in two cases, collisions, an empty text, and a
    batch of several texts all give exactly the vector the definition does."""
    rng = np.random.default_rng(3)
    vocabulary = [f"w{i}" for i in range(300)] + ["Heron", "heron", "ÉTÉ", "été", "x"]
    texts = [" ".join(rng.choice(vocabulary, int(n))) for n in rng.integers(0, 40, 300)]
    texts += ["", "heron HERON heron", "a-b a_b", "   "]

    def definition(text: str, dims: int) -> np.ndarray:
        row = np.zeros(dims, dtype=np.float64)
        for word in re.findall(r"\w+", text.lower()):
            digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest())
            row[digest % dims] += 1.0 if digest >> 63 else -1.0
        norm = np.linalg.norm(row)
        return row / norm if norm else row

    for dims in (256, 64):
        vectors = HashEmbedder(dims).embed_sync(texts)
        expected = np.array([definition(text, dims) for text in texts])
        assert vectors.shape == (len(texts), dims) and vectors.dtype == np.float32
        assert np.allclose(vectors, expected, atol=1e-6)
        assert not vectors[-1].any() and not vectors[-4].any()  # no words, no direction
    # one at a time or in a batch: the same bits
    one_by_one = np.vstack([HashEmbedder().embed_sync([text]) for text in texts])
    assert np.array_equal(one_by_one, HashEmbedder().embed_sync(texts))
