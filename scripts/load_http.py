"""Open-loop HTTP load against the gateway: accepted rate, reply latency, saturation.

    .venv/bin/python scripts/load_http.py --rate 200 --seconds 10 --chats 16
    .venv/bin/python scripts/load_http.py --saturate --max-rate 4000 --slo-ms 250
    .venv/bin/python scripts/load_http.py --url http://127.0.0.1:8642 --rate 50 --seconds 30

By default it starts its own daemon (`python -m gateway.cli run`, scripts/harness.py
Daemon) in a temp home with the echo agent (`--delay S` simulates a model's latency),
and stops it at the end; `--url` targets a running gateway instead (127.0.0.1 only; new
chat ids per run, so old replies never count). Only aiohttp is used, only on loopback.

Fixed rate (default): messages are sent on a schedule (open loop: message i goes out at
t0 + i/rate whatever the replies do), round robin over `--chats` chats, each with a unique
text and message_id. One long-poll reader per chat follows its cursor
(`GET /v1/chats/{chat}/messages?after=SEQ&wait=S`). Reply latency is the time from issuing
a message's POST to the reply that contains it becoming visible to its reader; replies to
plain messages sent while a turn runs are merged (one reply `echo: a\\nb\\nc` answers a, b
and c), so each line of a reply settles one message. After sending, it waits up to
`--drain` seconds for the rest; whatever is still unanswered is reported missing.
Printed: sent (and shed: not sent because `--max-inflight` POSTs were already open, so
the server answers POSTs too slowly or this client is starved of CPU), accepted msgs/s
(202 with status started/pending/queued), refused/other/errors, POST round trip, reply
latency p50/p90/p99/max, missing, duplicated, CPU of the daemon (and of its event-loop
thread) and of this client while sending, and the daemon's own counters from /metrics
(turns < messages when messages merged).

Saturation (`--saturate`): steps of the offered rate (250, 500, 1000, 2000, ... up to
`--max-rate`, or `--steps`), `--step-seconds` each, on fresh chats, draining between
steps. Per step: offered, sent/s, accepted/s, replies/s (message replies that became
visible during the step's send window / step seconds), p50/p99 reply latency (a message
still unanswered after the drain counts as infinitely late). The saturation point is the
highest step with replies/s >= 95% of offered and p99 < `--slo-ms`. It stops after two
failing steps in a row. Sent/s below offered means POSTs were shed (see above); the CPU
columns (daemon, its event-loop thread, that thread's wait for a CPU, this client) tell a
busy daemon from a starved one. Fresh chats mean short transcripts: the daemon loads a
session's whole history on every turn, so long sessions saturate lower (see soak.py).
With `--url`, pass `--pid` of the daemon to get its CPU figures.

Bounds: at most `--max-messages` in total, every wait has a deadline, and the whole run is
cut off after its planned duration plus a margin.

The client and the daemon share the machine; numbers move with whatever else runs.
This script pins nothing. To keep the client off the daemon's CPU, start the gateway
yourself on one CPU and point the client at it from another:

    taskset -c 0 .venv/bin/hermes-gateway run --home /tmp/h     # HTTP API on :8642
    taskset -c 1 .venv/bin/python scripts/load_http.py --url http://127.0.0.1:8642 --saturate

(`taskset` on this script alone pins its daemon too: a child inherits the CPU mask.)
Exit status: 0, or 1 when a reply went missing or came twice in fixed-rate mode, a reply
answered nothing we sent, or the daemon this script started did not exit cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import (
    Daemon,
    cpu_seconds,
    fmt_ms,
    parse_metrics,
    percentile,
)
from scripts.load_report import (
    print_fixed,
    print_metrics,
    print_table,
    report_daemon_log,
    step_ok,
)

ACCEPTED = frozenset({"started", "pending", "queued"})
ECHO_PREFIX = "echo: "
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
POST_TIMEOUT = 10.0
POLL_WAIT = 10.0  # long-poll wait; an abandoned poll lingers server-side at most this long

# Message states, one byte per message.
UNSENT, SENT, ACCEPTED_STATE, ANSWERED = 0, 1, 2, 3


# --- CPU -------------------------------------------------------------------------------------


def cpu_snapshot(pid: int | None) -> dict[str, float]:
    """Seconds of: wall, this client's CPU, the daemon's CPU, its main thread's CPU (the
    event loop; SQLite runs on a thread of its own) and that thread's wait for a CPU
    (runnable, not running: /proc schedstat). nan when the daemon is unknown or gone."""
    snap = {"wall": time.monotonic(), "client": time.process_time()}
    snap.update(daemon=math.nan, daemon_loop=math.nan, daemon_loop_runq=math.nan)
    if pid is None:
        return snap
    try:
        snap["daemon"] = cpu_seconds(f"/proc/{pid}/stat")
        snap["daemon_loop"] = cpu_seconds(f"/proc/{pid}/task/{pid}/stat")
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            snap["daemon_loop_runq"] = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        pass
    return snap


def cpu_percent(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """Each figure of `cpu_snapshot` as % of the wall time between the two (100 = a core)."""
    wall = max(end["wall"] - start["wall"], 1e-9)
    return {key: 100 * (end[key] - start[key]) / wall for key in start if key != "wall"}


# --- one load run ----------------------------------------------------------------------------


@dataclass
class Run:
    """Bookkeeping of one open-loop run: per-message state in flat arrays (bounded memory)."""

    prefix: str
    total: int
    chats: list[str]
    state: bytearray = field(init=False)
    sent_at: array = field(init=False)
    latencies: array = field(default_factory=lambda: array("d"))
    answer_times: array = field(default_factory=lambda: array("d"))
    post_rtts: array = field(default_factory=lambda: array("d"))
    schedule_lag: array = field(default_factory=lambda: array("d"))
    shed: int = 0
    accepted: int = 0
    refused: int = 0
    statuses: Counter = field(default_factory=Counter)  # other 202 statuses
    errors: Counter = field(default_factory=Counter)  # non-202 answers and exceptions
    poll_errors: Counter = field(default_factory=Counter)
    duplicated: int = 0
    unexpected: int = 0
    error_replies: int = 0
    reply_messages: int = 0
    outstanding: int = 0  # accepted, not answered yet
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set when that hits 0
    t0: float = 0.0
    send_end: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # % during the send window

    def __post_init__(self) -> None:
        self.state = bytearray(self.total)
        self.sent_at = array("d", bytes(8 * self.total))

    def text(self, n: int) -> str:
        return f"{self.prefix}-{n}"

    def on_reply(self, text: str, now: float) -> None:
        """Settle every message a reply answers (one per line of a merged echo)."""
        self.reply_messages += 1
        body = text.split("\n\n")[-1]  # an automatic-reset notice comes first, if any
        if not body.startswith(ECHO_PREFIX):
            self.error_replies += 1
            return
        for line in body[len(ECHO_PREFIX) :].split("\n"):
            head, _, number = line.rpartition("-")
            if head != self.prefix or not number.isdigit() or int(number) >= self.total:
                self.unexpected += 1
                continue
            n = int(number)
            if self.state[n] == ANSWERED:
                self.duplicated += 1
            elif self.state[n] == UNSENT:
                self.unexpected += 1
            else:
                if self.state[n] == ACCEPTED_STATE:
                    self.outstanding -= 1
                    if not self.outstanding:
                        self.settled.set()
                self.state[n] = ANSWERED
                self.latencies.append(now - self.sent_at[n])
                self.answer_times.append(now)

    def missing(self) -> int:
        """Accepted messages without a reply."""
        return self.state.count(ACCEPTED_STATE)

    def answered(self) -> int:
        return len(self.latencies)


class Client:
    """aiohttp sessions for one gateway: POSTs (bounded in flight) and long-polls."""

    def __init__(
        self, base: str, token: str | None, max_inflight: int, chats: int, pid: int | None
    ) -> None:
        self.base = base.rstrip("/")
        self.pid = pid  # the daemon's, for CPU figures (None: unknown)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.max_inflight = max_inflight
        self.posts = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max_inflight),
            timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT),
            headers=self.headers,
        )
        self.polls = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=chats + 8),
            timeout=aiohttp.ClientTimeout(total=POLL_WAIT + 15),
            headers=self.headers,
        )

    async def close(self) -> None:
        await self.posts.close()
        await self.polls.close()

    async def metrics(self) -> dict[str, float]:
        async with self.polls.get(f"{self.base}/metrics") as resp:
            resp.raise_for_status()
            return parse_metrics(await resp.text())

    async def post(self, run: Run, n: int, chat: str) -> None:
        text = run.text(n)
        body = json.dumps({"chat_id": chat, "user_id": "load", "text": text, "message_id": text})
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with self.posts.post(
                f"{self.base}/v1/messages",
                data=body.encode(),
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status != 202:
                    run.errors[f"http {resp.status}"] += 1
                    return
                status = (await resp.json())["status"]
        except TimeoutError:
            run.errors["timeout"] += 1
            return
        except aiohttp.ClientError as exc:
            run.errors[type(exc).__name__] += 1
            return
        run.post_rtts.append(loop.time() - started)
        if status in ACCEPTED:
            run.accepted += 1
            if run.state[n] == SENT:
                run.state[n] = ACCEPTED_STATE
                run.outstanding += 1
                run.settled.clear()
        elif status == "refused":
            run.refused += 1
        else:
            run.statuses[status] += 1

    async def follow(self, run: Run, chat: str) -> None:
        """One chat's long-poll reader, following its cursor until cancelled."""
        loop = asyncio.get_running_loop()
        cursor = 0
        url = f"{self.base}/v1/chats/{chat}/messages"
        while True:
            try:
                async with self.polls.get(
                    url, params={"after": str(cursor), "wait": str(POLL_WAIT)}
                ) as resp:
                    if resp.status != 200:
                        run.poll_errors[f"http {resp.status}"] += 1
                        await asyncio.sleep(0.1)
                        continue
                    data = await resp.json()
            except (TimeoutError, aiohttp.ClientError) as exc:
                run.poll_errors[type(exc).__name__] += 1
                await asyncio.sleep(0.1)
                continue
            now = loop.time()
            for message in data["messages"]:
                run.on_reply(message["text"], now)
            cursor = data["next"]


