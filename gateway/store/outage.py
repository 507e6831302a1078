"""A store that cannot write, told apart from other errors, and lasting failures
reported once a minute instead of once per message.

A full disk (ENOSPC), a file system remounted read-only (EROFS) or a failing disk (EIO)
reach us as SQLite errors whose primary code is SQLITE_FULL, SQLITE_READONLY or
SQLITE_IOERR ("database or disk is full", "attempt to write a readonly database",
"disk I/O error"), or as the plain OSError of a file write. None of them is the fault of
the write that met it: the same write works once the disk does again.
"""

from __future__ import annotations

import errno
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

REPEAT_SECONDS = 60.0

_SQLITE_CAUSES = {
    sqlite3.SQLITE_FULL: "disk full",
    sqlite3.SQLITE_READONLY: "read-only",
    sqlite3.SQLITE_IOERR: "disk I/O error",
}
_OS_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only",
    errno.EIO: "disk I/O error",
}


class StoreUnwritable(sqlite3.OperationalError):
    """A write refused because the disk cannot take it (full, read-only, failing); it was
    not committed, and trying again once the disk can write again is safe."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def unwritable_reason(exc: BaseException) -> str | None:
    """`"disk full: database or disk is full"` and the like when `exc` says the disk
    cannot write; None for any other error."""
    if isinstance(exc, StoreUnwritable):
        return exc.reason
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        cause = _SQLITE_CAUSES.get(code & 0xFF)  # extended codes keep the primary one
    elif isinstance(exc, OSError):
        cause = _OS_CAUSES.get(exc.errno or 0)
    else:
        cause = None
    return f"{cause}: {exc}" if cause else None


class Outage:
    """One lasting failure, reported as an operator wants to read it: a warning when it
    starts, at most one more a minute while it lasts (with how many attempts failed since
    the last line), and an info line when it ends.

    A failure that comes back within a minute of the last warning (a disk on the edge
    of full) is counted, not logged again, and so is its end: warnings and "ended" lines
    pair up, and a failure that outlasts the minute shows in the next warning.
    """

    def __init__(
        self,
        logger: Any,
        event: str,
        clock: Callable[[], float] = time.monotonic,
        **context: Any,
    ) -> None:
        self.log = logger
        self.event = event
        self.context = context
        self.clock = clock
        self.reason: str | None = None
        self.since: datetime | None = None  # when the current failure began
        self.failures = 0  # during the current failure
        self._unreported = 0  # failures since the last line
        self._warned_at: float | None = None
        self._warned = False  # the last line logged was a warning

    @property
    def active(self) -> bool:
        return self.reason is not None

    def failed(self, reason: str, count: int = 1) -> None:
        """`count` attempts failed for `reason`."""
        if self.reason is None:
            self.since = datetime.now(UTC)
            self.failures = 0
        self.reason = reason
        self.failures += count
        self._unreported += count
        now = self.clock()
        if self._warned_at is not None and now - self._warned_at < REPEAT_SECONDS:
            return
        self.log.warning(
            self.event if not self._warned else f"{self.event}_continues",
            reason=reason,
            failed=self._unreported,
            since=self.since.isoformat() if self.since else None,
            **self.context,
        )
        self._warned_at, self._warned, self._unreported = now, True, 0

    def ended(self) -> None:
        """The failing thing works again."""
        if self.reason is None:
            return
        if self._warned:
            assert self.since is not None
            self.log.info(
                f"{self.event}_ended",
                failed=self.failures,
                lasted_seconds=round((datetime.now(UTC) - self.since).total_seconds(), 1),
                **self.context,
            )
            self._warned = False
        self.reason, self.since = None, None
