"""A kill -9 of a real daemon while an A2A task's turn runs: after the restart the task
completes once. The unmodified a2a-sdk client sends the message (returning at once),
waits until the task is working, the daemon is killed, and after the restart `GetTask`
shows the task completed with its reply, `ListTasks` lists it once, and its session's
transcript holds one user message and one reply."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb

from scripts.harness import free_port
from tests.a2a_support import message, reply_of, send
from tests.commandline import finish, spawn, wait_ready
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


async def client_of(http: httpx.AsyncClient, url: str) -> Client:
    config = ClientConfig(streaming=False, httpx_client=http)
    return await ClientFactory(config).create_from_url(f"{url}/a2a/main")


async def reaches(url: str, task_id: str, state: int) -> bool:
    """Whether the task is in `state` now (False while the daemon does not answer)."""
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            task = await (await client_of(http, url)).get_task(pb.GetTaskRequest(id=task_id))
    except Exception:  # the daemon is starting: asked again
        await asyncio.sleep(0.1)
        return False
    return task.status.state == state


async def test_a_task_cut_off_by_kill_9_completes_once_after_the_restart(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The echo agent thinks for 2 s: long enough to kill it while its turn runs.
    (tmp_path / "hermes.yaml").write_text(
        f"platforms:\n  http:\n    enabled: true\n    port: {port}\n"
        "agent:\n  backend: echo\n  delay_seconds: 2\n"
        "a2a:\n  enabled: true\n"
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        daemon = spawn(tmp_path, "run")
        procs.append(daemon)
        await asyncio.to_thread(wait_ready, daemon)
        async with httpx.AsyncClient(timeout=30) as http:
            sent = message("survive the crash", message_id="m-crash-1")
            (event,) = await send(await client_of(http, url), sent, return_immediately=True)
        task_id = event.task.id
        await wait_for(lambda: reaches(url, task_id, pb.TASK_STATE_WORKING), within=30)
        daemon.kill()  # SIGKILL: kill -9, mid-turn
        daemon.wait(timeout=10)

        again = spawn(tmp_path, "run")
        procs.append(again)
        await asyncio.to_thread(wait_ready, again)
        await wait_for(lambda: reaches(url, task_id, pb.TASK_STATE_COMPLETED), within=60)
        async with httpx.AsyncClient(timeout=30) as http:
            a2a = await client_of(http, url)
            task = await a2a.get_task(pb.GetTaskRequest(id=task_id))
            listed = await a2a.list_tasks(pb.ListTasksRequest(context_id=task.context_id))
            # the same message sent again is the same task, not a second turn
            (resent,) = await send(a2a, sent)
        assert reply_of(task) == "echo: survive the crash"
        assert [t.id for t in listed.tasks] == [task_id]
        assert resent.task.id == task_id
        code, out = await asyncio.to_thread(finish, again)
        assert code == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    db = sqlite3.connect(f"file:{tmp_path / 'sessions' / 'state.db'}?mode=ro", uri=True)
    with db:
        (key,) = db.execute("SELECT session_key FROM agent_tasks").fetchone()
        roles = [
            role
            for (role,) in db.execute(
                "SELECT m.role FROM messages m JOIN sessions s ON s.session_id = m.session_id "
                "WHERE s.session_key = ? ORDER BY m.id",
                (key,),
            )
        ]
    db.close()
    assert roles == ["user", "assistant"]
