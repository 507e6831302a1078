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
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.domain.agent_tasks import TaskRecord, TaskRefused, TaskState
from gateway.run import GatewayRunner
from gateway.tools.approval import ApprovalRequest
from tests.pg_support import StorageBackend, fresh_schema, pg_available
from tests.waiting import wait_for

Make = Callable[..., Awaitable[GatewayRunner]]

# Agents take tasks when served over A2A (or delegated to natively): the task platform
# is there only then.
A2A_ON = {"a2a": {"enabled": True}}


@pytest.fixture
async def make(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Make]:
    """Runners started on a home (the same home again: a restart) on the backend under
    test; each stopped at the end."""
    made: list[GatewayRunner] = []

    async def start(home: str = "home", **settings: Any) -> GatewayRunner:
        settings = {"timezone": "UTC", "agent": {"backend": "echo"}, **A2A_ON, **settings}
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
    assert await tasks.list("bob", after=page[-1].task_id) == []  # not bob's: nothing after
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


# --- cancel, subscribe, rejected ----------------------------------------------------------------


async def test_cancel_a_running_task_stops_its_turn(make: Make) -> None:
    runner = await make(agent={"backend": "echo", "delay_seconds": 30})
    tasks = runner.agent_tasks
    sent = await tasks.send("main", "slow", message_id="m1", caller="c")
    queued = await tasks.send(
        "main", "behind", message_id="m2", caller="c", context_id=sent.context_id
    )
    key = f"agent:main:a2a:dm:{sent.context_id}"
    await wait_for(lambda: runner.engine.running.get(key) is not None)
    await wait_for(lambda: _state_is(tasks, sent, TaskState.WORKING))
    canceled = await tasks.cancel(sent.task_id, "c")
    assert canceled is not None and canceled.state is TaskState.CANCELED
    assert not runner.is_busy(key)
    # As /stop: what waited behind it went with it.
    behind = await tasks.get(queued.task_id, "c")
    assert behind is not None and behind.state is TaskState.CANCELED
    assert await transcript(runner, sent.context_id) == ["slow"]  # no reply
    # A terminal task is returned as it is.
    assert await tasks.cancel(sent.task_id, "c") == canceled
    assert 'hermes_a2a_tasks_total{agent="main",state="canceled"} 2.0' in runner.metrics_text()


async def _state_is(tasks: Any, task: TaskRecord, state: TaskState) -> bool:
    found = await tasks.get(task.task_id, task.caller)
    return found is not None and found.state is state


async def test_cancel_a_queued_task_drops_it_alone(make: Make) -> None:
    runner = await make(agent={"backend": "echo", "delay_seconds": 1.5})
    tasks = runner.agent_tasks
    first = await tasks.send("main", "first", message_id="m1", caller="c")
    second = await tasks.send(
        "main", "second", message_id="m2", caller="c", context_id=first.context_id
    )
    canceled = await tasks.cancel(second.task_id, "c")
    assert canceled is not None and canceled.state is TaskState.CANCELED
    assert (await done(runner, first, "c")).state is TaskState.COMPLETED
    assert await transcript(runner, first.context_id) == ["first", "echo: first"]


async def test_a_full_queue_rejects_the_task(make: Make) -> None:
    runner = await make(agent={"backend": "echo", "delay_seconds": 1.5}, queue={"max_depth": 1})
    tasks = runner.agent_tasks
    first = await tasks.send("main", "one", message_id="m1", caller="c")
    ctx = first.context_id
    await tasks.send("main", "two", message_id="m2", caller="c", context_id=ctx)
    third = await tasks.send("main", "three", message_id="m3", caller="c", context_id=ctx)
    assert third.state is TaskState.REJECTED
    assert (await done(runner, first, "c")).state is TaskState.COMPLETED


async def test_subscribe_sees_working_then_completed(make: Make) -> None:
    runner = await make(agent={"backend": "echo", "delay_seconds": 1})
    tasks = runner.agent_tasks
    sent = await tasks.send("main", "hi", message_id="m1", caller="c")
    states = []
    async with asyncio.timeout(20):
        async for update in tasks.subscribe(sent.task_id, "c"):
            assert update.delta is None
            states.append(update.task.state)
    assert states[-1] is TaskState.COMPLETED
    assert TaskState.WORKING in states
    assert states.index(TaskState.WORKING) < len(states) - 1
    # Joining late: one update, the task as it stands.
    late = [u async for u in tasks.subscribe(sent.task_id, "c")]
    assert [u.task.state for u in late] == [TaskState.COMPLETED]
    assert [u async for u in tasks.subscribe(sent.task_id, "someone else")] == []


