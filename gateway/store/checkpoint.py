"""WAL checkpoints off the writer's path.

Left to itself, SQLite checkpoints inside the commit that crosses `wal_autocheckpoint`
pages: that commit copies the WAL back into the database and fsyncs it, and every
message waiting on the writer waits with it; under load that sets the gateway's p99.
Instead a connection of its own runs a PASSIVE checkpoint every `interval` seconds on a
worker thread (SQLite releases the GIL while it copies), which never blocks the writer,
and copies a page rewritten many times once. The writer keeps a far larger
autocheckpoint as a safety net (`SAFETY_NET_PAGES`) in case this task falls behind.

Under continuous writes the safety net is also what restarts the WAL: a restart needs
every frame copied when a write begins, and the writer adds frames during each of these
checkpoints, so the WAL grows until the writer's own checkpoint, which copies the last
frames and syncs the database on the event loop's thread. That sync sets the p99 of a
busy large gateway (BENCHMARKS.md, "Where the p99 at 100,000 sessions goes").

Every 0.1 s rather than less often: a checkpoint's copy and fsync slow the writer's own
WAL I/O while they run, and smaller checkpoints stall it for less (BENCHMARKS.md has the
p99 at each interval).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import structlog

from gateway.store.background import ThreadedSqliteTask
from gateway.store.outage import Outage

log = structlog.get_logger("gateway.store.checkpoint")

SAFETY_NET_PAGES = 10_000  # ~40 MiB of WAL before the writer checkpoints by itself
WAL_SIZE_LIMIT = 64 * 1024 * 1024  # the WAL file is truncated to this after a reset


class Checkpointer(ThreadedSqliteTask):
    """`commits()` counts the writer's commits: an idle gateway is not checkpointed for
    nothing (and is looked at once a second, `ThreadedSqliteTask._pause`)."""

    def __init__(self, path: Path, commits: Callable[[], int], interval: float = 0.1) -> None:
        super().__init__(interval)
        self.path = path
        self.commits = commits
        self._seen = -1
        self._failing = Outage(log, "wal_checkpoint_failed", path=str(path))  # once a minute

    def start(self) -> None:
        # Used from worker threads one call at a time, never concurrently.
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA busy_timeout=1000")
        self._start(self._run(), "wal-checkpoint")

    async def _run(self) -> None:
        worked = True
        while True:
            await self._pause(worked)
            conn = self._conn
            if conn is None:
                return
            commits = self.commits()
            worked = commits != self._seen
            if not worked:
                continue
            self._seen = commits
            try:
                await self._in_thread(_checkpoint, conn)
            except sqlite3.Error as exc:
                self._failing.failed(str(exc))
            else:
                self._failing.ended()


def _checkpoint(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
