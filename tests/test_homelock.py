"""One daemon per home (gateway/store/homelock.py): real daemons, real second runs on one home.

Each test owns its home and ports and stops every process it starts.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.store.homelock import LOCK_FILE, HomeInUse, HomeLock, held_by
from scripts.harness import Daemon
from tests.commandline import cli
from tests.waiting import wait_blocking

pytestmark = pytest.mark.timeout(180)  # daemons and CLI runs: slow on a loaded machine

KEY = "agent:main:http:dm:c1"
SETTINGS = (
    "agent:\n  backend: echo\n  delay_seconds: {delay}\nstorage:\n  mirror_interval_seconds: 0.1\n"
)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for daemon in made:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)  # a stopped process ignores SIGKILL's wait
        daemon.ensure_stopped()


def make(daemons: list[Daemon], home: Path, delay: float = 0) -> Daemon:
    daemon = Daemon(home, SETTINGS.format(delay=delay))
    daemons.append(daemon)
    return daemon


def files(home: Path) -> dict[str, bytes]:
    """Every file of the home, by relative path (the harness's own log left out)."""
    return {
        str(path.relative_to(home)): path.read_bytes()
        for path in sorted(home.rglob("*"))
        if path.is_file() and path.name != "daemon.log"
    }


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: "T" once a SIGSTOP has taken effect."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def freeze_between_writes(daemon: Daemon) -> dict[str, bytes]:
    """SIGSTOP the daemon at a moment it is between writes: its files all there and no
    atomic write's temp file in flight (else let it go on and try again). Its files."""
    proc = daemon.proc
    assert proc is not None
    expected = {"status.json", "sessions/state.db", "sessions/sessions.json"}
    frozen: dict[str, bytes] = {}

    def stopped_between_writes() -> bool:
        proc.send_signal(signal.SIGSTOP)
        wait_blocking(lambda: process_state(proc.pid) == "T", within=5)
        snapshot = files(daemon.home)
        if expected <= set(snapshot) and not any(".tmp-" in name for name in snapshot):
            frozen.update(snapshot)
            return True
        proc.send_signal(signal.SIGCONT)
        return False

    wait_blocking(stopped_between_writes, within=20)
    return frozen


def sessions_state(daemon: Daemon) -> dict[str, list[tuple[object, ...]]]:
    """Entries (with their flags), turn markers, inbox and transcripts, as stored."""
    conn = daemon.db()
    try:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("session_entries", "sessions", "turns", "inbox", "messages", "outbound")
        }
    finally:
        conn.close()


def wait_for_turn_marker(daemon: Daemon, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = daemon.db()
        try:
            if conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0]:
                return
        except sqlite3.OperationalError:
            pass  # the schema is not there yet
        finally:
            conn.close()
        time.sleep(0.02)
    raise AssertionError("the turn never started")


# --- the lock itself ------------------------------------------------------------------------


def test_the_lock_is_exclusive_private_and_names_its_holder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert held_by(home) is None and not home.exists()  # a probe creates nothing
    with HomeLock.acquire(home):
        path = home / LOCK_FILE
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(HomeInUse) as refused:
            HomeLock.acquire(home)  # another open file description: refused like a process
        assert refused.value.pid == os.getpid() and f"pid {os.getpid()}" in str(refused.value)
        holder = held_by(home)
        assert holder is not None and holder.pid == os.getpid()
    assert held_by(home) is None
    HomeLock.acquire(home).release()


def test_a_holder_killed_with_sigkill_leaves_a_file_that_blocks_nobody(tmp_path: Path) -> None:
    home = tmp_path / "home"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path;"
            " from gateway.store.homelock import HomeLock;"
            f" lock = HomeLock.acquire(Path({str(home)!r})); print('held', flush=True);"
            " time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(HomeInUse) as refused:
            HomeLock.acquire(home)
        assert refused.value.pid == holder.pid
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert (home / LOCK_FILE).read_text() == f"{holder.pid}\n"  # the stale file stays ...
    HomeLock.acquire(home).release()  # ... and blocks nobody


