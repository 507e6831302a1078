"""Schema 7: a session entry is a narrow hot row (what a turn reads and changes) and a cold
row (origin, display name, platform, chat type). A v6 file's entry JSON migrates field
for field, a turn writes the hot row only, and sessions.json built from both rows reads
back as the same entries."""

from __future__ import annotations

import shutil
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import Platform, SessionEntry, SessionSource, TokenUsage
from gateway.store import codec, entries
from gateway.store.migrations import _MIGRATIONS, SCHEMA_VERSION, _split_sql
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog

CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
USAGE = TokenUsage(input_tokens=7, output_tokens=3, estimated_cost_usd=0.1)


def varied_entries() -> list[SessionEntry]:
    """Entries whose every field differs from its default somewhere: microseconds (and
    none, and the last one before a whole second), a cost that 15 digits do not hold,
    non-ASCII names, each flag set, each optional field present and absent."""
    base = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    group = SessionSource(
        platform=Platform.DISCORD,
        chat_id="g-1",
        chat_type="group",
        user_id="u-2",
        user_name="Zoë",
        chat_name='Ünïcode "quoted" chat',
        thread_id="t-9",
    )
    return [
        SessionEntry(
            session_key="agent:main:discord:group:g-1",
            session_id="20260501_120000_0000abcd",
            created_at=base + timedelta(microseconds=123456),
            updated_at=base + timedelta(seconds=5, microseconds=999999),
            origin=group,
            display_name='Ünïcode "quoted" chat',
            platform=Platform.DISCORD,
            chat_type="group",
            input_tokens=120,
            output_tokens=34,
            cache_read_tokens=5,
            cache_write_tokens=6,
            total_tokens=154,
            estimated_cost_usd=0.1 + 0.2,
            cost_status="estimated",
            last_prompt_tokens=77,
            was_auto_reset=True,
            auto_reset_reason="idle",
            reset_had_activity=True,
            is_fresh_reset=True,
            expiry_finalized=True,
            suspended=False,
            resume_pending=True,
            resume_reason="restart_timeout",
            last_resume_marked_at=base + timedelta(seconds=7, microseconds=1),
        ),
        SessionEntry(
            session_key="agent:main:telegram:dm:42",
            session_id="20260501_120001_0000beef",
            created_at=base,
            updated_at=base + timedelta(minutes=3),
            origin=SessionSource(platform=Platform.TELEGRAM, chat_id="42", user_id="42"),
            platform=Platform.TELEGRAM,
            suspended=True,
        ),
        SessionEntry(  # as an import of an old, sparse sessions.json may leave it
            session_key="agent:main:local:dm:bare",
            session_id="20260501_120002_0000cafe",
            created_at=base + timedelta(microseconds=500000),
            updated_at=base + timedelta(microseconds=500001),
        ),
    ]


def by_key(found: list[SessionEntry]) -> dict[str, SessionEntry]:
    return {entry.session_key: entry for entry in found}


# --- v6 -> v7 ------------------------------------------------------------------------------


def write_v6_file(path: Path, stored: list[SessionEntry], garbled: tuple[str, str]) -> None:
    """A state.db as schema 6 wrote it: each entry's JSON in `entry`, a few fields copied
    into columns. `garbled` (key, session id) gets an entry JSON that does not parse."""
    conn = sqlite3.connect(path)
    for version in range(1, 7):
        step = _MIGRATIONS[version]
        assert isinstance(step, str)
        for statement in _split_sql(step):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=6")
    rows = [
        (
            e.session_key,
            e.session_id,
            e.updated_at.timestamp(),
            entries.minute_of(e.updated_at),
            int(e.suspended),
            int(e.resume_pending),
            int(e.expiry_finalized),
            codec.dumps(e.to_dict()),
        )
        for e in stored
    ]
    key, session_id = garbled
    rows.append((key, session_id, 1.5e9, int(1.5e9 // 60), 0, 1, 0, '{"session_id": 3'))
    conn.executemany("INSERT INTO session_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    for e in stored:
        conn.execute(
            "INSERT INTO sessions (session_id, session_key, started_at) VALUES (?, ?, ?)",
            (e.session_id, e.session_key, e.created_at.timestamp()),
        )
    conn.commit()
    conn.close()


async def test_a_v6_file_migrates_with_every_entry_field_kept(tmp_path: Path) -> None:
    stored = varied_entries()
    write_v6_file(tmp_path / "state.db", stored, ("agent:main:local:dm:garbled", "sid-g"))

    async with SessionStore(tmp_path, CONFIG) as store:
        version = await store.read(lambda c: c.execute("PRAGMA user_version").fetchone()[0])
        found = by_key(await store.list_sessions())
        columns = await store.read(
            lambda c: [row[1] for row in c.execute("PRAGMA table_info(session_entries)")]
        )
        indexes = await store.read(
            lambda c: {row[1] for row in c.execute("PRAGMA index_list(session_entries)")}
        )
    assert version == SCHEMA_VERSION >= 9  # every later migration ran too
    for entry in stored:
        assert found[entry.session_key] == entry, entry.session_key
        # equal as instants is not enough: the microseconds themselves must survive
        assert found[entry.session_key].updated_at.microsecond == entry.updated_at.microsecond
    # The entry that did not parse keeps its key's session and what its columns held.
    garbled = found["agent:main:local:dm:garbled"]
    assert (garbled.session_id, garbled.resume_pending) == ("sid-g", True)
    assert garbled.updated_at == datetime.fromtimestamp(1.5e9, UTC)
    assert "entry" not in columns
    assert {"session_entries_by_session_id", "session_entries_by_minute"} <= indexes


# --- the turn's writes ---------------------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path):
    async with SessionStore(tmp_path / "sessions", CONFIG) as opened:
        yield opened


def event(message_id: str) -> MessageEvent:
    return MessageEvent(source=SOURCE, text="hi", message_id=message_id)


async def traced(store: SessionStore, step) -> tuple[list[str], object]:
    statements: list[str] = []
    store._db.trace_writes(statements.append)
    try:
        result = await step()
    finally:
        store._db.trace_writes(None)
    return statements, result


async def test_a_continuing_turn_writes_only_the_hot_row(store: SessionStore) -> None:
    log = TurnLog(store)
    key = store.session_key_for(SOURCE)
    first = await log.begin(event("m1"), key, "hi")
    await log.finish(key, first, event("m1"), reply="one", usage=USAGE, chunks=["one"])

    began, start = await traced(store, lambda: log.begin(event("m2"), key, "hi"))
    finished, _ = await traced(
        store,
        lambda: log.finish(key, start, event("m2"), reply="two", usage=USAGE, chunks=["two"]),
    )

    assert first.fresh and not start.fresh
    assert start.entry.origin is None and start.entry.platform == SOURCE.platform
    assert not [s for s in began + finished if "session_entry_docs" in s]
    [read] = [s for s in began if "session_entries" in s]
    assert read.lstrip().upper().startswith("SELECT") and " JOIN " not in read.upper()
    [update] = [s for s in finished if "session_entries" in s]
    assert update.lstrip().upper().startswith("UPDATE SESSION_ENTRIES")
    entry = await store.get_entry(key)
    assert entry is not None
    assert entry.origin == SOURCE  # the cold row still holds what the first turn wrote
    assert (entry.input_tokens, entry.total_tokens, entry.last_prompt_tokens) == (14, 20, 7)
    assert entry.estimated_cost_usd == 0.1 + 0.1 and entry.cost_status == "estimated"


async def test_a_reset_between_begin_and_finish_is_not_overwritten(
    store: SessionStore,
) -> None:
    log = TurnLog(store)
    key = store.session_key_for(SOURCE)
    first = await log.begin(event("m1"), key, "hi")
    await log.finish(key, first, event("m1"), reply="one", usage=USAGE, chunks=["one"])
    start = await log.begin(event("m2"), key, "hi")
    reset = await store.reset_session(key, display_name="renamed")
    assert reset is not None and reset.is_fresh_reset

    await log.finish(key, start, event("m2"), reply="two", usage=USAGE, chunks=["two"])

    # A successful turn of the old session would have consumed is_fresh_reset, counted
    # its tokens and touched the row: the new session's entry shows none of that.
    assert await store.get_entry(key) == reset


async def test_a_failed_turn_keeps_its_flags_and_still_counts(store: SessionStore) -> None:
    log = TurnLog(store)
    key = store.session_key_for(SOURCE)
    first = await log.begin(event("m1"), key, "hi")
    await log.finish(key, first, event("m1"), reply="one", usage=None, chunks=["one"])
    assert await store.mark_resume_pending(key, "restart_timeout")
    start = await log.begin(event("m2"), key, "hi")

    await log.finish(key, start, event("m2"), reply=None, usage=USAGE, chunks=["error"])

    entry = await store.get_entry(key)
    assert entry is not None
    assert (entry.resume_pending, entry.resume_reason) == (True, "restart_timeout")
    assert entry.total_tokens == 10  # the first turn had no usage


# --- sessions.json -------------------------------------------------------------------------


async def test_the_mirror_reads_back_as_the_same_entries(tmp_path: Path) -> None:
    stored = varied_entries()
    first, second = tmp_path / "first", tmp_path / "second"

    async with SessionStore(first, CONFIG) as store:
        await store.write(lambda conn: [entries.start_session_row(conn, e) for e in stored])
        await store.write(lambda conn: [entries.save_entry(conn, e) for e in stored])
        assert by_key(await store.list_sessions()) == by_key(stored)
    second.mkdir()
    shutil.copy(first / "sessions.json", second / "sessions.json")

    mirror = codec.loads((second / "sessions.json").read_bytes())
    assert mirror == {e.session_key: e.to_dict() for e in stored}  # the seed format itself
    async with SessionStore(second, CONFIG) as store:  # no state.db: imported from it
        assert by_key(await store.list_sessions()) == by_key(stored)
