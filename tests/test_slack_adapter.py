"""The Slack adapter end to end: real slack-bolt and slack_sdk over loopback to a fake
Slack (tests/fakes/slack_api.py), a real GatewayRunner in-process."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.slack import SlackAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from gateway.runner.pairing import Pairing
from tests.fakes.agents import scripted
from tests.fakes.slack_api import (
    FakeSlack,
    app_mention,
    channel_message,
    dm,
    next_ts,
    post_event,
    redeliver,
    url_verification,
)
from tests.waiting import wait_for

BOT_TOKEN = "xoxb-test-7f3a9c-bot-token"
APP_TOKEN = "xapp-test-51d2e8-app-token"
SIGNING_SECRET = "signing-secret-0b6e44"
#: a reply long enough for three Slack messages
LONG_REPLY = "\n\n".join(f"paragraph {i:04d} " + "lorem ipsum " * 60 for i in range(120))


EchoAgent = scripted({"long": LONG_REPLY})


@dataclass
class Gateway:
    runner: GatewayRunner
    adapter: SlackAdapter

    @property
    def events_url(self) -> str:
        return f"http://127.0.0.1:{self.adapter.port}/slack/events"

    async def session_keys(self) -> list[str]:
        return [entry["session_key"] for entry in await self.runner.list_sessions()]


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack(bot_token=BOT_TOKEN, app_token=APP_TOKEN) as fake:
        yield fake


@pytest.fixture
async def start_gateway(tmp_path: Path, slack: FakeSlack) -> AsyncIterator[StartGateway]:
    """Starts a gateway with a Slack adapter (Socket Mode unless `mode="http"`); `home`
    reuses a gateway home (a restart). Every gateway is stopped at the end."""
    running: list[GatewayRunner] = []

    async def start(home: str = "home", **slack_settings: Any) -> Gateway:
        settings = {
            "enabled": True,
            "bot_token": BOT_TOKEN,
            "app_token": APP_TOKEN,
            "signing_secret": SIGNING_SECRET,
            "api_base_url": slack.api_base_url,
            "port": 0,
            "allowed_users": ["U42"],
            **slack_settings,
        }
        config = GatewayConfig.model_validate({"timezone": "UTC", "platforms": {"slack": settings}})
        adapter = SlackAdapter(config.platforms.slack, ping_interval=0.5)
        runner = GatewayRunner(config, [adapter], agent_factory=EchoAgent, home=tmp_path / home)
        running.append(runner)  # stopped even when start() fails: its store is open
        await runner.start()
        return Gateway(runner, adapter)

    yield start
    for runner in running:
        await runner.stop()


async def posted(slack: FakeSlack, count: int, within: float = 5.0) -> list[dict[str, Any]]:
    """The first `count` posted messages, once there are that many."""
    await slack.wait_until(lambda: len(slack.posted) >= count, within)
    return slack.posted[:count]


async def posted_once_stopped(
    slack: FakeSlack, gw: Gateway, *envelopes: str
) -> list[dict[str, Any]]:
    """Everything posted, once Slack has its ack for each envelope and the gateway stopped.

    The adapter acks an event after the gateway decided on it (accepted, a duplicate,
    ignored), and stopping drains every turn an accepted event started: a reply that
    must not exist would be in the list."""
    for envelope in envelopes:
        await slack.wait_for_ack(envelope)
    await gw.runner.stop()
    return slack.posted


def post_message_calls(slack: FakeSlack) -> int:
    return sum(1 for r in slack.requests if r["method"] == "chat.postMessage")


# --- Socket Mode ---------------------------------------------------------------------------


async def test_dm_from_allowed_user_gets_exactly_one_reply(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    assert gw.adapter.health()["state"] == "running"
    assert gw.adapter.bot_user_id == "UBOT" and gw.adapter.bot_username == "hermes"
    envelope = await slack.deliver(dm("U42", "hello &amp; welcome", channel="D1"))
    await slack.wait_for_ack(envelope)
    [reply] = await posted(slack, 1)
    assert reply["channel"] == "D1" and reply["thread_ts"] is None
    # Slack escapes &, < and > both ways; the agent saw and wrote them plainly.
    assert reply["text"] == "echo: hello &amp; welcome"
    assert await gw.session_keys() == ["agent:main:slack:dm:D1"]
    assert len(await posted_once_stopped(slack, gw, envelope)) == 1


async def test_channel_message_needs_a_mention(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    chatting = await slack.deliver(channel_message("C7", "U42", "just chatting"))
    mention = await slack.deliver(channel_message("C7", "U42", "<@UBOT> what time is it?"))
    [reply] = await posted(slack, 1)
    assert reply == {**reply, "channel": "C7", "text": "echo: what time is it?", "thread_ts": None}
    await slack.wait_for_ack(chatting)
    assert await gw.session_keys() == ["agent:main:slack:channel:C7:U42"]
    # "just chatting" got nothing
    assert len(await posted_once_stopped(slack, gw, chatting, mention)) == 1


async def test_free_response_channel_needs_no_mention(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    await start_gateway(free_response_channels=["C8"])
    await slack.deliver(channel_message("C8", "U42", "anyone here?"))
    [reply] = await posted(slack, 1)
    assert reply["text"] == "echo: anyone here?"


async def test_thread_reply_is_answered_in_its_thread(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    root = next_ts()
    await slack.deliver(channel_message("C7", "U42", "<@UBOT> and in here?", thread_ts=root))
    [reply] = await posted(slack, 1)
    assert (reply["channel"], reply["thread_ts"]) == ("C7", root)
    assert await gw.session_keys() == [f"agent:main:slack:channel:C7:{root}"]


async def test_long_reply_arrives_as_ordered_chunks_within_the_limit(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    assert len(LONG_REPLY) > 2 * 40000
    envelope = await slack.deliver(dm("U42", "something long please"))
    chunks = [m["text"] for m in await posted(slack, 3)]
    assert all(len(chunk) <= 40000 for chunk in chunks)
    assert "".join(chunks) == LONG_REPLY
    assert len(await posted_once_stopped(slack, gw, envelope)) == 3


async def test_rate_limited_post_is_waited_out_and_delivered_once(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    slack.fail_next("chat.postMessage", status=429, retry_after=1)
    started = time.monotonic()
    envelope = await slack.deliver(dm("U42", "busy?"))
    [reply] = await posted(slack, 1, within=8.0)
    assert time.monotonic() - started >= 1.0  # Retry-After was honoured
    assert reply["text"] == "echo: busy?"
    assert len(await posted_once_stopped(slack, gw, envelope)) == 1
    assert post_message_calls(slack) == 2  # the 429, then the one that went through


async def test_redelivered_event_gets_one_reply(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    event = dm("U42", "only once")
    first = await slack.deliver(event)
    again = await slack.deliver(redeliver(event), retry_attempt=1)
    await posted(slack, 1)
    assert len(await posted_once_stopped(slack, gw, first, again)) == 1


async def test_redelivery_after_a_restart_is_dropped_by_the_durable_inbox(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    first = await start_gateway(home="shared")
    event = dm("U42", "before the restart")
    await slack.deliver(event)
    await posted(slack, 1)
    await first.runner.stop()
    second = await start_gateway(home="shared")  # a fresh adapter: nothing in memory
    envelope = await slack.deliver(redeliver(event), retry_attempt=2)
    assert len(await posted_once_stopped(slack, second, envelope)) == 1


async def test_mention_delivered_as_message_and_app_mention_gets_one_reply(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    message = channel_message("C7", "U42", "hi <@UBOT|hermes> ping")
    mention = await slack.deliver(app_mention(message))
    plain = await slack.deliver(message)
    [reply] = await posted(slack, 1)
    assert reply["text"] == "echo: hi ping"
    assert len(await posted_once_stopped(slack, gw, mention, plain)) == 1


async def test_bot_messages_and_edits_are_ignored(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway(free_response_channels=["C8"])
    envelopes = [
        await slack.deliver(channel_message("C8", "UBOT", "my own reply")),
        await slack.deliver(channel_message("C8", "U42", "from a bot", bot_id="B9")),
        await slack.deliver(channel_message("C8", "U42", "edited", subtype="message_changed")),
    ]
    for envelope in envelopes:
        await slack.wait_for_ack(envelope)
    assert await gw.session_keys() == []
    assert await posted_once_stopped(slack, gw) == []


async def test_unknown_user_pairs_then_gets_replies(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway()
    await slack.deliver(dm("U99", "let me in", user_profile={"display_name": "Zed"}))
    [notice] = await posted(slack, 1)
    assert notice["channel"] == "DU99"
    match = re.search(r"pairing code is ([A-Z2-9]{8})", notice["text"])
    assert match is not None, notice["text"]
    assert await gw.session_keys() == []
    request = await Pairing(gw.runner.store).approve("slack", match.group(1))
    assert request is not None and (request.user_id, request.user_name) == ("U99", "Zed")
    await slack.deliver(dm("U99", "thanks"))
    replies = await posted(slack, 2)
    assert replies[1]["text"] == "echo: thanks"


@pytest.mark.parametrize("fault", ["dropped", "disconnect message"])
async def test_lost_socket_mode_connection_is_replaced(
    slack: FakeSlack, start_gateway: StartGateway, fault: str
) -> None:
    gw = await start_gateway()
    if fault == "dropped":
        await slack.drop_connection()
    else:
        await slack.send_disconnect()
    await slack.wait_until(lambda: slack.connections == 2)
    await wait_for(lambda: gw.adapter.health()["reconnects"] >= 1 and gw.adapter.state == "running")
    assert gw.runner.health()["status"] == "ok"
    await slack.deliver(dm("U42", "still there?"))
    [reply] = await posted(slack, 1)
    assert reply["text"] == "echo: still there?"


async def test_rejected_bot_token_fails_start_with_the_config_key(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    with pytest.raises(ConnectionError, match=r"platforms\.slack\.bot_token \(invalid_auth\)"):
        await start_gateway(bot_token="xoxb-wrong")


# --- HTTP mode -----------------------------------------------------------------------------


async def test_http_mode_checks_signatures_and_drops_retries(
    slack: FakeSlack, start_gateway: StartGateway
) -> None:
    gw = await start_gateway(mode="http", app_token=None)
    url = gw.events_url

    status, body = await post_event(url, url_verification("ch4ll"), secret=SIGNING_SECRET)
    assert (status, body) == (200, '{"challenge": "ch4ll"}')

    event = dm("U42", "signed?")
    forged = await post_event(url, event, secret=SIGNING_SECRET, bad_signature=True)
    stale = await post_event(url, event, secret=SIGNING_SECRET, timestamp=time.time() - 600)
    assert (forged[0], stale[0]) == (401, 401)
    # The endpoint answers once the gateway decided: neither reached it.
    assert await gw.session_keys() == []

    assert (await post_event(url, event, secret=SIGNING_SECRET))[0] == 200
    [reply] = await posted(slack, 1)
    assert reply["text"] == "echo: signed?"
    retry = await post_event(url, redeliver(event), secret=SIGNING_SECRET, retry_num=1)
    assert retry[0] == 200
    assert gw.adapter.health()["mode"] == "http"
    # Answered with 200 (the ack) after the gateway decided; the turns are drained.
    assert len(await posted_once_stopped(slack, gw)) == 1


# --- secrets ---------------------------------------------------------------------------------


async def test_tokens_and_signing_secret_never_reach_the_logs(
    slack: FakeSlack,
    start_gateway: StartGateway,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # slack_sdk logs every request and message at DEBUG
    await start_gateway(home="socket")
    http = await start_gateway(home="http", mode="http")
    await slack.deliver(dm("U42", "socket"))
    await post_event(http.events_url, dm("U42", "forged"), secret="nope")
    await post_event(http.events_url, dm("U42", "http"), secret=SIGNING_SECRET)
    await posted(slack, 2)
    with pytest.raises(ConnectionError) as rejected:
        await start_gateway(home="bad", app_token="xapp-rejected-9d1c")

    out, err = capsys.readouterr()
    captured = "\n".join([caplog.text, out, err, str(rejected.value)])
    assert "Sending a request" in caplog.text  # the debug logs were really captured
    for secret in (BOT_TOKEN, APP_TOKEN, SIGNING_SECRET, "xapp-rejected-9d1c"):
        assert secret not in captured
