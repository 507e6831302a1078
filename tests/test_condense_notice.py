"""The line a reply opens with after a rolling summary condensed messages
(`agent.context.notify`): once per summary, and a summary once per many turns (a
session past `agent.history_limit` condenses in chunks, not a message or two a turn);
not after /compress, not when turned off; still owed after a restart, and after a
kill -9 between the summary and the reply.

The real runner, HTTP adapter and store (SQLite and PostgreSQL), against the echo
agent or the fake OpenAI-compatible server of tests/test_memory.py (its summaries name
what they took in); the crash, the real daemon.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.memory import notice
from gateway.store import migrations
from scripts.harness import Daemon
from tests.fakes.openai_server import FakeOpenAI, last_user_content, serve_in_a_thread
from tests.pg_support import StorageBackend
from tests.test_memory import (
    Gateway,
    fake_reply,
    fake_usage,
    is_summary_request,
    openai_agent,
    start_gateway,
    text_of,
)

split_notice = notice.split


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[MakeGateway]:
    """Gateways on one home and one store: a second is the first restarted."""
    made: list[Gateway] = []

    async def make(agent: dict[str, Any]) -> Gateway:
        config = store_backend.apply(
            GatewayConfig.model_validate(
                {
                    "timezone": "UTC",
                    "platforms": {"http": {"enabled": True, "port": 0}},
                    "agent": agent,
                    "session_reset": {"mode": "none"},
                }
            )
        )
        gateway = await start_gateway(config, tmp_path / "home")
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


async def condensed(gw: Gateway) -> int:
    """The messages the session's summary condenses (0: none yet)."""
    checkpoint = await gw.checkpoint()
    return checkpoint.messages if checkpoint is not None else 0


class Chat:
    """Turns whose every reply is checked: it is the model's, after a notice exactly
    when the summary the turn sent (read as the model receives the request) condenses
    messages no earlier reply told, and then of exactly those."""

    def __init__(self, gw: Gateway, fake: FakeOpenAI, told: int = 0) -> None:
        self.gw = gw
        self.told = told
        self.notices: list[int] = []
        self.at_request = 0
        fake.on_request = self._snapshot

    async def _snapshot(self, body: dict[str, Any]) -> None:
        if not is_summary_request(body):
            self.at_request = await condensed(self.gw)

    async def say(self, text: str) -> int:
        notice, reply = split_notice(await self.gw.say(text))
        assert reply == "fake: " + text
        assert notice == self.at_request - self.told, (text, notice, self.told)
        self.told += notice
        if notice:
            self.notices.append(notice)
        await self.gw.summaries_idle()  # a summary the reply started is written now
        return notice

    async def until_summarized(self, start: int) -> int:
        """Turns until a summary condensed messages not told yet; the next number."""
        for n in range(start, start + 30):
            await self.say(text_of(n))
            if await condensed(self.gw) > self.told:
                return n + 1
        raise AssertionError("no summary was written")


async def test_each_summary_is_told_once_with_the_next_reply(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake))
        chat = Chat(gw, fake)
        n = 0
        while len(chat.notices) < 2:
            n = await chat.until_summarized(n)
            owed = await condensed(gw) - chat.told
            assert await chat.say(f"question {n}") == owed > 0
        assert chat.told == sum(chat.notices) == await condensed(gw)
        if await condensed(gw) == chat.told:  # no summary since the last notice
            assert await gw.say("and then?") == "fake: and then?"


async def talk(gw: Gateway, turns: range) -> list[tuple[int, int]]:
    """The echo agent's turns, each reply checked: (turn, messages told) of the notices."""
    notices = []
    for n in turns:
        told, reply = split_notice(await gw.say(f"m{n}"))
        assert reply == f"echo: m{n}", n
        if told:
            notices.append((n, told))
    return notices


async def test_past_the_history_limit_a_summary_comes_in_chunks_each_told_once(
    make_gateway: MakeGateway,
) -> None:
    """At the default `history_limit` (100) a turn whose read is full condenses down to
    half the limit (not the one turn's worth past it), so a summary, and its notice,
    comes once every 25 turns, each of 50 messages."""
    gw = await make_gateway({"backend": "echo"})
    notices = await talk(gw, range(130))
    checkpoint = await gw.checkpoint()
    assert checkpoint is not None
    assert notices == [(50, 50), (75, 50), (100, 50), (125, 50)]
    # One notice per summary written, with the reply of the turn that wrote it.
    assert len(notices) == checkpoint.epoch
    assert checkpoint.messages == checkpoint.told == 200


async def test_notify_false_tells_nothing_and_leaves_nothing_owed_to_tell_later(
    make_gateway: MakeGateway,
) -> None:
    echo = {"backend": "echo", "history_limit": 20}
    gw = await make_gateway({**echo, "context": {"notify": False}})
    assert await talk(gw, range(13)) == []
    checkpoint = await gw.checkpoint()
    assert checkpoint is not None and checkpoint.messages == checkpoint.told == 10
    cursors = dict(gw.client.cursors)
    await gw.stop()

    gw = await make_gateway(echo)  # the notice on again: of new summaries only
    gw.client.cursors.update(cursors)
    assert await talk(gw, range(13, 20)) == [(15, 10)]


