"""Two real daemons (`hermes-gateway run` subprocesses) working together over A2A: the
first one's agent delegates with `agent_call` to a remote agent that is the second
daemon's, through its A2A server, and reads the reply as the tool's result; a second
delegation from the same chat continues the same remote conversation; a chain that would
come back to the first daemon (main -> peer -> back to main) is refused on the second
daemon as a cycle, seen across the two by the agents' URLs.

Both agents are on the openai backend against one fake OpenAI server in this process,
each driven by its own script (the fake tells them apart by the request's model)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scripts.harness import Daemon
from tests.fakes.openai_server import FakeOpenAI
from tests.test_agent_call import Models

pytestmark = pytest.mark.timeout(120)


def agent_yaml(fake: FakeOpenAI, model: str, delegates: list[str]) -> str:
    return (
        "agent:\n"
        "  backend: openai\n"
        f"  base_url: {fake.base_url}\n"
        f"  model: {model}\n"
        f"  system_prompt: You are {model}.\n"
        f"  delegates: {json.dumps(delegates)}\n"
    )


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[Daemon, Daemon, Models]]:
    models = Models()
    async with FakeOpenAI(reply=models) as fake:
        first = Daemon(tmp_path / "first")
        second = Daemon(tmp_path / "second")
        (first.home / "hermes.yaml").write_text(
            f"platforms:\n  http:\n    enabled: true\n    port: {first.port}\n"
            + agent_yaml(fake, "orch", ["peer"])
            + "a2a:\n  enabled: true\n"
            + f"remote_agents:\n  peer:\n    url: {second.url}/a2a/main\n"
        )
        (second.home / "hermes.yaml").write_text(
            f"platforms:\n  http:\n    enabled: true\n    port: {second.port}\n"
            + agent_yaml(fake, "helper", ["back"])
            + "a2a:\n  enabled: true\n"
            + f"remote_agents:\n  back:\n    url: {first.url}/a2a/main\n"
        )
        try:
            await asyncio.gather(asyncio.to_thread(second.start), asyncio.to_thread(first.start))
            yield first, second, models
        finally:
            for daemon in (first, second):
                if daemon.alive():
                    await asyncio.to_thread(daemon.stop)
                daemon.ensure_stopped()


async def say(daemon: Daemon, text: str, count: int, chat: str = "c1") -> str:
    """Post `text` to `chat` and return its `count`-th reply (bounded wait)."""
    await asyncio.to_thread(daemon.post, chat, text)
    replies = await asyncio.to_thread(daemon.wait_replies, chat, count, 60.0)
    assert len(replies) >= count, f"no reply {count} in {chat}: {replies}"
    return replies[count - 1]["text"]


def tasks_of(daemon: Daemon) -> list[tuple[str, str, str]]:
    """The second daemon's stored tasks: (context, state, chain JSON), oldest first."""
    path = daemon.home / "sessions" / "state.db"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute(
            "SELECT context_id, state, chain FROM agent_tasks ORDER BY created_at"
        ).fetchall()


async def test_a_daemon_delegates_to_another_and_keeps_one_remote_context_per_chat(
    pair: tuple[Daemon, Daemon, Models],
) -> None:
    first, second, models = pair
    models.call("orch", "peer", "find the moon")
    assert await say(first, "ask the peer", 1) == "orch got: helper: find the moon (turn 1)"
    models.call("orch", "peer", "and the sun")
    assert await say(first, "again", 2) == "orch got: helper: and the sun (turn 2)"
    models.call("orch", "peer", "find mars")
    assert await say(first, "ask", 1, chat="c2") == "orch got: helper: find mars (turn 1)"

    tasks = tasks_of(second)
    assert [state for _, state, _ in tasks] == ["completed"] * 3
    contexts = [context for context, _, _ in tasks]
    assert contexts[0] == contexts[1] != contexts[2]
    # the chain the first daemon sent: its own agent, named by its A2A URL
    assert json.loads(tasks[0][2]) == [f"{first.url}/a2a/main"]


async def test_a_cycle_back_to_the_first_daemon_is_refused_on_the_second(
    pair: tuple[Daemon, Daemon, Models],
) -> None:
    first, second, models = pair
    models.call("orch", "peer", "loop")
    models.call("helper", "back", "loop again")
    reply = await say(first, "start the loop", 1)
    assert reply.startswith("orch got: helper got: "), reply
    assert "cycle" in reply, reply
    # the second daemon's task completed (the refusal was its model's tool result), and
    # the first never got a task back: the second refused before calling it
    assert [state for _, state, _ in tasks_of(second)] == ["completed"]
    path = first.home / "sessions" / "state.db"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("SELECT count(*) FROM agent_tasks").fetchone() == (0,)
