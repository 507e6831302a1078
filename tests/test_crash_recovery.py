"""The real daemon as a subprocess: kill -9, drain, clean stop, stuck loops, redelivery,
damaged files. Each test owns its home directory and port and stops what it starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.runner.recovery import stuck_notice
from scripts.harness import Daemon
from tests.waiting import wait_blocking

pytestmark = pytest.mark.timeout(120)

KEY = "agent:main:http:dm:c1"


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for daemon in made:
        daemon.ensure_stopped()


def make(daemons: list[Daemon], home: Path, settings: str = "", **kwargs) -> Daemon:
    daemon = Daemon(home, settings, **kwargs)
    daemons.append(daemon)
    return daemon


def stopped_after_one_answer(daemons: list[Daemon], home: Path) -> Daemon:
    """A daemon that answered one message in chat c1 and then stopped cleanly: a home
    with a real state.db, transcript, mirror and ledger for a test to damage."""
    daemon = make(daemons, home, slow_echo(0))
    daemon.start()
    daemon.post("c1", "hi", message_id="m1")
    daemon.wait_replies("c1", 1)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    return daemon


def slow_echo(delay: float, drain: float = 60) -> str:
    return (
        f"agent:\n  backend: echo\n  delay_seconds: {delay}\n"
        f"  restart_drain_timeout: {drain}\n"
        "storage:\n  mirror_interval_seconds: 0.1\n"
    )


def wait_for_turn_marker(daemon: Daemon, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = daemon.db()
        try:
            if conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0]:
                return
        finally:
            conn.close()
        time.sleep(0.02)
    raise AssertionError("the turn never started")


def wait_for_restart_count(daemon: Daemon, count: int, timeout: float = 10) -> None:
    path = daemon.home / "restart_counts.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text()).get(KEY, {}).get("count") == count:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"restart count {count} never written")


def markers(daemon: Daemon) -> dict[str, tuple[int, bool]]:
    """Each open turn marker: session key -> (how many messages, running)."""
    conn = daemon.db()
    try:
        rows = conn.execute("SELECT session_key, inbox_ids, running FROM turns").fetchall()
    finally:
        conn.close()
    return {key: (len(json.loads(ids)), bool(running)) for key, ids, running in rows}


def wait_for_markers(daemon: Daemon, accept, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if accept(markers(daemon)):
            return
        time.sleep(0.02)
    raise AssertionError(f"markers never as expected: {markers(daemon)}")


def assert_files_sound(daemon: Daemon) -> None:
    assert daemon.integrity_ok()
    assert isinstance(daemon.sessions_json(), dict)


def test_kill9_during_a_slow_turn_gives_exactly_one_reply_after_restart(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(1.5))
    daemon.start()
    assert daemon.post("c1", "hello", message_id="m1")["status"] == "started"
    wait_for_turn_marker(daemon)
    daemon.kill9()

    daemon.start()
    replies = daemon.wait_replies("c1", 1)
    assert replies[0]["in_reply_to"] == "m1"
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    # Stopped, its turns drained: the ledger holds every reply it ever sends.
    assert daemon.sent_texts("c1") == ["echo: hello"]
    assert daemon.transcript(KEY) == [("user", "hello"), ("assistant", "echo: hello")]
    entry = daemon.entry(KEY)
    assert entry is not None and not entry["resume_pending"]
    assert_files_sound(daemon)


def test_sigterm_with_a_short_drain_marks_shutdown_timeout_and_resumes(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(3, drain=0.3))
    daemon.start()
    daemon.post("c1", "slow one", message_id="m1")
    wait_for_turn_marker(daemon)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    assert (daemon.home / ".clean_shutdown").exists()
    entry = daemon.entry(KEY)
    assert entry is not None
    assert entry["resume_pending"] and entry["resume_reason"] == "shutdown_timeout"
    conn = daemon.db()
    try:
        assert conn.execute("SELECT COUNT(*) FROM outbound").fetchone()[0] == 0  # no reply yet
    finally:
        conn.close()

    daemon.start()
    assert not (daemon.home / ".clean_shutdown").exists()
    assert [r["text"] for r in daemon.wait_replies("c1", 1)] == ["echo: slow one"]
    assert daemon.stop() == 0
    assert daemon.sent_texts("c1") == ["echo: slow one"]
    entry = daemon.entry(KEY)
    assert entry is not None and not entry["resume_pending"]
    assert daemon.transcript(KEY) == [("user", "slow one"), ("assistant", "echo: slow one")]


def test_clean_stop_leaves_the_marker_and_suspends_nothing(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    daemon.start()
    daemon.post("c1", "hi", message_id="m1")
    assert len(daemon.wait_replies("c1", 1)) == 1
    first = daemon.entry(KEY)
    daemon.signal(signal.SIGINT)
    assert daemon.wait_exit() == 0
    assert (daemon.home / ".clean_shutdown").exists()

    daemon.start()
    assert not (daemon.home / ".clean_shutdown").exists()
    entry = daemon.entry(KEY)
    assert entry is not None and first is not None
    assert not entry["suspended"] and not entry["resume_pending"]
    daemon.post("c1", "again", message_id="m2")
    assert [r["text"] for r in daemon.wait_replies("c1", 2)] == ["echo: hi", "echo: again"]
    assert daemon.entry(KEY)["session_id"] == first["session_id"]


def test_three_unclean_restarts_during_one_turn_suspend_the_session(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(30))
    daemon.start()
    daemon.post("c1", "never finishes", message_id="m1")
    first_id = None
    for count in (1, 2, 3):
        # Only a turn whose work had begun counts: kill it once it holds its slot.
        wait_for_markers(daemon, lambda m: m.get(KEY) == (1, True))
        first_id = first_id or daemon.entry(KEY)["session_id"]
        daemon.kill9()
        daemon.start()
        if count < 3:  # recovery writes the count once the adapters are up: wait for it
            wait_for_restart_count(daemon, count)
    replies = [r["text"] for r in daemon.wait_replies("c1", 1)]
    assert replies == [stuck_notice([{"text": "never finishes"}])]
    entry = daemon.entry(KEY)
    assert entry is not None and entry["suspended"]
    assert json.loads((daemon.home / "restart_counts.json").read_text()) == {}
    daemon.post("c1", "fresh start", message_id="m2")
    wait_for_turn_marker(daemon)
    conn = daemon.db()
    try:
        assert conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 1  # only the new one
    finally:
        conn.close()
    assert daemon.entry(KEY)["session_id"] != first_id


def test_a_stuck_merged_turn_is_set_aside_named_and_run_again_by_retry(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    """kill -9 three times while chat c1's turn of two merged messages runs, while chat
    c2's turn waits for the one agent slot each time: the notice counts and quotes c1's
    two messages, c2 is never counted and gets its answer, and /retry runs c1's messages
    again as one turn."""
    other = "agent:main:http:dm:c2"
    settings = slow_echo(3).replace("agent:\n", "agent:\n  max_concurrent_turns: 1\n", 1)
    daemon = make(daemons, tmp_path / "home", settings)
    daemon.start()
    daemon.post("c1", "first", message_id="m1")
    wait_for_turn_marker(daemon)
    daemon.post("c1", "second", message_id="m2")
    daemon.post("c1", "third", message_id="m3")
    # "first" answered, the merged turn of m2 and m3 runs and holds the slot.
    wait_for_markers(daemon, lambda m: m.get(KEY) == (2, True))
    daemon.post("c2", "waits its turn", message_id="n1")
    wait_for_markers(daemon, lambda m: m == {KEY: (2, True), other: (1, False)})

    def c1_runs(found: dict[str, tuple[int, bool]]) -> bool:
        return found.get(KEY) == (2, True) and found.get(other, (1, False)) == (1, False)

    for count in (1, 2, 3):
        daemon.kill9()
        daemon.start()
        if count < 3:
            wait_for_restart_count(daemon, count)
            counts = json.loads((daemon.home / "restart_counts.json").read_text())
            assert other not in counts  # it only waited
            wait_for_markers(daemon, c1_runs)
    notice = stuck_notice([{"text": "second"}, {"text": "third"}])
    assert "your 2 messages" in notice and '- "second"\n- "third"' in notice
    texts = [r["text"] for r in daemon.wait_replies("c1", 2)]
    assert texts == ["echo: first", notice]
    assert [r["text"] for r in daemon.wait_replies("c2", 1)] == ["echo: waits its turn"]

    daemon.post("c1", "/retry", message_id="m4")
    again = daemon.wait_replies("c1", 3)[-1]["text"]
    assert again.split("\n\n")[-1] == "echo: second\nthird"
    conn = daemon.db()
    try:
        states = conn.execute(
            "SELECT message_id, state FROM inbox WHERE message_id IN ('m2', 'm3')"
        ).fetchall()
    finally:
        conn.close()
    assert sorted(states) == [("m2", "done"), ("m3", "done")]
    daemon.post("c1", "/retry", message_id="m5")  # once: now an ordinary retry
    assert daemon.wait_replies("c1", 4)[-1]["text"].split("\n\n")[-1] == "echo: second\nthird"


def test_the_same_message_id_across_a_restart_gets_one_reply(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    daemon.start()
    assert daemon.post("c1", "once", message_id="dup-1")["status"] == "started"
    assert len(daemon.wait_replies("c1", 1)) == 1
    daemon.kill9()
    daemon.start()
    assert daemon.post("c1", "once", message_id="dup-1")["status"] == "duplicate"
    assert daemon.stop() == 0
    assert daemon.sent_texts("c1") == ["echo: once"]


def test_queued_messages_survive_a_kill9(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(1.0))
    daemon.start()
    daemon.post("c1", "first", message_id="m1")
    wait_for_turn_marker(daemon)
    assert daemon.post("c1", "/queue second", message_id="m2")["status"] == "queued"
    assert daemon.post("c1", "third", message_id="m3")["status"] == "pending"
    daemon.kill9()
    daemon.start()
    texts = [r["text"] for r in daemon.wait_replies("c1", 3, timeout=30)]
    assert texts == ["echo: first", "echo: third", "echo: second"]
    assert daemon.stop() == 0
    assert daemon.sent_texts("c1") == texts


def test_reply_cursor_stays_valid_across_a_restart(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    daemon.start()
    daemon.post("c1", "one", message_id="m1")
    (first,) = daemon.wait_replies("c1", 1)
    daemon.kill9()
    daemon.start()
    daemon.post("c1", "two", message_id="m2")
    deadline = time.monotonic() + 10
    newer: list[dict] = []
    while not newer and time.monotonic() < deadline:
        newer = daemon.replies("c1", after=first["seq"], wait=2)
    assert [r["text"] for r in newer] == ["echo: two"]
    assert newer[0]["seq"] > first["seq"]


def test_a_damaged_state_db_exits_78_naming_the_file(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = stopped_after_one_answer(daemons, tmp_path / "home")
    db = daemon.home / "sessions" / "state.db"
    size = db.stat().st_size
    with db.open("r+b") as f:  # keep the header, wreck the pages after it
        f.seek(4096)
        f.write(b"\xde\xad\xbe\xef" * ((size - 4096) // 4))
    daemon.start(wait_ready=False)
    assert daemon.wait_exit() == 78
    log = daemon.log_tail()
    assert "state.db" in log and "doctor --repair" in log
    assert db.stat().st_size == size  # left untouched, never replaced by empty state


@pytest.mark.parametrize("content", [b"", os.urandom(8192)], ids=["0 bytes", "random bytes"])
def test_a_state_db_that_is_empty_or_not_a_database_exits_78_and_changes_nothing(
    daemons: list[Daemon], tmp_path: Path, content: bytes
) -> None:
    # An empty file is an empty database to SQLite: importing the sessions.json mirror over
    # it would silently lose every transcript and the duplicate memory.
    daemon = stopped_after_one_answer(daemons, tmp_path / "home")
    sessions = daemon.home / "sessions"
    (sessions / "state.db").write_bytes(content)
    mirror = (sessions / "sessions.json").read_bytes()
    assert KEY in json.loads(mirror)
    daemon.start(wait_ready=False)
    assert daemon.wait_exit() == 78
    assert "state.db cannot be used" in daemon.log_tail()
    assert (sessions / "state.db").read_bytes() == content
    assert (sessions / "sessions.json").read_bytes() == mirror
    assert not (sessions / "state.db-wal").exists()


def test_a_missing_state_db_is_imported_from_sessions_json_with_a_warning(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    daemon.start()
    daemon.post("c1", "hi", message_id="m1")
    daemon.wait_replies("c1", 1)
    session_id = daemon.entry(KEY)["session_id"]
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    for path in (daemon.home / "sessions").glob("*.db*"):
        path.unlink()  # state.db lost (and its search index with it)

    doctor = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor"],
        env={**os.environ, "HERMES_HOME": str(daemon.home)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    line = next(x for x in doctor.stdout.splitlines() if "state.db" in x)
    assert line.startswith("[warn] state.db: missing: the next start imports the 1 routing")
    assert "duplicate memory" in line and "delivery ledger" in line and "transcripts" in line

    daemon.start()
    assert daemon.entry(KEY)["session_id"] == session_id  # the routing index is back
    [warning] = [
        json.loads(x) for x in daemon.log_tail(200).splitlines() if '"sessions_json_imported"' in x
    ]
    assert warning["level"] == "warning" and warning["entries"] == 1
    assert "duplicate memory" in warning["not_restored"]
    # What the warning says: the old message id is not remembered, so it is answered again.
    assert daemon.post("c1", "hi", message_id="m1")["status"] == "started"


def test_a_damaged_sessions_json_is_set_aside_and_rewritten(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = stopped_after_one_answer(daemons, tmp_path / "home")
    mirror = daemon.home / "sessions" / "sessions.json"
    mirror.write_text('{"agent:main:http:dm:c1": {"broken"')
    daemon.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if KEY in daemon.sessions_json():
                break
        except (ValueError, FileNotFoundError):
            pass
        time.sleep(0.05)
    assert KEY in daemon.sessions_json()
    assert list(mirror.parent.glob("sessions.json.corrupt-*"))
    assert "sessions_json_damaged" in daemon.log_tail(100)


def test_sd_notify_ready_watchdog_and_stopping(daemons: list[Daemon], tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(10)
    try:
        daemon = make(
            daemons,
            tmp_path / "home",
            slow_echo(0),
            env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"},
        )
        daemon.start()
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and seen.count("WATCHDOG=1") < 2:
            seen.append(sock.recv(4096).decode())
        assert any(m.startswith("READY=1") for m in seen)
        assert seen.count("WATCHDOG=1") >= 2
        daemon.signal(signal.SIGTERM)
        while "STOPPING=1" not in seen and time.monotonic() < deadline + 10:
            seen.append(sock.recv(4096).decode())
        assert "STOPPING=1" in seen
        assert daemon.wait_exit() == 0
    finally:
        sock.close()


def test_sigusr1_drains_and_exits_75(daemons: list[Daemon], tmp_path: Path) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    daemon.start()
    daemon.signal(signal.SIGUSR1)
    assert daemon.wait_exit() == 75
    assert (daemon.home / ".clean_shutdown").exists()


def test_admin_restart_command_exits_75_and_others_are_refused(
    daemons: list[Daemon], tmp_path: Path
) -> None:
    daemon = make(daemons, tmp_path / "home", slow_echo(0) + 'admins: ["http:boss"]\n')
    daemon.start()
    daemon.post("c1", "/restart", message_id="m1")
    (refusal,) = daemon.wait_replies("c1", 1)
    assert refusal["text"].startswith("Only an admin")
    assert daemon.proc is not None and daemon.proc.poll() is None
    daemon.post("c2", "/restart", message_id="m2", user_id="boss")
    assert daemon.wait_exit() == 75


def test_status_command_tells_running_from_dead(daemons: list[Daemon], tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    daemon = make(daemons, tmp_path / "home", slow_echo(0))
    env = {**os.environ, "HERMES_HOME": str(daemon.home)}

    def status() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", "status"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    assert status().returncode == 3
    daemon.start()
    # The status file is written off the event loop once the daemon runs: under load it
    # may trail the first /healthz answer by a moment.
    seen: list[subprocess.CompletedProcess[str]] = []

    def says_running() -> bool:
        seen.append(status())
        return seen[-1].returncode == 0 and "http: running" in seen[-1].stdout

    wait_blocking(says_running, within=30)
    assert "is running" in seen[-1].stdout
    daemon.kill9()
    dead = status()
    assert dead.returncode == 3 and "not running" in dead.stdout