class StreamingAgent:
    """Streams a first part once the test listens (`listening`), then waits for the test
    to have seen it (`release`), then answers."""

    def __init__(self, listening: asyncio.Event, release: asyncio.Event) -> None:
        self.listening, self.release = listening, release

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        return TurnResult("unused")

    async def stream_turn(self, request: TurnRequest, on_text: Callable[[str], None]) -> TurnResult:
        await self.listening.wait()
        first = "streamed part one, long enough to be shown at once. "
        on_text(first)
        await self.release.wait()
        return TurnResult(first + "and the end.")

    async def close(self) -> None:
        return None


async def test_subscribe_sees_the_streamed_deltas(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    listening, release = asyncio.Event(), asyncio.Event()
    config = store_backend.apply(GatewayConfig.model_validate({"timezone": "UTC", **A2A_ON}))
    runner = GatewayRunner(
        config, [], agent_factory=lambda key: StreamingAgent(listening, release), home=tmp_path
    )
    await runner.start()
    try:
        tasks = runner.agent_tasks
        sent = await tasks.send("main", "stream it", message_id="m1", caller="c")
        deltas, states = [], []
        async with asyncio.timeout(20):
            async for update in tasks.subscribe(sent.task_id, "c"):
                listening.set()  # subscribed: what streams from now on reaches us
                if update.delta is not None:
                    deltas.append(update.delta)
                    release.set()
                else:
                    states.append(update.task.state)
        assert deltas and deltas[0].startswith("streamed part one")
        assert states[-1] is TaskState.COMPLETED
        final = await tasks.get(sent.task_id, "c")
        assert final is not None
        assert (
            final.result_text == "streamed part one, long enough to be shown at once. and the end."
        )
    finally:
        await runner.stop()


# --- durability ---------------------------------------------------------------------------------


async def test_get_after_a_restart(make: Make) -> None:
    runner = await make()
    sent = await runner.agent_tasks.send("main", "keep me", message_id="m1", caller="c")
    finished = await done(runner, sent, "c")
    await runner.stop()
    again = await make()
    assert await again.agent_tasks.get(sent.task_id, "c") == finished
    assert [t.task_id for t in await again.agent_tasks.list("c")] == [sent.task_id]


async def test_a_task_cut_off_by_a_stop_completes_after_the_restart(make: Make) -> None:
    slow = {"backend": "echo", "delay_seconds": 2, "restart_drain_timeout": 0}
    runner = await make(agent=slow)
    tasks = runner.agent_tasks
    sent = await tasks.send("main", "interrupted", message_id="m1", caller="c")
    await wait_for(lambda: _state_is(tasks, sent, TaskState.WORKING))
    await runner.stop()
    again = await make(agent={"backend": "echo"})
    finished = await done(again, sent, "c")
    assert finished.state is TaskState.COMPLETED
    assert finished.result_text == "echo: interrupted"
    assert await transcript(again, sent.context_id) == ["interrupted", "echo: interrupted"]


# --- delegation --------------------------------------------------------------------------------


class DelegatingAgent:
    """Main's turn asks agent `helper` through a native delegation and waits for it,
    holding its agent slot meanwhile (as `agent_call` does)."""

    runner: GatewayRunner | None = None
    chains: list[tuple[str, ...]] = []

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        assert self.runner is not None
        tasks = self.runner.agent_tasks
        chain = await tasks.running_chain(request.session_key)
        self.chains.append(chain)
        caller = f"session:{request.session_key}"
        task = await tasks.send(
            "helper", f"help with {request.text}", message_id="d1", caller=caller, chain=chain
        )
        async with asyncio.timeout(10):
            found = await tasks.wait(task.task_id, caller)
        assert found is not None
        return TurnResult(f"helper said: {found.result_text}")

    async def close(self) -> None:
        return None


async def test_only_a_native_delegation_runs_outside_the_agent_slots(make: Make) -> None:
    """A chain from outside (another gateway's delegation, over A2A) is checked for
    cycles but takes a slot like any chat: no caller can run turns past the limit."""
    runner = await make(agent={"backend": "echo", "delay_seconds": 1.0})
    tasks, chain = runner.agent_tasks, ("http://elsewhere/a2a/main",)
    remote = await tasks.send("main", "r", message_id="r1", caller="bearer", chain=chain)
    native = await tasks.send(
        "main", "n", message_id="n1", caller="session:agent:x:http:dm:c", chain=chain
    )
    keys = {
        f"agent:main:a2a:dm:{remote.context_id}": False,
        f"agent:main:a2a:dm:{native.context_id}": True,
    }
    await wait_for(lambda: all(key in runner.engine.running for key in keys), within=15)
    assert {key: runner.engine.running[key].source.is_bot for key in keys} == keys


async def test_a_delegation_does_not_wait_for_the_slot_its_caller_holds(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    settings = {
        "timezone": "UTC",
        "agent": {"backend": "echo", "max_concurrent_turns": 1},
        "agents": {"helper": {"backend": "echo"}},
        **A2A_ON,
    }
    config = store_backend.apply(GatewayConfig.model_validate(settings))
    agent = DelegatingAgent()
    agent.chains = []
    runner = GatewayRunner(config, [], agent_factory={"main": lambda key: agent}, home=tmp_path)
    agent.runner = runner
    await runner.start()
    try:
        tasks = runner.agent_tasks
        sent = await tasks.send("main", "the plan", message_id="m1", caller="bearer")
        finished = await done(runner, sent)
        assert finished.result_text == "helper said: echo: help with the plan"
        assert agent.chains == [("main",)]  # the running task's chain ends with its agent
        (delegated,) = await tasks.list(f"session:agent:main:a2a:dm:{sent.context_id}")
        assert delegated.chain == ("main",) and delegated.agent_id == "helper"
        assert await tasks.running_chain("agent:main:http:dm:nobody") == ()
    finally:
        await runner.stop()


# --- replicas -----------------------------------------------------------------------------------


Replicas = Callable[[float], Awaitable[list[GatewayRunner]]]


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    """Two replicas on one PostgreSQL schema, their echo agents taking `delay` seconds."""
    if pg_available() is not None:
        pytest.skip(pg_available() or "")
    runners: list[GatewayRunner] = []
    with fresh_schema() as dsn:

        async def start(delay: float) -> list[GatewayRunner]:
            for i in range(2):
                agent = {"backend": "echo", "delay_seconds": delay, "restart_drain_timeout": 1}
                settings = {
                    "timezone": "UTC",
                    "agent": agent,
                    "storage": {"backend": "postgres", "dsn": dsn},
                    "cluster": {"failover_seconds": 2},
                    **A2A_ON,
                }
                runner = GatewayRunner(
                    GatewayConfig.model_validate(settings), [], home=tmp_path / f"home{i}"
                )
                await runner.start()
                runners.append(runner)
            return runners

        try:
            yield start
        finally:
            for runner in runners:
                await runner.stop()


async def test_a_task_whose_session_runs_on_another_replica_completes(
    replicas: Replicas,
) -> None:
    """A task sent to B for a context whose turn runs on A is handed to A, and B's
    waiter sees it end (the shared row)."""
    a, b = await replicas(1)
    first = await a.agent_tasks.send("main", "on a", message_id="m1", caller="c")
    key = f"agent:main:a2a:dm:{first.context_id}"
    await wait_for(lambda: a.is_busy(key))
    second = await b.agent_tasks.send(
        "main", "via b", message_id="m2", caller="c", context_id=first.context_id
    )
    async with asyncio.timeout(20):
        finished = await b.agent_tasks.wait(second.task_id, "c")
    assert finished is not None and finished.state is TaskState.COMPLETED
    assert finished.result_text == "echo: via b"
    assert not b.is_busy(key)  # it ran on A
    assert await transcript(a, first.context_id) == ["on a", "echo: on a", "via b", "echo: via b"]


async def test_a_cancel_sent_to_another_replica_stops_the_turn(replicas: Replicas) -> None:
    a, b = await replicas(30)
    sent = await a.agent_tasks.send("main", "hang on", message_id="m1", caller="c")
    key = f"agent:main:a2a:dm:{sent.context_id}"
    await wait_for(lambda: _state_is(a.agent_tasks, sent, TaskState.WORKING))
    canceled = await b.agent_tasks.cancel(sent.task_id, "c")
    assert canceled is not None and canceled.state is TaskState.CANCELED
    await wait_for(lambda: not a.is_busy(key))
    assert await transcript(a, sent.context_id) == ["hang on"]


async def test_a_task_canceled_on_another_replica_before_its_turn_never_runs(
    replicas: Replicas,
) -> None:
    a, b = await replicas(1)
    first = await a.agent_tasks.send("main", "first", message_id="m1", caller="c")
    ctx = first.context_id
    second = await a.agent_tasks.send("main", "second", message_id="m2", caller="c", context_id=ctx)
    assert second.state is TaskState.SUBMITTED  # waits behind the first, on A
    canceled = await b.agent_tasks.cancel(second.task_id, "c")
    assert canceled is not None and canceled.state is TaskState.CANCELED
    assert (await done(a, first, "c")).state is TaskState.COMPLETED
    await wait_for(lambda: not a.is_busy(f"agent:main:a2a:dm:{ctx}"))
    # Begun by the first's finish (its message stored), never run: no answer.
    assert (await transcript(a, ctx))[:2] == ["first", "echo: first"]
    assert "echo: second" not in await transcript(a, ctx)
    assert (await a.agent_tasks.get(second.task_id, "c")) == canceled


# --- deletion -----------------------------------------------------------------------------------


async def test_deleting_a_session_or_a_caller_deletes_their_tasks(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    one = await done(runner, await tasks.send("main", "one", message_id="m1", caller="c"), "c")
    two = await done(runner, await tasks.send("main", "two", message_id="m2", caller="c"), "c")
    other = await done(runner, await tasks.send("main", "x", message_id="m1", caller="d"), "d")

    def session_of(context_id: str) -> Any:
        return lambda conn: conn.execute(
            "SELECT session_id FROM sessions WHERE session_key = ?",
            (f"agent:main:a2a:dm:{context_id}",),
        ).fetchone()[0]

    deleted = await runner.delete_session(await runner.store.read(session_of(one.context_id)))
    assert deleted["rows"]["agent_tasks"] == 1
    assert [t.task_id for t in await tasks.list("c")] == [two.task_id]
    await runner.recall.forget_user("a2a", "c")
    assert await tasks.list("c") == []
    assert [t.task_id for t in await tasks.list("d")] == [other.task_id]


async def test_a_context_is_its_callers_alone(make: Make) -> None:
    runner = await make()
    tasks = runner.agent_tasks
    mine = await done(runner, await tasks.send("main", "secret", message_id="m", caller="c"), "c")
    with pytest.raises(TaskRefused, match="no context"):
        await tasks.send(
            "main", "what did they say?", message_id="m", caller="d", context_id=mine.context_id
        )
    assert await tasks.list("d") == []
    assert await transcript(runner, mine.context_id) == ["secret", "echo: secret"]


# --- input-required -----------------------------------------------------------------------------


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


async def test_a_turn_waiting_for_an_approval_is_input_required_until_answered(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    config = store_backend.apply(GatewayConfig.model_validate({"timezone": "UTC", **A2A_ON}))
    agent = AskingAgent()
    runner = GatewayRunner(config, [], agent_factory=lambda key: agent, home=tmp_path)
    agent.runner = runner
    await runner.start()
    try:
        tasks = runner.agent_tasks
        sent = await tasks.send("main", "go", message_id="m1", caller="c")
        await wait_for(lambda: _state_is(tasks, sent, TaskState.INPUT_REQUIRED))
        waiting = await tasks.get(sent.task_id, "c")
        assert waiting is not None and "launch" in (waiting.result_text or "")
        answer = await tasks.send(
            "main", "/approve", message_id="m2", caller="c", context_id=sent.context_id
        )
        assert answer.task_id == sent.task_id  # the answer, not a task of its own
        finished = await done(runner, sent, "c")
        assert finished.state is TaskState.COMPLETED
        assert finished.result_text == "verdict: approved"
        assert [t.task_id for t in await tasks.list("c")] == [sent.task_id]
    finally:
        await runner.stop()
