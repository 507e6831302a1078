"""Benchmark the whole gateway (not just the store) at 1,000 / 10,000 / 100,000 sessions.

Per size N, on a fresh HERMES home:

1. fill: N sessions written to disk through the store's own helpers (what the gateway
   writes for a new key), then the store is closed (which writes sessions.json) and the
   clean-shutdown marker is left, as a gateway stopped with SIGTERM leaves them;
2. start-up: `python -m gateway.cli run` (HTTP adapter on a free 127.0.0.1 port) from
   process start until /healthz says accepting, median of a few runs, each stopped with
   SIGTERM; the project's modules byte-compiled first, as an installed gateway's are;
3. in-process: the real GatewayRunner (real store, echo agent, production settings) with
   an in-process adapter (no network, scripts/gateway_driver.py) in a fresh Python
   process, so its peak RSS is its own. Closed loop: C chats, each sending its next
   message when its previous reply arrived. Open loop: messages offered at a fixed rate.
   Latency is from the `handle_message` call to the adapter's `send` of the reply's last
   chunk;
4. naive baseline: the same closed loop against a store that rewrites all of
   sessions.json on every message (capped by time);
5. the floor (scripts/bench_floor.py, in this process): the least SQL a durable turn
   can be, on plain sqlite3 with the gateway's own schema and pragmas. `cpu/floor` =
   `cpu_us / floor_us` is the figure that holds across machines.

The floor is made to do what the closed loop does: the same number of sessions (N),
the same number of turns (--messages) on keys drawn at random, every session starting
with no messages and every turn reading up to `agent.history_limit` (100) of its
session's newest messages, as the gateway's turn does (so both read the same history:
about 40 messages per turn at 1,000 sessions by the end of a run, about none at
100,000), and decodes it as the turn does. The floor commits --floor-batch turns at once
(16 by default: about what the gateway's group commit reaches with the closed loop's 64
chats, as --split prints it; a floor committing all 64 at once flattered itself); it
runs no agent.

    .venv/bin/python scripts/bench_gateway.py                  # 1k, 10k, 100k
    taskset -c 0 .venv/bin/python scripts/bench_gateway.py     # pinned to one CPU
    .venv/bin/python scripts/bench_gateway.py --quick          # 1k, seconds (the tests)
    .venv/bin/python scripts/bench_gateway.py --split          # also: where a turn's time goes
    .venv/bin/python scripts/bench_gateway.py --cold           # start-up as after a boot (root)
    .venv/bin/python scripts/bench_gateway.py --strategy window  # the window context strategy
    .venv/bin/python scripts/bench_gateway.py --schedules 10000  # the scheduler
    .venv/bin/python scripts/bench_gateway.py --stream  # streamed replies
    .venv/bin/python scripts/bench_gateway.py --backend postgres --replicas 1,2,3  # replicas

Keys are random among the N sessions; a key with a message in flight is not picked again
until its reply arrived, so every message gets its own turn and its own reply (two
messages to a busy session would merge into one turn). Every turn loads its session's
history, so at 1,000 sessions (about 40 messages each by the end of a default run) a
turn costs more than at 100,000 (about none). `cpu_us` (process CPU per closed-loop turn,
all threads) is the figure to compare on a busy machine. Everything stays on 127.0.0.1;
every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.runner.recovery import CLEAN_SHUTDOWN
from gateway.store import entries
from gateway.store.session_store import SessionStore
from gateway.util.fsutil import atomic_write_bytes
from scripts.bench_floor import GATEWAY_TURNS_PER_COMMIT, measure_floor
from scripts.bench_naive import run_naive
from scripts.gateway_driver import (
    gateway_config,
    run_gateway,
    source_for,
)
from scripts.harness import Daemon, home_env

FILL_BATCH = 10_000
HEADER = (
    f"{'sessions':>9} {'fill_s':>7} {'start_s':>7} {'turns/s':>8} {'cpu_us':>6} {'floor':>5}"
    f" {'cpu/fl':>6} {'p50_ms':>7}"
    f" {'p99_ms':>7} {'max_ms':>7} {'rate/s':>7} {'o_p50':>6} {'o_p99':>6} {'o_max':>7}"
    f" {'rss_MiB':>7} {'naive/s':>8} {'ratio':>6}"
)
TARGET_FLOOR_RATIO = 3.0
TARGET_TURNS = 5_000
TARGET_RATIO = 0.8
TARGET_P99_MS = 5.0
TARGET_RSS_BYTES = 200 * 1000 * 1000
TARGET_STARTUP_S = 1.0
COLD = " from a cold page cache"
BIG = 100_000
SMALL = 1_000


# --- 1. fill ------------------------------------------------------------------------------


async def fill_home(home: Path, n: int) -> float:
    """N sessions on disk as the gateway writes them for new keys; returns seconds taken.

    One `store.write` per FILL_BATCH keys (same rows, entries and sessions.json as
    `get_or_create_session` for each key, without a group-commit round trip per key).
    """
    started = time.perf_counter()
    store = SessionStore(home / "sessions", gateway_config())
    await store.open()
    try:
        for first in range(0, n, FILL_BATCH):
            last = min(n, first + FILL_BATCH)

            def fill(conn: Any, first: int = first, last: int = last) -> None:
                for i in range(first, last):
                    source = source_for(i)
                    entry = entries.fresh_entry(
                        store.session_key_for(source), source, datetime.now(UTC)
                    )
                    entries.start_session_row(conn, entry)
                    entries.save_entry(conn, entry)

            await store.write(fill)
    finally:
        await store.close()  # writes sessions.json, as at a gateway's shutdown
    # What GatewayRunner.stop leaves last: the next start is a clean one.
    atomic_write_bytes(home / CLEAN_SHUTDOWN, b"clean shutdown\n")
    return time.perf_counter() - started


# --- 2. start-up --------------------------------------------------------------------------


# The project's own packages, byte-compiled before start-up is timed (`compile_project`).
PACKAGES = ("gateway", "adapters", "config")


def compile_project() -> None:
    """Byte-compile the project's packages, as installing them does. With
    PYTHONDONTWRITEBYTECODE set (as in some shells and containers) an editable checkout
    is never cached, and every start compiled all of its modules from source first."""
    root = Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        compileall.compile_dir(root / package, quiet=1)


def measure_startup(home: Path, timeout: float = 60.0) -> float:
    """Seconds from process start until /healthz says accepting; stopped with SIGTERM.
    The project is byte-compiled first (`compile_project`), as a deployed one is."""
    compile_project()
    daemon = Daemon(home)
    started = time.perf_counter()
    daemon.start(wait_ready=False)
    try:
        daemon.wait_ready(timeout, interval=0.005)
        elapsed = time.perf_counter() - started
        code = daemon.stop(timeout=60)
        if code != 0:
            raise RuntimeError(f"gateway exited {code} after SIGTERM: {daemon.log_tail()}")
    finally:
        daemon.ensure_stopped()
    return elapsed


def drop_page_cache() -> None:
    """Empty the kernel's page cache (root only), as after a boot: `--cold`."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs root to drop the page cache: {exc}") from None


