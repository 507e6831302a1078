"""kill -9 in the middle of a streamed reply: the real daemon as a subprocess,
the fake Telegram Bot API and the fake model (streaming slowly) on a thread of this
process. After the restart the chat holds exactly one message, the complete reply: the
streamed message edited to the final text, never a partial plus a second reply."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.harness import Daemon
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.openai_server import serve_in_a_thread
from tests.fakes.slack_api import FakeSlack
from tests.fakes.slack_api import dm as slack_dm
from tests.fakes.telegram_api import FakeTelegram
from tests.fakes.telegram_api import serve_in_a_thread as serve_telegram
from tests.waiting import wait_blocking

pytestmark = pytest.mark.timeout(120)

TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")
REPLY = "the answer: " + " ".join(f"word{n}" for n in range(50)) + "."


@pytest.fixture
def telegram() -> Iterator[tuple[FakeTelegram, asyncio.AbstractEventLoop]]:
    with serve_telegram(TOKEN) as served:
        yield served


def stream_rows(daemon: Daemon) -> int:
    conn = daemon.db()
    try:
        return conn.execute("SELECT COUNT(*) FROM streams").fetchone()[0]
    finally:
        conn.close()


def daemon_settings(tg: FakeTelegram, model_url: str) -> str:
    return (
        "  telegram:\n"
        "    enabled: true\n"
        f"    token: '{TOKEN}'\n"
        f"    base_url: {tg.base_url}\n"
        "    poll_timeout: 1\n"
        "    allowed_users: ['42']\n"
        "    edit_interval: 0.2\n"
        "agent:\n"
        "  backend: openai\n"
        f"  base_url: {model_url}\n"
        "  model: fake\n"
        "  tools: []\n"
        "streaming:\n"
        "  min_chars: 5\n"
    )


def assert_one_complete_reply(tg: FakeTelegram, daemon: Daemon) -> None:
    """Waits for the reply, then stops the daemon: what it sent before it exited (its
    turns drained) is all it ever sends, so a duplicate would be among it."""
    wait_blocking(lambda: tg.chat_view(42) == [REPLY], within=30)
    assert daemon.stop() == 0
    assert tg.chat_view(42) == [REPLY]
    assert len(tg.sent) == 1  # the one message, edited to the end
    assert stream_rows(daemon) == 0
    key = "agent:main:telegram:dm:42"
    assert daemon.transcript(key) == [("user", "tell me"), ("assistant", REPLY)]


def test_kill9_mid_stream_leaves_exactly_one_complete_reply(
    telegram: tuple[FakeTelegram, asyncio.AbstractEventLoop], tmp_path: Path
) -> None:
    tg, loop = telegram
    with serve_in_a_thread(reply=lambda body: REPLY) as (model, _):
        model.stream_delay = 0.08  # 52 words: about 4 s of streaming
        daemon = Daemon(tmp_path / "home", daemon_settings(tg, model.base_url))
        try:
            daemon.start()
            loop.call_soon_threadsafe(tg.push_message, tg.private_chat(ADA), ADA, "tell me")
            # The streamed message is sent and recorded, and the stream goes on.
            wait_blocking(lambda: stream_rows(daemon) == 1 and len(tg.edits) >= 1)
            partial = tg.chat_view(42)
            assert len(partial) == 1 and partial[0] != REPLY
            daemon.kill9()

            daemon.start()
            assert_one_complete_reply(tg, daemon)
        finally:
            daemon.ensure_stopped()


@pytest.mark.parametrize("point", ["after_transcript_write", "before_ledger_mark"])
def test_a_crash_around_the_final_edit_still_leaves_one_complete_reply(
    telegram: tuple[FakeTelegram, asyncio.AbstractEventLoop], tmp_path: Path, point: str
) -> None:
    """The final recorded (its ledger row names the streamed message) but not edited in,
    or edited in but not marked: the restart edits the same message (again: the text it
    already has is no error), and sends nothing new."""
    tg, loop = telegram
    with serve_in_a_thread(reply=lambda body: REPLY) as (model, _):
        model.stream_delay = 0.01
        daemon = Daemon(tmp_path / "home", daemon_settings(tg, model.base_url))
        try:
            daemon.start(env={"HERMES_CRASH_AT": f"{point}:1"})
            loop.call_soon_threadsafe(tg.push_message, tg.private_chat(ADA), ADA, "tell me")
            assert daemon.wait_exit(30) == -9  # it killed itself at the crash point
            assert len(tg.sent) == 1

            daemon.start()
            assert_one_complete_reply(tg, daemon)
        finally:
            daemon.ensure_stopped()


# --- the same on Discord and Slack ---------------------------------------------------------


class DiscordSide:
    """The fake Discord, driven from this thread."""

    token = "MTEwMA.fake-bot-token.Zq7Xk9"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fake = FakeDiscord(token=self.token)
        self.run(self.fake.start())
        self.fake.add_user("42", "Alice")
        self.channel = self.fake.dm_channel("42")

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def settings(self) -> str:
        return (
            "  discord:\n    enabled: true\n"
            f"    token: '{self.token}'\n    api_base_url: {self.fake.api_base_url}\n"
            "    allowed_users: ['42']\n    edit_interval: 0.2\n"
        )

    def say(self, text: str) -> None:
        self.run(self.fake.dm("42", text))

    def view(self) -> list[str]:
        return self.fake.chat_view(self.channel)

    def sent(self) -> int:
        return len(self.fake.sent)

    def close(self) -> None:
        self.run(self.fake.stop())


class SlackSide:
    """The fake Slack (Web API and Socket Mode), driven from this thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fake = FakeSlack(bot_token="xoxb-crash-1", app_token="xapp-crash-1")
        self.run(self.fake.start())

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(20)

    def settings(self) -> str:
        return (
            "  slack:\n    enabled: true\n"
            "    bot_token: xoxb-crash-1\n    app_token: xapp-crash-1\n"
            f"    api_base_url: {self.fake.api_base_url}\n"
            "    allowed_users: ['U42']\n    edit_interval: 0.2\n"
        )

    def say(self, text: str) -> None:
        self.run(self.fake.deliver(slack_dm("U42", text, channel="D1")))

    def view(self) -> list[str]:
        return self.fake.chat_view("D1")

    def sent(self) -> int:
        return len(self.fake.posted)

    def close(self) -> None:
        self.run(self.fake.stop())


