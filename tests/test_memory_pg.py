"""Long-term memory with the store on PostgreSQL, where the index is the store's
`memory_*` tables (gateway.memory.pg_index) shared by every replica. What only that
backend has: several replicas indexing one database, log entries that commit out of
their sequence order, the advisory lock, and `fts_log` kept trimmed without a search
indexer. A real server (skipped, with the reason, when none answers), a schema per test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest

from config import GatewayConfig
from gateway.memory import pg_index
from gateway.memory.recall import Namespace, Recall
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from gateway.util.pg_scope import LOCK_KEY_SQL
from tests.pg_support import fresh_schema
from tests.waiting import wait_for

ALICE = Namespace("main", "http", "alice")
BOB = Namespace("main", "http", "bob")


@pytest.fixture
def dsn() -> Iterator[str]:
    with fresh_schema() as schema_dsn:
        yield schema_dsn


def config_on(dsn: str, **memory: Any) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "memory": {"index_transcripts": True, **memory},
            "storage": {"backend": "postgres", "dsn": dsn},
        }
    )


@asynccontextmanager
async def replica(tmp_path: Any, dsn: str, name: str, **memory: Any) -> AsyncIterator[Recall]:
    """One gateway replica's store and recall on the shared database."""
    config = config_on(dsn, **memory)
    async with SessionStore(tmp_path / name, config) as store:
        recall = Recall(store, config)
        await recall.open()
        try:
            yield recall
        finally:
            await recall.close()