# --- a second daemon ------------------------------------------------------------------------


def test_a_second_run_is_refused_at_once_and_changes_nothing(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    first = make(daemons, tmp_path / "home", delay=1.0)
    first.start()
    assert first.post("c1", "hello", message_id="m1")["status"] == "started"
    wait_for_turn_marker(first)  # a turn in flight: what a second start took for a crash
    assert first.proc is not None
    # Frozen, the first writes nothing, so every byte of the home can be compared; it
    # still holds its lock and its port.
    before = freeze_between_writes(first)
    try:
        # A wait for the lock would never end (its holder is frozen): the refusal itself
        # proves there was none, on a machine of any speed (the timeout only bounds it).
        second = cli(first.home, "run", "--log-json", timeout=120)
        after = files(first.home)
    finally:
        first.proc.send_signal(signal.SIGCONT)
    assert second.returncode == 78, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert f"pid {first.proc.pid}" in second.stderr and "in use" in second.stderr
    assert after == before  # status.json, state.db, -wal, sessions.json: byte for byte

    # The first never noticed: its turn ends with one reply, nothing marked.
    assert [r["text"] for r in first.wait_replies("c1", 1)] == ["echo: hello"]
    assert first.transcript(KEY) == [("user", "hello"), ("assistant", "echo: hello")]
    entry = first.entry(KEY)
    assert entry is not None and not entry["resume_pending"] and not entry["suspended"]
    assert first.get("/healthz")["accepting"]


@pytest.mark.parametrize("left_by", ["clean stop", "kill -9"])
def test_a_run_whose_port_is_taken_marks_nothing(
    daemons: list[Daemon], tmp_path: Path, left_by: str
) -> None:
    daemon = make(daemons, tmp_path / "home", delay=1.0)
    daemon.start()
    daemon.post("c1", "hello", message_id="m1")
    if left_by == "clean stop":
        daemon.wait_replies("c1", 1)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait_exit() == 0
    else:
        wait_for_turn_marker(daemon)
        daemon.kill9()
    # SQLite may checkpoint state.db on open, so sessions are compared by content; the
    # markers and status files byte for byte.
    marker_files = ("status.json", ".clean_shutdown", "restart_counts.json", "sessions.json")
    before = files(daemon.home)
    sessions = sessions_state(daemon)
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        taken.bind(("127.0.0.1", daemon.port))
        taken.listen()
        failed = cli(daemon.home, "run", "--log-json")
    assert failed.returncode == 1, failed.stderr
    assert "cannot listen" in failed.stderr
    after = files(daemon.home)
    for name in marker_files:
        assert after.get(name) == before.get(name), name
    assert (".clean_shutdown" in after) == (left_by == "clean stop")
    assert sessions_state(daemon) == sessions  # no resume_pending, no suspension

    # The next start sees what the failed one saw: after kill -9, the interrupted turn is
    # resumed and answered once.
    daemon.start()
    assert [r["text"] for r in daemon.wait_replies("c1", 1)] == ["echo: hello"]


def test_doctor_repair_is_refused_while_read_only_commands_work(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home")
    daemon.start()
    daemon.post("c1", "hello", message_id="m1")
    daemon.wait_replies("c1", 1)
    assert daemon.proc is not None
    pid = f"pid {daemon.proc.pid}"
    before = sessions_state(daemon)
    repair = cli(daemon.home, "doctor", "--repair")
    assert repair.returncode == 1
    assert "--repair refused" in repair.stderr and pid in repair.stderr
    assert not list((daemon.home / "sessions").glob("*.corrupt-*"))
    doctor = cli(daemon.home, "doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert f"[ok] gateway: running ({pid})" in doctor.stdout
    listing = cli(daemon.home, "sessions", "list")
    assert listing.returncode == 0 and KEY in listing.stdout
    assert cli(daemon.home, "status").returncode == 0
    assert sessions_state(daemon) == before
    assert daemon.get("/healthz")["accepting"]
