"""Crash-safe file helpers: atomic replace and setting damaged files aside."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None], mode: int = 0o600) -> None:
    """Produce `path` through `write(file)` so that it holds either the old or the new
    content, never a mix: temp file in the same directory, fsync, `os.replace`, fsync the
    directory. `write` may stream; nothing has to fit in memory at once.
    """
    # Unique per call: two writers of one path (threads, processes) must not share a temp.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    atomic_write(path, lambda file: file.write(data), mode)


def overwrite_in_place(path: Path, data: bytes) -> None:
    """Rewrite an existing small file in place: for when a full disk has no room for the
    temp file `atomic_write` needs, as rewriting within the block the file already holds
    takes no new one. Not atomic (a reader may catch it half-written), so only for files
    whose readers cope with that, such as status.json."""
    fd = os.open(path, os.O_WRONLY)  # no O_CREAT: a missing file would need a new block
    try:
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, len(data) - len(view)) :]
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def set_aside(path: Path, label: str = "corrupt") -> Path:
    """Rename a damaged file to `<name>.<label>-<UTC timestamp>` and return the new path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = path.with_name(f"{path.name}.{label}-{stamp}")
    os.replace(path, target)
    fsync_dir(path.parent)
    return target
