"""A remote agent's answer is bounded as it is read: a remote that answers with more
than `MAX_ANSWER_BYTES` (streamed without a length, or declaring one) is a RemoteError
naming the size, which `agent_call` gives the model as a tool error, and a card too
large is refused the same way. The remote is a raw aiohttp server on 127.0.0.1 serving a
real 1.0 card (made with the SDK's types) and a body past the bound."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from config import RemoteAgentConfig
from gateway.a2a import client as remote_client
from gateway.a2a.client import RemoteAgents, RemoteError

pytestmark = pytest.mark.timeout(30)

LIMIT = 64 * 1024  # the bound under test, lowered so the test moves little data


def card(url: str) -> dict:
    return {
        "name": "big",
        "description": "answers too much",
        "version": "1.0.0",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "capabilities": {"streaming": False},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{"id": "s", "name": "s", "description": "s", "tags": ["t"]}],
    }


@pytest.fixture
async def remote(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, str]]:
    """URLs of three agents on one server: `streamed` answers a call with a body past
    the bound and no length, `declared` with a Content-Length past it, `fat` has a
    card past it."""
    monkeypatch.setattr(remote_client, "MAX_ANSWER_BYTES", LIMIT)
    base = {}

    async def get_card(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = card(f"{base['url']}/{name}")
        if name == "fat":
            body["description"] = "x" * (LIMIT + 1)
        return web.json_response(body)

    async def post(request: web.Request) -> web.StreamResponse:
        await request.read()
        filler = b" " * 8192
        if request.match_info["name"] == "declared":
            return web.Response(body=filler * (LIMIT // len(filler) + 2))
        response = web.StreamResponse()
        response.content_type = "application/json"
        await response.prepare(request)
        await response.write(b'{"jsonrpc": "2.0", "id": 1, "result": ')
        for _ in range(LIMIT // len(filler) + 2):
            await response.write(filler)
        await response.write(json.dumps({}).encode() + b"}")
        return response

    app = web.Application()
    app.add_routes(
        [web.get("/{name}/.well-known/agent-card.json", get_card), web.post("/{name}", post)]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield {name: f"{base['url']}/{name}" for name in ("streamed", "declared", "fat")}
    await runner.cleanup()


@pytest.mark.parametrize("name", ["streamed", "declared"])
async def test_an_answer_past_the_bound_is_a_remote_error(
    remote: dict[str, str], name: str
) -> None:
    agents = RemoteAgents({name: RemoteAgentConfig(url=remote[name], timeout_seconds=10)})
    try:
        with pytest.raises(RemoteError) as caught:
            await agents.send(name, "hello", message_id="m1", context_id=None)
    finally:
        await agents.close()
    assert f"over {LIMIT} bytes" in str(caught.value)


async def test_a_card_past_the_bound_is_not_read(remote: dict[str, str]) -> None:
    agents = RemoteAgents({"fat": RemoteAgentConfig(url=remote["fat"], timeout_seconds=10)})
    try:
        with pytest.raises(RemoteError) as caught:
            await agents.card("fat")
    finally:
        await agents.close()
    assert caught.value.kind == "unreachable"
    assert f"over {LIMIT} bytes" in str(caught.value)
