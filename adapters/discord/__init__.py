"""Discord through discord.py 2 (see `adapters.discord.adapter` for the flow): the adapter,
and what keeps discord.py's connection alive (`adapters.discord.connection`)."""

from adapters.discord.adapter import DiscordAdapter

__all__ = ["DiscordAdapter"]