async def run_load(client: Client, *, rate: float, seconds: float, chats: int, drain: float) -> Run:
    """Offer `rate` msgs/s for `seconds` (open loop), then wait up to `drain` for replies."""
    token = os.urandom(3).hex()
    run = Run(
        prefix=f"L{token}",
        total=max(1, round(rate * seconds)),
        chats=[f"load-{token}-{i}" for i in range(chats)],
    )
    loop = asyncio.get_running_loop()
    readers = [asyncio.create_task(client.follow(run, chat)) for chat in run.chats]
    inflight: set[asyncio.Task[None]] = set()
    try:
        await asyncio.sleep(0.2)  # let the readers' first polls reach the server
        cpu_start = cpu_snapshot(client.pid)
        run.t0 = loop.time()
        for n in range(run.total):
            due = run.t0 + n / rate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif n % 32 == 0:
                await asyncio.sleep(0)  # behind schedule: still let the POSTs and readers run
            if len(inflight) >= client.max_inflight:
                run.shed += 1
                continue
            now = loop.time()
            run.schedule_lag.append(max(0.0, now - due))
            run.state[n] = SENT
            run.sent_at[n] = now
            task = asyncio.create_task(client.post(run, n, run.chats[n % chats]))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        run.send_end = max(loop.time(), run.t0 + seconds)
        if (wait := run.send_end - loop.time()) > 0:
            await asyncio.sleep(wait)
        run.cpu = cpu_percent(cpu_start, cpu_snapshot(client.pid))
        if inflight:
            await asyncio.wait(inflight, timeout=POST_TIMEOUT + 2)
        if run.outstanding:
            run.settled.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.settled.wait(), timeout=drain)
    finally:
        for task in (*readers, *inflight):
            task.cancel()
        await asyncio.gather(*readers, *inflight, return_exceptions=True)
    return run


