"""Shared adapter behaviour: deny-by-default access, DM pairing, the mention rule,
backoff and health state, and the `pairing` CLI."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import time_machine

from adapters.base import Backoff, MessageEvent, PlatformAdapter, SendResult
from config import GatewayConfig, TelegramConfig
from gateway.runner.pairing import (
    ALPHABET,
    APPROVED_NOTICE,
    CODE_LENGTH,
    MAX_PENDING_PER_PLATFORM,
    Pairing,
    add_pairing_parser,
    cmd_pairing,
)
from gateway.session import Platform, SessionSource
from gateway.store import journal
from gateway.store.session_store import SessionStore
from scripts.harness import Daemon
from tests.fakes.telegram_api import FakeTelegram

CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})


class FakeGateway:
    """The GatewayHandle bits access control uses, over a real store."""

    def __init__(self, pairing: Pairing) -> None:
        self.pairing = pairing
        self.notices: list[tuple[SessionSource, str]] = []

    async def is_paired(self, platform: str, user_id: str) -> bool:
        return await self.pairing.is_paired(platform, user_id)

    async def request_pairing(self, source: SessionSource):
        assert source.user_id is not None
        return await self.pairing.request(
            source.platform.value, source.user_id, source.user_name, target=source
        )

    async def notify(self, target: SessionSource, text: str) -> None:
        self.notices.append((target, text))


class Adapter(PlatformAdapter):
    platform = Platform.TELEGRAM

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def send(self, target, text, reply_to=None, *, delivery_id=None) -> SendResult:
        return SendResult()


@pytest.fixture
async def store(tmp_path: Path):
    async with SessionStore(tmp_path / "sessions", CONFIG) as opened:
        yield opened


def make(store: SessionStore, **settings: Any) -> tuple[Adapter, FakeGateway]:
    adapter = Adapter(TelegramConfig(enabled=True, **settings))
    gateway = FakeGateway(Pairing(store))
    adapter.bind(gateway)  # type: ignore[arg-type]
    return adapter, gateway


def dm(user_id: str = "7", name: str = "Ann") -> MessageEvent:
    source = SessionSource(Platform.TELEGRAM, chat_id=user_id, user_id=user_id, user_name=name)
    return MessageEvent(source=source, text="hi")


def group(chat_id: str = "-100", user_id: str = "7", parent: str | None = None) -> SessionSource:
    return SessionSource(
        Platform.TELEGRAM,
        chat_id=chat_id,
        chat_type="group",
        user_id=user_id,
        parent_chat_id=parent,
    )


async def test_unknown_users_are_denied_by_default_and_get_a_pairing_code(store) -> None:
    adapter, gateway = make(store)
    assert not await adapter.authorize(dm())
    ((target, text),) = gateway.notices
    assert target.chat_id == "7"
    code = re.search(r"pairing code is ([A-Z0-9]+)", text).group(1)
    assert len(code) == CODE_LENGTH and set(code) <= set(ALPHABET)
    assert not set(code) & set("IO01")
    assert f"hermes-gateway pairing approve telegram {code}" in text


async def test_the_same_user_keeps_the_same_code(store) -> None:
    adapter, gateway = make(store)
    await adapter.authorize(dm())
    await adapter.authorize(dm())
    first, second = (t for _, t in gateway.notices)
    assert first == second


async def test_at_most_three_codes_are_pending_per_platform(store) -> None:
    adapter, gateway = make(store)
    for user in range(MAX_PENDING_PER_PLATFORM + 1):
        await adapter.authorize(dm(str(user)))
    texts = [t for _, t in gateway.notices]
    assert all("pairing code is" in t for t in texts[:MAX_PENDING_PER_PLATFORM])
    assert "too many pairing requests" in texts[-1]
    assert await Pairing(store).request("discord", "9", None) is not None  # per platform


async def test_codes_expire_after_an_hour(store) -> None:
    pairing = Pairing(store)
    start = time.time()
    with time_machine.travel(start, tick=False):
        code = await pairing.request("telegram", "7", "Ann")
    with time_machine.travel(start + 3601, tick=False):
        assert await pairing.approve("telegram", code) is None
        assert await pairing.pending() == []


async def test_approval_lets_the_user_in_and_revoke_takes_it_back(store) -> None:
    adapter, gateway = make(store)
    await adapter.authorize(dm())
    code = re.search(r"code is ([A-Z0-9]+)", gateway.notices[0][1]).group(1)
    pairing = Pairing(store)
    assert await pairing.approve("discord", code) is None  # another platform's code space
    request = await pairing.approve("telegram", code.lower())
    assert request is not None and request.user_id == "7"
    assert await adapter.authorize(dm())
    assert await pairing.revoke("telegram", "7")
    assert not await adapter.authorize(dm())


async def test_approval_records_one_notice_to_the_dm_the_code_was_asked_from(store) -> None:
    pairing = Pairing(store)
    first = SessionSource(Platform.SLACK, "D111", user_id="U9", user_name="Zed")
    latest = SessionSource(Platform.SLACK, "D222", user_id="U9", user_name="Zed")
    code = await pairing.request("slack", "U9", "Zed", target=first)
    assert await pairing.request("slack", "U9", "Zed", target=latest) == code
    assert await pairing.request("slack", "U9", "Zed") == code  # keeps the last DM known
    request = await pairing.approve("slack", code)
    assert request is not None and request.target == latest
    assert await pairing.approve("slack", code) is None  # once
    [row] = await store.write(lambda conn: journal.pending_outbound(conn, time.time() + 1))
    # The ledger keeps the DM to deliver to, not who it is (`journal.delivery_target`).
    dm_only = SessionSource(Platform.SLACK, "D222")
    assert (row["target"], row["text"], row["reply_to"]) == (dm_only, APPROVED_NOTICE, None)


async def test_a_code_without_a_dm_is_approved_without_a_notice(store) -> None:
    pairing = Pairing(store)
    code = await pairing.request("slack", "U9", "Zed")
    request = await pairing.approve("slack", code)
    assert request is not None and request.target is None
    assert await store.write(lambda conn: journal.pending_outbound(conn, time.time() + 1)) == []


async def test_allowlists_and_allow_all(store) -> None:
    adapter, gateway = make(store, allowed_users=["7"], allowed_chats=["-100"])
    assert await adapter.authorize(dm("7"))
    assert await adapter.authorize(MessageEvent(source=group("-100", user_id="8"), text="x"))
    thread = group("thread-1", user_id="8", parent="-100")
    assert await adapter.authorize(MessageEvent(source=thread, text="x"))
    assert not await adapter.authorize(MessageEvent(source=group("-200", user_id="8"), text="x"))
    assert gateway.notices == []  # no pairing codes in groups
    everyone, _ = make(store, allow_all_users=True)
    assert await everyone.authorize(dm("99"))


async def test_ignore_behaviour_stays_silent(store) -> None:
    adapter, gateway = make(store, unauthorized_dm_behavior="ignore")
    assert not await adapter.authorize(dm())
    assert gateway.notices == []


async def test_mention_rule(store) -> None:
    adapter, _ = make(store)
    src = group()
    assert not adapter.addressed_to_bot(src, mentioned=False, replied_to_bot=False)
    assert adapter.addressed_to_bot(src, mentioned=True, replied_to_bot=False)
    assert adapter.addressed_to_bot(src, mentioned=False, replied_to_bot=True)
    assert adapter.addressed_to_bot(dm().source, mentioned=False, replied_to_bot=False)
    free, _ = make(store, free_response_channels=["-100"])
    assert free.addressed_to_bot(src, mentioned=False, replied_to_bot=False)
    assert free.addressed_to_bot(group("t", parent="-100"), mentioned=False, replied_to_bot=False)
    open_, _ = make(store, require_mention=False)
    assert open_.addressed_to_bot(group("-5"), mentioned=False, replied_to_bot=False)


def test_backoff_grows_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial=1, maximum=8, factor=2, jitter=0)
    assert [backoff.delay() for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    backoff.reset()
    assert backoff.delay() == 1
    jittery = Backoff(initial=10, maximum=10, jitter=0.1)
    assert all(9 <= jittery.delay() <= 11 for _ in range(50))


def test_health_reports_the_real_state_and_counts_reconnects() -> None:
    adapter = Adapter(TelegramConfig())
    assert adapter.health()["state"] == "stopped"
    adapter.set_state("running")
    adapter.set_state("reconnecting", "connection reset")
    adapter.set_state("reconnecting")
    adapter.set_state("running")
    health = adapter.health()
    assert health["state"] == "running"
    assert health["reconnects"] == 1 and health["last_error"] == "connection reset"


def _run_cli(home: Path, *argv: str, monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setenv("HERMES_HOME", str(home))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_pairing_parser(sub, [])
    code = cmd_pairing(parser.parse_args(["pairing", *argv]), CONFIG)
    out = capsys.readouterr()
    return code, out.out + out.err


async def _request_code(home: Path) -> str:
    async with SessionStore(home / "sessions", CONFIG) as store:
        return await Pairing(store).request("slack", "U9", "Zed")


def test_pairing_cli_list_approve_revoke(tmp_path: Path, monkeypatch, capsys) -> None:
    code = asyncio.run(_request_code(tmp_path))
    status, out = _run_cli(tmp_path, "list", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0 and code in out and "Zed (U9)" in out
    status, out = _run_cli(
        tmp_path, "approve", "slack", "WRONG123", monkeypatch=monkeypatch, capsys=capsys
    )
    assert status == 1 and "no valid code" in out
    status, out = _run_cli(
        tmp_path, "approve", "slack", code, monkeypatch=monkeypatch, capsys=capsys
    )
    assert status == 0 and "approved Zed (U9) on slack" in out
    status, out = _run_cli(tmp_path, "list", monkeypatch=monkeypatch, capsys=capsys)
    assert "no pending codes" in out and "U9" in out
    status, out = _run_cli(
        tmp_path, "revoke", "slack", "U9", monkeypatch=monkeypatch, capsys=capsys
    )
    assert status == 0
    status, out = _run_cli(
        tmp_path, "revoke", "slack", "U9", monkeypatch=monkeypatch, capsys=capsys
    )
    assert status == 1 and "not paired" in out


# --- the approval notice, end to end ---------------------------------------------------

TG_TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
BOB = FakeTelegram.user(99, "Bob")
CAT = FakeTelegram.user(77, "Cat")


async def _wait_for(predicate: Callable[[], bool], what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        await asyncio.sleep(0.05)


async def _cli(home: Path, *argv: str) -> tuple[int, str]:
    env = {**os.environ, "HERMES_HOME": str(home)}
    env.pop("HERMES_CONFIG", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway.cli",
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _texts_to(tg: FakeTelegram, user: dict[str, Any]) -> list[str]:
    return [m["text"] for m in tg.sent_messages if m["chat"]["id"] == user["id"]]


async def _code_for(tg: FakeTelegram, user: dict[str, Any]) -> str:
    tg.push_message(tg.private_chat(user), user, "hello")
    await _wait_for(lambda: bool(_texts_to(tg, user)), "the pairing code")
    match = re.search(r"pairing code is ([A-Z2-9]{8})", _texts_to(tg, user)[0])
    assert match is not None, _texts_to(tg, user)
    return match.group(1)


@pytest.mark.timeout(90)
async def test_an_approved_user_is_told_so_once_by_the_daemon(tmp_path: Path) -> None:
    """`pairing approve` in its own process while the daemon runs: the daemon tells the
    user at once; approved while it is down: it tells them when it starts. Each notice
    is sent exactly once, across restarts."""
    async with FakeTelegram(token=TG_TOKEN) as tg:
        telegram = (
            f"  telegram:\n    enabled: true\n    token: '{TG_TOKEN}'\n"
            f"    base_url: '{tg.base_url}'\n    poll_timeout: 1\n"
        )
        daemon = Daemon(tmp_path / "home", telegram)
        try:
            await asyncio.to_thread(daemon.start)
            bob, cat = await _code_for(tg, BOB), await _code_for(tg, CAT)

            status, out = await _cli(daemon.home, "pairing", "approve", "telegram", bob)
            assert status == 0 and "the gateway is telling them now" in out, out
            await _wait_for(lambda: APPROVED_NOTICE in _texts_to(tg, BOB), "Bob's notice")

            daemon.signal(signal.SIGTERM)
            assert await asyncio.to_thread(daemon.wait_exit) == 0
            status, out = await _cli(daemon.home, "pairing", "approve", "telegram", cat)
            assert status == 0 and "they are told when the gateway next starts" in out, out
            await asyncio.to_thread(daemon.start)
            await _wait_for(lambda: APPROVED_NOTICE in _texts_to(tg, CAT), "Cat's notice")

            tg.push_message(tg.private_chat(BOB), BOB, "hi again")
            await _wait_for(lambda: "echo: hi again" in _texts_to(tg, BOB), "Bob's answer")
        finally:
            await asyncio.to_thread(daemon.ensure_stopped)
    assert _texts_to(tg, BOB)[1:] == [APPROVED_NOTICE, "echo: hi again"]
    assert _texts_to(tg, CAT)[1:] == [APPROVED_NOTICE]


async def test_a_message_for_a_platform_without_an_adapter_is_denied_and_logged(
    tmp_path: Path,
) -> None:
    """Authorization is the adapter's: an event for a platform that has none (here
    Telegram, with only the HTTP API running) is refused, never run, and logged."""
    from structlog.testing import capture_logs

    from adapters.base import AcceptStatus
    from adapters.http import HttpAdapter
    from gateway.run import GatewayRunner

    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"http": {"enabled": True, "port": 0}}}
    )
    runner = GatewayRunner(config, [HttpAdapter(config.platforms.http)], home=tmp_path)
    await runner.start()
    try:
        stranger = SessionSource(platform=Platform.TELEGRAM, chat_id="55", user_id="55")
        with capture_logs() as logs:
            accepted = await runner.handle_message(
                MessageEvent(source=stranger, text="hello", message_id="t1")
            )
        assert accepted.status == AcceptStatus.IGNORED
        assert accepted.detail == "not authorized"
        assert not runner.is_busy(runner.store.session_key_for(stranger))
        assert await runner.turnlog.open_inbox() == []
        denied = [e for e in logs if e["event"] == "message_denied_no_adapter"]
        assert denied and denied[0]["platform"] == "telegram"
    finally:
        await runner.stop()
