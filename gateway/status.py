"""`$HERMES_HOME/status.json` and `hermes-gateway status`.

The daemon rewrites the file every few seconds with its health (each adapter's real
state, queue depth, running turns), and once more when it stops. `status` reads it,
so it works whichever platforms are enabled, and tells a stale file (a daemon that
died) from a live one by the pid and the file's age.

Exit codes of `status`: 0 running, 3 not running (like `systemctl status`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from config import GatewayConfig, hermes_home
from gateway.fsutil import atomic_write_bytes, overwrite_in_place
from gateway.outage import Outage

log = structlog.get_logger("gateway.status")

STATUS_FILE = "status.json"
WRITE_INTERVAL_SECONDS = 5.0
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


async def keep_status(home: Path, snapshot: Any, interval: float = WRITE_INTERVAL_SECONDS) -> None:
    """Rewrite the status file from `snapshot()` until cancelled (off the event loop). A
    disk that refuses the write (read-only) is logged once a minute and tried again."""
    failing = Outage(log, "status_file_write_failed", path=str(home / STATUS_FILE))
    while True:
        try:
            await asyncio.to_thread(write_status, home, snapshot())
        except OSError as exc:
            failing.failed(str(exc))
        else:
            failing.ended()
        await asyncio.sleep(interval)


def read_status(home: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((home / STATUS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    return time.time() - float(status.get("written_at", 0)) < 3 * WRITE_INTERVAL_SECONDS


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
            last = datetime.fromtimestamp(float(status.get("written_at", 0)), UTC)
            when = f" (last seen {last:%Y-%m-%d %H:%M:%S} UTC, state {status.get('state')})"
        print(f"hermes-gateway is not running in {home}{when}")
        return EXIT_NOT_RUNNING
    health = status.get("health", {})
    print(f"hermes-gateway is running (pid {status['pid']}) in {home}")
    print(f"  status: {health.get('status')}, uptime {health.get('uptime_seconds')} s")
    print(f"  agent: {status.get('agent')}")
    print(f"  running turns: {status.get('active_turns')}, queued: {status.get('queue_depth')}")
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
    return 0