# --- 3. in-process gateway, in a process of its own (scripts/gateway_driver.py) -----------


def worker_main(args: argparse.Namespace) -> int:
    """The in-process run, in a Python process of its own (its ru_maxrss is its own)."""
    from gateway.ops.logs import configure_logging

    configure_logging(json_output=True)  # as `hermes-gateway run` does; to the worker log
    result = asyncio.run(run_gateway(Path(args.worker_home), args))
    Path(args.worker_result).write_text(json.dumps(result))
    return 0


def run_worker(home: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    result_path = home / "bench-result.json"
    log_path = home / "bench-worker.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker-home",
        str(home),
        "--worker-result",
        str(result_path),
        "--worker-sessions",
        str(n),
        "--messages",
        str(args.messages),
        "--warmup",
        str(args.warmup),
        "--concurrency",
        str(args.concurrency),
        "--rate",
        str(args.rate),
        "--open-messages",
        str(args.open_messages),
        "--seed",
        str(args.seed),
        "--max-seconds",
        str(args.max_seconds),
        *(["--split"] if args.split else []),
        *(["--budgets"] if args.budgets else []),
        *(["--worker-index", args.worker_index] if getattr(args, "worker_index", None) else []),
        "--strategy",
        args.strategy,
    ]
    with log_path.open("wb") as log:
        code = subprocess.run(
            command, env=home_env(home), stdout=log, stderr=log, timeout=3 * args.max_seconds + 120
        ).returncode
    if code != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"in-process run failed (exit {code}):\n{tail}")
    return json.loads(result_path.read_text())


# --- 4. naive baseline: scripts/bench_naive.py ----------------------------------------


