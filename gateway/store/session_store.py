"""SessionStore: the durable session routing index and transcripts (seed section 3).

SQLite (`state.db`) is the one source of truth. Each operation is one small transaction
committed by the writer (`gateway.store.db`); a message touch is a single-row upsert, never
a rewrite of all entries, so per-message cost does not grow with the number of sessions.
`sessions.json` is a coalesced mirror for people and tools that read the seed format.

State-machine priority in `get_or_create_session` (gateway.store.session_routing):
suspended > resume_pending > reset policy (idle / daily) > plain touch.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from config import GatewayConfig, SessionResetPolicy
from gateway.domain.policy import reset_reason
from gateway.domain.routing import Router
from gateway.domain.session import (
    Platform,
    SessionEntry,
    SessionSource,
    TokenUsage,
    build_session_key,
    schedule_id_of_key,
)
from gateway.store import entries, summary_checkpoints, transcript
from gateway.store.db import Database, T
from gateway.store.fts import FtsIndexer
from gateway.store.mirror import (
    SessionsMirror,
    check_sessions_json,
    log_imported,
    read_sessions_json,
)
from gateway.store.pg.search import PgSearchIndex
from gateway.store.session_routing import ActiveCheck, ResetPolicies, expiry_cutoff, route_entry

log = structlog.get_logger(__name__)
NEVER_RESET = SessionResetPolicy(mode="none")

STATE_DB = "state.db"
SESSIONS_JSON = "sessions.json"
PRUNE_PAGE = 500  # routing entries dropped per write by prune_old_entries
#: the most user turns one /undo takes back (and what SQLite's LIMIT can take at all)
MAX_REWIND = 1_000


def _utcnow() -> datetime:
    return datetime.now(UTC)


class SessionStore:
    """Durable sessions under `sessions_dir` (`state.db` + the `sessions.json` mirror)."""

    def __init__(
        self,
        sessions_dir: Path | str,
        config: GatewayConfig,
        has_active_processes_fn: Callable[[str], bool] | None = None,
    ) -> None:
        self.sessions_dir = Path(sessions_dir)
        self.config = config
        self.has_active_processes_fn = has_active_processes_fn
        self._active_check = ActiveCheck()
        self._policy = ResetPolicies(config)
        self.db_path = self.sessions_dir / STATE_DB
        self.json_path = self.sessions_dir / SESSIONS_JSON
        # On PostgreSQL every replica shares the tables; search.db and sessions.json are
        # SQLite-side files (transcript search is a GIN index there; no mirror to keep).
        self.postgres = config.storage.backend == "postgres"
        self._db: Database
        self.search_index: FtsIndexer | PgSearchIndex
        if self.postgres:
            # Imported here: a gateway on SQLite never loads psycopg (22 MiB).
            from gateway.store.pg.db import PgDatabase

            self._db = PgDatabase(config.storage.dsn or "")
            self.search_index = PgSearchIndex(self._db)
        else:
            self._db = Database(self.db_path)
            self.search_index = FtsIndexer(self._db, self.sessions_dir)
        self._mirror = SessionsMirror(
            self.json_path, self.db_path, config.storage.mirror_interval_seconds
        )
        self._tz = config.tzinfo()
        # `routes:`: which agent's session a message belongs to (the key's agent part).
        self.router = Router(config.routes)
        self.created = False  # set by open(): True when this open created the state

    # --- lifecycle ---------------------------------------------------------------------

    def check_soon(self) -> None:
        """Begin `open()`'s integrity check of an existing state.db now, on a worker
        thread (see `Database.check_soon`); creates nothing."""
        self._db.check_soon()

    async def open(self) -> SessionStore:
        self.sessions_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.created = not self.db_path.exists() and not self.json_path.exists()
        await self._db.open()
        if self.postgres:
            return self
        # Import when the database holds no session at all, not only when the file was
        # absent: a crash between creating state.db and committing the import leaves an
        # empty database, and the next mirror write would then erase the legacy index.
        if not await self.has_any_sessions():
            legacy = await asyncio.to_thread(read_sessions_json, self.json_path)
            if legacy:
                await self._db.write(lambda conn: entries.import_entries(conn, legacy))
                log_imported(self.json_path, len(legacy))
        elif not await asyncio.to_thread(check_sessions_json, self.json_path):
            self._mirror.mark_dirty()
        if not self.json_path.exists():
            self._mirror.mark_dirty()
        self.search_index.start()  # catches up in the background: start-up does not wait
        self._mirror.start()
        return self

    async def close(self) -> None:
        if not self._db.is_open:
            return
        if self.postgres:
            await self._db.close()
            return
        await self.search_index.stop()
        try:
            await self._mirror.stop()
        except (OSError, sqlite3.Error):
            pass  # logged by the mirror (a full disk); sessions.json catches up next change
        finally:
            await self._db.close()

    async def __aenter__(self) -> SessionStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def flush_mirror(self) -> None:
        """Write sessions.json now if anything changed (also done at close). None on
        PostgreSQL: sessions.json mirrors a local state.db."""
        if not self.postgres:
            await self._mirror.flush()

    # --- helpers -----------------------------------------------------------------------

    def session_key_for(self, source: SessionSource) -> str:
        """The key this source routes to, its agent picked by `routes:` (raises
        ValueError for unsafe ids)."""
        return self._generate_session_key(source)

    def _generate_session_key(self, source: SessionSource) -> str:
        return build_session_key(
            source,
            group_sessions_per_user=self.config.group_sessions_per_user,
            thread_sessions_per_user=self.config.thread_sessions_per_user,
            agent_id=self.router.agent_for(source),
        )

    def _has_active_processes(self, session_key: str) -> bool:
        """Whether the host says the session has work running (it is not reset then)."""
        return self._active_check(self.has_active_processes_fn, session_key)

    def _policy_for(self, entry: SessionEntry) -> Any:
        return self._policy(entry.platform or Platform.LOCAL, entry.chat_type)

    def _is_session_expired(self, entry: SessionEntry, now: datetime | None = None) -> bool:
        """Policy check from the entry alone (the expiry watcher has no source)."""
        if self._has_active_processes(entry.session_key):
            return False
        now = now or _utcnow()
        return reset_reason(entry.updated_at, self._policy_for(entry), now, self._tz) is not None

    async def write(
        self, fn: Callable[[sqlite3.Connection], T], *, dirty: bool = True, persist: bool = False
    ) -> T:
        """Run a transaction on the store's database (for the journal's combined writes).
        `persist`: work already acknowledged, which waits out a disk that cannot take it
        (see `Database.write_soon`)."""
        return await self._write(fn, dirty=dirty, persist=persist)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._db.read(fn)

    @property
    def commits(self) -> int:
        """Transactions committed so far (background indexers' change signal)."""
        return self._db.commits

    def data_version(self) -> int:
        """Changes when another process committed to state.db (`Database.data_version`)."""
        return self._db.data_version()

    def write_soon(
        self, fn: Callable[[sqlite3.Connection], T], *, persist: bool = False
    ) -> asyncio.Future[T]:
        """A journal write nobody waits for (see `Database.write_soon`); not mirrored."""
        return self._db.write_soon(fn, persist=persist)

    def write_later(
        self,
        fn: Callable[[sqlite3.Connection], object],
        done: Callable[[BaseException | None], object],
        *,
        persist: bool = False,
    ) -> None:
        """A journal write settled through `done`, not a future (`Database.write_later`)."""
        self._db.write_later(fn, done, persist=persist)

    def write_health(self) -> dict[str, Any]:
        """Can the store write (`Database.write_health`)?"""
        return self._db.write_health()

    async def _write(
        self, fn: Callable[[sqlite3.Connection], T], *, dirty: bool = True, persist: bool = False
    ) -> T:
        result = await self._db.write(fn, persist=persist)
        if dirty:
            self._mirror.mark_dirty()
        return result

    async def _modify(
        self, session_key: str, change: Callable[[SessionEntry], bool]
    ) -> SessionEntry | None:
        """Load, change and save one entry; `change` returns False to leave it untouched."""

        def tx(conn: sqlite3.Connection) -> SessionEntry | None:
            entry = entries.load_entry(conn, session_key)
            if entry is None or not change(entry):
                return None
            entries.save_hot(conn, entry)  # the changes here touch no cold field
            return entry

        return await self._write(tx)

    # --- the core entry point ----------------------------------------------------------

    async def get_or_create_session(
        self, source: SessionSource, force_new: bool = False
    ) -> SessionEntry:
        """The session this message belongs to, resetting it first if it must be."""
        return await self._write(self.route_tx(source, force_new))

    def route_tx(
        self, source: SessionSource, force_new: bool = False
    ) -> Callable[[sqlite3.Connection], SessionEntry]:
        """The transaction body of `get_or_create_session`, for callers that combine it
        with more writes in one transaction."""
        key, now = self._generate_session_key(source), _utcnow()
        route = self._routing_tx(source, key, force_new, now)

        def tx(conn: sqlite3.Connection) -> SessionEntry:
            loaded = entries.load_to_touch(conn, key)
            entry, fresh = route(conn, loaded[0] if loaded else None)
            if not fresh and loaded:
                entries.touch(conn, entry, loaded[1], now)
            return entry

        return tx

    def route_for_turn_tx(
        self, source: SessionSource, key: str | None = None
    ) -> Callable[[sqlite3.Connection], tuple[SessionEntry, bool, int, float | None]]:
        """Routing for a turn, which touches the entry when it ends: a session that simply
        continues is read from its hot row alone (see `entries.load_hot`: origin and
        display name are None) and not written here. Returns the entry, whether this
        transaction wrote it (a new or reset session), the row's active_minute and its
        stored token calibration (None: none yet).
        `key`: the source's session key, when the caller has it already."""
        if key is None:
            key = self._generate_session_key(source)
        route = self._routing_tx(source, key, False, _utcnow())

        def tx(conn: sqlite3.Connection) -> tuple[SessionEntry, bool, int, float | None]:
            loaded = entries.load_hot(conn, key, source)
            entry, fresh = route(conn, loaded[0] if loaded else None)
            factor = loaded[2] if loaded else None
            if fresh or loaded is None:
                return entry, True, entries.minute_of(entry.updated_at), factor
            return entry, False, loaded[1], factor

        return tx

    def _routing_tx(
        self, source: SessionSource, key: str, force_new: bool, now: datetime
    ) -> Callable[[sqlite3.Connection, SessionEntry | None], tuple[SessionEntry, bool]]:
        """The state machine (gateway.store.session_routing) on a loaded entry (None:
        the key has none), with this source's policy and the key's running processes."""
        policy = self._policy(source.platform, source.chat_type)
        if schedule_id_of_key(key) is not None:
            # A scheduled job's session keeps its context from run to run.
            policy = NEVER_RESET
        active = self._has_active_processes(key)
        tz = self._tz

        def tx(conn: sqlite3.Connection, entry: SessionEntry | None) -> tuple[SessionEntry, bool]:
            return route_entry(
                conn,
                entry,
                key=key,
                source=source,
                force_new=force_new,
                now=now,
                policy=policy,
                active=active,
                tz=tz,
            )

        return tx

    # --- entry updates -----------------------------------------------------------------

    async def update_session(
        self,
        session_key: str,
        last_prompt_tokens: int | None = None,
        *,
        usage: TokenUsage | None = None,
    ) -> SessionEntry | None:
        """Bump `updated_at` after an interaction; add the turn's token usage if given."""
        now = _utcnow()

        def change(entry: SessionEntry) -> bool:
            entry.updated_at = now
            if last_prompt_tokens is not None:
                entry.last_prompt_tokens = last_prompt_tokens
            if usage is not None:
                entry.add_usage(usage)
            return True

        return await self._modify(session_key, change)

    async def reset_session(
        self, session_key: str, display_name: str | None = None
    ) -> SessionEntry | None:
        """Explicit /new or /reset: a new session id with `is_fresh_reset`; None if unknown."""
        now = _utcnow()

        def tx(conn: sqlite3.Connection) -> SessionEntry | None:
            old = entries.load_entry(conn, session_key)
            if old is None:
                return None
            return entries.replace_session(
                conn,
                old,
                None,
                now,
                is_fresh_reset=True,
                display_name=display_name or old.display_name,
            )

        return await self._write(tx)

    async def switch_session(
        self, session_key: str, target_session_id: str, source: SessionSource | None = None
    ) -> SessionEntry | None:
        """Point `session_key` at an earlier session of the same key (/resume).

        A key without an entry (its current session was deleted, or it was pruned) gets
        one for the asking `source`. Returns None when the target is not a session of
        this key, or the key has no entry and no `source` is given.
        """
        now = _utcnow()

        def tx(conn: sqlite3.Connection) -> SessionEntry | None:
            entry = entries.load_entry(conn, session_key)
            row = entries.load_counters(conn, target_session_id, session_key)
            created = entry is None
            if row is None or (entry is None and source is None):
                return None
            if entry is None:
                entry = entries.fresh_entry(session_key, source, now)
            elif entry.session_id == target_session_id:
                return entry
            else:
                entries.end_session_row(conn, entry, now, entries.END_SWITCH)
            conn.execute(
                "UPDATE sessions SET ended_at = NULL, end_reason = NULL WHERE session_id = ?",
                (target_session_id,),
            )
            *counters, started_at = row
            for name, value in zip(entries.COUNTERS, counters, strict=True):
                setattr(entry, name, value)
            entry.session_id = target_session_id
            entry.created_at = datetime.fromtimestamp(started_at, UTC)
            entry.updated_at = now
            entry.suspended = entry.resume_pending = entry.expiry_finalized = False
            entry.was_auto_reset = entry.is_fresh_reset = False
            entry.resume_reason = None
            if created:  # its cold row too: who resumes, as for a new chat's first message
                entries.save_entry(conn, entry)
            else:
                entries.save_hot(conn, entry)  # same origin and names: a new session id only
            return entry

        return await self._write(tx)

    async def suspend_session(self, session_key: str) -> bool:
        """Hard wipe on next access (/stop, stuck loop); beats `resume_pending`."""

        def change(entry: SessionEntry) -> bool:
            entry.suspended = True
            return True

        return await self._modify(session_key, change) is not None

    async def mark_resume_pending(
        self, session_key: str, reason: str = "restart_interrupted"
    ) -> bool:
        """Keep the session id on next access; refused (False) for suspended/unknown keys."""
        now = _utcnow()

        def change(entry: SessionEntry) -> bool:
            if entry.suspended:
                return False
            entry.resume_pending = True
            entry.resume_reason = reason
            entry.last_resume_marked_at = now
            return True

        return await self._modify(session_key, change) is not None

    async def clear_resume_pending(self, session_key: str) -> bool:
        """Called only after a resumed turn succeeded."""

        def change(entry: SessionEntry) -> bool:
            if not entry.resume_pending:
                return False
            entry.resume_pending = False
            entry.resume_reason = None
            return True

        return await self._modify(session_key, change) is not None

    async def set_expiry_finalized(self, session_key: str, finalized: bool = True) -> bool:
        """Record that the expiry watcher finalized this session (hooks ran, agent evicted)."""

        def change(entry: SessionEntry) -> bool:
            entry.expiry_finalized = finalized
            return True

        return await self._modify(session_key, change) is not None

    async def suspend_recently_active(self, max_age_seconds: float = 120) -> int:
        """Crash recovery: mark sessions touched in the last `max_age_seconds` resume_pending.

        Skips entries already pending or suspended. Returns how many were marked.
        """
        now = _utcnow()
        cutoff = (now - timedelta(seconds=max_age_seconds)).timestamp()
        return await self._write(lambda conn: entries.mark_active_since(conn, cutoff, now))

    async def prune_old_entries(self, max_age_days: int) -> int:
        """Drop routing entries idle for `max_age_days` (0 disables); transcripts stay.

        Suspended entries and keys with active processes are kept.
        """
        if max_age_days <= 0:
            return 0
        now = _utcnow()
        cutoff = (now - timedelta(days=max_age_days)).timestamp()
        candidates = await self._db.read(lambda conn: entries.idle_keys(conn, cutoff))
        doomed = [key for key in candidates if not self._has_active_processes(key)]
        # Page by page: writes run on the event loop's thread, so thousands of idle
        # sessions are dropped in short steps, not in one long write.
        pruned = 0
        for first in range(0, len(doomed), PRUNE_PAGE):
            keys = doomed[first : first + PRUNE_PAGE]
            pruned += await self._write(
                lambda conn, keys=keys: entries.prune(conn, keys, cutoff, now)
            )
        return pruned

    # --- queries -----------------------------------------------------------------------

    async def get_entry(self, session_key: str) -> SessionEntry | None:
        return await self._db.read_now(lambda conn: entries.load_entry(conn, session_key))

    async def expired_entries(self, limit: int = 1000, page: int = 1000) -> list[SessionEntry]:
        """Up to `limit` entries whose reset policy has expired and that are not finalized.

        Only rows idle past the shortest possible expiry are read (via active_minute),
        page by page, and each is checked against its own policy, so entries that never
        expire (mode none on one platform) cannot crowd out the ones that did.
        """
        now = _utcnow()
        cutoff = expiry_cutoff(self.config, now, self._tz)
        if cutoff is None:
            return []

        def query(after: tuple[int, str]) -> Callable[[sqlite3.Connection], list[Any]]:
            return lambda conn: entries.idle_page(conn, cutoff.timestamp(), after, page)

        expired: list[SessionEntry] = []
        after: tuple[int, str] = (-1, "")
        while len(expired) < limit:
            rows = await self._db.read(query(after))
            for _, _, entry in rows:
                if self._is_session_expired(entry, now):
                    expired.append(entry)
            if len(rows) < page:
                break
            after = (rows[-1][0], rows[-1][1])
        return expired[:limit]

    async def list_sessions(
        self, active_minutes: float | None = None, agent_id: str | None = None
    ) -> list[SessionEntry]:
        """All entries, most recently active first; optionally only the last N minutes,
        only one agent's."""
        since = None
        if active_minutes is not None:
            since = (_utcnow() - timedelta(minutes=active_minutes)).timestamp()
        return await self._db.read(lambda conn: entries.list_entries(conn, since, agent_id))

    async def list_sessions_page(
        self,
        after: str | None = None,
        limit: int = 100,
        *,
        active_minutes: float | None = None,
        agent_id: str | None = None,
    ) -> tuple[list[SessionEntry], str | None]:
        """Up to `limit` entries after session key `after`, in key order, and the key to
        pass as `after` for the next page (None on the last); scoped as `list_sessions`."""
        since = None
        if active_minutes is not None:
            since = (_utcnow() - timedelta(minutes=active_minutes)).timestamp()
        page = await self._db.read(
            lambda conn: entries.list_entries_page(conn, after, limit + 1, since, agent_id)
        )
        if len(page) <= limit:
            return page, None
        del page[limit:]
        return page, page[-1].session_key

    async def lookup_by_session_id(self, session_id: str) -> SessionEntry | None:
        return await self._db.read_now(lambda conn: entries.load_by_session_id(conn, session_id))

    async def has_any_sessions(self) -> bool:
        """Whether any session was ever created (history, not just live entries)."""
        return await self._db.read_now(
            lambda conn: conn.execute("SELECT 1 FROM sessions LIMIT 1").fetchone() is not None
        )

    async def list_session_history(self, session_key: str, limit: int = 10) -> list[dict[str, Any]]:
        """Earlier and current sessions of one key, newest first (for /resume)."""
        return await self._db.read(lambda conn: entries.session_history(conn, session_key, limit))

    async def session_replaced_by(self, session_key: str, session_id: str) -> str | None:
        """The session of this key that the reset starting `session_id` ended (for the
        reset's log line): the one a reset ended most recently."""
        return await self._db.read(lambda conn: entries.replaced_by(conn, session_key, session_id))

    # --- transcripts -------------------------------------------------------------------

    async def append_to_transcript(
        self, session_id: str, message: dict[str, Any], skip_db: bool = False
    ) -> int | None:
        """Append one message; `skip_db` when the agent already persisted it. Returns its id."""
        transcript.validate_message(message)
        if skip_db:
            return None
        message = dict(message)
        return await self._write(
            lambda conn: transcript.append(conn, session_id, message), dirty=False
        )

    async def rewrite_transcript(self, session_id: str, messages: list[dict[str, Any]]) -> int:
        """Replace the whole active transcript, all or nothing (/retry, /undo, /compress)."""
        copies = [dict(transcript.validate_message(m)) for m in messages]
        return await self._write(
            lambda conn: summary_checkpoints.rewrite(conn, session_id, copies), dirty=False
        )

    async def load_transcript(self, session_id: str) -> list[dict[str, Any]]:
        messages = await self._db.read_now(lambda conn: transcript.load_small(conn, session_id))
        if messages is None:  # too long to read on the event loop's thread
            messages = await self._db.read(lambda conn: transcript.load(conn, session_id))
        return messages

    async def count_messages(self, session_id: str) -> int:
        return await self._db.read(lambda conn: transcript.count_active(conn, session_id))

    async def rewind_session(self, session_id: str, n: int = 1) -> dict[str, Any]:
        """Soft-delete the last `n` user turns; `{rewound_count, turns_undone, target_text}`."""
        if not 1 <= n <= MAX_REWIND:
            raise ValueError(f"n must be between 1 and {MAX_REWIND}")
        # The summary checkpoint follows in the same transaction.
        return await self._write(
            lambda conn: summary_checkpoints.rewind(conn, session_id, n), dirty=False
        )
