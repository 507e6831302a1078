"""The doctor's look at the MCP tool servers: each configured server connected once,
its tools listed, then stopped. The hub runs on a home of its own (a temporary one), so
a running daemon's stdio children, recorded in the real home, are never touched."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from config import GatewayConfig
from gateway.mcp import McpHub
from gateway.ops.doctor.findings import ERROR, OK, Finding


def check_mcp(config: GatewayConfig) -> list[Finding]:
    """One finding per server: up with its tool count, or why it could not connect (the
    hub's error: no env or header value in it)."""
    if not config.mcp.servers:
        return []
    with tempfile.TemporaryDirectory(prefix="hermes-doctor-mcp-") as home:
        health = asyncio.run(_connect_once(config, Path(home)))
    findings = []
    for name, server in health.items():
        if server["state"] == "up":
            findings.append(Finding(f"mcp server {name}", OK, f"up, {server['tools']} tools"))
        else:
            reason = server.get("last_error") or "did not connect within the start-up wait"
            findings.append(Finding(f"mcp server {name}", ERROR, f"{server['state']}: {reason}"))
    return findings


async def _connect_once(config: GatewayConfig, home: Path) -> dict[str, dict]:
    hub = McpHub(config.mcp, home)
    await hub.start()
    try:
        return hub.health()
    finally:
        await hub.stop()
