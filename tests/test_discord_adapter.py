"""The Discord adapter end to end: real discord.py over loopback to a fake Discord (REST +
gateway websocket), a real GatewayRunner in-process with a scripted agent."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from discord.gateway import KeepAliveHandler
from structlog.testing import capture_logs

from adapters.discord import DiscordAdapter
from config import DiscordConfig, GatewayConfig
from gateway.run import GatewayRunner
from gateway.runner.pairing import Pairing
from gateway.session import Platform, SessionSource
from tests.discord_support import restore_discord_globals  # noqa: F401 (autouse)
from tests.fakes.agents import scripted
from tests.fakes.discord_api import FakeDiscord
from tests.waiting import wait_for

TOKEN = "MTEwMA.fake-bot-token.Zq7Xk9"  # distinctive, so a leak into the logs is found
ALICE = "42"  # in allowed_users
STRANGER = "77"  # nobody approved them
LONG_REPLY = "\n\n".join(" ".join(f"para{p}-word{w}" for w in range(120)) for p in range(12))[:9000]
MESSAGE_CONTENT_INTENT = 1 << 15


ScriptedAgent = scripted({"long": LONG_REPLY})


@dataclass
class Bot:
    runner: GatewayRunner
    adapter: DiscordAdapter

    async def session_keys(self) -> list[str]:
        return sorted(s["session_key"] for s in await self.runner.list_sessions())


MakeBot = Callable[..., Awaitable[Bot]]


async def replies(dc: FakeDiscord, channel: str, count: int, within: float = 5.0) -> list[str]:
    """The bot's messages in `channel` once there are at least `count` of them."""
    await wait_for(lambda: len(dc.sent_to(channel)) >= count, within)
    return dc.sent_to(channel)


@pytest.fixture
async def dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(token=TOKEN) as fake:
        fake.add_user(ALICE, "Alice")
        fake.add_user(STRANGER, "Stranger")
        yield fake


@pytest.fixture
async def make_bot(dc: FakeDiscord, tmp_path: Path) -> AsyncIterator[MakeBot]:
    made: list[GatewayRunner] = []

    async def make(**discord_settings: Any) -> Bot:
        settings = {
            "enabled": True,
            "token": TOKEN,
            "api_base_url": dc.api_base_url,
            "allowed_users": [ALICE],
        } | discord_settings
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"discord": settings}}
        )
        # reconnect_delay: a connect() ended by an error is retried at once, not after
        # the production backoff's first second (that the retry happens is what is judged).
        adapter = DiscordAdapter(
            config.platforms.discord,
            guild_ready_timeout=0.05,
            ready_timeout=5.0,
            reconnect_delay=0.02,
        )
        runner = GatewayRunner(
            config, [adapter], agent_factory=ScriptedAgent, home=tmp_path / f"home{len(made)}"
        )
        try:
            await runner.start()
        except BaseException:
            await runner.stop()  # close the store: its thread would keep pytest alive
            raise
        made.append(runner)
        return Bot(runner, adapter)

    yield make
    for runner in made:
        await runner.stop()


def mention(dc: FakeDiscord) -> str:
    return f"<@{dc.bot_id}>"


# --- DMs -------------------------------------------------------------------------------------


