"""A model server that stops sending (`agent.idle_timeout_seconds`): the request fails
within the idle timeout, is retried like a 5xx unless streamed text was already shown,
and the user gets the failure once. Against the fake server made to stall.

Bounds: a stall fails after IDLE seconds of silence; every bound below adds a margin of
MARGIN seconds for a loaded two-core machine, and, where retries run, each retry's idle
timeout and backoff delay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from adapters.telegram import TelegramAdapter
from config import ConfigError, GatewayConfig, load_config
from gateway.agents.openai import ModelStalled, OpenAIAgent
from gateway.agents.protocol import AgentError, SummaryRequest, TurnRequest
from gateway.run import GatewayRunner
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_api import FakeTelegram
from tests.gateway_client import GatewayClient
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

IDLE = 0.5
MARGIN = 5.0
BACKOFF = (0.1, 0.2)  # two retries, as the backend's default
WORDS = "one two three four five six seven eight"


def request(text: str = "hi") -> TurnRequest:
    return TurnRequest("k", "s", text, (), "")


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def agent(fake: FakeOpenAI) -> AsyncIterator[OpenAIAgent]:
    made = OpenAIAgent(base_url=fake.base_url, model="m", backoff=BACKOFF, idle_timeout=IDLE)
    yield made
    await made.close()


async def timed(awaitable: Any, bound: float) -> tuple[Any, float]:
    """The awaitable's result and how long it took; fails once it runs past `bound`."""
    started = time.monotonic()
    async with asyncio.timeout(bound):
        result = await awaitable
    return result, time.monotonic() - started


async def test_a_body_that_never_comes_fails_after_the_retries(
    fake: FakeOpenAI, agent: OpenAIAgent
) -> None:
    fake.stall_next(times=3)
    bound = 3 * IDLE + sum(BACKOFF) + MARGIN
    with pytest.raises(ModelStalled, match=f"sent nothing for {IDLE:g} seconds"):
        await timed(agent.run_turn(request()), bound)
    assert len(fake.requests) == 3  # the first request and its two retries


async def test_a_stall_is_retried_like_a_5xx(fake: FakeOpenAI, agent: OpenAIAgent) -> None:
    fake.stall_next()
    result, _ = await timed(agent.run_turn(request("again")), IDLE + MARGIN)
    assert result.text == "fake: again" and len(fake.requests) == 2


async def test_no_response_headers_is_a_stall_too(fake: FakeOpenAI, agent: OpenAIAgent) -> None:
    fake.delay_next(30)  # nothing at all: not even the headers
    result, _ = await timed(agent.run_turn(request("late")), IDLE + MARGIN)
    assert result.text == "fake: late" and len(fake.requests) == 2


async def test_a_stream_silent_after_its_headers_is_retried_and_shown_once(
    fake: FakeOpenAI, agent: OpenAIAgent
) -> None:
    fake.stall_next(after_chunks=0)
    fake.script(WORDS, WORDS)
    seen: list[str] = []
    result, _ = await timed(agent.stream_turn(request(), seen.append), IDLE + MARGIN)
    assert result.text == WORDS and len(fake.requests) == 2
    # Nothing came before the stall: the retry's text is the only text shown.
    assert seen[-1] == WORDS and all(WORDS.startswith(text) for text in seen)
    assert len(seen) == len(WORDS.split())


async def test_a_stream_that_stops_midway_fails_without_a_retry(
    fake: FakeOpenAI, agent: OpenAIAgent
) -> None:
    fake.stall_next(after_chunks=2)
    fake.script(WORDS)
    seen: list[str] = []
    with pytest.raises(ModelStalled):
        await timed(agent.stream_turn(request(), seen.append), IDLE + MARGIN)
    assert seen == ["one ", "one two "]  # shown once: no retry writes it again
    assert len(fake.requests) == 1


async def test_the_summary_request_has_the_same_idle_rule(
    fake: FakeOpenAI, agent: OpenAIAgent
) -> None:
    fake.stall_next(times=3)
    summary = SummaryRequest("k", "s", None, ({"role": "user", "content": "hi"},), 800)
    with pytest.raises(AgentError):
        await timed(agent.summarize(summary), 3 * IDLE + sum(BACKOFF) + MARGIN)
    assert len(fake.requests) == 3


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_an_idle_timeout_that_is_not_positive_is_refused_by_its_key_path(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "hermes.yaml"
    path.write_text(f"agent: {{idle_timeout_seconds: {value}}}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"agent\.idle_timeout_seconds: Input should be"):
        load_config(path)


# --- through the gateway ---------------------------------------------------------------

DEFAULT_BACKOFF = 0.5 + 1.0  # the backend's own retry delays


def openai_agent(fake: FakeOpenAI, idle: float = IDLE) -> dict[str, Any]:
    return {"backend": "openai", "base_url": fake.base_url, "idle_timeout_seconds": idle}


async def test_a_stalled_model_fails_the_turn_once_and_the_next_message_works(
    fake: FakeOpenAI, tmp_path: Path
) -> None:
    config = GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {"http": {"enabled": True, "port": 0}},
            "agent": openai_agent(fake),
        }
    )
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], home=tmp_path / "home")
    await runner.start()
    client = GatewayClient(adapter.url)
    try:
        fake.stall_next(times=3)
        await client.post("c1", "are you there")
        bound = 3 * IDLE + DEFAULT_BACKOFF + MARGIN
        (reply,), _ = await timed(client.replies("c1", 1), bound)
        assert reply.startswith("Sorry, the agent failed: the model server at")
        assert f"sent nothing for {IDLE:g} seconds" in reply
        await client.post("c1", "and now")
        assert await client.replies("c1", 1) == ["fake: and now"]
        # One reply per message: the failure came once.
        assert [m["text"] for m in await client.poll("c1")] == []
    finally:
        await client.close()
        await runner.stop()


TG_TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")


async def test_a_stream_stalled_midway_leaves_the_failure_in_one_message(
    fake: FakeOpenAI, tmp_path: Path
) -> None:
    async with FakeTelegram(token=TG_TOKEN) as tg:
        telegram = {
            "enabled": True,
            "token": TG_TOKEN,
            "base_url": tg.base_url,
            "poll_timeout": 1,
            "allowed_users": ["42"],
            "edit_interval": 0.1,
        }
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "platforms": {"telegram": telegram},
                "streaming": {"min_chars": 1},
                # Room for the partial to be sent before the stall fails the turn.
                "agent": openai_agent(fake, idle=2.0),
            }
        )
        runner = GatewayRunner(
            config, [TelegramAdapter(config.platforms.telegram)], home=tmp_path / "home"
        )
        await runner.start()
        try:
            fake.stall_next(after_chunks=3)
            fake.script(WORDS)
            tg.push_message(tg.private_chat(ADA), ADA, "tell me")
            await wait_for(lambda: tg.sent, within=MARGIN)
            await wait_for(lambda: "sent nothing" in "".join(tg.chat_view(42)), within=2 + MARGIN)
            assert len(tg.sent) == 1  # one message: the partial ...
            assert tg.sent[0]["text"].startswith("one")
            (shown,) = tg.chat_view(42)  # ... edited into the failure
            assert shown.startswith("Sorry, the agent failed:")
            assert "one" not in shown
            assert len(fake.requests) == 1  # not retried: the partial was shown
        finally:
            await runner.stop()
