"""Notes, hybrid recall over notes and past transcripts,
embeddings (hash; openai through the fake server), background indexing, forgetting.
Real SQLite files, the real runner with the HTTP adapter, the fake OpenAI-compatible
server on 127.0.0.1, and the command line as a subprocess.

Tests about behaviour take `store_backend` and run on both store backends (on
PostgreSQL the index is the store's `memory_*` tables); those about memory.db's files
and FTS5 are `sqlite_only`."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sqlite3
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.memory import sqlite_index, vector_cache
from gateway.memory.chunking import chunk_text, content_hash, normalize, normalize_tags
from gateway.memory.embeddings import HashEmbedder
from gateway.memory.index import MEMORY_DB
from gateway.memory.recall import Namespace, Recall
from gateway.memory.retrieval import (
    CANDIDATES,
    MAX_POSTINGS,
    MAX_QUERY_WORDS,
    SQLITE,
    VectorCache,
    kept_words,
    vector_scores,
)
from gateway.run import GatewayRunner
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from tests.commandline import cli
from tests.fakes.agents import ScriptedAgent as EchoAgent
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_client import GatewayClient
from tests.pg_support import StorageBackend
from tests.scanning import pg_tables_holding, tables_holding
from tests.waiting import wait_for

ALICE = Namespace("main", "http", "alice")
BOB = Namespace("main", "http", "bob")


async def notes_of(recall: Recall, ns: Namespace) -> list[dict[str, Any]]:
    """The namespace's notes, as `hermes-gateway memory list` reads them."""
    return await recall.export(ns.platform, ns.user_id, ns.agent_id)


def config_of(**memory: Any) -> GatewayConfig:
    """Transcripts are indexed here (`memory.index_transcripts`, off by default)."""
    return GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {"http": {"enabled": True, "port": 0}},
            "memory": {"index_transcripts": True, **memory},
        }
    )


def index_count(backend: StorageBackend, sessions: Path, table: str) -> int:
    """Rows of one of the memory index's tables (memory.db's name), on either backend;
    -1 when there is no such table (yet)."""
    if not backend.postgres:
        return _count(sessions / MEMORY_DB, table)
    with psycopg.connect(backend.dsn or "") as conn:
        found = conn.execute("SELECT to_regclass(%s)", (f"memory_{table}",)).fetchone()
        if not found or found[0] is None:
            return -1
        return conn.execute(f"SELECT count(*) FROM memory_{table}").fetchone()[0]


def stored_vectors(backend: StorageBackend, chunks: int) -> int:
    """The hash embedder's vectors held for `chunks` chunks: all on PostgreSQL, none in
    memory.db (recall derives them, gateway.memory.vector_cache)."""
    return chunks if backend.postgres else 0


@pytest.fixture
async def recall(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Recall]:
    config = store_backend.apply(config_of())
    async with SessionStore(tmp_path, config) as store:
        memory = Recall(store, config)
        await memory.open()
        yield memory
        await memory.close()


# --- pure parts ----------------------------------------------------------------------


def test_chunks_are_640_characters_overlapping_by_96() -> None:
    text = " ".join(f"w{i:04d}" for i in range(400))  # 2,399 characters, words of 5
    chunks = chunk_text(text)
    assert len(chunks) > 3 and all(len(chunk) <= 640 for chunk in chunks)
    for left, right in itertools.pairwise(chunks):
        assert right[:84] in left[-96:]  # 14 whole words of the left one's tail
        assert right.split(" ", 1)[0] in left.split(" ")
    assert " ".join(chunks).split()[-1] == "w0399"
    assert chunk_text("  ") == []


def test_every_kind_of_whitespace_is_one_space_in_a_chunk() -> None:
    """Chunks and their hashes depend on `normalize`: each run of what the regex `\\s`
    calls whitespace (every such code point) is one space, the ends trimmed."""
    spaces = [chr(c) for c in range(sys.maxunicode + 1) if re.fullmatch(r"\s", chr(c))]
    assert len(spaces) > 20 and "\u3000" in spaces and "\x1f" in spaces
    for space in spaces:
        assert normalize(f"{space}a{space}{space}b \t{space}c{space}") == "a b c", hex(ord(space))
    assert chunk_text("\u2003hello\u00a0\u00a0world\n") == ["hello world"]
    assert normalize("a\u200bb") == "a\u200bb"  # a zero-width space is no whitespace


