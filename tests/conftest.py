"""Test-wide settings.

Hypothesis runs derandomized by default, so a clean-clone CI run sees the same examples
every time. To explore with fresh random examples:

    HYPOTHESIS_PROFILE=explore .venv/bin/python -m pytest tests/test_store_model.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.pg_support import StorageBackend, fresh_schema

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# --- temporary files in RAM -------------------------------------------------------------
# The suite's stores, daemons and scripts commit (and so fsync) thousands of times; on a
# disk shared with other work each fsync costs milliseconds to seconds, most of some
# tests' time. Where Linux offers a RAM file system (/dev/shm) pytest's tmp_path and
# every `tempfile` here and in the processes the tests start go there. No test rests on
# data outliving the machine: their crashes are kill -9, which the page cache survives
# on a disk too. A TMPDIR set by the caller is left as it is, and so is a small /dev/shm
# (a container's default is 64 MiB: the benchmark scripts' stores would fill it).
RAM_TMP = Path("/dev/shm")
RAM_TMP_MIN_FREE = 2 * 1024**3


def _ram_tmp_usable() -> bool:
    if not (RAM_TMP.is_dir() and os.access(RAM_TMP, os.W_OK | os.X_OK)):
        return False
    fs = os.statvfs(RAM_TMP)
    return fs.f_bavail * fs.f_frsize >= RAM_TMP_MIN_FREE


if "TMPDIR" not in os.environ and _ram_tmp_usable():
    os.environ["TMPDIR"] = str(RAM_TMP)
    tempfile.tempdir = None  # gettempdir() may have been asked already: ask it again


# --- store backends ---------------------------------------------------------------------
# A test that takes the `store_backend` fixture runs once per backend: SQLite files, and a
# schema of its own on the PostgreSQL test server (tests/pg_support.py; skipped, with the
# reason, only when no server answers). `@pytest.mark.sqlite_only` keeps a test about
# state.db's files (damage, sessions.json, WAL) to SQLite.


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sqlite_only: the test is about SQLite's files; not run on PostgreSQL"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_backend" in metafunc.fixturenames:
        backends = ["sqlite"]
        if metafunc.definition.get_closest_marker("sqlite_only") is None:
            backends.append("postgres")
        metafunc.parametrize("store_backend", backends, indirect=True)


@pytest.fixture
def store_backend(request: pytest.FixtureRequest) -> Iterator[StorageBackend]:
    """The backend under test: `storage` config for it (None for SQLite's default)."""
    if request.param == "sqlite":
        yield StorageBackend("sqlite", None)
        return
    with fresh_schema() as dsn:
        yield StorageBackend("postgres", dsn)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts (append them): each is killed, if still running, and
    reaped at the end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
