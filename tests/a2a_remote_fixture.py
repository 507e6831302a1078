"""A remote A2A agent for the delegation tests, written with the a2a-sdk's own server
(Starlette routes, run by uvicorn in the test's event loop): it answers "echo: <text>"
with the number of messages its context has seen, so a test can tell a continued context
from a new one. `version="0.3"` serves a 0.3 agent card (url, protocolVersion,
preferredTransport) and the SDK's 0.3-compat JSON-RPC; "1.0" a 1.0 card.

It records what each request carried (the JSON-RPC method, the Authorization header, the
message's context id, message id and metadata) for the tests to check."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.waiting import wait_for


@dataclass
class Seen:
    methods: list[str] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    canceled: list[str] = field(default_factory=list)
    contexts: dict[str, int] = field(default_factory=dict)


class _Echo(AgentExecutor):
    def __init__(self, seen: Seen, delay: float) -> None:
        self.seen, self.delay = seen, delay

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id and context.context_id
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if context.current_task is None:
            await event_queue.enqueue_event(
                pb.Task(
                    id=context.task_id,
                    context_id=context.context_id,
                    status=pb.TaskStatus(state=pb.TASK_STATE_SUBMITTED),
                    history=[context.message] if context.message else [],
                )
            )
        await updater.start_work()
        message = context.message
        self.seen.messages.append(
            {
                "context_id": context.context_id,
                "message_id": message.message_id if message else None,
                "metadata": MessageToDict(message.metadata) if message else {},
            }
        )
        count = self.seen.contexts[context.context_id] = (
            self.seen.contexts.get(context.context_id, 0) + 1
        )
        if self.delay:
            await asyncio.sleep(self.delay)
        text = context.get_user_input()
        await updater.add_artifact([pb.Part(text=f"echo: {text} (message {count})")])
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id and context.context_id
        self.seen.canceled.append(context.task_id)
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteAgent:
    """`async with RemoteAgent(version="1.0") as agent:` serves at `agent.url`."""

    def __init__(
        self,
        *,
        version: str = "1.0",
        token: str | None = None,
        delay: float = 0.0,
        description: str = "Answers with an echo of the task",
    ) -> None:
        self.version, self.token, self.delay = version, token, delay
        self.description = description
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen = Seen()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    def _card(self) -> pb.AgentCard:
        return pb.AgentCard(
            name="remote-echo",
            description=self.description,
            version="1",
            supported_interfaces=[
                pb.AgentInterface(
                    url=f"{self.url}/rpc",
                    protocol_binding="JSONRPC",
                    protocol_version="0.3" if self.version == "0.3" else "1.0",
                )
            ],
            capabilities=pb.AgentCapabilities(streaming=False),
            default_input_modes=["text/plain"],
            default_output_modes=["text/plain"],
            skills=[pb.AgentSkill(id="echo", name="echo", description="echoes", tags=["echo"])],
        )

    def _card_03(self) -> dict[str, Any]:
        return {
            "name": "remote-echo",
            "description": self.description,
            "version": "1",
            "url": f"{self.url}/rpc",
            "protocolVersion": "0.3.0",
            "preferredTransport": "JSONRPC",
            "capabilities": {"streaming": False},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [],
        }

    def app(self) -> Any:
        card = self._card()
        handler = DefaultRequestHandler(_Echo(self.seen, self.delay), InMemoryTaskStore(), card)
        rpc = create_jsonrpc_routes(handler, "/rpc", enable_v0_3_compat=True)
        if self.version == "0.3":
            body = self._card_03()

            async def card_03(request: Request) -> Response:
                return JSONResponse(body)

            cards = [Route("/.well-known/agent-card.json", card_03, methods=["GET"])]
        else:
            cards = create_agent_card_routes(card)
        app = Starlette(routes=[*cards, *rpc])
        seen, token = self.seen, self.token

        async def recording(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/rpc":
                await app(scope, receive, send)
                return
            chunks, more = [], True
            while more:
                event = await receive()
                chunks.append(event.get("body", b""))
                more = event.get("more_body", False)
            raw = b"".join(chunks)
            try:
                seen.methods.append(json.loads(raw).get("method"))
            except ValueError:
                seen.methods.append("?")
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            auth = headers.get("authorization")
            seen.auth.append(auth)
            if token is not None and auth != f"Bearer {token}":
                await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
                return
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": raw, "more_body": False}
                return await receive()

            await app(scope, replay, send)

        return recording

    async def __aenter__(self) -> RemoteAgent:
        config = uvicorn.Config(
            self.app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        server = self._server
        await wait_for(lambda: server.started, within=10)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        self._server.force_exit = True
        async with asyncio.timeout(10):
            await self._task