def test_a_sparse_query_scores_exactly_as_the_full_product() -> None:
    """A hash query has few nonzero dimensions, and only those rows are multiplied:
    the same scores and candidates as the whole matrix product (and a dense query)."""
    rng = np.random.default_rng(7)
    ids = np.arange(1_000, 2_000, dtype=np.int64)
    matrix = rng.standard_normal((64, 1_000)).astype(np.float32)  # dimensions x chunks
    sparse = np.zeros(64, dtype=np.float32)
    sparse[[3, 17, 40]] = [0.5, -0.7, 0.5]
    for query in (sparse, rng.standard_normal(64).astype(np.float32)):
        full = query.astype(np.float64) @ matrix.astype(np.float64)
        best = np.argsort(-full)[:CANDIDATES]
        want = {int(ids[i]): full[i] for i in best if full[i] > 0.2}
        got = vector_scores((ids, matrix), query, 0.2)
        assert got.keys() == want.keys()
        assert all(abs(got[key] - want[key]) < 1e-4 for key in want)


def test_a_text_query_keeps_the_rare_words_of_a_bounded_prefix(tmp_path: Path) -> None:
    sqlite3.connect(tmp_path / "state.db").close()
    conn = sqlite_index.connect(tmp_path / MEMORY_DB, tmp_path / "state.db")
    try:
        conn.executemany(
            "INSERT INTO chunks (id, namespace, kind, hash, text, created_at, updated_at)"
            " VALUES (?, 'ns', 'note', 'h', ?, 0, 0)",
            [(i, f"common word{i}") for i in range(1, MAX_POSTINGS + 2)],
        )
        sqlite_index.SQLITE_INDEX.add_words(conn, 0, MAX_POSTINGS + 1)
        # "common" is in more chunks than a search may rank: only the rarer words stay
        assert kept_words(conn, "Common word7 word9", SQLITE)[0] == ["word7", "word9"]
        assert kept_words(conn, "common", SQLITE)[0] == []
        many = " ".join(f"w{i}" for i in range(3 * MAX_QUERY_WORDS))
        assert len(kept_words(conn, many, SQLITE)[0]) == MAX_QUERY_WORDS
    finally:
        conn.close()


def test_the_vector_cache_grows_with_new_vectors_and_reloads_after_a_delete(
    tmp_path: Path,
) -> None:
    sqlite3.connect(tmp_path / "state.db").close()
    conn = sqlite_index.connect(tmp_path / MEMORY_DB, tmp_path / "state.db")
    cache = VectorCache()
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((150, 16)).astype(np.float32)

    def add(first: int, last: int) -> None:
        conn.executemany(
            "INSERT INTO chunks (id, namespace, kind, hash, text, created_at, updated_at)"
            " VALUES (?, 'ns', 'note', 'h', 't', 0, 0)",
            [(i,) for i in range(first, last)],
        )
        sqlite_index.INDEX.store_vectors(conn, list(range(first, last)), vectors[first:last], "m")

    try:
        add(0, 10)
        ids, cols = cache.get(conn, "ns", "m", SQLITE)
        assert ids.tolist() == list(range(10)) and np.array_equal(cols, vectors[:10].T)
        add(10, 150)  # past the first capacity (64): the matrix grows
        ids, cols = cache.get(conn, "ns", "m", SQLITE)
        assert ids.tolist() == list(range(150)) and np.array_equal(cols, vectors.T)
        conn.execute("DELETE FROM vectors WHERE chunk_id = 5")
        ids, cols = cache.get(conn, "ns", "m", SQLITE)
        keep = [i for i in range(150) if i != 5]
        assert ids.tolist() == keep and np.array_equal(cols, vectors[keep].T)
    finally:
        conn.close()


def test_derived_vectors_are_the_hash_of_each_chunk_of_the_namespace_also_after_a_delete(
    tmp_path: Path,
) -> None:
    """Under the hash embedder memory.db stores no vector: the cache computes them from
    the texts, the namespace's only, the same as stored ones would be; a delete drops
    the chunk's vector, and a deleted chunk's id is never handed out again."""
    sqlite3.connect(tmp_path / "state.db").close()
    conn = sqlite_index.connect(tmp_path / MEMORY_DB, tmp_path / "state.db")
    sql = sqlite_index.DERIVED_INDEX.sql
    embedder = HashEmbedder()
    cache = VectorCache(derive=embedder.embed_sync)
    texts: dict[int, str] = {}

    def add(namespace: str, kind: str, text: str) -> int:
        if kind == "note":
            sql.add_note_chunks(conn, namespace, text, [(content_hash(text), text)], 0, 0, [])
        else:
            sql.add_transcript_chunks(conn, [(namespace, "s", content_hash(text), text, 0)], [])
        chunk_id = conn.execute("SELECT id FROM chunks WHERE text = ?", (text,)).fetchone()[0]
        if namespace == "ns":
            texts[chunk_id] = text
        return chunk_id

    def check() -> None:
        ids, cols = cache.get(conn, "ns", embedder.model_id, SQLITE)
        assert sorted(ids.tolist()) == sorted(texts) and len(ids) == len(texts)
        want = embedder.embed_sync([texts[i] for i in ids.tolist()])
        assert np.array_equal(cols, want.T)

    try:
        for i in range(70):  # past the first capacity (64), both kinds, another namespace
            add("ns", ("note", "transcript")[i % 2], f"heron number {i} by the lake")
            add("other", "note", f"egret {i}")
        check()
        add("ns", "transcript", "a kingfisher came later")  # only the new one is read
        check()
        last, middle = max(texts), sorted(texts)[30]
        for gone in (last, middle):
            sql.delete_chunks(conn, "id = ?", (gone,))
            del texts[gone]
        check()
        assert add("ns", "note", "the otter came last") > last  # never the same id again
        check()
        assert conn.execute("SELECT count(*) FROM vectors").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pending_vectors").fetchone()[0] == 0
    finally:
        conn.close()


