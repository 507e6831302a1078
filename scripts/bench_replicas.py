"""Several gateway replicas on one PostgreSQL, beside one node on SQLite:
closed-loop turns/s and reply latency over the real daemons' HTTP APIs.

    .venv/bin/python scripts/bench_replicas.py --backend postgres --replicas 1,2,3
    .venv/bin/python scripts/bench_replicas.py --backend postgres --replicas 3 --no-baseline
    .venv/bin/python scripts/bench_replicas.py --backend sqlite        # the baseline alone
    .venv/bin/python scripts/bench_gateway.py --backend postgres --replicas 1,2,3

`--replicas` takes a count or counts separated by commas; on PostgreSQL each count is run
in turn, after one node on SQLite in the same invocation (unless `--no-baseline`), and the
ratios are printed against the targets: one replica at least `TARGET_ONE` of the SQLite
node's turns/s, two replicas at least `TARGET_TWO` of one replica's.

For each row it starts N daemons (`python -m gateway.cli run`, scripts/harness.py Daemon, each in a
home of its own with its HTTP API on a free 127.0.0.1 port; echo agent, production
settings otherwise) on a PostgreSQL schema it creates for the run and drops at the end
(`--dsn`, else $HERMES_TEST_PG_DSN, else the local trust-auth server), or one daemon on
SQLite. Then a closed loop: `--chats` chats, chat i talking to replica i % N; each posts
a message (a unique message_id), long-polls `GET /v1/chats/{chat}/messages?after=SEQ&wait=S`
on the same replica until the reply to it is there, and posts the next. The first
`--warmup` seconds are not measured; then for `--seconds`:

- turns/s: replies that became visible inside the window, per second;
- reply latency (POST sent -> reply seen by the long-poll) of the messages sent in it;
- errors: POSTs not accepted (non-202, a timeout) and replies not seen in time;
- missing / duplicated: read at the end from another replica than the one each chat
  used (the database, not one process's view): a reply to every accepted message,
  none twice (both must be 0);
- CPU (/proc) over the window as % of one core: the daemons, the PostgreSQL backends
  serving them (matched by client port in pg_stat_activity when the window opens,
  plus the server's background processes such as the WAL writer, which serve anyone
  else on the server too) and this client.

Client, daemons and PostgreSQL share the machine; numbers move with whatever else runs.
Everything stays on 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import Daemon, cpu_seconds, percentile
from scripts.load_http import ACCEPTED, ECHO_PREFIX, POLL_WAIT, Client
from scripts.replicas_report import HEADER, failures, format_row, machine_line, notes, ratio_lines

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
REPLY_TIMEOUT = 30.0  # seconds a chat waits for one reply before it counts as an error
MAX_TURNS_PER_CHAT = 100_000  # a bound on each chat's loop besides its deadline
FINAL_PAGES = 1_000  # pages of 500 replies read per chat at the end, at most
SETTLE_SECONDS = 0.5  # after the last reply: time for a reply sent twice to show up
WAIT_SAMPLE = 0.02  # seconds between two looks at what the PostgreSQL backends do


# --- the daemons ------------------------------------------------------------------------------


def replica_settings(dsn: str | None, delay: float) -> str:
    """hermes.yaml after the HTTP section: the echo agent, and the shared store if any."""
    text = f"agent:\n  backend: echo\n  delay_seconds: {delay}\n"
    if dsn is not None:
        text += f"storage:\n  backend: postgres\n  dsn: {json.dumps(dsn)}\n"
    return text


@contextlib.contextmanager
def pg_schema(dsn: str) -> Iterator[str]:
    """A new schema for the run: yields a DSN whose search_path is on it; dropped after."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    from gateway.store.pg.dsn import redact

    schema = f"bench_{secrets.token_hex(6)}"
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.Error as exc:
        raise SystemExit(f"no PostgreSQL at {redact(dsn)} (--dsn): {str(exc).strip()}") from None
    try:
        yield make_conninfo(dsn, options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


# --- CPU from /proc ---------------------------------------------------------------------------


def socket_ports(pids: list[int]) -> set[int]:
    """Local TCP ports of the sockets these processes hold (their fds -> /proc/net/tcp)."""
    inodes: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9] in inodes:
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def pg_server_pids(dsn: str, client_pids: list[int]) -> tuple[list[int], list[int]]:
    """PostgreSQL processes working for these clients: (the backends whose client port is
    one of theirs, the server's background processes, which serve any other client too)."""
    import psycopg

    ports = socket_ports(client_pids)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        rows = conn.execute(
            "SELECT pid, client_port, backend_type FROM pg_stat_activity"
            " WHERE pid <> pg_backend_pid()"
        ).fetchall()
    backends = [pid for pid, port, kind in rows if kind == "client backend" and port in ports]
    return backends, [pid for pid, _, kind in rows if kind != "client backend"]


