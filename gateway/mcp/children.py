"""The stdio servers' child processes, never orphaned: each child (the leader of its own
process group, which the SDK starts with `start_new_session`) is recorded with its
/proc start time in `<home>/mcp/children.json`; at start the hub ends every group the
last run left (a kill -9 gives no chance to stop them) whose start time still matches,
so a pid reused by an unrelated process is never signalled. Linux /proc only: elsewhere
nothing is recorded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.util.fsutil import atomic_write_bytes

log = structlog.get_logger("gateway.mcp")

PROC = Path("/proc")
# A TERM'd group gets this long before KILL.
TERM_GRACE_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Child:
    server: str
    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: clock ticks after boot


def start_time(pid: int) -> int | None:
    """The process's start time, None when there is no such process."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its ")".
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


def child_on_pipe(pipe_inode: int) -> int | None:
    """The pid of our child whose stderr is the pipe `pipe_inode` (how a stdio server is
    told apart from the others: each has its own stderr pipe)."""
    me = os.getpid()
    target = f"pipe:[{pipe_inode}]"
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid == me and os.readlink(entry / "fd" / "2") == target:
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


class ChildBook:
    """The record of live stdio children in `<home>/mcp/children.json` (written off the
    event loop, one write at a time)."""

    def __init__(self, home: Path) -> None:
        self.path = home / "mcp" / "children.json"
        self._children: dict[str, Child] = {}
        self._lock = asyncio.Lock()

    async def add(self, child: Child) -> None:
        self._children[child.server] = child
        await self._save()

    async def remove(self, server: str) -> None:
        if self._children.pop(server, None) is not None:
            await self._save()

    async def _save(self) -> None:
        async with self._lock:
            rows = [
                {"server": c.server, "pid": c.pid, "start_time": c.start_time}
                for c in self._children.values()
            ]
            await asyncio.to_thread(self._write, json.dumps(rows).encode())

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_bytes(self.path, data)

    def _leftovers(self) -> list[Child]:
        try:
            rows = json.loads(self.path.read_bytes()[:1_000_000])
            return [Child(str(r["server"]), int(r["pid"]), int(r["start_time"])) for r in rows]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("mcp_children_unreadable", path=str(self.path), error=type(exc).__name__)
            return []

    async def end_leftovers(self) -> list[Child]:
        """End every recorded group whose leader still has its recorded start time (TERM,
        then KILL after a grace); forget the rest. Returns the groups signalled."""
        recorded = await asyncio.to_thread(self._leftovers)
        ended = [c for c in recorded if start_time(c.pid) == c.start_time]
        for child in ended:
            _signal_group(child.pid, signal.SIGTERM)
            log.warning("mcp_orphan_ended", server=child.server, pid=child.pid)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TERM_GRACE_SECONDS
        # Not our children: no exit event to wait on, so their /proc entries are polled.
        while any(_alive(c) for c in ended) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        for child in ended:
            if _alive(child):
                _signal_group(child.pid, signal.SIGKILL)
        if recorded:
            await self._save()
        return ended


def _alive(child: Child) -> bool:
    # Not our child: nothing reaps it here, so a zombie (its parent, init, reaps it
    # soon) counts as ended.
    try:
        stat = (PROC / str(child.pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z" and start_time(child.pid) == child.start_time


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
