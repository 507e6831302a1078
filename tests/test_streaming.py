"""Streamed replies through the real platform libraries against the wire
fakes: one message edited in place to the final text, no more often than the interval,
flood waits skipped, the final never lost; the HTTP API's stream of deltas and finals."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from adapters.http import HttpAdapter
from adapters.markdown import to_markdown_v2
from adapters.telegram import TelegramAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from tests.fakes.agents import ScriptedAgent, streaming
from tests.fakes.telegram_api import FakeTelegram, parse_markdown_v2
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")
WORDS = " ".join(f"word{n}" for n in range(60))  # 60 words, 0.03 s apart: ~1.8 s of stream
STORY = f"story: {WORDS}."
PARAGRAPH = "A paragraph of the long answer that goes on and on, line after line. " * 6
LONG = "\n\n".join(f"{n}. {PARAGRAPH.strip()}" for n in range(12))  # > 4096: rolls over
INTERVAL = 0.3


def telegram_runner(tg: FakeTelegram, home: Path, agent: Any, **telegram: Any) -> GatewayRunner:
    settings = {
        "enabled": True,
        "token": TOKEN,
        "base_url": tg.base_url,
        "poll_timeout": 1,
        "allowed_users": ["42"],
        "edit_interval": INTERVAL,
        **telegram,
    }
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"telegram": settings}, "streaming": {"min_chars": 5}}
    )
    return GatewayRunner(
        config, [TelegramAdapter(config.platforms.telegram)], agent_factory=agent, home=home
    )


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as fake:
        yield fake


async def run_telegram(
    tg: FakeTelegram, tmp_path: Path, text: str, agent: Any, **telegram: Any
) -> GatewayRunner:
    runner = telegram_runner(tg, tmp_path / "home", agent, **telegram)
    await runner.start()
    tg.push_message(tg.private_chat(ADA), ADA, text)
    return runner


def gaps(timeline: list[tuple[str, float, Any, str]]) -> list[float]:
    times = [at for kind, at, _, _ in timeline if kind in ("send", "edit")]
    return [b - a for a, b in itertools.pairwise(times)]


async def test_a_streamed_reply_is_one_message_edited_to_the_final_text(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    runner = await run_telegram(tg, tmp_path, "tell a story", streaming({"story": STORY}, 0.03))
    stopped = False
    try:
        await wait_for(lambda: tg.chat_view(42) == [STORY], within=10)
        # The transcript keeps the final text only.
        key = (await runner.store.list_sessions())[0].session_key
        assert [m["content"] for m in await transcript(runner, key)] == [
            "tell a story",
            STORY,
        ]
        stopped = True
        await runner.stop()  # its turn drained: every send and edit it makes is in
        assert len(tg.sent) == 1  # one message ...
        assert len(tg.edits) >= 2  # ... edited as the story was written
        assert tg.chat_view(42) == [STORY]
        assert min(gaps(tg.timeline)) >= INTERVAL * 0.9  # never more often than the interval
        assert tg.sent[0]["text"] != STORY  # the first text was a partial
        edited = [params["text"] for params in tg.edits]
        assert all(a != b for a, b in itertools.pairwise(edited))  # never the same text twice
    finally:
        if not stopped:
            await runner.stop()


async def test_a_long_streamed_reply_rolls_over_into_a_second_message(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    agent = streaming({"long": LONG}, 0.002)
    runner = await run_telegram(tg, tmp_path, "long please", agent, edit_interval=0.05)
    stopped = False
    try:
        chunks = TelegramAdapter.split(runner.adapters[next(iter(runner.adapters))], LONG)
        assert len(chunks) == 2
        # as Telegram shows each: Markdown rendered ("0." paragraphs are a list, drawn tight)
        expected = [parse_markdown_v2(to_markdown_v2(chunk))[0] for chunk in chunks]
        await wait_for(lambda: tg.chat_view(42) == expected, within=20)
        stopped = True
        await runner.stop()  # its turn drained: every send and edit it makes is in
        assert len(tg.sent) == 2
        assert tg.chat_view(42) == expected
        assert tg.chat_view(42)[0].rstrip().endswith(".")  # cut at a paragraph, not mid-word
    finally:
        if not stopped:
            await runner.stop()


async def test_a_flood_wait_skips_interim_edits_and_the_final_still_arrives(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    tg.fail_next("editMessageText", status=429, retry_after=1)
    runner = await run_telegram(tg, tmp_path, "tell a story", streaming({"story": STORY}, 0.03))
    try:
        await wait_for(lambda: tg.chat_view(42) == [STORY], within=15)
        tried = [at for method, at in tg.request_times if method == "editMessageText"]
        assert len(tried) >= 2  # the refused edit, and later ones
        # Counted when the turn's stream ends, a moment after the final edit shows.
        await wait_for(lambda: "hermes_stream_flood_waits_total 1" in runner.metrics_text())
        # No edit was tried while the wait lasted (skipped, not queued up).
        assert [at for at in tried if tried[0] < at < tried[0] + 0.95] == []
        assert len(tg.sent) == 1 and tg.chat_view(42) == [STORY]
    finally:
        await runner.stop()


async def test_three_floods_stop_interim_edits_and_the_final_is_delivered(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    tg.fail_next("editMessageText", status=429, retry_after=1, times=3)
    runner = await run_telegram(tg, tmp_path, "tell a story", streaming({"story": STORY}, 0.07))
    try:
        await wait_for(lambda: tg.chat_view(42) == [STORY], within=15)
        tried = [at for method, at in tg.request_times if method == "editMessageText"]
        assert len(tried) == 4  # three refused, then only the final
        assert len(tg.edits) == 1 and len(tg.sent) == 1
    finally:
        await runner.stop()


async def test_a_flood_wait_past_the_cap_sends_the_final_as_a_new_message(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    runner = telegram_runner(tg, tmp_path / "home", streaming({"story": STORY}, 0.03))
    runner.delivery.max_flood_wait = 0.5
    await runner.start()
    try:
        tg.fail_next("editMessageText", status=429, retry_after=30, times=5)
        tg.push_message(tg.private_chat(ADA), ADA, "tell a story")
        await wait_for(lambda: tg.chat_view(42) == [STORY], within=15)
        assert len(tg.sent) == 2  # the partial, then the final as a new message ...
        assert tg.chat_view(42) == [STORY]  # ... and the partial deleted
    finally:
        await runner.stop()


async def test_an_agent_that_does_not_stream_answers_as_before(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    agent = type("Agent", (ScriptedAgent,), {"replies": {"story": STORY}})
    runner = await run_telegram(tg, tmp_path, "tell a story", agent)
    try:
        await wait_for(lambda: tg.chat_view(42) == [STORY])
        assert tg.edits == [] and len(tg.sent) == 1
    finally:
        await runner.stop()


async def test_streaming_off_sends_the_whole_reply_once(tg: FakeTelegram, tmp_path: Path) -> None:
    agent = streaming({"story": STORY}, 0.01)
    runner = await run_telegram(tg, tmp_path, "tell a story", agent, streaming=False)
    try:
        await wait_for(lambda: tg.chat_view(42) == [STORY])
        assert tg.edits == [] and [m["text"] for m in tg.sent_messages] == [STORY]
    finally:
        await runner.stop()


async def test_markdown_refused_in_an_edit_falls_back_to_plain_text(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    reply = "story: a *bold* move, then `code` and more words to stream along here."
    runner = await run_telegram(tg, tmp_path, "tell a story", streaming({"story": reply}, 0.01))
    try:
        await wait_for(lambda: len(tg.sent) == 1)
        tg.fail_parse_next(times=50)  # every formatted edit from now on is refused
        await wait_for(lambda: tg.chat_view(42) == [reply], within=10)
        assert tg.edits[-1].get("parse_mode") is None  # the final went out plain
    finally:
        await runner.stop()


async def test_stop_mid_stream_ends_the_edits_and_forgets_the_stream(
    tg: FakeTelegram, tmp_path: Path
) -> None:
    runner = await run_telegram(tg, tmp_path, "tell a story", streaming({"story": STORY}, 0.05))
    running = True
    try:
        await wait_for(lambda: len(tg.sent) == 1, within=10)
        tg.push_message(tg.private_chat(ADA), ADA, "/stop")
        await wait_for(lambda: not runner.busy_sessions(), within=10)
        stopped_at = time.monotonic()
        rows = await runner.store.read(lambda c: c.execute("SELECT * FROM streams").fetchall())
        assert rows == []
        # Stopped, every task of the runner has ended: what it sent is all it ever sends.
        running = False
        await runner.stop()
        assert [c for c in tg.timeline if c[0] == "edit" and c[1] > stopped_at] == []
        assert STORY not in tg.chat_view(42)
    finally:
        if running:
            await runner.stop()


# --- the HTTP API's stream -------------------------------------------------------------------


async def test_the_http_stream_gives_deltas_then_the_final(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {"http": {"enabled": True, "port": 0, "edit_interval": 0.05}},
            "streaming": {"min_chars": 5},
        }
    )
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(
        config, [adapter], agent_factory=streaming({"story": STORY}, 0.01), home=tmp_path / "h"
    )
    await runner.start()
    try:
        async with aiohttp.ClientSession() as http:
            events: list[tuple[str, Any]] = []
            async with http.get(f"{adapter.url}/v1/chats/c1/stream") as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/event-stream")
                async with http.post(
                    f"{adapter.url}/v1/messages",
                    json={"chat_id": "c1", "user_id": "u1", "text": "tell a story"},
                ) as posted:
                    assert posted.status == 202
                events = await read_events(response, until="final")
            deltas = "".join(data["text"] for name, data in events if name == "delta")
            name, final = events[-1]
            assert name == "final" and final["text"] == STORY
            assert len([n for n, _ in events if n == "delta"]) >= 2
            assert STORY.startswith(deltas) and deltas
            # A reconnect with ?after replays the finals after that seq.
            async with http.get(f"{adapter.url}/v1/chats/c1/stream?after=0") as response:
                replayed = await read_events(response, until="final")
            assert replayed == [("final", final)]
            # The long-poll still returns only final texts.
            async with http.get(f"{adapter.url}/v1/chats/c1/messages?after=0") as polled:
                assert [m["text"] for m in (await polled.json())["messages"]] == [STORY]
    finally:
        await runner.stop()


async def test_the_http_stream_of_an_agent_that_does_not_stream_sends_only_the_final(
    tmp_path: Path,
) -> None:
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"http": {"enabled": True, "port": 0}}}
    )
    adapter = HttpAdapter(config.platforms.http)
    agent = type("Agent", (ScriptedAgent,), {"replies": {}})
    runner = GatewayRunner(config, [adapter], agent_factory=agent, home=tmp_path / "h")
    await runner.start()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{adapter.url}/v1/chats/c2/stream") as response,
        ):
            await http.post(
                f"{adapter.url}/v1/messages",
                json={"chat_id": "c2", "user_id": "u1", "text": "hello"},
            )
            events = await read_events(response, until="final")
        assert [name for name, _ in events] == ["final"]
        assert events[0][1]["text"] == "echo: hello" and events[0][1]["seq"] >= 1
    finally:
        await runner.stop()


# --- helpers -----------------------------------------------------------------------------------


async def read_events(
    response: aiohttp.ClientResponse, until: str, within: float = 10
) -> list[tuple[str, Any]]:
    """Server-sent events up to the first named `until` (comments skipped)."""
    events: list[tuple[str, Any]] = []
    name, data = "message", ""

    async def read() -> None:
        nonlocal name, data
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data += line[5:].strip()
            elif line == "" and data:
                events.append((name, json.loads(data)))
                if name == until:
                    return
                name, data = "message", ""

    await asyncio.wait_for(read(), within)
    return events


async def transcript(runner: GatewayRunner, key: str) -> list[dict[str, Any]]:
    entry = await runner.store.get_entry(key) if hasattr(runner.store, "get_entry") else None
    session_id = entry.session_id if entry else (await runner.store.list_sessions())[0].session_id
    session = await runner.get_session(session_id)
    assert session is not None
    return session["messages"]