def sample_waits(dsn: str, pids: list[int], stop: threading.Event, seconds: float) -> Counter:
    """What these backends do, sampled from pg_stat_activity every WAIT_SAMPLE seconds
    until `stop` (or `seconds`): the number of samples, and per busy backend (a statement
    running, or a transaction open) what it was doing: `running`, its wait event, or
    `in transaction, waiting for the gateway`. Idle backends are not counted."""
    import psycopg

    counts: Counter[str] = Counter()
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        for _ in range(int(seconds / WAIT_SAMPLE) + 1):
            if stop.is_set():
                break
            counts["(samples)"] += 1
            rows = conn.execute(
                "SELECT state, wait_event_type, wait_event FROM pg_stat_activity"
                " WHERE pid = ANY(%s) AND state <> 'idle'",
                (pids,),
            ).fetchall()
            for state, kind, event in rows:
                if state == "idle in transaction":
                    counts["in transaction, waiting for the gateway"] += 1
                else:
                    counts["running" if kind is None else f"{kind}:{event}"] += 1
            stop.wait(WAIT_SAMPLE)
    return counts


def cpu_of(pids: list[int]) -> dict[int, float]:
    """CPU seconds (all threads) of each process still there."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            found[pid] = cpu_seconds(f"/proc/{pid}/stat")
    return found


def waited_for_cpu(pids: list[int]) -> dict[int, float]:
    """Seconds the threads of each process were runnable but not running (waiting for a
    CPU: /proc schedstat), summed over its threads."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total = 0
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[1])
            found[pid] = total / 1e9
    return found


@dataclass
class CpuWindow:
    """Process CPU over the measured window, as % of one core (100 = a whole core), and
    the time their threads waited for a CPU, in the same unit."""

    daemon_pids: list[int]
    pg_pids: list[int] = field(default_factory=list)
    start: dict[str, Any] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        return {
            "wall": time.monotonic(),
            "client": time.process_time(),
            "daemons": cpu_of(self.daemon_pids),
            "pg": cpu_of(self.pg_pids),
            "daemons_runq": waited_for_cpu(self.daemon_pids),
            "pg_runq": waited_for_cpu(self.pg_pids),
        }

    def begin(self) -> None:
        self.start = self.snapshot()

    def end(self) -> dict[str, float]:
        end = self.snapshot()
        wall = max(end["wall"] - self.start["wall"], 1e-9)

        def used(group: str) -> float:
            before, after = self.start[group], end[group]
            # a process gone by the end (a backend that disconnected) is left out
            return sum(after[pid] - before[pid] for pid in after if pid in before)

        return {
            "daemons": 100 * used("daemons") / wall,
            "pg": 100 * used("pg") / wall if self.pg_pids else math.nan,
            "client": 100 * (end["client"] - self.start["client"]) / wall,
            "daemons_runq": 100 * used("daemons_runq") / wall,
            "pg_runq": 100 * used("pg_runq") / wall if self.pg_pids else math.nan,
        }


# --- the closed loop --------------------------------------------------------------------------


@dataclass
class Tally:
    """What the chats saw; times are the event loop's clock."""

    warm: float  # the window opens
    end: float  # the window closes: no new message after it
    latencies: array = field(default_factory=lambda: array("d"))
    turns: int = 0  # replies visible inside the window
    sent: int = 0
    errors: Counter = field(default_factory=Counter)
    accepted: dict[str, set[str]] = field(default_factory=dict)  # chat -> its message ids


