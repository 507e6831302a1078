"""The A2A server (gateway/a2a/, docs/a2a.md) through the unmodified a2a-sdk client: the
card, sending and streaming, contexts, reading, cancelling and following tasks, a task
waiting for an approval. The harness is tests/a2a_support.py; the endpoint's own
behaviour (auth, 0.3, bad input, shutdown, restarts) is tests/test_a2a_endpoint.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from a2a.client import A2ACardResolver
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import A2AError, TaskNotFoundError

from tests.a2a_support import TOKEN, A2aGateway, message, reply_of, send
from tests.test_agent_tasks import AskingAgent
from tests.waiting import wait_for


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[A2aGateway]:
    running = await A2aGateway.started(tmp_path)
    yield running
    await running.stop()


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


async def test_a_card_names_the_address_it_was_asked_at(gateway: A2aGateway) -> None:
    path = "/a2a/main/.well-known/agent-card.json"
    async with gateway.httpx() as http:
        named = await http.get(gateway.url + path, headers={"Host": "agents.example:8642"})
        odd = await http.get(gateway.url + path, headers={"Host": "x y/<z>"})
    assert named.json()["url"] == "http://agents.example:8642/a2a/main"
    assert odd.json()["url"] == f"{gateway.url}/a2a/main"  # not repeated: the socket's


async def test_a_card_names_the_public_url_when_one_is_set(tmp_path: Path) -> None:
    running = await A2aGateway.started(tmp_path, a2a={"public_url": "https://agents.example/"})
    try:
        async with running.httpx() as http:
            card = (await http.get(f"{running.url}/.well-known/agent-card.json")).json()
    finally:
        await running.stop()
    assert card["url"] == "https://agents.example/a2a/main"


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
    # The helper's task, asked of main, is no task here either.
    with pytest.raises(TaskNotFoundError):
        await client.get_task(pb.GetTaskRequest(id=helpers.task.id))
    with pytest.raises(TaskNotFoundError):
        await client.cancel_task(pb.CancelTaskRequest(id=helpers.task.id))
    with pytest.raises(TaskNotFoundError):
        streaming = await gateway.client()
        async for _ in streaming.subscribe(pb.SubscribeToTaskRequest(id=helpers.task.id)):
            pass


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