# --- reports ---------------------------------------------------------------------------------


def summary(run: Run, rate: float, seconds: float) -> dict[str, Any]:
    sent = run.state.count(SENT) + run.state.count(ACCEPTED_STATE) + run.state.count(ANSWERED)
    window_end = run.t0 + seconds
    in_window = sum(1 for t in run.answer_times if t <= window_end)
    missing = run.missing()
    latencies = sorted(run.latencies)
    late = [*latencies, *[math.inf] * missing]  # for the saturation criterion
    return {
        "offered_rate": rate,
        "seconds": seconds,
        "chats": len(run.chats),
        "scheduled": run.total,
        "sent": sent,
        "sent_rate": sent / seconds,
        "shed": run.shed,
        "accepted": run.accepted,
        "accepted_rate": run.accepted / seconds,
        "refused": run.refused,
        "other_statuses": dict(run.statuses),
        "errors": dict(run.errors),
        "poll_errors": dict(run.poll_errors),
        "answered": run.answered(),
        "replies_rate": in_window / seconds,
        "reply_messages": run.reply_messages,
        "missing": missing,
        "duplicated": run.duplicated,
        "unexpected": run.unexpected,
        "error_replies": run.error_replies,
        "latency": {
            "p50": percentile(latencies, 50, ordered=True),
            "p90": percentile(latencies, 90, ordered=True),
            "p99": percentile(latencies, 99, ordered=True),
            "max": latencies[-1] if latencies else math.nan,
        },
        "p99_with_missing": percentile(late, 99, ordered=True),
        "p50_with_missing": percentile(late, 50, ordered=True),
        "post_rtt": {
            "p50": percentile(run.post_rtts, 50),
            "p99": percentile(run.post_rtts, 99),
        },
        "schedule_lag_p99": percentile(run.schedule_lag, 99),
        "cpu_percent": run.cpu,
    }


