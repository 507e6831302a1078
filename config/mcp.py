"""The agent's MCP tool servers (`mcp:`): how each is reached (a child process over
stdio, or a streamable-HTTP URL), which of its tools are offered, which need the user's
yes and which are safe to run again, and the per-call limits. Also the grammar of an
agent's MCP tool selection (`agent.tools: [mcp:<server>, mcp:<server>__<tool>]`).

`env` and `headers` carry secrets (tokens): they are kept out of reprs, and errors name
their key paths, never their values."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from config.base import MODEL_CONFIG

# A server's name is the first half of the tool names the model sees ("<server>__<tool>"),
# so it may hold no "__" and only what the OpenAI API accepts in a function name.
SERVER_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")  # fullmatch it
# What the OpenAI API accepts as a function name: the qualified tool name must match.
QUALIFIED_TOOL_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch it
SEPARATOR = "__"  # between the server's name and the tool's
SELECTION_PREFIX = "mcp:"  # an `agent.tools` entry naming MCP tools


def server_name_problem(name: str) -> str | None:
    """Why `name` cannot name an MCP server (None: it can)."""
    if not SERVER_NAME_PATTERN.fullmatch(name) or SEPARATOR in name:
        return (
            "not a valid server name: use 1-32 of A-Z, a-z, 0-9, '-' and '_', without '__'"
            " (it becomes the first part of each tool's name, <server>__<tool>)"
        )
    return None


class McpToolFilter(BaseModel):
    """Which of a server's tools are offered: only those in `include`, or all but those in
    `exclude` (one of the two)."""

    model_config = MODEL_CONFIG

    include: list[str] | None = None
    exclude: list[str] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> McpToolFilter:
        if (self.include is None) == (self.exclude is None):
            raise ValueError("give exactly one of include or exclude (a list of tool names)")
        return self

    def offers(self, tool: str) -> bool:
        if self.include is not None:
            return tool in self.include
        return tool not in (self.exclude or ())


class McpServerConfig(BaseModel):
    """One MCP server: `command` (+ `args`, `env`, `cwd`), a child process spoken to over
    stdio, or `url` (+ `headers`), a streamable-HTTP endpoint. Times are in seconds."""

    model_config = MODEL_CONFIG

    command: str | None = None
    args: list[str] = Field(default_factory=list)
    # Added to the child's environment (the SDK passes a safe subset of ours besides).
    env: dict[str, str] = Field(default_factory=dict, repr=False)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    tools: McpToolFilter | None = None  # None: every tool the server lists
    # The user must /approve each call: true for every tool, or a list of tool names.
    approve: bool | list[str] = False
    # Tools safe to run again when a crash interrupted a call (reads, lookups).
    read_only: list[str] = Field(default_factory=list)
    timeout_seconds: float = Field(default=60.0, gt=0, le=86_400)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"https?://[^/\s]+", value):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("command")
    @classmethod
    def _command_given(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must name a program")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (a stdio server) or url (HTTP)")
        if self.url is not None and (self.args or self.env or self.cwd is not None):
            raise ValueError("args, env and cwd are for a command; this server has a url")
        if self.command is not None and self.headers:
            raise ValueError("headers are for a url; this server has a command")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def offers(self, tool: str) -> bool:
        """Is the server's tool `tool` offered to the model (`tools:`)?"""
        return self.tools is None or self.tools.offers(tool)

    def needs_approval(self, tool: str) -> bool:
        return self.approve is True or (isinstance(self.approve, list) and tool in self.approve)


class McpConfig(BaseModel):
    """The MCP tool servers by name, and the limits every MCP call shares."""

    model_config = MODEL_CONFIG

    servers: dict[str, McpServerConfig] = Field(default_factory=dict)
    # How long a turn waits for the user's /approve or /deny.
    approval_timeout_seconds: float = Field(default=300.0, gt=0, le=86_400)
    # A tool result longer than this is cut, with a marker saying so.
    max_result_chars: int = Field(default=16_000, ge=100, le=1_000_000)

    def problems(self) -> list[str]:
        """Checks the field validators cannot place at their key path (the server names
        are dict keys): one `mcp.servers.<name>: ...` line each."""
        return [
            f"mcp.servers.{name}: {problem}"
            for name in self.servers
            if (problem := server_name_problem(name)) is not None
        ]


# --- an agent's selection of MCP tools ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class McpSelection:
    """The MCP tools an agent is given: every configured one (`everything`), or those of
    whole servers (`servers`) and single tools (`tools`, qualified "<server>__<tool>")."""

    everything: bool = False
    servers: frozenset[str] = frozenset()
    tools: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.everything or self.servers or self.tools)

    def takes(self, server: str, qualified: str) -> bool:
        return self.everything or server in self.servers or qualified in self.tools


ALL_MCP = McpSelection(everything=True)
NO_MCP = McpSelection()


def parse_selection_entry(entry: str) -> tuple[str, str | None]:
    """`mcp:<server>` -> (server, None); `mcp:<server>__<tool>` -> (server, tool). Raises
    ValueError saying what is wrong."""
    body = entry.removeprefix(SELECTION_PREFIX)
    server, sep, tool = body.partition(SEPARATOR)
    if server_name_problem(server) is not None:
        raise ValueError(f"{entry!r}: write mcp:<server> or mcp:<server>__<tool>")
    if sep and not QUALIFIED_TOOL_PATTERN.fullmatch(body):
        raise ValueError(
            f"{entry!r}: the tool name must be 1-64 characters of A-Z, a-z, 0-9, '-' and"
            " '_' with its server's name"
        )
    return server, (tool if sep else None)


def selection_of(entries: Any) -> McpSelection:
    """The McpSelection of `agent.tools` (None: everything), its `mcp:` entries only."""
    if entries is None:
        return ALL_MCP
    servers, tools = set(), set()
    for entry in entries:
        if not entry.startswith(SELECTION_PREFIX):
            continue
        server, tool = parse_selection_entry(entry)
        if tool is None:
            servers.add(server)
        else:
            tools.add(f"{server}{SEPARATOR}{tool}")
    return McpSelection(servers=frozenset(servers), tools=frozenset(tools))
