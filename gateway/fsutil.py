"""Crash-safe file helpers: atomic replace and setting damaged files aside."""

from __future__ import annotations

import os
import secrets
from datetime import UTC, datetime
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` so that `path` holds either the old or the new content, never a mix.

    Temp file in the same directory, fsync, `os.replace`, fsync the directory.
    """
    # Unique per call: two writers of one path (threads, processes) must not share a temp.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def set_aside(path: Path, label: str = "corrupt") -> Path:
    """Rename a damaged file to `<name>.<label>-<UTC timestamp>` and return the new path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = path.with_name(f"{path.name}.{label}-{stamp}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target
