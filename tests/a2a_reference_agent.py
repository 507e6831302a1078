"""A reference A2A agent served by the a2a-sdk's own server: the SDK's
DefaultRequestHandler, its Starlette JSON-RPC routes (0.3 compatibility on) and card
route, under uvicorn. It echoes, as the gateway's echo agent does.

    python tests/a2a_reference_agent.py --port N [--host 127.0.0.1] [--delay SECONDS]

What it is for: the behaviour of the SDK's server to hold ours against (a conformance
kit run against both shows where ours differs), and a remote agent for `agent_call`
tests. Needs the test extras (`a2a-sdk[http-server]`, `uvicorn`).
"""

from __future__ import annotations

import argparse
import asyncio

import uvicorn
from a2a.helpers.proto_helpers import new_task
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as pb
from starlette.applications import Starlette

TEXT = "text/plain"


class EchoExecutor(AgentExecutor):
    """Answers `echo: <text>` in two artifact chunks, after `delay` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        task_id, context_id = context.task_id or "", context.context_id or ""
        if context.current_task is None:
            history = [context.message] if context.message is not None else []
            await event_queue.enqueue_event(
                new_task(task_id, context_id, pb.TASK_STATE_SUBMITTED, history=history)
            )
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.start_work()
        await asyncio.sleep(self.delay)
        reply = f"echo: {context.get_user_input()}"
        half = len(reply) // 2
        await updater.add_artifact(
            [pb.Part(text=reply[:half])], artifact_id="reply", name="reply", last_chunk=False
        )
        await updater.add_artifact(
            [pb.Part(text=reply[half:])],
            artifact_id="reply",
            name="reply",
            append=True,
            last_chunk=True,
        )
        await updater.complete(updater.new_agent_message([pb.Part(text=reply)]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel()


def build_card(url: str) -> pb.AgentCard:
    return pb.AgentCard(
        name="reference echo",
        description="The a2a-sdk's own server with an echo agent.",
        version="1.0.0",
        supported_interfaces=[
            pb.AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version=version)
            for version in ("1.0", "0.3")
        ],
        capabilities=pb.AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=[TEXT],
        default_output_modes=[TEXT],
        skills=[
            pb.AgentSkill(id="echo", name="Echo", description="Echoes the message", tags=["echo"])
        ],
    )


def build_app(url: str, delay: float = 0.0) -> Starlette:
    card = build_card(url)
    handler = DefaultRequestHandler(EchoExecutor(delay), InMemoryTaskStore(), card)
    routes = [
        *create_agent_card_routes(card),
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True),
    ]
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    args = parser.parse_args()
    app = build_app(f"http://{args.host}:{args.port}/", args.delay)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
