"""An attachment reply across kill -9: the real daemon as a subprocess, Telegram faked on
a loop of its own in this process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.harness import Daemon
from tests.fakes.telegram_api import FakeTelegram, serve_in_a_thread
from tests.waiting import wait_blocking

pytestmark = pytest.mark.timeout(120)

TOKEN = "123456:AAH-crash-TOKEN_abcdefghijklmnopq"
ADA = FakeTelegram.user(42, "Ada", "ada")


@pytest.fixture
def tg_loop() -> Iterator[tuple[FakeTelegram, asyncio.AbstractEventLoop]]:
    with serve_in_a_thread(TOKEN) as served:
        yield served


def test_kill9_after_the_reply_was_recorded_sends_the_attachment_exactly_once(
    tmp_path: Path, tg_loop: tuple[FakeTelegram, asyncio.AbstractEventLoop]
) -> None:
    tg, loop = tg_loop
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG chart")
    settings = (
        f"  telegram:\n    enabled: true\n    token: '{TOKEN}'\n    base_url: {tg.base_url}\n"
        "    poll_timeout: 1\n    allowed_users: ['42']\n"
        "agent:\n  backend: tests.fakes.agents:attaching\n"
        f"  options: {{path: '{chart}'}}\n"
    )
    daemon = Daemon(tmp_path / "home", settings)
    try:
        # Dies right after the turn's last transaction: text and photo recorded, unsent.
        daemon.start(env={"HERMES_CRASH_AT": "after_transcript_write:1"})
        loop.call_soon_threadsafe(tg.push_message, tg.private_chat(ADA), ADA, "chart please")
        assert daemon.proc is not None
        daemon.proc.wait(timeout=20)
        assert tg.sent_files == [] and tg.sent == []
        daemon.start()
        wait_blocking(lambda: len(tg.sent_files) == 1 and len(tg.sent) == 1)
        assert daemon.stop() == 0  # all it ever sends: a duplicate would be among it
        assert len(tg.sent_files) == 1 and tg.sent_files[0]["data"] == b"\x89PNG chart"
        assert [m.get("text") or m.get("caption") for m in tg.sent_messages] == [
            "here it is",
            "a chart",
        ]
    finally:
        daemon.ensure_stopped()
