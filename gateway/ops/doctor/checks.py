"""The doctor's checks, one `Finding` each: the home and its permissions, the lock and
env files, state.db and the indexes, the journal, schedules, turns, the shutdown markers,
PostgreSQL, the memory embedding; `run_checks` runs those that apply."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Collection
from pathlib import Path

from config import GatewayConfig
from gateway.memory.embeddings import local_model_problem
from gateway.memory.index import MEMORY_DB
from gateway.ops.doctor.findings import (
    ERROR,
    OK,
    WARN,
    Finding,
    Paths,
    connect_ro,
    load_json_object,
    read_mirror,
    rel,
)
from gateway.ops.doctor.mcp import check_mcp
from gateway.ops.service import ENV_FILE
from gateway.ops.status import is_live, read_status
from gateway.runner.recovery import CLEAN_SHUTDOWN, RESTART_COUNTS
from gateway.store.fts import SEARCH_DB, index_damage
from gateway.store.homelock import LOCK_FILE
from gateway.store.migrations import SCHEMA_VERSION
from gateway.store.mirror import IMPORT_CANNOT_RESTORE
from gateway.store.pg import health as pg_health
from gateway.store.pg.dsn import redact

INDEX_DBS = (SEARCH_DB, MEMORY_DB)
STALE_TEMP_SECONDS = 60
SCHEDULES_NAMED = 10  # undeliverable schedules named by id, at most
ORPHAN_TURNS = (  # no table alias: DELETE does not take one
    "FROM turns WHERE NOT EXISTS (SELECT 1 FROM session_entries e"
    " WHERE e.session_key = turns.session_key)"
    " OR NOT EXISTS (SELECT 1 FROM sessions s WHERE s.session_id = turns.session_id)"
)


# --- checks -------------------------------------------------------------------------------


def db_usable(paths: Paths) -> bool:
    return paths.db.exists() and check_state_db(paths).status == OK


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
        f"{rel(paths, p)} is {p.stat().st_mode & 0o777:04o}"
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
        detail = f"missing, but {rel(paths, wal)} is not: put state.db back, or move it aside"
        return Finding(name, ERROR, detail)
    if not paths.sessions_json.exists():
        return Finding(name, OK, "not created yet (the first start creates it)")
    count = len(read_mirror(paths.sessions_json))
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
        conn = connect_ro(paths.db)
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


def check_sessions_json(paths: Paths) -> Finding:
    name = "sessions.json"
    if not paths.sessions_json.exists():
        return Finding(name, OK, "absent (written from state.db by the gateway)")
    try:
        data = load_json_object(paths.sessions_json)
    except ValueError as exc:  # UnicodeDecodeError included
        fix = "sets it aside and rewrites it from state.db"
        return Finding(name, WARN, f"damaged: {exc}", True, fix)
    return Finding(name, OK, f"{len(data)} entries")


def stale_temp_files(paths: Paths) -> list[Path]:
    cutoff = time.time() - STALE_TEMP_SECONDS
    found = []
    for directory in (paths.home, paths.sessions):
        if directory.is_dir():
            found += [p for p in directory.glob(".*.tmp-*") if p.stat().st_mtime < cutoff]
    return sorted(found)


def check_temp_files(paths: Paths) -> Finding:
    stale = stale_temp_files(paths)
    if stale:
        names = ", ".join(rel(paths, p) for p in stale)
        return Finding("temp files", WARN, f"{len(stale)} stale: {names}", True, "deletes them")
    return Finding("temp files", OK, "none stale")


def check_restart_counts(paths: Paths) -> Finding:
    name = RESTART_COUNTS
    try:
        data = load_json_object(paths.restart_counts)
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
        conn = connect_ro(paths.db)
        try:
            if not 2 <= conn.execute("PRAGMA user_version").fetchone()[0] <= SCHEMA_VERSION:
                return []  # no journal tables yet (the next start migrates), or newer
            orphans = conn.execute(f"SELECT COUNT(*) {ORPHAN_TURNS}").fetchone()[0]
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
        conn = connect_ro(paths.db)
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
    found = check_journal(paths) if db_usable(paths) else []
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
            *check_mcp(config),
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
        found += check_mcp(config)
    found.append(check_clean_shutdown(paths))
    return [finding for finding in found if finding is not None]
