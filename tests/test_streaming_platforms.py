"""Streamed replies on Discord (discord.py, message edits) and Slack
(slack-bolt's client, chat.update) against their wire fakes: one message edited to the
final text no more often than the interval; a 429 skips interim edits and the final
still arrives."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adapters.discord import DiscordAdapter
from adapters.slack import SlackAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from tests.discord_support import restore_discord_globals  # noqa: F401 (autouse)
from tests.fakes.agents import streaming
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack, dm
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

STORY = "story: " + " ".join(f"word{n}" for n in range(60)) + "."
MARKDOWN = "# Plan\n- **first** step, see [docs](https://example.com/a?b=1&c=2)\n- <!channel> `a<b`"
REPLIES = {"story": STORY, "markdown": MARKDOWN}
INTERVAL = 0.3
ALICE = "42"


def at_least_apart(times: list[float], interval: float) -> bool:
    return all(b - a >= interval * 0.9 for a, b in itertools.pairwise(sorted(times)))


# --- Discord ---------------------------------------------------------------------------------


@pytest.fixture
async def discord_bot(tmp_path: Path) -> AsyncIterator[tuple[FakeDiscord, GatewayRunner]]:
    async with FakeDiscord(token="MTEwMA.fake-bot-token.Zq7Xk9") as dc:
        dc.add_user(ALICE, "Alice")
        settings = {
            "enabled": True,
            "token": "MTEwMA.fake-bot-token.Zq7Xk9",
            "api_base_url": dc.api_base_url,
            "allowed_users": [ALICE],
            "edit_interval": INTERVAL,
        }
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"discord": settings}, "streaming": {"min_chars": 5}}
        )
        adapter = DiscordAdapter(
            config.platforms.discord, guild_ready_timeout=0.05, ready_timeout=5.0
        )
        runner = GatewayRunner(
            config, [adapter], agent_factory=streaming({"story": STORY}, 0.03), home=tmp_path
        )
        try:
            await runner.start()
            yield dc, runner
        finally:
            await runner.stop()


async def test_discord_streams_one_message_edited_to_the_final_text(
    discord_bot: tuple[FakeDiscord, GatewayRunner],
) -> None:
    dc, _ = discord_bot
    await dc.dm(ALICE, "tell a story")
    channel = dc.dm_channel(ALICE)
    await wait_for(lambda: dc.chat_view(channel) == [STORY], within=10)
    await asyncio.sleep(INTERVAL * 2)
    assert len(dc.sent) == 1 and len(dc.edits) >= 2
    assert dc.chat_view(channel) == [STORY]
    assert at_least_apart(dc.send_attempts + dc.edit_attempts, INTERVAL)


async def test_discord_a_rate_limited_edit_still_ends_with_the_final(
    discord_bot: tuple[FakeDiscord, GatewayRunner],
) -> None:
    dc, _ = discord_bot
    dc.fail_next_edit(retry_after=0.8)
    await dc.dm(ALICE, "tell a story")
    channel = dc.dm_channel(ALICE)
    await wait_for(lambda: dc.chat_view(channel) == [STORY], within=15)
    assert len(dc.sent) == 1
    # No other edit went out while the limit lasted.
    first = dc.edit_attempts[0]
    assert [t for t in dc.edit_attempts[1:] if t < first + 0.75] == []


# --- Slack ------------------------------------------------------------------------------------


@pytest.fixture
async def slack_bot(tmp_path: Path) -> AsyncIterator[tuple[FakeSlack, GatewayRunner]]:
    async with FakeSlack(bot_token="xoxb-test-1", app_token="xapp-test-1") as slack:
        settings = {
            "enabled": True,
            "bot_token": "xoxb-test-1",
            "app_token": "xapp-test-1",
            "api_base_url": slack.api_base_url,
            "allowed_users": ["U42"],
            "edit_interval": INTERVAL,
        }
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"slack": settings}, "streaming": {"min_chars": 5}}
        )
        adapter = SlackAdapter(config.platforms.slack, ping_interval=0.5)
        runner = GatewayRunner(
            config, [adapter], agent_factory=streaming(REPLIES, 0.03), home=tmp_path
        )
        try:
            await runner.start()
            yield slack, runner
        finally:
            await runner.stop()


async def test_slack_streams_one_message_updated_to_the_final_text(
    slack_bot: tuple[FakeSlack, GatewayRunner],
) -> None:
    slack, _ = slack_bot
    await slack.deliver(dm("U42", "tell a story", channel="D1"))
    await wait_for(lambda: slack.chat_view("D1") == [STORY], within=10)
    await asyncio.sleep(INTERVAL * 2)
    assert len(slack.posted) == 1 and len(slack.updates) >= 2
    calls = [r["at"] for r in slack.requests if r["method"] in ("chat.postMessage", "chat.update")]
    assert at_least_apart(calls, INTERVAL)


async def test_slack_a_429_skips_interim_updates_and_the_final_arrives(
    slack_bot: tuple[FakeSlack, GatewayRunner],
) -> None:
    slack, _ = slack_bot
    slack.fail_next("chat.update", status=429, retry_after=1)
    await slack.deliver(dm("U42", "tell a story", channel="D1"))
    await wait_for(lambda: slack.chat_view("D1") == [STORY], within=15)
    tried = [r["at"] for r in slack.requests if r["method"] == "chat.update"]
    assert len(tried) >= 2
    assert [t for t in tried if tried[0] < t < tried[0] + 0.95] == []  # skipped, not slept
    assert len(slack.posted) == 1


async def test_slack_gets_markdown_as_mrkdwn_with_its_control_characters_escaped(
    slack_bot: tuple[FakeSlack, GatewayRunner],
) -> None:
    slack, _ = slack_bot
    await slack.deliver(dm("U42", "markdown please", channel="D1"))
    expected = (
        "*Plan*\n• *first* step, see <https://example.com/a?b=1&amp;c=2|docs>\n"
        "• &lt;!channel&gt; `a&lt;b`"
    )
    await wait_for(lambda: slack.chat_view("D1") == [expected], within=10)


def test_to_mrkdwn_keeps_a_chunks_ends_and_never_loses_text() -> None:
    from adapters.markdown import to_mrkdwn

    assert to_mrkdwn("\n\n**a** & b\n\n") == "\n\n*a* &amp; b\n\n"
    assert to_mrkdwn("   ") == "   "
    assert to_mrkdwn("2 < 3 and <@U1>") == "2 &lt; 3 and &lt;@U1&gt;"