def scalar(dsn: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
        return row[0] if row else None


async def test_two_replicas_indexing_at_once_build_one_exact_index(tmp_path: Any, dsn: str) -> None:
    async with (
        replica(tmp_path, dsn, "one") as one,
        replica(tmp_path, dsn, "two") as two,
    ):
        saves = [
            (one if i % 2 else two).save(ALICE if i % 3 else BOB, f"note {i} about herons {i}")
            for i in range(40)
        ]
        ids = await asyncio.gather(*saves)
        # Both replicas' background loops too, and both catching up at once.
        one.indexer.start()
        two.indexer.start()
        await asyncio.gather(one.indexer.catch_up(), two.indexer.catch_up())
        for recall in (one, two):
            hits = await recall.search(ALICE, "herons", k=50)
            assert sorted(h.id for h in hits) == sorted(note for i, note in enumerate(ids) if i % 3)
            assert all(h.text.startswith("note") for h in hits)
            bob = await recall.search(BOB, "herons", k=50)
            assert sorted(h.id for h in bob) == sorted(ids[i] for i in range(0, 40, 3))
    # One chunk per note (none indexed twice), each with one vector; both logs taken.
    assert scalar(dsn, "SELECT count(*) FROM memory_chunks") == 40
    assert scalar(dsn, "SELECT count(DISTINCT note_id) FROM memory_chunks") == 40
    assert scalar(dsn, "SELECT count(*) FROM memory_vectors") == 40
    assert scalar(dsn, "SELECT count(*) FROM memory_pending_vectors") == 0
    assert scalar(dsn, "SELECT count(*) FROM note_log") == 0


async def test_a_log_entry_committed_after_a_later_one_is_not_lost(tmp_path: Any, dsn: str) -> None:
    """Another replica's transaction takes note_log's seq n, this one's n + 1 commits
    first and is indexed; n commits later and is indexed too (a round that stored
    "applied up to n + 1" would have skipped it for good)."""
    async with replica(tmp_path, dsn, "one") as recall:
        slow = psycopg.connect(dsn)
        try:
            slow.execute(
                "INSERT INTO notes (note_id, namespace, agent_id, platform, user_id, content,"
                " tags, created_at, updated_at) VALUES ('note-slow', %s, 'main', 'http',"
                " 'alice', 'the slow pelican', '[]', 0, 0)",
                (str(ALICE),),
            )
            fast = await recall.save(ALICE, "the fast pelican")
            assert [h.id for h in await recall.search(ALICE, "pelican")] == [fast]
            slow.commit()
        finally:
            slow.close()
        hits = await recall.search(ALICE, "pelican")
        assert sorted(h.id for h in hits) == sorted([fast, "note-slow"])


def lock_waiters(dsn: str, key: int) -> int:
    """Backends waiting for the advisory lock `key` (a bigint: two 32-bit halves)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        ).fetchone()
    return int(row[0]) if row else 0


async def test_a_round_held_by_another_replica_is_skipped_by_the_loop_and_awaited_by_a_search(
    tmp_path: Any, dsn: str
) -> None:
    async with replica(tmp_path, dsn, "one") as recall:
        note = await recall.save(ALICE, "ibis migration dates")
        other = psycopg.connect(dsn)
        try:
            # The same schema's key: what another replica of this store takes.
            lock = {"key": pg_index.LOCK_KEY}
            other.execute(f"SELECT pg_advisory_xact_lock({LOCK_KEY_SQL})", lock)
            await recall.store.write(
                lambda conn: conn.execute(
                    "UPDATE notes SET content = 'ibis and stork dates' WHERE note_id = ?", (note,)
                ),
                dirty=False,
            )
            started = time.monotonic()
            assert await recall.indexer.catch_up(wait=False, embed=False) == 0
            assert time.monotonic() - started < 2
            waiting = asyncio.ensure_future(recall.search(ALICE, "stork"))
            key = other.execute(f"SELECT {LOCK_KEY_SQL}", lock).fetchone()[0]
            await wait_for(lambda: lock_waiters(dsn, key) == 1)
            assert not waiting.done()  # waits for the other replica's round
            other.commit()  # its round ends: the lock is released
            hits = await asyncio.wait_for(waiting, 10)
        finally:
            other.close()
        assert [h.id for h in hits] == [note]


async def _message(store: SessionStore, user: str, text: str) -> None:
    source = SessionSource(platform=Platform.HTTP, chat_id=f"dm-{user}", user_id=user)
    entry = await store.get_or_create_session(source)
    await store.append_to_transcript(entry.session_id, {"role": "user", "content": text})


async def test_fts_log_is_kept_trimmed_with_transcripts_on_and_off(tmp_path: Any, dsn: str) -> None:
    async with replica(tmp_path, dsn, "on") as recall:
        for i in range(5):
            await _message(recall.store, "alice", f"gannet sighting {i}")
        assert scalar(dsn, "SELECT count(*) FROM fts_log") == 5
        hits = await recall.search(ALICE, "gannet", k=10)
        assert len(hits) == 5 and {h.kind for h in hits} == {"transcript"}
        assert scalar(dsn, "SELECT count(*) FROM fts_log") == 0
        assert scalar(dsn, "SELECT applied FROM log_readers WHERE name = 'memory'") >= 5
    async with replica(tmp_path, dsn, "off", index_transcripts=False) as recall:
        for i in range(5):
            await _message(recall.store, "alice", f"more gannets {i}")
        await recall.indexer.catch_up()
        # Nobody reads the log with transcripts off: it is emptied, not left to grow.
        assert scalar(dsn, "SELECT count(*) FROM fts_log") == 0
        assert scalar(dsn, "SELECT count(*) FROM memory_chunks WHERE kind = 'transcript'") == 0
        assert scalar(dsn, "SELECT count(*) FROM log_readers WHERE name = 'memory'") == 0
        assert await recall.search(ALICE, "gannet") == []
    async with replica(tmp_path, dsn, "again") as recall:  # on again: rebuilt
        hits = await recall.search(ALICE, "gannet gannets", k=20)
        assert len(hits) == 10


async def test_a_lost_index_is_rebuilt_from_the_store(tmp_path: Any, dsn: str) -> None:
    async with replica(tmp_path, dsn, "one") as recall:
        await recall.save(ALICE, "a note about the ocelot")
        await _message(recall.store, "alice", "remember the ocelot")
        await recall.indexer.catch_up()
    with psycopg.connect(dsn) as conn:  # as after `storage migrate`: no index at all
        conn.execute("DELETE FROM memory_chunks")
        conn.execute("DELETE FROM memory_meta WHERE key <> 'vector_deletes'")
    async with replica(tmp_path, dsn, "two") as recall:
        kinds = sorted(h.kind for h in await recall.search(ALICE, "ocelot"))
        assert kinds == ["note", "transcript"]
    assert scalar(dsn, "SELECT count(*) FROM memory_vectors") == 2
