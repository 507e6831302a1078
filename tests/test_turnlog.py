"""TurnLog's begin/finish pair on a real store: the entry is saved once per turn, from
memory when nothing else changed it, and never over a change made during the turn."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import Platform, SessionSource, TokenUsage
from gateway.store import journal
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog
from tests.pg_support import StorageBackend

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
USAGE = TokenUsage(input_tokens=7, output_tokens=3)


@pytest.fixture
async def store(tmp_path: Path, store_backend: StorageBackend):
    """The journal on each backend (`store_backend`, tests/conftest.py)."""
    async with SessionStore(tmp_path / "sessions", store_backend.apply(CONFIG)) as opened:
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
