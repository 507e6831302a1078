"""Agent tasks across kill -9 (gateway.runner.agent_tasks): a runner in a process of its
own sends a task and is killed at a crash point (HERMES_CRASH_AT, as kill -9 would);
the next start completes the task exactly once, or, when every start dies running its
turn, the stuck-loop guard fails it. SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.domain.agent_tasks import TaskState
from gateway.run import GatewayRunner
from gateway.runner.agent_tasks import task_id_of
from tests.pg_support import StorageBackend
from tests.test_agent_tasks import A2A_ON, transcript

CHILD = """
import asyncio, json, sys
from pathlib import Path
from config import GatewayConfig
from gateway.run import GatewayRunner

async def main():
    config = GatewayConfig.model_validate(json.loads(sys.argv[2]))
    runner = GatewayRunner(config, [], home=Path(sys.argv[1]))
    await runner.start()
    await runner.agent_tasks.send(
        "main", "survive", message_id="k1", caller="c", context_id="ctx-k"
    )
    await asyncio.sleep(60)  # the crash point kills the process before this ends

asyncio.run(main())
"""


def run_until_killed(
    home: Path, settings: dict[str, Any], point: str
) -> subprocess.CompletedProcess[str]:
    """A runner in a process of its own that sends a task and is killed (SIGKILL, as
    kill -9) at the crash point."""
    env = {**os.environ, "HERMES_CRASH_AT": f"{point}:1", "HERMES_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(home), json.dumps(settings)],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("point", ["after_turn_begin", "before_ledger_mark"])
async def test_a_task_cut_off_by_kill_9_completes_once(
    tmp_path: Path, store_backend: StorageBackend, point: str
) -> None:
    settings: dict[str, Any] = {"timezone": "UTC", "agent": {"backend": "echo"}, **A2A_ON}
    if store_backend.postgres:
        settings["storage"] = store_backend.storage()
        # The killed process's session lease lapses soon: the restart takes its turn over.
        settings["cluster"] = {"failover_seconds": 2}
    home = tmp_path / "home"
    child = await asyncio.to_thread(run_until_killed, home, settings, point)
    assert child.returncode == -signal.SIGKILL, child.stderr

    config = store_backend.apply(GatewayConfig.model_validate(settings))
    runner = GatewayRunner(config, [], home=home)
    await runner.start()
    try:
        tasks = runner.agent_tasks
        task_id = task_id_of("main", "c", "k1")
        async with asyncio.timeout(20):
            finished = await tasks.wait(task_id, "c")
        assert finished is not None and finished.state is TaskState.COMPLETED
        assert finished.result_text == "echo: survive"
        # Resent after the crash: the same task, no second turn.
        again = await tasks.send("main", "survive", message_id="k1", caller="c")
        assert again.task_id == task_id and again.state is TaskState.COMPLETED
        assert await transcript(runner, "ctx-k") == ["survive", "echo: survive"]
    finally:
        await runner.stop()


async def test_a_task_whose_turn_kills_every_start_fails_once_given_up(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """The stuck-loop guard: a turn cut off by a crash at every start is given up on,
    and its task fails with the notice the chat would get."""
    settings: dict[str, Any] = {"timezone": "UTC", "agent": {"backend": "echo"}, **A2A_ON}
    if store_backend.postgres:
        settings["storage"] = store_backend.storage()
        settings["cluster"] = {"failover_seconds": 1}
    home = tmp_path / "home"
    for _ in range(3):
        child = await asyncio.to_thread(run_until_killed, home, settings, "after_turn_begin")
        assert child.returncode == -signal.SIGKILL, child.stderr
    config = store_backend.apply(GatewayConfig.model_validate(settings))
    runner = GatewayRunner(config, [], home=home)
    await runner.start()
    try:
        async with asyncio.timeout(20):
            failed = await runner.agent_tasks.wait(task_id_of("main", "c", "k1"), "c")
        assert failed is not None and failed.state is TaskState.FAILED
        assert failed.error and failed.result_text is None
        assert "echo: survive" not in await transcript(runner, "ctx-k")
    finally:
        await runner.stop()
