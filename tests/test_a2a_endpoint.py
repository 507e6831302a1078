"""The A2A endpoint (gateway/a2a/jsonrpc.py, docs/a2a.md): the token, a 0.3 client (the
a2a-sdk's compat transport), bad JSON-RPC input and its error codes, versions, bounds,
keep-alive, shutdown with open streams and waiting sends, and tasks read back after a
restart, in process on each store and of a real daemon. The harness is
tests/a2a_support.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.compat.v0_3.jsonrpc_transport import CompatJsonRpcTransport
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import A2AError, TaskNotFoundError

from gateway.a2a import jsonrpc
from tests.a2a_support import TOKEN, A2aGateway, message, message_json, reply_of, send
from tests.commandline import finish, spawn, wait_ready
from tests.pg_support import StorageBackend
from tests.waiting import wait_for


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[A2aGateway]:
    running = await A2aGateway.started(tmp_path)
    yield running
    await running.stop()


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
    # the task as sent (submitted, or working when its turn began first), then its turn's
    # begin as a status update when it came later: working before the keep-alives
    states = [events[0]["result"]["task"]["status"]["state"]] + [
        e["result"]["statusUpdate"]["status"]["state"] for e in events[1:]
    ]
    assert states[-1] == "TASK_STATE_WORKING", states
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
        (  # a delegation chain (from another gateway) that is not a list of agent URLs
            _request(
                "SendMessage", {"message": {**_TEXT["message"], "metadata": {"hermes.chain": "x"}}}
            ),
            "1.0",
            -32602,
        ),
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


def _start_reference_agent(port: int) -> subprocess.Popen[str]:
    script = Path(__file__).with_name("a2a_reference_agent.py")
    command = [sys.executable, str(script), "--port", str(port)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def test_the_reference_agent_answers_the_sdk_client(procs: list) -> None:
    """tests/a2a_reference_agent.py, the SDK's own server the conformance runs compare
    ours with, starts from its command line and answers 1.0 and 0.3 clients."""
    port = _free_port()
    agent = _start_reference_agent(port)
    procs.append(agent)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=30) as http:

        async def card_served() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return (await http.get(f"{url}/.well-known/agent-card.json")).status_code == 200
            return False

        await wait_for(card_served, within=30)
        client = await ClientFactory(ClientConfig(httpx_client=http)).create_from_url(url)
        events = await send(client, message("hi"))
        card = await A2ACardResolver(http, url).get_agent_card()
        old = CompatJsonRpcTransport(http, card, url + "/")
        sent = await old.send_message(pb.SendMessageRequest(message=message("old")))
    assert events[-1].status_update.status.state == pb.TASK_STATE_COMPLETED
    chunks = [
        e.artifact_update.artifact.parts[0].text for e in events if e.HasField("artifact_update")
    ]
    assert "".join(chunks) == "echo: hi"
    assert reply_of(sent.task) == "echo: old"
