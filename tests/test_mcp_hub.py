"""The MCP hub against real servers: the test server (tests/fakes/mcp_server.py, the
official SDK) over stdio and streamable HTTP, and the PyPI reference server
`mcp-server-time`. Listing and calls, a server killed and back, a down server, a call
past its timeout, a flood, a changed tool list, and the children a kill -9 left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from config.mcp import ALL_MCP, McpConfig, McpSelection
from gateway.mcp import McpHub
from gateway.mcp.link import ServerLink
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fakes" / "mcp_server.py"
TIME_SERVER = Path(sys.executable).parent / "mcp-server-time"


def stdio_server(**extra: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(FAKE), "stdio"], **extra}


def hub_for(home: Path, servers: dict[str, Any], **settings: Any) -> McpHub:
    config = McpConfig.model_validate({"servers": servers, **settings}, strict=False)
    return McpHub(config, home)


def spawn(args: list[str], **options: Any) -> subprocess.Popen[str]:
    """A subprocess of the test (started in a blink: no need to leave the loop for it)."""
    return subprocess.Popen(args, text=True, cwd=ROOT, **options)


def start_http_server(port: int = 0) -> tuple[subprocess.Popen[str], int]:
    proc = spawn([sys.executable, str(FAKE), "http", str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening on PORT", or "" when it died
    assert line.startswith("listening on "), line
    return proc, int(line.split()[-1])


@pytest.fixture
def http_server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc, port = start_http_server()
    yield proc, port
    proc.kill()
    proc.wait(timeout=10)


def fake_hub(home: Path) -> McpHub:
    counter = home / "tickets.txt"
    return hub_for(
        home,
        {"fake": stdio_server(env={"MCP_FAKE_COUNTER": str(counter)}, timeout_seconds=1)},
        max_result_chars=1000,
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def shared_hub(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[McpHub]:
    """One server for the tests that leave it as they found it (a server start costs
    about a second)."""
    hub = fake_hub(tmp_path_factory.mktemp("mcp-home"))
    await hub.start()
    yield hub
    await hub.stop()


@pytest.fixture
async def stdio_hub(tmp_path: Path) -> AsyncIterator[McpHub]:
    hub = fake_hub(tmp_path)
    await hub.start()
    yield hub
    await hub.stop()


def child_pid(home: Path, server: str) -> int:
    rows = json.loads((home / "mcp" / "children.json").read_text())
    return next(row["pid"] for row in rows if row["server"] == server)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours has ended too.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rpartition(")")[2].split()[0] == "Z")


@pytest.mark.asyncio(loop_scope="module")
async def test_stdio_tools_are_listed_qualified_and_called(shared_hub: McpHub) -> None:
    assert shared_hub.health()["fake"] == {"state": "up", "tools": 6, "last_error": None}
    names = {tool.qualified for tool in shared_hub.tools(ALL_MCP)}
    assert {"fake__add", "fake__create_ticket", "fake__slow"} <= names
    add = shared_hub.tool("fake__add")
    assert add is not None and add.input_schema["required"] == ["a", "b"]
    assert (await shared_hub.call("fake__add", {"a": 2, "b": 40})).text == "42"
    picture = await shared_hub.call("fake__picture", {})
    assert picture.images and picture.images[0][0] == "image/png"
    assert picture.images[0][1].startswith(b"\x89PNG")


async def test_the_reference_time_server_beside_ours_and_an_agents_selection(
    tmp_path: Path,
) -> None:
    hub = hub_for(tmp_path, {"fake": stdio_server(), "time": {"command": str(TIME_SERVER)}})
    await hub.start()
    try:
        result = await hub.call("time__get_current_time", {"timezone": "Etc/UTC"})
        assert not result.is_error
        assert json.loads(result.text)["timezone"] == "Etc/UTC"
        only = McpSelection(servers=frozenset({"time"}), tools=frozenset({"fake__add"}))
        assert {t.qualified for t in hub.tools(only)} == {
            "fake__add",
            "time__get_current_time",
            "time__convert_time",
        }
        assert hub.tools(McpSelection()) == []
        # One server killed: the other's calls go on.
        os.kill(child_pid(tmp_path, "fake"), signal.SIGKILL)
        await wait_for(lambda: hub.health()["fake"]["state"] == "down")
        assert hub.health()["time"]["state"] == "up"
        again = await hub.call("time__get_current_time", {"timezone": "Etc/UTC"})
        assert not again.is_error
    finally:
        await hub.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_call_past_its_timeout_is_cancelled_and_the_server_still_works(
    shared_hub: McpHub,
) -> None:
    started = time.monotonic()
    result = await shared_hub.call("fake__slow", {"seconds": 30})
    assert result.is_error and "did not answer within 1 seconds" in result.text
    assert time.monotonic() - started < 5
    assert (await shared_hub.call("fake__add", {"a": 1, "b": 1})).text == "2"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_flood_is_cut_with_a_marker_and_its_stderr_bounded(shared_hub: McpHub) -> None:
    with capture_logs() as logs:
        result = await shared_hub.call("fake__flood", {"chars": 200_000})
        assert len(result.text) <= 1000 and "[cut: 200,000 characters" in result.text
        await wait_for(lambda: any(e["event"] == "mcp_server_stderr" for e in logs))
    lines = [e for e in logs if e["event"] == "mcp_server_stderr"]
    assert 0 < len(lines) <= 20 and all(len(e["line"]) <= 500 for e in lines)
    assert (await shared_hub.call("fake__add", {"a": 1, "b": 2})).text == "3"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_changed_tool_list_is_read_again(shared_hub: McpHub) -> None:
    version = shared_hub.version
    assert (await shared_hub.call("fake__grow", {})).text == "grown"
    await wait_for(lambda: shared_hub.tool("fake__extra") is not None)
    assert shared_hub.version > version
    assert (await shared_hub.call("fake__extra", {})).text == "extra"


async def test_a_handshake_era_connection_sees_list_changed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ServerLink, "connect_mode", "legacy")
    hub = fake_hub(tmp_path)
    await hub.start()
    try:
        assert hub.health()["fake"]["state"] == "up"
        assert (await hub.call("fake__grow", {})).text == "grown"
        await wait_for(lambda: hub.tool("fake__extra") is not None)
    finally:
        await hub.stop()


async def test_a_killed_stdio_server_goes_down_answers_at_once_and_comes_back(
    tmp_path: Path, stdio_hub: McpHub
) -> None:
    pid = child_pid(tmp_path, "fake")
    with capture_logs() as logs:
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: stdio_hub.health()["fake"]["state"] == "down")
        started = time.monotonic()
        result = await stdio_hub.call("fake__add", {"a": 1, "b": 2})
        assert time.monotonic() - started < 0.5
        assert json.loads(result.text) == {"error": "tool server fake is down; retrying"}
        # Its last known tools stay offered.
        assert stdio_hub.tool("fake__add") is not None
        await wait_for(lambda: stdio_hub.health()["fake"]["state"] == "up", within=15)
    events = [e["event"] for e in logs if e.get("server") == "fake"]
    assert events.index("mcp_server_down") < events.index("mcp_server_up")
    assert child_pid(tmp_path, "fake") != pid
    assert (await stdio_hub.call("fake__add", {"a": 1, "b": 2})).text == "3"


async def test_streamable_http_lists_calls_and_reconnects(
    tmp_path: Path, http_server: tuple[subprocess.Popen[str], int]
) -> None:
    proc, port = http_server
    hub = hub_for(tmp_path, {"web": {"url": f"http://127.0.0.1:{port}/mcp"}})
    await hub.start()
    try:
        assert hub.health()["web"]["state"] == "up"
        assert (await hub.call("web__add", {"a": 20, "b": 22})).text == "42"
        proc.kill()
        proc.wait(timeout=10)
        await wait_for(lambda: hub.health()["web"]["state"] == "down", within=20)
        assert "down; retrying" in (await hub.call("web__add", {"a": 1, "b": 1})).text
        back, _ = start_http_server(port)
        try:
            await wait_for(lambda: hub.health()["web"]["state"] == "up", within=20)
            assert (await hub.call("web__add", {"a": 1, "b": 1})).text == "2"
        finally:
            back.kill()
            back.wait(timeout=10)
    finally:
        await hub.stop()


async def test_an_unreachable_server_is_down_with_its_error_and_no_secret(tmp_path: Path) -> None:
    hub = hub_for(
        tmp_path,
        {
            "gone": {"command": str(tmp_path / "no-such-server"), "env": {"T": "env-SECRET9"}},
            "web": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Token": "hdr-SECRET8"}},
        },
    )
    await hub.start()
    try:
        health = hub.health()
        assert health["gone"]["state"] == "down"
        assert "FileNotFoundError" in health["gone"]["last_error"]
        await wait_for(lambda: hub.health()["web"]["state"] == "down")
        assert "SECRET" not in json.dumps(hub.health())
        assert "is down" in (await hub.call("gone__x", {})).text
    finally:
        await hub.stop()


HOLDER = """
import asyncio, sys
from pathlib import Path
from config.mcp import McpConfig
from gateway.mcp import McpHub
from gateway.mcp.link import ServerLink

