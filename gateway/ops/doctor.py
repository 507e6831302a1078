"""`hermes-gateway doctor [--repair] [--json]`: check the state directory, fix what is safe.

Each check yields one `Finding`. `--repair` (only while no gateway runs: it holds the
home's lock, `gateway.store.homelock`, so none starts meanwhile) fixes the repairable ones,
most fundamental first, then checks again. A damaged search.db or memory.db (indexes
derived from state.db) is a warning, set aside by --repair. A damaged `state.db` is never
deleted: it is set aside as `state.db.corrupt-<time>`, a fresh database is built next to
it from every row that can still be read, and the routing index is rebuilt from the
transcripts and the `sessions.json` mirror.

With `storage.backend: postgres` the state.db checks give way to the database's: it
answers, its schema version, its `leases` table (`check_postgres`).

Exit codes: 0 no errors, 1 errors (remaining after --repair), or --repair refused.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import sqlite3
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from config import GatewayConfig, hermes_home
from gateway.domain.session import SessionEntry
from gateway.memory.embeddings import local_model_problem
from gateway.memory.index import MEMORY_DB
from gateway.ops.service import ENV_FILE
from gateway.ops.status import is_live, read_status
from gateway.runner.recovery import CLEAN_SHUTDOWN, RESTART_COUNTS
from gateway.store.fts import SEARCH_DB, index_damage, search_files, set_index_aside
from gateway.store.homelock import LOCK_FILE, HomeInUse, HomeLock, HomeUnusable, held_by
from gateway.store.migrations import SCHEMA_VERSION
from gateway.store.mirror import IMPORT_CANNOT_RESTORE, write_sessions_json
from gateway.store.pg import health as pg_health
from gateway.store.pg.dsn import redact
from gateway.store.salvage import create_database, salvage
from gateway.store.session_store import SESSIONS_JSON, STATE_DB
from gateway.util.fsutil import fsync_dir, set_aside

OK, WARN, ERROR = "ok", "warn", "error"
INDEX_DBS = (SEARCH_DB, MEMORY_DB)
STALE_TEMP_SECONDS = 60
SCHEDULES_NAMED = 10  # undeliverable schedules named by id, at most
_ORPHAN_TURNS = (  # no table alias: DELETE does not take one
    "FROM turns WHERE NOT EXISTS (SELECT 1 FROM session_entries e"
    " WHERE e.session_key = turns.session_key)"
    " OR NOT EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = turns.session_id)"
)


@dataclass
class Finding:
    name: str
    status: str  # ok | warn | error
    detail: str = ""
    repairable: bool = False
    fix: str = ""  # what --repair does about it
    repaired: str | None = None  # what --repair did about it in this run

    def line(self) -> str:
        text = f"[{self.status}] {self.name}" + (f": {self.detail}" if self.detail else "")
        if self.repaired:
            text += f" (--repair: {self.repaired})"
        elif self.repairable and self.status != OK:
            text += f" (repairable: --repair {self.fix})"
        return text


@dataclass(frozen=True)
class Paths:
    home: Path
    sessions: Path
    db: Path
    sessions_json: Path
    restart_counts: Path

    @classmethod
    def of(cls, home: Path) -> Paths:
        sessions = home / "sessions"
        return cls(
            home, sessions, sessions / STATE_DB, sessions / SESSIONS_JSON, home / RESTART_COUNTS
        )

    def db_files(self) -> list[Path]:
        return [self.db, *(self.db.with_name(self.db.name + s) for s in ("-wal", "-shm"))]

    def state_files(self) -> list[Path]:
        return [*self.db_files(), self.sessions_json, self.restart_counts]


# --- helpers ------------------------------------------------------------------------------


def _rel(paths: Paths, path: Path) -> str:
    return str(path.relative_to(paths.home))


def _connect_ro(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=2000")
    return conn


def _load_json_object(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise ValueError("top level is not an object")
    return data


def _db_usable(paths: Paths) -> bool:
    return paths.db.exists() and check_state_db(paths).status == OK


def gateway_running(db: Path) -> bool:
    """Best effort: does another process (or connection) hold state.db open?

    In exclusive locking mode a WAL database needs an exclusive lock on the file, which
    any open connection of a running gateway prevents, even an idle one.
    """
    if not db.exists():
        return False
    try:
        conn = sqlite3.connect(f"file:{db}?mode=rw", uri=True, isolation_level=None, timeout=0.2)
    except sqlite3.Error:
        return False
    try:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("BEGIN EXCLUSIVE")
        conn.execute("ROLLBACK")
    except sqlite3.OperationalError as exc:
        code = getattr(exc, "sqlite_errorcode", None)
        return code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in str(exc)
    except sqlite3.Error:
        return False  # damaged or not a database: nobody can be using it usefully
    finally:
        conn.close()
    return False


def _read_mirror(path: Path) -> dict[str, SessionEntry]:
    """The entries of sessions.json that parse, without touching the file."""
    try:
        raw = _load_json_object(path)
    except (OSError, ValueError):
        return {}
    found: dict[str, SessionEntry] = {}
    for key, data in raw.items():
        try:
            entry = SessionEntry.from_dict(data)
        except (TypeError, ValueError, KeyError, AttributeError):
            continue
        entry.session_key = key
        found[key] = entry
    return found


# --- checks -------------------------------------------------------------------------------


def _check_directory(name: str, path: Path) -> Finding:
    if not path.is_dir():
        return Finding(name, ERROR, f"{path} does not exist or is not a directory")
    mode = path.stat().st_mode & 0o777
    if mode & 0o022:
        return Finding(
            name, WARN, f"{path} is group/world writable ({mode:04o})", True, "sets it to 0700"
        )
    return Finding(name, OK, f"{path} ({mode:04o})")


def check_home(paths: Paths) -> Finding:
    return _check_directory("home directory", paths.home)


def check_sessions_dir(paths: Paths) -> Finding | None:
    return (
        _check_directory("sessions directory", paths.sessions) if paths.sessions.exists() else None
    )


def check_permissions(paths: Paths) -> Finding:
    loose = [
        f"{_rel(paths, p)} is {p.stat().st_mode & 0o777:04o}"
        for p in paths.state_files()
        if p.exists() and p.stat().st_mode & 0o077
    ]
    if loose:
        return Finding("file permissions", WARN, ", ".join(loose), True, "sets them to 0600")
    return Finding("file permissions", OK, "state files are private")


def _check_missing_state_db(paths: Paths) -> Finding:
    name = "state.db"
    wal = paths.db.with_name(paths.db.name + "-wal")
    if wal.exists() and wal.stat().st_size:
        detail = f"missing, but {_rel(paths, wal)} is not: put state.db back, or move it aside"
        return Finding(name, ERROR, detail)
    if not paths.sessions_json.exists():
        return Finding(name, OK, "not created yet (the first start creates it)")
    count = len(_read_mirror(paths.sessions_json))
    detail = (
        f"missing: the next start imports the {count} routing entries of sessions.json, but"
        f" cannot bring back what only state.db held: {IMPORT_CANNOT_RESTORE}"
    )
    return Finding(name, WARN, detail)


def check_lock_file(paths: Paths) -> Finding | None:
    """`gateway.lock` (gateway.store.homelock): absent until the first start, then a file.
    Anything else stops every start (exit 78) and --repair; removing it is the operator's
    call, not a repair's: it may hold something of theirs."""
    path = paths.home / LOCK_FILE
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        detail = f"{path} is {kind}: the gateway cannot start until it is removed"
        return Finding(LOCK_FILE, ERROR, detail)
    return Finding(LOCK_FILE, OK, "a file (the lock one gateway holds while it runs)")


