"""Media in and out on Slack: real slack-bolt and slack_sdk against the fake Slack (Web
API, Socket Mode, url_private, files_upload_v2), the real `openai` backend against the
fake OpenAI server, a real runner."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from adapters.slack import SlackAdapter
from gateway.run import GatewayRunner
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_api import FakeSlack, dm
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

BOT_TOKEN = "xoxb-media-9c1f-bot-token"
APP_TOKEN = "xapp-media-2b7d-app-token"

StartGateway = Callable[..., Awaitable[GatewayRunner]]


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(bot_token=BOT_TOKEN, app_token=APP_TOKEN) as fake:
        yield fake


@pytest.fixture
async def start_gateway(
    tmp_path: Path, slack: FakeSlack, model: FakeOpenAI
) -> AsyncIterator[StartGateway]:
    async with Runners() as runners:

        async def start(*, media: dict[str, Any] | None = None, agent: Any = None) -> GatewayRunner:
            settings = {
                "enabled": True,
                "bot_token": BOT_TOKEN,
                "app_token": APP_TOKEN,
                "api_base_url": slack.api_base_url,
                "allowed_users": ["U42"],
            }
            config = media_gateway_config(model, "slack", settings, media=media)
            adapter = SlackAdapter(config.platforms.slack, ping_interval=0.5)
            return await runners.start(config, adapter, agent=agent, home=tmp_path / "home")

        yield start


async def test_shared_image_reaches_the_model_as_an_image_part_fetched_with_the_token(
    slack: FakeSlack, model: FakeOpenAI, start_gateway: StartGateway, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    await start_gateway()
    photo = slack.add_file("cat.png", PHOTO, "image/png")
    await slack.deliver(dm("U42", "what breed?", channel="D1", subtype="file_share", files=[photo]))
    await slack.wait_until(lambda: len(slack.posted) == 1)
    (body,) = chat_requests(model)
    text_part, image_part = last_user(body)
    assert text_part["text"] == "what breed?\n\n[photo: cat.png]"
    assert image_bytes(image_part) == PHOTO
    assert slack.downloads == [photo["id"]]  # the fake serves it only with the bot token
    assert BOT_TOKEN not in caplog.text


async def test_voice_clip_reaches_the_model_as_its_transcript(
    slack: FakeSlack, model: FakeOpenAI, start_gateway: StartGateway
) -> None:
    await start_gateway()
    model.transcripts[VOICE] = "book the room for friday"
    clip = slack.add_file("audio_message.m4a", VOICE, "audio/mp4", subtype="slack_audio")
    await slack.deliver(dm("U42", "", channel="D1", subtype="file_share", files=[clip]))
    await slack.wait_until(lambda: len(slack.posted) == 1)
    (body,) = chat_requests(model)
    assert last_user(body) == "[voice message, transcribed]: book the room for friday"


async def test_over_size_file_gets_the_size_reply(
    slack: FakeSlack, model: FakeOpenAI, start_gateway: StartGateway
) -> None:
    await start_gateway(media={"max_bytes": 64})
    big = slack.add_file("dump.sql", b"-" * 1000, "text/plain")
    await slack.deliver(dm("U42", "", channel="D1", subtype="file_share", files=[big]))
    await slack.wait_until(lambda: len(slack.posted) == 1)
    assert (
        slack.posted[0]["text"]
        == "That file is too large: the limit is 64 bytes. Nothing was kept."
    )
    assert slack.downloads == [] and chat_requests(model) == []


async def test_attachment_reply_is_uploaded_once(
    slack: FakeSlack, start_gateway: StartGateway, tmp_path: Path
) -> None:
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG chart")
    runner = await start_gateway(agent=FileAgent)
    await slack.deliver(dm("U42", f"send me {chart}", channel="D1"))
    await slack.wait_until(lambda: len(slack.uploads) == 1)
    (upload,) = slack.uploads
    assert upload["data"] == b"\x89PNG chart" and upload["filename"] == "chart.png"
    assert upload["channel"] == "D1" and upload["comment"] == "a chart"
    assert [p["text"] for p in slack.posted] == ["here it is"]
    assert await runner.resend_pending() == 0
    assert len(slack.uploads) == 1