# --- 5. the floor --------------------------------------------------------------------------


def run_floor(root: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """The floor beside the gateway: N sessions, --messages turns, each reading up to the
    gateway's `agent.history_limit` of what its session accumulated (see the docstring)."""
    return measure_floor(
        n,
        args.messages,
        args.floor_batch,
        root,
        history=0,
        read_limit=gateway_config().agent.history_limit,
        seed_value=args.seed + 1,
    )


# --- report -------------------------------------------------------------------------------


def bench_size(n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    home = root / f"home-{n}"
    home.mkdir(mode=0o700)
    fill_s = asyncio.run(fill_home(home, n))
    startups = []
    for _ in range(args.startup_samples):
        if args.cold:
            drop_page_cache()
        startups.append(measure_startup(home))
    gateway = run_worker(home, n, args)
    naive = run_naive(home, n, args)
    floor = run_floor(root, n, args)
    closed, opened = gateway["closed"], gateway["open"]
    row = {
        "sessions": n,
        "fill_s": fill_s,
        "startup_s": statistics.median(startups),
        "startup_samples": startups,
        "closed": closed,
        "open": opened,
        "rss_bytes": gateway["rss_bytes"],
        "naive": naive,
        "floor": floor,
        "floor_us": floor["floor_us"],
        "cpu_us": closed["cpu_us_per_turn"],
        "cpu_per_floor": closed["cpu_us_per_turn"] / floor["floor_us"],
        "ratio": closed["turns_per_s"] / naive["turns_per_s"] if naive["turns_per_s"] else None,
        "error_count": gateway["error_count"],
        "errors": gateway["errors"],
        "unexpected_sends": gateway["unexpected_sends"],
    }
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    return row


def format_row(r: dict[str, Any]) -> str:
    c, o = r["closed"], r["open"]
    ratio = f"{r['ratio']:.0f}x" if r["ratio"] is not None else "-"
    return (
        f"{r['sessions']:>9} {r['fill_s']:>7.1f} {r['startup_s']:>7.2f} {c['turns_per_s']:>8.0f}"
        f" {c['cpu_us_per_turn']:>6.0f} {r['floor_us']:>5.0f} {r['cpu_per_floor']:>5.1f}x"
        f" {c['p50_ms']:>7.2f} {c['p99_ms']:>7.2f} {c['max_ms']:>7.1f}"
        f" {o['achieved_per_s']:>7.0f} {o['p50_ms']:>6.2f} {o['p99_ms']:>6.2f} {o['max_ms']:>7.1f}"
        f" {r['rss_bytes'] / 2**20:>7.0f} {r['naive']['turns_per_s']:>8.1f} {ratio:>6}"
    )


def split_lines(closed: dict[str, Any]) -> list[str]:
    split, cpu = closed["split"], closed["cpu_us_per_turn"]
    head = (
        f"split: of {cpu:.0f} us CPU per turn, {split['store_us']:.0f} us in the store's"
        f" transactions ({split['turns_per_batch']:.1f} turns per commit), of which"
        f" {split['sql_us']:.0f} us in {split['statements']:.1f} SQLite statements; the other"
        f" {cpu - split['store_us']:.0f} us: runner, asyncio, driver, other threads"
    )
    return [head] + [
        f"  {row['us']:6.1f} us/turn ({row['per_turn']:.2f} per turn)  {row['sql']}"
        for row in split["by_statement"][:12]
    ]


def target_lines(rows: list[dict[str, Any]], rate: float, cold: bool = False) -> list[str]:
    by_size = {r["sessions"]: r for r in rows}
    big, small = by_size.get(BIG), by_size.get(SMALL)

    def verdict(ok: bool | None) -> str:
        return "n/a " if ok is None else "pass" if ok else "MISS"

    worst_floor = max(r["cpu_per_floor"] for r in rows)
    lines = [
        f"{verdict(worst_floor <= TARGET_FLOOR_RATIO)}  cpu_us <= {TARGET_FLOOR_RATIO:g}x"
        " floor_us at every size: "
        + ", ".join(f"{r['sessions']:,}: {r['cpu_per_floor']:.2f}x" for r in rows)
    ]
    if big is None:
        lines.append(f"n/a   (targets are about {BIG:,} sessions; that size was not run)")
    else:
        turns = big["closed"]["turns_per_s"]
        lines.append(
            f"{verdict(turns >= TARGET_TURNS)}  >= {TARGET_TURNS:,} turns/s at {BIG:,}"
            f" sessions: {turns:,.0f}/s"
        )
        if small is not None:
            ratio = turns / small["closed"]["turns_per_s"]
            lines.append(
                f"{verdict(ratio >= TARGET_RATIO)}  {BIG:,} within 20% of {SMALL:,}:"
                f" {ratio:.2f}x ({turns:,.0f} vs {small['closed']['turns_per_s']:,.0f}/s)"
            )
        else:
            lines.append(f"n/a   {BIG:,} within 20% of {SMALL:,}: {SMALL:,} was not run")
        rss = big["rss_bytes"]
        lines.append(
            f"{verdict(rss <= TARGET_RSS_BYTES)}  RSS <= 200 MB at {BIG:,} sessions:"
            f" {rss / 1e6:.0f} MB ({rss / 2**20:.0f} MiB)"
        )
        start = big["startup_s"]
        lines.append(
            f"{verdict(start <= TARGET_STARTUP_S)}  start-up <= {TARGET_STARTUP_S:g} s at"
            f" {BIG:,} sessions{COLD if cold else ''}: {start:.2f} s (samples "
            + ", ".join(f"{s:.2f}" for s in big["startup_samples"])
            + ")"
        )
    p99s = ", ".join(f"{r['sessions']:,}: {r['open']['p99_ms']:.2f} ms" for r in rows)
    worst = max(r["open"]["p99_ms"] for r in rows)
    rated = rate == 1000
    lines.append(
        f"{verdict(worst <= TARGET_P99_MS if rated else None)}  p99 <= {TARGET_P99_MS:g} ms at"
        f" 1,000 turns/s offered ({rate:g}/s offered): {p99s}"
    )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--messages", type=int, default=None, help="closed loop (20000)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop chats")
    parser.add_argument(
        "--floor-batch",
        type=int,
        default=GATEWAY_TURNS_PER_COMMIT,
        help=f"the floor's turns per commit ({GATEWAY_TURNS_PER_COMMIT}: what the gateway reaches)",
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="open loop, messages/s")
    parser.add_argument(
        "--open-messages", type=int, default=None, help="open loop (10 s worth, <= messages)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed messages first (500)")
    parser.add_argument("--startup-samples", type=int, default=None, help="median of (3)")
    parser.add_argument("--baseline-seconds", type=float, default=None, help="naive cap (10)")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="cap per loop")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="1k sessions, 2000 messages")
    parser.add_argument("--keep", action="store_true", help="keep the homes (prints where)")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before each start-up sample (root; as after a boot)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="also time the store's transactions and SQLite's statements per turn (slower)",
    )
    parser.add_argument(
        "--strategy",
        choices=("summary", "window"),
        default="summary",
        help="agent.context.strategy of the gateway under test (default: summary, the default)",
    )
    parser.add_argument(
        "--budgets",
        action="store_true",
        help="budgets on: every limit set (high enough never to refuse), so each turn is"
        " checked and its pace recorded (default: off, the default)",
    )
    parser.add_argument("--json", type=Path, help="also write all figures to this file")
    for hidden in ("--worker-home", "--worker-result"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--worker-sessions", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-index", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--recall",
        action="store_true",
        help="only long-term memory: recall p50/p99 over 100,000 chunks (--recall-chunks)"
        " and the closed loop's per-turn cost with transcript indexing on vs off",
    )
    parser.add_argument(
        "--recall-chunks",
        type=int,
        default=100_000,
        help="with --recall: chunks of the latency run (0: only the on/off A/B)",
    )
    parser.add_argument(
        "--recall-pairs",
        type=int,
        default=3,
        help="with --recall: interleaved on/off pairs of closed loops (3)",
    )
    parser.add_argument(
        "--schedules",
        type=int,
        default=None,
        metavar="N",
        help="only the scheduler: the daemon's idle CPU with N schedules and the delay from"
        " a fire time to its turn begun (scripts/bench_schedules.py; --quick: shorter)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="only streamed replies: edits per reply and first token -> first visible text"
        " p50/p99 (scripts/bench_stream.py; --quick: shorter)",
    )
    parser.add_argument(
        "--backend",
        choices=("sqlite", "postgres"),
        default=None,
        help="only replicas over HTTP (scripts/bench_replicas.py): one node on SQLite, then"
        " (postgres) each --replicas count on one PostgreSQL; --concurrency chats",
    )
    parser.add_argument(
        "--replicas",
        default=None,
        metavar="N,N,...",
        help="with --backend postgres: the replica counts to run (default 1,2,3)",
    )
    args = parser.parse_args(argv)
    if args.replicas is not None:
        try:
            args.replicas = [int(n) for n in args.replicas.split(",") if n.strip()]
        except ValueError:
            parser.error("--replicas: counts separated by commas, such as 1,2,3")
        if args.backend is None:
            args.backend = "postgres"
        if args.backend == "sqlite" and args.replicas != [1]:
            parser.error("--backend sqlite runs one node: --replicas 1 (or none)")
    quick = args.quick
    defaults = {
        "sizes": [SMALL] if quick else [SMALL, 10_000, BIG],
        "messages": 2_000 if quick else 20_000,
        "warmup": 100 if quick else 500,
        "startup_samples": 1 if quick else 3,
        "baseline_seconds": 2.0 if quick else 10.0,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.open_messages is None:
        args.open_messages = min(args.messages, int(args.rate * 10))
    if args.rate <= 0 or args.concurrency < 1 or args.messages < 1 or args.floor_batch < 1:
        parser.error("--rate, --concurrency, --messages and --floor-batch must be positive")
    if args.worker_home is None and min(args.sizes) <= args.concurrency:
        parser.error("every size must be larger than --concurrency")
    if args.recall_pairs < 1 or args.recall_chunks < 0:
        parser.error("--recall-pairs must be positive and --recall-chunks at least 0")
    return args


def recall_section(args: argparse.Namespace) -> int:
    """Long-term memory: recall latency, and what indexing costs a turn.

    The cost is an interleaved A/B in this one run: --recall-pairs pairs of closed loops,
    indexing on and off alternately (the order swapped every pair), each on a fresh copy
    of the same filled home, so that a machine whose load drifts shifts both sides alike.
    Each loop's CPU includes the background indexing of its own turns, no other (the
    indexers are caught up before it starts and before it ends: `gateway_driver.indexed`).
    The share is the median of the pairs' on/off - 1."""
    from scripts import bench_recall

    if args.recall_chunks > 0:
        recall_args = bench_recall.parse_args(["--chunks", str(args.recall_chunks)])
        result = bench_recall.run(recall_args)
        print(
            f"recall over {result['chunks']} chunks of one user: p50 {result['p50_ms']:.1f} ms,"
            f" p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms"
            f" ({recall_args.queries} queries; indexing them took {result['index_s']:.1f} s)",
            flush=True,
        )
    n = min(args.sizes)
    root = Path(tempfile.mkdtemp(prefix="bench-recall-turns-"))
    cpu: dict[bool, list[float]] = {True: [], False: []}
    try:
        filled = root / "filled"
        filled.mkdir(mode=0o700)
        asyncio.run(fill_home(filled, n))
        for pair in range(args.recall_pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for indexing in order:
                args.worker_index = "on" if indexing else "off"
                home = root / f"home-{pair}-{args.worker_index}"
                shutil.copytree(filled, home)
                result = run_worker(home, n, args)
                closed = result["closed"]
                shutil.rmtree(home, ignore_errors=True)
                cpu[indexing].append(closed["cpu_us_per_turn"])
                print(
                    f"pair {pair + 1}, {n} sessions, transcript indexing {args.worker_index:>3}:"
                    f" cpu_us/turn {closed['cpu_us_per_turn']:.0f},"
                    f" p50 {closed['p50_ms']:.2f} ms, p99 {closed['p99_ms']:.2f} ms,"
                    f" {closed['turns_per_s']:.0f} turns/s,"
                    f" peak RSS {result['rss_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [on / off for on, off in zip(cpu[True], cpu[False], strict=True) if off > 0]
    if ratios:
        share = statistics.median(ratios) - 1
        print(
            f"indexing on vs off over {len(ratios)} pairs: cpu_us/turn median"
            f" {statistics.median(cpu[True]):.0f} on, {statistics.median(cpu[False]):.0f} off;"
            f" median of the pairs' on/off {share:+.1%}"
            f" (pairs: {', '.join(f'{r - 1:+.0%}' for r in ratios)})"
        )
    return 0


def schedules_section(args: argparse.Namespace) -> int:
    """Scheduled jobs: idle CPU at N schedules, fire time -> turn begun."""
    from scripts import bench_schedules

    options = ["--schedules", str(args.schedules)]
    if args.quick:
        options += ["--due", "20", "--burst", "10", "--idle-seconds", "2"]
    schedule_args = bench_schedules.parse_args(options)
    for line in bench_schedules.report(bench_schedules.run(schedule_args), schedule_args):
        print(line)
    return 0


def stream_section(args: argparse.Namespace) -> int:
    """Streamed replies: edits per reply, first token -> first visible text."""
    from scripts import bench_stream

    stream_args = bench_stream.parse_args(["--quick"] if args.quick else [])
    for line in bench_stream.report(bench_stream.run(stream_args), stream_args):
        print(line, flush=True)
    return 0


def replicas_section(args: argparse.Namespace) -> int:
    """Replicas on PostgreSQL: closed-loop turns/s and reply latency over the
    HTTP API, SQLite on one node first."""
    from scripts import bench_replicas, replicas_report

    runs = [("sqlite", 1)]
    if args.backend == "postgres":
        runs += [("postgres", n) for n in args.replicas or [1, 2, 3]]
    window = ["--seconds", "3", "--warmup", "1"] if args.quick else []
    print(replicas_report.machine_line())
    print(
        f"closed loop: {args.concurrency} chats, chat i on replica i % N, POST then long-poll"
        " the reply on the same replica; echo agent; CPU in % of one core"
    )
    print(replicas_report.HEADER, flush=True)
    failed = False
    replica_args = bench_replicas.parse_args(["--chats", str(args.concurrency), *window])
    results = []
    for backend, replicas in runs:
        result = bench_replicas.run(replica_args, backend, replicas)
        results.append(result)
        print(replicas_report.format_row(result), flush=True)
        for line in replicas_report.notes(result):
            print(f"  {line}", flush=True)
        failed = failed or bool(replicas_report.failures(result))
    for line in replicas_report.ratio_lines(results):
        print(line, flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_home is not None:
        return worker_main(args)
    if args.recall:
        return recall_section(args)
    if args.schedules is not None:
        return schedules_section(args)
    if args.stream:
        return stream_section(args)
    if args.backend is not None:
        return replicas_section(args)
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    print(
        f"python {platform.python_version()}, {cpus} CPUs ({usable} usable by this process),"
        f" {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.2f}"
    )
    print(f"context strategy: {args.strategy} (--strategy; compare the two by cpu_us)")
    print(f"budgets: {'on, every limit' if args.budgets else 'off (the default)'} (--budgets)")
    print(
        f"closed loop: {args.messages} messages, {args.concurrency} chats, {args.warmup} warm-up;"
        f" open loop: {args.open_messages} messages at {args.rate:g}/s;"
        f" start-up: median of {args.startup_samples}{COLD if args.cold else ''};"
        f" naive: <= {args.baseline_seconds:g} s"
    )
    print(
        "latencies: handle_message -> adapter.send of the last chunk; o_ = open loop;"
        " cpu_us: process CPU per closed-loop turn (all threads); floor: floor_us, the"
        " same turns as the least SQL a durable turn can be (scripts/bench_floor.py, same"
        f" sessions, same history read and decoded, {args.floor_batch} turns per commit);"
        " cpu/fl: cpu_us / floor_us"
    )
    print(HEADER, flush=True)
    rows = []
    failed = False
    root = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    try:
        for n in args.sizes:
            row = bench_size(n, args, root)
            rows.append(row)
            print(format_row(row), flush=True)
            if row["error_count"] or row["unexpected_sends"]:
                failed = True
                print(
                    f"  {row['error_count']} failed messages, {row['unexpected_sends']}"
                    f" unexpected sends: {row['errors'][:5]}",
                    flush=True,
                )
            for phase in ("closed", "open"):
                if row[phase]["timed_out"]:
                    print(f"  {phase} loop stopped at --max-seconds: partial figures")
            if "split" in row["closed"]:
                for line in split_lines(row["closed"]):
                    print(f"  {line}")
            lag = row["open"]["max_schedule_lag_ms"]
            if lag > 50:
                print(
                    f"  open loop fell behind its schedule by up to {lag:.0f} ms"
                    f" ({row['open']['saturated_waits']} waits for a free key)"
                )
    finally:
        if args.keep:
            print(f"homes kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print("peak RSS is the in-process run's own (ru_maxrss of a fresh process)")
    print("targets:")
    for line in target_lines(rows, args.rate, args.cold):
        print(f"  {line}")
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
