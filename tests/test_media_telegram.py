"""Media in and out on Telegram: real python-telegram-bot against the fake Bot API, the
real `openai` backend against the fake OpenAI server (chat and transcription), and a
real GatewayRunner in-process."""

from __future__ import annotations

import logging
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.telegram import TelegramAdapter
from gateway.run import GatewayRunner
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_api import FakeTelegram
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

TOKEN = "123456:AAH-media-TOKEN_abcdefghijklmnopq"
ADA = FakeTelegram.user(42, "Ada", "ada")


@dataclass
class Gateway:
    runner: GatewayRunner
    home: Path
    runners: Runners

    async def stop(self) -> None:
        await self.runners.stop(self.runner)

    async def transcript(self) -> list[dict[str, Any]]:
        (entry,) = await self.runner.store.list_sessions()
        return await self.runner.store.load_transcript(entry.session_id)

    async def session_id(self) -> str:
        (entry,) = await self.runner.store.list_sessions()
        return entry.session_id


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as fake:
        yield fake


@pytest.fixture
async def make_gateway(
    tg: FakeTelegram, model: FakeOpenAI, tmp_path: Path
) -> AsyncIterator[MakeGateway]:
    async with Runners() as runners:

        async def make(
            *,
            media: dict[str, Any] | None = None,
            vision: bool = True,
            agent: Any = None,
            home: Path | None = None,
        ) -> Gateway:
            settings = {
                "enabled": True,
                "token": TOKEN,
                "base_url": tg.base_url,
                "poll_timeout": 1,
                "allowed_users": ["42"],
            }
            config = media_gateway_config(model, "telegram", settings, media=media, vision=vision)
            home = home or tmp_path / f"home{runners.started}"
            adapter = TelegramAdapter(config.platforms.telegram)
            runner = await runners.start(config, adapter, agent=agent, home=home)
            return Gateway(runner, home, runners)

        yield make


def replies(tg: FakeTelegram) -> list[str]:
    return [m.get("text") or m.get("caption") or "" for m in tg.sent_messages]


# --- media in --------------------------------------------------------------------------