async def test_a_dm_from_an_allowed_user_gets_one_reply_in_the_same_channel(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    message_id = await dc.dm(ALICE, "hello, slowly")
    dm = dc.dm_channel(ALICE)
    assert await replies(dc, dm, 1) == ["echo: hello, slowly"]
    # The bot's own echoed MESSAGE_CREATE came before this one in the same session: an
    # answer to it would come before this one's.
    await dc.dm(ALICE, "next")
    assert await replies(dc, dm, 2) == ["echo: hello, slowly", "echo: next"]
    body = dc.sent[0]
    assert body["allowed_mentions"] == {"parse": ["users"]}  # no @everyone, @here, roles
    assert body["message_reference"]["message_id"] == int(message_id)
    assert body["message_reference"]["fail_if_not_exists"] is False
    assert body["nonce"] and body["enforce_nonce"] is True
    assert dm in dc.typing
    assert dc.identifies[0]["intents"] & MESSAGE_CONTENT_INTENT
    assert dc.connections[0]["compress"] == "zlib-stream"  # the fake spoke zlib-stream
    assert dc.unhandled == []  # the fake served every call discord.py made
    assert await bot.session_keys() == [f"agent:main:discord:dm:{dm}"]
    health = bot.runner.health()["adapters"]["discord"]
    assert health["state"] == "running" and health["user"] == "hermes"


async def test_a_resend_with_the_same_delivery_id_is_deduplicated_by_discord(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    target = SessionSource(platform=Platform.DISCORD, chat_id=dc.dm_channel(ALICE))
    first = await bot.adapter.send(target, "only once", delivery_id=9001)
    again = await bot.adapter.send(target, "only once", delivery_id=9001)
    assert first == again
    assert dc.sent_to(target.chat_id) == ["only once"]
    assert len(dc.send_attempts) == 2


async def test_a_long_reply_arrives_as_several_messages_in_order(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    await make_bot()
    assert len(LONG_REPLY) == 9000
    await dc.dm(ALICE, "something long please")
    dm = dc.dm_channel(ALICE)
    await wait_for(lambda: len("".join(dc.sent_to(dm))) >= len(LONG_REPLY))
    chunks = dc.sent_to(dm)
    assert len(chunks) >= 5
    assert all(len(chunk) <= 2000 for chunk in chunks)
    assert "".join(chunks) == LONG_REPLY


async def test_a_429_on_send_is_waited_out_and_delivered_once(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    await make_bot()
    dc.fail_next_send(status=429, retry_after=0.5)
    await dc.dm(ALICE, "are you there")
    dm = dc.dm_channel(ALICE)
    assert await replies(dc, dm, 1) == ["echo: are you there"]
    await dc.dm(ALICE, "next")  # its reply comes after any second send of the first
    assert await replies(dc, dm, 2) == ["echo: are you there", "echo: next"]
    refused, accepted = dc.send_attempts[:2]
    assert accepted - refused >= 0.45  # retry_after honoured


async def test_the_same_message_delivered_twice_gets_one_reply(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    await make_bot()
    message_id = await dc.dm(ALICE, "once")
    dm = dc.dm_channel(ALICE)
    await replies(dc, dm, 1)
    await dc.redeliver(message_id)
    await dc.dm(ALICE, "after")
    # A reply to the redelivery would come before the one to "after" (one session).
    assert await replies(dc, dm, 2) == ["echo: once", "echo: after"]


async def test_an_unknown_user_gets_a_pairing_code_then_replies_once_approved(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    await dc.dm(STRANGER, "hi")
    dm = dc.dm_channel(STRANGER)
    (notice,) = await replies(dc, dm, 1)
    match = re.search(r"pairing code is ([A-Z2-9]{8})", notice)
    assert match, notice
    assert await Pairing(bot.runner.store).approve("discord", match.group(1)) is not None
    await dc.dm(STRANGER, "hello again")
    assert (await replies(dc, dm, 2))[1] == "echo: hello again"
    assert await bot.session_keys() == [f"agent:main:discord:dm:{dm}"]  # "hi" never ran


# --- guild channels and threads --------------------------------------------------------------


async def test_a_guild_message_is_answered_only_when_addressed_to_the_bot(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    await dc.guild_message(dc.channel, ALICE, "just chatting")
    asked = await dc.guild_message(
        dc.channel, ALICE, f"{mention(dc)} what's up", mentions=[dc.bot_id]
    )
    # Handled in order: the reply to the mention means the first message was seen.
    assert await replies(dc, dc.channel, 1) == ["echo: what's up"]
    assert dc.sent[0]["message_reference"]["message_id"] == int(asked)
    assert await bot.session_keys() == [f"agent:main:discord:group:{dc.channel}:{ALICE}"]

    await dc.guild_message(dc.channel, ALICE, "and a reply to you", reference=dc.sent[0]["id"])
    assert (await replies(dc, dc.channel, 2))[1] == "echo: and a reply to you"


async def test_require_mention_off_answers_every_guild_message(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    await make_bot(require_mention=False)
    await dc.guild_message(dc.channel, ALICE, "no mention needed")
    assert await replies(dc, dc.channel, 1) == ["echo: no mention needed"]


async def test_a_free_response_channel_needs_no_mention(dc: FakeDiscord, make_bot: MakeBot) -> None:
    await make_bot(free_response_channels=[dc.other_channel])
    await dc.guild_message(dc.channel, ALICE, "ignored here")
    await dc.guild_message(dc.other_channel, ALICE, "answered here")
    assert await replies(dc, dc.other_channel, 1) == ["echo: answered here"]
    assert dc.sent_to(dc.channel) == []


async def test_a_message_in_a_thread_is_answered_in_the_thread(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    await dc.guild_message(dc.channel, ALICE, "not for the bot", thread=dc.thread)
    await dc.guild_message(
        dc.channel, ALICE, f"{mention(dc)} plan it", mentions=[dc.bot_id], thread=dc.thread
    )
    # Threads are shared sessions, so the agent sees who spoke.
    assert await replies(dc, dc.thread, 1) == ["echo: [Alice] plan it"]
    assert dc.sent_to(dc.channel) == []
    assert await bot.session_keys() == [f"agent:main:discord:group:{dc.channel}:{dc.thread}"]

    later = await dc.add_thread(dc.channel, "started later", owner=ALICE)  # THREAD_CREATE
    await dc.guild_message(
        dc.channel, ALICE, f"{mention(dc)} hi", mentions=[dc.bot_id], thread=later
    )
    assert await replies(dc, later, 1) == ["echo: [Alice] hi"]


async def test_auto_thread_answers_a_channel_mention_in_a_new_thread(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot(auto_thread=True)
    asked = await dc.guild_message(
        dc.channel, ALICE, f"{mention(dc)} let's plan the release", mentions=[dc.bot_id]
    )
    assert await replies(dc, asked, 1) == ["echo: [Alice] let's plan the release"]
    assert dc.threads_created[0]["name"] == "let's plan the release"
    assert "message_reference" not in dc.sent[0]  # the thread hangs off the message itself
    assert await bot.session_keys() == [f"agent:main:discord:group:{dc.channel}:{asked}"]

    with capture_logs() as logs:
        await dc.redeliver(asked)  # the thread exists already: same session, no second reply
        # The bot started this thread: no mention needed there.
        await dc.guild_message(dc.channel, ALICE, "follow-up", thread=asked)
        # A reply to the redelivery would come before the follow-up's (one session).
        assert await replies(dc, asked, 2) == [
            "echo: [Alice] let's plan the release",
            "echo: [Alice] follow-up",
        ]
    assert len(dc.threads_created) == 1
    # Discord's 160004 was understood
    assert [e for e in logs if e["event"] == "discord_thread_not_started"] == []


# --- the connection --------------------------------------------------------------------------


async def test_a_dropped_gateway_connection_is_resumed_without_losing_messages(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot()
    await dc.drop_connection()
    await dc.dm(ALICE, "sent while the bot was away")  # replayed on RESUME
    dm = dc.dm_channel(ALICE)
    assert await replies(dc, dm, 1) == ["echo: sent while the bot was away"]
    await wait_for(lambda: bot.adapter.state == "running")
    assert bot.adapter.reconnects == 1
    assert len(dc.resumes) == 1 and len(dc.identifies) == 1
    await dc.dm(ALICE, "and after")
    assert (await replies(dc, dm, 2))[1] == "echo: and after"


async def test_an_unresumable_session_identifies_again_at_the_configured_gateway(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    bot = await make_bot(gateway_url=dc.gateway_url)
    assert ("GET", "/api/v10/gateway/bot") not in dc.requests  # the configured URL is used
    await dc.drop_connection(resumable=False)
    # discord.py goes back to DiscordWebSocket.DEFAULT_GATEWAY to IDENTIFY again, after
    # the 5 s pause its before_identify_hook keeps between IDENTIFYs (Discord's limit).
    await wait_for(lambda: len(dc.identifies) == 2 and bot.adapter.state == "running", 10)
    assert bot.adapter.reconnects == 1
    await dc.dm(ALICE, "still there?")
    assert await replies(dc, dc.dm_channel(ALICE), 1) == ["echo: still there?"]


def heartbeat_threads() -> list[threading.Thread]:
    """discord.py's heartbeat threads that were not told to stop: one per live socket."""
    return [
        thread
        for thread in threading.enumerate()
        if isinstance(thread, KeepAliveHandler) and not thread._stop_ev.is_set()
    ]


async def test_a_payload_that_ends_the_connection_leaves_no_socket_behind(
    dc: FakeDiscord, make_bot: MakeBot
) -> None:
    before = len(heartbeat_threads())
    bot = await make_bot()
    assert len(heartbeat_threads()) == before + 1
    for round_ in range(1, 4):
        # Too deep for any JSON decoder: discord.py's connect() ends with the error, and
        # the adapter connects again by itself.
        await dc.dispatch_raw("MESSAGE_CREATE", b"[" * 100_000 + b"]" * 100_000)
        await wait_for(lambda r=round_: len(dc.identifies) == 1 + r, within=15)
        await wait_for(lambda: bot.adapter.state == "running", within=15)
    # The sockets of the ended connections were closed, and their heartbeats with them.
    assert len(heartbeat_threads()) == before + 1
    await dc.dm(ALICE, "still there?")
    assert await replies(dc, dc.dm_channel(ALICE), 1) == ["echo: still there?"]
    await bot.runner.stop()
    assert len(heartbeat_threads()) == before


async def test_a_wrong_token_fails_start_with_a_clear_error(dc: FakeDiscord) -> None:
    config = DiscordConfig(token="not-the-token", api_base_url=dc.api_base_url)
    adapter = DiscordAdapter(config)
    with pytest.raises(ValueError, match="rejected the bot token") as failure:
        await adapter.start()
    assert "not-the-token" not in str(failure.value)
    assert adapter.health()["state"] == "failed"
    await adapter.stop()


def test_a_missing_token_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"platforms\.discord\.token is required"):
        DiscordAdapter(DiscordConfig(enabled=True))


async def test_a_missing_message_content_intent_fails_start_with_what_to_enable() -> None:
    async with FakeDiscord(token=TOKEN, message_content_allowed=False) as dc:
        config = DiscordConfig(token=TOKEN, api_base_url=dc.api_base_url)
        adapter = DiscordAdapter(config)
        with pytest.raises(ValueError, match="MESSAGE CONTENT intent is not enabled"):
            await adapter.start()
        assert adapter.health()["state"] == "failed"
        await adapter.stop()


async def test_the_bot_token_never_appears_in_the_logs(
    dc: FakeDiscord,
    make_bot: MakeBot,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="discord")  # configure_logging quiets it
    bot = await make_bot()
    await dc.dm(ALICE, "hello")
    dc.fail_next_send(status=429, retry_after=0.1)
    await replies(dc, dc.dm_channel(ALICE), 1)
    await dc.drop_connection()  # RESUME sends the token again
    await wait_for(lambda: len(dc.resumes) == 1 and bot.adapter.state == "running")
    out, err = capfd.readouterr()
    assert "logging in using static token" in caplog.text  # discord.py's logs were captured
    assert "rate limited" in caplog.text
    for text in (caplog.text, out, err, json.dumps(bot.runner.health(), default=str)):
        assert TOKEN not in text
