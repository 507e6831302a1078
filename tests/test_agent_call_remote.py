"""`agent_call` to remote A2A agents through the whole gateway: the real runner and HTTP
adapter, the openai backend against the fake OpenAI server (scripted to call the tool),
and a remote agent served by the a2a-sdk's own server (tests/a2a_remote_fixture.py) in
A2A 1.0 and in 0.3 mode, reached by the SDK's client.

The remote's context is kept across two delegations in one chat and differs between
chats; the bearer token is sent; the chain travels in the message's metadata; a slow or
unreachable remote is a tool error the model reads, never a failed turn; /healthz and
/metrics report the remote agents and the delegations."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.a2a_remote_fixture import RemoteAgent, free_port
from tests.fakes.openai_server import FakeOpenAI, tool_calls
from tests.gateway_client import RunningGateway
from tests.pg_support import StorageBackend
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

MakeGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def make_gateway(tmp_path: Path, fake: FakeOpenAI) -> AsyncIterator[MakeGateway]:
    made: list[RunningGateway] = []

    async def make(remotes: dict[str, Any], **more: Any) -> RunningGateway:
        settings = {
            **more,
            "timezone": "UTC",
            "agent": {
                "backend": "openai",
                "base_url": fake.base_url,
                "model": "m",
                "delegates": list(remotes),
            },
            "remote_agents": remotes,
        }
        gateway = await RunningGateway.started(settings, tmp_path / f"home{len(made)}")
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


def last_results(fake: FakeOpenAI) -> list[str]:
    """The tool results of the newest request that ended with them (a session's title
    or summary may be asked for after the turn)."""
    for request in reversed(fake.requests):
        messages = request["json"]["messages"]
        results: list[str] = []
        for message in reversed(messages):
            if message.get("role") != "tool":
                break
            results.insert(0, message["content"])
        if results:
            return results
    return []


def agent_call_spec(fake: FakeOpenAI) -> dict[str, Any]:
    for request in reversed(fake.requests):
        for tool in request["json"].get("tools", []):
            if tool["function"]["name"] == "agent_call":
                return tool["function"]
    raise AssertionError("agent_call was never offered")


async def delegate(
    gw: RunningGateway, fake: FakeOpenAI, agent: str, task: str, chat: str = "c1"
) -> str:
    """One turn in which the model calls agent_call once; the tool's result."""
    fake.script(tool_calls(("agent_call", {"agent": agent, "task": task})), "done")
    assert await gw.say(f"please ask {agent}", chat=chat) == "done"
    (result,) = last_results(fake)
    return result


async def remote_contexts(gw: RunningGateway) -> list[tuple[str, str]]:
    """(session key, remote) of every stored remote context."""
    rows = await gw.runner.store.read(
        lambda conn: conn.execute(
            "SELECT session_key, remote FROM remote_contexts ORDER BY session_key"
        ).fetchall()
    )
    return [tuple(row) for row in rows]


@pytest.mark.parametrize("version", ["1.0", "0.3"])
async def test_a_remote_context_is_kept_in_a_chat_and_differs_between_chats(
    make_gateway: MakeGateway, fake: FakeOpenAI, version: str, store_backend: StorageBackend
) -> None:
    async with RemoteAgent(version=version, token="remote-secret") as remote:
        gw = await make_gateway(
            {"helper": {"url": remote.url, "token": "remote-secret", "timeout_seconds": 20}},
            storage=store_backend.storage(),
        )
        assert await delegate(gw, fake, "helper", "one") == "echo: one (message 1)"
        assert await delegate(gw, fake, "helper", "two") == "echo: two (message 2)"
        # the card, read by now, describes the agent to the model
        assert "helper: Answers with an echo of the task" in agent_call_spec(fake)["description"]
        assert await delegate(gw, fake, "helper", "three", chat="c2") == "echo: three (message 1)"

        first, second, third = remote.seen.messages
        assert first["context_id"] == second["context_id"] != third["context_id"]
        assert len({m["message_id"] for m in remote.seen.messages}) == 3
        assert set(remote.seen.auth) == {"Bearer remote-secret"}
        # 1.0 speaks SendMessage, 0.3 message/send: the SDK picked the card's transport
        expected = "message/send" if version == "0.3" else "SendMessage"
        assert remote.seen.methods[0] == expected
        # the chain names the calling agent by its A2A URL
        (chain_entry,) = first["metadata"]["hermes.chain"]
        assert chain_entry.endswith("/a2a/main")

        metrics = await gw.client.get_text("/metrics")
        assert (
            'hermes_a2a_delegations_total{agent="main",delegate="helper",outcome="ok"} 3.0'
            in metrics
        )

        # deleting a chat's session deletes its remote context, and only its own
        c1, c2 = "agent:main:http:dm:c1", "agent:main:http:dm:c2"
        assert await remote_contexts(gw) == [(c1, "helper"), (c2, "helper")]
        entry = await gw.runner.store.get_entry(c1)
        assert entry is not None
        assert (await gw.runner.delete_session(entry.session_id))["status"] == "deleted"
        assert await remote_contexts(gw) == [(c2, "helper")]
        # the chat's next delegation starts a new remote context
        assert await delegate(gw, fake, "helper", "four") == "echo: four (message 1)"
        await gw.stop()  # before the PostgreSQL schema goes