@pytest.fixture
def side_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("side_class", [DiscordSide, SlackSide], ids=["discord", "slack"])
def test_kill9_mid_stream_on_discord_and_slack_leaves_one_complete_reply(
    side_loop: asyncio.AbstractEventLoop, tmp_path: Path, side_class: Any
) -> None:
    side = side_class(side_loop)
    try:
        with serve_in_a_thread(reply=lambda body: REPLY) as (model, _):
            model.stream_delay = 0.08
            settings = side.settings() + (
                "agent:\n  backend: openai\n"
                f"  base_url: {model.base_url}\n  model: fake\n  tools: []\n"
                "streaming:\n  min_chars: 5\n"
            )
            daemon = Daemon(tmp_path / "home", settings)
            try:
                daemon.start()
                side.say("tell me")
                wait_blocking(lambda: stream_rows(daemon) == 1 and len(side.view()) == 1)
                time.sleep(0.5)  # an edit or two
                assert side.view() != [REPLY]
                daemon.kill9()

                daemon.start()
                wait_blocking(lambda: side.view() == [REPLY], within=30)
                time.sleep(1.0)
                assert side.view() == [REPLY] and side.sent() == 1
                assert stream_rows(daemon) == 0
                assert daemon.stop() == 0
            finally:
                daemon.ensure_stopped()
    finally:
        side.close()