def check_env_file(paths: Paths) -> Finding:
    """The service's secrets file (`.env`, loaded by the unit): private when present."""
    path = paths.home / ENV_FILE
    name = "secrets file"
    if not path.exists():
        return Finding(name, OK, f"{ENV_FILE} absent (the service gets no variables from it)")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        detail = f"{path} is {mode:04o}: others may read its tokens; run: chmod 600 {path}"
        return Finding(name, WARN, detail, True, "sets it to 0600")
    return Finding(name, OK, f"{path} ({mode:04o})")


def check_state_db(paths: Paths) -> Finding:
    name, fix = "state.db", "sets it aside and rebuilds"
    if not paths.db.exists():
        return _check_missing_state_db(paths)
    if paths.db.stat().st_size == 0:
        return Finding(name, ERROR, "empty (0 bytes): its contents were lost", True, fix)
    try:
        conn = _connect_ro(paths.db)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                return Finding(
                    name,
                    ERROR,
                    f"schema version {version} is newer than this gateway ({SCHEMA_VERSION}):"
                    " upgrade hermes-gateway",
                )
            problems = [row[0] for row in conn.execute("PRAGMA integrity_check(10)")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return Finding(name, ERROR, f"integrity check failed: {exc}", True, fix)
    if problems != ["ok"]:
        return Finding(name, ERROR, f"integrity check failed: {'; '.join(problems)}", True, fix)
    return Finding(name, OK, f"integrity ok, schema version {version}")


def check_index_db(paths: Paths, name: str) -> Finding:
    """An index beside state.db (search.db, memory.db): derived, so a damaged one is only
    a warning: the gateway sets it aside at start and rebuilds it from state.db."""
    path = paths.sessions / name
    if not path.exists():
        return Finding(name, OK, "absent (built from state.db by the gateway)")
    problem = index_damage(path)
    if problem is not None:
        fix = "sets it aside (the gateway rebuilds it from state.db)"
        return Finding(name, WARN, f"damaged: {problem}", True, fix)
    return Finding(name, OK, "quick check ok")


def repair_index_db(paths: Paths, name: str) -> str:
    moved = set_index_aside(paths.sessions / name)
    return f"set aside as {moved} (rebuilt at the next start)" if moved else "gone already"


def check_sessions_json(paths: Paths) -> Finding:
    name = "sessions.json"
    if not paths.sessions_json.exists():
        return Finding(name, OK, "absent (written from state.db by the gateway)")
    try:
        data = _load_json_object(paths.sessions_json)
    except ValueError as exc:  # UnicodeDecodeError included
        fix = "sets it aside and rewrites it from state.db"
        return Finding(name, WARN, f"damaged: {exc}", True, fix)
    return Finding(name, OK, f"{len(data)} entries")


def _stale_temp_files(paths: Paths) -> list[Path]:
    cutoff = time.time() - STALE_TEMP_SECONDS
    found = []
    for directory in (paths.home, paths.sessions):
        if directory.is_dir():
            found += [p for p in directory.glob(".*.tmp-*") if p.stat().st_mtime < cutoff]
    return sorted(found)


def check_temp_files(paths: Paths) -> Finding:
    stale = _stale_temp_files(paths)
    if stale:
        names = ", ".join(_rel(paths, p) for p in stale)
        return Finding("temp files", WARN, f"{len(stale)} stale: {names}", True, "deletes them")
    return Finding("temp files", OK, "none stale")


def check_restart_counts(paths: Paths) -> Finding:
    name = RESTART_COUNTS
    try:
        data = _load_json_object(paths.restart_counts)
    except FileNotFoundError:
        return Finding(name, OK, "absent (no unclean restarts counted)")
    except (OSError, ValueError) as exc:
        return Finding(name, WARN, f"damaged: {exc}", True, "deletes it")
    return Finding(name, OK, f"{len(data)} keys counted")


def check_journal(paths: Paths, enabled: Collection[str] | None = None) -> list[Finding]:
    """Turn markers (first), the inbox and the outbound ledger of a sound state.db.
    `enabled`: the platforms the config enables (replies pending for another platform
    wait until it is enabled again, and are reported apart)."""
    try:
        conn = _connect_ro(paths.db)
        try:
            if not 2 <= conn.execute("PRAGMA user_version").fetchone()[0] <= SCHEMA_VERSION:
                return []  # no journal tables yet (the next start migrates), or newer
            orphans = conn.execute(f"SELECT COUNT(*) {_ORPHAN_TURNS}").fetchone()[0]
            (turns,) = conn.execute("SELECT COUNT(*) FROM turns").fetchone()
            # Accepted messages of keys with no entry and no turn are queued, not orphans.
            accepted, queued_new = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(NOT EXISTS (SELECT 1 FROM session_entries e"
                " WHERE e.session_key = i.session_key) AND NOT EXISTS (SELECT 1 FROM turns t"
                " WHERE t.session_key = i.session_key)), 0)"
                " FROM inbox i WHERE state = 'accepted'"
            ).fetchone()
            sql = "SELECT platform, COUNT(*) FROM outbound WHERE state = 'pending' GROUP BY 1"
            pending_by_platform = dict(conn.execute(sql).fetchall())
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return []
    if orphans:
        detail = f"{orphans} of {turns} point at an unknown session key or session id"
        marker = Finding("turn markers", WARN, detail, True, "deletes them")
    else:
        marker = Finding("turn markers", OK, f"{turns} in flight (resumed at the next start)")
    inbox = f"{accepted} accepted messages waiting for an answer"
    if queued_new:
        inbox += f" ({queued_new} for keys without a session yet: queued, not orphans)"
    return [marker, Finding("inbox", OK, inbox), _outbound(pending_by_platform, enabled)]


def _outbound(pending: dict[str, int], enabled: Collection[str] | None) -> Finding:
    stuck = {p: n for p, n in sorted(pending.items()) if enabled is not None and p not in enabled}
    going = sum(pending.values()) - sum(stuck.values())
    detail = f"{going} reply chunks pending (sent at the next start)"
    if not stuck:
        return Finding("outbound", OK, detail)
    where = ", ".join(f"{platform}: {count}" for platform, count in stuck.items())
    detail += f"; {sum(stuck.values())} for platforms not enabled ({where}), sent only once enabled"
    return Finding("outbound", WARN, detail)


def check_schedules(paths: Paths, config: GatewayConfig) -> Finding | None:
    """Active schedules whose runs cannot be delivered (their platform is not enabled,
    or they go to a home channel it does not have: each fire time is recorded
    `undeliverable`, nothing runs), and the undeliverable runs on record."""
    try:
        conn = _connect_ro(paths.db)
        try:
            active = conn.execute(
                "SELECT schedule_id, platform, deliver FROM schedules WHERE status = 'active'"
                " ORDER BY created_at"
            ).fetchall()
            homes = {platform for (platform,) in conn.execute("SELECT platform FROM home_channels")}
            sql = "SELECT COUNT(*) FROM schedule_runs WHERE status = 'undeliverable'"
            (undelivered,) = conn.execute(sql).fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return None  # no schedule tables yet (the next start migrates)
    enabled = set(config.connected_platforms())
    homes |= set(config.home_channels())
    stuck = [
        f"{schedule_id} ({platform} not enabled)"
        if platform not in enabled
        else f"{schedule_id} (no home channel on {platform})"
        for schedule_id, platform, deliver in active
        if platform not in enabled or (deliver == "home" and platform not in homes)
    ]
    if not stuck and not undelivered:
        return Finding("schedules", OK, f"{len(active)} active, each with somewhere to deliver")
    parts = []
    if stuck:
        shown = ", ".join(stuck[:SCHEDULES_NAMED]) + (" .." if len(stuck) > SCHEDULES_NAMED else "")
        parts.append(f"{len(stuck)} active schedules cannot deliver, so they do not run: {shown}")
    if undelivered:
        parts.append(f"{undelivered} runs on record were undeliverable")
    fix = "enable the platform or set its home channel, or remove the schedule"
    return Finding("schedules", WARN, f"{'; '.join(parts)} ({fix}; schedules runs ID)")


def check_turns(paths: Paths) -> Finding | None:
    """The turn-marker finding, only when state.db is sound (repairs write to it)."""
    found = check_journal(paths) if _db_usable(paths) else []
    return found[0] if found else None


def check_clean_shutdown(paths: Paths) -> Finding:
    if (paths.home / CLEAN_SHUTDOWN).exists():
        return Finding("clean shutdown", OK, "marker present: the last stop was clean")
    if not paths.db.exists():
        return Finding("clean shutdown", OK, "no marker (nothing stored yet)")
    detail = "no marker: the gateway is running or did not stop cleanly (recovery on start)"
    return Finding("clean shutdown", OK, detail)


def check_replica_stop(paths: Paths) -> Finding:
    """On PostgreSQL: how this home's replica last stopped, from its status.json. (No
    `.clean_shutdown` marker there: a replica runs no start-up recovery, the others
    resume its sessions as their leases expire.)"""
    name = "clean shutdown"
    status = read_status(paths.home)
    if status is None:
        return Finding(name, OK, "this home's replica has not run yet (no status.json)")
    if status.get("state") == "stopped":
        return Finding(name, OK, "this home's replica stopped cleanly (status.json)")
    if is_live(status):
        return Finding(name, OK, "this home's replica is running")
    detail = (
        "this home's replica did not stop cleanly: its sessions are resumed by a replica"
        " once their leases expire"
    )
    return Finding(name, OK, detail)


def check_postgres(dsn: str) -> list[Finding]:
    """A PostgreSQL store (storage.backend: postgres): it answers, its schema is this
    gateway's (or older: the next start migrates it), and the cluster's lease table is
    there. Reads only; the DSN is shown without its password."""
    found = pg_health.inspect(dsn)
    where = redact(dsn)
    if found.error is not None:
        return [Finding("postgres", ERROR, f"cannot connect to {where}: {found.error}")]
    findings = [Finding("postgres", OK, f"{where} ({found.server})")]
    name = "postgres schema"
    if found.schema is None:
        detail = "search_path names no schema that exists: nowhere to create the tables"
        return [*findings, Finding(name, ERROR, detail)]
    if found.version > SCHEMA_VERSION:
        detail = (
            f"schema version {found.version} is newer than this gateway ({SCHEMA_VERSION}):"
            " upgrade hermes-gateway"
        )
        return [*findings, Finding(name, ERROR, detail)]
    if found.version == 0:
        detail = "no schema yet (the first start creates it; storage migrate fills it)"
        return [*findings, Finding(name, OK, detail)]
    if found.version < SCHEMA_VERSION:
        detail = f"schema version {found.version}: the next start migrates it to {SCHEMA_VERSION}"
        findings.append(Finding(name, WARN, detail))
    else:
        findings.append(Finding(name, OK, f"schema version {found.version} in {found.schema}"))
    if not found.leases_table:
        detail = "table `leases` is missing: the schema is damaged (replicas cannot coordinate)"
        return [*findings, Finding("leases", ERROR, detail)]
    expired = f", {found.expired_leases} expired" if found.expired_leases else ""
    return [*findings, Finding("leases", OK, f"{found.leases} held{expired}")]


def check_memory_embedding(config: GatewayConfig) -> Finding:
    """What recall finds by: `hash` is lexical (said plainly, since recall "works" with
    it and only misses what is asked in other words); `local`'s model must be there."""
    memory = config.memory
    if memory.embedding == "hash":
        return Finding(
            "memory embedding",
            OK,
            "hash: lexical, finds notes sharing the question's words, not its meaning;"
            " for meaning set memory.embedding: openai (a local embeddings server such as"
            " Ollama's) or local (memory.model_path)",
        )
    if memory.embedding == "local":
        problem = local_model_problem(config)
        if problem is not None:
            return Finding("memory embedding", ERROR, problem)
        return Finding("memory embedding", OK, f"local: model2vec model in {memory.model_path}")
    where = memory.base_url or config.agent.base_url
    return Finding("memory embedding", OK, f"openai: {memory.model} at {redact_url(where)}")


def redact_url(url: str) -> str:
    """A URL without its user info (a password may be in it)."""
    scheme, sep, rest = url.partition("://")
    host = rest.rpartition("@")[2] if sep else url
    return f"{scheme}{sep}{host}" if sep else host


def run_checks(paths: Paths, config: GatewayConfig | None = None) -> list[Finding]:
    home = check_home(paths)
    if home.status == ERROR:
        return [home]
    storage = config.storage if config is not None else None
    if storage is not None and storage.backend == "postgres" and storage.dsn:
        # The store is in the database: state.db and its journal are not the gateway's.
        found = [
            home,
            check_sessions_dir(paths),
            check_permissions(paths),
            check_lock_file(paths),
            check_env_file(paths),
            *check_postgres(storage.dsn),
            check_temp_files(paths),
            check_restart_counts(paths),
            check_replica_stop(paths),
            check_memory_embedding(config),
        ]
        return [finding for finding in found if finding is not None]
    db = check_state_db(paths)
    found = [
        home,
        check_sessions_dir(paths),
        check_permissions(paths),
        check_lock_file(paths),
        check_env_file(paths),
        db,
        check_sessions_json(paths),
        *(check_index_db(paths, name) for name in INDEX_DBS),
        check_temp_files(paths),
        check_restart_counts(paths),
    ]
    if db.status == OK:  # the journal tables are only worth reading in a sound database
        enabled = config.connected_platforms() if config is not None else None
        found += check_journal(paths, enabled)
        if config is not None:
            found.append(check_schedules(paths, config))
    if config is not None:
        found.append(check_memory_embedding(config))
    found.append(check_clean_shutdown(paths))
    return [finding for finding in found if finding is not None]


# --- repairs ------------------------------------------------------------------------------


def repair_directory(path: Path) -> str:
    path.chmod(0o700)
    return "mode set to 0700"


def repair_mode(path: Path) -> str:
    path.chmod(0o600)
    return "mode set to 0600"


def repair_permissions(paths: Paths) -> str:
    fixed = [p for p in paths.state_files() if p.exists() and p.stat().st_mode & 0o077]
    for path in fixed:
        path.chmod(0o600)
    return "set to 0600: " + ", ".join(_rel(paths, p) for p in fixed)


def repair_sessions_json(paths: Paths) -> str:
    aside = set_aside(paths.sessions_json)
    if not _db_usable(paths):
        return f"set aside as {aside.name} (no usable state.db to rewrite it from)"
    count = write_sessions_json(paths.db, paths.sessions_json)
    return f"set aside as {aside.name}, rewrote {count} entries from state.db"


def repair_temp_files(paths: Paths) -> str:
    stale = _stale_temp_files(paths)
    for path in stale:
        path.unlink(missing_ok=True)
    return f"deleted {len(stale)}"


def repair_restart_counts(paths: Paths) -> str:
    paths.restart_counts.unlink(missing_ok=True)
    return "deleted"


def repair_turns(paths: Paths) -> str:
    conn = sqlite3.connect(paths.db, isolation_level=None, timeout=5)
    try:
        deleted = conn.execute(f"DELETE {_ORPHAN_TURNS}").rowcount
    finally:
        conn.close()
    return f"deleted {deleted}"


# Most fundamental first: a rebuilt state.db also rewrites sessions.json, and each repair
# runs only if its check still fails at that point.
REPAIRS: list[tuple[Callable[[Paths], Finding | None], Callable[[Paths], str]]] = [
    (check_home, lambda paths: repair_directory(paths.home)),
    (check_sessions_dir, lambda paths: repair_directory(paths.sessions)),
    (check_state_db, lambda paths: rebuild_state_db(paths)),
    (check_sessions_json, repair_sessions_json),
    *(
        (
            functools.partial(check_index_db, name=name),
            functools.partial(repair_index_db, name=name),
        )
        for name in INDEX_DBS
    ),
    (check_turns, repair_turns),
    (check_temp_files, repair_temp_files),
    (check_restart_counts, repair_restart_counts),
    (check_permissions, repair_permissions),
    (check_env_file, lambda paths: repair_mode(paths.home / ENV_FILE)),
]


def run_repairs(paths: Paths) -> dict[str, str]:
    done: dict[str, str] = {}
    for check, repair in REPAIRS:
        finding = check(paths)
        if finding is None or finding.status == OK or not finding.repairable:
            continue
        try:
            done[finding.name] = repair(paths)
        except (OSError, sqlite3.Error) as exc:
            done[finding.name] = f"failed: {exc}"
    return done


# --- rebuilding a damaged state.db (the rows: `gateway.store.salvage`) ---------------------


def rebuild_state_db(paths: Paths) -> str:
    """Build a fresh database from what the damaged one still yields, then swap it in.

    The fresh file is built beside the old one first, so a failure leaves state.db as it
    was; the damaged files are only ever renamed.
    """
    mirror = _read_mirror(paths.sessions_json)
    fresh = paths.sessions / f".{STATE_DB}.tmp-rebuild-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        asyncio.run(create_database(fresh))
        source = _connect_ro(paths.db)
        try:
            summary = salvage(source, fresh, mirror)
        finally:
            source.close()
    except BaseException:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{fresh}{suffix}").unlink(missing_ok=True)
        raise
    aside = [set_aside(path) for path in paths.db_files() if path.exists()]
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{fresh}{suffix}").exists():
            os.replace(f"{fresh}{suffix}", f"{paths.db}{suffix}")
    # The search index belongs to the old database: the gateway rebuilds it at start.
    for path in search_files(paths.sessions):
        path.unlink(missing_ok=True)
    fsync_dir(paths.sessions)
    if paths.sessions_json.exists() and check_sessions_json(paths).status != OK:
        set_aside(paths.sessions_json)
    count = write_sessions_json(paths.db, paths.sessions_json)
    return (
        f"set aside as {', '.join(p.name for p in aside)}; {summary};"
        f" sessions.json rewritten with {count} entries"
    )


# --- the command --------------------------------------------------------------------------


def _repair(paths: Paths) -> dict[str, str] | None:
    """Run the repairs holding the home's lock (a daemon cannot start meanwhile); None
    when a gateway runs (the reason is printed)."""
    try:
        lock = HomeLock.acquire(paths.home)
    except HomeInUse as exc:
        print(f"--repair refused: {exc}; stop it first", file=sys.stderr)
        return None
    except HomeUnusable as exc:
        print(f"--repair refused: {exc}", file=sys.stderr)
        return None
    with lock:
        # A gateway without the lock (an older version) still holds state.db open.
        if gateway_running(paths.db):
            print(
                "--repair refused: the gateway seems to be running (state.db is open in"
                " another process); stop it first",
                file=sys.stderr,
            )
            return None
        return run_repairs(paths)


def cmd_doctor(args: argparse.Namespace, config: GatewayConfig) -> int:
    paths = Paths.of(hermes_home())
    repaired: dict[str, str] = {}
    if args.repair and paths.home.is_dir():
        done = _repair(paths)
        if done is None:
            return 1
        repaired = done
    findings = run_checks(paths, config)
    if findings[0].status != ERROR:
        holder = held_by(paths.home)
        if holder is not None:
            state = f"running (pid {holder.pid or 'unknown'})"
        elif gateway_running(paths.db):
            state = "seems to be running (state.db is open in another process)"
        else:
            state = "not running"
        findings.insert(1, Finding("gateway", OK, state))
    for finding in findings:
        finding.repaired = repaired.get(finding.name)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            print(finding.line())
    return 1 if any(f.status == ERROR for f in findings) else 0


def add_doctor_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: list[argparse.ArgumentParser],
) -> None:
    """Add ``doctor``; ``parents`` carry the common options."""
    doctor = subparsers.add_parser(
        "doctor", parents=parents, help="check the state directory (and --repair it)"
    )
    doctor.add_argument(
        "--repair",
        action="store_true",
        help="fix what can be fixed (the gateway must be stopped); damaged files are set aside",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.set_defaults(handler=cmd_doctor)
