"""The client side of the MCP conformance suite (npm `@modelcontextprotocol/conformance`,
client scenarios): the gateway's MCP hub connects to the URL the suite appends, lists
the server's tools and calls each once, then stops.

    conformance client --command "python scripts/mcp_conformance_client.py" \\
        --scenario tools_call
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from config.mcp import ALL_MCP, McpConfig
from gateway.mcp import McpHub

# Arguments for the scenarios' tools (the others take none).
ARGUMENTS = {"add_numbers": {"a": 2, "b": 3}}


async def run(url: str) -> int:
    with tempfile.TemporaryDirectory() as home:
        config = McpConfig.model_validate({"servers": {"suite": {"url": url}}}, strict=False)
        hub = McpHub(config, Path(home))
        await hub.start()
        try:
            state = hub.health()["suite"]
            print("state", state, flush=True)
            for tool in hub.tools(ALL_MCP):
                result = await hub.call(tool.qualified, ARGUMENTS.get(tool.name, {}))
                print(tool.qualified, result.is_error, result.text[:200], flush=True)
        finally:
            await hub.stop()
    return 0 if state["state"] == "up" else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(run(sys.argv[-1])))
