"""Idle means idle: a daemon with nothing to do writes nothing into its home, and
`hermes-gateway status` still knows it is alive from a once-a-minute heartbeat."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.ops.status import STATUS_FILE, is_live, keep_status, read_status, write_status
from scripts.bench_idle import measure_idle, wait_settled
from scripts.harness import Daemon
from tests.waiting import wait_for

# Longer than the status check (5 s), which must not rewrite status.json each time, and
# than 20 rounds of the search indexer (0.25 s), which must not commit each time. Short of
# the status heartbeat (60 s after start-up), which touches the file's mtime.
IDLE_WINDOW_SECONDS = 6.0
# Idle starts this long after a message's effects landed: the log trim the index round
# hands the writer, and the checkpoint after it, follow within 0.1-0.25 s.
SETTLE_SECONDS = 1.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    made = Daemon(tmp_path / "home", "storage:\n  mirror_interval_seconds: 0.1\n")
    made.log_path = tmp_path / "daemon.log"  # stderr, not part of the home's writes
    yield made
    made.ensure_stopped()


@pytest.mark.timeout(60)
def test_an_idle_daemon_writes_nothing_into_its_home(daemon: Daemon) -> None:
    daemon.start()
    daemon.post("idle", "hello before the quiet", message_id="m1")
    assert daemon.wait_replies("idle", 1), daemon.log_tail()
    wait_settled(daemon, "agent:main:http:dm:idle")
    time.sleep(SETTLE_SECONDS)  # the definition of idle, not a synchronisation
    assert daemon.proc is not None
    report = measure_idle(daemon.proc.pid, daemon.home, IDLE_WINDOW_SECONDS)
    assert report.changed_files == {}, "\n".join(report.lines())
    assert report.write_bytes < 4096, "\n".join(report.lines())
    assert report.growth_bytes == 0, "\n".join(report.lines())


def _status_file(home: Path) -> dict[str, Any]:
    return json.loads((home / STATUS_FILE).read_text())


async def test_status_is_rewritten_on_change_and_only_touched_otherwise(tmp_path: Path) -> None:
    turns = 0
    started = time.monotonic()

    def snapshot() -> dict[str, Any]:
        # The uptime differs at every call, as the runner's does.
        uptime = time.monotonic() - started
        return {"state": "running", "active_turns": turns, "health": {"uptime_seconds": uptime}}

    path = tmp_path / STATUS_FILE
    task = asyncio.create_task(keep_status(tmp_path, snapshot, interval=0.01, heartbeat=0.3))
    try:
        await wait_for(path.exists)
        first = _status_file(tmp_path)
        mtime = path.stat().st_mtime_ns
        await wait_for(lambda: path.stat().st_mtime_ns != mtime)  # the heartbeat
        assert _status_file(tmp_path) == first  # touched, not rewritten
        turns = 1
        await wait_for(lambda: _status_file(tmp_path)["active_turns"] == 1)
        assert _status_file(tmp_path)["written_at"] > first["written_at"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_heartbeat_a_minute_old_is_live_and_two_missed_are_not(tmp_path: Path) -> None:
    write_status(tmp_path, {"state": "running"})  # this test's pid: a live process
    path = tmp_path / STATUS_FILE
    data = _status_file(tmp_path)
    data["written_at"] = time.time() - 3600  # written an hour ago, idle since
    path.write_text(json.dumps(data))
    beat = time.time() - 65  # the last heartbeat, a minute ago
    os.utime(path, (beat, beat))
    status = read_status(tmp_path)
    assert status is not None and is_live(status)
    gone = time.time() - 200  # no heartbeat for over three minutes: hung or gone
    os.utime(path, (gone, gone))
    status = read_status(tmp_path)
    assert status is not None and not is_live(status)