def test_a_derived_matrix_that_failed_half_way_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matrix is extended in place, a batch at a time: when a batch fails, the next
    look-up computes the namespace again instead of trusting what was half extended."""
    sqlite3.connect(tmp_path / "state.db").close()
    conn = sqlite_index.connect(tmp_path / MEMORY_DB, tmp_path / "state.db")
    sql, embedder = sqlite_index.DERIVED_INDEX.sql, HashEmbedder()
    calls = 0

    def embed(texts: Sequence[str]) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 3:  # the extension's second batch
            raise OSError("the embedder failed")
        return embedder.embed_sync(texts)

    def add(first: int, last: int) -> None:
        """Notes and transcript chunks in turn: the look-up reads them kind by kind,
        so not in id order."""
        for i in range(first, last):
            text = f"chunk {i} about pelicans"
            if i % 2:
                sql.add_transcript_chunks(conn, [("ns", "s", content_hash(text), text, 0)], [])
            else:
                sql.add_note_chunks(conn, "ns", f"n{i}", [(content_hash(text), text)], 0, 0, [])

    monkeypatch.setattr(vector_cache, "DERIVE_BATCH", 10)
    cache = VectorCache(derive=embed)
    try:
        add(0, 5)
        assert len(cache.get(conn, "ns", "m", SQLITE)[0]) == 5
        add(5, 30)
        with pytest.raises(OSError, match="embedder failed"):
            cache.get(conn, "ns", "m", SQLITE)
        ids, cols = cache.get(conn, "ns", "m", SQLITE)
        texts = dict(conn.execute("SELECT id, text FROM chunks"))
        assert sorted(ids.tolist()) == sorted(texts)
        assert np.array_equal(cols, embedder.embed_sync([texts[i] for i in ids.tolist()]).T)
    finally:
        conn.close()


def test_tags_are_trimmed_lowercased_deduplicated_and_bounded() -> None:
    assert normalize_tags([" Pets ", "pets", "DOG", "", "dog "]) == ("pets", "dog")
    assert len(normalize_tags([f"t{i}" for i in range(16)])) == 16
    with pytest.raises(ValueError, match="at most 16 tags"):
        normalize_tags([f"t{i}" for i in range(17)])
    with pytest.raises(ValueError, match="longer than 64"):
        normalize_tags(["x" * 65])
    with pytest.raises(ValueError, match="list of strings"):
        normalize_tags("pets")


# --- notes -----------------------------------------------------------------------------


async def test_notes_belong_to_one_user_of_one_agent(recall: Recall) -> None:
    mine = await recall.save(ALICE, "Alice's cat is called Mochi", [" Pets ", "PETS", "cats"])
    await recall.save(BOB, "Bob's cat is called Pixel", ["pets"])
    other_agent = Namespace("coder", "http", "alice")
    await recall.save(other_agent, "Alice's cat reviews pull requests")

    hits = await recall.search(ALICE, "cat called")
    assert [hit.id for hit in hits] == [mine]
    assert hits[0].kind == "note" and hits[0].tags == ("pets", "cats")
    assert hits[0].created_at == hits[0].updated_at
    assert [h.text for h in await recall.search(BOB, "cat")] == ["Bob's cat is called Pixel"]
    assert [h.text for h in await recall.search(other_agent, "cat")] == [
        "Alice's cat reviews pull requests"
    ]
    assert [n["id"] for n in await notes_of(recall, ALICE)] == [mine]
    # Bob cannot touch Alice's note, nor learn it exists.
    assert await recall.delete(BOB, mine) is False
    with pytest.raises(ValueError, match="no note"):
        await recall.save(BOB, "stolen", note_id=mine)
    assert [n["text"] for n in await notes_of(recall, ALICE)] == ["Alice's cat is called Mochi"]


async def test_update_keeps_the_id_and_replaces_text_and_tags(recall: Recall) -> None:
    note = await recall.save(ALICE, "The wifi password is tangerine", ["home"])
    again = await recall.save(ALICE, "The wifi password is now grapefruit", ["wifi"], note_id=note)
    assert again == note
    assert await recall.search(ALICE, "tangerine") == []
    (hit,) = await recall.search(ALICE, "grapefruit")
    assert (hit.id, hit.tags) == (note, ("wifi",))
    assert hit.updated_at > hit.created_at
    assert await recall.search(ALICE, "grapefruit", tags=["home"]) == []
    assert await recall.delete(ALICE, note) is True
    assert await recall.search(ALICE, "grapefruit") == []
    assert await recall.delete(ALICE, note) is False


async def test_tag_filters_need_every_tag(recall: Recall) -> None:
    both = await recall.save(ALICE, "Dentist on Monday at nine", ["health", "calendar"])
    await recall.save(ALICE, "Gym on Monday at seven", ["health"])
    found = await recall.search(ALICE, "Monday", tags=["Calendar", "health"])
    assert [hit.id for hit in found] == [both]
    assert len(await recall.search(ALICE, "Monday", tags=["health"])) == 2


@pytest.mark.parametrize(
    ("content", "tags", "message"),
    [
        ("", (), "needs some text"),
        ("   ", (), "needs some text"),
        ("x" * 8001, (), "at most 8000"),
        ("ok", ["t"] * 1 + [f"t{i}" for i in range(16)], "at most 16 tags"),
        ("ok", ["y" * 65], "longer than 64"),
    ],
)
async def test_bad_notes_are_refused_clearly(
    recall: Recall, content: str, tags: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await recall.save(ALICE, content, tags)
    assert await notes_of(recall, ALICE) == []


async def test_bad_searches_are_refused(recall: Recall) -> None:
    with pytest.raises(ValueError, match="some words"):
        await recall.search(ALICE, "  ")
    with pytest.raises(ValueError, match="k must be"):
        await recall.search(ALICE, "x", k=0)
    with pytest.raises(ValueError, match="user id"):
        Namespace.of("main", SessionSource(platform=Platform.HTTP, chat_id="c", chat_type="dm"))
    assert str(
        Namespace.of("main", SessionSource(Platform.TELEGRAM, "42", "dm", user_id="42"))
    ) == ("memory:main:telegram:42")


async def test_hash_matches_words_not_meaning(recall: Recall) -> None:
    note = await recall.save(ALICE, "I parked the car on level three of the garage")
    await recall.save(ALICE, "Lunch with Sam next Thursday")
    (hit,) = await recall.search(ALICE, "I parked the car on level three of the garage", k=1)
    assert hit.id == note and hit.score == pytest.approx(1.0)
    # The same meaning in other words: no shared word, so no vector and no text match.
    assert await recall.search(ALICE, "automobile stored upstairs") == []


# --- hybrid ranking with a steered embedding server -------------------------------------


@pytest.mark.parametrize(("vector", "text", "first"), [(0.7, 0.3, "near"), (0.2, 0.8, "words")])
async def test_hybrid_ranking_follows_the_weights(
    tmp_path: Path, vector: float, text: float, first: str, store_backend: StorageBackend
) -> None:
    query = "where did I leave my umbrella"
    near = "The brolly hangs behind the office door"  # no word in common, vector-near
    words = "I did leave a message where my old umbrella shop was"  # words, vector-far
    async with FakeOpenAI(expected_key="sk-emb") as fake:
        fake.embedding_dimensions = 4
        fake.embeddings = {
            query: [1.0, 0.0, 0.0, 0.0],
            near: [0.9, 0.1, 0.0, 0.0],
            words: [0.0, 0.0, 1.0, 0.0],
        }
        config = config_of(
            embedding="openai",
            base_url=fake.base_url,
            api_key="sk-emb",
            weights={"vector": vector, "text": text},
            dimensions=4,
        )
        config = store_backend.apply(config)
        async with SessionStore(tmp_path, config) as store:
            recall = Recall(store, config)
            await recall.open()
            ids = {"near": await recall.save(ALICE, near), "words": await recall.save(ALICE, words)}
            hits = await recall.search(ALICE, query)
            await recall.close()
    assert [hit.id for hit in hits] == [ids[first], ids[other(first)]]
    assert hits[0].score == pytest.approx(max(vector, text))
    bodies = [r["json"] for r in fake.requests if r["path"] == "/v1/embeddings"]
    assert {"input", "model"} <= bodies[0].keys()
    assert [r["headers"]["Authorization"] for r in fake.requests] == ["Bearer sk-emb"] * len(bodies)


def other(name: str) -> str:
    return "words" if name == "near" else "near"


async def test_a_down_embedding_server_leaves_text_recall_working(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    async with FakeOpenAI() as fake:
        config = config_of(embedding="openai", base_url=fake.base_url, dimensions=8)
        config = store_backend.apply(config)
        async with SessionStore(tmp_path, config) as store:
            recall = Recall(store, config)
            await recall.open()
            fake.fail_next(503, "overloaded", times=3)  # the save's vector, the query's
            note = await recall.save(ALICE, "the spare key is under the blue pot")
            assert [h.id for h in await recall.search(ALICE, "spare key")] == [note]
            # Once it answers again, the waiting chunk gets its vector.
            await recall.indexer.catch_up()
            assert index_count(store_backend, tmp_path, "pending_vectors") == 0
            assert index_count(store_backend, tmp_path, "vectors") == 1
            await recall.close()


async def test_a_new_embedding_backend_reembeds_everything(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    config = store_backend.apply(config_of())
    async with SessionStore(tmp_path, config) as store:
        recall = Recall(store, config)
        await recall.open()
        await recall.save(ALICE, "first note about herons")
        await recall.save(ALICE, "second note about egrets")
        await recall.close()
    async with FakeOpenAI() as fake:
        other_config = store_backend.apply(config_of(embedding="openai", base_url=fake.base_url))
        async with SessionStore(tmp_path, other_config) as store:
            recall = Recall(store, other_config)
            await recall.open()
            await recall.indexer.catch_up()
            await recall.close()
    if store_backend.postgres:
        with psycopg.connect(store_backend.dsn or "") as conn:
            models = conn.execute(
                "SELECT model, count(*) FROM memory_vectors GROUP BY model"
            ).fetchall()
    else:
        memory = sqlite3.connect(tmp_path / MEMORY_DB)
        models = memory.execute("SELECT model, count(*) FROM vectors GROUP BY model").fetchall()
        memory.close()
    assert models == [("openai:text-embedding-3-small", 2)]  # the hash vectors replaced
    # And back: memory.db keeps no hash vector (recall derives them), PostgreSQL does.
    async with SessionStore(tmp_path, config) as store:
        recall = Recall(store, config)
        await recall.open()
        await recall.indexer.catch_up()
        hits = await recall.search(ALICE, "herons")
        await recall.close()
    assert [hit.text for hit in hits][:1] == ["first note about herons"]
    if store_backend.postgres:
        with psycopg.connect(store_backend.dsn or "") as conn:
            models = conn.execute(
                "SELECT model, count(*) FROM memory_vectors GROUP BY model"
            ).fetchall()
        assert models == [("hash-words:256", 2)]
    else:
        assert _count(tmp_path / MEMORY_DB, "vectors") == 0
        assert _count(tmp_path / MEMORY_DB, "pending_vectors") == 0


# --- the daemon: transcripts, forgetting -------------------------------------------------


@dataclass
class Gateway:
    runner: GatewayRunner
    client: GatewayClient
    home: Path
    backend: StorageBackend

    async def say(self, user: str, text: str) -> str:
        await self.client.post(f"dm-{user}", text, user_id=user)
        (reply,) = await self.client.replies(f"dm-{user}", 1)
        return reply


@pytest.fixture
async def gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Gateway]:
    config = store_backend.apply(config_of())
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], agent_factory=EchoAgent, home=tmp_path)
    await runner.start()
    gw = Gateway(runner, GatewayClient(adapter.url), tmp_path, store_backend)
    yield gw
    await gw.client.close()
    await runner.stop()


async def test_past_transcripts_are_recalled_for_their_user_only(gateway: Gateway) -> None:
    await gateway.say("alice", "my locker combination is 1234 pelican")
    await gateway.say("bob", "bob also likes the pelican")
    await gateway.runner.recall.indexer.catch_up()
    hits = await gateway.runner.recall.search(ALICE, "pelican locker")
    assert hits and all(hit.kind == "transcript" for hit in hits)
    assert "locker combination is 1234 pelican" in hits[0].text
    entry = await gateway.runner.store.get_entry("agent:main:http:dm:dm-alice")
    assert entry is not None and hits[0].session_id == entry.session_id
    assert hits[0].id.startswith("chunk-")
    assert all("bob" not in hit.text for hit in hits)
    assert all("locker" not in h.text for h in await gateway.runner.recall.search(BOB, "locker"))


async def test_undone_messages_are_not_recalled(gateway: Gateway) -> None:
    await gateway.say("alice", "the secret word is marmalade")
    await gateway.runner.recall.indexer.catch_up()
    assert await gateway.runner.recall.search(ALICE, "marmalade")
    await gateway.say("alice", "/undo")
    assert await gateway.runner.recall.search(ALICE, "marmalade") == []


@pytest.mark.sqlite_only
async def test_the_index_holds_exactly_the_indexable_messages(gateway: Gateway) -> None:
    """A round indexes its messages set-wise: each indexable message's chunks (the same
    words twice in a session are one chunk, linked from both), every chunk in the
    full-text index and with a vector of the current embedder; undone ones leave."""
    for text in ("apricot one", "apricot one", "a long message about figs " * 60, "gone soon"):
        await gateway.say("alice", text)
    await gateway.say("alice", "/undo")
    await gateway.say("bob", "apricot one")
    await gateway.runner.recall.indexer.catch_up()
    sessions = gateway.home / "sessions"
    memory = sqlite3.connect(sessions / MEMORY_DB)
    try:
        memory.execute("ATTACH DATABASE ? AS st", (str(sessions / "state.db"),))
        memory.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('integrity-check')")
        want_links = {
            (message_id, session_id, content_hash(text))
            for message_id, session_id, content in memory.execute(
                "SELECT id, session_id, content FROM st.messages"
                " WHERE role IN ('user', 'assistant') AND active"
            )
            for text in chunk_text(content)
        }
        links = set(
            memory.execute(
                "SELECT s.message_id, c.session_id, c.hash FROM chunk_sources s"
                " JOIN chunks c ON c.id = s.chunk_id"
            )
        )
        assert links == want_links
        chunks = memory.execute("SELECT count(*) FROM chunks").fetchone()[0]
        assert chunks == len({link[1:] for link in want_links})
        assert not any("gone soon" in link for link in memory.execute("SELECT text FROM chunks"))
        # the hash embedder's vectors are derived by recall (vector_cache), never stored
        assert memory.execute("SELECT count(*) FROM vectors").fetchone()[0] == 0
        assert memory.execute("SELECT count(*) FROM pending_vectors").fetchone()[0] == 0
        # the full-text index has a row (its `docsize` entry) for every chunk, no other
        indexed = memory.execute("SELECT id FROM chunks_fts_docsize ORDER BY id").fetchall()
        assert indexed == memory.execute("SELECT id FROM chunks ORDER BY id").fetchall()
        for (chunk_id,) in indexed:  # and finds each by its first word
            word = memory.execute("SELECT text FROM chunks WHERE id = ?", (chunk_id,))
            query = '"' + word.fetchone()[0].split()[0] + '"'
            assert (chunk_id,) in memory.execute(
                "SELECT rowid FROM chunks_fts WHERE chunks_fts MATCH ?", (query,)
            ).fetchall()
    finally:
        memory.close()


def test_an_older_memory_db_loses_its_full_text_triggers(tmp_path: Path) -> None:
    """memory.db files made before the triggers stopped writing chunks_fts: opened now,
    those triggers are gone, so a chunk's words are indexed once and removed once."""
    state = tmp_path / "state.db"
    sqlite3.connect(state).close()
    old = sqlite3.connect(tmp_path / MEMORY_DB)
    old.executescript(
        "CREATE TABLE chunks (id INTEGER PRIMARY KEY, namespace TEXT NOT NULL,"
        " kind TEXT NOT NULL, note_id TEXT, session_id TEXT, hash TEXT NOT NULL,"
        " text TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);"
        "CREATE VIRTUAL TABLE chunks_fts USING fts5(text, content='chunks', content_rowid='id');"
        "CREATE TRIGGER chunks_insert AFTER INSERT ON chunks BEGIN"
        " INSERT INTO chunks_fts(rowid, text) VALUES (new.id, new.text); END;"
        "CREATE TRIGGER chunks_delete AFTER DELETE ON chunks BEGIN"
        " INSERT INTO chunks_fts(chunks_fts, rowid, text) VALUES ('delete', old.id, old.text);"
        " END;"
    )
    old.close()
    conn = sqlite_index.connect(tmp_path / MEMORY_DB, state)
    try:
        triggers = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        }
        assert "chunks_insert" not in triggers and "chunks_delete" not in triggers
        conn.execute(
            "INSERT INTO chunks (namespace, kind, hash, text, created_at, updated_at)"
            " VALUES ('memory:main:http:alice', 'note', 'h', 'quince jelly', 0, 0)"
        )
        sqlite_index.SQLITE_INDEX.add_words(conn, 0, 1)
        assert conn.execute("SELECT count(*) FROM chunks_fts_docsize").fetchone()[0] == 1
        assert sqlite_index.SQLITE_INDEX.delete_chunks(conn, "kind = 'note'") == 1
        conn.execute("INSERT INTO chunks_fts(chunks_fts) VALUES ('integrity-check')")
        assert conn.execute("SELECT count(*) FROM chunks_fts_docsize").fetchone()[0] == 0
    finally:
        conn.close()


