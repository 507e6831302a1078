"""Where the default gateway's writes and waits go: the figures behind BENCHMARKS.md's
"Where the p99 at 100,000 sessions goes". A probe, not a benchmark: it reaches into the
store's private parts on purpose (as `bench_gateway.py --split` does), so that
production code carries no timing hooks.

    .venv/bin/python scripts/probe_turn_io.py --sessions 100000 pages
    .venv/bin/python scripts/probe_turn_io.py --sessions 100000 commits
    .venv/bin/python scripts/probe_turn_io.py --sessions 100000 memory
    .venv/bin/python scripts/probe_turn_io.py --sessions 10000 threads

`pages`: the background checkpointer held off, the WAL truncated after a warm-up, then
--turns turns one at a time (--concurrency); the WAL's frames are read back and each
page named by its B-tree (SQLite's `dbstat`): pages written a turn, and by what.

`commits`: the open loop of `bench_gateway.py` (--rate/s for --messages) with every
group commit timed, the event loop thread's system call and wait channel read every
0.5 ms while it commits (`/proc/self/task/<tid>/syscall` and `wchan`: Linux only), and
each background checkpoint's WAL length kept: the turns' p99, the slow commits, what
the loop waited on inside them, and how long the WAL grew between restarts.

`memory`: `bench_gateway.py`'s in-process run (start, warm-up, closed loop, open loop,
stop), in a process of its own as there, with the resident memory (VmRSS) read every
50 ms: its peak in each phase.

`threads`: the closed loop (--turns, 64 chats) with transcript indexing on, then off,
each in a fresh home; the CPU of every thread of the process (/proc) a turn, counted
over the loop and the 2.5 s after it (the indexers catch up then): which thread pays
for indexing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import shutil
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.ops.logs import configure_logging
from gateway.run import GatewayRunner
from gateway.store import checkpoint
from gateway.store.db import Database
from scripts.bench_gateway import fill_home
from scripts.gateway_driver import Driver, InProcessAdapter, gateway_config

# x86_64 system call numbers worth a name here
SYSCALLS = {"75": "fdatasync", "74": "fsync", "202": "futex (the GIL)", "18": "pwrite64"}
SLOW_COMMIT = 0.002  # seconds: a commit this long is listed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=("pages", "commits", "memory", "threads"))
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=300, help="pages: turns read back")
    parser.add_argument("--concurrency", type=int, default=1, help="pages: turns at once")
    parser.add_argument("--rate", type=float, default=1_000.0, help="commits: offered/s")
    parser.add_argument("--messages", type=int, default=10_000, help="commits: offered")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--home", type=Path, help="memory: a filled home (set by the probe)")
    return parser.parse_args(argv)


# --- pages -----------------------------------------------------------------------------


def wal_commits(wal: bytes) -> list[set[int]]:
    """The pages of each committed transaction in a WAL file's bytes (frames after the
    last commit frame are left out)."""
    if len(wal) < 32:
        return []
    page_size = struct.unpack(">I", wal[8:12])[0]
    commits: list[set[int]] = []
    pages: set[int] = set()
    offset = 32
    while offset + 24 + page_size <= len(wal):
        page, size_after_commit = struct.unpack(">II", wal[offset : offset + 8])
        pages.add(page)
        if size_after_commit:
            commits.append(pages)
            pages = set()
        offset += 24 + page_size
    return commits


async def _empty_wal(state: Path, tries: int = 20) -> None:
    """Copy the WAL back and truncate it, once no background reader holds it (an
    indexer's round may): tried a few times, then an error rather than a miscount."""
    for _ in range(tries):
        with contextlib.closing(sqlite3.connect(state, timeout=1.0)) as conn:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if not busy:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the WAL could not be emptied: a reader or writer stayed busy")


async def probe_pages(home: Path, args: argparse.Namespace) -> str:
    # The checkpointer would copy the WAL back and restart it under the probe.
    checkpoint.Checkpointer.start = lambda self: None  # type: ignore[method-assign]
    adapter = InProcessAdapter()
    runner = GatewayRunner(gateway_config(), [adapter], agent_factory=None, home=home)
    driver = Driver(runner, adapter, args.sessions)
    state = home / "sessions" / "state.db"
    await runner.start()
    try:
        await driver.closed_loop("warmup", args.warmup, args.concurrency, 1, 120)
        await asyncio.sleep(2.5)  # the indexers' rounds and their reports are written
        await _empty_wal(state)
        await driver.closed_loop("closed", args.turns, args.concurrency, 2, 120)
        wal = state.with_name("state.db-wal").read_bytes()
    finally:
        await runner.stop()
    commits = wal_commits(wal)
    with contextlib.closing(sqlite3.connect(state)) as conn:
        owner = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    by_tree: collections.Counter[str] = collections.Counter()
    for pages in commits:
        by_tree.update(owner.get(page, "(new pages)") for page in pages)
    total = sum(len(pages) for pages in commits)
    lines = [
        f"{args.sessions} sessions, {args.turns} turns {args.concurrency} at a time:"
        f" {len(commits)} commits ({len(commits) / args.turns:.2f} a turn), {total} pages"
        f" written, {total / args.turns:.1f} a turn; by B-tree, pages a turn:"
    ]
    lines += [f"  {n / args.turns:6.2f}  {name}" for name, n in by_tree.most_common()]
    return "\n".join(lines)


# --- commits ---------------------------------------------------------------------------


class LoopWatch:
    """The event loop thread's system call and wait channel, sampled from a thread of
    its own while a group commit runs; and each commit's duration."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()  # built on the event loop's thread
        self.committing = False
        self.samples: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.commits: list[float] = []
        self.done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        base = Path(f"/proc/self/task/{self.tid}")
        while not self.done.is_set():
            if self.committing:
                try:
                    call = (base / "syscall").read_text().split()
                    wait = (base / "wchan").read_text().strip() or "-"
                except OSError:
                    return
                name = SYSCALLS.get(call[0], call[0])
                fd = call[1] if call[0] in ("74", "75", "18") and len(call) > 1 else ""
                self.samples[(name, fd, wait)] += 1
            time.sleep(0.0005)

    def wrap(self, commit: Any) -> Any:
        def timed(database: Database) -> None:
            started = time.perf_counter()
            self.committing = True
            try:
                commit(database)
            finally:
                self.committing = False
                self.commits.append(time.perf_counter() - started)

        return timed


async def probe_commits(home: Path, args: argparse.Namespace) -> str:
    watch = LoopWatch()
    Database._commit_pending = watch.wrap(Database._commit_pending)  # type: ignore[method-assign]
    wal_lengths: list[tuple[int, int]] = []  # (WAL frames, frames copied) per checkpoint

    def checkpointed(conn: sqlite3.Connection) -> None:
        _, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        wal_lengths.append((frames, copied))

    checkpoint._checkpoint = checkpointed  # type: ignore[assignment]
    adapter = InProcessAdapter()
    runner = GatewayRunner(gateway_config(), [adapter], agent_factory=None, home=home)
    driver = Driver(runner, adapter, args.sessions)
    await runner.start()
    try:
        await driver.closed_loop("warmup", args.warmup, 64, 1, 120)
        watch.commits.clear()
        watch.samples.clear()
        wal_lengths.clear()
        result = await driver.open_loop("open", args.messages, args.rate, 3, 300)
        fds = {fd: Path(path).name for fd, path in _open_files().items() if "sessions" in path}
    finally:
        watch.done.set()
        await runner.stop()
    slow = sorted(d for d in watch.commits if d >= SLOW_COMMIT)
    frames = [frames for frames, _ in wal_lengths]
    restarts = sum(1 for a, b in itertools.pairwise(frames) if b < a)
    lines = [
        f"{args.sessions} sessions, {result['replies']} turns at {args.rate:.0f}/s offered:"
        f" p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms, max"
        f" {result['max_ms']:.1f} ms",
        f"group commits: {len(watch.commits)}, of them {len(slow)} of {SLOW_COMMIT * 1e3:.0f} ms"
        f" or more (median of those {statistics.median(slow) * 1e3 if slow else 0:.1f} ms,"
        f" max {max(slow, default=0) * 1e3:.1f} ms)",
        f"WAL at each background checkpoint: max {max(frames, default=0)} frames, median"
        f" {statistics.median(frames) if frames else 0:.0f}; {restarts} restarts in"
        f" {len(frames)} checkpoints, {sum(1 for f, c in wal_lengths if c < f)} left partial",
        "the event loop's thread inside commits, samples every 0.5 ms:",
    ]
    for (name, fd, wait), count in watch.samples.most_common(10):
        where = f" {fds.get(str(int(fd, 16)), fd)}" if fd else ""
        lines.append(f"  {count:6d}  {name}{where} (waiting in {wait})")
    return "\n".join(lines)


# --- memory and threads -------------------------------------------------------------


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def probe_memory(home: Path, args: argparse.Namespace) -> str:
    peaks: dict[str, float] = {"imports": _rss_mib()}
    phase = ["start"]

    def note() -> None:
        peaks[phase[0]] = max(peaks.get(phase[0], 0.0), _rss_mib())

    def enter(name: str) -> None:
        note()  # the phase ending, at its end (a short one may see no sample)
        phase[0] = name
        note()

    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            note()

    threading.Thread(target=sample, daemon=True).start()
    adapter = InProcessAdapter()
    runner = GatewayRunner(gateway_config(), [adapter], agent_factory=None, home=home)
    driver = Driver(runner, adapter, args.sessions)
    enter("start")
    await runner.start()
    try:
        enter("warm-up")
        await driver.closed_loop("warmup", args.warmup, 64, 1, 120)
        enter("closed loop")
        await driver.closed_loop("closed", args.messages, 64, 2, 300)
        enter("open loop")
        await driver.open_loop("open", args.messages, args.rate, 3, 300)
        enter("stop")
    finally:
        await runner.stop()
        done.set()
    note()
    lines = [f"{args.sessions} sessions: peak VmRSS (MiB) by phase"]
    lines += [f"  {name:12s} {mib:6.1f}" for name, mib in peaks.items()]
    return "\n".join(lines)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by its Python name (or its id)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(task.name), task.name)
        found[name] = (int(stat[11]) + int(stat[12])) / ticks
    return found


async def probe_threads(home: Path, args: argparse.Namespace) -> str:
    lines = []
    for indexing in (True, False):
        run_home = home.with_name(f"{home.name}-{'on' if indexing else 'off'}")
        shutil.copytree(home, run_home)
        adapter = InProcessAdapter()
        config = gateway_config("summary", indexing)
        runner = GatewayRunner(config, [adapter], agent_factory=None, home=run_home)
        driver = Driver(runner, adapter, args.sessions)
        await runner.start()
        try:
            await driver.closed_loop("warmup", args.warmup, 64, 1, 120)
            before, started = _thread_cpu(), time.process_time()
            await driver.closed_loop("closed", args.turns, 64, 2, 300)
            await asyncio.sleep(2.5)
            after, cpu = _thread_cpu(), time.process_time() - started
        finally:
            await runner.stop()
        per_turn = {
            name: (seconds - before.get(name, 0.0)) / args.turns * 1e6
            for name, seconds in after.items()
        }
        lines.append(
            f"transcript indexing {'on' if indexing else 'off'}: {cpu / args.turns * 1e6:.0f}"
            f" us of CPU a turn ({args.turns} turns, {args.sessions} sessions), by thread:"
        )
        lines += [
            f"  {us:7.1f}  {name}"
            for name, us in sorted(per_turn.items(), key=lambda item: -item[1])
            if us >= 0.5
        ]
    return "\n".join(lines)


def _open_files() -> dict[str, str]:
    fds = Path("/proc/self/fd")
    found = {}
    for fd in fds.iterdir():
        try:
            found[fd.name] = str(fd.readlink())
        except OSError:
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(json_output=True)
    if args.home is not None:  # the memory probe's own process, on a filled home
        sys.stdout.write(asyncio.run(probe_memory(args.home, args)) + "\n")
        return 0
    root = Path(tempfile.mkdtemp(prefix="probe-turn-io-"))
    try:
        home = root / "home"
        home.mkdir(mode=0o700)
        asyncio.run(fill_home(home, args.sessions))
        probes = {
            "pages": probe_pages,
            "commits": probe_commits,
            "memory": probe_memory,
            "threads": probe_threads,
        }
        if args.probe == "memory":  # a fresh process: its RSS is the run's own
            forwarded = ["--sessions", str(args.sessions), "--messages", str(args.messages)]
            forwarded += ["--rate", str(args.rate), "--warmup", str(args.warmup)]
            command = [sys.executable, __file__, "memory", "--home", str(home), *forwarded]
            report = subprocess.run(
                command, check=True, capture_output=True, text=True, timeout=900
            ).stdout.rstrip()
        else:
            report = asyncio.run(probes[args.probe](home, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # The gateway's log lines went to standard error; the report is the output.
    sys.stdout.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
