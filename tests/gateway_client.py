"""A small test client for the gateway's HTTP API (used by the end-to-end tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from gateway.run import GatewayRunner


class GatewayClient:
    """POSTs messages and long-polls replies per chat, remembering each chat's cursor."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(headers=self.headers)
        self.cursors: dict[str, int] = {}

    async def close(self) -> None:
        await self.session.close()

    async def post(self, chat_id: str, text: str, user_id: str = "u1", **extra: Any) -> dict:
        body = {"chat_id": chat_id, "user_id": user_id, "text": text, **extra}
        async with self.session.post(f"{self.url}/v1/messages", json=body) as resp:
            assert resp.status == 202, await resp.text()
            return await resp.json()

    async def poll(self, chat_id: str, wait: float = 0) -> list[dict]:
        after = self.cursors.get(chat_id, 0)
        async with self.session.get(
            f"{self.url}/v1/chats/{chat_id}/messages", params={"after": after, "wait": wait}
        ) as resp:
            assert resp.status == 200, await resp.text()
            data = await resp.json()
        self.cursors[chat_id] = data["next"]
        return data["messages"]

    async def replies(self, chat_id: str, count: int, within: float = 15.0) -> list[str]:
        """Wait for exactly `count` more replies in this chat (fails on timeout)."""
        texts: list[str] = []
        deadline = time.monotonic() + within
        while len(texts) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"expected {count} replies in {chat_id}, got {texts!r}")
            texts += [m["text"] for m in await self.poll(chat_id, wait=min(remaining, 5))]
        return texts

    async def replies_through_a_marker(
        self, chat_id: str, marker: str = "marker", within: float = 15.0
    ) -> list[str]:
        """Post `marker` to the chat; every reply from now up to the one that quotes it.

        A session's turns run in order, so a reply still owed to an earlier message in
        the chat arrives before the marker's: when none is owed, the list is the
        marker's reply alone. (The test agents' replies quote the message they answer.)"""
        await self.post(chat_id, marker)
        texts: list[str] = []
        deadline = time.monotonic() + within
        while not any(marker in text for text in texts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no reply to {marker!r} in {chat_id}, got {texts!r}")
            texts += [m["text"] for m in await self.poll(chat_id, wait=min(remaining, 5))]
        return texts

    async def get_json(self, path: str) -> dict:
        async with self.session.get(f"{self.url}{path}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def get_text(self, path: str) -> str:
        async with self.session.get(f"{self.url}{path}") as resp:
            assert resp.status == 200, await resp.text()
            return await resp.text()


@dataclass
class RunningGateway:
    """A runner started in the test's own loop, and a client of its HTTP adapter; test
    files subclass it with what they read back."""

    runner: GatewayRunner
    client: GatewayClient
    stopped: bool = field(default=False, kw_only=True)

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.client.close()
            await self.runner.stop()

    async def say(self, text: str, chat: str = "c1", user: str = "u1") -> str:
        """Post and wait for the one reply."""
        await self.client.post(chat, text, user_id=user)
        (reply,) = await self.client.replies(chat, 1)
        return reply

    @classmethod
    async def started(cls, settings: dict[str, Any], home: Path) -> RunningGateway:
        """A runner of `settings` (hermes.yaml as a dict; the HTTP adapter on a free port
        is added) started on `home`, with a client of its HTTP API."""
        from adapters.http import HttpAdapter
        from config import GatewayConfig
        from gateway.run import GatewayRunner

        http = {"platforms": {"http": {"enabled": True, "port": 0}}}
        config = GatewayConfig.model_validate({**http, **settings})
        adapter = HttpAdapter(config.platforms.http)
        runner = GatewayRunner(config, [adapter], home=home)
        await runner.start()
        return cls(runner, GatewayClient(adapter.url))
