"""The seed's SessionStore calls read what was written: reads made on the event loop's
own thread (`Database.read_now`) see every write issued before them, a transcript too
long for that thread is read whole on the reader thread, and many callers at once each
get their own session's messages, before and after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.session import Platform, SessionSource, build_session_key
from gateway.store import loop_reader, transcript
from gateway.store.session_store import SessionStore
from tests.pg_support import StorageBackend

StoreFactory = Callable[..., Awaitable[SessionStore]]


@pytest.fixture
def sessions_dir(tmp_path: Path) -> Path:
    return tmp_path / "sessions"


@pytest.fixture
async def make_store(
    sessions_dir: Path, store_backend: StorageBackend
) -> AsyncIterator[StoreFactory]:
    """Open stores on `sessions_dir` on the backend under test; closed at teardown."""
    opened: list[SessionStore] = []

    async def factory() -> SessionStore:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        store = SessionStore(sessions_dir, store_backend.apply(config))
        opened.append(await store.open())
        return store

    yield factory
    for store in opened:
        await store.close()


@pytest.fixture
async def store(make_store: StoreFactory) -> SessionStore:
    return await make_store()


def dm(chat_id: str) -> SessionSource:
    return SessionSource(platform=Platform.TELEGRAM, chat_id=chat_id, user_id=chat_id)


def key_of(source: SessionSource) -> str:
    return build_session_key(source)


def msg(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


def said(i: int, chat: str = "") -> dict[str, Any]:
    return msg("user" if i % 2 == 0 else "assistant", f"{chat} message {i}")


async def test_a_read_issued_after_a_write_sees_it(make_store: StoreFactory) -> None:
    store = await make_store()
    entry = await store.get_or_create_session(dm("1"))
    # Issued in one loop pass: the append's write is queued, not yet committed, when the
    # load begins; the load still sees it.
    _, loaded, found = await asyncio.gather(
        store.append_to_transcript(entry.session_id, said(0)),
        store.load_transcript(entry.session_id),
        store.lookup_by_session_id(entry.session_id),
    )
    assert loaded == [said(0)]
    assert found is not None and found.session_key == entry.session_key
    again = await store.get_or_create_session(dm("1"))
    stored = await store.get_entry(key_of(dm("1")))
    assert stored is not None
    assert stored.session_id == entry.session_id
    assert stored.updated_at == again.updated_at
    assert stored.origin == dm("1")


async def test_transcripts_and_touches_survive_a_restart(make_store: StoreFactory) -> None:
    store = await make_store()
    entry = await store.get_or_create_session(dm("1"))
    for i in range(3):
        await store.append_to_transcript(entry.session_id, said(i))
    touched = await store.get_or_create_session(dm("1"))
    await store.close()

    reopened = await make_store()
    assert await reopened.load_transcript(entry.session_id) == [said(i) for i in range(3)]
    stored = await reopened.get_entry(key_of(dm("1")))
    assert stored is not None and stored.updated_at == touched.updated_at
    assert (await reopened.get_or_create_session(dm("1"))).session_id == entry.session_id


async def test_many_callers_at_once_each_get_their_own_session(
    make_store: StoreFactory,
) -> None:
    store = await make_store()

    async def chat(name: str) -> tuple[str, list[dict[str, Any]]]:
        entry = await store.get_or_create_session(dm(name))
        for i in range(4):
            await store.append_to_transcript(entry.session_id, said(i, name))
            await asyncio.sleep(0)  # let the other chats' writes share the batches
        return entry.session_id, await store.load_transcript(entry.session_id)

    names = [f"chat{n}" for n in range(24)]
    results = await asyncio.gather(*(chat(name) for name in names))
    assert len({session_id for session_id, _ in results}) == len(names)
    for name, (_, messages) in zip(names, results, strict=True):
        assert messages == [said(i, name) for i in range(4)]


async def test_a_long_transcript_is_read_whole(make_store: StoreFactory) -> None:
    store = await make_store()
    many = (await store.get_or_create_session(dm("many"))).session_id
    big = (await store.get_or_create_session(dm("big"))).session_id
    count = transcript.SMALL_MESSAGES + 5
    await asyncio.gather(*(store.append_to_transcript(many, said(i)) for i in range(count)))
    large = msg("tool", "x" * transcript.SMALL_CHARS)
    await store.append_to_transcript(big, said(0))
    await store.append_to_transcript(big, large)

    assert await store.load_transcript(many) == [said(i) for i in range(count)]
    assert await store.load_transcript(big) == [said(0), large]


@pytest.mark.sqlite_only
async def test_a_busy_loop_reader_hands_the_read_to_the_reader_thread(
    store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = await store.get_or_create_session(dm("1"))
    await store.append_to_transcript(entry.session_id, said(0))
    refused: list[str] = []

    def busy(self: loop_reader.LoopReader, fn: object) -> object:
        refused.append("busy")
        raise loop_reader.LoopReadBusy("database is locked")

    monkeypatch.setattr(loop_reader.LoopReader, "read", busy)
    assert await store.load_transcript(entry.session_id) == [said(0)]
    assert (await store.get_entry(entry.session_key)) == await store.lookup_by_session_id(
        entry.session_id
    )
    assert refused == ["busy", "busy", "busy"]
