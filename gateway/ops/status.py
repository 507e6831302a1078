"""`$HERMES_HOME/status.json` and `hermes-gateway status`.

The daemon looks at its health (each adapter's real state, queue depth, running turns)
every few seconds and rewrites the file only when that changed, and once more when it
stops. An idle daemon rewrites nothing: once a minute it only touches the file's mtime
(a heartbeat, no data written). `status` reads the file, so it works whichever
platforms are enabled, and tells a stale file (a daemon that died or hangs) from a live
one by the pid and the last heartbeat.

Exit codes of `status`: 0 running, 3 not running (like `systemctl status`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from config import GatewayConfig, hermes_home
from gateway.store.outage import Outage
from gateway.util.fsutil import atomic_write_bytes, overwrite_in_place

log = structlog.get_logger("gateway.ops.status")

STATUS_FILE = "status.json"
CHECK_INTERVAL_SECONDS = 5.0  # how often the daemon compares its health with the file
HEARTBEAT_SECONDS = 60.0  # with nothing changed, the file's mtime is touched this often
# Two heartbeats missed: the daemon is gone or hung, even if its pid lives.
STALE_AFTER_SECONDS = 2 * HEARTBEAT_SECONDS + CHECK_INTERVAL_SECONDS
EXIT_NOT_RUNNING = 3


def write_status(home: Path, snapshot: dict[str, Any]) -> None:
    data = {**snapshot, "pid": os.getpid(), "written_at": time.time()}
    encoded = json.dumps(data, indent=1).encode()
    try:
        atomic_write_bytes(home / STATUS_FILE, encoded)
    except OSError as exc:
        # A full disk has no room for the temp file, but `status` must still be able to
        # tell the operator so: the old file's block takes the new content.
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not (home / STATUS_FILE).exists():
            raise
        overwrite_in_place(home / STATUS_FILE, encoded)


def _lasting(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The snapshot without the uptime, which changes every time it is taken (`status`
    adds the time since `written_at` to the uptime the file holds)."""
    health = snapshot.get("health")
    if not isinstance(health, dict):
        return snapshot
    return {**snapshot, "health": {k: v for k, v in health.items() if k != "uptime_seconds"}}


def _heartbeat(home: Path, snapshot: dict[str, Any]) -> None:
    try:
        os.utime(home / STATUS_FILE)
    except FileNotFoundError:  # removed by hand: write it again
        write_status(home, snapshot)


async def keep_status(
    home: Path,
    snapshot: Callable[[], dict[str, Any]],
    interval: float = CHECK_INTERVAL_SECONDS,
    heartbeat: float = HEARTBEAT_SECONDS,
) -> None:
    """Keep the status file current from `snapshot()` until cancelled (off the event
    loop): rewritten when something other than the uptime changed, touched every
    `heartbeat` seconds otherwise. A disk that refuses the write (read-only) is logged
    once a minute and tried again."""
    failing = Outage(log, "status_file_write_failed", path=str(home / STATUS_FILE))
    written: dict[str, Any] | None = None
    beat = time.monotonic()
    while True:
        current = snapshot()
        try:
            if _lasting(current) != written:
                await asyncio.to_thread(write_status, home, current)
                written, beat = _lasting(current), time.monotonic()
            elif time.monotonic() - beat >= heartbeat:
                await asyncio.to_thread(_heartbeat, home, current)
                beat = time.monotonic()
        except OSError as exc:
            failing.failed(str(exc))
        else:
            failing.ended()
        await asyncio.sleep(interval)


def read_status(home: Path) -> dict[str, Any] | None:
    """The status file, with `seen_at`: its last write or heartbeat (Unix time)."""
    path = home / STATUS_FILE
    try:
        data = json.loads(path.read_text())
        mtime = path.stat().st_mtime
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    written = data.get("written_at")
    data["seen_at"] = max(mtime, written) if isinstance(written, int | float) else mtime
    return data


def is_live(status: dict[str, Any]) -> bool:
    if status.get("state") == "stopped":
        return False
    pid = status.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    return time.time() - float(status.get("seen_at", 0)) < STALE_AFTER_SECONDS


def add_status_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    status = subparsers.add_parser(
        "status", parents=parents, help="is the daemon running, and how are its adapters"
    )
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace, config: GatewayConfig) -> int:
    home = hermes_home()
    status = read_status(home)
    live = status is not None and is_live(status)
    if args.json:
        print(json.dumps({"running": live, "status": status}, indent=2))
        return 0 if live else EXIT_NOT_RUNNING
    if status is None or not live:
        when = ""
        if status is not None:
            last = datetime.fromtimestamp(float(status.get("seen_at", 0)), UTC)
            when = f" (last seen {last:%Y-%m-%d %H:%M:%S} UTC, state {status.get('state')})"
        print(f"hermes-gateway is not running in {home}{when}")
        return EXIT_NOT_RUNNING
    health = status.get("health", {})
    print(f"hermes-gateway is running (pid {status['pid']}) in {home}")
    uptime = health.get("uptime_seconds")
    if isinstance(uptime, int | float):  # as of `written_at`; the daemon ran on since
        uptime = round(uptime + time.time() - float(status.get("written_at", time.time())))
    print(f"  status: {health.get('status')}, uptime {uptime} s")
    agents = status.get("agents")
    if isinstance(agents, dict) and len(agents) > 1:  # several agents: one line each
        for agent_id, described in agents.items():
            print(f"  agent {agent_id}: {described}")
    else:
        print(f"  agent: {status.get('agent')}")
    print(f"  running turns: {status.get('active_turns')}, queued: {status.get('queue_depth')}")
    upcoming = status.get("next_schedule")
    if isinstance(upcoming, dict):
        print(f"  next scheduled run: {upcoming.get('fire_at')} ({upcoming.get('schedule_id')})")
    store = health.get("store", {})
    if store.get("state", "writable") != "writable":
        print(
            f"  store: {store['state']} since {store.get('since')}: {store.get('reason')} "
            f"({store.get('refused_writes')} writes refused)"
        )
    for name, adapter in sorted(health.get("adapters", {}).items()):
        extra = f", last error: {adapter['last_error']}" if adapter.get("last_error") else ""
        reconnects = adapter.get("reconnects")
        again = f", reconnects {reconnects}" if reconnects else ""
        shed = adapter.get("shed_total")
        again += f", refused while busy: {shed}" if shed else ""
        print(f"  {name}: {adapter.get('state')}{again}{extra}")
    for name, server in sorted(health.get("mcp", {}).items()):
        extra = f", last error: {server['last_error']}" if server.get("last_error") else ""
        print(f"  tool server {name}: {server.get('state')}, {server.get('tools')} tools{extra}")
    for name, remote in sorted(health.get("remote_agents", {}).items()):
        state = "reachable" if remote.get("reachable") else f"unreachable: {remote.get('error')}"
        print(f"  remote agent {name}: {state} (checked {remote.get('checked_at')})")
    return 0
