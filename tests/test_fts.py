"""The transcript full-text index is kept up in batches (gateway.fts): findable after a
pass, never damaged by deleting a message it has not indexed yet, and carried over from
a version-3 database whose trigger indexed every message at once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from config import GatewayConfig
from gateway import fts
from gateway.db import _MIGRATIONS, _split_sql
from gateway.session import Platform, SessionSource
from gateway.store import SessionStore

CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")


def hits(conn: sqlite3.Connection, word: str) -> list[int]:
    return [
        row[0]
        for row in conn.execute(
            "SELECT rowid FROM messages_fts WHERE messages_fts MATCH ? ORDER BY rowid", (word,)
        )
    ]


def fts_sound(conn: sqlite3.Connection) -> bool:
    # FTS5 runs its integrity check as an INSERT command, hence a write.
    try:
        conn.execute("INSERT INTO messages_fts(messages_fts, rank) VALUES('integrity-check', 1)")
    except sqlite3.DatabaseError:
        return False
    return True


async def test_messages_are_findable_after_an_indexing_pass(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        first = await store.append_to_transcript(
            entry.session_id, {"role": "user", "content": "zebra crossing"}
        )
        assert await store.read(lambda c: hits(c, "zebra")) == []  # pending, not indexed
        assert await store.write(fts.index_pending) == 1
        assert await store.read(lambda c: hits(c, "zebra")) == [first]
        assert await store.write(fts.index_pending) == 0


async def test_a_crash_before_indexing_is_caught_up_at_open(tmp_path: Path) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        row = await store.append_to_transcript(
            entry.session_id, {"role": "user", "content": "walrus"}
        )
    # close() does not index; the next open does.
    async with SessionStore(tmp_path, CONFIG) as store:
        assert await store.read(lambda c: hits(c, "walrus")) == [row]
        assert await store.read(
            lambda c: c.execute("SELECT COUNT(*) FROM fts_pending").fetchone()
        ) == (0,)
        assert await store.write(fts_sound)


async def test_deleting_indexed_and_pending_messages_keeps_the_index_sound(
    tmp_path: Path,
) -> None:
    async with SessionStore(tmp_path, CONFIG) as store:
        entry = await store.get_or_create_session(SOURCE)
        sid = entry.session_id
        indexed = await store.append_to_transcript(sid, {"role": "user", "content": "otter"})
        await store.write(fts.index_pending)
        pending = await store.append_to_transcript(sid, {"role": "user", "content": "otter two"})

        def delete_both(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM messages WHERE id IN (?, ?)", (indexed, pending))

        await store.write(delete_both)
        assert await store.read(lambda c: hits(c, "otter")) == []
        assert await store.write(fts_sound)
        # A new message may even get a reused id; it is indexed as itself.
        again = await store.append_to_transcript(sid, {"role": "user", "content": "heron"})
        await store.write(fts.index_pending)
        assert await store.read(lambda c: hits(c, "heron")) == [again]
        assert await store.write(fts_sound)


async def test_a_version_3_database_keeps_its_index(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db)
    for version in (1, 2, 3):
        for statement in _split_sql(_MIGRATIONS[version]):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=3")
    conn.execute("INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s1', 'k', 0)")
    conn.execute(
        "INSERT INTO messages (session_id, role, content, message, created_at)"
        " VALUES ('s1', 'user', 'badger', '{}', 0)"
    )
    conn.commit()
    conn.close()

    async with SessionStore(tmp_path, CONFIG) as store:
        assert await store.read(lambda c: c.execute("PRAGMA user_version").fetchone()[0]) == 4
        assert await store.read(lambda c: hits(c, "badger")) == [1]  # indexed by version 3
        await store.write(lambda c: c.execute("DELETE FROM messages WHERE id = 1"))
        assert await store.read(lambda c: hits(c, "badger")) == []
        assert await store.write(fts_sound)
