"""The tool commands: /tools (the agent's tools and the tool servers' states), /approve
and /deny (the answer to a tool call waiting for the user's yes, `approvals`).

They answer inline, on the intake path: a call waits inside its running turn, so the
answer must not queue behind that turn.
"""

from __future__ import annotations

from typing import Any

from gateway.domain.command_syntax import Command
from gateway.domain.events import MessageEvent
from gateway.domain.session import agent_id_of_key
from gateway.runner.ports import CommandContext
from gateway.tools.approval import Verdict

NOTHING_WAITS = "Nothing is waiting for approval."


async def cmd_approve(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    return _answer(ctx, event, key, Verdict.APPROVED)


async def cmd_deny(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    return _answer(ctx, event, key, Verdict.DENIED)


def _answer(ctx: CommandContext, event: MessageEvent, key: str, verdict: Verdict) -> str:
    request = ctx.approvals.waiting(key)
    if request is None:
        return NOTHING_WAITS
    asker = request.source
    own = asker is not None and asker.user_id is not None and asker.user_id == event.source.user_id
    if not own and not ctx.is_admin(event.source):
        who = (asker.user_name or asker.user_id) if asker is not None else None
        return (
            f"Only {who or 'the user whose message started this turn'} or an admin can"
            f" answer for {request.tool}; nothing changed."
        )
    if not ctx.approvals.answer(key, verdict):  # the wait ended meanwhile
        return NOTHING_WAITS
    if verdict is Verdict.APPROVED:
        return f"Approved: {request.tool} runs now."
    return f"Denied: {request.tool} does not run."


async def cmd_tools(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    agent_id = agent_id_of_key(key)
    toolbox = ctx.toolbox_for(agent_id)
    if toolbox is None or not toolbox.tools:
        lines = [f"Agent {agent_id} has no tools."]
    else:
        lines = [f"Tools of agent {agent_id} ({len(toolbox.tools)}):"]
        lines += [
            f"{name} (asks /approve first)" if tool.approve else name
            for name, tool in toolbox.tools.items()
        ]
    servers = ctx.tool_servers()
    if servers:
        lines.append("Tool servers:")
        lines += [_server_line(name, state) for name, state in sorted(servers.items())]
    return "\n".join(lines)


def _server_line(name: str, state: dict[str, Any]) -> str:
    line = f"{name}: {state.get('state', 'unknown')}, {state.get('tools', 0)} tools"
    error = state.get("last_error")
    return f"{line} (last error: {error})" if error and state.get("state") != "up" else line
