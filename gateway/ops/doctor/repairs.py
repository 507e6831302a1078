"""What `doctor --repair` does about the repairable findings, most fundamental first;
a damaged state.db is rebuilt beside itself from the rows it still yields."""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import sqlite3
from collections.abc import Callable
from pathlib import Path

from gateway.ops.doctor.checks import (
    INDEX_DBS,
    ORPHAN_TURNS,
    check_env_file,
    check_home,
    check_index_db,
    check_permissions,
    check_restart_counts,
    check_sessions_dir,
    check_sessions_json,
    check_state_db,
    check_temp_files,
    check_turns,
    db_usable,
    stale_temp_files,
)
from gateway.ops.doctor.findings import OK, Finding, Paths, connect_ro, read_mirror, rel
from gateway.ops.service import ENV_FILE
from gateway.store.fts import search_files, set_index_aside
from gateway.store.mirror import write_sessions_json
from gateway.store.salvage import create_database, salvage
from gateway.store.session_store import STATE_DB
from gateway.util.fsutil import fsync_dir, set_aside

# --- repairs ------------------------------------------------------------------------------


def repair_index_db(paths: Paths, name: str) -> str:
    moved = set_index_aside(paths.sessions / name)
    return f"set aside as {moved} (rebuilt at the next start)" if moved else "gone already"


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
    return "set to 0600: " + ", ".join(rel(paths, p) for p in fixed)


def repair_sessions_json(paths: Paths) -> str:
    aside = set_aside(paths.sessions_json)
    if not db_usable(paths):
        return f"set aside as {aside.name} (no usable state.db to rewrite it from)"
    count = write_sessions_json(paths.db, paths.sessions_json)
    return f"set aside as {aside.name}, rewrote {count} entries from state.db"


def repair_temp_files(paths: Paths) -> str:
    stale = stale_temp_files(paths)
    for path in stale:
        path.unlink(missing_ok=True)
    return f"deleted {len(stale)}"


def repair_restart_counts(paths: Paths) -> str:
    paths.restart_counts.unlink(missing_ok=True)
    return "deleted"


def repair_turns(paths: Paths) -> str:
    conn = sqlite3.connect(paths.db, isolation_level=None, timeout=5)
    try:
        deleted = conn.execute(f"DELETE {ORPHAN_TURNS}").rowcount
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
    mirror = read_mirror(paths.sessions_json)
    fresh = paths.sessions / f".{STATE_DB}.tmp-rebuild-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        asyncio.run(create_database(fresh))
        source = connect_ro(paths.db)
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
