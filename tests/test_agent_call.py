"""`agent_call` between native agents through the whole gateway: the real runner with its
task service and HTTP adapter, every agent on the openai backend against the fake
OpenAI server, each agent's model driven by its own script (the fake tells them apart
by the request's model).

The delegate's reply is the tool's result; the delegate's session continues across two
delegations from one chat and is another for another chat; a cycle (main -> b -> main)
and a chain deeper than a2a.max_delegation_depth are refused with an error the model
reads; /stop of the calling turn cancels the delegate's task; a delegate that does not
exist is a configuration error naming its key (exit 78)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.domain.agent_tasks import TaskState
from tests.commandline import cli
from tests.fakes.openai_server import FakeOpenAI, tool_calls
from tests.gateway_client import RunningGateway
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


class Models:
    """Each agent's model: a script of answers per model name; with none left, an answer
    that shows what the model was sent: after a tool round "<model> got: <result>",
    else "<model>: <task> (turn <user messages in the request>)"."""

    def __init__(self) -> None:
        self.scripts: dict[str, deque[Any]] = defaultdict(deque)
        self.seen: dict[str, list[dict[str, Any]]] = defaultdict(list)

    def __call__(self, body: dict[str, Any]) -> str | dict[str, Any]:
        model, messages = body["model"], body["messages"]
        self.seen[model].append(body)
        if self.scripts[model]:
            return self.scripts[model].popleft()
        if messages[-1]["role"] == "tool":
            return f"{model} got: {messages[-1]['content']}"
        users = [m for m in messages if m["role"] == "user"]
        return f"{model}: {users[-1]['content']} (turn {len(users)})"

    def call(self, model: str, agent: str, task: str) -> None:
        """`model`'s next answer calls agent_call(agent, task)."""
        self.scripts[model].append(tool_calls(("agent_call", {"agent": agent, "task": task})))


@pytest.fixture
def models() -> Models:
    return Models()


@pytest.fixture
async def fake(models: Models) -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(reply=models) as server:
        yield server


def agent(fake: FakeOpenAI, model: str, delegates: list[str]) -> dict[str, Any]:
    return {
        "backend": "openai",
        "base_url": fake.base_url,
        "model": model,
        "delegates": delegates,
        # a fixed prompt: the requests carry no time or tool list that varies
        "system_prompt": f"You are {model}.",
    }


@pytest.fixture
async def gateway(tmp_path: Path, fake: FakeOpenAI) -> AsyncIterator[RunningGateway]:
    settings = {
        "timezone": "UTC",
        "agent": agent(fake, "main", ["researcher", "b"]),
        "agents": {
            "researcher": {**agent(fake, "researcher", []), "description": "Finds things out"},
            "b": agent(fake, "b", ["main", "c"]),
            "c": agent(fake, "c", []),
        },
        "a2a": {"max_delegation_depth": 1},
    }
    gateway = await RunningGateway.started(settings, tmp_path / "home")
    yield gateway
    await gateway.stop()


async def test_the_reply_is_the_tool_result_and_the_delegate_session_is_per_chat(
    gateway: RunningGateway, models: Models
) -> None:
    models.call("main", "researcher", "find the moon")
    assert await gateway.say("ask the researcher") == (
        "main got: researcher: find the moon (turn 1)"
    )
    (offered,) = [
        tool["function"]
        for tool in models.seen["main"][0]["tools"]
        if tool["function"]["name"] == "agent_call"
    ]
    assert "- researcher: Finds things out" in offered["description"]
    assert offered["parameters"]["properties"]["agent"]["enum"] == ["researcher", "b"]

    # the same chat: the delegate's session goes on (it sees its first task)
    models.call("main", "researcher", "and the sun")
    assert await gateway.say("again") == "main got: researcher: and the sun (turn 2)"
    history = [m["content"] for m in models.seen["researcher"][-1]["messages"]]
    assert "find the moon" in history
    # another chat: another session of the delegate
    models.call("main", "researcher", "find mars")
    assert await gateway.say("ask", chat="c2") == "main got: researcher: find mars (turn 1)"

    tasks = gateway.runner.agent_tasks
    mine = await tasks.list("session:agent:main:http:dm:c1")
    assert [t.state for t in mine] == [TaskState.COMPLETED, TaskState.COMPLETED]
    assert len({t.context_id for t in mine}) == 1
    (other,) = await tasks.list("session:agent:main:http:dm:c2")
    assert other.context_id != mine[0].context_id
    assert mine[0].chain == ("main",)
    metrics = await gateway.client.get_text("/metrics")
    assert 'hermes_a2a_delegations_total{agent="main",delegate="researcher",outcome="ok"} 3.0' in (
        metrics
    )


