"""Scheduled jobs against the real daemon (a subprocess, the HTTP API as the chat platform):
an `in 2s` reminder delivered once, the CLI beside the running daemon (picked up within a
second), and kill -9 right after a run was claimed: never two replies.

Each test owns its home and port, and stops what it starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from scripts.harness import Daemon, home_env, parse_metrics
from tests.waiting import wait_blocking

pytestmark = pytest.mark.timeout(90)

SETTINGS = (
    "timezone: UTC\nstorage:\n  mirror_interval_seconds: 0.1\nschedules:\n  min_interval: 1\n"
)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for daemon in made:
        daemon.ensure_stopped()


def make(daemons: list[Daemon], home: Path, delay: float = 0) -> Daemon:
    daemon = Daemon(home, f"agent:\n  backend: echo\n  delay_seconds: {delay}\n{SETTINGS}")
    daemons.append(daemon)
    return daemon


def cli(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "schedules", *args],
        env=home_env(daemon.home),
        capture_output=True,
        text=True,
        timeout=30,
    )


def cli_json(daemon: Daemon, *args: str) -> Any:
    done = cli(daemon, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def runs_of(daemon: Daemon, schedule_id: str) -> list[tuple[str, float]]:
    conn = daemon.db()
    try:
        return conn.execute(
            "SELECT status, fire_time FROM schedule_runs WHERE schedule_id = ? ORDER BY fire_time",
            (schedule_id,),
        ).fetchall()
    finally:
        conn.close()


def wait_for_running_run(daemon: Daemon, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = daemon.db()
        try:
            row = conn.execute(
                "SELECT schedule_id FROM schedule_runs WHERE status = 'running'"
            ).fetchone()
        finally:
            conn.close()
        if row:
            return row[0]
        time.sleep(0.02)
    raise AssertionError(f"no run was claimed: {daemon.log_tail()}")


def test_an_in_2s_reminder_is_delivered_once_to_its_chat(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home")
    daemon.start()
    daemon.post("c1", "/schedule add in 2s stand up and stretch", message_id="m1")
    (ack,) = daemon.wait_replies("c1", 1)
    assert ack["text"].startswith("Scheduled sch_")
    replies = daemon.wait_replies("c1", 2, timeout=10)
    assert "stand up and stretch" in replies[1]["text"]
    ok_runs = 'hermes_schedule_runs_total{status="ok"}'
    wait_blocking(lambda: parse_metrics(urlopen_text(daemon, "/metrics")).get(ok_runs) == 1)
    (listed,) = cli_json(daemon, "list")
    assert listed["status"] == "done" and listed["next_run_at"] is None
    assert daemon.stop() == 0
    # Stopped: the ledger holds every reply it ever sends, a second delivery included.
    assert len(daemon.sent_texts("c1")) == 2
    assert daemon.sent_texts("c2") == []


def urlopen_text(daemon: Daemon, path: str) -> str:
    with urllib.request.urlopen(f"{daemon.url}{path}", timeout=5) as resp:
        return resp.read().decode()


# Some fifteen CLI runs, each an interpreter start: minutes on a loaded machine.
@pytest.mark.timeout(480)
def test_the_cli_adds_lists_and_removes_beside_the_running_daemon(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home")
    daemon.start()
    added = cli_json(daemon, "add", "--chat", "http:c9", "in 1s", "from", "the", "operator")
    assert added["status"] == "active" and added["platform"] == "http"
    # Picked up at its fire time, not at a later pass of a slow poll (within a bound a
    # loaded machine meets).
    (reply,) = daemon.wait_replies("c9", 1, timeout=10)
    assert "from the operator" in reply["text"]
    # The run's row is final before the CLI is asked (one interpreter start, not a poll).
    wait_blocking(lambda: [s for s, _ in runs_of(daemon, added["id"])] == ["ok"])
    (run,) = cli_json(daemon, "runs", added["id"])
    assert set(run) >= {"status", "fire_time", "started_at", "finished_at", "output_summary"}
    assert run["status"] == "ok" and "from the operator" in run["output_summary"]
    fire = _epoch(run["fire_time"])
    assert 0 <= _epoch(run["started_at"]) - fire < 5

    every = cli_json(daemon, "add", "--chat", "http:c9", "every 1h", "hourly", "check")
    listed = cli_json(daemon, "list")
    assert [s["id"] for s in listed] == [added["id"], every["id"]]
    for schedule in listed:
        assert set(schedule) >= {
            *("id", "platform", "chat_id", "prompt", "cadence", "status", "next_run_at"),
        }
    assert listed[1]["cadence"] == "every 1h" and listed[1]["next_run_at"].endswith("+00:00")
    # `hermes-gateway status` shows the next fire time (status.json: rewritten within 5 s,
    # waited for here before the one `status` run).
    wait_blocking(lambda: next_schedule(daemon) == every["id"], within=15)
    status = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "status"],
        env=home_env(daemon.home),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert f"next scheduled run: {listed[1]['next_run_at']} ({every['id']})" in status, status
    assert cli(daemon, "pause", every["id"]).returncode == 0
    assert cli_json(daemon, "list")[1]["status"] == "paused"
    assert cli(daemon, "remove", every["id"]).returncode == 0
    assert [s["id"] for s in cli_json(daemon, "list")] == [added["id"]]
    missing = cli(daemon, "remove", every["id"])
    assert missing.returncode == 1 and "no schedule" in missing.stderr
    refused = cli(daemon, "add", "--chat", "http:c9", "at 2001-01-01 09:00", "late")
    assert refused.returncode == 1 and "is in the past" in refused.stderr
    unknown = cli(daemon, "add", "--chat", "http:c9", "--agent", "nobody", "in 1h", "x")
    assert unknown.returncode == 1 and "unknown agent 'nobody'" in unknown.stderr
    # Nowhere to deliver: a platform this gateway does not enable, no home channel.
    disabled = cli(daemon, "add", "--chat", "telegram:55", "in 1h", "x")
    assert disabled.returncode == 1
    assert "add: telegram is not enabled in this gateway" in disabled.stderr
    assert "(enabled: http; platforms.telegram.enabled)" in disabled.stderr
    homeless = cli(daemon, "add", "--home-channel", "http", "in 1h", "x")
    assert homeless.returncode == 1 and "http has no home channel" in homeless.stderr
    assert [s["id"] for s in cli_json(daemon, "list")] == [added["id"]]
    daemon.stop()


def next_schedule(daemon: Daemon) -> str | None:
    """The schedule id status.json names as the next to run (None before it does)."""
    try:
        upcoming = json.loads((daemon.home / "status.json").read_text()).get("next_schedule")
    except (FileNotFoundError, ValueError):
        return None
    return upcoming.get("schedule_id") if isinstance(upcoming, dict) else None


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_kill9_right_after_the_claim_gives_one_reply_after_restart(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home")
    daemon.start(env={"HERMES_CRASH_AT": "after_schedule_claim:1"})
    daemon.post("c1", "/schedule add in 1s exactly once", message_id="m1")
    daemon.wait_replies("c1", 1)
    assert daemon.wait_exit(timeout=15) == -9  # killed itself at the claim
    schedule_id = wait_for_running_run(daemon)

    daemon.start()  # no crash point this time
    replies = daemon.wait_replies("c1", 2, timeout=15)
    assert daemon.stop() == 0
    # Stopped: the ledger holds every reply it ever sends, a duplicate included.
    texts = daemon.sent_texts("c1")
    assert len(texts) == 2 and "exactly once" in texts[1]
    assert replies[1]["text"] == texts[1]
    assert [status for status, _ in runs_of(daemon, schedule_id)] == ["ok"]


def test_kill9_during_a_slow_run_never_replies_twice(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = make(daemons, tmp_path / "home", delay=1.5)
    daemon.start()
    daemon.post("c1", "/schedule add every 2s tick", message_id="m1")
    daemon.wait_replies("c1", 1)
    schedule_id = wait_for_running_run(daemon)
    (fire_time,) = [f for status, f in runs_of(daemon, schedule_id) if status == "running"]
    daemon.kill9()

    daemon.start()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        statuses = {f: s for s, f in runs_of(daemon, schedule_id)}
        if statuses.get(fire_time) in ("ok", "interrupted"):
            break
        time.sleep(0.1)
    assert daemon.stop() == 0  # running turns finish first
    rows = runs_of(daemon, schedule_id)
    conn = daemon.db()
    try:
        texts = [
            text
            for (text,) in conn.execute(
                "SELECT text FROM outbound WHERE chat_id = 'c1' AND state = 'sent' ORDER BY id"
            )
        ]
    finally:
        conn.close()
    assert [f for _, f in rows].count(fire_time) == 1  # that fire time ran once
    assert dict((f, s) for s, f in rows)[fire_time] in ("ok", "interrupted")
    # One reply per run that ended ok: none was sent twice.
    ticks = [t for t in texts if t.startswith("echo: [Scheduled task")]
    assert len(ticks) == sum(1 for s, _ in rows if s == "ok")
