"""`hermes-gateway agents list`: the configured agents (id, description, backend, the
agents each may delegate to) and the remote A2A agents, each with whether its agent card
resolves now (read within bounded time, all at once; the token is sent, never shown).
docs/cli.md describes it."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from config import GatewayConfig

#: one remote's card, at most (its own timeout_seconds when that is shorter)
CARD_SECONDS = 10.0


def add_agents_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    agents = sub.add_parser("agents", parents=parents, help="the agents and remote agents")
    agents_sub = agents.add_subparsers(dest="agents_command", required=True)
    listing = agents_sub.add_parser(
        "list", parents=parents, help="every agent, its delegates, and the remote agents"
    )
    listing.add_argument("--json", action="store_true")
    listing.add_argument(
        "--no-check", action="store_true", help="do not read the remote agents' cards"
    )


async def agents_report(config: GatewayConfig, *, check: bool = True) -> dict[str, Any]:
    """{agents: [...], remote_agents: [...]}: what `agents list` prints."""
    agents = [
        {
            "id": agent_id,
            "description": agent.description,
            "backend": agent.backend,
            "delegates": list(agent.delegates),
        }
        for agent_id, agent in config.agent_configs().items()
    ]
    remotes: list[dict[str, Any]] = [
        {"name": name, "url": remote.url, "description": remote.description}
        for name, remote in sorted(config.remote_agents.items())
    ]
    if check and remotes:
        from gateway.a2a.client import RemoteAgents

        client = RemoteAgents(config.remote_agents, card_timeout=CARD_SECONDS)
        try:
            found = await asyncio.gather(*(_card(client, r["name"]) for r in remotes))
        finally:
            await client.close()
        for remote, card in zip(remotes, found, strict=True):
            remote.update(card)
    return {"agents": agents, "remote_agents": remotes}


async def _card(client: Any, name: str) -> dict[str, Any]:
    from gateway.a2a.client import RemoteError

    try:
        card = await client.card(name)
    except RemoteError as exc:
        return {"card": None, "reachable": False, "error": str(exc)}
    versions = sorted({i.protocol_version for i in card.supported_interfaces if i.protocol_version})
    return {
        "reachable": True,
        "error": None,
        "card": {
            "name": card.name,
            "description": card.description,
            "protocol_versions": versions,
            "skills": [skill.name or skill.id for skill in card.skills],
        },
    }


def render(report: dict[str, Any]) -> str:
    lines = ["agents:"]
    for agent in report["agents"]:
        delegates = ", ".join(agent["delegates"]) or "-"
        lines.append(f"  {agent['id']}  ({agent['backend']})  delegates: {delegates}")
        if agent["description"]:
            lines.append(f"      {agent['description']}")
    lines.append("remote agents:" if report["remote_agents"] else "remote agents: none")
    for remote in report["remote_agents"]:
        if "reachable" not in remote:
            state = "not checked"
        elif remote["reachable"]:
            versions = ", ".join(remote["card"]["protocol_versions"]) or "?"
            state = f"card resolves (A2A {versions})"
        else:
            state = f"card does not resolve: {remote['error']}"
        lines.append(f"  {remote['name']}  {remote['url']}  {state}")
        card = remote.get("card")
        description = (card or {}).get("description") or remote["description"]
        if description:
            lines.append(f"      {description}")
    return "\n".join(lines)


async def run_agents_command(config: GatewayConfig, args: argparse.Namespace) -> int:
    report = await agents_report(config, check=not args.no_check)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def cmd_agents(args: argparse.Namespace, config: GatewayConfig) -> int:
    """`hermes-gateway agents ...`, as the CLI's handler."""
    return asyncio.run(run_agents_command(config, args))
