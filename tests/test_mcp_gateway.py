"""MCP tools through the whole gateway: the real runner and HTTP adapter, the openai
backend against the fake OpenAI server (scripted to call the tools), and real MCP
servers: the test server (tests/fakes/mcp_server.py, the official SDK) as a stdio child
and over streamable HTTP, and the PyPI reference server `mcp-server-time`.

A tool of each answers through the model; a killed server shows `down` in /healthz, the
user is still answered, and the tools work again once it is back, with no restart;
approve, deny and timeout of a call that asks first (a denied call never reaches the
server)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.harness import Daemon
from tests.fakes.openai_server import FakeOpenAI, tool_calls
from tests.gateway_client import RunningGateway
from tests.test_mcp_hub import TIME_SERVER, start_http_server, stdio_server
from tests.waiting import wait_blocking, wait_for

pytestmark = pytest.mark.timeout(120)

MakeGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(check_pairing=True) as server:
        yield server


@pytest.fixture
async def make_gateway(tmp_path: Path, fake: FakeOpenAI) -> AsyncIterator[MakeGateway]:
    made: list[RunningGateway] = []

    async def make(servers: dict[str, Any], **mcp: Any) -> RunningGateway:
        settings = {
            "timezone": "UTC",
            "agent": {"backend": "openai", "base_url": fake.base_url, "model": "m"},
            "mcp": {"servers": servers, **mcp},
        }
        gateway = await RunningGateway.started(settings, tmp_path / "home")
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


def last_results(fake: FakeOpenAI) -> list[str]:
    """The tool results (their text) of the last round the model was sent."""
    results: list[str] = []
    for message in fake.requests[-1]["json"]["messages"]:
        results = [*results, message["content"]] if message.get("role") == "tool" else []
    return results


def offered(fake: FakeOpenAI) -> set[str]:
    """The tool names of the model's last request."""
    return {spec["function"]["name"] for spec in fake.requests[-1]["json"].get("tools", [])}


async def health(gw: RunningGateway) -> dict[str, Any]:
    return (await gw.client.get_json("/healthz"))["mcp"]


