"""One daemon per home: an exclusive `flock` on `$HERMES_HOME/gateway.lock`.

`run` takes the lock before it reads or writes any state and holds it for the life of
the process; `doctor --repair` holds it while it moves files. The kernel drops a flock
when its holder exits, however it exits (kill -9 included), so a lock file left behind
never blocks anyone: only a live holder does. The file holds the holder's PID, for the
message that refuses a second one. It is never deleted: a process that opened it just
before an unlink would lock a file nobody else sees.

A probe (`held_by`) takes a shared lock for an instant. A daemon starting in that
instant would see the home busy, so `HomeLock.acquire` retries for a moment
(`PROBE_GRACE_SECONDS`) before it gives up: a real holder keeps the lock far longer.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

LOCK_FILE = "gateway.lock"
PROBE_GRACE_SECONDS = 0.3
_RETRY_SECONDS = 0.02


class HomeInUse(Exception):
    """Another process holds the home's lock."""

    def __init__(self, path: Path, pid: int | None) -> None:
        self.path = path
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "a process whose pid it did not record"
        super().__init__(f"{path.parent} is in use by another hermes-gateway ({holder}; {path})")


class HomeUnusable(Exception):
    """The home or its lock file cannot be used (a directory where the lock file should
    be, a file where the home should be, no permission): nothing a retry would fix."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        reason = error.strerror or type(error).__name__
        if isinstance(error, IsADirectoryError):
            reason = "it is a directory, not a file: remove it"
        super().__init__(f"cannot lock {path}: {reason}")


class HomeLock:
    """The held lock; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, home: Path) -> HomeLock:
        """Lock `home` (creating it and the lock file, mode 0700/0600); raise HomeInUse,
        or HomeUnusable when the home or the lock file cannot be opened."""
        path = home / LOCK_FILE
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Not inherited by child processes (Python's default): a child outliving the
            # daemon must not keep the home locked.
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise HomeUnusable(path, exc) from None
        deadline = time.monotonic() + PROBE_GRACE_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise HomeInUse(path, _read_pid(path)) from None
                time.sleep(_RETRY_SECONDS)
            except OSError as exc:  # a file system without flock
                os.close(fd)
                raise HomeUnusable(path, exc) from None
            except BaseException:
                os.close(fd)
                raise
        try:
            os.fchmod(fd, 0o600)
            data = f"{os.getpid()}\n".encode()
            # Written over the old PID, then cut: a reader never sees an empty file.
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> HomeLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def held_by(home: Path) -> HomeInUse | None:
    """Who holds `home`'s lock (None: nobody), without creating anything."""
    path = home / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return HomeInUse(path, _read_pid(path))
    finally:
        os.close(fd)
    return None


def _read_pid(path: Path) -> int | None:
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None