async def test_the_context_survives_a_restart(tmp_path: Path, fake: FakeOpenAI) -> None:
    async with RemoteAgent() as remote:
        settings = {
            "timezone": "UTC",
            "agent": {
                "backend": "openai",
                "base_url": fake.base_url,
                "model": "m",
                "delegates": ["helper"],
            },
            "remote_agents": {"helper": {"url": remote.url}},
        }
        gw = await RunningGateway.started(settings, tmp_path / "home")
        try:
            assert await delegate(gw, fake, "helper", "one") == "echo: one (message 1)"
        finally:
            await gw.stop()
        gw = await RunningGateway.started(settings, tmp_path / "home")
        try:
            assert await gw.client.replies("c1", 1) == ["done"]  # the first run's reply
            assert await delegate(gw, fake, "helper", "two") == "echo: two (message 2)"
        finally:
            await gw.stop()


async def test_a_wrong_token_a_timeout_and_an_unreachable_remote_are_tool_errors(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    async with (
        RemoteAgent(token="right") as guarded,
        RemoteAgent(delay=5.0) as slow,
    ):
        gw = await make_gateway(
            {
                "guarded": {"url": guarded.url, "token": "wrong-token-value"},
                "slow": {"url": slow.url, "timeout_seconds": 0.5},
                "gone": {"url": f"http://127.0.0.1:{free_port()}", "timeout_seconds": 5},
            }
        )
        refused = json.loads(await delegate(gw, fake, "guarded", "hello"))
        assert "guarded" in refused["error"] and "wrong-token-value" not in refused["error"]
        timed_out = json.loads(await delegate(gw, fake, "slow", "hello"))
        assert timed_out["error"] == "'slow' did not answer within 0.5 seconds"
        # the remote task it left running is cancelled
        await wait_for(lambda: slow.seen.canceled, within=10)
        unreachable = json.loads(await delegate(gw, fake, "gone", "hello"))
        assert "gone" in unreachable["error"] and "could not be read" in unreachable["error"]

        health = (await gw.client.get_json("/healthz"))["remote_agents"]
        assert health["guarded"]["reachable"] is True  # its card is public
        assert health["gone"]["reachable"] is False and health["gone"]["error"]
        assert "checked_at" in health["slow"]
        assert "wrong-token-value" not in json.dumps(health)
        assert gw.runner.status_snapshot()["health"]["remote_agents"] == health

        metrics = await gw.client.get_text("/metrics")
        assert 'delegate="slow",outcome="timeout"} 1.0' in metrics
        assert 'delegate="gone",outcome="failed"} 1.0' in metrics


async def test_an_unknown_agent_is_a_tool_error_naming_the_delegates(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    async with RemoteAgent() as remote:
        gw = await make_gateway({"helper": {"url": remote.url}})
        error = json.loads(await delegate(gw, fake, "nobody", "hello"))["error"]
        assert error.startswith("agent_call: bad arguments: agent:") and "'helper'" in error
        assert remote.seen.messages == []


async def test_agents_list_shows_the_delegates_and_whether_each_card_resolves(
    tmp_path: Path,
) -> None:
    async with RemoteAgent(version="0.3", token="list-secret") as remote:
        (tmp_path / "hermes.yaml").write_text(
            "agent:\n  description: The orchestrator\n  delegates: [researcher, helper, gone]\n"
            "agents:\n  researcher: {backend: echo, description: Finds things out}\n"
            "remote_agents:\n"
            f"  helper: {{url: '{remote.url}', token: list-secret}}\n"
            f"  gone: {{url: 'http://127.0.0.1:{free_port()}', timeout_seconds: 5}}\n"
        )
        # a subprocess, while the remote agent serves in this loop
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "agents", "list", "--json",
            env={**os.environ, "HERMES_HOME": str(tmp_path)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    report = json.loads(out)
    assert [(a["id"], a["delegates"]) for a in report["agents"]] == [
        ("main", ["researcher", "helper", "gone"]),
        ("researcher", []),
    ]
    remotes = {r["name"]: r for r in report["remote_agents"]}
    assert remotes["helper"]["reachable"] is True
    assert remotes["helper"]["card"]["description"] == "Answers with an echo of the task"
    assert remotes["helper"]["card"]["protocol_versions"] == ["0.3.0"]
    assert remotes["gone"]["reachable"] is False and "gone" in remotes["gone"]["error"]
    assert "list-secret" not in out.decode() + err.decode()


async def test_stop_cancels_the_remote_task(make_gateway: MakeGateway, fake: FakeOpenAI) -> None:
    async with RemoteAgent(delay=10.0) as remote:
        gw = await make_gateway({"helper": {"url": remote.url, "timeout_seconds": 30}})
        fake.script(tool_calls(("agent_call", {"agent": "helper", "task": "slow"})), "done")
        await gw.client.post("c1", "go")
        await wait_for(lambda: remote.seen.messages)  # the remote works on it
        await gw.client.post("c1", "/stop")
        await wait_for(lambda: remote.seen.canceled)
        metrics = await gw.client.get_text("/metrics")
        assert 'delegate="helper",outcome="canceled"} 1.0' in metrics
