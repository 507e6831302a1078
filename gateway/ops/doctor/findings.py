"""What the doctor reports and reads: a `Finding`, the `Paths` of a home, and read-only
looks at its files (state.db opened read-only, sessions.json parsed without touching it)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.domain.session import SessionEntry
from gateway.runner.recovery import RESTART_COUNTS
from gateway.store.session_store import SESSIONS_JSON, STATE_DB

OK, WARN, ERROR = "ok", "warn", "error"


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


def rel(paths: Paths, path: Path) -> str:
    return str(path.relative_to(paths.home))


def connect_ro(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=2000")
    return conn


def load_json_object(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_bytes())
    if not isinstance(data, dict):
        raise ValueError("top level is not an object")
    return data


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


def read_mirror(path: Path) -> dict[str, SessionEntry]:
    """The entries of sessions.json that parse, without touching the file."""
    try:
        raw = load_json_object(path)
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
