"""SessionStore (gateway/store/session_store.py) on real SQLite files and on PostgreSQL
(`store_backend`, tests/conftest.py): every operation and rule."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import structlog
import time_machine

import gateway.store.session_store as store_module
from config import GatewayConfig
from gateway.session import Platform, SessionEntry, SessionSource, TokenUsage, build_session_key
from gateway.store.db import DatabaseError
from gateway.store.session_store import SessionStore
from tests.pg_support import StorageBackend

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
SESSION_ID = re.compile(r"^\d{8}_\d{6}_[0-9a-f]{8}$")

StoreFactory = Callable[..., Awaitable[SessionStore]]


def make_config(**overrides: Any) -> GatewayConfig:
    data: dict[str, Any] = {
        "timezone": "UTC",
        "session_reset": {"mode": "idle", "idle_minutes": 60},
    }
    data.update(overrides)
    return GatewayConfig.model_validate(data)


def dm(chat_id: str = "100", platform: Platform = Platform.TELEGRAM) -> SessionSource:
    return SessionSource(
        platform=platform,
        chat_id=chat_id,
        chat_type="dm",
        user_id=chat_id,
        user_name=f"user {chat_id}",
        chat_name=f"chat {chat_id}",
    )


def key_of(source: SessionSource) -> str:
    return build_session_key(source)


def msg(role: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


@pytest.fixture
def sessions_dir(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


@pytest.fixture
async def make_store(
    sessions_dir: Path, store_backend: StorageBackend
) -> AsyncIterator[StoreFactory]:
    """Open stores on `sessions_dir` (or another directory) on the backend under test;
    all are closed at teardown."""
    opened: list[SessionStore] = []

    async def factory(
        config: GatewayConfig | None = None,
        *,
        directory: Path | None = None,
        active: Callable[[str], bool] | None = None,
    ) -> SessionStore:
        config = store_backend.apply(config or make_config())
        store = SessionStore(directory or sessions_dir, config, active)
        await store.open()
        opened.append(store)
        return store

    yield factory
    for store in opened:
        await store.close()


@pytest.fixture
async def store(make_store: StoreFactory) -> SessionStore:
    return await make_store()


@pytest.fixture
def clock() -> Any:
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if ".tmp" in p.name]


def set_aside_files(directory: Path) -> list[Path]:
    return list(directory.glob("sessions.json.corrupt-*"))


def write_sessions_json(directory: Path, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sessions.json").write_bytes(data)


async def history(store: SessionStore, key: str) -> dict[str, dict[str, Any]]:
    return {row["session_id"]: row for row in await store.list_session_history(key, limit=100)}


async def snapshot(store: SessionStore) -> dict[str, dict[str, Any]]:
    return {e.session_key: e.to_dict() for e in await store.list_sessions()}


# --- get_or_create_session -----------------------------------------------------------------


async def test_creates_a_session(store: SessionStore, clock: Any) -> None:
    source = dm()
    entry = await store.get_or_create_session(source)
    assert entry.session_key == key_of(source) == "agent:main:telegram:dm:100"
    assert SESSION_ID.match(entry.session_id)
    assert entry.session_id.startswith("20260501_120000_")
    assert entry.created_at == entry.updated_at == T0
    assert entry.origin == source
    assert entry.platform == Platform.TELEGRAM
    assert entry.chat_type == "dm"
    assert entry.display_name == "chat 100"
    assert not (entry.was_auto_reset or entry.is_fresh_reset or entry.suspended)
    assert await store.get_entry(entry.session_key) == entry
    assert await store.has_any_sessions()


async def test_second_call_keeps_id_and_bumps_updated_at(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    clock.shift(timedelta(minutes=5))
    second = await store.get_or_create_session(dm())
    assert second.session_id == first.session_id
    assert second.created_at == T0
    assert second.updated_at == T0 + timedelta(minutes=5)
    assert not second.was_auto_reset
    assert (await store.get_entry(first.session_key)).updated_at == second.updated_at


async def test_force_new_gives_a_new_id(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    second = await store.get_or_create_session(dm(), force_new=True)
    assert second.session_id != first.session_id
    assert SESSION_ID.match(second.session_id)
    rows = await history(store, first.session_key)
    assert rows[first.session_id]["end_reason"] == "session_reset"
    assert rows[second.session_id]["ended_at"] is None


async def test_distinct_sources_get_distinct_sessions(store: SessionStore) -> None:
    a = await store.get_or_create_session(dm("1"))
    b = await store.get_or_create_session(dm("2"))
    c = await store.get_or_create_session(dm("1", Platform.DISCORD))
    assert len({a.session_id, b.session_id, c.session_id}) == 3
    assert len({a.session_key, b.session_key, c.session_key}) == 3


async def test_suspended_beats_resume_pending(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    await store.update_session(first.session_key, usage=TokenUsage(input_tokens=3))
    assert await store.mark_resume_pending(first.session_key, "shutdown_timeout")
    assert await store.suspend_session(first.session_key)
    stored = await store.get_entry(first.session_key)
    assert stored.suspended and stored.resume_pending

    entry = await store.get_or_create_session(dm())
    assert entry.session_id != first.session_id
    assert entry.was_auto_reset
    assert entry.auto_reset_reason == "suspended"
    assert entry.reset_had_activity
    assert not entry.suspended and not entry.resume_pending and entry.resume_reason is None
    assert entry.total_tokens == 0


async def test_resume_pending_beats_expired_policy(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    assert await store.mark_resume_pending(first.session_key)
    clock.shift(timedelta(hours=5))  # far past idle_minutes=60
    entry = await store.get_or_create_session(dm())
    assert entry.session_id == first.session_id
    assert not entry.was_auto_reset
    assert entry.resume_pending  # cleared only after a successful turn
    assert entry.updated_at == T0 + timedelta(hours=5)


@pytest.mark.parametrize("had_activity", [True, False])
async def test_idle_reset(store: SessionStore, clock: Any, had_activity: bool) -> None:
    first = await store.get_or_create_session(dm())
    if had_activity:
        await store.update_session(
            first.session_key, usage=TokenUsage(input_tokens=10, output_tokens=5)
        )
    clock.shift(timedelta(minutes=59))
    assert (await store.get_or_create_session(dm())).session_id == first.session_id
    clock.shift(timedelta(minutes=61))
    entry = await store.get_or_create_session(dm())
    assert entry.session_id != first.session_id
    assert entry.was_auto_reset
    assert entry.auto_reset_reason == "idle"
    assert entry.reset_had_activity is had_activity
    assert not entry.is_fresh_reset
    assert entry.total_tokens == 0 and entry.input_tokens == 0
    assert entry.created_at == entry.updated_at == T0 + timedelta(minutes=120)
    rows = await history(store, first.session_key)
    assert rows[first.session_id]["end_reason"] == "session_reset"
    assert rows[first.session_id]["ended_at"] == T0 + timedelta(minutes=120)
    assert rows[entry.session_id]["ended_at"] is None


async def test_daily_reset_across_at_hour(make_store: StoreFactory) -> None:
    store = await make_store(make_config(session_reset={"mode": "daily", "at_hour": 4}))
    with time_machine.travel(datetime(2026, 5, 1, 3, 30, tzinfo=UTC), tick=False) as clock:
        first = await store.get_or_create_session(dm())
        clock.move_to(datetime(2026, 5, 1, 3, 59, tzinfo=UTC))
        assert (await store.get_or_create_session(dm())).session_id == first.session_id
        clock.move_to(datetime(2026, 5, 1, 4, 1, tzinfo=UTC))
        entry = await store.get_or_create_session(dm())
        assert entry.session_id != first.session_id
        assert entry.was_auto_reset and entry.auto_reset_reason == "daily"
        clock.move_to(datetime(2026, 5, 1, 23, 0, tzinfo=UTC))
        assert (await store.get_or_create_session(dm())).session_id == entry.session_id


async def test_daily_reset_in_configured_timezone(make_store: StoreFactory) -> None:
    config = make_config(timezone="America/New_York", session_reset={"mode": "daily", "at_hour": 4})
    store = await make_store(config)
    # 2026-03-08 is the spring-forward day: 04:00 EDT is 08:00 UTC.
    with time_machine.travel(datetime(2026, 3, 8, 7, 59, tzinfo=UTC), tick=False) as clock:
        first = await store.get_or_create_session(dm())
        clock.move_to(datetime(2026, 3, 8, 8, 1, tzinfo=UTC))
        second = await store.get_or_create_session(dm())
        assert second.session_id != first.session_id
        assert second.auto_reset_reason == "daily"
        clock.move_to(datetime(2026, 3, 8, 12, 0, tzinfo=UTC))
        assert (await store.get_or_create_session(dm())).session_id == second.session_id


async def test_mode_none_never_resets(make_store: StoreFactory, clock: Any) -> None:
    store = await make_store(make_config(session_reset={"mode": "none"}))
    first = await store.get_or_create_session(dm())
    clock.shift(timedelta(days=400))
    entry = await store.get_or_create_session(dm())
    assert entry.session_id == first.session_id
    assert not entry.was_auto_reset


async def test_active_processes_prevent_policy_reset(make_store: StoreFactory, clock: Any) -> None:
    busy: set[str] = set()
    store = await make_store(active=lambda key: key in busy)
    first = await store.get_or_create_session(dm("1"))
    other = await store.get_or_create_session(dm("2"))
    busy.add(first.session_key)
    clock.shift(timedelta(hours=3))
    assert store._is_session_expired(await store.get_entry(other.session_key))
    assert not store._is_session_expired(await store.get_entry(first.session_key))
    assert (await store.get_or_create_session(dm("1"))).session_id == first.session_id
    assert (await store.get_or_create_session(dm("2"))).session_id != other.session_id
    # Suspension is a hard wipe even while processes run.
    await store.suspend_session(first.session_key)
    assert (await store.get_or_create_session(dm("1"))).session_id != first.session_id


async def test_per_platform_override(make_store: StoreFactory, clock: Any) -> None:
    config = make_config(platforms={"telegram": {"session_reset": {"mode": "none"}}})
    store = await make_store(config)
    tg = await store.get_or_create_session(dm("1", Platform.TELEGRAM))
    dc = await store.get_or_create_session(dm("1", Platform.DISCORD))
    clock.shift(timedelta(hours=2))
    assert (await store.get_or_create_session(dm("1", Platform.TELEGRAM))).session_id == (
        tg.session_id
    )
    dc2 = await store.get_or_create_session(dm("1", Platform.DISCORD))
    assert dc2.session_id != dc.session_id
    assert dc2.auto_reset_reason == "idle"
    # The watcher's entry-only check uses the persisted platform the same way.
    assert not store._is_session_expired(await store.get_entry(tg.session_key))


async def test_bad_id_in_source_is_rejected(store: SessionStore) -> None:
    with pytest.raises(ValueError):
        await store.get_or_create_session(dm("../x"))
    assert await store.list_sessions() == []
    assert not await store.has_any_sessions()


# --- reset / switch ------------------------------------------------------------------------


async def test_reset_session(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    await store.update_session(first.session_key, usage=TokenUsage(input_tokens=7))
    clock.shift(timedelta(minutes=1))
    entry = await store.reset_session(first.session_key)
    assert entry is not None
    assert entry.session_id != first.session_id
    assert SESSION_ID.match(entry.session_id)
    assert entry.is_fresh_reset and not entry.was_auto_reset
    assert entry.total_tokens == 0
    assert entry.display_name == first.display_name
    assert entry.origin == first.origin and entry.platform == first.platform
    assert (await store.get_entry(first.session_key)).session_id == entry.session_id
    rows = await history(store, first.session_key)
    assert rows[first.session_id]["end_reason"] == "session_reset"
    assert rows[first.session_id]["ended_at"] == T0 + timedelta(minutes=1)
    assert rows[entry.session_id]["end_reason"] is None

    renamed = await store.reset_session(first.session_key, display_name="Renamed")
    assert renamed.display_name == "Renamed"
    assert await store.reset_session("agent:main:telegram:dm:nobody") is None


async def test_switch_session_back(store: SessionStore, clock: Any) -> None:
    first = await store.get_or_create_session(dm())
    key = first.session_key
    old_messages = [msg("user", "hello"), msg("assistant", "hi there")]
    for m in old_messages:
        await store.append_to_transcript(first.session_id, m)
    await store.update_session(
        key, usage=TokenUsage(input_tokens=100, output_tokens=20, estimated_cost_usd=0.25)
    )
    clock.shift(timedelta(minutes=1))
    second = await store.reset_session(key)
    await store.append_to_transcript(second.session_id, msg("user", "new topic"))
    await store.update_session(key, usage=TokenUsage(input_tokens=5, output_tokens=1))

    clock.shift(timedelta(minutes=1))
    back = await store.switch_session(key, first.session_id)
    assert back is not None
    assert back.session_id == first.session_id
    assert back.created_at == T0
    assert back.updated_at == T0 + timedelta(minutes=2)
    assert (back.input_tokens, back.output_tokens, back.total_tokens) == (100, 20, 120)
    assert back.estimated_cost_usd == pytest.approx(0.25)
    assert not back.is_fresh_reset and not back.was_auto_reset
    assert await store.load_transcript(back.session_id) == old_messages
    assert await store.get_entry(key) == back
    assert (await store.get_or_create_session(dm())).session_id == first.session_id

    rows = await history(store, key)
    assert rows[second.session_id]["end_reason"] == "session_switch"
    assert rows[first.session_id]["ended_at"] is None
    assert rows[first.session_id]["message_count"] == 2

    # And forward again: the second session's counters come back too.
    forward = await store.switch_session(key, second.session_id)
    assert (forward.input_tokens, forward.output_tokens) == (5, 1)
    assert await store.load_transcript(second.session_id) == [msg("user", "new topic")]


async def test_switch_session_refusals(store: SessionStore) -> None:
    mine = await store.get_or_create_session(dm("1"))
    theirs = await store.get_or_create_session(dm("2"))
    assert await store.switch_session(mine.session_key, "20260101_000000_deadbeef") is None
    assert await store.switch_session(mine.session_key, theirs.session_id) is None
    assert await store.switch_session("agent:main:telegram:dm:404", mine.session_id) is None
    assert (await store.get_entry(mine.session_key)).session_id == mine.session_id
    assert (await store.get_entry(theirs.session_key)).session_id == theirs.session_id
    # Switching to the current session is a no-op that returns the entry.
    assert (await store.switch_session(mine.session_key, mine.session_id)) == mine


# --- flags ---------------------------------------------------------------------------------


async def test_suspend_session(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    assert await store.suspend_session(entry.session_key)
    assert (await store.get_entry(entry.session_key)).suspended
    assert not await store.suspend_session("agent:main:telegram:dm:404")


async def test_mark_and_clear_resume_pending(store: SessionStore, clock: Any) -> None:
    entry = await store.get_or_create_session(dm("1"))
    clock.shift(timedelta(seconds=30))
    assert await store.mark_resume_pending(entry.session_key, "restart_timeout")
    stored = await store.get_entry(entry.session_key)
    assert stored.resume_pending
    assert stored.resume_reason == "restart_timeout"
    assert stored.last_resume_marked_at == T0 + timedelta(seconds=30)
    assert stored.updated_at == T0  # marking is not activity

    assert await store.clear_resume_pending(entry.session_key)
    stored = await store.get_entry(entry.session_key)
    assert not stored.resume_pending and stored.resume_reason is None
    assert not await store.clear_resume_pending(entry.session_key)  # nothing pending
    assert not await store.clear_resume_pending("agent:main:telegram:dm:404")

    suspended = await store.get_or_create_session(dm("2"))
    await store.suspend_session(suspended.session_key)
    assert not await store.mark_resume_pending(suspended.session_key, "shutdown_timeout")
    stored = await store.get_entry(suspended.session_key)
    assert not stored.resume_pending and stored.resume_reason is None
    assert not await store.mark_resume_pending("agent:main:telegram:dm:404")


async def test_default_resume_reason(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    assert await store.mark_resume_pending(entry.session_key)
    assert (await store.get_entry(entry.session_key)).resume_reason == "restart_interrupted"


async def test_set_expiry_finalized(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    assert await store.set_expiry_finalized(entry.session_key)
    assert (await store.get_entry(entry.session_key)).expiry_finalized
    assert await store.set_expiry_finalized(entry.session_key, False)
    assert not (await store.get_entry(entry.session_key)).expiry_finalized
    assert not await store.set_expiry_finalized("agent:main:telegram:dm:404")


async def test_update_session(store: SessionStore, clock: Any) -> None:
    entry = await store.get_or_create_session(dm())
    clock.shift(timedelta(minutes=3))
    updated = await store.update_session(entry.session_key, last_prompt_tokens=1234)
    assert updated.updated_at == T0 + timedelta(minutes=3)
    assert updated.last_prompt_tokens == 1234
    assert updated.total_tokens == 0
    usage = TokenUsage(1, 2, 3, 4, 0.5)
    await store.update_session(entry.session_key, usage=usage)
    updated = await store.update_session(entry.session_key, usage=usage)
    assert (
        updated.input_tokens,
        updated.output_tokens,
        updated.cache_read_tokens,
        updated.cache_write_tokens,
        updated.total_tokens,
    ) == (2, 4, 6, 8, 6)
    assert updated.estimated_cost_usd == pytest.approx(1.0)
    assert updated.cost_status == "estimated"
    assert updated.last_prompt_tokens == 1234  # untouched when not given
    assert await store.update_session("agent:main:telegram:dm:404") is None


async def test_suspend_recently_active(store: SessionStore, clock: Any) -> None:
    old = await store.get_or_create_session(dm("old"))
    clock.shift(timedelta(minutes=10))
    fresh = [await store.get_or_create_session(dm(f"fresh{i}")) for i in range(2)]
    suspended = await store.get_or_create_session(dm("suspended"))
    pending = await store.get_or_create_session(dm("pending"))
    await store.suspend_session(suspended.session_key)
    await store.mark_resume_pending(pending.session_key, "shutdown_timeout")
    pending_marked_at = T0 + timedelta(minutes=10)
    clock.shift(timedelta(seconds=60))

    assert await store.suspend_recently_active(120) == 2

    now = T0 + timedelta(minutes=11)
    for entry in fresh:
        stored = await store.get_entry(entry.session_key)
        assert stored.resume_pending
        assert stored.resume_reason == "restart_interrupted"
        assert stored.last_resume_marked_at == now
    stored_old = await store.get_entry(old.session_key)
    assert not stored_old.resume_pending and stored_old.last_resume_marked_at is None
    stored_suspended = await store.get_entry(suspended.session_key)
    assert stored_suspended.suspended and not stored_suspended.resume_pending
    stored_pending = await store.get_entry(pending.session_key)
    assert stored_pending.resume_reason == "shutdown_timeout"
    assert stored_pending.last_resume_marked_at == pending_marked_at
    # A second pass finds nothing new.
    assert await store.suspend_recently_active(120) == 0


async def test_prune_drops_many_entries_in_short_writes(
    make_store: StoreFactory, clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PRUNE_PAGE", 2)
    store = await make_store(make_config(session_reset={"mode": "none"}))
    for i in range(5):
        await store.get_or_create_session(dm(f"old{i}"))
    clock.shift(timedelta(days=10))
    kept = await store.get_or_create_session(dm("fresh"))
    statements: list[str] = []
    store._db.trace_writes(statements.append)
    try:
        assert await store.prune_old_entries(7) == 5
    finally:
        store._db.trace_writes(None)
    assert [e.session_key for e in await store.list_sessions()] == [kept.session_key]
    assert sum(s.strip().upper() == "COMMIT" for s in statements) == 3  # pages of 2, 2, 1


async def test_prune_old_entries(make_store: StoreFactory, clock: Any) -> None:
    busy: set[str] = set()
    store = await make_store(make_config(session_reset={"mode": "none"}), active=busy.__contains__)
    old = await store.get_or_create_session(dm("old"))
    await store.append_to_transcript(old.session_id, msg("user", "remember me"))
    old_suspended = await store.get_or_create_session(dm("old-suspended"))
    await store.suspend_session(old_suspended.session_key)
    old_busy = await store.get_or_create_session(dm("old-busy"))
    busy.add(old_busy.session_key)
    clock.shift(timedelta(days=10))
    fresh = await store.get_or_create_session(dm("fresh"))

    assert await store.prune_old_entries(0) == 0
    assert len(await store.list_sessions()) == 4
    assert await store.prune_old_entries(30) == 0

    assert await store.prune_old_entries(7) == 1
    keys = {e.session_key for e in await store.list_sessions()}
    assert keys == {old_suspended.session_key, old_busy.session_key, fresh.session_key}
    assert await store.get_entry(old.session_key) is None
    assert await store.lookup_by_session_id(old.session_id) is None
    assert await store.load_transcript(old.session_id) == [msg("user", "remember me")]
    assert await store.has_any_sessions()
    rows = await history(store, old.session_key)
    assert rows[old.session_id]["end_reason"] == "pruned"

    # The pruned key starts over as a brand new session (not an auto-reset).
    again = await store.get_or_create_session(dm("old"))
    assert again.session_id != old.session_id and not again.was_auto_reset


# --- queries -------------------------------------------------------------------------------


async def test_list_sessions_order_and_filter(store: SessionStore, clock: Any) -> None:
    a = await store.get_or_create_session(dm("a"))
    clock.shift(timedelta(minutes=1))
    b = await store.get_or_create_session(dm("b"))
    clock.shift(timedelta(minutes=1))
    c = await store.get_or_create_session(dm("c"))
    clock.shift(timedelta(minutes=1))
    await store.get_or_create_session(dm("a"))

    order = [e.session_key for e in await store.list_sessions()]
    assert order == [a.session_key, c.session_key, b.session_key]
    recent = [e.session_key for e in await store.list_sessions(active_minutes=1.5)]
    assert recent == [a.session_key, c.session_key]
    assert await store.list_sessions(active_minutes=0.5) == [await store.get_entry(a.session_key)]


async def test_lookup_by_session_id(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    found = await store.lookup_by_session_id(entry.session_id)
    assert found == entry
    assert await store.lookup_by_session_id("20260101_000000_deadbeef") is None
    newer = await store.reset_session(entry.session_key)
    assert await store.lookup_by_session_id(entry.session_id) is None  # no longer current
    assert (await store.lookup_by_session_id(newer.session_id)).session_key == entry.session_key


async def test_has_any_sessions(store: SessionStore) -> None:
    assert not await store.has_any_sessions()
    assert await store.list_sessions() == []
    await store.get_or_create_session(dm())
    assert await store.has_any_sessions()


# --- transcripts ---------------------------------------------------------------------------


async def test_append_and_load_in_order(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    messages = [
        msg("system", "be nice"),
        msg("user", "hi", name="alice", extra={"nested": [1, 2]}),
        msg("assistant", None, tool_calls=[{"id": "t1", "function": {"name": "x"}}]),
        msg("tool", [{"type": "text", "text": "result"}], tool_call_id="t1"),
        msg("assistant", "done ✓"),
    ]
    ids = [await store.append_to_transcript(entry.session_id, m) for m in messages]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert await store.load_transcript(entry.session_id) == messages
    assert await store.count_messages(entry.session_id) == len(messages)
    assert await store.load_transcript("20260101_000000_deadbeef") == []


async def test_append_does_not_keep_a_reference(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    message = msg("user", "original")
    await store.append_to_transcript(entry.session_id, message)
    message["content"] = "mutated"
    assert await store.load_transcript(entry.session_id) == [msg("user", "original")]


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "wizard", "content": "x"},
        {"role": None, "content": "x"},
        {"content": "x"},
        {"role": "user"},
        "just a string",
        ["user", "x"],
        None,
    ],
)
async def test_invalid_message_is_rejected(store: SessionStore, bad: Any) -> None:
    entry = await store.get_or_create_session(dm())
    with pytest.raises(ValueError):
        await store.append_to_transcript(entry.session_id, bad)
    with pytest.raises(ValueError):
        await store.append_to_transcript(entry.session_id, bad, skip_db=True)
    assert await store.load_transcript(entry.session_id) == []


async def test_append_with_skip_db_stores_nothing(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    assert await store.append_to_transcript(entry.session_id, msg("user", "x"), True) is None
    assert await store.load_transcript(entry.session_id) == []


async def test_append_to_unknown_session(store: SessionStore) -> None:
    await store.get_or_create_session(dm())
    with pytest.raises(KeyError):
        await store.append_to_transcript("20260101_000000_deadbeef", msg("user", "x"))
    assert await store.load_transcript("20260101_000000_deadbeef") == []
    count = await store._db.read(
        lambda conn: conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    )
    assert count == 0


async def test_rewrite_transcript(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    for m in [msg("user", "a"), msg("assistant", "b"), msg("user", "c")]:
        await store.append_to_transcript(entry.session_id, m)
    replacement = [msg("system", "summary of a/b/c"), msg("user", "c")]
    assert await store.rewrite_transcript(entry.session_id, replacement) == 2
    assert await store.load_transcript(entry.session_id) == replacement
    assert await store.rewrite_transcript(entry.session_id, []) == 0
    assert await store.load_transcript(entry.session_id) == []
    with pytest.raises(KeyError):
        await store.rewrite_transcript("20260101_000000_deadbeef", replacement)


async def test_rewrite_is_all_or_nothing(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    original = [msg("user", "a"), msg("assistant", "b")]
    for m in original:
        await store.append_to_transcript(entry.session_id, m)
    with pytest.raises(ValueError):
        await store.rewrite_transcript(
            entry.session_id, [msg("user", "x"), {"role": "bogus", "content": "y"}]
        )
    assert await store.load_transcript(entry.session_id) == original


def _conversation() -> list[dict[str, Any]]:
    return [
        msg("system", "sys"),
        msg("user", "u1"),
        msg("assistant", "a1"),
        msg("user", "u2"),
        msg("assistant", None, tool_calls=[{"id": "t"}]),
        msg("tool", "tool out", tool_call_id="t"),
        msg("assistant", "a2"),
        msg("user", "u3"),
        msg("assistant", "a3"),
    ]


async def _seeded(store: SessionStore) -> str:
    entry = await store.get_or_create_session(dm())
    for m in _conversation():
        await store.append_to_transcript(entry.session_id, m)
    return entry.session_id


async def test_rewind_one_turn(store: SessionStore) -> None:
    sid = await _seeded(store)
    result = await store.rewind_session(sid)
    assert result == {"rewound_count": 2, "turns_undone": 1, "target_text": "u3"}
    assert await store.load_transcript(sid) == _conversation()[:7]
    # Again: the tool-call turn goes as a whole.
    result = await store.rewind_session(sid, 1)
    assert result == {"rewound_count": 4, "turns_undone": 1, "target_text": "u2"}
    assert await store.load_transcript(sid) == _conversation()[:3]


async def test_rewind_two_turns(store: SessionStore) -> None:
    sid = await _seeded(store)
    result = await store.rewind_session(sid, n=2)
    assert result == {"rewound_count": 6, "turns_undone": 2, "target_text": "u2"}
    assert await store.load_transcript(sid) == _conversation()[:3]
    assert await store.count_messages(sid) == 3


async def test_rewind_more_than_available(store: SessionStore) -> None:
    sid = await _seeded(store)
    result = await store.rewind_session(sid, n=10)
    assert result == {"rewound_count": 8, "turns_undone": 3, "target_text": "u1"}
    assert await store.load_transcript(sid) == [msg("system", "sys")]
    # Soft delete keeps the audit trail in the table.
    total = await store._db.read(
        lambda conn: conn.execute(
            "SELECT COUNT(*) FROM messages WHERE session_id = ?", (sid,)
        ).fetchone()[0]
    )
    assert total == len(_conversation())


async def test_rewind_without_user_messages(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    await store.append_to_transcript(entry.session_id, msg("system", "sys"))
    await store.append_to_transcript(entry.session_id, msg("assistant", "hello"))
    result = await store.rewind_session(entry.session_id)
    assert result == {"rewound_count": 0, "turns_undone": 0, "target_text": None}
    assert len(await store.load_transcript(entry.session_id)) == 2
    with pytest.raises(ValueError):
        await store.rewind_session(entry.session_id, 0)
    with pytest.raises(KeyError):
        await store.rewind_session("20260101_000000_deadbeef")


async def test_rewind_target_text_of_structured_content(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": "x"}]
    await store.append_to_transcript(entry.session_id, msg("user", parts))
    result = await store.rewind_session(entry.session_id)
    assert result["turns_undone"] == 1
    assert json.loads(result["target_text"]) == parts


# --- persistence and files -----------------------------------------------------------------


async def test_everything_survives_a_restart(
    make_store: StoreFactory, sessions_dir: Path, clock: Any
) -> None:
    store = await make_store()
    a = await store.get_or_create_session(dm("a"))
    await store.update_session(
        a.session_key, 4321, usage=TokenUsage(11, 22, 33, 44, estimated_cost_usd=0.125)
    )
    await store.mark_resume_pending(a.session_key, "shutdown_timeout")
    await store.set_expiry_finalized(a.session_key)
    transcript = [msg("user", "persist me"), msg("assistant", "ok", meta={"k": 1})]
    for m in transcript:
        await store.append_to_transcript(a.session_id, m)
    b = await store.get_or_create_session(dm("b"))
    await store.suspend_session(b.session_key)
    c = await store.get_or_create_session(dm("c"))
    await store.update_session(c.session_key, usage=TokenUsage(input_tokens=1))
    d = await store.get_or_create_session(dm("d"))
    clock.shift(timedelta(minutes=30))
    await store.reset_session(d.session_key, display_name="D!")
    clock.shift(timedelta(minutes=61))
    c2 = await store.get_or_create_session(dm("c"))  # idle auto-reset
    assert c2.was_auto_reset and c2.reset_had_activity

    before = await snapshot(store)
    await store.close()

    reopened = await make_store()
    after = await snapshot(reopened)
    assert after == before
    stored_a = SessionEntry.from_dict(after[a.session_key])
    assert stored_a.resume_pending and stored_a.resume_reason == "shutdown_timeout"
    assert stored_a.last_resume_marked_at == T0
    assert stored_a.expiry_finalized
    assert (stored_a.input_tokens, stored_a.output_tokens) == (11, 22)
    assert (stored_a.cache_read_tokens, stored_a.cache_write_tokens) == (33, 44)
    assert stored_a.total_tokens == 33 and stored_a.last_prompt_tokens == 4321
    assert stored_a.estimated_cost_usd == pytest.approx(0.125)
    assert after[b.session_key]["suspended"]
    assert after[c.session_key]["was_auto_reset"]
    assert after[c.session_key]["auto_reset_reason"] == "idle"
    assert after[c.session_key]["reset_had_activity"]
    assert after[d.session_key]["is_fresh_reset"]
    assert after[d.session_key]["display_name"] == "D!"
    assert await reopened.load_transcript(a.session_id) == transcript
    assert await reopened.has_any_sessions()
    rows = await history(reopened, c.session_key)
    assert rows[c.session_id]["end_reason"] == "session_reset"
    # The state machine continues where it left off.
    assert (await reopened.get_or_create_session(dm("a"))).session_id == a.session_id
    assert (await reopened.get_or_create_session(dm("b"))).auto_reset_reason == "suspended"


@pytest.mark.sqlite_only
async def test_files_and_mirror_format(
    make_store: StoreFactory, sessions_dir: Path, clock: Any
) -> None:
    store = await make_store()
    for chat in ("1", "2", "3"):
        await store.get_or_create_session(dm(chat))
    await store.update_session("agent:main:telegram:dm:2", usage=TokenUsage(5, 6))
    await store.suspend_session("agent:main:telegram:dm:3")
    expected = await snapshot(store)
    await store.close()

    for name in ("state.db", "sessions.json"):
        path = sessions_dir / name
        assert path.exists()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
    assert data == expected
    assert set(data) == {f"agent:main:telegram:dm:{c}" for c in "123"}
    for key, raw in data.items():
        assert SessionEntry.from_dict(raw).session_key == key
    assert not temp_files(sessions_dir)


@pytest.mark.sqlite_only
async def test_async_with_and_flush_mirror(sessions_dir: Path) -> None:
    async with SessionStore(sessions_dir, make_config()) as store:
        entry = await store.get_or_create_session(dm())
        await store.flush_mirror()
        data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
        assert data[entry.session_key]["session_id"] == entry.session_id
    with pytest.raises(DatabaseError):
        await store.get_or_create_session(dm())
    await store.close()  # closing twice is harmless


@pytest.mark.sqlite_only
async def test_mirror_coalesces_writes(
    make_store: StoreFactory, sessions_dir: Path, clock: Any
) -> None:
    store = await make_store(make_config(storage={"mirror_interval_seconds": 60.0}))
    for _ in range(50):
        clock.shift(timedelta(seconds=1))
        await store.get_or_create_session(dm())
    await asyncio.sleep(0.05)  # let the background writer run if it wants to
    assert store._mirror.writes <= 2
    writes_before_close = store._mirror.writes
    expected = await snapshot(store)
    assert expected["agent:main:telegram:dm:100"]["updated_at"] == (
        (T0 + timedelta(seconds=50)).isoformat()
    )
    await store.close()
    assert store._mirror.writes == writes_before_close + 1
    data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
    assert data == expected


# --- start-up: migration and damaged files -------------------------------------------------


def _remove_db(directory: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        (directory / f"state.db{suffix}").unlink(missing_ok=True)


@pytest.mark.sqlite_only
async def test_imports_sessions_json_when_state_db_is_missing(
    make_store: StoreFactory, sessions_dir: Path, clock: Any
) -> None:
    store = await make_store()
    pending = await store.get_or_create_session(dm("pending"))
    await store.update_session(pending.session_key, usage=TokenUsage(40, 2))
    await store.mark_resume_pending(pending.session_key, "restart_timeout")
    suspended = await store.get_or_create_session(dm("suspended"))
    await store.suspend_session(suspended.session_key)
    plain = await store.get_or_create_session(dm("plain"))
    expected = await snapshot(store)
    await store.close()
    _remove_db(sessions_dir)

    imported = await make_store()
    assert await snapshot(imported) == expected
    assert await imported.has_any_sessions()
    assert (await imported.lookup_by_session_id(plain.session_id)).session_key == plain.session_key
    assert (await imported.get_or_create_session(dm("pending"))).session_id == pending.session_id
    wiped = await imported.get_or_create_session(dm("suspended"))
    assert wiped.session_id != suspended.session_id and wiped.auto_reset_reason == "suspended"
    # Imported sessions are real sessions: transcripts can be appended to them.
    await imported.append_to_transcript(plain.session_id, msg("user", "after migration"))
    # ... and their counters survive a switch away and back.
    await imported.reset_session(pending.session_key)
    back = await imported.switch_session(pending.session_key, pending.session_id)
    assert (back.input_tokens, back.output_tokens, back.total_tokens) == (40, 2, 42)


@pytest.mark.sqlite_only
async def test_import_skips_damaged_entries(make_store: StoreFactory, sessions_dir: Path) -> None:
    good = SessionEntry(
        session_key="agent:main:telegram:dm:1",
        session_id="20260101_000000_0123abcd",
        created_at=T0,
        updated_at=T0,
        platform=Platform.TELEGRAM,
    )
    raw = {
        good.session_key: good.to_dict(),
        "agent:main:telegram:dm:2": "not an entry",
        "agent:main:telegram:dm:3": {"session_id": "x"},  # missing required fields
        "agent:main:telegram:dm:4": {**good.to_dict(), "updated_at": "yesterday"},
        "agent:main:telegram:dm:5": {**good.to_dict(), "origin": "nowhere"},
    }
    write_sessions_json(sessions_dir, json.dumps(raw).encode())
    store = await make_store()
    assert await snapshot(store) == {good.session_key: good.to_dict()}


def _legacy_index() -> dict[str, Any]:
    entry = SessionEntry(
        session_key="agent:main:telegram:dm:7",
        session_id="20260101_000000_0123abcd",
        created_at=T0,
        updated_at=T0,
        platform=Platform.TELEGRAM,
        input_tokens=9,
        total_tokens=9,
    )
    return {entry.session_key: entry.to_dict()}


@pytest.mark.sqlite_only
async def test_imports_sessions_json_into_an_empty_state_db(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    # A crash after state.db was created but before the import committed must not lose the
    # legacy index (the next mirror write would overwrite sessions.json with nothing).
    empty = await make_store()
    await empty.close()
    legacy = _legacy_index()
    write_sessions_json(sessions_dir, json.dumps(legacy).encode())

    store = await make_store()
    assert await snapshot(store) == legacy
    await store.get_or_create_session(dm("other"))
    await store.close()
    data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
    assert set(data) == {*legacy, "agent:main:telegram:dm:other"}


@pytest.mark.sqlite_only
async def test_importing_sessions_json_warns_what_it_cannot_bring_back(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    write_sessions_json(sessions_dir, json.dumps(_legacy_index()).encode())
    with structlog.testing.capture_logs() as logs:
        store = await make_store()
    assert await snapshot(store) == _legacy_index()
    [warning] = [e for e in logs if e["event"] == "sessions_json_imported"]
    assert warning["log_level"] == "warning" and warning["entries"] == 1
    for lost in ("transcripts", "duplicate memory", "delivery ledger", "paired users"):
        assert lost in warning["not_restored"]


def _place(directory: Path, name: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.sqlite_only
@pytest.mark.parametrize("content", [b"", os.urandom(4096)], ids=["0 bytes", "random bytes"])
async def test_a_state_db_that_is_empty_or_not_a_database_is_damage(
    make_store: StoreFactory, sessions_dir: Path, content: bytes
) -> None:
    # SQLite takes an empty file for an empty database: the mirror would have been
    # imported over it, silently losing every transcript and the duplicate memory.
    _place(sessions_dir, "state.db", content)
    write_sessions_json(sessions_dir, json.dumps(_legacy_index()).encode())
    before = _files(sessions_dir)
    with pytest.raises(DatabaseError, match=r"state\.db cannot be used"):
        await make_store()
    assert _files(sessions_dir) == before  # no byte changed, no -wal or -shm made


@pytest.mark.sqlite_only
async def test_a_crash_while_creating_state_db_leaves_no_state_db(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    # The schema is built in a temp file that is linked into place once complete: what a
    # crash in a first start leaves is such a temp file (doctor deletes stale ones), never
    # an empty state.db; the next start builds its own.
    leftover = ".state.db.tmp-4242-0badcafe"
    _place(sessions_dir, leftover, b"")
    write_sessions_json(sessions_dir, json.dumps(_legacy_index()).encode())
    store = await make_store()
    assert await snapshot(store) == _legacy_index()
    # Names only: the open store's background threads create and remove files (a
    # rollback journal of search.db) while the directory is listed.
    names = _names(sessions_dir)
    assert {n for n in names if n.startswith(".state.db.tmp-")} == {leftover}
    assert {"state.db", "state.db-wal"} <= names
    assert stat.S_IMODE((sessions_dir / "state.db").stat().st_mode) == 0o600


@pytest.mark.sqlite_only
async def test_a_missing_state_db_beside_its_wal_is_not_recreated(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    # A new, empty database would take the old log's pages as its own.
    _place(sessions_dir, "state.db-wal", b"\x37\x7f\x06\x82" + bytes(28))
    with pytest.raises(DatabaseError, match=r"state\.db-wal"):
        await make_store()
    assert set(_files(sessions_dir)) == {"state.db-wal"}


@pytest.mark.sqlite_only
async def test_existing_sessions_are_not_overwritten_by_an_import(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    store = await make_store()
    entry = await store.get_or_create_session(dm())
    await store.close()
    write_sessions_json(sessions_dir, json.dumps(_legacy_index()).encode())
    reopened = await make_store()
    assert [e.session_id for e in await reopened.list_sessions()] == [entry.session_id]


@pytest.mark.sqlite_only
@pytest.mark.parametrize("content", [b"[]", b"null", b'"text"'])
async def test_non_object_sessions_json_is_set_aside(
    make_store: StoreFactory, sessions_dir: Path, content: bytes
) -> None:
    store = await make_store()
    entry = await store.get_or_create_session(dm())
    await store.close()
    write_sessions_json(sessions_dir, content)
    reopened = await make_store()
    assert len(set_aside_files(sessions_dir)) == 1
    await reopened.close()
    data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
    assert data[entry.session_key]["session_id"] == entry.session_id


@pytest.mark.sqlite_only
async def test_corrupt_sessions_json_with_state_db(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    store = await make_store()
    entries = [await store.get_or_create_session(dm(c)) for c in ("1", "2")]
    await store.suspend_session(entries[1].session_key)
    expected = await snapshot(store)
    await store.close()
    garbage = b"\xff\xfe\x00garbage{{{\x9c"
    write_sessions_json(sessions_dir, garbage)

    reopened = await make_store()
    aside = set_aside_files(sessions_dir)
    assert len(aside) == 1 and aside[0].read_bytes() == garbage
    assert await snapshot(reopened) == expected
    await reopened.close()
    data = json.loads((sessions_dir / "sessions.json").read_text("utf-8"))
    assert data == expected


@pytest.mark.sqlite_only
async def test_corrupt_sessions_json_without_state_db(
    make_store: StoreFactory, sessions_dir: Path
) -> None:
    write_sessions_json(sessions_dir, b"{ this is not json")
    store = await make_store()
    assert len(set_aside_files(sessions_dir)) == 1
    assert await store.list_sessions() == []
    assert not await store.has_any_sessions()
    await store.close()
    assert json.loads((sessions_dir / "sessions.json").read_text("utf-8")) == {}


def _future_schema_db(directory: Path) -> None:
    directory.mkdir(parents=True)
    conn = sqlite3.connect(directory / "state.db")
    conn.execute("PRAGMA user_version = 999")
    conn.close()


@pytest.mark.sqlite_only
async def test_newer_schema_is_refused(sessions_dir: Path) -> None:
    _future_schema_db(sessions_dir)
    store = SessionStore(sessions_dir, make_config())
    with pytest.raises(DatabaseError, match="newer"):
        await store.open()
    await store.close()


# --- cost and concurrency ------------------------------------------------------------------


async def _touch_statements(store: SessionStore, source: SessionSource) -> list[str]:
    stmts: list[str] = []
    store._db.trace_writes(stmts.append)
    try:
        await store.get_or_create_session(source)
    finally:
        store._db.trace_writes(None)
    return stmts


async def test_touch_is_constant_cost(store: SessionStore) -> None:
    await store.get_or_create_session(dm("0"))
    small = await _touch_statements(store, dm("0"))

    await asyncio.gather(*(store.get_or_create_session(dm(str(i))) for i in range(1, 200)))
    assert len(await store.list_sessions()) == 200
    stmts = await _touch_statements(store, dm("150"))

    assert len(stmts) == len(small)
    on_entries = [s for s in stmts if "session_entries" in s]
    assert 1 <= len(on_entries) <= 3
    for s in on_entries:
        normalized = " ".join(s.split()).upper()
        assert normalized.startswith("INSERT INTO SESSION_ENTRIES") or (
            "WHERE SESSION_KEY = " in normalized or "WHERE H.SESSION_KEY = " in normalized
        ), s
    assert sum(s.strip().upper() == "COMMIT" for s in stmts) == 1
    # The trace callback is gone again.
    seen = len(stmts)
    await store.get_or_create_session(dm("150"))
    assert len(stmts) == seen


async def test_group_commit_concurrent_appends(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    messages = [msg("user" if i % 2 == 0 else "assistant", f"m{i}", i=i) for i in range(200)]
    stmts: list[str] = []
    store._db.trace_writes(stmts.append)
    try:
        calls = [store.append_to_transcript(entry.session_id, m) for m in messages]
        calls.insert(100, store.append_to_transcript("20260101_000000_deadbeef", msg("user", "x")))
        results = await asyncio.gather(*calls, return_exceptions=True)
    finally:
        store._db.trace_writes(None)

    failed = results.pop(100)
    assert isinstance(failed, KeyError)
    assert all(isinstance(r, int) for r in results)
    assert len(set(results)) == 200
    loaded = await store.load_transcript(entry.session_id)
    assert sorted(m["i"] for m in loaded) == list(range(200))
    # Load order is id order, and every caller got the id of its own message.
    by_id = dict(zip(results, messages, strict=True))
    assert loaded == [by_id[i] for i in sorted(by_id)]
    assert loaded == messages  # submitted in this order, committed in this order
    # Far fewer commits than writes, no savepoints while nothing fails, and the failed
    # write's batch was re-run sharing one transaction with the successful ones (it
    # rolled back to its own savepoint only).
    ops = [s.strip().upper() for s in stmts]
    assert ops.count("COMMIT") < 20
    first_rollback = ops.index("ROLLBACK")
    assert "SAVEPOINT OP" not in ops[:first_rollback]
    failed_at = ops.index("ROLLBACK TO OP")
    begin = max(i for i in range(failed_at) if ops[i] in ("BEGIN IMMEDIATE", "BEGIN"))
    end = ops.index("COMMIT", failed_at)
    released = ops[begin:end].count("RELEASE OP")
    assert released - 1 > 1  # minus the failed one's own RELEASE


async def test_a_read_sees_the_writes_queued_before_it(store: SessionStore) -> None:
    # Reads run on their own connection and thread; one issued right after an unawaited
    # write (a delivery mark) must still see it, or a re-send could act on a stale view.
    entry = await store.get_or_create_session(dm())

    def slow_mark(conn: sqlite3.Connection) -> None:
        time.sleep(0.05)  # time enough for the reader thread to answer from before it
        conn.execute(
            "UPDATE sessions SET title = 'marked' WHERE session_id = ?", (entry.session_id,)
        )

    queued = store.write_soon(slow_mark)
    title = await store.read(
        lambda conn: conn.execute(
            "SELECT title FROM sessions WHERE session_id = ?", (entry.session_id,)
        ).fetchone()[0]
    )
    assert title == "marked"
    assert queued.done()


async def test_reads_cannot_write(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    with pytest.raises(sqlite3.OperationalError):
        await store.read(lambda conn: conn.execute("DELETE FROM sessions"))
    assert (await store.get_entry(entry.session_key)) is not None


async def test_concurrent_get_or_create_same_key(store: SessionStore) -> None:
    entries = await asyncio.gather(*(store.get_or_create_session(dm()) for _ in range(20)))
    assert len({e.session_id for e in entries}) == 1
    assert len(await store.list_session_history(entries[0].session_key)) == 1


async def test_snapshots_are_independent(store: SessionStore) -> None:
    entry = await store.get_or_create_session(dm())
    entry.suspended = True
    entry.session_id = "tampered"
    stored = await store.get_entry(entry.session_key)
    assert not stored.suspended and stored.session_id != "tampered"


def test_file_modes_are_private_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:

        async def run() -> None:
            async with SessionStore(tmp_path / "s", make_config()) as store:
                await store.get_or_create_session(dm())

        asyncio.run(run())
    finally:
        os.umask(old)
    for name in ("state.db", "sessions.json"):
        assert stat.S_IMODE((tmp_path / "s" / name).stat().st_mode) == 0o600


async def test_close_while_the_mirror_is_writing(tmp_path: Path) -> None:
    # A fresh store writes sessions.json in the background right after open; closing at
    # that moment must not race the final write for the temp file (FileNotFoundError).
    for i in range(40):
        store = SessionStore(tmp_path / str(i), make_config())
        await store.open()
        entry = await store.get_or_create_session(dm())
        await store.close()
        data = json.loads((tmp_path / str(i) / "sessions.json").read_text("utf-8"))
        assert data[entry.session_key]["session_id"] == entry.session_id
        assert not temp_files(tmp_path / str(i))


async def test_expired_entries_are_not_crowded_out_by_sessions_that_never_expire(
    make_store: StoreFactory,
) -> None:
    config = make_config(platforms={"telegram": {"session_reset": {"mode": "none"}}})
    store = await make_store(config)
    start = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    with time_machine.travel(start, tick=False):
        for i in range(7):  # older than the discord one, and never expiring
            await store.get_or_create_session(dm(f"tg{i}"))
    with time_machine.travel(start + timedelta(minutes=1), tick=False):
        discord = await store.get_or_create_session(dm("d1", Platform.DISCORD))
    with time_machine.travel(start + timedelta(hours=3), tick=False):
        expired = await store.expired_entries(limit=5, page=2)
        assert [e.session_key for e in expired] == [discord.session_key]
        await store.set_expiry_finalized(discord.session_key)
        assert await store.expired_entries(limit=5, page=2) == []


async def test_a_touch_rewrites_the_activity_index_at_most_once_a_minute(
    make_store: StoreFactory,
) -> None:
    store = await make_store()
    statements: list[str] = []
    start = datetime(2026, 5, 1, 12, 0, 5, tzinfo=UTC)
    with time_machine.travel(start, tick=False):
        await store.get_or_create_session(dm("1"))
    store._db.trace_writes(statements.append)
    try:
        for seconds in (10, 30, 50):  # same minute: no index rewrite
            with time_machine.travel(start + timedelta(seconds=seconds), tick=False):
                await store.get_or_create_session(dm("1"))
        same_minute = [s for s in statements if "SET active_minute" in s]
        with time_machine.travel(start + timedelta(seconds=70), tick=False):
            await store.get_or_create_session(dm("1"))
        next_minute = [s for s in statements if "SET active_minute" in s]
    finally:
        store._db.trace_writes(None)
    assert same_minute == []
    assert len(next_minute) == 1
    with time_machine.travel(start + timedelta(seconds=75), tick=False):
        recent = await store.list_sessions(active_minutes=0.1)
        assert [e.session_key for e in recent] == [key_of(dm("1"))]
        assert await store.suspend_recently_active(10) == 1


async def test_commits_reach_the_database_file_without_waiting_for_a_full_wal(
    tmp_path: Path,
) -> None:
    """The checkpointer copies committed pages from the WAL into state.db within about
    a quarter of a second (the writer's own autocheckpoint would wait 10,000 pages)."""
    async with SessionStore(tmp_path, make_config()) as opened:
        await opened.get_or_create_session(dm("checkpointed"))

        def in_main_file() -> int:
            # immutable=1 reads state.db alone, ignoring the WAL.
            conn = sqlite3.connect(f"file:{opened.db_path}?immutable=1", uri=True)
            try:
                return conn.execute("SELECT COUNT(*) FROM session_entries").fetchone()[0]
            except sqlite3.OperationalError:  # not even the schema was checkpointed
                return 0
            finally:
                conn.close()

        for _ in range(50):
            if in_main_file() == 1:
                break
            await asyncio.sleep(0.05)
        assert in_main_file() == 1


# --- read-ahead before the start-up check ---------------------------------------------------


def test_read_ahead_is_best_effort(tmp_path: Path) -> None:
    from gateway.store.db import _read_ahead

    _read_ahead(tmp_path / "missing.db")  # nothing there, no WAL either
    _read_ahead(tmp_path)  # a directory: its read fails, which the check would report


def test_read_ahead_reads_the_database_and_its_wal_without_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.store.db import _read_ahead

    path = tmp_path / "state.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")  # keep the rows in the WAL
    conn.execute("CREATE TABLE t (x TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * 2000)
    wal = tmp_path / "state.db-wal"
    sizes = path.stat().st_size + wal.stat().st_size
    assert wal.stat().st_size > 0

    def no_sendfile(*args: Any) -> int:
        raise OSError(38, "Function not implemented")  # as where sendfile cannot

    read: list[int] = []
    preadv = os.preadv

    def counting_preadv(fd: int, buffers: list[bytearray], offset: int) -> int:
        n = preadv(fd, buffers, offset)
        read.append(n)
        return n

    monkeypatch.setattr(os, "sendfile", no_sendfile)
    monkeypatch.setattr(os, "preadv", counting_preadv)
    try:
        _read_ahead(path)
    finally:
        conn.close()
    assert sum(read) == sizes


# --- the paged listing ---------------------------------------------------------------


async def all_pages(
    store: SessionStore, limit: int, between: Callable[[], Awaitable[None]] | None = None, **scope
) -> list[list[str]]:
    """Every page's keys, following each page's next key to the end."""
    pages: list[list[str]] = []
    after = None
    while True:
        page, after = await store.list_sessions_page(after, limit, **scope)
        pages.append([e.session_key for e in page])
        if after is None:
            return pages
        assert after == pages[-1][-1]
        if between is not None:
            await between()


async def test_the_listing_pages_by_key_without_gaps_or_duplicates(
    make_store: StoreFactory,
) -> None:
    config = make_config(
        agents={"alpha": {}},
        routes=[{"match": {"platform": "discord"}, "agent": "alpha"}],
    )
    store = await make_store(config)
    mains = [await store.get_or_create_session(dm(f"{n}")) for n in range(23)]
    alphas = [await store.get_or_create_session(dm(f"{n}", Platform.DISCORD)) for n in range(5)]
    everyone = sorted(e.session_key for e in [*mains, *alphas])
    assert {key.split(":")[1] for key in everyone} == {"main", "alpha"}

    pages = await all_pages(store, 5)
    assert [len(page) for page in pages] == [5, 5, 5, 5, 5, 3]
    assert [key for page in pages for key in page] == everyone

    # Entries touched between pages (listed already, or still to come) do not move, and
    # a session started meanwhile with a key before the cursor does not shift the rest.
    touched = iter(range(100))

    async def activity() -> None:
        n = next(touched)
        await store.get_or_create_session(dm(f"{n % 23}"))  # listed or not yet listed
        await store.get_or_create_session(dm(f"{n % 5}", Platform.DISCORD))
        await store.get_or_create_session(dm(f"0-new-{n}"))  # sorts among the first

    seen = [key for page in await all_pages(store, 4, activity) for key in page]
    assert len(seen) == len(set(seen))  # no duplicates
    assert set(everyone) <= set(seen)  # no gaps

    # Scoped as the unpaged listing: one agent's, the recently active.
    alpha_pages = await all_pages(store, 2, agent_id="alpha")
    alpha_keys = sorted(e.session_key for e in alphas)
    assert [key for page in alpha_pages for key in page] == alpha_keys
    assert [len(page) for page in alpha_pages] == [2, 2, 1]
    assert await store.list_sessions_page(None, 100, agent_id="nobody") == ([], None)
    unpaged = sorted(await store.list_sessions(agent_id="main"), key=lambda e: e.session_key)
    assert await store.list_sessions_page(None, 1000, agent_id="main") == (unpaged, None)


async def test_the_paged_listing_keeps_the_active_minutes_scope(
    store: SessionStore, clock: Any
) -> None:
    old = [await store.get_or_create_session(dm(f"old{n}")) for n in range(3)]
    clock.shift(timedelta(minutes=10))
    recent = [await store.get_or_create_session(dm(f"new{n}")) for n in range(3)]
    pages = await all_pages(store, 2, active_minutes=5)
    assert [key for page in pages for key in page] == sorted(e.session_key for e in recent)
    assert len(await store.list_sessions()) == len(old) + len(recent)


@pytest.mark.sqlite_only
async def test_a_listing_page_is_read_through_the_key_index_not_sorted(
    store: SessionStore,
) -> None:
    """Keyset paging on the primary key: SQLite walks the index from the cursor and sorts
    nothing, so a page deep in 100,000 entries costs what the first one does."""
    from gateway.store import entries

    statements: list[tuple[str, tuple[Any, ...]]] = []

    class Recording:
        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
            statements.append((sql, params))
            return self.conn.execute(sql, params)

    def plans(conn: Any) -> list[str]:
        statements.clear()
        entries.list_entries_page(Recording(conn), "agent:main:x", 10, None, "main")
        entries.list_entries_page(Recording(conn), "agent:main:x", 10, time.time(), None)
        return [
            " / ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params))
            for sql, params in statements
        ]

    for plan in await store.read(plans):
        assert "TEMP B-TREE" not in plan, plan
        assert "PRIMARY KEY" in plan and "session_key>?" in plan, plan