async def test_deleting_a_session_deletes_its_chunks_and_vectors(gateway: Gateway) -> None:
    await gateway.say("alice", "kumquat harvest notes")
    await gateway.runner.recall.indexer.catch_up()
    sessions = gateway.home / "sessions"
    backend = gateway.backend

    def holding(needle: str) -> list[str]:
        if backend.postgres:
            return pg_tables_holding(backend.dsn or "", needle)
        return tables_holding(sessions / MEMORY_DB, needle)

    assert holding("kumquat")
    assert index_count(backend, sessions, "chunks") == 2  # the message and its echo
    assert index_count(backend, sessions, "vectors") == stored_vectors(backend, 2)
    entry = await gateway.runner.store.get_entry("agent:main:http:dm:dm-alice")
    assert entry is not None
    done = await gateway.runner.delete_session(entry.session_id)
    assert done["status"] == "deleted"
    assert holding("kumquat") == []
    assert index_count(backend, sessions, "vectors") == 0
    assert index_count(backend, sessions, "chunks") == 0


@pytest.mark.sqlite_only
async def test_indexing_catches_up_after_memory_db_is_lost(tmp_path: Path) -> None:
    config = config_of()
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], agent_factory=EchoAgent, home=tmp_path)
    await runner.start()
    client = GatewayClient(adapter.url)
    await client.post("dm-alice", "remember the ocelot", user_id="alice")
    await client.replies("dm-alice", 1)
    await runner.recall.save(ALICE, "a note about the ocelot")
    await client.close()
    await runner.stop()
    for path in (tmp_path / "sessions").glob(MEMORY_DB + "*"):
        path.unlink()  # as if it never was: rebuilt from state.db
    runner = GatewayRunner(config, [HttpAdapter(config.platforms.http)], EchoAgent, home=tmp_path)
    await runner.start()
    try:
        await wait_for(lambda: _count(tmp_path / "sessions" / MEMORY_DB, "chunks") == 3)
        kinds = sorted(h.kind for h in await runner.recall.search(ALICE, "ocelot"))
        assert kinds == ["note", "transcript", "transcript"]
    finally:
        await runner.stop()


