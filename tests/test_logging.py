"""Logs an operator can use: one `turn_done` line per turn (no message text unless
`logging.include_text`), a line per automatic reset, per access denial and pairing
request, per adapter connect/disconnect, and one line per retry attempt; `logging.level`
and `--log-level` decide what is written.

The turn and reset lines come from a real daemon (`python -m gateway.cli run`) over HTTP;
the chat-platform lines from a real GatewayRunner with the Telegram adapter against the
fake Bot API, logging through the daemon's own configuration."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from adapters.http import HttpAdapter
from adapters.telegram import TelegramAdapter
from config import ConfigError, GatewayConfig, load_config
from gateway.ops.logs import QUIET_LIBRARIES, TurnLine, configure_logging
from gateway.run import GatewayRunner
from gateway.session import TokenUsage
from scripts.harness import Daemon
from tests.fakes.agents import scripted
from tests.fakes.telegram_api import FakeTelegram
from tests.test_http_adapter import FakeGateway, http_config

pytestmark = pytest.mark.timeout(180)  # daemons: slow to start on a loaded machine

SECRET_WORDS = "marmalade-zeppelin-4417"  # appears nowhere but in the user's message
KEY = "agent:main:http:dm:c1"


def log_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def events(lines: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [line for line in lines if line.get("event") == name]


# --- a real daemon ----------------------------------------------------------------------


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    made: list[Daemon] = []

    def make(settings: str = "", *run_args: str) -> Daemon:
        daemon = Daemon(tmp_path / f"home{len(made)}", settings)
        daemon.run_args = ["--log-json", *run_args]
        made.append(daemon)
        daemon.start()
        return daemon

    yield make
    for daemon in made:
        daemon.ensure_stopped()


def stop_and_read_log(daemon: Daemon) -> tuple[str, list[dict[str, Any]]]:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0, daemon.log_tail()
    text = daemon.log_path.read_text()
    return text, log_lines(text)


def test_each_turn_logs_one_line_without_its_text_and_a_reset_its_reason(
    make_daemon: Callable[..., Daemon],
) -> None:
    daemon = make_daemon()
    daemon.post("c1", f"please remember {SECRET_WORDS}", message_id="m1")
    assert len(daemon.wait_replies("c1", 1)) == 1
    first_session = daemon.entry(KEY)["session_id"]
    daemon.post("c1", "/stop", message_id="m2")  # suspends: the next message resets
    daemon.post("c1", "again", message_id="m3")
    replies = daemon.wait_replies("c1", 3)
    assert len(replies) == 3, replies
    second_session = daemon.entry(KEY)["session_id"]
    text, lines = stop_and_read_log(daemon)

    turns = events(lines, "turn_done")
    assert len(turns) == 2, turns  # the two messages; /stop is a command, not a turn
    turn = turns[0]
    assert turn["level"] == "info"
    assert turn["session_key"] == KEY and turn["session_id"] == first_session
    assert turn["platform"] == "http" and turn["outcome"] == "ok"
    assert isinstance(turn["duration_ms"], float) and turn["duration_ms"] >= 0
    assert turn["reply_chunks"] == 1 and turn["chunks_sent"] == 1
    assert turn["input_tokens"] > 0 and turn["output_tokens"] > 0
    assert turn["total_tokens"] == turn["input_tokens"] + turn["output_tokens"]
    assert "text" not in turn and "reply" not in turn
    assert SECRET_WORDS not in text  # neither the message nor the echoed reply

    (reset,) = events(lines, "session_reset")
    assert reset["reason"] == "suspended" and reset["session_key"] == KEY
    assert reset["old_session_id"] == first_session
    assert reset["new_session_id"] == second_session != first_session
    assert turns[1]["session_id"] == second_session

    # (the agent tasks' in-process platform, `a2a`, connects too: the HTTP API serves
    # OpenAI's chat API over it)
    connected = {e["platform"]: e for e in events(lines, "adapter_connected")}
    assert set(connected) == {"http", "a2a"}
    assert connected["http"]["listen"] == daemon.url
    assert "http" in {e["platform"] for e in events(lines, "adapter_stopped")}


def turn_running(daemon: Daemon) -> bool:
    with contextlib.closing(daemon.db()) as conn:
        return conn.execute("SELECT 1 FROM turns").fetchone() is not None


def test_a_timed_out_and_a_stopped_turn_say_so(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon("agent:\n  delay_seconds: 1.0\n  gateway_timeout: 0.3\n")
    daemon.post("slow", "take your time", message_id="m1")
    (timed_out,) = daemon.wait_replies("slow", 1)
    assert "did not answer" in timed_out["text"]
    daemon.post("c1", "never mind", message_id="m2")
    deadline = time.monotonic() + 10
    while not turn_running(daemon):
        assert time.monotonic() < deadline, "the turn never started"
        time.sleep(0.02)
    daemon.post("c1", "/stop", message_id="m3")
    assert len(daemon.wait_replies("c1", 1)) == 1  # "Stopped. ..."
    _, lines = stop_and_read_log(daemon)
    outcomes = {turn["session_key"]: turn["outcome"] for turn in events(lines, "turn_done")}
    assert outcomes == {"agent:main:http:dm:slow": "timeout", KEY: "cancelled"}


def test_include_text_puts_the_message_and_the_reply_in_the_turn_line(
    make_daemon: Callable[..., Daemon],
) -> None:
    daemon = make_daemon("logging:\n  include_text: true\n")
    daemon.post("c1", SECRET_WORDS, message_id="m1")
    assert len(daemon.wait_replies("c1", 1)) == 1
    _, lines = stop_and_read_log(daemon)
    (turn,) = events(lines, "turn_done")
    assert turn["text"] == SECRET_WORDS
    assert SECRET_WORDS in turn["reply"]


def test_log_level_on_the_command_line_beats_the_config(
    make_daemon: Callable[..., Daemon],
) -> None:
    quiet = make_daemon("logging:\n  level: info\n", "--log-level", "warning")
    loud = make_daemon("logging:\n  level: error\n", "--log-level", "INFO")
    for daemon in (quiet, loud):
        daemon.post("c1", "hello", message_id="m1")
        assert len(daemon.wait_replies("c1", 1)) == 1
    _, quiet_lines = stop_and_read_log(quiet)
    _, loud_lines = stop_and_read_log(loud)
    assert len(events(loud_lines, "turn_done")) == 1
    assert events(quiet_lines, "turn_done") == []
    assert [line for line in quiet_lines if line["level"] in ("debug", "info")] == []


def test_the_config_level_applies_without_the_option(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon("logging:\n  level: warning\n")
    daemon.post("c1", "hello", message_id="m1")
    assert len(daemon.wait_replies("c1", 1)) == 1
    _, lines = stop_and_read_log(daemon)
    assert events(lines, "turn_done") == [] and events(lines, "gateway_started") == []


# --- chat platforms: a real runner and the Telegram adapter ------------------------------

TOKEN = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
ADA = FakeTelegram.user(42, "Ada", "ada")
BOB = FakeTelegram.user(99, "Bob")


@pytest.fixture
def json_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """The daemon's JSON logging (to a buffer standing in for stderr); a function that
    returns the lines logged so far."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in QUIET_LIBRARIES}
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    configure_logging(json_output=True, level="info")
    yield lambda: log_lines(stderr.getvalue())
    root.handlers = saved[0]
    root.setLevel(saved[1])
    for name, level in quiet.items():
        logging.getLogger(name).setLevel(level)
    structlog.reset_defaults()


