"""`mcp:` and the MCP entries of `agent.tools`: what is accepted, and every refusal names
its key path (exit 78 from the CLI) without the secrets of `env` and `headers`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from config import TOOL_NAMES, ConfigError, GatewayConfig, load_config
from config.mcp import ALL_MCP, McpSelection

STDIO = """
mcp:
  servers:
    time:
      command: mcp-server-time
      args: ["--local-timezone", "Europe/Berlin"]
      env: {TZ: "Europe/Berlin", TOKEN: "env-SECRET1"}
    tickets:
      url: https://mcp.example.com/mcp
      headers: {Authorization: "Bearer hdr-SECRET2"}
      tools: {include: [create_ticket, search_tickets]}
      approve: [create_ticket]
      read_only: [search_tickets]
      timeout_seconds: 5
"""


def load(tmp_path: Path, text: str) -> GatewayConfig:
    path = tmp_path / "hermes.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return load_config(path)


def problems(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        load(tmp_path, text)
    return excinfo.value.problems


def test_servers_load_with_their_secrets_out_of_the_repr(tmp_path: Path) -> None:
    config = load(tmp_path, STDIO)
    time, tickets = config.mcp.servers["time"], config.mcp.servers["tickets"]
    assert (time.transport, time.args, time.timeout_seconds) == (
        "stdio",
        ["--local-timezone", "Europe/Berlin"],
        60,
    )
    assert (tickets.transport, tickets.timeout_seconds) == ("http", 5)
    assert tickets.offers("create_ticket") and not tickets.offers("delete_ticket")
    assert tickets.needs_approval("create_ticket") and not tickets.needs_approval("search_tickets")
    assert "env-SECRET1" not in repr(config) and "hdr-SECRET2" not in repr(config)
    assert (config.mcp.approval_timeout_seconds, config.mcp.max_result_chars) == (300, 16000)


def test_without_a_tools_key_an_agent_gets_every_builtin_and_every_mcp_tool(
    tmp_path: Path,
) -> None:
    agent = load(tmp_path, STDIO).agent
    assert agent.builtin_tools == TOOL_NAMES
    assert agent.mcp_selection == ALL_MCP


def test_tools_select_builtins_servers_and_single_tools(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        STDIO + "agent:\n  tools: [memory_save, mcp:time, mcp:tickets__create_ticket]\n",
    )
    assert config.agent.builtin_tools == ("memory_save",)
    selection = config.agent.mcp_selection
    assert selection == McpSelection(
        servers=frozenset({"time"}), tools=frozenset({"tickets__create_ticket"})
    )
    assert selection.takes("time", "time__get_current_time")
    assert not selection.takes("tickets", "tickets__search_tickets")


def test_an_empty_tools_list_is_no_tool_at_all(tmp_path: Path) -> None:
    agent = load(tmp_path, STDIO + "agent:\n  tools: []\n").agent
    assert agent.builtin_tools == () and agent.mcp_selection.empty


def test_only_mcp_tools_leave_no_builtin(tmp_path: Path) -> None:
    agent = load(tmp_path, STDIO + "agent:\n  tools: [mcp:time]\n").agent
    assert agent.builtin_tools == () and not agent.mcp_selection.empty


def test_an_unconfigured_server_names_the_agents_key_path(tmp_path: Path) -> None:
    text = STDIO + "agents:\n  ops:\n    tools: [memory_save, session_search, mcp:nope]\n"
    assert problems(tmp_path, text) == [
        "agents.ops.tools.2: 'mcp:nope' names no server of mcp.servers (configured: tickets, time)"
    ]


def test_the_main_agent_key_path_is_agent(tmp_path: Path) -> None:
    found = problems(tmp_path, "agent:\n  tools: [mcp:time__now]\n")
    assert found == [
        "agent.tools.0: 'mcp:time__now' names no server of mcp.servers (configured: none)"
    ]


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("mcp:", "write mcp:<server>"),
        ("mcp:a b", "write mcp:<server>"),
        ("mcp:x__" + "t" * 70, "1-64"),
    ],
)
def test_malformed_mcp_entries_are_refused(tmp_path: Path, entry: str, why: str) -> None:
    (line,) = problems(tmp_path, f'agent:\n  tools: ["{entry}"]\n')
    assert line.startswith("agent.tools: ") and why in line


@pytest.mark.parametrize("name", ["a__b", "has space", "x" * 33, "dot.ted"])
def test_bad_server_names_are_refused_by_key_path(tmp_path: Path, name: str) -> None:
    (line,) = problems(tmp_path, f'mcp:\n  servers:\n    "{name}":\n      command: x\n')
    assert line.startswith(f"mcp.servers.{name}: not a valid server name")


@pytest.mark.parametrize(
    ("server", "why"),
    [
        ("{}", "exactly one of command"),
        ("{command: x, url: 'http://h/mcp'}", "exactly one of command"),
        ("{url: 'ftp://h/mcp'}", "http:// or https://"),
        ("{url: 'http://h/mcp', env: {A: b}}", "args, env and cwd are for a command"),
        ("{command: x, headers: {A: b}}", "headers are for a url"),
        ("{command: x, tools: {include: [a], exclude: [b]}}", "exactly one of include or exclude"),
        ("{command: x, timeout_seconds: 0}", "greater than 0"),
    ],
)
def test_server_problems_name_the_server(tmp_path: Path, server: str, why: str) -> None:
    found = problems(tmp_path, f"mcp:\n  servers:\n    s1: {server}\n")
    assert len(found) == 1 and found[0].startswith("mcp.servers.s1") and why in found[0], found


def test_check_config_exits_78_naming_the_key_without_the_secret(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text(
        "mcp:\n  servers:\n    t:\n      url: https://h/mcp\n"
        "      headers: {Authorization: 'Bearer hdr-SECRET3'}\n      timeout_seconds: -1\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config"],
        env={"HERMES_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 78, result.stderr
    assert "mcp.servers.t.timeout_seconds" in result.stderr
    assert "SECRET3" not in result.stderr + result.stdout