async def test_forgetting_a_user_leaves_nothing_of_theirs_in_any_table(gateway: Gateway) -> None:
    """`forget_user` on either backend: notes, sessions, transcripts, chunks and vectors
    of Alice (every agent) go, table by table; Bob's stay and are still recalled."""
    recall = gateway.runner.recall
    await recall.save(ALICE, "alice's wombat diary entry", ["diary"])
    await recall.save(Namespace("coder", "http", "alice"), "alice wombat code review")
    await recall.save(BOB, "bob's wombat list")
    await gateway.say("alice", "tell nobody about the wombat zeppelin")
    await gateway.say("bob", "bob wombat zeppelin too")
    await recall.indexer.catch_up()
    sessions, backend = gateway.home / "sessions", gateway.backend

    def holding(needle: str) -> list[str]:
        if backend.postgres:
            return pg_tables_holding(backend.dsn or "", needle)
        return [t for f in sorted(sessions.glob("*.db")) for t in tables_holding(f, needle)]

    assert holding("tell nobody") and holding("memory:coder:http:alice")
    gone = await recall.forget_user("http", "alice")
    assert (gone.notes, gone.sessions) == (2, 1) and gone.index_entries >= 3
    await recall.indexer.catch_up()
    for needle in ("tell nobody", "alice's wombat", "alice wombat", "memory:main:http:alice"):
        assert holding(needle) == [], needle
    assert holding("memory:coder:http:alice") == []
    # Bob: a note and two messages (his and the echo), each a chunk (with its vector)
    assert index_count(backend, sessions, "chunks") == 3
    assert index_count(backend, sessions, "vectors") == stored_vectors(backend, 3)
    assert next(h.text for h in await recall.search(BOB, "wombat")).startswith("bob")
    assert await recall.search(ALICE, "wombat") == []
    assert await notes_of(recall, ALICE) == []


