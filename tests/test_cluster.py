"""Three replicas on one PostgreSQL store, as real subprocesses on 127.0.0.1
ports, with an agent that records when each turn starts and ends. A load goes to all three
HTTP APIs, the housekeeping leader is killed with SIGKILL while it runs turns, and the
load goes on to the two left. Then, from the replies and the agent's record:

- no two turns of one session overlapped, across processes;
- every message got exactly one reply (none lost, none answered twice);
- every turn the killed replica left unfinished was run again exactly once, elsewhere;
- the leader role moved to another replica within `cluster.failover_seconds`.
"""

from __future__ import annotations

import html
import itertools
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.runner.housekeeping import RESEND_AFTER_SECONDS
from scripts.harness import Daemon
from tests.fakes.tcp_proxy import TcpProxy
from tests.pg_support import fresh_schema

pytestmark = pytest.mark.timeout(240)

FAILOVER = 3.0  # seconds: a short lease, so the test waits little for the takeover
TURN_SECONDS = 0.25
CHATS = 8
ROUNDS = 6  # messages per chat
HOUSEKEEPING = "leader:housekeeping"


@pytest.fixture
def dsn() -> Iterator[str]:
    with fresh_schema() as schema_dsn:
        yield schema_dsn


def replica_settings(record: Path, dsn: str, turn_seconds: float = TURN_SECONDS) -> str:
    return (
        "agent:\n  backend: tests.fakes.agents:recording\n"
        f"  options:\n    path: {json.dumps(str(record))}\n    delay: {turn_seconds}\n"
        f"storage:\n  backend: postgres\n  dsn: {json.dumps(dsn)}\n"
        f"cluster:\n  failover_seconds: {FAILOVER}\n"
    )


@pytest.fixture
def replicas(tmp_path: Path, dsn: str) -> Iterator[list[Daemon]]:
    settings = replica_settings(tmp_path / "turns.jsonl", dsn)
    made = [Daemon(tmp_path / f"replica{i}", settings) for i in range(3)]
    try:
        # Started together, then each waited for: three interpreter start-ups overlap.
        for daemon in made:
            daemon.start(wait_ready=False)
        for daemon in made:
            daemon.wait_ready()
        yield made
    finally:
        for daemon in made:
            daemon.ensure_stopped()


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def leader(daemons: list[Daemon]) -> Daemon | None:
    for daemon in daemons:
        try:
            replica = daemon.get("/healthz", timeout=2).get("replica", {})
        except OSError:
            continue
        if HOUSEKEEPING in replica.get("leader_of", []):
            return daemon
    return None