async def chat_loop(client: Client, chat: str, tally: Tally) -> None:
    """One chat: post, long-poll the same replica for the reply, post the next."""
    loop = asyncio.get_running_loop()
    url = f"{client.base}/v1/chats/{chat}/messages"
    ours = tally.accepted.setdefault(chat, set())
    cursor = 0
    for n in range(MAX_TURNS_PER_CHAT):
        if loop.time() >= tally.end:
            return
        message_id = f"{chat}-{n}"
        body = {"chat_id": chat, "user_id": "bench", "text": message_id, "message_id": message_id}
        sent_at = loop.time()
        tally.sent += 1
        try:
            async with client.posts.post(f"{client.base}/v1/messages", json=body) as resp:
                status = (await resp.json())["status"] if resp.status == 202 else resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = type(exc).__name__
        if status not in ACCEPTED:
            tally.errors[f"post {status}"] += 1
            await asyncio.sleep(0.05)  # a refusal: do not spin
            continue
        ours.add(message_id)
        expected = ECHO_PREFIX + message_id
        deadline = sent_at + REPLY_TIMEOUT
        seen = False
        while not seen and (remaining := deadline - loop.time()) > 0:
            params = {"after": str(cursor), "wait": f"{min(POLL_WAIT, remaining):.3f}"}
            try:
                async with client.polls.get(url, params=params) as resp:
                    resp.raise_for_status()
                    data = await resp.json()
            except (TimeoutError, aiohttp.ClientError) as exc:
                tally.errors[f"poll {type(exc).__name__}"] += 1
                await asyncio.sleep(0.05)
                continue
            cursor = data["next"]
            # A notice (an automatic reset, a condensed history) may open the reply.
            seen = any(m["text"].split("\n\n")[-1] == expected for m in data["messages"])
        if not seen:
            tally.errors["no reply in time"] += 1
            continue
        now = loop.time()
        if sent_at >= tally.warm:
            tally.latencies.append(now - sent_at)
        if tally.warm <= now <= tally.end:
            tally.turns += 1


async def replies_of(client: Client, chat: str) -> list[str]:
    """Every reply of the chat, through `client`'s replica (paged, bounded)."""
    texts: list[str] = []
    cursor = 0
    for _ in range(FINAL_PAGES):
        params = {"after": str(cursor), "wait": "0"}
        async with client.polls.get(f"{client.base}/v1/chats/{chat}/messages", params=params) as r:
            r.raise_for_status()
            data = await r.json()
        if not data["messages"]:
            return texts
        texts += [m["text"] for m in data["messages"]]
        cursor = data["next"]
    raise RuntimeError(f"{chat}: more than {FINAL_PAGES} pages of replies")


def check_replies(accepted: set[str], texts: list[str]) -> tuple[int, int, int]:
    """(missing, duplicated, unexpected) of one chat's replies against its messages."""
    answered: Counter[str] = Counter()
    unexpected = 0
    for text in texts:
        text = text.split("\n\n")[-1]  # after a notice, if any
        if text.startswith(ECHO_PREFIX) and text[len(ECHO_PREFIX) :] in accepted:
            answered[text[len(ECHO_PREFIX) :]] += 1
        else:
            unexpected += 1
    missing = sum(1 for message_id in accepted if not answered[message_id])
    return missing, sum(count - 1 for count in answered.values()), unexpected


async def drive(
    daemons: list[Daemon], args: argparse.Namespace, cpu: CpuWindow, pg_dsn: str | None
) -> dict[str, Any]:
    token = secrets.token_hex(3)
    clients = [
        Client(d.url, None, args.chats + 8, args.chats, d.proc.pid if d.proc else None)
        for d in daemons
    ]
    loop = asyncio.get_running_loop()
    start = loop.time()
    tally = Tally(warm=start + args.warmup, end=start + args.warmup + args.seconds)
    chats = [f"b{token}-{i}" for i in range(args.chats)]
    try:
        tasks = [
            asyncio.create_task(chat_loop(clients[i % len(clients)], chat, tally))
            for i, chat in enumerate(chats)
        ]
        await asyncio.sleep(max(0.0, tally.warm - loop.time()))
        waits: asyncio.Future[Counter] | None = None
        stop = threading.Event()
        backends: list[int] = []
        if pg_dsn is not None:
            backends, background = await asyncio.to_thread(pg_server_pids, pg_dsn, cpu.daemon_pids)
            cpu.pg_pids = backends + background
            waits = asyncio.ensure_future(
                asyncio.to_thread(sample_waits, pg_dsn, backends, stop, args.seconds)
            )
        cpu.begin()
        await asyncio.sleep(max(0.0, tally.end - loop.time()))
        usage = cpu.end()
        stop.set()
        pg_waits = dict(await waits) if waits is not None else {}
        # Every chat ends with at most one reply outstanding, REPLY_TIMEOUT at most.
        await asyncio.wait_for(asyncio.gather(*tasks), REPLY_TIMEOUT + POLL_WAIT + 5)
        await asyncio.sleep(SETTLE_SECONDS)
        missing = duplicated = unexpected = 0
        for i, chat in enumerate(chats):
            other = clients[(i + 1) % len(clients)]  # another replica where there is one
            m, d, u = check_replies(tally.accepted.get(chat, set()), await replies_of(other, chat))
            missing, duplicated, unexpected = missing + m, duplicated + d, unexpected + u
    finally:
        for client in clients:
            await client.close()
    latencies = sorted(tally.latencies)
    return {
        "turns": tally.turns,
        "turns_per_s": tally.turns / args.seconds,
        "sent": tally.sent,
        "p50_ms": 1000 * percentile(latencies, 50, ordered=True),
        "p99_ms": 1000 * percentile(latencies, 99, ordered=True),
        "max_ms": 1000 * latencies[-1] if latencies else math.nan,
        "errors": sum(tally.errors.values()),
        "error_kinds": dict(tally.errors),
        "missing": missing,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "cpu_percent": usage,
        "pg_backends": len(backends),
        "pg_waits": pg_waits,
    }