async def test_photo_reaches_the_model_as_an_image_part_and_is_stored_0600(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway, caplog: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    gw = await make_gateway()
    file_id = tg.add_file(PHOTO)
    tg.push_media(tg.private_chat(ADA), ADA, "photo", file_id, caption="what is this?")
    await wait_for(lambda: len(tg.sent_messages) == 1)
    (body,) = chat_requests(model)
    text_part, image_part = last_user(body)
    assert text_part == {"type": "text", "text": "what is this?\n\n[photo: photo-100.jpg]"}
    assert image_part["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert image_bytes(image_part) == PHOTO
    # Stored under media/<session_id>/ (0600 in a 0700 directory), referenced by path.
    session_id = await gw.session_id()
    (user, _assistant) = await gw.transcript()
    (ref,) = user["media"]
    assert ref["kind"] == "photo" and ref["bytes"] == len(PHOTO)
    stored = gw.home / ref["path"]
    assert stored.parent == gw.home / "media" / session_id
    assert stored.read_bytes() == PHOTO
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    # The database holds the reference, never the bytes.
    assert "jpeg-bytes" not in str(user)
    # The file URL holds the bot token; no log line does.
    assert tg.downloads and TOKEN not in caplog.text


async def test_without_vision_the_model_gets_a_one_line_note(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    await make_gateway(vision=False)
    tg.push_media(tg.private_chat(ADA), ADA, "photo", tg.add_file(PHOTO))
    await wait_for(lambda: len(tg.sent_messages) == 1)
    (body,) = chat_requests(model)
    assert last_user(body) == "[photo: photo-100.jpg (this model cannot see images)]"


async def test_voice_note_reaches_the_model_as_its_transcript(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    model.transcripts[VOICE] = "remind me to buy milk"
    tg.push_media(tg.private_chat(ADA), ADA, "voice", tg.add_file(VOICE))
    await wait_for(lambda: len(tg.sent_messages) == 1)
    (heard,) = model.transcriptions
    assert heard["data"] == VOICE and heard["model"] == "whisper-1"
    assert heard["auth"] == "Bearer sk-media"
    (body,) = chat_requests(model)
    assert last_user(body) == "[voice message, transcribed]: remind me to buy milk"
    user = (await gw.transcript())[0]
    assert user["content"].endswith("remind me to buy milk")  # later turns see it too


async def test_voice_without_transcription_gets_a_placeholder_and_the_user_is_told(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    await make_gateway(media={})
    tg.push_media(tg.private_chat(ADA), ADA, "voice", tg.add_file(VOICE))
    await wait_for(lambda: len(tg.sent_messages) == 2)
    assert "transcription is off" in replies(tg)[0]
    (body,) = chat_requests(model)
    assert last_user(body) == "[voice message: not transcribed (transcription is off)]"
    assert model.transcriptions == []


async def test_declared_over_size_file_gets_the_size_reply_and_nothing_is_fetched(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(media={"max_bytes": 1000})
    file_id = tg.add_file(b"x" * 2000)
    tg.push_media(tg.private_chat(ADA), ADA, "document", file_id, file_name="big.bin")
    await wait_for(lambda: len(tg.sent_messages) == 1)
    assert replies(tg) == ["That file is too large: the limit is 1000 bytes. Nothing was kept."]
    assert "getFile" not in tg.methods() and tg.downloads == []
    assert chat_requests(model) == []  # the model is not asked about nothing
    assert not (gw.home / "media").exists() or not any((gw.home / "media").rglob("*.*"))


async def test_file_larger_than_declared_is_cut_off_at_the_cap_and_not_kept(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway(media={"max_bytes": 1000})
    file_id = tg.add_file(b"y" * 200_000, declared_size=10)  # the platform under-declares
    tg.push_media(tg.private_chat(ADA), ADA, "document", file_id, file_name="lie.bin")
    await wait_for(lambda: len(tg.sent_messages) == 1)
    assert replies(tg)[0].startswith("That file is too large")
    assert list((gw.home / "media").rglob("*.bin")) == []


async def test_text_document_is_inlined_up_to_max_text_chars(
    tg: FakeTelegram, model: FakeOpenAI, make_gateway: MakeGateway
) -> None:
    await make_gateway(media={"max_text_chars": 20})
    data = b"name,age\nada,36\nbob,41\ncharles,50\n"
    file_id = tg.add_file(data)
    tg.push_media(
        tg.private_chat(ADA), ADA, "document", file_id, file_name="people.csv", mime_type="text/csv"
    )
    await wait_for(lambda: len(tg.sent_messages) == 1)
    (body,) = chat_requests(model)
    assert last_user(body) == ("[file people.csv]:\nname,age\nada,36\nbob,\n[cut at 20 characters]")


async def test_deleting_a_session_removes_its_media_directory(
    tg: FakeTelegram, make_gateway: MakeGateway
) -> None:
    gw = await make_gateway()
    tg.push_media(tg.private_chat(ADA), ADA, "photo", tg.add_file(PHOTO))
    await wait_for(lambda: len(tg.sent_messages) == 1)
    session_id = await gw.session_id()
    directory = gw.home / "media" / session_id
    assert any(directory.iterdir())
    assert (await gw.runner.delete_session(session_id))["status"] == "deleted"
    assert not directory.exists()


# --- media out -------------------------------------------------------------------------


async def test_attachment_reply_is_sent_once_as_a_photo(
    tg: FakeTelegram, make_gateway: MakeGateway, tmp_path: Path
) -> None:
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG chart")
    gw = await make_gateway(agent=FileAgent)
    tg.push_message(tg.private_chat(ADA), ADA, f"send me {chart}")
    await wait_for(lambda: len(tg.sent_files) == 1)
    await wait_for(lambda: len(tg.sent_messages) == 2)
    (sent,) = tg.sent_files
    assert sent["method"] == "sendPhoto" and sent["data"] == b"\x89PNG chart"
    assert sent["params"]["caption"] == "a chart"
    assert replies(tg) == ["here it is", "a chart"]
    # A restart finds it acknowledged in the ledger: nothing is sent again.
    await gw.stop()
    again = await make_gateway(agent=FileAgent, home=gw.home)
    await again.runner.resend_pending()
    assert len(tg.sent_files) == 1


async def test_attachment_refused_stays_in_the_ledger_and_is_sent_once_after_restart(
    tg: FakeTelegram, make_gateway: MakeGateway, tmp_path: Path
) -> None:
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG chart")
    gw = await make_gateway(agent=FileAgent)
    tg.fail_next("sendPhoto", status=500)
    tg.push_message(tg.private_chat(ADA), ADA, f"send me {chart}")
    await wait_for(lambda: tg.methods().count("sendPhoto") == 1)
    await wait_for(lambda: len(tg.sent_messages) == 1)  # the text went, the photo not
    assert tg.sent_files == []
    await gw.stop()  # as a crash would leave it: recorded, not acknowledged
    again = await make_gateway(agent=FileAgent, home=gw.home)
    await wait_for(lambda: len(tg.sent_files) == 1)  # start-up sends what is pending
    await again.runner.resend_pending()
    assert len(tg.sent_files) == 1
    assert replies(tg) == ["here it is", "a chart"]
