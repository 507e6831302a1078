"""`agent_call` across a kill -9: a real daemon subprocess, killed while its delegate's
turn waits for the model. On restart the calling turn resumes, runs the delegation again
with the same message id, and the delegate's dedup makes it the same task: one task, one
user message in the delegate's session, and the caller's reply carries the delegate's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from scripts.harness import Daemon
from tests.fakes.openai_server import FakeOpenAI
from tests.test_agent_call import Models
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def models() -> Models:
    return Models()


@pytest.fixture
async def fake(models: Models) -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(reply=models) as server:
        yield server


def settings(fake: FakeOpenAI) -> str:
    def agent(model: str, delegates: list[str]) -> str:
        return json.dumps(
            {
                "backend": "openai",
                "base_url": fake.base_url,
                "model": model,
                "delegates": delegates,
                "system_prompt": f"You are {model}.",
            }
        )

    return (
        f"timezone: UTC\nagent: {agent('main', ['researcher'])}\n"
        f"agents:\n  researcher: {agent('researcher', [])}\n"
    )


async def test_a_delegation_cut_by_kill_9_is_one_task_after_the_restart(
    tmp_path: Path, fake: FakeOpenAI, models: Models
) -> None:
    daemon = Daemon(tmp_path / "home", settings(fake))
    try:
        await asyncio.to_thread(daemon.start)
        release = fake.hold(lambda body: body["model"] == "researcher")
        models.call("main", "researcher", "dig")
        await asyncio.to_thread(daemon.post, "c1", "go")
        await wait_for(lambda: fake.held, within=30)  # the delegate's turn asks its model
        await asyncio.to_thread(daemon.kill9)
        release.set()

        await asyncio.to_thread(daemon.start)
        replies = await asyncio.to_thread(daemon.wait_replies, "c1", 1, 60.0)
        assert [r["text"] for r in replies] == ["main got: researcher: dig (turn 1)"]
        await asyncio.to_thread(daemon.stop)
    finally:
        await asyncio.to_thread(daemon.ensure_stopped)

    conn = daemon.db()
    try:
        tasks = conn.execute("SELECT agent_id, state, request_text FROM agent_tasks").fetchall()
        (context,) = conn.execute("SELECT DISTINCT context_id FROM agent_tasks").fetchone()
    finally:
        conn.close()
    assert tasks == [("researcher", "completed", "dig")]
    delegate_session = daemon.transcript(f"agent:researcher:a2a:dm:{context}")
    assert [content for role, content in delegate_session if role == "user"] == ["dig"]
    # the delegate's model was asked before the kill and again after it: the task ran once
    asked = [r for r in fake.requests if r["json"].get("model") == "researcher"]
    assert len(asked) == 2