async def test_forgetting_a_user_leaves_no_row_naming_them_and_twice_deletes_nothing(
    gateway: Gateway,
) -> None:
    """After `forget_user` not one row of any table names Alice (her id is in her chat's
    id, `dm-alice`): no session nor routing entry (none started in place of her current
    one), no journal row, no pairing; sessions.json neither. A second run deletes 0, and
    her next message starts a new session that is answered."""
    runner, backend = gateway.runner, gateway.backend
    sessions = gateway.home / "sessions"
    await runner.recall.save(ALICE, "a note of hers")
    await gateway.say("alice", "first words")
    await gateway.say("alice", "/new")
    await gateway.say("alice", "second words")
    await gateway.say("bob", "words of bob")
    code = await runner.pairing.request("http", "alice", "Alice Liddell")
    assert code is not None and await runner.pairing.approve("http", code) is not None
    assert await runner.pairing.request("http", "alice", "Alice Liddell")  # pending again
    await gateway.say("alice", "/status")  # the newest reply of all is hers
    await runner.recall.indexer.catch_up()

    async def holding(needle: str) -> list[str]:
        if backend.postgres:
            return pg_tables_holding(backend.dsn or "", needle)
        await runner.store.search_index.catch_up()
        await runner.store.flush_mirror()
        mirror = (sessions / "sessions.json").read_text()
        found = [t for f in sorted(sessions.glob("*.db")) for t in tables_holding(f, needle)]
        return found + (["sessions.json"] if needle in mirror else [])

    held = await holding("alice")
    assert {"sessions", "session_entries", "session_entry_docs", "inbox", "outbound"} <= {
        name.split(".")[0] for name in held
    }, held
    assert await holding("Liddell")
    gone = await runner.recall.forget_user("http", "alice")
    assert (gone.notes, gone.sessions) == (1, 2)
    await runner.recall.indexer.catch_up()
    assert await holding("alice") == []
    assert await holding("Liddell") == []
    assert gone.pairings == 2  # her approval and her pending code
    assert await runner.store.get_entry("agent:main:http:dm:dm-alice") is None
    assert await holding("words of bob")  # Bob's chat is his still

    again = await runner.recall.forget_user("http", "alice")
    assert again.total == 0, again
    assert await gateway.say("alice", "hello again") == "echo: hello again"
    entry = await runner.store.get_entry("agent:main:http:dm:dm-alice")
    assert entry is not None and not entry.is_fresh_reset


