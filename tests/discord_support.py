"""What the tests that run the real discord.py adapter share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from discord.gateway import DiscordWebSocket
from discord.http import Route


@pytest.fixture(autouse=True)
def restore_discord_globals() -> Iterator[None]:
    """The adapter points discord.py's process-wide URLs at the fake; put them back.
    Autouse in every module that imports it."""
    base, gateway = Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY
    yield
    Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY = base, gateway
