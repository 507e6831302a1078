"""Where the files users send live, and their removal with the session they belong to.

Files go under `$HERMES_HOME/media/<session_id>/` (directories 0700, files 0600); the
transcript holds their paths, never their bytes. A session's directory goes when the
session does: at once for a delete through the runner or the CLI, and in the
housekeeping sweep (`sweep`) for every other way a session ends for good (pruned,
forgotten with its user): a directory whose session row is gone, or was pruned, is
removed.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.store.entries import END_PRUNED

if TYPE_CHECKING:
    from gateway.store.session_store import SessionStore

MEDIA_DIR = "media"


def media_root(home: Path) -> Path:
    return home / MEDIA_DIR


def session_media_dir(home: Path, session_id: str) -> Path:
    """The session's directory (not created). Session ids are gateway-made (no `/`)."""
    if "/" in session_id or "\\" in session_id or session_id in ("", ".", ".."):
        raise ValueError(f"not a session id: {session_id!r}")
    return media_root(home) / session_id


def remove_session_media(home: Path, session_id: str) -> bool:
    """Delete the session's files; True when there were any."""
    directory = session_media_dir(home, session_id)
    if not directory.exists():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True


def sessions_to_sweep(conn: sqlite3.Connection, session_ids: list[str]) -> list[str]:
    """Of `session_ids` (directories found on disk), those whose session is gone or pruned."""
    keep = set()
    for start in range(0, len(session_ids), 500):
        batch = session_ids[start : start + 500]
        marks = ",".join("?" * len(batch))
        keep.update(
            session_id
            for (session_id,) in conn.execute(
                f"SELECT session_id FROM sessions WHERE session_id IN ({marks})"
                " AND coalesce(end_reason, '') != ?",
                (*batch, END_PRUNED),
            )
        )
    return [session_id for session_id in session_ids if session_id not in keep]


def media_session_ids(home: Path) -> list[str]:
    root = media_root(home)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir())


async def sweep(store: SessionStore) -> int:
    """Remove the media directories of sessions that are gone or pruned; returns how
    many. One directory listing and one indexed read: cheap enough for every pass."""
    home = store.sessions_dir.parent
    found = media_session_ids(home)
    if not found:
        return 0
    gone = await store.read(lambda conn: sessions_to_sweep(conn, found))
    for session_id in gone:
        remove_session_media(home, session_id)
    return len(gone)
