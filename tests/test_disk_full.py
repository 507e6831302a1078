"""A store that cannot write (disk full, read-only): nothing new is accepted, the operator
is told (503 + Retry-After, /healthz `degraded`, `status`, one log line a minute), and
writing resumes by itself when space returns, with every acknowledged message answered
exactly once.

Two ways to fill the disk: a small tmpfs filled to the last block (real ENOSPC, needs
root and mount; skipped with the reason otherwise), and a simulation that always runs:
the writer connection's `PRAGMA max_page_count` pinned to the pages the database has, so
every write that needs a new page fails with SQLITE_FULL, "database or disk is full",
exactly as SQLite reports ENOSPC. Raising it again is the space coming back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest
import structlog
from discord.gateway import DiscordWebSocket
from discord.http import Route
from structlog.testing import capture_logs

from adapters.discord import DiscordAdapter
from adapters.http import HttpAdapter
from adapters.slack import SlackAdapter
from adapters.telegram import TelegramAdapter
from config import GatewayConfig
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.ops.status import write_status
from gateway.run import GatewayRunner
from gateway.store.db import Database
from gateway.store.outage import Outage, StoreUnwritable, unwritable_reason
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import FakeSlack, dm, post_event, redeliver
from tests.fakes.telegram_api import FakeTelegram
from tests.test_metrics import samples
from tests.waiting import wait_for

# Rows this long spill onto overflow pages, so storing them needs pages the full
# database does not have (short rows may still fit in the free room of existing pages).
BIG = 6000
BIG_REPLY = "r" * 20000


class SimulatedFullDisk:
    """The writer limited to the pages the database has: writes needing a new page fail
    with SQLITE_FULL. VACUUM first, so no free page is left inside the file either."""

    def __init__(self, db: Database) -> None:
        assert db._writer is not None
        self.conn = db._writer  # the gateway's own writer connection (a per-connection limit)
        self.limit = self.conn.execute("PRAGMA max_page_count").fetchone()[0]

    def fill(self) -> None:
        self.conn.execute("VACUUM")
        pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
        self.conn.execute(f"PRAGMA max_page_count={pages}")

    def free(self) -> None:
        self.conn.execute(f"PRAGMA max_page_count={self.limit}")


class HeldAgent:
    """Echoes; a text starting with "hold" waits for `release` and then answers with a
    reply too long to fit in a full database."""

    started: ClassVar[asyncio.Event]
    release: ClassVar[asyncio.Event]

    def __init__(self, session_key: str) -> None:
        self.session_key = session_key

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if request.text.startswith("hold"):
            type(self).started.set()
            await type(self).release.wait()
            return TurnResult(BIG_REPLY)
        return TurnResult(f"echo: {request.text[:20]}")

    async def close(self) -> None:
        pass


def log_events(logs: list[dict[str, Any]], prefix: str) -> list[str]:
    return [entry["event"] for entry in logs if str(entry["event"]).startswith(prefix)]


def status_cli(home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HERMES_HOME": str(home)}
    env.pop("HERMES_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


# --- telling a full disk from other errors, and logging it once a minute ----------------


def test_full_read_only_and_failing_disks_are_told_from_other_errors(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    conn.execute("CREATE TABLE t (v TEXT PRIMARY KEY)")
    conn.execute("INSERT INTO t VALUES ('a')")
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages}")
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.execute("INSERT INTO t VALUES (?)", ("x" * 20000,))
    with pytest.raises(sqlite3.IntegrityError) as duplicate:
        conn.execute("INSERT INTO t VALUES ('a')")
    conn.execute("PRAGMA query_only=1")
    with pytest.raises(sqlite3.OperationalError) as read_only:
        conn.execute("INSERT INTO t VALUES ('b')")
    conn.close()

    assert unwritable_reason(full.value) == "disk full: database or disk is full"
    assert unwritable_reason(read_only.value) == ("read-only: attempt to write a readonly database")
    assert unwritable_reason(OSError(errno.EIO, "Input/output error")) == (
        "disk I/O error: [Errno 5] Input/output error"
    )
    assert unwritable_reason(duplicate.value) is None
    assert unwritable_reason(OSError(errno.ENOENT, "No such file")) is None


def test_a_lasting_outage_is_logged_once_a_minute_not_per_failure() -> None:
    now = [1000.0]
    with capture_logs() as logs:
        outage = Outage(structlog.get_logger("t"), "store_unwritable", clock=lambda: now[0])
        for _ in range(50):  # fifty refused writes within the first minute
            outage.failed("disk full: database or disk is full")
            now[0] += 1
        now[0] += 20
        outage.failed("disk full: database or disk is full")  # a minute on: one repeat
        outage.ended()
        outage.ended()  # nothing more to say
        now[0] += 1
        outage.failed("read-only: attempt to write a readonly database")  # within the minute
        outage.ended()

    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("store_unwritable", "warning"),
        ("store_unwritable_continues", "warning"),
        ("store_unwritable_ended", "info"),
    ]
    assert logs[0]["failed"] == 1
    assert logs[1]["failed"] == 50  # every refusal since the first line
    assert logs[2]["failed"] == 51


# --- the group commit ---------------------------------------------------------------------


@pytest.fixture
async def full_disk_db(tmp_path: Path) -> AsyncIterator[tuple[Database, SimulatedFullDisk]]:
    """A database with a table `t`, on a disk that is full (`disk.free()` ends that)."""
    db = Database(tmp_path / "state.db")
    await db.open()
    db.retry_interval = 0.05
    try:
        await db.write(lambda conn: conn.execute("CREATE TABLE t (v TEXT)"))
        disk = SimulatedFullDisk(db)
        disk.fill()
        yield db, disk
    finally:
        await db.close()


async def test_a_refused_batch_fails_new_writes_and_keeps_acknowledged_ones(
    full_disk_db: tuple[Database, SimulatedFullDisk],
) -> None:
    db, disk = full_disk_db
    rows = "SELECT substr(v, 1, 4) FROM t"
    # One pass of the loop: both writes go into one batch, which the disk refuses.
    new = db.write_soon(lambda conn: conn.execute("INSERT INTO t VALUES (?)", ("new" * BIG,)))
    kept = db.write_soon(
        lambda conn: conn.execute("INSERT INTO t VALUES (?)", ("kept" * BIG,)), persist=True
    )
    with pytest.raises(StoreUnwritable, match=r"^disk full: database or disk is full$"):
        await new
    # The batch's two writes, then a few retries of the parked one: all refused.
    await wait_for(lambda: db.write_health().get("refused_writes", 0) >= 5)
    assert not kept.done()
    assert await db.read(lambda conn: conn.execute(rows).fetchall()) == []  # reads work
    health = db.write_health()
    assert health["state"] == "unwritable" and health["waiting_writes"] == 1
    assert health["reason"] == "disk full: database or disk is full"

    disk.free()
    await asyncio.wait_for(kept, 5)
    assert await db.read(lambda conn: conn.execute(rows).fetchall()) == [("kept",)]
    assert db.write_health() == {"state": "writable"}


async def test_a_write_later_is_parked_like_a_persistent_write_and_settled_once(
    full_disk_db: tuple[Database, SimulatedFullDisk],
) -> None:
    """The future-less write (a reply chunk's "sent" mark) keeps the persist semantics:
    refused by a full disk it waits, and its callback runs once, when it commits."""
    db, disk = full_disk_db
    settled: list[BaseException | None] = []
    db.write_later(
        lambda conn: conn.execute("INSERT INTO t VALUES (?)", ("mark" * BIG,)),
        settled.append,
        persist=True,
    )
    # Refused, parked, and retried a few times.
    await wait_for(lambda: db.write_health().get("refused_writes", 0) >= 3)
    assert settled == []
    assert db.write_health()["waiting_writes"] == 1
    disk.free()
    await wait_for(lambda: settled)
    assert settled == [None]
    rows = await db.read(lambda conn: conn.execute("SELECT substr(v, 1, 4) FROM t").fetchall())
    assert rows == [("mark",)]

    # A write that fails on its own hands its error to the callback, and fails alone.
    def broken(conn: sqlite3.Connection) -> None:
        raise ValueError("not this one")

    db.write_later(broken, settled.append)
    neighbour = db.write_soon(lambda conn: conn.execute("INSERT INTO t VALUES ('next')"))
    await neighbour
    assert len(settled) == 2 and isinstance(settled[1], ValueError)


# --- end to end, simulated: the HTTP API ----------------------------------------------------


@pytest.fixture
async def http_gateway(tmp_path: Path) -> AsyncIterator[tuple[GatewayRunner, str]]:
    HeldAgent.started, HeldAgent.release = asyncio.Event(), asyncio.Event()
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"http": {"enabled": True, "port": 0}}}
    )
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], agent_factory=HeldAgent, home=tmp_path / "home")
    await runner.start()
    runner.store._db.retry_interval = 0.05
    try:
        yield runner, adapter.url
    finally:
        HeldAgent.release.set()
        await runner.stop()


async def test_simulated_disk_full_refuses_new_messages_and_loses_nothing_acknowledged(
    http_gateway: tuple[GatewayRunner, str],
) -> None:
    runner, url = http_gateway
    async with aiohttp.ClientSession() as http:

        async def post(chat: str, text: str, message_id: str) -> tuple[int, dict[str, Any], str]:
            body = {"chat_id": chat, "user_id": "u1", "text": text, "message_id": message_id}
            async with http.post(f"{url}/v1/messages", json=body) as resp:
                return resp.status, await resp.json(), resp.headers.get("Retry-After", "")

        async def replies(chat: str) -> list[str]:
            async with http.get(f"{url}/v1/chats/{chat}/messages") as resp:
                return [m["text"] for m in (await resp.json())["messages"]]

        async def health() -> dict[str, Any]:
            async with http.get(f"{url}/healthz") as resp:
                return await resp.json()

        async def metrics() -> dict[str, float]:
            async with http.get(f"{url}/metrics") as resp:
                return {name: value for (name, _), value in samples(await resp.text()).items()}

        # Accepted (202) before the disk fills; its answer comes while it is full.
        status, _, _ = await post("c1", "hold on", "m1")
        assert status == 202
        await asyncio.wait_for(HeldAgent.started.wait(), 5)
        await runner.store.search_index.catch_up()  # its log trim is the last write before
        await runner.store.read(lambda conn: None)
        disk = SimulatedFullDisk(runner.store._db)

        with capture_logs() as logs:
            disk.fill()
            HeldAgent.release.set()  # the reply cannot be recorded: it waits, unsent
            await wait_for(lambda: runner.store.write_health()["state"] == "unwritable")

            for _ in range(3):  # a new message, sent again and again: nothing accepted
                status, body, retry_after = await post("c2", "x" * BIG, "m2")
                assert status == 503 and retry_after == "5"
                assert "disk full: database or disk is full" in body["error"]
                assert "nothing was accepted" in body["error"]
            inbox = await runner.store.read(
                lambda conn: conn.execute(
                    "SELECT count(*) FROM inbox WHERE message_id = 'm2'"
                ).fetchone()[0]
            )
            assert inbox == 0  # the id stays free for the retry
            now = await health()
            assert now["status"] == "degraded"
            assert now["store"]["state"] == "unwritable"
            assert now["store"]["reason"] == "disk full: database or disk is full"
            assert now["store"]["refused_writes"] >= 4
            assert await replies("c1") == []  # nothing is sent that was not recorded
            now_metrics = await metrics()
            assert now_metrics["hermes_store_writable"] == 0
            assert now_metrics["hermes_messages_unavailable_total"] == 3

            write_status(runner.home, runner.status_snapshot())
            shown = await asyncio.to_thread(status_cli, runner.home)
            assert shown.returncode == 0, shown.stderr
            assert "  status: degraded" in shown.stdout
            assert "  store: unwritable since " in shown.stdout
            assert ": disk full: database or disk is full (" in shown.stdout

            disk.free()  # space returns: the waiting reply is recorded and sent by itself
            await wait_for(replies_arrived := _Collector(replies, "c1"))
            assert replies_arrived.texts == [BIG_REPLY]
            assert (await health())["status"] == "ok"
            assert (await metrics())["hermes_store_writable"] == 1

            status, body, _ = await post("c2", "x" * BIG, "m2")  # the retry is accepted
            assert (status, body["status"]) == (202, "started")
            await wait_for(answered := _Collector(replies, "c2"))
            status, body, _ = await post("c2", "x" * BIG, "m2")  # and only once
            assert (status, body["status"]) == (202, "duplicate")
            assert answered.texts == [f"echo: {'x' * 20}"]
            # A later message in the chat is answered after any reply owed to the copy.
            await post("c2", "marker", "m3")
            await wait_for(lambda: _has_reply(replies, "c2", "echo: marker"))
            assert await replies("c2") == [*answered.texts, "echo: marker"]
            assert await replies("c1") == [BIG_REPLY]

        assert log_events(logs, "store_unwritable") == [
            "store_unwritable",
            "store_unwritable_ended",
        ]


async def _has_reply(replies: Callable[[str], Awaitable[list[str]]], chat: str, text: str) -> bool:
    return text in await replies(chat)


class _Collector:
    """A condition for `wait_for`: true once `chat` has replies; keeps them in `texts`."""

    def __init__(self, replies: Callable[[str], Awaitable[list[str]]], chat: str) -> None:
        self.replies, self.chat = replies, chat
        self.texts: list[str] = []

    async def __call__(self) -> bool:
        self.texts = await self.replies(self.chat)
        return bool(self.texts)


# --- end to end, simulated: the chat platforms ---------------------------------------------


@contextlib.asynccontextmanager
async def chat_gateway(
    home: Path, platform: str, adapter_type: type[Any], **settings: Any
) -> AsyncIterator[GatewayRunner]:
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {platform: {"enabled": True, **settings}}}
    )
    runner = GatewayRunner(
        config,
        [adapter_type(getattr(config.platforms, platform))],
        agent_factory=HeldAgent,
        home=home,
    )
    try:
        await runner.start()
        runner.store._db.retry_interval = 0.05
        yield runner
    finally:
        await runner.stop()


TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")


def telegram_settings(tg: FakeTelegram, **extra: Any) -> dict[str, Any]:
    return {
        "token": TOKEN,
        "base_url": tg.base_url,
        "poll_timeout": 1,
        "allowed_users": ["42"],
        **extra,
    }


async def test_telegram_update_is_not_confirmed_until_stored_then_answered_once(
    tmp_path: Path,
) -> None:
    async with (
        FakeTelegram(token=TOKEN) as tg,
        chat_gateway(tmp_path, "telegram", TelegramAdapter, **telegram_settings(tg)) as gw,
    ):
        disk = SimulatedFullDisk(gw.store._db)
        with capture_logs() as logs:
            disk.fill()
            # 4,000 characters (Telegram's limit is 4,096): too long for the room left.
            update_id = tg.push_message(tg.private_chat(ADA), ADA, "x" * 4000)

            await wait_for(lambda: tg.deliveries[update_id] >= 2)  # Telegram sent it again
            offsets = [p.get("offset") for m, p in tg.requests if m == "getUpdates"]
            assert all(o is None or o <= update_id for o in offsets)  # never confirmed
            assert tg.sent == []
            # Small writes that still fit (the memory index's report) may clear the state
            # between two refused redeliveries; each refusal sets it again.
            await wait_for(lambda: gw.health()["store"]["state"] == "unwritable")
        # Each retry is quiet: the store says it once a minute, not the adapter per retry.
        assert [e for e in logs if e.get("platform") == "telegram"] == []
        assert any(e["event"] == "store_unwritable" for e in logs)  # the capture worked

        disk.free()
        await wait_for(lambda: len(tg.sent) == 1)
        assert tg.sent[0]["text"] == f"echo: {'x' * 20}"
        await wait_for(
            lambda: any(
                m == "getUpdates" and (p.get("offset") or 0) > update_id for m, p in tg.requests
            )
        )
        delivered = tg.deliveries[update_id]
        # Updates are taken in order: once a later one is answered, the first was
        # confirmed and not sent again.
        tg.push_message(tg.private_chat(ADA), ADA, "marker")
        await wait_for(lambda: len(tg.sent) == 2)
        assert tg.deliveries[update_id] == delivered
        assert [m["text"] for m in tg.sent] == [f"echo: {'x' * 20}", "echo: marker"]


async def test_telegram_webhook_answers_503_for_an_update_it_cannot_store(
    tmp_path: Path,
) -> None:
    secret = "s3cret-Token_1"
    async with FakeTelegram(token=TOKEN) as tg:
        settings = telegram_settings(
            tg,
            mode="webhook",
            webhook_url="https://hermes.example/telegram/hook",
            webhook_secret=secret,
            port=0,
        )
        async with chat_gateway(tmp_path, "telegram", TelegramAdapter, **settings) as gw:
            adapter = next(iter(gw.adapters.values()))
            assert isinstance(adapter, TelegramAdapter)
            url = f"http://127.0.0.1:{adapter.webhook_port}/telegram/hook"
            update = tg.make_message_update(tg.private_chat(ADA), ADA, "x" * 4000)
            disk = SimulatedFullDisk(gw.store._db)
            disk.fill()
            assert await tg.post_webhook(url, update, secret=secret) == 503  # Telegram retries

            disk.free()
            assert await tg.post_webhook(url, update, secret=secret) == 200
            await wait_for(lambda: len(tg.sent) == 1)
            assert await tg.post_webhook(url, update, secret=secret) == 200  # a late retry
            # Same chat, same session: a reply owed to the retry comes before this one's.
            marker = tg.make_message_update(tg.private_chat(ADA), ADA, "marker")
            assert await tg.post_webhook(url, marker, secret=secret) == 200
            await wait_for(lambda: len(tg.sent) == 2)
            assert [m["text"] for m in tg.sent] == [f"echo: {'x' * 20}", "echo: marker"]


SLACK_BOT_TOKEN, SLACK_APP_TOKEN, SIGNING_SECRET = "xoxb-test-bot", "xapp-test-app", "s1gn"


def slack_settings(slack: FakeSlack, mode: str) -> dict[str, Any]:
    return {
        "bot_token": SLACK_BOT_TOKEN,
        "app_token": SLACK_APP_TOKEN if mode == "socket" else None,
        "signing_secret": SIGNING_SECRET,
        "api_base_url": slack.api_base_url,
        "mode": mode,
        "port": 0,
        "allowed_users": ["U42"],
    }


async def test_slack_socket_mode_leaves_an_event_it_cannot_store_unacknowledged(
    tmp_path: Path,
) -> None:
    async with FakeSlack(bot_token=SLACK_BOT_TOKEN, app_token=SLACK_APP_TOKEN) as slack:
        settings = slack_settings(slack, "socket")
        async with chat_gateway(tmp_path, "slack", SlackAdapter, **settings) as gw:
            disk = SimulatedFullDisk(gw.store._db)
            disk.fill()
            event = dm("U42", "x" * BIG)
            refused = await slack.deliver(event)
            await wait_for(lambda: gw.metrics.messages_unavailable_total == 1)
            assert slack.posted == []

            disk.free()
            retried = await slack.deliver(redeliver(event), retry_attempt=1)
            await slack.wait_for_ack(retried)
            await slack.wait_until(lambda: len(slack.posted) >= 1)
        # The gateway stopped (its turns drained) and closed the socket; once the fake saw
        # it close, it has read every ack the client sent.
        await slack.wait_until(lambda: slack._socket is None)
        assert refused not in slack.acks  # Slack will send it again
        assert [m["text"] for m in slack.posted] == [f"echo: {'x' * 20}"]


async def test_slack_http_mode_answers_503_for_an_event_it_cannot_store(tmp_path: Path) -> None:
    async with (
        FakeSlack(bot_token=SLACK_BOT_TOKEN, app_token=SLACK_APP_TOKEN) as slack,
        chat_gateway(tmp_path, "slack", SlackAdapter, **slack_settings(slack, "http")) as gw,
    ):
        adapter = next(iter(gw.adapters.values()))
        assert isinstance(adapter, SlackAdapter)
        url = f"http://127.0.0.1:{adapter.port}/slack/events"
        disk = SimulatedFullDisk(gw.store._db)
        disk.fill()
        event = dm("U42", "x" * BIG)
        status, body = await post_event(url, event, secret=SIGNING_SECRET)
        assert status == 503 and "disk full" in body

        disk.free()
        retry = await post_event(url, redeliver(event), secret=SIGNING_SECRET, retry_num=1)
        assert retry[0] == 200
        await slack.wait_until(lambda: len(slack.posted) >= 1)
        again = await post_event(url, redeliver(event), secret=SIGNING_SECRET, retry_num=2)
        assert again[0] == 200
        # Same DM, same session: a reply owed to the late retry comes before this one's.
        assert (await post_event(url, dm("U42", "marker"), secret=SIGNING_SECRET))[0] == 200
        await slack.wait_until(lambda: len(slack.posted) >= 2)
        assert [m["text"] for m in slack.posted] == [f"echo: {'x' * 20}", "echo: marker"]


async def test_discord_counts_and_logs_messages_lost_to_a_full_disk(tmp_path: Path) -> None:
    base, gateway_url = Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY  # process-wide in discord.py
    try:
        async with FakeDiscord(token="MTEwMA.fake.Zq7Xk9") as discord_api:
            discord_api.add_user("42", "Alice")
            async with chat_gateway(
                tmp_path,
                "discord",
                DiscordAdapter,
                token="MTEwMA.fake.Zq7Xk9",
                api_base_url=discord_api.api_base_url,
                allowed_users=["42"],
            ) as gw:
                adapter = next(iter(gw.adapters.values()))
                assert isinstance(adapter, DiscordAdapter)
                disk = SimulatedFullDisk(gw.store._db)
                disk.fill()
                with capture_logs() as logs:
                    for _ in range(3):
                        await discord_api.dm("42", "x" * 2000)
                    await wait_for(lambda: adapter.health().get("lost_total") == 3)
                lost = [e for e in logs if e["event"] == "discord_messages_lost"]
                assert len(lost) == 1  # once a minute, not per message
                assert lost[0]["log_level"] == "error" and lost[0]["platform"] == "discord"
                assert lost[0]["count"] == 1 and lost[0]["lost_total"] == 1
                assert lost[0]["reason"].startswith("the store cannot write (disk full")
                disk.free()
                await discord_api.dm("42", "back")
                channel = discord_api.dm_channel("42")
                await wait_for(lambda: discord_api.sent_to(channel) == ["echo: back"])
    finally:
        Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY = base, gateway_url


# --- end to end, a real full disk: a small tmpfs under a real daemon -------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path`, unmounted at the end whatever happens."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the simulated disk-full tests cover this")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here ({mounted.stderr.strip()})"
        print(reason)
        pytest.skip(f"{reason}; the simulated disk-full tests cover this")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill_up(directory: Path) -> Path:
    """Write zeros until the file system is full; returns the file to delete."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    block = b"\0" * (1 << 16)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, block)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 512)
    finally:
        os.close(fd)
    return filler


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
async def test_real_disk_full_on_a_tmpfs_is_reported_and_recovered_from(tmp_path: Path) -> None:
    port = free_port()
    errors = tmp_path / "daemon.log"  # off the tmpfs, so the log itself has room
    with small_tmpfs(tmp_path / "home", "16m") as home:
        (home / "hermes.yaml").write_text(f"platforms:\n  http:\n    port: {port}\n")
        env = {**os.environ, "HERMES_HOME": str(home)}
        env.pop("HERMES_CONFIG", None)
        with errors.open("w") as log_file:
            daemon = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "gateway.cli", "run", "--log-json"),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
        try:
            await _full_disk_round_trip(f"http://127.0.0.1:{port}", home)
        finally:
            daemon.terminate()
            try:
                await asyncio.wait_for(daemon.wait(), 20)
            except TimeoutError:
                daemon.kill()
                await daemon.wait()
    lines = [json.loads(line) for line in errors.read_text().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
    assert [e for e in events if e.startswith("store_unwritable")] == [
        "store_unwritable",
        "store_unwritable_ended",
    ], events
    for writer in ("fts_index", "wal_checkpoint", "sessions_json_write", "status_file_write"):
        assert events.count(f"{writer}_failed") <= 1, events  # once a minute, not per retry
    assert daemon.returncode == 0
    assert "Traceback" not in errors.read_text()


async def _full_disk_round_trip(url: str, home: Path) -> None:
    async with aiohttp.ClientSession() as http:

        async def post(text: str, message_id: str) -> tuple[int, dict[str, Any], str]:
            body = {"chat_id": "c1", "user_id": "u1", "text": text, "message_id": message_id}
            async with http.post(f"{url}/v1/messages", json=body) as resp:
                return resp.status, await resp.json(), resp.headers.get("Retry-After", "")

        async def replies() -> list[str]:
            async with http.get(f"{url}/v1/chats/c1/messages") as resp:
                return [m["text"] for m in (await resp.json())["messages"]]

        async def health() -> dict[str, Any] | None:
            try:
                async with http.get(f"{url}/healthz") as resp:
                    return await resp.json()
            except aiohttp.ClientError:
                return None

        await wait_for(health, within=20)
        assert (await post("first", "m1"))[0] == 202
        await wait_for(replies)
        assert await replies() == ["echo: first"]

        # SQLite reuses a checkpointed WAL file's room for later writes; empty it first,
        # so every write needs new blocks and the full disk refuses them all.
        checkpoint = sqlite3.connect(home / "sessions" / "state.db")
        try:
            assert checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        finally:
            checkpoint.close()
        filler = fill_up(home)

        for _ in range(3):
            status, body, retry_after = await post("second", "m2")
            assert (status, retry_after) == (503, "5"), body
            assert "disk full" in body["error"]
        now = await health()
        assert now is not None and now["status"] == "degraded"
        assert now["store"]["state"] == "unwritable"
        assert now["store"]["reason"].startswith("disk full: ")

        # status.json has no room for a temp file: it is rewritten in place, and `status`
        # shows the store (written here with this test's pid, a live process).
        write_status(home, {"state": "running", "health": now})
        shown = await asyncio.to_thread(status_cli, home)
        assert shown.returncode == 0, shown.stderr
        assert "  store: unwritable since " in shown.stdout and "disk full" in shown.stdout

        filler.unlink()  # space returns
        status, body, _ = await post("second", "m2")  # the retry is accepted
        assert (status, body["status"]) == (202, "started")
        await wait_for(lambda: _count(replies, 2))
        assert (await post("second", "m2"))[1]["status"] == "duplicate"
        # A later message in the chat is answered after any reply owed to the copy.
        assert (await post("marker", "m3"))[0] == 202
        await wait_for(lambda: _count(replies, 3))
        assert await replies() == ["echo: first", "echo: second", "echo: marker"]
        now = await health()
        assert now is not None and now["status"] == "ok", now


async def _count(replies: Callable[[], Awaitable[list[str]]], n: int) -> bool:
    return len(await replies()) >= n
