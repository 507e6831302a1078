"""discord.py's connection as the adapter keeps it alive: one unreadable gateway event
skipped instead of ending the connection, the close codes that retrying cannot cure, and
why a connection loop ended (for health and the log)."""

from __future__ import annotations

import asyncio
from typing import Any

import discord

from adapters.base import AdapterLog

#: gateway close codes discord.py does not retry, and what the operator can do about them
FATAL_CLOSE = {
    4004: "Discord rejected the bot token; check platforms.discord.token",
    4013: "the gateway refused the intents this adapter asks for",
    4014: (
        "the MESSAGE CONTENT intent is not enabled for this bot; turn it on in the "
        "Developer Portal (Bot -> Privileged Gateway Intents)"
    ),
}


def guard_parsers(client: discord.Client, log: AdapterLog) -> None:
    """Make one unreadable gateway event cost only itself.

    discord.py calls its event parsers (`ConnectionState.parsers`, the dict its websocket
    dispatches through) without a guard, so a payload it cannot read ends the whole
    connection loop. Each parser is wrapped to log and skip such an event instead.
    """
    parsers = client._connection.parsers

    def guarded(name: str, parse: Any) -> Any:
        def parse_or_skip(data: Any) -> None:
            try:
                parse(data)
            except Exception as exc:
                log.warning("discord_event_skipped", gateway_event=name, error=repr(exc))

        return parse_or_skip

    for name, parse in list(parsers.items()):
        parsers[name] = guarded(name, parse)


def refusal(exc: BaseException | None) -> str | None:
    """What to fix, when the gateway closed for a reason retrying cannot cure."""
    if isinstance(exc, discord.PrivilegedIntentsRequired):
        return FATAL_CLOSE[4014]
    return FATAL_CLOSE.get(getattr(exc, "code", None))


def describe_ending(task: asyncio.Task[None]) -> str:
    """Why discord.py's connection loop ended, for health and the log."""
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    if exc is None:
        return "the connection closed"
    refused = refusal(exc)
    if refused is not None:
        return refused
    text = f"{type(exc).__name__}: {exc}"
    # discord.py 2.7 cannot retry a first connection that failed: it trips over its missing
    # websocket (AttributeError) while handling the real error, so name that one too.
    context = exc.__cause__ or exc.__context__
    return f"{text} (while handling {type(context).__name__}: {context})" if context else text
