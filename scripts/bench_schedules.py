"""Benchmark the scheduler: the daemon's idle CPU with N schedules, and the
delay from a fire time to its run's turn begun.

On a fresh home, N schedules (`every 1h`, fire times spread over the hour after the
measurements, so none fires by itself) are written into state.db, plus --due ones that
fire during the run: one every 50 ms (spread), then --burst at one instant. The real
daemon (`python -m gateway.cli run`, echo agent, HTTP adapter on a free 127.0.0.1 port)
then runs:

1. idle: process CPU (all threads, /proc) over --idle-seconds with nothing due, as a
   percentage of one CPU; the same with no schedules at all, for comparison;
2. delay: each due run's claim time (`schedule_runs.started_at`, written in the
   transaction that begins its turn) minus its fire time: p50, p99, max.

    .venv/bin/python scripts/bench_schedules.py --schedules 10000
    .venv/bin/python scripts/bench_gateway.py --schedules 10000      # the same
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import GatewayConfig
from gateway.runner.recovery import CLEAN_SHUTDOWN
from gateway.schedules.cadence import Cadence
from gateway.session import SessionSource
from gateway.store import codec
from gateway.store import schedules as rows
from gateway.store.session_store import SessionStore
from scripts.harness import Daemon, cpu_seconds, percentile

PAGE = 1000
SPREAD_GAP = 0.05  # seconds between two spread due fire times
SETTINGS = "agent:\n  backend: echo\nschedules:\n  min_interval: 1\n  max_per_user: 1000000\n"


def schedule_row(index: int, next_run_at: float, now: float) -> dict[str, Any]:
    chat = f"bench{index}"
    target = SessionSource.from_dict(
        {"platform": "http", "chat_id": chat, "chat_type": "dm", "user_id": f"u{index}"}
    )
    cadence = Cadence("interval", "UTC", seconds=3600.0, anchor=next_run_at)
    return {
        "schedule_id": f"sch_{index:08x}",
        "agent_id": "main",
        "platform": "http",
        "chat_id": chat,
        "user_id": f"u{index}",
        "target": codec.dumps(target.to_dict()),
        "deliver": "chat",
        "prompt": f"scheduled job {index}",
        "cadence": cadence.to_json(),
        "status": rows.ACTIVE,
        "created_at": now,
        "updated_at": now,
        "next_run_at": next_run_at,
        "consecutive_failures": 0,
    }


async def fill(home: Path, fire_times: list[float], first: int = 0) -> None:
    """One schedule per fire time, through the store (migrations, pragmas) in pages;
    their numbers start at `first`."""
    now = time.time()
    async with SessionStore(home / "sessions", GatewayConfig()) as store:
        for start in range(0, len(fire_times), PAGE):
            page = [
                schedule_row(first + start + i, fire, now)
                for i, fire in enumerate(fire_times[start : start + PAGE])
            ]

            def write(conn: sqlite3.Connection, page: list[dict[str, Any]] = page) -> None:
                for row in page:
                    rows.insert(conn, row)

            await store.write(write, dirty=False)


def idle_cpu_percent(daemon: Daemon, seconds: float) -> float:
    assert daemon.proc is not None
    stat = f"/proc/{daemon.proc.pid}/stat"
    time.sleep(1.0)  # start-up's own work (recovery, the first status write) settles
    cpu0, wall0 = cpu_seconds(stat), time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_seconds(stat) - cpu0) / (time.monotonic() - wall0)


def delays(daemon: Daemon, count: int, timeout: float) -> list[float]:
    """Claim time minus fire time of the runs, oldest first, once `count` are claimed."""
    deadline = time.monotonic() + timeout
    while True:
        conn = daemon.db()
        try:
            found = conn.execute(
                "SELECT started_at - fire_time FROM schedule_runs"
                " WHERE started_at IS NOT NULL ORDER BY fire_time"
            ).fetchall()
        finally:
            conn.close()
        if len(found) >= count or time.monotonic() > deadline:
            return [d for (d,) in found]
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-schedules-"))
    result: dict[str, Any] = {"schedules": args.schedules}
    try:
        # Without schedules: the idle daemon's own cost (status file, housekeeping).
        bare = Daemon(root / "bare", SETTINGS)
        try:
            bare.start()
            result["idle_cpu_pct_none"] = idle_cpu_percent(bare, args.idle_seconds)
        finally:
            bare.ensure_stopped()

        home = root / "home"
        daemon = Daemon(home, SETTINGS)
        later = time.time() + 3600.0  # the idle ones fire in the hour after the run
        idle = [later + i * 3600.0 / max(args.schedules, 1) for i in range(args.schedules)]
        asyncio.run(fill(home, idle))
        (home / CLEAN_SHUTDOWN).write_text("clean shutdown\n")  # as a stopped daemon leaves
        try:
            started = time.monotonic()
            daemon.start()
            result["startup_s"] = time.monotonic() - started
            result["idle_cpu_pct"] = idle_cpu_percent(daemon, args.idle_seconds)
            # The due ones are added beside the running daemon, as the CLI adds them; it
            # sees them within a second, well before their first fire time.
            spread_at = time.time() + 3.0
            spread = [spread_at + i * SPREAD_GAP for i in range(args.due)]
            burst_at = (spread[-1] if spread else spread_at) + 2.0
            asyncio.run(fill(home, [*spread, *([burst_at] * args.burst)], first=len(idle)))
            measured = delays(daemon, args.due + args.burst, burst_at - time.time() + 30.0)
            problems, _ = daemon.log_problems()
            result["log_problems"] = dict(problems)
        finally:
            daemon.ensure_stopped()
        spread_delays = sorted(measured[: args.due])
        burst_delays = sorted(measured[args.due :])
        for name, values in (("spread", spread_delays), ("burst", burst_delays)):
            result[name] = {
                "runs": len(values),
                "p50_ms": 1000 * percentile(values, 50, ordered=True),
                "p99_ms": 1000 * percentile(values, 99, ordered=True),
                "max_ms": 1000 * max(values) if values else float("nan"),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def report(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [
        f"scheduler at {result['schedules']:,} schedules (+{args.due} spread, +{args.burst}"
        f" at one instant): idle CPU {result['idle_cpu_pct']:.2f}% of one core over"
        f" {args.idle_seconds:g} s (no schedules: {result['idle_cpu_pct_none']:.2f}%),"
        f" start-up {result['startup_s']:.2f} s"
    ]
    for name, label in (("spread", f"one every {SPREAD_GAP * 1000:.0f} ms"), ("burst", "at once")):
        r = result[name]
        lines.append(
            f"fire time -> turn begun, {r['runs']} runs {label}: p50 {r['p50_ms']:.1f} ms,"
            f" p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms"
        )
    if result["log_problems"]:
        lines.append(f"daemon log warnings/errors: {result['log_problems']}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000, help="idle schedules (N)")
    parser.add_argument("--due", type=int, default=200, help="runs fired one every 50 ms")
    parser.add_argument("--burst", type=int, default=100, help="runs fired at one instant")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="idle CPU window")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for line in report(run(args), args):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