async def main():
    config = McpConfig.model_validate({"servers": {"fake": {
        "command": sys.executable, "args": [sys.argv[2], "stdio"],
        "env": {"MCP_FAKE_LINGER": "1"}}}}, strict=False)
    hub = McpHub(config, Path(sys.argv[1]))
    await hub.start()
    print("ready", hub.health()["fake"]["state"], flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_new_hub_ends_the_children_a_killed_daemon_left_and_stop_ends_its_own(
    tmp_path: Path,
) -> None:
    holder = spawn([sys.executable, "-c", HOLDER, str(tmp_path), str(FAKE)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        lines = iter(holder.stdout.readline, "")  # structlog's lines come first
        assert next(line for line in lines if line.startswith("ready")).strip() == "ready up"
        pid = child_pid(tmp_path, "fake")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert alive(pid)  # the child outlived its daemon: an orphan
        hub = hub_for(tmp_path, {"fake": stdio_server(env={"MCP_FAKE_LINGER": "1"})})
        await hub.start()
        await wait_for(lambda: not alive(pid))
        # The new hub's own child (it too outlives its stdin) ends with the hub's stop.
        own = child_pid(tmp_path, "fake")
        assert own != pid and alive(own)
        await hub.stop()
        await wait_for(lambda: not alive(own))
        assert json.loads((tmp_path / "mcp" / "children.json").read_text()) == []
    finally:
        holder.kill()
        holder.wait(timeout=10)


async def test_a_recorded_pid_whose_start_time_differs_is_left_alone(tmp_path: Path) -> None:
    bystander = spawn(["sleep", "60"], start_new_session=True)
    try:
        (tmp_path / "mcp").mkdir()
        record = [{"server": "old", "pid": bystander.pid, "start_time": 1}]
        (tmp_path / "mcp" / "children.json").write_text(json.dumps(record))
        hub = hub_for(tmp_path, {})
        await hub.start()
        await hub.stop()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


async def test_a_server_that_answers_pings_with_an_error_stays_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newer protocols have no ping method: "method not found" is an answer, and the
    connection is alive. Only silence or a broken transport takes the server down."""
    monkeypatch.setattr("gateway.mcp.link.PING_INTERVAL_SECONDS", 0.1)
    hub = hub_for(tmp_path, {"fake": stdio_server()})
    await hub.start()
    try:
        (link,) = hub._links.values()
        await wait_for(lambda: link.pings >= 3)
        assert hub.health()["fake"] == {"state": "up", "tools": 6, "last_error": None}
        assert (await hub.call("fake__add", {"a": 1, "b": 2})).text == "3"
    finally:
        await hub.stop()


def test_a_daemon_without_servers_never_loads_the_sdk(tmp_path: Path) -> None:
    """The SDK is a few hundred modules: a runner with no `mcp.servers` builds its hub
    without importing it (start-up time and memory stay what they were)."""
    code = (
        "import sys; from pathlib import Path; from config import GatewayConfig;"
        " from gateway.run import GatewayRunner;"
        f" GatewayRunner(GatewayConfig(), home=Path({str(tmp_path)!r}));"
        " print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


async def test_a_killed_handshake_era_server_goes_down_and_comes_back(tmp_path: Path) -> None:
    """`mcp-server-time` speaks the handshake-era protocol (no event stream): killed, it
    is down, answers so at once, and is back with a new child."""
    hub = hub_for(tmp_path, {"time": {"command": str(TIME_SERVER)}})
    await hub.start()
    try:
        assert hub.health()["time"]["state"] == "up"
        pid = child_pid(tmp_path, "time")
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: hub.health()["time"]["state"] == "down", within=40)
        result = await hub.call("time__get_current_time", {"timezone": "UTC"})
        assert json.loads(result.text) == {"error": "tool server time is down; retrying"}
        await wait_for(lambda: hub.health()["time"]["state"] == "up", within=15)
        assert child_pid(tmp_path, "time") != pid
        answer = await hub.call("time__get_current_time", {"timezone": "UTC"})
        assert "datetime" in answer.text
    finally:
        await hub.stop()


async def test_a_command_not_found_is_named_in_the_error(tmp_path: Path) -> None:
    hub = hub_for(tmp_path, {"gone": {"command": "no-such-mcp-server-here"}})
    await hub.start()
    try:
        await wait_for(lambda: hub.health()["gone"]["last_error"] is not None)
        health = hub.health()["gone"]
        assert health["state"] == "down"
        assert "cannot start 'no-such-mcp-server-here': not found" in health["last_error"]
    finally:
        await hub.stop()