# --- driver ----------------------------------------------------------------------------------


def saturation_steps(args: argparse.Namespace) -> list[float]:
    if args.steps:
        return [float(s) for s in args.steps.split(",") if s.strip()]
    steps, rate = [], args.start_rate
    while rate <= args.max_rate:
        steps.append(rate)
        rate *= 2
    return steps


async def drive(args: argparse.Namespace, base: str, pid: int | None) -> dict[str, Any]:
    client = Client(base, args.token, args.max_inflight, args.chats, pid)
    report: dict[str, Any] = {"url": base}
    try:
        try:
            before = await client.metrics()
        except (aiohttp.ClientError, TimeoutError) as exc:
            print(f"warning: cannot read /metrics before the run: {exc}", file=sys.stderr)
            before = None
        if args.saturate:
            slo = args.slo_ms / 1000
            rows: list[dict[str, Any]] = []
            failures = 0
            for rate in saturation_steps(args):
                run = await run_load(
                    client, rate=rate, seconds=args.step_seconds, chats=args.chats, drain=args.drain
                )
                rows.append(summary(run, rate, args.step_seconds))
                ok = step_ok(rows[-1], slo)
                print(
                    f"  step {rate:g}/s: replies {rows[-1]['replies_rate']:.0f}/s, "
                    f"p99 {fmt_ms(rows[-1]['p99_with_missing'])} ms, "
                    f"{'ok' if ok else 'saturated'}",
                    flush=True,
                )
                failures = 0 if ok else failures + 1
                if failures >= 2:
                    break
                await asyncio.sleep(0.5)
            report["steps"] = rows
            passing = [r["offered_rate"] for r in rows if step_ok(r, slo)]
            report["saturation_rate"] = max(passing) if passing else None
        else:
            run = await run_load(
                client, rate=args.rate, seconds=args.seconds, chats=args.chats, drain=args.drain
            )
            report["fixed"] = summary(run, args.rate, args.seconds)
        try:
            after = await client.metrics()
        except (aiohttp.ClientError, TimeoutError) as exc:
            print(f"warning: cannot read /metrics after the run: {exc}", file=sys.stderr)
            after = None
        report["metrics_before"], report["metrics_after"] = before, after
    finally:
        await client.close()
    return report