@pytest.mark.sqlite_only
async def test_memory_cli_lists_exports_and_forgets_a_user(gateway: Gateway) -> None:
    recall = gateway.runner.recall
    note = await recall.save(ALICE, "alice's wombat diary entry", ["diary"])
    await recall.save(Namespace("coder", "http", "alice"), "alice wombat code review")
    await recall.save(BOB, "bob's wombat list")
    await gateway.say("alice", "tell nobody about the wombat zeppelin")
    await gateway.say("bob", "bob wombat zeppelin too")
    await recall.indexer.catch_up()

    listed = await asyncio.to_thread(cli, gateway.home, "memory", "list", "--user", "http:alice")
    assert listed.returncode == 0, listed.stderr
    assert note in listed.stdout and "wombat code review" in listed.stdout
    one_agent = await asyncio.to_thread(
        cli, gateway.home, "memory", "export", "--user", "http:alice", "--agent", "main"
    )
    doc = json.loads(one_agent.stdout)
    assert [n["id"] for n in doc["notes"]] == [note] and doc["notes"][0]["tags"] == ["diary"]
    bad = await asyncio.to_thread(cli, gateway.home, "memory", "list", "--user", "alice")
    assert bad.returncode == 2 and "PLATFORM:USER_ID" in bad.stderr

    sessions = gateway.home / "sessions"
    files = sorted(p for p in sessions.glob("*.db"))
    assert [p.name for p in files] == ["memory.db", "search.db", "state.db"]
    assert any(tables_holding(f, "zeppelin") for f in files)  # the check can see it ...
    unasked = await asyncio.to_thread(
        cli, gateway.home, "memory", "delete", "--user", "http:alice", "--all"
    )
    assert unasked.returncode == 1 and "--yes" in unasked.stderr
    gone = await asyncio.to_thread(
        cli, gateway.home, "memory", "delete", "--user", "http:alice", "--all", "--yes", "--json"
    )
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["deleted"] >= 3
    await recall.indexer.catch_up()
    # ... and finds nothing of Alice's now, table by table in every database file.
    for path in files:
        for needle in ("tell nobody", "alice's wombat", "alice wombat", "memory:main:http:alice"):
            assert tables_holding(path, needle) == [], (path.name, needle)
    memory = sessions / MEMORY_DB
    assert tables_holding(memory, "alice") == []
    assert _count(memory, "chunks") == 3  # Bob: note, 2 messages
    assert _count(memory, "vectors") == 0  # the hash embedder's are derived (vector_cache)
    assert next(h.text for h in await recall.search(BOB, "wombat")).startswith("bob")
    assert await recall.search(ALICE, "wombat") == []
    assert await notes_of(recall, ALICE) == []


@pytest.mark.sqlite_only
async def test_memory_cli_deletes_one_note(gateway: Gateway) -> None:
    keep = await gateway.runner.recall.save(ALICE, "keep this one")
    drop = await gateway.runner.recall.save(ALICE, "drop this one")
    wrong = await asyncio.to_thread(
        cli, gateway.home, "memory", "delete", "--user", "http:bob", drop
    )
    assert wrong.returncode == 1 and "has no note" in wrong.stderr
    done = await asyncio.to_thread(
        cli, gateway.home, "memory", "delete", "--user", "http:alice", drop
    )
    assert done.returncode == 0, done.stderr
    assert [n["id"] for n in await notes_of(gateway.runner.recall, ALICE)] == [keep]
    assert await gateway.runner.recall.search(ALICE, "drop") == []


def _count(db: Path, table: str) -> int:
    if not db.exists():
        return -1
    conn = sqlite3.connect(db)
    try:
        return conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    except sqlite3.OperationalError:
        return -1
    finally:
        conn.close()
