"""Recall quality on the paraphrase set (scripts/bench_recall_quality.py's logic): adding
the text signal never costs the vector signal's first answer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
from gateway.store.session_store import SessionStore
from tests.fakes.openai_server import FakeOpenAI
from tests.pg_support import StorageBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_recall_quality import load, quality

DIMENSIONS = 64


def config_of(backend: StorageBackend, **memory: object) -> GatewayConfig:
    return backend.apply(GatewayConfig.model_validate({"memory": memory}))


async def test_fused_ranks_first_at_least_as_often_as_the_hash_vector(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    result = await quality(tmp_path / "sessions", config_of(store_backend))
    assert result["fused"].rank1 >= result["vector"].rank1
    assert result["fused"].top5 >= 1  # the set runs end to end and finds something


async def test_a_word_match_on_the_vectors_runner_up_never_overtakes_its_first(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """A semantic model's vectors, steered: each question is nearest its own note and
    next nearest the note its words match best (the text signal's first), every note a
    candidate. Fused must keep the vector's answer first for every question (min-max
    scores lifted the word match above it)."""
    notes, questions = load()
    text_first = await _text_firsts(tmp_path / "text", store_backend)
    basis = np.eye(DIMENSIONS)
    common = np.full(DIMENSIONS, 0.1)  # every note a (weak) vector candidate
    vectors = {note: list(basis[i] + common) for i, note in enumerate(notes)}
    for (question, answer), runner_up in zip(questions, text_first, strict=True):
        other = runner_up if runner_up != answer else (answer + 1) % len(notes)
        vectors[question] = list(0.8 * basis[answer] + 0.6 * basis[other] + common)
    async with FakeOpenAI() as fake:
        fake.embedding_dimensions = DIMENSIONS
        fake.embeddings = vectors
        config = config_of(store_backend, embedding="openai", base_url=fake.base_url)
        result = await quality(tmp_path / "steered", config)
    assert result["vector"].rank1 == len(questions)
    assert result["fused"].rank1 == len(questions), result["fused"].misses


async def _text_firsts(home: Path, backend: StorageBackend) -> list[int]:
    """Per question, the note the text signal alone ranks first (its index); in a
    namespace of its own (on PostgreSQL both homes share one schema)."""
    probe = Namespace("main", "telegram", "text-probe")
    notes, questions = load()
    config = config_of(backend)
    async with SessionStore(home, config) as store:
        recall = Recall(store, config)
        await recall.open()
        ids = [await recall.save(probe, note) for note in notes]
        recall.weights = (0.0, 1.0)
        firsts = []
        for question, answer in questions:
            hits = await recall.search(probe, question, k=1)
            firsts.append(ids.index(hits[0].id) if hits else answer)
        await recall.close()
    return firsts