@pytest.fixture
async def telegram(
    tmp_path: Path, json_log: Callable[[], list[dict[str, Any]]]
) -> AsyncIterator[tuple[FakeTelegram, GatewayRunner]]:
    async with FakeTelegram(token=TOKEN) as tg:
        settings = {
            "enabled": True,
            "token": TOKEN,
            "base_url": tg.base_url,
            "poll_timeout": 1,
            "allowed_users": ["42"],
        }
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"telegram": settings}}
        )
        runner = GatewayRunner(
            config,
            [TelegramAdapter(config.platforms.telegram)],
            agent_factory=scripted({}),
            home=tmp_path / "home",
        )
        await runner.start()
        try:
            yield tg, runner
        finally:
            await runner.stop()


async def until(condition: Callable[[], Any], within: float = 8.0) -> Any:
    deadline = time.monotonic() + within
    while not (result := condition()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
    return result


async def test_a_denied_user_and_the_pairing_request_each_log_a_line(
    json_log: Callable[[], list[dict[str, Any]]],
    telegram: tuple[FakeTelegram, GatewayRunner],
) -> None:
    tg, _ = telegram
    tg.push_message(tg.private_chat(BOB), BOB, f"let me in {SECRET_WORDS}")
    await until(lambda: tg.sent)  # the pairing code went out
    (denied,) = await until(lambda: events(json_log(), "access_denied"))
    assert denied["platform"] == "telegram" and denied["action"] == "pairing"
    assert (denied["user_id"], denied["chat_id"], denied["chat_type"]) == ("99", "99", "dm")
    (pairing,) = events(json_log(), "pairing_requested")
    assert pairing["platform"] == "telegram" and pairing["user_id"] == "99"
    assert pairing["outcome"] == "new_code"
    log_text = json.dumps(json_log())
    assert SECRET_WORDS not in log_text
    code = tg.sent_messages[0]["text"].split("code is ")[1].split()[0]
    assert code not in log_text  # the code is for the operator's `pairing list`
    connected = events(json_log(), "adapter_connected")
    assert [c["platform"] for c in connected] == ["telegram"]
    assert connected[0]["bot"] == "hermes_test_bot" and connected[0]["mode"] == "polling"


async def test_a_retried_platform_error_logs_one_line_per_attempt_without_traceback(
    json_log: Callable[[], list[dict[str, Any]]],
    telegram: tuple[FakeTelegram, GatewayRunner],
) -> None:
    tg, runner = telegram
    tg.fail_next("getUpdates", status=429, retry_after=1, times=2)
    await until(lambda: events(json_log(), "adapter_reconnected"))
    retries = events(json_log(), "platform_retry")
    assert [r["attempt"] for r in retries] == [1, 2]
    for retry in retries:
        assert retry["platform"] == "telegram" and retry["operation"] == "poll"
        assert retry["delay_seconds"] == 1 and "RetryAfter" in retry["error"]
        assert retry["level"] == "warning"
    (down,) = events(json_log(), "adapter_disconnected")  # once, not per attempt
    assert down["platform"] == "telegram" and down["reconnecting"] is True
    (back,) = events(json_log(), "adapter_reconnected")
    assert back["reconnects"] == 1
    assert not [line for line in json_log() if "exception" in line or "exc_info" in line]
    assert runner.health()["adapters"]["telegram"]["state"] == "running"


# --- the `logging:` section ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("logging:\n  colour: true\n", "logging.colour: unknown key"),
        ("logging:\n  level: loud\n", "logging.level: Input should be 'debug', 'info',"),
        ("logging:\n  include_text: 'yes'\n", "logging.include_text: Input should be a valid"),
        ("logging:\n  format: xml\n", "logging.format: Input should be 'auto', 'json'"),
    ],
)
def test_logging_settings_are_checked_by_key_path(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "hermes.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert expected in str(error.value)


async def test_the_turn_line_written_directly_equals_the_one_the_chain_writes(
    json_log: Callable[[], list[dict[str, Any]]],
) -> None:
    """`TurnLine` renders its line itself when the daemon's JSON chain is configured; the
    line must be the chain's own, field for field, and in order with the chain's lines."""
    structlog.contextvars.bind_contextvars(session_key=KEY)
    try:
        turn = TurnLine("http", time.monotonic())
        turn.session_id, turn.outcome, turn.chunks, turn.sent = (
            "20261124_000000_0a0b0c0d",
            "ok",
            2,
            2,
        )
        turn.usage = TokenUsage(input_tokens=5, output_tokens=7)
        logger = structlog.get_logger("gateway.run")
        logger.info("before")
        turn.log(logger)
        direct = log_lines_now(json_log)[-1]
        with structlog.testing.capture_logs() as captured:  # the chain's own route
            turn.log(logger)
    finally:
        structlog.contextvars.unbind_contextvars("session_key")
    lines = log_lines_now(json_log)
    assert [line["event"] for line in lines] == ["before", "turn_done"]
    [chained] = captured
    assert direct.pop("timestamp").endswith("Z")
    assert direct.pop("level") == chained.pop("log_level") == "info"
    chained["session_key"] = KEY  # capture_logs leaves out the bound context
    direct_duration, chained_duration = direct.pop("duration_ms"), chained.pop("duration_ms")
    assert 0 <= direct_duration <= chained_duration
    assert direct == chained


def log_lines_now(json_log: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The lines so far, including those the sink gathers until the loop pass ends."""
    from gateway.ops import logs

    assert logs._sink is not None
    logs._sink.drain()
    return json_log()


# --- clients that go away -----------------------------------------------------------


async def drop_mid_body(port: int) -> None:
    """A real TCP client that sends a POST's headers and part of its body, then closes."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/messages HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b'Content-Length: 4000\r\n\r\n{"chat_id": "c1", "user_id": "u1", "text": "half'
    )
    await writer.drain()
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def test_clients_that_drop_a_post_mid_body_log_one_info_line_a_minute(
    json_log: Callable[[], list[dict[str, Any]]],
) -> None:
    adapter, gateway = HttpAdapter(http_config()), FakeGateway()
    adapter.bind(gateway)
    await adapter.start()
    now = [1000.0]
    adapter._gone_log.clock = lambda: now[0]  # the minute passes when the test says so
    try:
        await asyncio.gather(*(drop_mid_body(adapter.port) for _ in range(40)))
        await until(lambda: adapter.clients_gone_total == 40)
        first = log_lines_now(json_log)
        now[0] += 61
        await drop_mid_body(adapter.port)
        await until(lambda: adapter.clients_gone_total == 41)
        lines = log_lines_now(json_log)
    finally:
        await adapter.stop()
    assert not [line for line in lines if "exception" in line or "exc_info" in line]
    assert not [line for line in lines if line["level"] in ("warning", "error", "critical")]
    [gone] = events(first, "http_client_gone")  # 40 clients, one line
    assert gone["level"] == "info" and (gone["method"], gone["path"]) == ("POST", "/v1/messages")
    assert gone["unlogged"] == 0 and gone["remote"] == "127.0.0.1"
    # A minute on, the next client's line counts those the first line stood for.
    [_, later] = events(lines, "http_client_gone")
    assert later["unlogged"] == 39 and later["clients_gone_total"] == 41
    assert gateway.events == []  # nothing half-sent reached the gateway


# --- adapters' own lines ----------------------------------------------------------------


def test_an_adapter_line_never_carries_its_token_in_a_field_or_a_traceback() -> None:
    """A platform library's error can quote a request URL, and Telegram's hold the token:
    the adapter's logger replaces it wherever it appears, exceptions included."""
    adapter = TelegramAdapter(
        GatewayConfig.model_validate(
            {"platforms": {"telegram": {"enabled": True, "token": TOKEN}}}
        ).platforms.telegram
    )
    url = f"https://api.telegram.org/bot{TOKEN}/getUpdates"
    with structlog.testing.capture_logs() as captured:
        # A URL object is no string, but its text shows the token all the same.
        adapter.log.warning("telegram_probe", error=f"ConnectError: {url}", url=httpx.URL(url))
        try:
            raise ConnectionError(f"cannot reach {url}")
        except ConnectionError:
            adapter.log.exception("telegram_probe_failed", attempt=2)
    warning, failed = captured
    assert warning["platform"] == "telegram" and warning["log_level"] == "warning"
    assert warning["error"] == "ConnectError: https://api.telegram.org/bot<token>/getUpdates"
    assert warning["url"] == "https://api.telegram.org/bot<token>/getUpdates"
    assert failed["log_level"] == "error" and failed["attempt"] == 2
    assert "ConnectionError: cannot reach" in failed["exception"]
    assert "Traceback" in failed["exception"]
    assert TOKEN not in json.dumps(captured)
