"""The A2A server's routes on the HTTP API's app (docs/a2a.md): every configured agent at
`/a2a/<agent>`, its card beside it, and the main agent's card at the gateway's root.

    GET  /.well-known/agent-card.json                the main agent's card (public)
    GET  /a2a/{agent}/.well-known/agent-card.json    an agent's card (public)
    POST /a2a/{agent}                                JSON-RPC, protocol 1.0 and 0.3

The HTTP API's token middleware covers the JSON-RPC endpoints; the cards are public, so
a caller can learn that a token is needed. A request that passed the middleware with
the token is the caller "bearer", else "anonymous": tasks are listed per caller.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from aiohttp import web

from config import MAIN_AGENT, GatewayConfig
from gateway.a2a.card import build_card, card_json
from gateway.a2a.handler import TaskHandler
from gateway.a2a.jsonrpc import JsonRpcEndpoint
from gateway.a2a.route_docs import a2a_route_docs
from gateway.domain.agent_tasks import AgentTasks
from gateway.util.route_doc import RouteDoc

__all__ = ["CARD_PATH", "A2aServer", "base_url"]

CARD_PATH = "/.well-known/agent-card.json"
MAX_CARDS = 64  # cards kept built, per agent and address
# A Host header as a card may repeat it: a name or address and a port, nothing else.
_HOST = re.compile(r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?")
WAIT_MARGIN_SECONDS = 30.0  # a blocking send outwaits the turn's own deadline by this


class A2aServer:
    """Build it, hand `routes()`, `public_paths()` and `route_docs()` to the HTTP
    adapter's `mount`, and `close()` it when the app shuts down (ends open streams,
    answers waiting sends)."""

    def __init__(self, config: GatewayConfig, tasks: AgentTasks) -> None:
        self.config = config
        caller = "bearer" if config.platforms.http.token else "anonymous"
        self.endpoints = {
            agent_id: JsonRpcEndpoint(
                TaskHandler(
                    tasks, agent_id, wait_seconds=agent.gateway_timeout + WAIT_MARGIN_SECONDS
                ),
                max_body_bytes=config.platforms.http.max_body_bytes,
                caller=lambda request: caller,
            )
            for agent_id, agent in config.agent_configs().items()
        }
        self._cards: dict[tuple[str, str], tuple[bytes, str]] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(CARD_PATH, self._main_card),
            web.get("/a2a/{agent}" + CARD_PATH, self._agent_card),
            web.post("/a2a/{agent}", self._post),
        ]

    @staticmethod
    def route_docs() -> list[RouteDoc]:
        """`routes()` as /openapi.json describes them (loosely: JSON-RPC objects)."""
        return a2a_route_docs(CARD_PATH)

    @staticmethod
    def public_paths() -> frozenset[str]:
        """The routes that need no token (matched as aiohttp's canonical paths)."""
        return frozenset({CARD_PATH, "/a2a/{agent}" + CARD_PATH})

    async def close(self, app: web.Application | None = None) -> None:
        for endpoint in self.endpoints.values():
            endpoint.close()

    def _endpoint(self, request: web.Request) -> tuple[str, JsonRpcEndpoint]:
        agent_id = request.match_info["agent"]
        endpoint = self.endpoints.get(agent_id)
        if endpoint is None:
            raise web.HTTPNotFound(reason=f"no agent {agent_id[:64]!r} here")
        return agent_id, endpoint

    async def _post(self, request: web.Request) -> web.StreamResponse:
        _, endpoint = self._endpoint(request)
        return await endpoint.handle(request)

    async def _main_card(self, request: web.Request) -> web.StreamResponse:
        return self._card(request, MAIN_AGENT)

    async def _agent_card(self, request: web.Request) -> web.StreamResponse:
        agent_id, _ = self._endpoint(request)
        return self._card(request, agent_id)

    def _card(self, request: web.Request, agent_id: str) -> web.StreamResponse:
        body, etag = self._card_body(agent_id, base_url(self.config, request))
        if etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(body=body, content_type="application/json", headers={"ETag": etag})

    def _card_body(self, agent_id: str, address: str) -> tuple[bytes, str]:
        """The card's JSON and its ETag, built once per agent and address."""
        key = (agent_id, address)
        cached = self._cards.get(key)
        if cached is None:
            if len(self._cards) >= MAX_CARDS:  # addresses callers name: bounded
                self._cards.clear()
            card: dict[str, Any] = card_json(build_card(self.config, agent_id, address))
            body = json.dumps(card, ensure_ascii=False).encode()
            cached = (body, f'W/"{hashlib.sha256(body).hexdigest()[:32]}"')
            self._cards[key] = cached
        return cached


def base_url(config: GatewayConfig, request: web.Request) -> str:
    """Where callers reach this gateway: `a2a.public_url`, else the address this request
    came to (its Host header: right behind a wildcard bind, where the HTTP API's own
    address would say 0.0.0.0), else the socket's own address."""
    if config.a2a.public_url:
        return config.a2a.public_url
    host = request.headers.get("Host", "")
    if not _HOST.fullmatch(host):
        address = request.transport.get_extra_info("sockname") if request.transport else None
        if not address:
            return ""
        host = f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"
    return f"{request.scheme}://{host}"