async def test_a_cycle_and_a_chain_past_the_depth_are_refused(
    gateway: RunningGateway, models: Models
) -> None:
    # main -> b -> main: b's call is refused, b answers with the refusal
    models.call("main", "b", "ask main back")
    models.call("b", "main", "loop")
    reply = await gateway.say("go")
    prefix = "main got: b got: "
    assert reply.startswith(prefix)
    error = json.loads(reply.removeprefix(prefix))["error"]
    assert "cycle" in error and "main -> b" in error
    # main -> b -> c: depth 2 > a2a.max_delegation_depth 1
    models.call("main", "b", "ask c")
    models.call("b", "c", "anything")
    reply = await gateway.say("go deeper")
    error = json.loads(reply.removeprefix(prefix))["error"]
    assert "a2a.max_delegation_depth (1)" in error
    assert models.seen["c"] == []  # c was never asked
    metrics = await gateway.client.get_text("/metrics")
    assert 'hermes_a2a_delegations_total{agent="b",delegate="main",outcome="refused"} 1.0' in (
        metrics
    )


async def test_stop_cancels_the_delegates_task(
    gateway: RunningGateway, models: Models, fake: FakeOpenAI
) -> None:
    release = fake.hold(lambda body: body["model"] == "researcher")
    models.call("main", "researcher", "a long job")
    await gateway.client.post("c1", "start")
    await wait_for(lambda: fake.held)
    await gateway.client.post("c1", "/stop")
    tasks = gateway.runner.agent_tasks
    caller = "session:agent:main:http:dm:c1"

    async def canceled() -> bool:
        listed = await tasks.list(caller)
        return bool(listed) and listed[0].state is TaskState.CANCELED

    await wait_for(canceled)
    release.set()


def test_an_unknown_delegate_is_a_config_error_naming_its_key(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text("agent:\n  delegates: [nobody]\n")
    result = cli(tmp_path, "check-config")
    assert result.returncode == 78
    assert "agent.delegates.0: unknown agent 'nobody'" in result.stderr


async def test_a_chain_from_another_daemon_is_checked_by_url(
    tmp_path: Path, fake: FakeOpenAI, models: Models
) -> None:
    """A task that came over A2A carries its chain as URLs: a delegate named in it, a
    remote one by its config url or one of ours by `<a2a.public_url>/a2a/<id>`, is a
    cycle (refused before anything is sent)."""
    far = "http://127.0.0.1:9/a2a/far"
    settings = {
        "timezone": "UTC",
        "agent": agent(fake, "main", ["b"]),
        "agents": {"b": agent(fake, "b", ["main", "far"])},
        "remote_agents": {"far": {"url": far}},
        "a2a": {"public_url": "https://gw.example.com"},
    }
    gateway = await RunningGateway.started(settings, tmp_path / "home")
    try:
        tasks = gateway.runner.agent_tasks
        for n, (chain, target) in enumerate(
            [((far,), "far"), (("https://gw.example.com/a2a/main",), "main")]
        ):
            models.call("b", target, "anything")
            sent = await tasks.send("b", "go", message_id=f"m{n}", caller="bearer", chain=chain)
            async with asyncio.timeout(20):
                done = await tasks.wait(sent.task_id, "bearer")
            assert done is not None and done.result_text is not None
            error = json.loads(done.result_text.removeprefix("b got: "))["error"]
            assert "would be a cycle" in error and chain[0] in error
        assert models.seen["main"] == []  # main was never asked
    finally:
        await gateway.stop()