async def test_compress_answers_for_itself_and_leaves_an_owed_notice_owed(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake))
        chat = Chat(gw, fake)
        await chat.until_summarized(0)
        owed = await condensed(gw) - chat.told
        reply = await gw.say("/compress")
        assert re.fullmatch(r"Condensed [\d,]+ messages into [\d,]+ characters\.", reply), reply
        assert await condensed(gw) > owed + chat.told
        # The background summary's messages are told; what /compress condensed is not.
        assert await gw.say("so?") == (
            f"(Earlier messages were condensed into a summary: {owed:,} messages.)\n\nfake: so?"
        )
        assert (await gw.say("/compress")).startswith("Condensed 2 messages into ")
        assert await gw.say("and?") == "fake: and?"


async def test_no_notice_with_notify_false(make_gateway: MakeGateway) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake, notify=False))
        for n in range(12):
            assert await gw.say(text_of(n)) == "fake: " + text_of(n)
            await gw.summaries_idle()
        assert await condensed(gw) > 0


async def test_an_owed_notice_survives_a_restart_and_is_told_once(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake))
        chat = Chat(gw, fake)
        n = await chat.until_summarized(0)
        owed = await condensed(gw) - chat.told
        await gw.stop()
        fake.on_request = None  # it read the stopped gateway's store

        gw = await make_gateway(openai_agent(fake))
        await gw.client.post("c1", "after the restart")
        # A new client reads every reply of the chat again: this turn's is the last.
        replies = await gw.client.replies("c1", n + 1)
        assert split_notice(replies[-1]) == (owed, "fake: after the restart")
        await gw.summaries_idle()
        if await condensed(gw) == chat.told + owed:  # no summary since: nothing owed
            assert await gw.say("once more") == "fake: once more"


def test_summaries_from_before_the_notice_are_not_owed_one(tmp_path: Path) -> None:
    """The migration that adds `told` counts every summary already written as told."""
    path = tmp_path / "state.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        migrations.migrate(conn)
        conn.execute("ALTER TABLE summary_checkpoints DROP COLUMN told")
        conn.execute("DROP TABLE platform_cursors")  # and what later migrations made
        conn.execute("PRAGMA user_version = 22")
        conn.execute(
            "INSERT INTO sessions (session_id, session_key, started_at) VALUES ('s', 'k', 0)"
        )
        conn.execute(
            "INSERT INTO summary_checkpoints (session_id, epoch, covered_up_to, summary,"
            " messages, updated_at) VALUES ('s', 3, 40, 'old', 42, 0)"
        )
        migrations.migrate(conn)
        row = conn.execute("SELECT messages, told FROM summary_checkpoints").fetchone()
    finally:
        conn.close()
    assert row == (42, 42)


# --- the real daemon, killed between the summary and the reply ---------------------------


def counts_of(daemon: Daemon) -> tuple[int, int] | None:
    """The summary checkpoint's (messages, told), None before one is written."""
    conn = daemon.db()
    try:
        row = conn.execute("SELECT messages, told FROM summary_checkpoints").fetchone()
    finally:
        conn.close()
    return (int(row[0]), int(row[1])) if row else None


@pytest.mark.timeout(120)
def test_a_notice_owed_when_the_daemon_is_killed_before_the_reply_is_told_once(
    tmp_path: Path,
) -> None:
    """The turn that condenses (its read hit `history_limit`) writes the summary before it
    asks the model; a kill -9 while the model is asked leaves the notice owed, and the
    turn re-run after the restart tells it, once."""
    with serve_in_a_thread(reply=fake_reply, usage=fake_usage) as (fake, loop):
        release = fake.hold(lambda body: last_user_content(body) == "crash here")
        daemon = Daemon(
            tmp_path / "home",
            f"agent:\n  backend: openai\n  base_url: {fake.base_url}\n  model: m\n"
            "  tools: []\n  history_limit: 10\n",
        )
        try:
            daemon.start()
            for n in range(5):
                daemon.post("c1", f"m{n}", message_id=f"m{n}")
                assert daemon.wait_replies("c1", n + 1)[-1]["text"] == f"fake: m{n}"
            assert counts_of(daemon) is None
            daemon.post("c1", "crash here", message_id="crash")
            deadline = time.monotonic() + 20
            while not fake.held and time.monotonic() < deadline:
                time.sleep(0.02)
            assert fake.held, daemon.log_tail()
            # The read of 10 rows was full: the 6 oldest are condensed (the newest half
            # from a user message on is kept), and the user is owed a word of them.
            assert counts_of(daemon) == (6, 0)
            daemon.kill9()
            loop.call_soon_threadsafe(release.set)

            daemon.start()
            replies = daemon.wait_replies("c1", 6)
            assert notice.split(replies[-1]["text"]) == (6, "fake: crash here")
            assert counts_of(daemon) == (6, 6)
            daemon.post("c1", "and now?", message_id="after")
            assert daemon.wait_replies("c1", 7)[-1]["text"] == "fake: and now?"
        finally:
            daemon.ensure_stopped()
