"""The console's filtered session listing (`gateway.store.console_reads`) on both store
backends: filters, and the window that bounds what one page reads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.domain.session import Platform, SessionSource
from gateway.store import console_reads
from gateway.store.session_store import SessionStore
from tests.pg_support import StorageBackend


@pytest.fixture
async def store(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[SessionStore]:
    config = store_backend.apply(GatewayConfig.model_validate({"timezone": "UTC"}))
    opened = await SessionStore(tmp_path / "sessions", config).open()
    for i in range(30):
        platform = Platform.TELEGRAM if i % 3 else Platform.DISCORD
        source = SessionSource(
            platform=platform, chat_id=f"chat-{i:02}", user_id=f"u{i}", user_name=f"Name{i}"
        )
        await opened.get_or_create_session(source)
    yield opened
    await opened.close()


async def page(store: SessionStore, after: str | None = None, limit: int = 5, **wanted: Any):  # type: ignore[no-untyped-def]
    return await store.read(lambda conn: console_reads.filtered_page(conn, after, limit, **wanted))


async def test_an_unfiltered_page_is_the_next_keys_in_order(store: SessionStore) -> None:
    first, next_key = await page(store)
    keys = [e["session_key"] for e in first]
    assert keys == sorted(keys) and len(keys) == 5 and next_key == keys[-1]
    second, _ = await page(store, after=next_key)
    assert second[0]["session_key"] > next_key


async def test_filters_by_platform_user_and_title_or_key(store: SessionStore) -> None:
    found, next_key = await page(store, limit=50, platform="discord")
    assert len(found) == 10 and {e["platform"] for e in found} == {"discord"}
    assert next_key is None
    found, _ = await page(store, limit=50, user="name2")  # Name2, Name20..29: case-blind
    assert sorted(e["user_id"] for e in found) == sorted(["u2", *(f"u{i}" for i in range(20, 30))])
    found, _ = await page(store, limit=50, text="CHAT-07")
    assert [e["user_id"] for e in found] == ["u7"]
    assert found[0]["title"] == "New Session"


async def test_a_rare_match_is_found_in_one_request_by_the_database(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console_reads, "FILTER_WINDOW", 8)  # not used: the database filters
    found, after = await page(store, text="chat-29")
    assert [e["user_id"] for e in found] == ["u29"] and after is None
    found, after = await page(store, limit=2, user="NAME2")  # Name2, Name20..29: 11
    assert len(found) == 2 and after == found[-1]["session_key"]
    rest, _ = await page(store, after=after, limit=50, user="NAME2")
    named = {"u2", *(f"u{i}" for i in range(20, 30))}
    assert sorted(e["user_id"] for e in found + rest) == sorted(named)
    # LIKE's wildcards in the text are taken literally: no key holds "chat_0" or "chat%0"
    assert (await page(store, text="chat_0"))[0] == []
    assert (await page(store, text="chat%0"))[0] == []


async def test_a_filter_outside_ascii_walks_one_window_per_page_and_the_cursor_goes_on(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = SessionSource(
        platform=Platform.TELEGRAM, chat_id="chat-zz", user_id="uz", user_name="Zoë"
    )
    await store.get_or_create_session(source)
    monkeypatch.setattr(console_reads, "FILTER_WINDOW", 8)
    after, pages, found = None, 0, []
    while True:
        listed, after = await page(store, after=after, user="ZOË")  # folded as Python folds
        pages += 1
        found += listed
        if after is None:
            break
    assert [e["user_id"] for e in found] == ["uz"]
    assert pages == 4  # 31 entries, 8 a window


async def test_session_counts_of_an_unknown_session_are_zero(store: SessionStore) -> None:
    counts = await store.read(lambda conn: console_reads.session_counts(conn, "nope"))
    assert counts == dict.fromkeys(counts, 0) and "estimated_cost_usd" in counts