def planned_seconds(args: argparse.Namespace) -> float:
    if args.saturate:
        return len(saturation_steps(args)) * (args.step_seconds + args.drain + POST_TIMEOUT + 1)
    return args.seconds + args.drain + POST_TIMEOUT + 1


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.url:
        parts = urlsplit(args.url)
        if parts.scheme != "http" or parts.hostname not in LOOPBACK:
            parser.error("--url must be http:// on 127.0.0.1, localhost or ::1")
    if not 0 < args.rate <= 20000 or (args.saturate and not 0 < args.max_rate <= 20000):
        parser.error("rates must be in (0, 20000] msgs/s")
    if not 0 < args.seconds <= 4 * 3600 or not 0 < args.step_seconds <= 600:
        parser.error("--seconds must be in (0, 14400], --step-seconds in (0, 600]")
    if not 1 <= args.chats <= 2000:
        parser.error("--chats must be 1..2000")
    if not 1 <= args.max_inflight <= 4096:
        parser.error("--max-inflight must be 1..4096")
    if not 0 <= args.drain <= 600:
        parser.error("--drain must be 0..600 seconds")
    planned = (
        sum(r * args.step_seconds for r in saturation_steps(args))
        if args.saturate
        else args.rate * args.seconds
    )
    if planned > args.max_messages:
        parser.error(
            f"this run would send {planned:.0f} messages; --max-messages is {args.max_messages}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running gateway (default: start one in a temp home)")
    parser.add_argument("--token", help="bearer token of --url, if it has one")
    parser.add_argument("--pid", type=int, help="pid of the --url daemon, for its CPU figures")
    parser.add_argument("--rate", type=float, default=100, help="offered msgs/s (fixed mode)")
    parser.add_argument("--seconds", type=float, default=10, help="send duration (fixed mode)")
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--drain", type=float, default=10, help="max wait for late replies (s)")
    parser.add_argument("--max-inflight", type=int, default=512, help="open POSTs at most")
    parser.add_argument("--max-messages", type=int, default=1_000_000)
    parser.add_argument("--saturate", action="store_true", help="step the rate up")
    parser.add_argument("--start-rate", type=float, default=250)
    parser.add_argument("--max-rate", type=float, default=4000)
    parser.add_argument("--steps", help="explicit comma-separated rates instead of doubling")
    parser.add_argument("--step-seconds", type=float, default=3)
    parser.add_argument("--slo-ms", type=float, default=250, help="p99 reply latency bound")
    parser.add_argument("--delay", type=float, default=0.0, help="echo agent delay (s)")
    parser.add_argument("--max-turns", type=int, default=16, help="agent.max_concurrent_turns")
    parser.add_argument("--home", help="own daemon: keep its home here, not in a temp dir")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    budget = planned_seconds(args) + 60

    async def bounded(base: str, pid: int | None) -> dict[str, Any]:
        async with asyncio.timeout(budget):
            return await drive(args, base, pid)

    daemon: Daemon | None = None
    exit_code: int | None = None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="load-http-") as tmp:
        try:
            if args.url:
                base, pid = args.url.rstrip("/"), args.pid
            else:
                settings = (
                    f"agent:\n  backend: echo\n  delay_seconds: {args.delay}\n"
                    f"  max_concurrent_turns: {args.max_turns}\n  restart_drain_timeout: 10\n"
                )
                daemon = Daemon(Path(args.home or tmp) / "home", settings)
                daemon.start()
                base, pid = daemon.url, daemon.proc.pid if daemon.proc else None
                print(
                    f"daemon pid {pid} at {base} (echo agent, delay {args.delay:g} s)", flush=True
                )
            report = asyncio.run(bounded(base, pid))
            if daemon is not None:
                exit_code = daemon.stop(timeout=40)
        finally:
            if daemon is not None:
                daemon.ensure_stopped()
        if daemon is not None:
            report["daemon_exit"] = exit_code
            counts, samples = daemon.log_problems()
            report["daemon_log"], report["daemon_log_samples"] = dict(counts), samples

    bad = False
    if args.saturate:
        print(
            f"saturation steps ({args.step_seconds:g} s each, {args.chats} chats, "
            f"SLO p99 < {args.slo_ms:g} ms, replies/s >= 95% of offered):"
        )
        print_table(report["steps"], args.slo_ms / 1000)
        point = report["saturation_rate"]
        print(f"saturation point: {f'{point:g} msgs/s' if point else 'none (no step passed)'}")
        bad = any(r["duplicated"] or r["unexpected"] for r in report["steps"])
    else:
        result = report["fixed"]
        print_fixed(result)
        bad = bool(result["missing"] or result["duplicated"] or result["unexpected"])
    print_metrics(report["metrics_before"], report["metrics_after"])
    if daemon is not None:
        report_daemon_log(report["daemon_log"], report["daemon_log_samples"])
        print(f"daemon exit code: {exit_code}")
        bad = bad or exit_code != 0
    print(f"elapsed {time.monotonic() - started:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=_json_default))
    return 1 if bad else 0


def _json_default(value: Any) -> Any:
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
