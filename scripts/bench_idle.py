"""What an idle gateway costs: bytes written into HERMES_HOME and CPU while nothing happens.

Starts a real daemon (`python -m gateway.cli run`) on a temporary home and a free port,
sends one message, waits for its reply and for what that message leaves behind (the
search index, the sessions.json mirror), then watches the home for `--window` seconds:

- `write_bytes` of the daemon in /proc/PID/io: what it handed to the block layer (page
  granular; 0 on tmpfs, so keep the home on a real disk, as by default under ./);
- `wchar`: bytes passed to write-like system calls (files, sockets, pipes);
- every file under the home, sampled every 50 ms (size, mtime, inode): which ones changed,
  how often, and how many bytes they grew (a rewrite in place grows nothing, hence the
  other two figures);
- CPU seconds (utime + stime of all the daemon's threads, /proc/PID/stat).

The daemon's own log goes beside the home, not into it (under systemd it goes to the
journal). Prints the figures and exits; the home is removed.

    python scripts/bench_idle.py                 # 30 s idle window
    python scripts/bench_idle.py --window 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import Daemon, cpu_seconds

ROOT = Path(__file__).resolve().parent.parent

SAMPLE_SECONDS = 0.05

FileState = tuple[int, int, int]  # size, mtime_ns, inode


def file_states(home: Path) -> dict[str, FileState]:
    """Every regular file under `home`, by relative path."""
    states: dict[str, FileState] = {}
    for path in home.rglob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue  # a temp file replaced while we looked
        if path.is_file():
            states[str(path.relative_to(home))] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return states


def proc_io(pid: int) -> dict[str, int]:
    fields = Path(f"/proc/{pid}/io").read_text().split("\n")
    return {name: int(value) for name, value in (line.split(": ") for line in fields if line)}


@dataclass
class IdleReport:
    window_seconds: float
    write_bytes: int
    wchar: int
    cpu_seconds: float
    changed_files: dict[str, int] = field(default_factory=dict)  # path -> changes seen
    growth_bytes: int = 0

    def lines(self) -> list[str]:
        per_day = 86_400 / self.window_seconds
        out = [
            f"idle window: {self.window_seconds:.1f} s",
            f"  write_bytes (block layer): {self.write_bytes} B"
            f"  (~{self.write_bytes * per_day / 1e6:.1f} MB/day)",
            f"  wchar (write calls):       {self.wchar} B",
            f"  files grown by:            {self.growth_bytes} B",
            f"  CPU: {self.cpu_seconds:.3f} s"
            f" ({100 * self.cpu_seconds / self.window_seconds:.2f}% of one core)",
        ]
        if self.changed_files:
            out.append("  files changed (times seen):")
            out += [f"    {name}: {n}" for name, n in sorted(self.changed_files.items())]
        else:
            out.append("  files changed: none")
        return out


def measure_idle(pid: int, home: Path, window: float) -> IdleReport:
    """Watch `home` and the process `pid` for `window` seconds."""
    io0, cpu0 = proc_io(pid), cpu_seconds(f"/proc/{pid}/stat")
    first = previous = file_states(home)
    changes: dict[str, int] = {}
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < window:
        time.sleep(min(SAMPLE_SECONDS, window - elapsed))
        now = file_states(home)
        for name in previous.keys() | now.keys():
            if previous.get(name) != now.get(name):
                changes[name] = changes.get(name, 0) + 1
        previous = now
    elapsed = time.monotonic() - started
    io1, cpu1 = proc_io(pid), cpu_seconds(f"/proc/{pid}/stat")
    growth = sum(max(0, state[0] - first.get(name, (0, 0, 0))[0]) for name, state in now.items())
    return IdleReport(
        window_seconds=elapsed,
        write_bytes=io1["write_bytes"] - io0["write_bytes"],
        wchar=io1["wchar"] - io0["wchar"],
        cpu_seconds=round(cpu1 - cpu0, 3),
        changed_files=changes,
        growth_bytes=growth,
    )


def wait_settled(daemon: Daemon, session_key: str, timeout: float = 30.0) -> None:
    """Until what one message leaves behind has landed: the mirror names its session and
    the search index and the memory index (its report in `log_readers`) have applied
    every logged message (bounded)."""
    deadline = time.monotonic() + timeout
    search = daemon.home / "sessions" / "search.db"
    while time.monotonic() < deadline:
        try:
            mirrored = session_key in daemon.sessions_json()
        except (FileNotFoundError, ValueError):
            mirrored = False
        if mirrored and search.exists() and _index_caught_up(daemon, search):
            return
        time.sleep(0.05)
    raise TimeoutError(f"the message's after-effects did not land in {timeout}s")


def _index_caught_up(daemon: Daemon, search: Path) -> bool:
    import sqlite3

    state = daemon.db()
    try:
        conn = sqlite3.connect(f"file:{search}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'applied_seq'").fetchone()
        finally:
            conn.close()
        (last,) = state.execute(
            "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'fts_log'), 0)"
        ).fetchone()
        # The memory indexer (transcripts on, the default) reports its own progress.
        memory = state.execute("SELECT applied FROM log_readers WHERE name = 'memory'").fetchone()
    except sqlite3.Error:
        return False
    finally:
        state.close()
    return row is not None and row[0] >= last and (memory is None or memory[0] >= last)


def run(window: float, settle: float, base: Path | None) -> IdleReport:
    workdir = Path(tempfile.mkdtemp(prefix="bench-idle-", dir=base))
    # This checkout's code, wherever the script is run from (`-m gateway.cli` would
    # otherwise import whichever `gateway` the working directory or venv offers).
    daemon = Daemon(workdir / "home", env={"PYTHONPATH": str(ROOT)})
    daemon.log_path = workdir / "daemon.log"  # the log is not the home's writes
    try:
        daemon.start()
        daemon.post("idle-bench", "one message before the idle window", message_id="m1")
        replies = daemon.wait_replies("idle-bench", 1)
        if not replies:
            raise RuntimeError(f"no reply: {daemon.log_tail()}")
        wait_settled(daemon, "agent:main:http:dm:idle-bench")
        time.sleep(settle)  # part of the definition of idle: this long after the last event
        assert daemon.proc is not None
        return measure_idle(daemon.proc.pid, daemon.home, window)
    finally:
        daemon.ensure_stopped()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=30.0, help="idle seconds watched")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds after the message's effects landed"
    )
    parser.add_argument(
        "--dir", type=Path, default=Path.cwd(), help="where the temporary home goes (not tmpfs)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    report = run(args.window, args.settle, args.dir)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        print(f"load average: {os.getloadavg()[0]:.2f}")
        print("\n".join(report.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
