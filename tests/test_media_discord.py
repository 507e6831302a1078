"""Media in and out on Discord: real discord.py against the fake Discord (REST, gateway
and CDN), the real `openai` backend against the fake OpenAI server, a real runner."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.discord import DiscordAdapter
from gateway.run import GatewayRunner
from tests.discord_support import restore_discord_globals  # noqa: F401 (autouse)
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.openai_server import FakeOpenAI
from tests.media_support import (
    PHOTO,
    VOICE,
    FileAgent,
    Runners,
    chat_requests,
    image_bytes,
    last_user,
    media_gateway_config,
    model_fixture,  # noqa: F401 (the `model` fixture)
)
from tests.waiting import wait_for

TOKEN = "MTEwMA.fake-media-token.Zq7Xk9"
ALICE = "42"

MakeBot = Callable[..., Awaitable[GatewayRunner]]


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as fake:
        fake.add_user(ALICE, "Alice")
        yield fake


@pytest.fixture
async def make_bot(dc: FakeDiscord, model: FakeOpenAI, tmp_path: Path) -> AsyncIterator[MakeBot]:
    async with Runners() as runners:

        async def make(*, media: dict[str, Any] | None = None, agent: Any = None) -> GatewayRunner:
            settings = {
                "enabled": True,
                "token": TOKEN,
                "api_base_url": dc.api_base_url,
                "allowed_users": [ALICE],
            }
            config = media_gateway_config(model, "discord", settings, media=media)
            adapter = DiscordAdapter(
                config.platforms.discord, guild_ready_timeout=0.05, ready_timeout=5.0
            )
            home = tmp_path / f"home{runners.started}"
            return await runners.start(config, adapter, agent=agent, home=home)

        yield make


async def test_image_attachment_reaches_the_model_as_an_image_part(
    dc: FakeDiscord, model: FakeOpenAI, make_bot: MakeBot
) -> None:
    runner = await make_bot()
    photo = dc.attachment("cat.jpg", PHOTO, "image/jpeg")
    await dc.dm(ALICE, "look", attachments=[photo])
    channel = dc.dm_channel(ALICE)
    await wait_for(lambda: len(dc.sent_to(channel)) == 1)
    (body,) = chat_requests(model)
    text_part, image_part = last_user(body)
    assert text_part["text"] == "look\n\n[photo: cat.jpg]"
    assert image_bytes(image_part) == PHOTO
    (entry,) = await runner.store.list_sessions()
    assert any((runner.home / "media" / entry.session_id).iterdir())


async def test_voice_message_reaches_the_model_as_its_transcript(
    dc: FakeDiscord, model: FakeOpenAI, make_bot: MakeBot
) -> None:
    await make_bot()
    model.transcripts[VOICE] = "call mum at six"
    voice = dc.attachment("voice-message.ogg", VOICE, "audio/ogg", voice=True)
    await dc.dm(ALICE, "", attachments=[voice])
    await wait_for(lambda: len(dc.sent_to(dc.dm_channel(ALICE))) == 1)
    (body,) = chat_requests(model)
    assert last_user(body) == "[voice message, transcribed]: call mum at six"


async def test_over_size_attachment_gets_the_size_reply(
    dc: FakeDiscord, model: FakeOpenAI, make_bot: MakeBot
) -> None:
    await make_bot(media={"max_bytes": 100})
    big = dc.attachment("big.zip", b"z" * 500, "application/zip")
    await dc.dm(ALICE, "", attachments=[big])
    channel = dc.dm_channel(ALICE)
    await wait_for(lambda: len(dc.sent_to(channel)) == 1)
    assert dc.sent_to(channel) == [
        "That file is too large: the limit is 100 bytes. Nothing was kept."
    ]
    assert dc.cdn_downloads == [] and chat_requests(model) == []


async def test_attachment_reply_is_uploaded_once(
    dc: FakeDiscord, make_bot: MakeBot, tmp_path: Path
) -> None:
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG chart")
    runner = await make_bot(agent=FileAgent)
    await dc.dm(ALICE, f"send me {chart}")
    channel = dc.dm_channel(ALICE)
    await wait_for(lambda: len(dc.uploads) == 1)
    (upload,) = dc.uploads
    assert upload["filename"] == "chart.png" and upload["data"] == b"\x89PNG chart"
    assert upload["content"] == "a chart"
    assert dc.sent_to(channel) == ["here it is", "a chart"]
    assert await runner.resend_pending() == 0  # acknowledged in the ledger
    assert len(dc.uploads) == 1
