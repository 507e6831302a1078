"""What the A2A server tests share (tests/test_a2a_server.py, tests/test_a2a_endpoint.py):
a runner in the test's loop with its HTTP API and the A2A routes the composition root
mounts (`gateway.cli.mount_apis`) over the runner's real task service and store, clients
of it made by the unmodified a2a-sdk, and a test agent.

The agent streams its reply word by word and says what it remembers of the session
(the user's previous message), so a context's second task shows the first one's."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.cli import check_runnable, mount_apis, mount_console
from gateway.run import GatewayRunner

TOKEN = "s3cret-a2a-token"
STEP = 0.002  # seconds between streamed words; "stream" in a text: STREAM_STEP
STREAM_STEP = 0.05  # the runner pushes a turn's text once a second: 2 s shows pieces


class MemoryAgent:
    """`echo: <text>`, plus `(after: <previous user message>)` when the session has one;
    streamed word by word. A text with "slowly" waits until cancelled (or 30 s)."""

    def __init__(self, session_key: str) -> None:
        self.session_key = session_key

    def _reply(self, request: TurnRequest) -> str:
        earlier = [m.get("content") for m in request.history if m.get("role") == "user"]
        reply = f"echo: {request.text}"
        return reply + (f" (after: {earlier[-1]})" if earlier else "")

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        return TurnResult(self._reply(request))

    async def stream_turn(self, request: TurnRequest, on_text: Callable[[str], None]) -> TurnResult:
        if "slowly" in request.text:
            await asyncio.sleep(30)
        words = self._reply(request).split(" ")
        step = STREAM_STEP if "stream" in request.text else STEP
        for count in range(1, len(words) + 1):
            await asyncio.sleep(step)
            on_text(" ".join(words[:count]))
        return TurnResult(" ".join(words))

    async def close(self) -> None:
        pass


class A2aGateway:
    """A runner with the HTTP API and the A2A routes, and SDK clients of it."""

    def __init__(self, runner: GatewayRunner, http: HttpAdapter, token: str | None) -> None:
        self.runner = runner
        self.http = http
        self.token = token
        self._closers: list[Any] = []

    @classmethod
    async def started(
        cls,
        home: Path,
        token: str | None = None,
        agent: dict[str, Any] | None = None,
        storage: dict[str, str] | None = None,
        agent_factory: Any = MemoryAgent,
        a2a: dict[str, Any] | None = None,
        console: bool = False,
    ) -> A2aGateway:
        http_settings: dict[str, Any] = {"enabled": True, "port": 0}
        if token:
            http_settings["token"] = token
        config = GatewayConfig.model_validate(
            {
                "platforms": {"http": http_settings},
                "a2a": {"enabled": True, **(a2a or {})},
                "agent": agent or {},
                "storage": storage or {},
                "agents": {
                    "helper": {"description": "Helps.", "skills": [{"id": "x", "name": "X"}]}
                },
            }
        )
        adapters = check_runnable(config)
        runner = GatewayRunner(config, adapters, agent_factory=agent_factory, home=home)
        mount_apis(config, runner.agent_tasks, adapters)
        if console:
            mount_console(config, runner, adapters)
        await runner.start()
        (http,) = (a for a in adapters if isinstance(a, HttpAdapter))
        return cls(runner, http, token)

    @property
    def url(self) -> str:
        return self.http.url

    def httpx(self, token: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        client = httpx.AsyncClient(headers=headers, timeout=30)
        self._closers.append(client.aclose)
        return client

    async def client(self, agent: str = "main", *, streaming: bool = True) -> Client:
        config = ClientConfig(streaming=streaming, httpx_client=self.httpx(self.token))
        client = await ClientFactory(config).create_from_url(f"{self.url}/a2a/{agent}")
        self._closers.append(client.close)
        return client

    async def rpc(self, body: Any, *, agent: str = "main", version: str = "1.0") -> Any:
        """One raw JSON-RPC POST (bytes or a JSON value); the decoded answer."""
        content = body if isinstance(body, bytes) else None
        headers = {"Content-Type": "application/json"}
        if version:
            headers["A2A-Version"] = version
        async with self.httpx(self.token) as client:
            response = await client.post(
                f"{self.url}/a2a/{agent}",
                content=content,
                json=None if content is not None else body,
                headers=headers,
            )
        assert response.status_code == 200, response.text
        return response.json()

    async def stop(self) -> None:
        await self.runner.stop()  # first: what its clients wait for is answered
        for close in reversed(self._closers):
            await close()


def message(text: str, *, context_id: str = "", message_id: str | None = None) -> pb.Message:
    return pb.Message(
        message_id=message_id or str(uuid.uuid4()),
        context_id=context_id,
        role=pb.ROLE_USER,
        parts=[pb.Part(text=text)],
    )


async def send(client: Client, msg: pb.Message, **config: Any) -> list[pb.StreamResponse]:
    request = pb.SendMessageRequest(message=msg)
    for key, value in config.items():
        setattr(request.configuration, key, value)
    return [event async for event in client.send_message(request)]


def message_json(text: str) -> dict[str, Any]:
    return {"messageId": str(uuid.uuid4()), "role": "ROLE_USER", "parts": [{"text": text}]}


def reply_of(task: pb.Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts)
