"""A real GatewayRunner driven inside this process, for scripts/bench_gateway.py.

`InProcessAdapter` is a platform without a network: its `send` notes when a reply's
last chunk arrived. `Driver` sends bench messages through the runner and times each
reply, in a closed loop (C chats, each sending when its previous reply arrived) or an
open one (a fixed offered rate). `TurnSplit` (`--split`) times the store's transactions
and SQLite's statements per turn. Keys are picked so that no two messages in flight
share a session: each message gets its own turn and its own reply.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base import AcceptStatus, MessageEvent, PlatformAdapter, SendResult
from config import GatewayConfig
from gateway.run import GatewayRunner
from gateway.session import Platform, SessionSource
from scripts.harness import percentile

USER_TEXT = "hello there, how are you today?"
REPLY_TIMEOUT_SECONDS = 30.0


def source_for(i: int) -> SessionSource:
    return SessionSource(
        platform=Platform.LOCAL,
        chat_id=f"bench-{i}",
        chat_type="dm",
        user_id=f"user-{i}",
        user_name="bench",
    )


#: `--budgets`: every limit set, none ever reached by a benchmark's turns
BENCH_BUDGETS = {
    "default": {
        "tokens_per_day": 10**12,
        "tokens_per_month": 10**12,
        "cost_per_day": 1e6,
        "cost_per_month": 1e6,
        "turns_per_minute": 10_000,
    }
}


def gateway_config(
    strategy: str = "summary", index_transcripts: bool | None = None, budgets: bool = False
) -> GatewayConfig:
    """Production defaults, the zero-config echo agent without delay, and the context
    strategy asked for (`agent.context.strategy`, by default the default: summary);
    `index_transcripts` True or False turns long-term memory's transcript indexing on or
    off (None: the default, on); `budgets` sets every budget limit (`BENCH_BUDGETS`)."""
    memory = {} if index_transcripts is None else {"index_transcripts": index_transcripts}
    return GatewayConfig.model_validate(
        {
            "agent": {"backend": "echo", "delay_seconds": 0, "context": {"strategy": strategy}},
            "memory": memory,
            "budgets": BENCH_BUDGETS if budgets else {},
        }
    )


def latency_stats(latencies: list[float]) -> dict[str, float]:
    """p50, p99 and max in milliseconds (nearest rank; all 0 without any reply)."""
    values = sorted(latencies) or [0.0]
    return {
        "p50_ms": percentile(values, 50, ordered=True) * 1000,
        "p99_ms": percentile(values, 99, ordered=True) * 1000,
        "max_ms": values[-1] * 1000,
    }


def pick_key(rng: random.Random, n: int, busy: set[int]) -> int:
    """A random session index with no message in flight, marked busy at once (so a
    message not yet sent cannot share its key); bounded: n > len(busy)."""
    for _ in range(64):
        i = rng.randrange(n)
        if i not in busy:
            break
    else:
        i = next(i for i in range(n) if i not in busy)
    busy.add(i)
    return i


class TimedConnection:
    """The store's writer connection with the time of every SQL statement counted, by
    statement: what SQLite itself costs a turn (`--split`). The rest goes to the real one."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.by_statement: dict[str, list[float]] = {}  # SQL -> [seconds, count]

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        started = time.perf_counter()
        try:
            return self._conn.execute(sql, *args)
        finally:
            spent = self.by_statement.setdefault(sql, [0.0, 0])
            spent[0] += time.perf_counter() - started
            spent[1] += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class TurnSplit:
    """Where a closed-loop turn's time goes (`--split`, a diagnosis: it slows turns a
    little): the store's group-commit transactions and the SQLite statements inside
    them, as wall time on the event loop's thread (which is busy nearly all the time, so
    it compares with the process CPU per turn). Reaches into the store's private writer
    on purpose, so that production code carries no timing hooks."""

    def __init__(self, runner: Any) -> None:
        database = runner.store._db
        self.conn = TimedConnection(database._writer)
        database._writer = self.conn
        commit = database._commit_pending
        self.batch_seconds = 0.0
        self.batches = 0

        def timed_commit() -> None:
            started = time.perf_counter()
            try:
                commit()
            finally:
                self.batch_seconds += time.perf_counter() - started
                self.batches += 1

        database._commit_pending = timed_commit  # looked up per call by write_soon

    def reset(self) -> None:
        self.batch_seconds = 0.0
        self.batches = 0
        self.conn.by_statement.clear()

    def per_turn(self, turns: int) -> dict[str, Any]:
        turns = max(turns, 1)
        spent = self.conn.by_statement.values()
        by_statement = sorted(
            (
                {
                    "sql": " ".join(sql.split())[:70],
                    "us": seconds / turns * 1e6,
                    "per_turn": n / turns,
                }
                for sql, (seconds, n) in self.conn.by_statement.items()
            ),
            key=lambda row: -row["us"],
        )
        return {
            "store_us": self.batch_seconds / turns * 1e6,
            "sql_us": sum(seconds for seconds, _ in spent) / turns * 1e6,
            "statements": sum(n for _, n in spent) / turns,
            "turns_per_batch": turns / max(self.batches, 1),
            "by_statement": by_statement,
        }