async def test_tools_of_a_stdio_an_http_and_the_reference_server_answer_through_the_model(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    proc, port = start_http_server()
    try:
        gw = await make_gateway(
            {
                "local": stdio_server(),
                "web": {"url": f"http://127.0.0.1:{port}/mcp"},
                "time": {"command": str(TIME_SERVER), "args": ["--local-timezone", "UTC"]},
            }
        )

        # Start-up waits START_WAIT_SECONDS for the servers' first attempts; a slow
        # machine can take longer to start a server, which stays "starting" meanwhile.
        async def started() -> bool:
            return "starting" not in {h["state"] for h in (await health(gw)).values()}

        await wait_for(started, 60)
        assert {name: h["state"] for name, h in (await health(gw)).items()} == {
            "local": "up",
            "web": "up",
            "time": "up",
        }
        metrics = await gw.client.get_text("/metrics")
        assert 'hermes_mcp_server_up{server="web",state="up"} 1.0' in metrics
        assert 'hermes_mcp_server_tools{server="time"} 2.0' in metrics
        fake.script(tool_calls(("local__add", {"a": 2, "b": 3})), "2 + 3 is 5")
        assert await gw.say("add 2 and 3") == "2 + 3 is 5"
        assert last_results(fake) == ["5"]
        assert {"local__add", "web__add", "time__get_current_time"} <= offered(fake)
        assert "memory_save" in offered(fake)  # no `tools` key: built-ins and MCP tools

        fake.script(tool_calls(("web__add", {"a": 40, "b": 2})), "42")
        assert await gw.say("add 40 and 2 over there") == "42"
        assert last_results(fake) == ["42"]

        fake.script(tool_calls(("time__get_current_time", {"timezone": "Europe/Berlin"})), "ok")
        assert await gw.say("what time is it in Berlin?") == "ok"
        (answer,) = last_results(fake)
        assert "Europe/Berlin" in answer and "datetime" in answer
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_a_killed_server_is_down_the_user_is_answered_and_its_tools_come_back(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    proc, port = start_http_server()
    try:
        gw = await make_gateway({"web": {"url": f"http://127.0.0.1:{port}/mcp"}})
        fake.script(tool_calls(("web__add", {"a": 1, "b": 1})), "two")
        assert await gw.say("1 + 1") == "two"
        assert last_results(fake) == ["2"]

        proc.kill()
        proc.wait(timeout=10)

        async def down() -> bool:
            return (await health(gw))["web"]["state"] != "up"

        await wait_for(down, 30)  # the brief: within 30 s
        # Its tools stay offered; a call answers at once that the server is down.
        fake.script(tool_calls(("web__add", {"a": 2, "b": 2})), "the adder is away")
        assert await gw.say("2 + 2") == "the adder is away"
        assert "web__add" in offered(fake)
        assert last_results(fake) == ['{"error": "tool server web is down; retrying"}']

        proc, _ = start_http_server(port)

        async def up() -> bool:
            return (await health(gw))["web"]["state"] == "up"

        await wait_for(up, 90)  # the brief: within 90 s of its return, no restart
        fake.script(tool_calls(("web__add", {"a": 3, "b": 4})), "seven")
        assert await gw.say("3 + 4") == "seven"
        assert last_results(fake) == ["7"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def ticket_server(counter: Path) -> dict[str, Any]:
    return stdio_server(env={"MCP_FAKE_COUNTER": str(counter)}, approve=["create_ticket"])


def tickets(counter: Path) -> list[str]:
    return counter.read_text().splitlines() if counter.exists() else []


async def test_approve_runs_the_call_on_the_server_once(
    make_gateway: MakeGateway, fake: FakeOpenAI, tmp_path: Path
) -> None:
    counter = tmp_path / "tickets.txt"
    gw = await make_gateway({"desk": ticket_server(counter)})
    fake.script(tool_calls(("desk__create_ticket", {"title": "printer on fire"})), "filed")
    await gw.client.post("c1", "file a ticket")
    (question,) = await gw.client.replies("c1", 1)
    assert "desk__create_ticket" in question and "printer on fire" in question
    assert tickets(counter) == []  # nothing runs before the answer
    await gw.client.post("c1", "/approve")
    assert (await gw.client.replies("c1", 2))[1] == "filed"
    assert tickets(counter) == ["printer on fire"]
    assert last_results(fake) == ["ticket created: printer on fire"]


async def test_a_denied_call_never_reaches_the_server(
    make_gateway: MakeGateway, fake: FakeOpenAI, tmp_path: Path
) -> None:
    counter = tmp_path / "tickets.txt"
    gw = await make_gateway({"desk": ticket_server(counter)})
    fake.script(tool_calls(("desk__create_ticket", {"title": "no"})), "not filed")
    await gw.client.post("c1", "file a ticket")
    await gw.client.replies("c1", 1)
    await gw.client.post("c1", "/deny")
    assert (await gw.client.replies("c1", 2))[1] == "not filed"
    assert last_results(fake) == ['{"error": "the user denied this call"}']
    # The server is up and its other tools run: the denied call was never sent.
    fake.script(tool_calls(("desk__add", {"a": 1, "b": 2})), "three")
    assert (await gw.say("1 + 2")) == "three"
    assert tickets(counter) == []


async def test_an_unanswered_call_times_out_and_never_runs(
    make_gateway: MakeGateway, fake: FakeOpenAI, tmp_path: Path
) -> None:
    counter = tmp_path / "tickets.txt"
    gw = await make_gateway({"desk": ticket_server(counter)}, approval_timeout_seconds=1)
    fake.script(tool_calls(("desk__create_ticket", {"title": "late"})), "nobody answered")
    await gw.client.post("c1", "file a ticket")
    assert (await gw.client.replies("c1", 2))[1] == "nobody answered"
    assert last_results(fake) == ['{"error": "the user did not answer"}']
    await gw.client.post("c1", "/approve")  # too late: nothing waits any more
    assert await gw.client.replies("c1", 1) == ["Nothing is waiting for approval."]
    assert tickets(counter) == []


def test_the_daemon_sees_a_killed_stdio_child_down_within_30s_and_back(tmp_path: Path) -> None:
    """The real daemon (`hermes-gateway run`) with `mcp-server-time` as its child: the
    child killed, /healthz says down within the brief's 30 s and up again after, with a
    new child, no restart. (The daemon learns of it from the connection, here the
    ping's "connection closed": an error answer that is not an answer.)"""
    home = tmp_path / "home"
    settings = (
        "agent: {backend: openai, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
        f"mcp:\n  servers:\n    time: {{command: {json.dumps(str(TIME_SERVER))}}}\n"
    )
    daemon = Daemon(home, settings)
    try:
        daemon.start()

        def state() -> dict[str, Any]:
            return daemon.get("/healthz")["mcp"]["time"]

        wait_blocking(lambda: state()["state"] == "up", within=30)
        (child,) = json.loads((home / "mcp" / "children.json").read_text())
        os.kill(child["pid"], signal.SIGKILL)
        started = time.monotonic()
        wait_blocking(lambda: state()["state"] == "down", within=30)
        assert time.monotonic() - started <= 30
        wait_blocking(lambda: state()["state"] == "up", within=60)
        (again,) = json.loads((home / "mcp" / "children.json").read_text())
        assert again["pid"] != child["pid"]
    finally:
        daemon.ensure_stopped()
