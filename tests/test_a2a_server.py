"""The A2A server (gateway/a2a/, docs/a2a.md) through the unmodified a2a-sdk client: a
runner in the test's loop with its HTTP API and the A2A routes the composition root
mounts (`gateway.cli.mount_a2a`), the runner's real task service and store; one test
runs the daemon as the operator does and reads a task back after a restart.

The agent streams its reply word by word and says what it remembers of the session
(the user's previous message), so a context's second task shows the first one's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.compat.v0_3.jsonrpc_transport import CompatJsonRpcTransport
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import A2AError, TaskNotFoundError

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.a2a import jsonrpc
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.cli import check_runnable, mount_a2a
from gateway.run import GatewayRunner
from gateway.tools.approval import ApprovalRequest
from tests.commandline import finish, spawn, wait_ready
from tests.pg_support import StorageBackend
from tests.waiting import wait_for

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
    ) -> A2aGateway:
        http_settings: dict[str, Any] = {"enabled": True, "port": 0}
        if token:
            http_settings["token"] = token
        config = GatewayConfig.model_validate(
            {
                "platforms": {"http": http_settings},
                "a2a": {"enabled": True},
                "agent": agent or {},
                "storage": storage or {},
                "agents": {
                    "helper": {"description": "Helps.", "skills": [{"id": "x", "name": "X"}]}
                },
            }
        )
        adapters = check_runnable(config)
        runner = GatewayRunner(config, adapters, agent_factory=agent_factory, home=home)
        mount_a2a(config, runner, adapters)
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


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[A2aGateway]:
    running = await A2aGateway.started(tmp_path)
    yield running
    await running.stop()


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


# --- the card -----------------------------------------------------------------------------


async def test_cards_are_public_and_name_the_endpoint_for_both_protocols(tmp_path: Path) -> None:
    running = await A2aGateway.started(tmp_path, token=TOKEN)
    try:
        anonymous = running.httpx()
        main = (await anonymous.get(f"{running.url}/.well-known/agent-card.json")).json()
        card = await A2ACardResolver(anonymous, f"{running.url}/a2a/helper").get_agent_card()
        missing = await anonymous.get(f"{running.url}/a2a/nobody/.well-known/agent-card.json")
    finally:
        await running.stop()
    endpoint = f"{running.url}/a2a/main"
    assert [(i["url"], i["protocolVersion"]) for i in main["supportedInterfaces"]] == [
        (endpoint, "1.0"),
        (endpoint, "0.3"),
    ]
    # What a 0.3 client reads of the same document.
    assert (main["url"], main["protocolVersion"], main["preferredTransport"]) == (
        endpoint,
        "0.3",
        "JSONRPC",
    )
    assert main["capabilities"] == {"streaming": True, "pushNotifications": False}
    assert main["defaultInputModes"] == main["defaultOutputModes"] == ["text/plain"]
    assert main["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert main["securityRequirements"] == [{"schemes": {"bearer": {}}}]
    assert TOKEN not in str(main)
    assert card.description == "Helps."
    assert [(s.id, s.name) for s in card.skills] == [("x", "X")]
    assert card.supported_interfaces[0].url == f"{running.url}/a2a/helper"
    assert missing.status_code == 404


# --- sending --------------------------------------------------------------------------------


async def test_send_waits_for_the_reply(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    (event,) = await send(client, message("hello there"))
    task = event.task
    assert task.status.state == pb.TASK_STATE_COMPLETED
    assert reply_of(task) == "echo: hello there"
    assert [(m.role, m.parts[0].text) for m in task.history] == [
        (pb.ROLE_USER, "hello there"),
        (pb.ROLE_AGENT, "echo: hello there"),
    ]
    assert task.context_id


async def test_send_returning_immediately_gives_the_task_before_its_reply(
    gateway: A2aGateway,
) -> None:
    client = await gateway.client(streaming=False)
    (event,) = await send(client, message("quick"), return_immediately=True)
    assert event.task.status.state in (pb.TASK_STATE_SUBMITTED, pb.TASK_STATE_WORKING)

    async def done() -> bool:
        task = await client.get_task(pb.GetTaskRequest(id=event.task.id))
        return task.status.state == pb.TASK_STATE_COMPLETED

    await wait_for(done)


async def test_stream_sends_the_task_its_states_the_reply_in_pieces_and_the_end(
    gateway: A2aGateway,
) -> None:
    client = await gateway.client()
    text = "stream " + " ".join(f"w{i}" for i in range(40))
    events = await send(client, message(text))
    kinds = [event.WhichOneof("payload") for event in events]
    assert kinds[0] == "task"
    states = [e.status_update.status.state for e in events if e.HasField("status_update")]
    assert states[0] == pb.TASK_STATE_WORKING
    assert states[-1] == pb.TASK_STATE_COMPLETED
    assert kinds[-1] == "status_update"
    pieces = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert len(pieces) > 2  # streamed, not one piece at the end
    assert [p.append for p in pieces] == [False] + [True] * (len(pieces) - 1)
    assert [p.last_chunk for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert "".join(p.artifact.parts[0].text for p in pieces) == f"echo: {text}"


async def test_a_second_message_in_the_context_carries_the_first(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    (first,) = await send(client, message("remember apples"))
    (second,) = await send(client, message("and now?", context_id=first.task.context_id))
    assert second.task.context_id == first.task.context_id
    assert second.task.id != first.task.id
    assert reply_of(second.task) == "echo: and now? (after: remember apples)"
    (other,) = await send(client, message("fresh start"))
    assert reply_of(other.task) == "echo: fresh start"  # a new context remembers nothing


async def test_a_resent_message_id_is_the_same_task_and_one_turn(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    msg = message("only once")
    (first,) = await send(client, msg)
    (again,) = await send(client, msg)
    assert again.task.id == first.task.id
    assert reply_of(again.task) == "echo: only once"
    listed = await client.list_tasks(pb.ListTasksRequest())
    assert [t.id for t in listed.tasks] == [first.task.id]
    (followup,) = await send(client, message("next", context_id=first.task.context_id))
    # One turn before this one: the agent remembers "only once", and only once.
    assert reply_of(followup.task) == "echo: next (after: only once)"


# --- reading tasks ----------------------------------------------------------------------


async def test_list_shows_the_callers_tasks_of_this_agent_only(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    (mine,) = await send(client, message("mine"))
    tasks = gateway.runner.agent_tasks
    other = await tasks.send("main", "theirs", message_id="m-other", caller="someone-else")
    helper = await gateway.client("helper", streaming=False)
    (helpers,) = await send(helper, message("for the helper"))
    listed = await client.list_tasks(pb.ListTasksRequest())
    assert [t.id for t in listed.tasks] == [mine.task.id]
    assert not listed.tasks[0].artifacts  # includeArtifacts not asked
    with pytest.raises(TaskNotFoundError):
        await client.get_task(pb.GetTaskRequest(id=other.task_id))
    with pytest.raises(TaskNotFoundError):  # the helper's task, asked of main
        await client.get_task(pb.GetTaskRequest(id=helpers.task.id))


async def test_list_pages_newest_first(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    ids = [(await send(client, message(f"n{i}")))[0].task.id for i in range(3)]
    first = await client.list_tasks(pb.ListTasksRequest(page_size=2, include_artifacts=True))
    assert [t.id for t in first.tasks] == ids[:0:-1]
    assert (first.page_size, first.total_size) == (2, 3)
    assert reply_of(first.tasks[0]) == "echo: n2"
    second = await client.list_tasks(
        pb.ListTasksRequest(page_size=2, page_token=first.next_page_token)
    )
    assert [t.id for t in second.tasks] == [ids[0]]
    assert (second.page_size, second.total_size) == (1, 3)
    exact = await client.list_tasks(pb.ListTasksRequest(page_size=3))
    assert (len(exact.tasks), exact.next_page_token) == (3, "")  # a full page, the last
    assert second.next_page_token == ""


async def test_get_limits_the_history(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    (event,) = await send(client, message("hist"))
    full = await client.get_task(pb.GetTaskRequest(id=event.task.id))
    last = await client.get_task(pb.GetTaskRequest(id=event.task.id, history_length=1))
    none = await client.get_task(pb.GetTaskRequest(id=event.task.id, history_length=0))
    assert len(full.history) == 2
    assert [m.role for m in last.history] == [pb.ROLE_AGENT]
    assert len(none.history) == 0


class AskingAgent:
    """Asks the approval gate (as a tool marked `approve` does) and says the verdict."""

    runner: GatewayRunner | None = None

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        assert self.runner is not None
        verdict = await self.runner.approvals.ask(
            ApprovalRequest(request.session_key, request.source, "launch", {"what": "rocket"})
        )
        return TurnResult(f"verdict: {verdict.value}")

    async def close(self) -> None:
        return None


async def test_a_task_waiting_for_an_approval_is_answered_through_its_task_id(
    tmp_path: Path,
) -> None:
    agent = AskingAgent()
    running = await A2aGateway.started(tmp_path, agent_factory=lambda key: agent)
    agent.runner = running.runner
    try:
        client = await running.client(streaming=False)
        (asked,) = await send(client, message("go"))  # blocking: returns at input-required
        task = asked.task
        assert task.status.state == pb.TASK_STATE_INPUT_REQUIRED
        assert "launch" in task.status.message.parts[0].text
        listed = await client.list_tasks(pb.ListTasksRequest())
        answer = message("/approve")
        answer.task_id = task.id
        (answered,) = await send(client, answer)
        again = message("/approve")
        again.task_id = task.id
        with pytest.raises(A2AError, match="completed"):  # answered: no more answers
            await send(client, again)
    finally:
        await running.stop()
    assert answered.task.id == task.id
    assert answered.task.status.state == pb.TASK_STATE_COMPLETED
    assert reply_of(answered.task) == "verdict: approved"
    assert [t.id for t in listed.tasks] == [task.id]  # the answer is no task of its own


# --- cancel and subscribe -----------------------------------------------------------------


async def test_cancel_stops_a_running_task(gateway: A2aGateway) -> None:
    client = await gateway.client(streaming=False)
    (event,) = await send(client, message("think slowly"), return_immediately=True)
    task_id = event.task.id

    async def working() -> bool:
        task = await client.get_task(pb.GetTaskRequest(id=task_id))
        return task.status.state == pb.TASK_STATE_WORKING

    await wait_for(working)
    canceled = await client.cancel_task(pb.CancelTaskRequest(id=task_id))
    assert canceled.status.state == pb.TASK_STATE_CANCELED
    assert (await client.get_task(pb.GetTaskRequest(id=task_id))).status.state == (
        pb.TASK_STATE_CANCELED
    )
    with pytest.raises(A2AError) as again:  # a finished task is not canceled twice
        await client.cancel_task(pb.CancelTaskRequest(id=task_id))
    assert "canceled" in str(again.value)
    # The session is free again: the next message in the context is answered.
    (after,) = await send(client, message("still there?", context_id=event.task.context_id))
    assert reply_of(after.task).startswith("echo: still there?")


async def test_subscribe_joins_a_running_task_and_again_after_a_reconnect(
    gateway: A2aGateway,
) -> None:
    client = await gateway.client()
    first = await gateway.client()
    (event,) = await send(
        await gateway.client(streaming=False), message("think slowly"), return_immediately=True
    )
    task_id = event.task.id
    # The first subscriber leaves after the task event (a dropped connection).
    async for update in first.subscribe(pb.SubscribeToTaskRequest(id=task_id)):
        assert update.task.id == task_id
        break
    received: list[pb.StreamResponse] = []

    async def follow() -> None:
        async for update in client.subscribe(pb.SubscribeToTaskRequest(id=task_id)):
            received.append(update)

    follower = asyncio.create_task(follow())
    await wait_for(lambda: received)
    assert received[0].task.id == task_id
    await client.cancel_task(pb.CancelTaskRequest(id=task_id))
    async with asyncio.timeout(15):
        await follower
    assert received[-1].status_update.status.state == pb.TASK_STATE_CANCELED
    with pytest.raises(A2AError, match="terminal"):  # nothing more to follow
        async for _ in client.subscribe(pb.SubscribeToTaskRequest(id=task_id)):
            pass


async def test_a_quiet_stream_is_kept_alive(
    gateway: A2aGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jsonrpc, "KEEPALIVE_SECONDS", 0.05)
    body = _request("SendStreamingMessage", {"message": message_json("think slowly")})
    lines: list[str] = []
    async with gateway.httpx().stream(
        "POST", f"{gateway.url}/a2a/main", json=body, headers={"A2A-Version": "1.0"}
    ) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        async for line in response.aiter_lines():
            lines.append(line)
            if lines.count(": keep-alive") >= 2:
                break
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    assert events[0]["result"]["task"]["status"]["state"] == "TASK_STATE_WORKING"
    (task,) = await gateway.runner.agent_tasks.list("anonymous")
    await gateway.runner.agent_tasks.cancel(task.task_id, "anonymous")


async def test_stopping_the_gateway_ends_open_streams_at_once(tmp_path: Path) -> None:
    running = await A2aGateway.started(tmp_path, agent={"restart_drain_timeout": 0.2})
    events: list[pb.StreamResponse] = []
    client = await running.client()

    async def follow() -> None:
        with contextlib.suppress(A2AError):  # the connection ends without a final event
            async for event in client.send_message(
                pb.SendMessageRequest(message=message("think slowly"))
            ):
                events.append(event)

    follower = asyncio.create_task(follow())
    await wait_for(lambda: len(events) >= 2)  # the task and its working status
    began = time.monotonic()
    await running.stop()
    # Not the HTTP server's 5 s grace for open requests: the streams were ended.
    assert time.monotonic() - began < 4
    async with asyncio.timeout(5):
        await follower


async def test_stopping_the_gateway_answers_a_waiting_send_at_once(tmp_path: Path) -> None:
    running = await A2aGateway.started(tmp_path, agent={"restart_drain_timeout": 0.2})
    client = await running.client(streaming=False)
    waiting = asyncio.create_task(send(client, message("think slowly")))
    tasks = running.runner.agent_tasks
    await wait_for(lambda: _working(tasks))
    began = time.monotonic()
    await running.stop()
    assert time.monotonic() - began < 4
    async with asyncio.timeout(5):
        (event,) = await waiting
    assert event.task.status.state == pb.TASK_STATE_WORKING  # resumed after a restart


async def _working(tasks: Any) -> bool:
    return [t.state.value for t in await tasks.list("anonymous")] == ["working"]


# --- auth, 0.3, bad input -------------------------------------------------------------------


async def test_the_token_is_required_for_calls(tmp_path: Path) -> None:
    running = await A2aGateway.started(tmp_path, token=TOKEN)
    try:
        client = await running.client(streaming=False)
        (event,) = await send(client, message("with the token"))
        assert reply_of(event.task) == "echo: with the token"
        for token in (None, "wrong"):
            answer = await running.httpx(token).post(
                f"{running.url}/a2a/main",
                json={"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {}},
                headers={"A2A-Version": "1.0"},
            )
            assert answer.status_code == 401
            assert answer.headers["WWW-Authenticate"] == "Bearer"
    finally:
        await running.stop()


async def test_a_0_3_client_sends_and_reads_a_task(gateway: A2aGateway) -> None:
    http = gateway.httpx()
    card = await A2ACardResolver(http, f"{gateway.url}/a2a/main").get_agent_card()
    transport = CompatJsonRpcTransport(http, card, f"{gateway.url}/a2a/main")
    sent = await transport.send_message(pb.SendMessageRequest(message=message("old client")))
    assert sent.task.status.state == pb.TASK_STATE_COMPLETED
    read = await transport.get_task(pb.GetTaskRequest(id=sent.task.id))
    assert reply_of(read) == "echo: old client"
    streamed = [
        e
        async for e in transport.send_message_streaming(pb.SendMessageRequest(message=message("s")))
    ]
    assert streamed[-1].status_update.status.state == pb.TASK_STATE_COMPLETED
    with pytest.raises(TaskNotFoundError):
        await transport.get_task(pb.GetTaskRequest(id="no-such-task"))


def _request(method: str, params: Any = None, **envelope: Any) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "id": 7, "method": method, **envelope}
    if params is not None:
        body["params"] = params
    return body


_TEXT = {"message": {"messageId": "bad-1", "role": "ROLE_USER", "parts": [{"text": "x"}]}}
_OLD_TEXT = {
    "message": {
        "messageId": "bad-3",
        "role": "user",
        "kind": "message",
        "parts": [{"kind": "text", "text": "x"}],
    }
}


@pytest.mark.parametrize(
    ("body", "version", "code"),
    [
        (b"{not json", "1.0", -32700),
        (b"\xff\xfe", "1.0", -32700),
        ([_request("GetTask", {"id": "t"})], "1.0", -32600),  # a batch
        ({**_request("GetTask", {"id": "t"}), "jsonrpc": "1.0"}, "1.0", -32600),
        (_request("GetTask", {"id": "t"}, id=True), "1.0", -32600),
        ({"jsonrpc": "2.0", "id": 7}, "1.0", -32600),  # no method
        (_request("NoSuchMethod", {}), "1.0", -32601),
        (_request("SendMessage", {"message": "not an object"}), "1.0", -32602),
        (_request("SendMessage", ["params", "as", "a", "list"]), "1.0", -32602),
        (
            _request(
                "SendMessage",
                {"message": {"messageId": "bad-2", "role": "ROLE_USER", "parts": [{"url": "f"}]}},
            ),
            "1.0",
            -32602,
        ),  # not a text part
        (_request("SendMessage", {**_TEXT, "configuration": {"historyLength": -1}}), "1.0", -32602),
        (_request("SendMessage", _TEXT), "0.3", -32009),
        (_request("ListTasks", {"pageToken": "not-a-token"}), "1.0", -32602),
        (_request("ListTasks", {"pageSize": 101}), "1.0", -32602),
        (_request("ListTasks", {"status": "TASK_STATE_NONSENSE"}), "1.0", -32602),
        (_request("GetTask", {"id": "no-such"}), "1.0", -32001),
        (
            _request("CreateTaskPushNotificationConfig", {"taskId": "t", "url": "https://x.y/"}),
            "1.0",
            -32003,
        ),
        (_request("GetExtendedAgentCard", {}), "1.0", -32004),
        (_request("tasks/get", {"id": "no-such"}), "0.3", -32001),
        (_request("message/send", {"message": {"nonsense": 1}}), "0.3", -32600),
        # A 0.3 method asked as 1.0: -32009, which 0.3 does not know, so -32603.
        (_request("message/send", _OLD_TEXT), "1.0", -32603),
    ],
)
async def test_bad_requests_get_their_error_and_change_nothing(
    gateway: A2aGateway, body: Any, version: str, code: int
) -> None:
    answer = await gateway.rpc(body, version=version)
    assert answer["error"]["code"] == code, answer
    assert answer["id"] == (7 if isinstance(body, dict) and body.get("id") == 7 else None)
    assert await gateway.runner.agent_tasks.list("anonymous") == []


async def test_the_method_names_the_version_when_no_header_does(gateway: A2aGateway) -> None:
    sent = await gateway.rpc(_request("SendMessage", {"message": message_json("bare")}), version="")
    assert sent["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    async with gateway.httpx() as http:  # the spec's request parameter instead of the header
        answer = await http.post(
            f"{gateway.url}/a2a/main?A2A-Version=0.3", json=_request("ListTasks", {})
        )
    assert answer.json()["error"]["code"] == -32009


async def test_a_body_over_the_limit_is_refused(gateway: A2aGateway) -> None:
    big = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"pad": "x" * 70_000}}
    answer = await gateway.rpc(big)
    assert answer["error"]["code"] == -32600
    assert "too large" in answer["error"]["message"]


async def test_a_body_that_does_not_decode_is_a_parse_error(gateway: A2aGateway) -> None:
    async with gateway.httpx() as http:
        answer = await http.post(
            f"{gateway.url}/a2a/main",
            content=b"not gzip at all",
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
    assert answer.json()["error"]["code"] == -32700


async def test_an_unknown_agent_is_not_found(gateway: A2aGateway) -> None:
    async with gateway.httpx() as http:
        answer = await http.post(f"{gateway.url}/a2a/nobody", json=_request("ListTasks", {}))
    assert answer.status_code == 404


async def test_a_task_is_read_back_after_a_restart_on_each_store(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    running = await A2aGateway.started(tmp_path, storage=store_backend.storage())
    try:
        (event,) = await send(await running.client(streaming=False), message("kept"))
    finally:
        await running.stop()
    again = await A2aGateway.started(tmp_path, storage=store_backend.storage())
    try:
        client = await again.client(streaming=False)
        task = await client.get_task(pb.GetTaskRequest(id=event.task.id))
        listed = await client.list_tasks(pb.ListTasksRequest())
    finally:
        await again.stop()
    assert task.status.state == pb.TASK_STATE_COMPLETED
    assert reply_of(task) == "echo: kept"
    assert [t.id for t in listed.tasks] == [event.task.id]


# --- the daemon -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_task_is_read_back_after_a_daemon_restart(tmp_path: Path, procs: list) -> None:
    port = _free_port()
    (tmp_path / "hermes.yaml").write_text(
        f"platforms:\n  http:\n    enabled: true\n    port: {port}\na2a:\n  enabled: true\n"
    )
    url = f"http://127.0.0.1:{port}"

    async def client(http: httpx.AsyncClient) -> Client:
        config = ClientConfig(streaming=False, httpx_client=http)
        return await ClientFactory(config).create_from_url(f"{url}/a2a/main")

    daemon = spawn(tmp_path, "run")
    procs.append(daemon)
    await asyncio.to_thread(wait_ready, daemon)
    async with httpx.AsyncClient(timeout=30) as http:
        (event,) = await send(await client(http), message("survive"))
    assert reply_of(event.task) == "echo: survive"
    code, out = await asyncio.to_thread(finish, daemon)
    assert code == 0, out
    again = spawn(tmp_path, "run")
    procs.append(again)
    await asyncio.to_thread(wait_ready, again)
    async with httpx.AsyncClient(timeout=30) as http:
        task = await (await client(http)).get_task(pb.GetTaskRequest(id=event.task.id))
    assert task.status.state == pb.TASK_STATE_COMPLETED
    assert reply_of(task) == "echo: survive"
    code, out = await asyncio.to_thread(finish, again)
    assert code == 0, out