@dataclass
class Waiter:
    future: asyncio.Future[float]
    chunks_left: int


class InProcessAdapter(PlatformAdapter):
    """A platform inside the process: `send` records when a reply's last chunk arrived."""

    platform = Platform.LOCAL

    def __init__(self) -> None:
        super().__init__(None)  # no access settings: every message is authorized
        self.waiting: dict[str, Waiter] = {}
        self._chunks: dict[str, int] = {}
        self.unexpected = 0

    async def start(self) -> None:
        self.set_state("running")

    async def stop(self) -> None:
        self.set_state("stopped")

    def expect(self, message_id: str, text: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        chunks = self._chunks.get(text)
        if chunks is None:  # the driver's own CPU counts in cpu_us: split each text once
            chunks = self._chunks[text] = len(self.split(f"echo: {text}"))
        self.waiting[message_id] = Waiter(future, chunks)
        return future

    def forget(self, message_id: str) -> None:
        self.waiting.pop(message_id, None)

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        now = time.perf_counter()
        waiter = self.waiting.get(reply_to) if reply_to is not None else None
        if waiter is None:
            self.unexpected += 1
        else:
            waiter.chunks_left -= 1
            if waiter.chunks_left <= 0:
                del self.waiting[reply_to]  # type: ignore[arg-type]
                if not waiter.future.done():
                    waiter.future.set_result(now)
        return SendResult(message_id=f"local-{delivery_id}")


class Driver:
    """Sends bench messages through a runner and times their replies."""

    def __init__(self, runner: Any, adapter: InProcessAdapter, n: int) -> None:
        self.runner = runner
        self.adapter = adapter
        self.n = n
        self.busy: set[int] = set()
        self.freed = asyncio.Event()
        self.seq = 0
        self.run = f"{os.getpid()}.{time.time_ns()}"  # message ids never repeat on a home
        self.errors: list[str] = []

    async def one(self, phase: str, i: int) -> float | None:
        """Send one message to session i (picked by `pick_key`, so marked busy until this
        returns); its latency in seconds, None on failure."""
        self.seq += 1
        message_id = f"{self.run}-{phase}-{self.seq}"
        event = MessageEvent(source=source_for(i), text=USER_TEXT, message_id=message_id)
        future = self.adapter.expect(message_id, USER_TEXT)
        try:
            started = time.perf_counter()
            accepted = await self.runner.handle_message(event)
            # PENDING: the key's previous turn is still marking its reply sent; this
            # message then gets the next turn of its own (nothing else waits on the key).
            if accepted.status not in (AcceptStatus.STARTED, AcceptStatus.PENDING):
                self.errors.append(f"{message_id}: {accepted.status} {accepted.detail or ''}")
                return None
            # A timer that cancels the wait, not `asyncio.wait_for` (a task and a timeout
            # per message): the driver's own CPU counts in `cpu_us`, so it stays lean.
            timer = asyncio.get_running_loop().call_later(REPLY_TIMEOUT_SECONDS, future.cancel)
            try:
                replied = await future
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the driver itself was cancelled, not the wait timed out
                self.errors.append(f"{message_id}: no reply in {REPLY_TIMEOUT_SECONDS:g}s")
                return None
            finally:
                timer.cancel()
            return replied - started
        finally:
            self.busy.discard(i)
            self.freed.set()
            self.adapter.forget(message_id)

    async def closed_loop(
        self,
        phase: str,
        count: int,
        concurrency: int,
        seed: int,
        max_seconds: float,
        settle: Callable[[], Awaitable[object]] | None = None,
    ) -> dict[str, Any]:
        """`count` messages, `concurrency` chats at a time. With `settle` (the background
        indexers' catch-up), the CPU counted is exactly the window's own: what earlier
        turns left unindexed is indexed before it starts, and its own turns' indexing
        is waited for and counted before it ends (not in its turns/s)."""
        rng = random.Random(seed)
        latencies: list[float] = []
        issued = 0
        deadline = time.perf_counter() + max_seconds

        async def chat() -> None:
            nonlocal issued
            while issued < count and time.perf_counter() < deadline:
                issued += 1
                latency = await self.one(phase, pick_key(rng, self.n, self.busy))
                if latency is not None:
                    latencies.append(latency)

        if settle is not None:
            await settle()
        started, cpu_started = time.perf_counter(), time.process_time()
        await asyncio.gather(*(chat() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        if settle is not None:
            await settle()
        cpu = time.process_time() - cpu_started
        return {
            "messages": issued,
            "replies": len(latencies),
            "seconds": elapsed,
            "turns_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
            # CPU of all threads (event loop, SQLite, mirror) per turn: steadier than
            # turns/s on a busy machine; 1e6 / cpu_us is the one-CPU ceiling.
            "cpu_us_per_turn": cpu / len(latencies) * 1e6 if latencies else 0.0,
            "timed_out": issued < count,
            **latency_stats(latencies),
        }

    async def open_loop(
        self, phase: str, count: int, rate: float, seed: int, max_seconds: float
    ) -> dict[str, Any]:
        """Offer `count` messages at `rate`/s regardless of replies (late ones catch up)."""
        rng = random.Random(seed)
        latencies: list[float] = []
        tasks: set[asyncio.Task[None]] = set()
        max_lag = 0.0
        saturated = 0

        async def send(i: int) -> None:
            latency = await self.one(phase, i)
            if latency is not None:
                latencies.append(latency)

        started = time.perf_counter()
        deadline = started + max_seconds
        issued = 0
        for k in range(count):
            due = started + k / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Saturated (half the keys wait for a reply): hold back until one is free,
            # so the keys stay distinct; the delay shows as schedule lag.
            while len(self.busy) >= self.n // 2 and time.perf_counter() < deadline:
                saturated += 1
                self.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.freed.wait(), 1.0)
            now = time.perf_counter()
            if now > deadline:
                break
            max_lag = max(max_lag, now - due)
            task = asyncio.create_task(send(pick_key(rng, self.n, self.busy)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            issued += 1
        await asyncio.gather(*list(tasks))
        elapsed = time.perf_counter() - started
        return {
            "messages": issued,
            "replies": len(latencies),
            "seconds": elapsed,
            "offered_per_s": rate,
            "achieved_per_s": len(latencies) / elapsed if elapsed > 0 else 0.0,
            "max_schedule_lag_ms": max_lag * 1000,
            "saturated_waits": saturated,
            "timed_out": issued < count,
            **latency_stats(latencies),
        }


async def indexed(runner: GatewayRunner) -> None:
    """Everything logged so far in search.db and the memory index."""
    await runner.store.search_index.catch_up()
    await runner.recall.indexer.catch_up()


async def run_gateway(home: Path, args: argparse.Namespace) -> dict[str, Any]:
    adapter = InProcessAdapter()
    config = gateway_config(
        getattr(args, "strategy", "summary"),
        {"on": True, "off": False}.get(getattr(args, "worker_index", None) or ""),
        budgets=getattr(args, "budgets", False),
    )
    runner = GatewayRunner(config, [adapter], agent_factory=None, home=home)
    driver = Driver(runner, adapter, args.worker_sessions)
    result: dict[str, Any] = {}
    try:
        await runner.start()
        split = TurnSplit(runner) if args.split else None
        if args.warmup:
            await driver.closed_loop(
                "warmup", args.warmup, args.concurrency, args.seed, args.max_seconds
            )
        if split is not None:
            split.reset()
        # The indexing A/B (`worker_index`) counts each window's indexing exactly: a loop
        # of a few seconds against indexers that run every 0.25 and 1 s otherwise counts
        # a varying share of its own and of the warm-up's.
        settle = (lambda: indexed(runner)) if getattr(args, "worker_index", None) else None
        result["closed"] = await driver.closed_loop(
            "closed", args.messages, args.concurrency, args.seed + 1, args.max_seconds, settle
        )
        if split is not None:
            result["closed"]["split"] = split.per_turn(result["closed"]["replies"])
        result["open"] = await driver.open_loop(
            "open", args.open_messages, args.rate, args.seed + 2, args.max_seconds
        )
    finally:
        await runner.stop()
    result["errors"] = driver.errors[:20]
    result["error_count"] = len(driver.errors)
    result["unexpected_sends"] = adapter.unexpected
    result["rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result
