"""Single-connection platforms on several replicas: Telegram long polling runs
on exactly one replica, the holder of `leader:telegram`, and moves to the other when the
holder stops. Two gateways in one event loop on one PostgreSQL schema, against the fake
Bot API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters.telegram import TelegramAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from tests.fakes.agents import scripted
from tests.fakes.telegram_api import FakeTelegram
from tests.pg_support import fresh_schema
from tests.waiting import wait_for

TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")
FAILOVER = 1.5


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as fake:
        yield fake


@pytest.fixture
def dsn() -> AsyncIterator[str]:
    with fresh_schema() as schema_dsn:
        yield schema_dsn


def replica(
    tg: FakeTelegram, dsn: str, home: Path, **telegram: Any
) -> tuple[GatewayRunner, TelegramAdapter]:
    config = GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "storage": {"backend": "postgres", "dsn": dsn},
            "cluster": {"failover_seconds": FAILOVER},
            "platforms": {
                "telegram": {
                    "enabled": True,
                    "token": TOKEN,
                    "base_url": tg.base_url,
                    "poll_timeout": 1,
                    "allowed_users": ["42"],
                    **telegram,
                }
            },
        }
    )
    adapter = TelegramAdapter(config.platforms.telegram)
    return GatewayRunner(config, [adapter], agent_factory=scripted({}), home=home), adapter


def polling(adapters: list[TelegramAdapter]) -> list[TelegramAdapter]:
    return [a for a in adapters if a.health().get("state") == "running"]


async def test_telegram_polling_runs_on_one_replica_and_moves_when_it_stops(
    tg: FakeTelegram, dsn: str, tmp_path: Path
) -> None:
    runners, adapters = [], []
    for i in range(2):
        runner, adapter = replica(tg, dsn, tmp_path / f"home{i}")
        await runner.start()
        runners.append(runner)
        adapters.append(adapter)
    stopped: list[GatewayRunner] = []
    try:
        await wait_for(lambda: len(polling(adapters)) == 1, within=FAILOVER * 3)
        (leader,) = polling(adapters)
        tg.push_message(tg.private_chat(ADA), ADA, "first")

        def answered_with_one_poller() -> bool:
            assert len(polling(adapters)) <= 1  # never two pollers, sampled meanwhile
            return len(tg.sent) == 1

        await wait_for(answered_with_one_poller)

        index = adapters.index(leader)
        moved_from = time.monotonic()
        await runners[index].stop()  # a clean stop hands the role over at once
        stopped.append(runners[index])
        other = adapters[1 - index]
        await wait_for(lambda: polling(adapters) == [other], within=FAILOVER * 2)
        # within failover_seconds, and a second of slack for a loaded machine
        assert time.monotonic() - moved_from <= FAILOVER + 1.0
        tg.push_message(tg.private_chat(ADA), ADA, "second")
        await wait_for(lambda: len(tg.sent) == 2)
        # Updates come in order and the chat's turns run in order: a second answer to
        # "second" would come before the marker's.
        tg.push_message(tg.private_chat(ADA), ADA, "marker")
        await wait_for(lambda: len(tg.sent) == 3)
        texts = [m["text"] for m in tg.sent_messages]
        assert texts == ["echo: first", "echo: second", "echo: marker"]
    finally:
        for runner in runners:
            if runner not in stopped:
                await runner.stop()


async def test_telegram_webhooks_on_every_replica_answer_each_update_once(
    tg: FakeTelegram, dsn: str, tmp_path: Path
) -> None:
    """Webhook mode behind a load balancer: both replicas serve the hook, and an update
    Telegram sends again (to whichever replica the balancer picks) is answered once."""
    webhook = {
        "mode": "webhook",
        "webhook_url": "https://hermes.example/telegram/hook",
        "webhook_secret": "s3cret-Token_1",
        "port": 0,
    }
    runners, adapters = [], []
    try:
        for i in range(2):
            runner, adapter = replica(tg, dsn, tmp_path / f"home{i}", **webhook)
            await runner.start()
            runners.append(runner)
            adapters.append(adapter)
        assert [a.single_connection for a in adapters] == [False, False]
        urls = [f"http://127.0.0.1:{a.webhook_port}/telegram/hook" for a in adapters]
        updates = [tg.make_message_update(tg.private_chat(ADA), ADA, f"m{i}") for i in range(6)]
        for i, update in enumerate(updates):
            # Round robin, and every update once more to the other replica (a retry).
            for url in (urls[i % 2], urls[(i + 1) % 2]):
                assert await tg.post_webhook(url, update, secret=webhook["webhook_secret"]) == 200

        def answered() -> list[str]:
            # Messages that arrive while a turn runs are answered together, one per line.
            texts = [m["text"].removeprefix("echo: ") for m in tg.sent_messages]
            return [line for text in texts for line in text.split("\n")]

        await wait_for(lambda: len(answered()) >= 6, within=10)
        # Posted after every retry was accepted or refused: an accepted retry waits in the
        # chat's inbox ahead of the marker, so it is answered before it (or with it).
        marker = tg.make_message_update(tg.private_chat(ADA), ADA, "marker")
        assert await tg.post_webhook(urls[0], marker, secret=webhook["webhook_secret"]) == 200
        await wait_for(lambda: "marker" in answered(), within=10)
        assert sorted(answered()) == ["m0", "m1", "m2", "m3", "m4", "m5", "marker"], (
            tg.sent_messages
        )
    finally:
        for runner in runners:
            await runner.stop()
