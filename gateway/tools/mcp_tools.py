"""MCP tools as the registry's `Tool`s: the tools an agent's selection takes from the
hub (`gateway.mcp`), named "<server>__<tool>" with the server's input schema, their
calls routed to the hub. The list follows the hub's (a server's `tools/list_changed`, a
reconnect); a down server's tools stay offered and answer at once that it is down.

A tool's answer is the text the model reads: the server's text as is, its structured
content as JSON, cut at `mcp.max_result_chars`. Images become a one-line note each: a
tool message carries text only.
"""

from __future__ import annotations

import json
from typing import Any

from config.mcp import McpSelection
from gateway.mcp import McpHub, McpResult, McpTool
from gateway.tools.registry import Tool, ToolText, TurnScope


class McpToolSource:
    """The hub's tools for one agent's selection (a `ToolSource`)."""

    def __init__(self, hub: McpHub, selection: McpSelection) -> None:
        self._hub = hub
        self._selection = selection

    @property
    def version(self) -> int:
        return self._hub.version

    def tools(self) -> list[Tool]:
        return [self._tool(offered) for offered in self._hub.tools(self._selection)]

    def _tool(self, offered: McpTool) -> Tool:
        hub, qualified = self._hub, offered.qualified

        async def run(scope: TurnScope, arguments: dict[str, Any]) -> ToolText:
            return ToolText(model_text(await hub.call(qualified, arguments)))

        return Tool(
            qualified,
            offered.description or f"{offered.name} (tool server {offered.server})",
            None,
            run,
            read_only=offered.read_only,
            approve=offered.approve,
            parameters=offered.input_schema,
        )


def model_text(result: McpResult) -> str:
    """What the model reads of one answer: an error as ``{"error": ...}`` (the hub's own
    already is), images as a note each."""
    text = result.text
    notes = [
        f"[the tool returned an image ({mime}, {len(data):,} bytes), not shown to the model]"
        for mime, data in result.images
    ]
    if notes:
        text = "\n".join([text, *notes]) if text else "\n".join(notes)
    if result.is_error and not _is_error_object(text):
        return json.dumps({"error": text or "the tool failed"}, ensure_ascii=False)
    return text


def _is_error_object(text: str) -> bool:
    try:
        decoded = json.loads(text)
    except ValueError:
        return False
    return isinstance(decoded, dict) and "error" in decoded
