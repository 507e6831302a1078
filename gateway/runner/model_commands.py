"""`/model`: which of its agent's catalogue models a chat talks to (config.models).

`/model` lists the agent's choices with the chat's current one marked; `/model NAME`
switches the chat to NAME; `/model default` returns to the agent's own. The choice is
stored by session key (`gateway.store.chat_models`), so it outlives the chat's sessions
(/new keeps it), a restart and a replica takeover; `load_choice` reads it before each
turn of an agent that offers a choice.
"""

from __future__ import annotations

import time

from config import DEFAULT_CHOICE
from gateway.agents.roster import Roster
from gateway.domain.command_syntax import Command
from gateway.domain.events import MessageEvent
from gateway.domain.session import agent_id_of_key
from gateway.runner.ports import CommandContext
from gateway.store import chat_models
from gateway.store.session_store import SessionStore

MAX_NAME = 64  # a catalogue name's longest (config.models.MODEL_NAME_PATTERN)


async def load_choice(store: SessionStore, roster: Roster, key: str) -> None:
    """The chat's stored choice into the roster, so `for_key` gives its model (a read
    only for agents that offer a choice)."""
    if roster.offers_choice(key):
        roster.choose(key, await store.read(lambda conn: chat_models.load(conn, key)))


async def cmd_model(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    roster = ctx.roster
    agent_id = agent_id_of_key(key)
    choices = roster.choices(agent_id)
    await load_choice(ctx.store, roster, key)
    current = roster.for_key(key).model
    if not cmd.args:
        return _listing(choices, current.name, current.model)
    asked = cmd.args.split()[0][: MAX_NAME + 1]
    if asked.lower() == DEFAULT_CHOICE:
        name = None
    elif asked in choices:
        name = asked
    else:
        return f"No model {asked!r} for this chat. {_listing(choices, current.name, current.model)}"
    if ctx.is_busy(key):
        return "A turn is running; wait for it or /stop it first, then /model."
    now = time.time()
    await ctx.store.write(lambda conn: chat_models.save(conn, key, name, now), dirty=False)
    roster.choose(key, name)
    spec = roster.for_key(key)
    await ctx.agents.evict(key)  # the next turn builds the chosen model's agent
    shown = spec.model.name or spec.model.model
    if name is None:
        return f"Back to this agent's own model: {shown}."
    return f"This chat now talks to {shown} (context window {spec.model.context_window:,} tokens)."


def _listing(choices: tuple[str, ...], current: str | None, plain: str) -> str:
    if not choices:
        return f"This chat uses {current or plain}; this agent offers no other model."
    lines = ["Models (/model NAME to switch, /model default for the agent's own):"]
    lines += [f"{'* ' if name == current else '  '}{name}" for name in choices]
    if current is None or current not in choices:
        lines.append(f"* {current or plain} (the agent's own)")
    return "\n".join(lines)
