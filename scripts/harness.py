"""Run `hermes-gateway run` as a real subprocess, talk to it over its HTTP API, and
measure it: nearest-rank percentiles, its Prometheus `/metrics`, CPU from /proc.

Shared by the crash tests (tests/test_crash_recovery.py), the crash-loop driver, the
benchmarks and the load and soak drivers in scripts/. Everything stays on 127.0.0.1;
every wait is bounded.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.store import entries


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def home_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a gateway process on `home`: this one's, with HERMES_HOME set
    and no HERMES_CONFIG (the home's hermes.yaml is the config)."""
    env = {**os.environ, "HERMES_HOME": str(home), **(extra or {})}
    env.pop("HERMES_CONFIG", None)
    return env


class Daemon:
    """One gateway home directory; `start()` may be called again after a kill or stop."""

    def __init__(self, home: Path, settings: str = "", *, env: dict[str, str] | None = None):
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_env = env or {}
        self.log_path = home / "daemon.log"
        self.run_args = ["--log-json"]  # what follows `run` on the command line
        home.mkdir(parents=True, exist_ok=True)
        (home / "hermes.yaml").write_text(
            f"platforms:\n  http:\n    enabled: true\n    port: {self.port}\n{settings}"
        )

    # --- process ---------------------------------------------------------------------------

    # Start-up bounds are generous: a wait ends when the daemon is ready, so a long bound
    # costs nothing then, and a loaded machine (a test suite on every core) starts slowly.
    def start(
        self, timeout: float = 60.0, wait_ready: bool = True, env: dict[str, str] | None = None
    ) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "run", *self.run_args],
            env=home_env(self.home, {**self.extra_env, **(env or {})}),
            stdout=log,
            stderr=log,
        )
        log.close()
        if wait_ready:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.05) -> None:
        """Until /healthz says accepting, asking every `interval` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                health = self.get("/healthz", timeout=1)
                if health.get("accepting"):
                    return
            except (OSError, ValueError):  # not listening yet, or a half-read answer
                pass
            time.sleep(interval)
        raise TimeoutError(f"daemon not ready after {timeout}s: {self.log_tail()}")

    def kill9(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the gateway drains), then its exit code."""
        self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def ensure_stopped(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def log_problems(self, limit: int = 5) -> tuple[Counter, list[str]]:
        """Warning and error lines of the daemon's JSON log: counts by event, a few samples."""
        counts: Counter = Counter()
        samples: list[str] = []
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return counts, samples
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                if line.strip():
                    counts["(non-JSON output)"] += 1
                    if len(samples) < limit:
                        samples.append(line[:300])
                continue
            if record.get("level") in ("warning", "error", "critical"):
                counts[f"{record.get('level')}:{record.get('event')}"] += 1
                if len(samples) < limit:
                    samples.append(line[:300])
        return counts, samples

    # --- HTTP ------------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 5) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def post(self, chat_id: str, text: str, message_id: str | None = None, **extra: Any) -> dict:
        body = {"chat_id": chat_id, "user_id": "u1", "text": text, **extra}
        if message_id is not None:
            body["message_id"] = message_id
        request = urllib.request.Request(
            f"{self.url}/v1/messages",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())

    def replies(self, chat_id: str, after: int = 0, wait: float = 0) -> list[dict]:
        data = self.get(f"/v1/chats/{chat_id}/messages?after={after}&wait={wait}", wait + 5)
        return data["messages"]

    def wait_replies(self, chat_id: str, count: int, timeout: float = 20.0) -> list[dict]:
        """All replies of the chat once there are at least `count` (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.replies(chat_id)
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    # --- state on disk (read while the daemon is stopped, or read-only) --------------------

    def db(self) -> sqlite3.Connection:
        path = self.home / "sessions" / "state.db"
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True)

    def integrity_ok(self) -> bool:
        """`PRAGMA integrity_check` of state.db and of search.db (once it exists)."""
        search = self.home / "sessions" / "search.db"
        connections = [self.db()]
        if search.exists():
            connections.append(sqlite3.connect(f"file:{search}?mode=ro", uri=True))
        try:
            return all(
                conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok" for conn in connections
            )
        finally:
            for conn in connections:
                conn.close()

    def sessions_json(self) -> dict:
        return json.loads((self.home / "sessions" / "sessions.json").read_text())

    def transcript(self, session_key: str) -> list[tuple[str, str]]:
        conn = self.db()
        try:
            entry = entries.load_entry(conn, session_key)
            assert entry is not None, session_key
            session_id = entry.session_id
            rows = conn.execute(
                "SELECT role, content FROM messages WHERE session_id = ? AND active = 1"
                " ORDER BY id",
                (session_id,),
            ).fetchall()
        finally:
            conn.close()
        return [(role, content) for role, content in rows]

    def sent_texts(self, chat_id: str) -> list[str]:
        """The replies the ledger (`outbound`) records as sent to `chat_id`, in order.
        Read once the daemon has stopped, this is every reply it ever sends there."""
        conn = self.db()
        try:
            rows = conn.execute(
                "SELECT text FROM outbound WHERE chat_id = ? AND state = 'sent' ORDER BY id",
                (chat_id,),
            ).fetchall()
        finally:
            conn.close()
        return [text for (text,) in rows]

    def entry(self, session_key: str) -> dict | None:
        conn = self.db()
        try:
            entry = entries.load_entry(conn, session_key)
        finally:
            conn.close()
        return entry.to_dict() if entry else None


def is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, (urllib.error.URLError, ConnectionError, TimeoutError, OSError))


# --- measuring -------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float, *, ordered: bool = False) -> float:
    """Nearest-rank percentile (`ordered`: `values` is sorted already); nan when empty."""
    if not values:
        return math.nan
    if not ordered:
        values = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(values)))
    return values[rank - 1]


def fmt_ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    if math.isinf(seconds):
        return "inf"
    return f"{seconds * 1000:.2f}"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value} (comments skipped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def histogram(metrics: dict[str, float], name: str) -> list[tuple[float, float]]:
    """Cumulative buckets [(upper bound, count)] of histogram `name`, +Inf last."""
    pattern = re.compile(rf'^{re.escape(name)}_bucket\{{le="([^"]+)"\}}$')
    buckets = []
    for key, value in metrics.items():
        match = pattern.match(key)
        if match:
            buckets.append((float(match.group(1)), value))  # float("+Inf") is inf
    return sorted(buckets)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style estimate (linear within a bucket); nan without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: that bound is all we know
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def bucket_delta(
    now: list[tuple[float, float]], before: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The observations between two scrapes of one histogram."""
    old = dict(before)
    return [(upper, count - old.get(upper, 0.0)) for upper, count in now]


def cpu_seconds(stat_path: str | Path) -> float:
    """utime + stime (seconds) from a /proc stat file (a process: all its threads; a
    task: that thread). The command name may hold spaces, so the fields are counted
    after its closing parenthesis."""
    fields = Path(stat_path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
