"""TurnLog's begin/finish pair on a real store: the entry is saved once per turn, from
memory when nothing else changed it, and never over a change made during the turn."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import Platform, SessionEntry, SessionSource, TokenUsage
from gateway.store import journal
from gateway.store.entries import COUNTERS
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog
from tests.test_disk_full import BIG, SimulatedFullDisk
from tests.waiting import wait_for

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
USAGE = TokenUsage(input_tokens=7, output_tokens=3)


@pytest.fixture
async def store(tmp_path: Path):
    async with SessionStore(tmp_path / "sessions", CONFIG) as opened:
        yield opened


async def run_turn(log: TurnLog, text: str, message_id: str, between=None) -> str:
    key = log.store.session_key_for(SOURCE)
    event = MessageEvent(source=SOURCE, text=text, message_id=message_id)
    start = await log.begin(event, key, text)
    if between is not None:
        await between(key)
    await log.finish(key, start, event, reply=f"echo: {text}", usage=USAGE, chunks=["x"])
    return key


async def test_an_existing_session_is_saved_once_with_the_turns_counters(
    store: SessionStore,
) -> None:
    log = TurnLog(store)
    key = await run_turn(log, "one", "m1")
    first = await store.get_entry(key)
    await run_turn(log, "two", "m2")
    second = await store.get_entry(key)
    assert first is not None and second is not None
    assert second.session_id == first.session_id
    assert (second.input_tokens, second.output_tokens, second.total_tokens) == (14, 6, 20)
    assert second.updated_at > first.updated_at
    assert second.last_prompt_tokens == 7


async def test_a_change_made_during_the_turn_is_kept(store: SessionStore) -> None:
    log = TurnLog(store)
    await run_turn(log, "one", "m1")

    async def finalize(key: str) -> None:
        assert await store.set_expiry_finalized(key, True)

    key = await run_turn(log, "two", "m2", between=finalize)
    entry = await store.get_entry(key)
    assert entry is not None
    assert entry.expiry_finalized  # the compare-and-set saw the change and merged into it
    assert entry.total_tokens == 20


async def test_a_session_replaced_during_the_turn_is_left_alone(store: SessionStore) -> None:
    log = TurnLog(store)
    await run_turn(log, "one", "m1")
    replaced: list[str] = []

    async def reset(key: str) -> None:
        new = await store.reset_session(key)
        assert new is not None
        replaced.append(new.session_id)

    key = await run_turn(log, "two", "m2", between=reset)
    entry = await store.get_entry(key)
    assert entry is not None
    assert entry.session_id == replaced[0]
    assert entry.total_tokens == 0  # the old session's turn does not count on the new one


async def test_expire_never_lets_a_reply_seq_be_handed_out_again(store: SessionStore) -> None:
    log = TurnLog(store)
    ids = await log.record_reply(SOURCE, ["a", "b", "c"], None)
    for delivery_id in ids:
        await log.mark_sent(delivery_id, None)
    await store.write(lambda conn: conn.execute("UPDATE outbound SET created_at = 0"))
    assert await log.expire(1) == 2  # the newest stays: it holds the seq counter
    [later] = await log.record_reply(SOURCE, ["d"], None)
    assert later > max(ids)


async def test_expire_forgets_old_finished_rows_page_by_page(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "EXPIRE_PAGE", 2)  # 5 and 3 rows: several pages each

    def seed(conn: sqlite3.Connection) -> None:
        inbox = (
            "INSERT INTO inbox (platform, chat_id, message_id, session_key, kind, event,"
            " state, accepted_at) VALUES ('local', 'c1', ?, 'k', 'turn', '{}', ?, ?)"
        )
        for i in range(5):
            conn.execute(inbox, (f"old{i}", "done", 0))
        conn.execute(inbox, ("open", "accepted", 0))  # still being answered: kept
        conn.execute(inbox, ("new", "done", time.time()))  # inside the window: kept
        outbound = (
            "INSERT INTO outbound (platform, chat_id, target, text, session_key, state,"
            " created_at) VALUES ('local', 'c1', '{}', 'x', 'k', ?, 0)"
        )
        for _ in range(3):
            conn.execute(outbound, ("sent",))
        conn.execute(outbound, ("pending",))  # never acknowledged: kept

    await store.write(seed)
    assert await TurnLog(store).expire(1) == 8
    left = await store.read(
        lambda conn: (
            sorted(r[0] for r in conn.execute("SELECT message_id FROM inbox")),
            [r[0] for r in conn.execute("SELECT state FROM outbound")],
        )
    )
    assert left == (["new", "open"], ["pending"])


async def test_a_continuing_sessions_turn_writes_columns_not_the_entry_json(
    store: SessionStore,
) -> None:
    log = TurnLog(store)
    key = await run_turn(log, "one", "m1")
    statements: list[str] = []
    store._db.trace_writes(statements.append)
    await run_turn(log, "two", "m2")
    store._db.trace_writes(None)
    touching = [sql for sql in statements if "session_entries" in sql]
    assert touching and all(not re.search(r"\bentry\b", sql) for sql in touching), touching
    # What is on disk (another connection, as after kill -9): the JSON lags, the columns
    # hold both turns; every reader takes the columns.
    conn = sqlite3.connect(store.db_path)
    try:
        (raw,) = conn.execute(
            "SELECT entry FROM session_entries WHERE session_key = ?", (key,)
        ).fetchone()
    finally:
        conn.close()
    assert json.loads(raw)["total_tokens"] == 0
    entry = await store.get_entry(key)
    assert entry is not None and entry.total_tokens == 20 and entry.last_prompt_tokens == 7
    [listed] = await store.list_sessions()
    assert listed.total_tokens == 20 and listed.updated_at == entry.updated_at
    found = await store.lookup_by_session_id(entry.session_id)
    assert found is not None and found.total_tokens == 20
    async with SessionStore(store.sessions_dir, CONFIG) as other:  # `sessions list`
        [seen] = await other.list_sessions()
    assert seen.total_tokens == 20 and seen.updated_at == entry.updated_at
    await store.flush_mirror()
    mirrored = json.loads(store.json_path.read_text())[key]
    assert mirrored["total_tokens"] == 20 and mirrored["input_tokens"] == 14
    assert SessionEntry.from_dict(mirrored) == entry
    await store.close()  # at rest, the JSON itself is whole again
    conn = sqlite3.connect(store.db_path)
    try:
        (raw,) = conn.execute(
            "SELECT entry FROM session_entries WHERE session_key = ?", (key,)
        ).fetchone()
    finally:
        conn.close()
    assert SessionEntry.from_dict(json.loads(raw)) == entry


async def test_a_refused_batch_leaves_no_uncommitted_entry_cached(store: SessionStore) -> None:
    log = TurnLog(store)
    key = store.session_key_for(SOURCE)
    text = "x" * BIG  # needs pages a full disk does not have
    event = MessageEvent(source=SOURCE, text=text, message_id="m1")
    inbox_id = await log.accept(event, key, "turn")
    assert inbox_id is not None
    event = replace(event, inbox_ids=(inbox_id,))
    store._db.retry_interval = 0.05
    disk = SimulatedFullDisk(store._db)
    disk.fill()
    # Routed to a new session, then refused at the user message: parked, tried again.
    begin = asyncio.create_task(log.begin(event, key, text))
    await wait_for(lambda: store.write_health()["state"] == "unwritable")
    disk.free()
    start = await asyncio.wait_for(begin, 10)
    assert start.written  # the new session is written now, not taken from the cache
    await log.finish(key, start, event, reply="ok", usage=USAGE, chunks=["ok"])
    entry = await store.get_entry(key)
    assert entry is not None and entry.total_tokens == 10
    assert [m["content"] for m in await store.load_transcript(entry.session_id)] == [text, "ok"]


async def test_a_database_from_before_the_live_columns_keeps_its_counters(
    tmp_path: Path,
) -> None:
    sessions = tmp_path / "sessions"
    async with SessionStore(sessions, CONFIG) as store:
        key = await run_turn(TurnLog(store), "one", "m1")
        assert await store.update_session(key, 7, usage=USAGE)  # the JSON saved whole
    conn = sqlite3.connect(sessions / "state.db")
    # Back to schema 6: a current session's counters only in its entry's JSON.
    conn.execute("ALTER TABLE sessions DROP COLUMN last_prompt_tokens")
    conn.execute("ALTER TABLE sessions DROP COLUMN entry_lags")
    conn.execute(f"UPDATE sessions SET {', '.join(f'{n} = 0' for n in COUNTERS)}")
    conn.execute("PRAGMA user_version = 6")
    conn.commit()
    conn.close()
    async with SessionStore(sessions, CONFIG) as store:
        entry = await store.get_entry(key)
    assert entry is not None and entry.total_tokens == 20 and entry.last_prompt_tokens == 7
