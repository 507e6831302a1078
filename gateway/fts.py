"""The full-text index of transcripts (`messages_fts`), kept up in batches.

Indexing each message in the transaction that stores it made every message insert about
four times dearer, on the writer thread every turn waits for, and made every group
commit flush a tiny FTS segment. Instead the insert trigger only notes the row id in
`fts_pending` (one append), and this indexer moves pending rows into the index in pages,
every `interval` seconds and at open. The delete trigger knows which rows are indexed,
so deleting a message that was never indexed cannot damage the index. Anything that
searches should call `index_pending` first to see the last seconds of messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from gateway.db import Database

log = structlog.get_logger("gateway.fts")

INDEX_PAGE = 1_000  # rows per write: each page is a short write (a few ms)


def index_pending(conn: sqlite3.Connection, limit: int = INDEX_PAGE) -> int:
    """Index up to `limit` pending messages, oldest first; returns how many."""
    last = conn.execute(
        "SELECT max(id) FROM (SELECT id FROM fts_pending ORDER BY id LIMIT ?)", (limit,)
    ).fetchone()[0]
    if last is None:
        return 0
    conn.execute(
        "INSERT INTO messages_fts(rowid, content) SELECT m.id, m.content"
        " FROM fts_pending p JOIN messages m ON m.id = p.id WHERE p.id <= ?",
        (last,),
    )
    return conn.execute("DELETE FROM fts_pending WHERE id <= ?", (last,)).rowcount


class FtsIndexer:
    def __init__(self, db: Database, interval: float = 0.25) -> None:
        self.db = db
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def catch_up(self) -> int:
        """Index everything pending (at open: after a crash or a repair)."""
        total = 0
        while True:
            count = await self.db.write(index_pending)
            total += count
            if count < INDEX_PAGE:  # a short page: nothing more is pending
                return total

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fts-indexer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.catch_up()
            except sqlite3.Error as exc:
                log.warning("fts_index_failed", error=str(exc))