def wait_for(what: str, check: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(interval)
    raise AssertionError(f"no {what} within {timeout}s")


def post_round(daemons: list[Daemon], rounds: range) -> None:
    for i in rounds:
        for chat in range(CHATS):
            daemon = daemons[(chat + i) % len(daemons)]
            text = f"msg-{chat}-{i}"
            # /queue: each message is a turn of its own, in order (not merged).
            answer = daemon.post(f"c{chat}", f"/queue {text}", message_id=text)
            assert answer["status"] in ("queued", "pending", "started"), answer


def sent_texts(dsn: str) -> dict[str, list[str]]:
    """The replies the shared ledger (`outbound`) records as sent, by chat. Read once the
    replicas have stopped, this is every reply they ever send."""
    sent: dict[str, list[str]] = defaultdict(list)
    with psycopg.connect(dsn) as conn:
        query = "SELECT chat_id, text FROM outbound WHERE state = 'sent' ORDER BY id"
        for chat_id, text in conn.execute(query):
            sent[chat_id].append(text)
    return sent


def test_three_replicas_survive_a_sigkill(replicas: list[Daemon], tmp_path: Path, dsn: str) -> None:
    record = tmp_path / "turns.jsonl"
    first = wait_for("housekeeping leader", lambda: leader(replicas), FAILOVER * 3)
    # The console's overview lists every replica from the leases table, with its roles.
    owners = [d.get("/healthz")["replica"]["owner"] for d in replicas]
    with urllib.request.urlopen(replicas[1].url + "/console/", timeout=5) as page:
        overview = html.unescape(page.read().decode())
    assert all(owner in overview for owner in owners), overview
    assert overview.count("(this one)") == 1 and HOUSEKEEPING in overview
    victim = first
    others = [d for d in replicas if d is not victim]
    post_round(replicas, range(3))

    # Kill the leader while it runs a turn (a start of its pid with no end yet).
    assert victim.proc is not None
    victim_pid = victim.proc.pid

    def running_on_victim() -> bool:
        started: Counter[str] = Counter()
        for line in records(record):
            if line["pid"] == victim_pid:
                started[line["text"]] += 1 if line["ev"] == "start" else -1
        return any(count > 0 for count in started.values())

    wait_for("a turn running on the victim", running_on_victim, 20, interval=0.01)
    victim.kill9()
    killed_at = time.time()

    # The leader role moves within the failover time.
    moved = wait_for("a new housekeeping leader", lambda: leader(others), FAILOVER + 5)
    moved_after = time.time() - killed_at
    assert moved is not victim
    assert moved_after <= FAILOVER, f"leader moved after {moved_after:.1f}s"

    post_round(others, range(3, ROUNDS))

    def all_sent() -> bool:
        # The ledger, not the HTTP outbox: a reply the victim recorded but had not marked
        # sent is listed at once, and sent by a survivor once it is RESEND_AFTER_SECONDS
        # old (no row says whether a live sender still has it).
        sent = sent_texts(dsn)
        return all(len(sent[f"c{chat}"]) >= ROUNDS for chat in range(CHATS))

    wait_for("every reply sent", all_sent, 90 + RESEND_AFTER_SECONDS, interval=0.2)
    for daemon in others:
        assert daemon.stop() == 0
    replies = sent_texts(dsn)

    # Every message answered exactly once (none lost, none twice), in every chat.
    for chat in range(CHATS):
        expected = [f"done: msg-{chat}-{i}" for i in range(ROUNDS)]
        assert sorted(replies[f"c{chat}"]) == sorted(expected), replies[f"c{chat}"]

    lines = records(record)
    starts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    ends: dict[tuple[int, str], float] = {}
    for line in lines:
        if line["ev"] == "start":
            starts[line["text"]].append(line)
        else:
            ends[(line["pid"], line["text"])] = line["t"]

    # Interrupted turns (started on the victim, never finished there) ran again once, on
    # a live replica; no other turn ran twice.
    interrupted = [
        text
        for text, runs in starts.items()
        if any(r["pid"] == victim_pid and (victim_pid, text) not in ends for r in runs)
    ]
    assert interrupted, "the victim was killed with no turn running"
    for text, runs in starts.items():
        if text in interrupted:
            assert len(runs) == 2, (text, runs)
            assert runs[1]["pid"] != victim_pid and (runs[1]["pid"], text) in ends
        else:
            # A turn the victim finished but whose record did not commit runs again too.
            assert len(runs) <= 2 and all(r["pid"] == victim_pid for r in runs[:-1]), runs

    # No two turns of one session overlapped, across all three processes.
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for text, runs in starts.items():
        for run in runs:
            end = ends.get((run["pid"], text), killed_at)
            by_key[run["key"]].append((run["t"], end))
    for key, spans in by_key.items():
        spans.sort()
        for (_, earlier_end), (later_start, _) in itertools.pairwise(spans):
            assert later_start >= earlier_end, f"overlapping turns in {key}: {spans}"


def post_status(daemon: Daemon, chat: str, text: str) -> int:
    """The HTTP status of a POST (the harness's `post` expects 202)."""
    request = urllib.request.Request(
        f"{daemon.url}/v1/messages",
        data=json.dumps({"chat_id": chat, "user_id": "u1", "text": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def accepting(daemon: Daemon) -> bool:
    return bool(daemon.get("/healthz", timeout=5)["accepting"])


def test_a_replica_that_loses_the_database_stops_and_comes_back(tmp_path: Path, dsn: str) -> None:
    """Replica A reaches PostgreSQL through a proxy the test cuts while A runs a turn: A
    answers 503 and stops the turn before its lease can pass; B resumes the turn once; A
    serves again when the proxy is restored."""
    record = tmp_path / "turns.jsonl"
    proxy = TcpProxy("127.0.0.1", int(conninfo_to_dict(dsn).get("port") or 5432))
    proxy.start()
    via_proxy = make_conninfo(dsn, port=proxy.port)
    a = Daemon(tmp_path / "a", replica_settings(record, via_proxy, turn_seconds=2.5))
    b = Daemon(tmp_path / "b", replica_settings(record, dsn, turn_seconds=2.5))
    try:
        a.start(wait_ready=False)
        b.start(wait_ready=False)
        a.wait_ready()
        b.wait_ready()
        assert a.proc is not None
        a_pid = a.proc.pid
        a.post("c1", "long job", message_id="job-1")
        wait_for(
            "the turn to start on A",
            lambda: any(r["pid"] == a_pid and r["ev"] == "start" for r in records(record)),
            10,
            interval=0.01,
        )
        proxy.cut()
        # How soon A notices is timing (a loaded machine takes longer); what must hold
        # is the order checked below: A never finishes the turn B took over.
        wait_for("A to stop accepting", lambda: not accepting(a), FAILOVER + 10)
        assert post_status(a, "c2", "refused while cut") == 503

        replies = wait_for("the reply, from B", lambda: b.replies("c1"), FAILOVER + 15, 0.1)
        assert [m["text"] for m in replies] == ["done: long job"]
        # A never finished the turn it lost: B ran it, once.
        runs = [r for r in records(record) if r["text"] == "long job"]
        assert [(r["ev"], r["pid"] == a_pid) for r in runs] == [
            ("start", True),
            ("start", False),
            ("end", False),
        ], runs

        proxy.restore()
        wait_for("A to accept again", lambda: accepting(a), FAILOVER * 4, interval=0.1)
        a.post("c3", "after", message_id="after-1")
        assert [m["text"] for m in a.wait_replies("c3", 1, timeout=15)] == ["done: after"]
        assert a.stop() == 0 and b.stop() == 0
        assert sent_texts(dsn)["c1"] == ["done: long job"]  # still once
    finally:
        a.ensure_stopped()
        b.ensure_stopped()
        proxy.stop()


def test_a_replica_whose_database_does_not_answer_at_start_exits_to_be_restarted(
    tmp_path: Path,
) -> None:
    """Exit 75, not 78: the service manager (RestartPreventExitStatus=78) starts it again
    once the server answers. The DSN's password is in neither the output nor the log."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens once the probe is closed
    dsn = f"postgresql://hermes:s3cret-pw@127.0.0.1:{closed}/hermes"
    daemon = Daemon(tmp_path / "r", f"storage:\n  backend: postgres\n  dsn: {json.dumps(dsn)}\n")
    try:
        daemon.start(wait_ready=False)
        assert daemon.wait_exit(timeout=30) == 75
        output = daemon.log_path.read_text()
        assert "unreachable" in output and f"127.0.0.1:{closed}" in output, output
        assert "s3cret-pw" not in output
    finally:
        daemon.ensure_stopped()


def test_a_gateway_on_sqlite_never_loads_the_postgresql_driver() -> None:
    """psycopg costs 22 MiB of RSS: the default store must not pay for it."""
    probe = (
        "import sys, gateway.cli, gateway.run, gateway.store.session_store;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'psycopg'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout
