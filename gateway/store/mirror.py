"""`sessions.json`: the seed-format mirror of the routing index, kept off the hot path.

SQLite is the source of truth. The mirror is rewritten atomically, at most every
`min_interval` seconds while something changed (and at shutdown), from a read-only
connection of its own so the writer is never blocked. Writes back off further when one
takes long (at least 10x its own duration apart), so a huge index cannot hog the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import BinaryIO

import structlog

from gateway.domain.session import SessionEntry
from gateway.store.outage import Outage
from gateway.util.faults import crash_point
from gateway.util.fsutil import atomic_write, set_aside

log = structlog.get_logger(__name__)

# After a write that took t seconds the next waits at least BACKOFF_FACTOR * t: the
# mirror takes at most 1/(1 + BACKOFF_FACTOR) of a core, about 2%. At 100,000 sessions a
# write costs about 0.7 s of CPU (SQLite formats every entry), so under load sessions.json
# lags state.db by up to about 35 s there (5 s at 10,000); it is exact after a stop.
BACKOFF_FACTOR = 50
# What a write costs per byte of sessions.json, measured: 0.7 s of CPU for the 96 MB of
# 100,000 sessions (2026-11-24).
MIRROR_SECONDS_PER_BYTE = 7e-9
#: what a state.db built from sessions.json lacks: the mirror holds only the routing
#: entries (keys, session ids, flags, token counters), everything else lived in state.db
IMPORT_CANNOT_RESTORE = (
    "transcripts (sessions.json holds none), the duplicate memory (platform message ids"
    " already accepted: a redelivered old message is answered again), the delivery ledger"
    " (replies sent or pending, HTTP reply history) and paired users"
)


def log_imported(path: Path, count: int) -> None:
    """The warning of a state.db built from sessions.json: what it could not bring back."""
    log.warning(
        "sessions_json_imported", entries=count, path=str(path), not_restored=IMPORT_CANNOT_RESTORE
    )


def read_sessions_json(path: Path) -> dict[str, SessionEntry] | None:
    """Parse a sessions.json; None when it is absent or damaged (a damaged one is set aside).

    Entries that do not parse are skipped with a warning; the rest are kept.
    """
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_bytes())
        if not isinstance(raw, dict):
            raise ValueError("top level is not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        aside = set_aside(path)
        log.warning("sessions_json_damaged", path=str(path), moved_to=str(aside), error=str(exc))
        return None
    entries: dict[str, SessionEntry] = {}
    for key, data in raw.items():
        try:
            entry = SessionEntry.from_dict(data)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            log.warning("sessions_json_entry_skipped", session_key=key, error=str(exc))
            continue
        entries[key] = entry
    return entries


#: up to this size the mirror is parsed in full at start; above it only its ends are read
FULL_CHECK_MAX_BYTES = 1 << 20


def _looks_damaged(path: Path) -> str | None:
    """Why the mirror is unusable, or None. Small files are parsed; a large one is judged
    by its ends: our writer replaces it atomically, so a torn, truncated or foreign file
    shows there, while parsing 100 MB at every start would cost a second and 300 MB."""
    size = path.stat().st_size
    if size <= FULL_CHECK_MAX_BYTES:
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return str(exc)
        return None if isinstance(data, dict) else "top level is not an object"
    with path.open("rb") as file:
        head = file.read(1)
        file.seek(-2, 2)
        tail = file.read(2)
    if head != b"{" or tail.rstrip(b"\n")[-1:] != b"}":
        return "not a complete JSON object (truncated or not written by the gateway)"
    return None


def check_sessions_json(path: Path) -> bool:
    """True when the mirror is absent or sound; a damaged one is set aside with a warning."""
    if not path.exists():
        return True
    problem = _looks_damaged(path)
    if problem is None:
        return True
    aside = set_aside(path)
    log.warning(
        "sessions_json_damaged",
        path=str(path),
        moved_to=str(aside),
        error=problem,
        action="rewriting it from state.db",
    )
    return False


MIRROR_PAGE = 500


def _iso(column: str) -> str:
    """SQL for `datetime.isoformat()` of a UTC epoch column: microseconds when there are
    any, as Python writes them (strftime's %f stops at milliseconds, so the fraction is
    printed separately; a fraction that rounds to a whole second carries into it)."""
    micro = f"CAST(round(({column} - floor({column})) * 1000000) AS INTEGER)"
    seconds = f"(CAST(floor({column}) AS INTEGER) + ({micro} = 1000000))"
    fraction = f"({micro} % 1000000)"
    return (
        f"CASE WHEN {column} IS NULL THEN NULL ELSE"
        f" strftime('%Y-%m-%dT%H:%M:%S', {seconds}, 'unixepoch')"
        f" || CASE WHEN {fraction} THEN printf('.%06d', {fraction}) ELSE '' END"
        " || '+00:00' END"
    )


def _flag(column: str) -> str:
    return f"json(CASE WHEN {column} THEN 'true' ELSE 'false' END)"


# One entry as `SessionEntry.to_dict` has it (same keys, same order), built from the hot
# row and the cold row. The cost is printed with 17 digits (json_object's own REAL text
# keeps 15, which does not read back as the same float).
_ENTRY_JSON = (
    "json_object("
    "'session_key', h.session_key, 'session_id', h.session_id,"
    f" 'created_at', {_iso('h.created_at')}, 'updated_at', {_iso('h.updated_at')},"
    " 'origin', json(d.origin), 'display_name', d.display_name, 'platform', d.platform,"
    " 'chat_type', coalesce(d.chat_type, 'dm'),"
    " 'input_tokens', h.input_tokens, 'output_tokens', h.output_tokens,"
    " 'cache_read_tokens', h.cache_read_tokens, 'cache_write_tokens', h.cache_write_tokens,"
    " 'total_tokens', h.total_tokens,"
    " 'estimated_cost_usd', json(printf('%!.17g', h.estimated_cost_usd)),"
    " 'cost_status', h.cost_status, 'last_prompt_tokens', h.last_prompt_tokens,"
    f" 'was_auto_reset', {_flag('h.was_auto_reset')},"
    " 'auto_reset_reason', h.auto_reset_reason,"
    f" 'reset_had_activity', {_flag('h.reset_had_activity')},"
    f" 'is_fresh_reset', {_flag('h.is_fresh_reset')},"
    f" 'expiry_finalized', {_flag('h.expiry_finalized')},"
    f" 'suspended', {_flag('h.suspended')}, 'resume_pending', {_flag('h.resume_pending')},"
    " 'resume_reason', h.resume_reason,"
    f" 'last_resume_marked_at', {_iso('h.last_resume_marked_at')})"
)
# One page of `"key":{entry}` lines after a key; json_quote makes any key a valid JSON
# string (non-ASCII stays UTF-8, as in entries).
MIRROR_PAGE_SQL = (
    "SELECT group_concat(line, ',' || char(10)), count(*), max(session_key) FROM ("
    f" SELECT h.session_key, json_quote(h.session_key) || ':' || {_ENTRY_JSON} AS line"
    " FROM session_entries h LEFT JOIN session_entry_docs d ON d.session_key = h.session_key"
    " WHERE h.session_key > ? ORDER BY h.session_key LIMIT ?)"
)


def write_sessions_json(db_path: Path, json_path: Path) -> int:
    """Stream the routing index from a read snapshot of state.db into sessions.json
    (seed format), atomically. Each entry's JSON is built by SQLite from its columns,
    never by Python, and rows go to disk as they are read, so memory stays flat at any
    size. Returns the count.
    """
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    count = 0

    def write(file: BinaryIO) -> None:
        # SQLite formats each page of lines itself (in C, without the GIL), so a mirror
        # of 100k sessions costs the event loop (where the writer runs) next to nothing.
        nonlocal count
        file.write(b"{")
        after = ""
        while True:
            lines, rows, last = conn.execute(MIRROR_PAGE_SQL, (after, MIRROR_PAGE)).fetchone()
            if not rows:
                break
            file.write(b",\n" if count else b"\n")
            file.write(lines.encode())
            count += rows
            after = last
        crash_point("mid_sessions_json_write")  # the temp file is not closed yet
        file.write(b"\n}\n")

    try:
        conn.execute("BEGIN")  # one snapshot for the whole file
        atomic_write(json_path, write)
    finally:
        conn.close()
    return count


class SessionsMirror:
    """Coalesces 'something changed' signals into occasional atomic rewrites."""

    def __init__(self, json_path: Path, db_path: Path, min_interval: float) -> None:
        self.json_path = json_path
        self.db_path = db_path
        self.min_interval = min_interval
        self.writes = 0
        self._dirty = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._next_allowed = 0.0
        # A full disk fails every retry alike: logged once a minute, not per attempt.
        self._failing = Outage(log, "sessions_json_write_failed", path=str(json_path))

    def mark_dirty(self) -> None:
        self._dirty = True
        self._changed.set()

    def start(self) -> None:
        # The first write waits as the next one would after a write of this file: its
        # cost is about proportional to its size (MIRROR_SECONDS_PER_BYTE), so a
        # gateway started on 100,000 sessions does not spend its first seconds on it.
        with contextlib.suppress(OSError):
            expected = self.json_path.stat().st_size * MIRROR_SECONDS_PER_BYTE
            self._next_allowed = time.monotonic() + max(
                self.min_interval, BACKOFF_FACTOR * expected
            )
        self._task = asyncio.create_task(self._run(), name="sessions-json-mirror")

    async def stop(self) -> None:
        """Stop the background writer and write a final copy if anything changed."""
        if self._task is not None:
            # Cancel only between writes: a cancelled `asyncio.to_thread` keeps running on its
            # thread, so cancelling mid-write would let the final flush below race it.
            async with self._lock:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush()

    async def flush(self) -> None:
        """Write now if dirty (serialised with the background writer)."""
        async with self._lock:
            if not self._dirty:
                return
            self._dirty = False  # cleared before the snapshot: later changes re-mark it
            started = time.monotonic()
            try:
                await asyncio.to_thread(write_sessions_json, self.db_path, self.json_path)
            except (OSError, sqlite3.Error) as exc:
                self._dirty = True
                self._failing.failed(str(exc))
                raise
            except asyncio.CancelledError:
                self._dirty = True  # the snapshot may not have landed; write it next time
                raise
            self._failing.ended()
            took = time.monotonic() - started
            self.writes += 1
            self._next_allowed = time.monotonic() + max(self.min_interval, BACKOFF_FACTOR * took)

    async def _run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            delay = self._next_allowed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                await self.flush()
            except (OSError, sqlite3.Error):
                await asyncio.sleep(self.min_interval)  # logged in flush; retry later
                self._changed.set()
