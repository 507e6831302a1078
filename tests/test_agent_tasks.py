"""Agent tasks (gateway.runner.agent_tasks): one A2A message to one agent and the turn
that answers it, through the public `AgentTasks` API of a real runner (echo agents) on
SQLite and PostgreSQL: send, wait, get, list, cancel, subscribe, dedup of a resent
message id, durability across a restart, and the delegation slot guard."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.domain.agent_tasks import TaskRecord, TaskRefused, TaskState
from gateway.run import GatewayRunner
from tests.pg_support import StorageBackend
from tests.waiting import wait_for

Make = Callable[..., Awaitable[GatewayRunner]]


@pytest.fixture
async def make(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Make]:
    """Runners started on a home (the same home again: a restart) on the backend under
    test; each stopped at the end."""
    made: list[GatewayRunner] = []

    async def start(home: str = "home", **settings: Any) -> GatewayRunner:
        settings = {"timezone": "UTC", "agent": {"backend": "echo"}, **settings}
        config = store_backend.apply(GatewayConfig.model_validate(settings))
        runner = GatewayRunner(config, [], home=tmp_path / home)
        await runner.start()
        made.append(runner)
        return runner

    yield start
    for runner in made:
        await runner.stop()


async def done(runner: GatewayRunner, task: TaskRecord, caller: str = "bearer") -> TaskRecord:
    async with asyncio.timeout(20):
        found = await runner.agent_tasks.wait(task.task_id, caller)
    assert found is not None
    return found


async def transcript(runner: GatewayRunner, context_id: str, agent: str = "main") -> list[str]:
    """The contents of the context's session, oldest first."""
    key = f"agent:{agent}:a2a:dm:{context_id}"

    def read(conn: Any) -> list[str]:
        return [
            row[0]
            for row in conn.execute(
                "SELECT m.content FROM messages m JOIN sessions s USING (session_id)"
                " WHERE s.session_key = ? ORDER BY m.id",
                (key,),
            )
        ]

    return await runner.store.read(read)


async def test_send_wait_completed_with_the_echo_reply(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    sent = await tasks.send("main", "hello", message_id="m1", caller="bearer")
    assert sent.state in (TaskState.SUBMITTED, TaskState.WORKING)
    assert sent.context_id  # a new context was made
    finished = await done(runner, sent)
    assert finished.state is TaskState.COMPLETED
    assert finished.result_text == "echo: hello"
    assert finished.error is None
    assert await tasks.get(sent.task_id, "bearer") == finished
    text = runner.metrics_text()
    assert 'hermes_a2a_tasks_total{agent="main",state="completed"} 1.0' in text


async def test_second_task_in_a_context_sees_the_first(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    first = await done(runner, await tasks.send("main", "one", message_id="a", caller="c"), "c")
    second = await tasks.send(
        "main", "two", message_id="b", caller="c", context_id=first.context_id
    )
    await done(runner, second, "c")
    assert await transcript(runner, first.context_id) == ["one", "echo: one", "two", "echo: two"]


async def test_a_resent_message_id_is_the_same_task_and_one_turn(make: Make) -> None:
    runner = await make(agent={"backend": "echo", "delay_seconds": 0.3})
    tasks = runner.agent_tasks
    sent = await tasks.send("main", "once", message_id="dup", caller="c")
    again = await tasks.send("main", "once", message_id="dup", caller="c")
    assert again.task_id == sent.task_id and again.context_id == sent.context_id
    await done(runner, sent, "c")
    after = await tasks.send("main", "once", message_id="dup", caller="c")
    assert after.state is TaskState.COMPLETED
    assert await transcript(runner, sent.context_id) == ["once", "echo: once"]
    # Another caller's same message id is a task of its own.
    other = await tasks.send("main", "once", message_id="dup", caller="d")
    assert other.task_id != sent.task_id


async def test_list_is_scoped_to_the_caller_newest_first_and_paged(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    sent = [await tasks.send("main", f"t{i}", message_id=f"m{i}", caller="alice") for i in range(3)]
    for task in sent:
        await done(runner, task, "alice")
    listed = await tasks.list("alice")
    assert [t.task_id for t in listed] == [t.task_id for t in reversed(sent)]
    assert await tasks.list("bob") == []
    assert await tasks.get(sent[0].task_id, "bob") is None
    assert await tasks.cancel(sent[0].task_id, "bob") is None
    page = await tasks.list("alice", limit=2)
    rest = await tasks.list("alice", limit=2, after=page[-1].task_id)
    assert [t.task_id for t in page + rest] == [t.task_id for t in listed]
    only = await tasks.list("alice", context_id=sent[1].context_id)
    assert [t.task_id for t in only] == [sent[1].task_id]
    assert await tasks.list("alice", state=TaskState.FAILED) == []


async def test_bad_requests_are_refused_and_change_nothing(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    for kwargs, fragment in (
        ({"agent_id": "nobody"}, "no agent"),
        ({"context_id": "../x"}, "context id"),
        ({"context_id": "x" * 129}, "context id"),
        ({"text": "   "}, "no text"),
        ({"message_id": "m\n1"}, "control"),
        ({"message_id": ""}, "message id"),
    ):
        request = {"agent_id": "main", "text": "hi", "message_id": "m", "caller": "c", **kwargs}
        with pytest.raises(TaskRefused, match=fragment):
            await tasks.send(request.pop("agent_id"), request.pop("text"), **request)
    assert await tasks.list("c") == []
