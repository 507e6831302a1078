"""The MCP hub (`McpHub`, one per daemon): every configured tool server supervised by
its own `ServerLink`, the tools an agent's selection is offered, the calls routed to
their server, and each server's health. One server's failure never touches another's."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from config.mcp import SEPARATOR, McpConfig, McpSelection
from gateway.mcp.children import ChildBook
from gateway.mcp.results import McpResult, error_result
from gateway.mcp.tool import McpTool

if TYPE_CHECKING:
    from gateway.mcp.link import ServerLink

log = structlog.get_logger("gateway.mcp")

# start() returns once every server made its first connect attempt, or after this long
# (a slow server keeps connecting in the background; its state says `starting`).
START_WAIT_SECONDS = 5.0
# stop() lets the links end their sessions (and children) this long before cancelling.
STOP_WAIT_SECONDS = 10.0


class McpHub:
    """Every MCP server of `mcp.servers`, connected and kept connected."""

    def __init__(self, config: McpConfig, home: Path) -> None:
        self.config = config
        self.version = 0  # bumps when any server's tool list changes
        self._book = ChildBook(home)
        self._links: dict[str, ServerLink] = {}
        if config.servers:
            # The SDK (a few hundred modules) loads only for a daemon that has servers.
            from gateway.mcp.link import ServerLink

            self._links = {
                name: ServerLink(name, server, self._book, config.max_result_chars, self._bump)
                for name, server in config.servers.items()
            }
        self._tasks: list[asyncio.Task[None]] = []

    def _bump(self) -> None:
        self.version += 1

    async def start(self) -> None:
        """End what a killed run left behind, then start one supervisor per server."""
        await self._book.end_leftovers()
        for name, link in self._links.items():
            self._tasks.append(asyncio.create_task(link.run(), name=f"mcp-{name}"))
        if self._links:
            links = self._links.values()
            waits = [asyncio.create_task(link.first_attempt.wait()) for link in links]
            _, pending = await asyncio.wait(waits, timeout=START_WAIT_SECONDS)
            for wait in pending:
                wait.cancel()

    async def stop(self) -> None:
        """End every session and child process."""
        for link in self._links.values():
            link.stop()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=STOP_WAIT_SECONDS)
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._tasks.clear()
        # Whatever a cancelled link could not stop itself.
        await self._book.end_leftovers()

    def tools(self, selection: McpSelection) -> list[McpTool]:
        """The tools `selection` takes, every server's (a down server's last known list)."""
        if selection.empty:
            return []
        return [
            tool
            for name, link in self._links.items()
            for tool in link.tools.values()
            if selection.takes(name, tool.qualified)
        ]

    def tool(self, qualified: str) -> McpTool | None:
        server, _, name = qualified.partition(SEPARATOR)
        link = self._links.get(server)
        return link.tools.get(name) if link is not None else None

    async def call(self, qualified: str, arguments: dict[str, Any]) -> McpResult:
        """Run the tool `qualified` ("<server>__<tool>") on its server."""
        server, _, name = qualified.partition(SEPARATOR)
        link = self._links.get(server)
        if link is None or not name:
            return error_result(f"no MCP tool named {qualified!r}")
        if name not in link.tools and link.state == "up":
            return error_result(f"tool server {server} offers no tool {name!r}")
        return await link.call(name, arguments)

    def health(self) -> dict[str, dict[str, Any]]:
        """{server: {state, tools, last_error}}; the error carries no secret."""
        return {
            name: {"state": link.state, "tools": len(link.tools), "last_error": link.last_error}
            for name, link in self._links.items()
        }
