"""The transcript full-text index lives in search.db (gateway.store.fts): every message that
exists is findable after a round, no message that is gone is, a crash or a lost
search.db costs nothing but a rebuild, and older databases carry over."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import pytest

from config import GatewayConfig
from gateway.session import Platform, SessionSource
from gateway.store import fts
from gateway.store.migrations import _MIGRATIONS, SCHEMA_VERSION, _split_sql
from gateway.store.session_store import SessionStore

CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")


def search(sessions: Path, word: str) -> list[int]:
    conn = sqlite3.connect(f"file:{sessions / fts.SEARCH_DB}?mode=ro", uri=True)
    try:
        return [
            row[0]
            for row in conn.execute(
                "SELECT rowid FROM messages_fts WHERE messages_fts MATCH ? ORDER BY rowid",
                (word,),
            )
        ]
    finally:
        conn.close()


def index_sound(sessions: Path) -> bool:
    conn = sqlite3.connect(sessions / fts.SEARCH_DB)
    try:
        conn.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES('integrity-check', 1)")
        return True
    except sqlite3.DatabaseError:
        return False
    finally:
        conn.close()


async def log_length(store: SessionStore) -> int:
    return await store.read(lambda c: c.execute("SELECT COUNT(*) FROM fts_log").fetchone()[0])


async def say(store: SessionStore, session_id: str, text: str) -> int:
    return await store.append_to_transcript(session_id, {"role": "user", "content": text})


async def test_messages_are_findable_after_a_round_and_the_log_is_trimmed(
    tmp_path: Path,
) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.stop()  # no background rounds: this test runs them
        await store.search_index.catch_up()
        entry = await store.get_or_create_session(SOURCE)
        first = await say(store, entry.session_id, "zebra crossing")
        assert await log_length(store) == 1
        assert await store.search_index.catch_up() == 1
        assert search(tmp_path, "zebra") == [first]
        assert await log_length(store) == 0  # trimmed behind the index
        assert await store.search_index.catch_up() == 0


def file_states(sessions: Path) -> dict[str, tuple[int, int]]:
    """Size and mtime of search.db and its -wal and -shm files."""
    return {
        path.name: (path.stat().st_size, path.stat().st_mtime_ns)
        for path in fts.search_files(sessions)
        if path.exists()
    }


async def test_a_round_with_nothing_new_writes_nothing(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.stop()  # no background rounds: this test runs them
        entry = await store.get_or_create_session(SOURCE)
        await say(store, entry.session_id, "ibis")
        assert await store.search_index.catch_up() == 1
        before = file_states(tmp_path)
        for _ in range(5):  # an idle gateway's rounds: nothing logged since
            assert await store.search_index.catch_up() == 0
        assert file_states(tmp_path) == before


async def test_deleted_messages_leave_the_index_even_with_a_reused_id(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        sid = entry.session_id
        indexed = await say(store, sid, "otter")
        await store.search_index.catch_up()
        unindexed = await say(store, sid, "otter two")

        def delete_both(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM messages WHERE id IN (?, ?)", (indexed, unindexed))

        await store.write(delete_both)
        # The highest id is free again: SQLite may hand it to the next message.
        again = await say(store, sid, "heron")
        await store.search_index.catch_up()
        assert search(tmp_path, "otter") == []
        assert search(tmp_path, "heron") == [again]
        assert index_sound(tmp_path)


async def test_a_crash_before_a_round_is_caught_up_after_the_restart(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.catch_up()
        await store.search_index.stop()  # as if killed before its next round
        entry = await store.get_or_create_session(SOURCE)
        row = await say(store, entry.session_id, "walrus")
    assert search(tmp_path, "walrus") == []
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.catch_up()
        assert search(tmp_path, "walrus") == [row]
        assert await log_length(store) == 0


async def test_a_lost_or_foreign_search_db_is_rebuilt(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        rows = [await say(store, entry.session_id, f"lynx {i}") for i in range(3)]
        await store.search_index.catch_up()
    for path in fts.search_files(tmp_path):
        path.unlink(missing_ok=True)
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.stop()  # no background rounds: this test runs them
        assert await store.search_index.catch_up() == 3  # every message, from state.db
        assert search(tmp_path, "lynx") == rows

    # An index ahead of state.db's log (state.db was rebuilt or restored) is not trusted.
    conn = sqlite3.connect(tmp_path / fts.SEARCH_DB)
    conn.execute("UPDATE meta SET value = value + 1000 WHERE key = 'applied_seq'")
    conn.execute("INSERT INTO messages_fts(rowid, content) VALUES (999, 'lynx ghost')")
    conn.commit()
    conn.close()
    async with SessionStore(tmp_path, CONFIG) as store:
        await store.search_index.catch_up()
        assert search(tmp_path, "lynx") == rows


async def test_a_damaged_search_db_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        row = await say(store, entry.session_id, "puffin")
    (tmp_path / fts.SEARCH_DB).write_bytes(b"not a database at all" * 100)
    async with SessionStore(tmp_path, CONFIG) as store:
        # The background task's first round fails on the damaged file, removes it, and
        # the next round rebuilds the index from state.db.
        found: list[int] = []
        for _ in range(200):  # bounded: about 4 s
            await asyncio.sleep(0.02)
            with contextlib.suppress(sqlite3.DatabaseError):
                if (found := search(tmp_path, "puffin")) == [row]:
                    break
        assert found == [row]


async def test_a_version_4_database_moves_its_index_out(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    for version in (1, 2, 3, 4):
        for statement in _split_sql(_MIGRATIONS[version]):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=4")
    conn.execute("INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s1', 'k', 0)")
    for word in ("badger", "beaver"):
        conn.execute(
            "INSERT INTO messages (session_id, role, content, message, created_at)"
            " VALUES ('s1', 'user', ?, '{}', 0)",
            (word,),
        )
    conn.commit()
    conn.close()

    async with SessionStore(tmp_path, CONFIG) as store:
        assert (
            await store.read(lambda c: c.execute("PRAGMA user_version").fetchone()[0])
            == SCHEMA_VERSION
        )
        tables = await store.read(
            lambda c: {row[0] for row in c.execute("SELECT name FROM sqlite_master")}
        )
        assert "fts_pending" not in tables and "messages_fts" not in tables
        await store.search_index.catch_up()
        assert search(tmp_path, "badger") == [1] and search(tmp_path, "beaver") == [2]
        await store.write(lambda c: c.execute("DELETE FROM messages WHERE id = 1"))
        await store.search_index.catch_up()
        assert search(tmp_path, "badger") == []
        assert index_sound(tmp_path)


async def test_closing_just_as_the_index_connects_leaves_no_connection_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A connection left open would hold state.db: its WAL would outlive the store and
    # `doctor` would think the gateway still runs.
    opened: list[sqlite3.Connection] = []
    real_connect = fts.connect

    def tracking_connect(search_path: Path, state_path: Path) -> sqlite3.Connection:
        opened.append(real_connect(search_path, state_path))
        return opened[-1]

    monkeypatch.setattr(fts, "connect", tracking_connect)
    store = await SessionStore(tmp_path, CONFIG).open()
    indexer = store.search_index
    for _ in range(100):  # bounded: the background task's first round starts connecting
        if indexer._inflight is not None:
            break
        await asyncio.sleep(0)
    assert indexer._inflight is not None and indexer._task is not None
    # The cancellation lands in the very pass in which the connect finishes.
    task = indexer._task
    indexer._inflight.add_done_callback(lambda _: task.cancel())
    await asyncio.wait({task})
    await store.close()
    assert opened
    for conn in opened:
        with pytest.raises(sqlite3.ProgrammingError):  # closed
            conn.execute("SELECT 1")