# --- a run ------------------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The rows of an invocation: (backend, replicas) in the order they run."""
    if args.backend == "sqlite":
        return [("sqlite", 1)]
    baseline = [] if args.no_baseline else [("sqlite", 1)]
    return baseline + [("postgres", n) for n in args.replicas]


def run(args: argparse.Namespace, backend: str, replicas: int) -> dict[str, Any]:
    """Start the daemons, drive the loop, stop them (SIGTERM); the figures of the run."""
    root = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    result: dict[str, Any] = {"backend": backend, "replicas": replicas}
    try:
        with contextlib.ExitStack() as stack:
            dsn = stack.enter_context(pg_schema(args.dsn)) if backend == "postgres" else None
            settings = replica_settings(dsn, args.delay)
            daemons = [Daemon(root / f"replica{i}", settings) for i in range(replicas)]
            try:
                for daemon in daemons:  # one by one: the first runs the migrations
                    daemon.start(timeout=60)
                pids = [d.proc.pid for d in daemons if d.proc is not None]
                budget = args.warmup + args.seconds + REPLY_TIMEOUT + 3 * POLL_WAIT + 60
                result.update(
                    asyncio.run(
                        asyncio.wait_for(drive(daemons, args, CpuWindow(pids), dsn), budget)
                    )
                )
                result["exit_codes"] = [d.stop(timeout=60) for d in daemons]
            finally:
                for daemon in daemons:
                    daemon.ensure_stopped()
            problems: Counter[str] = Counter()
            samples: list[str] = []
            for daemon in daemons:
                counts, some = daemon.log_problems(limit=3)
                problems += counts
                samples += some
            result["log_problems"], result["log_samples"] = dict(problems), samples
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="postgres")
    parser.add_argument(
        "--replicas",
        type=_counts,
        default=[1],
        help="daemons on PostgreSQL: a count, or counts separated by commas (1,2,3) run in"
        " turn (sqlite: 1)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="postgres: skip the SQLite node run first for the ratios",
    )
    parser.add_argument("--chats", type=int, default=64, help="concurrent chats")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--delay", type=float, default=0.0, help="echo agent delay_seconds")
    parser.add_argument(
        "--dsn",
        default=os.environ.get("HERMES_TEST_PG_DSN") or DEFAULT_DSN,
        help="PostgreSQL server (a schema of the run's own is made and dropped)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if not all(1 <= n <= 16 for n in args.replicas) or (
        args.backend == "sqlite" and args.replicas != [1]
    ):
        parser.error("--replicas: 1..16 on postgres, 1 on sqlite (one node owns its home)")
    if not 1 <= args.chats <= 1000:
        parser.error("--chats must be 1..1000")
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        parser.error("--seconds must be in (0, 600], --warmup in [0, 60]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_line())
    print(
        f"closed loop: {args.chats} chats, {args.warmup:g} s warm-up, {args.seconds:g} s"
        f" measured; echo agent, delay {args.delay:g} s; CPU in % of one core"
    )
    print(HEADER, flush=True)
    results = []
    for backend, replicas in plan(args):
        result = run(args, backend, replicas)
        results.append(result)
        print(format_row(result), flush=True)
        for line in notes(result):
            print(f"  {line}", flush=True)
    for line in ratio_lines(results):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    return 1 if any(failures(result) for result in results) else 0


def _counts(text: str) -> list[int]:
    """`--replicas`: "3" or "1,2,3"."""
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("counts separated by commas, such as 1,2,3") from None
    if not counts:
        raise argparse.ArgumentTypeError("at least one count")
    return counts


if __name__ == "__main__":
    sys.exit(main())
