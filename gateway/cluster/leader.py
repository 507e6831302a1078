"""One replica at a time does a job: the holder of a named leader lease.

`LeaderRole("leader:telegram", ...)` keeps trying to take the lease and, once it has it,
renews it every ttl/3 on a connection of its own. It stops acting as leader on its own
clock, `ttl - margin` seconds after it sent its last successful renewal: that renewal
set the lease to expire `ttl` seconds after the database ran it, which is later, so the
replica steps down before any other replica can take over, even while it cannot reach
the database. A standby sleeps until the holder's lease runs out (at most ttl/3,
jittered), so a dead holder's job moves within `ttl` seconds (`cluster.failover_seconds`).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import psycopg
import structlog

from gateway.cluster import leases
from gateway.cluster._support import (
    CONNECTION_ERRORS,
    Callback,
    SerialCallbacks,
    bounded,
    close_quietly,
    connect,
    describe,
    nothing,
)
from gateway.util.backoff import Backoff

log = structlog.get_logger("gateway.cluster.leader")


class LeaderRole:
    """Holds (or waits for) the lease `name` as `owner`.

    `on_gain` runs when this replica becomes the leader and `on_lose` when it stops
    being it (lease lost, database unreachable for too long, or `stop()`); they run one
    at a time, in order. `is_leader` turns False before `on_lose` runs, the moment the
    replica must stop acting. `holder` is the last live holder seen (None: nobody).
    """

    def __init__(
        self,
        dsn: str,
        name: str,
        owner: str,
        *,
        on_gain: Callback = nothing,
        on_lose: Callback = nothing,
        ttl: float = 15.0,
        margin: float | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"LeaderRole {name!r}: ttl must be > 0 seconds, got {ttl}")
        self.dsn = dsn
        self.name = name
        self.owner = owner
        self.ttl = ttl
        # Room for the step-down to take effect and for clocks that tick at slightly
        # different rates; renewals every ttl/3 leave two chances before it runs out.
        self.margin = ttl * 0.2 if margin is None else margin
        self.period = ttl / 3
        self.on_gain = on_gain
        self.on_lose = on_lose
        self.is_leader = False
        self.holder: str | None = None
        self.gains = 0
        self.losses = 0
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._callbacks = SerialCallbacks(f"leader {name}")
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leader {self.name}")

    async def stop(self) -> None:
        """Stop acting as leader, then release the lease so a standby takes it at once."""
        self._stopping = True  # from here on, a renewal in flight gains nothing
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._step_down("stopped")
        await self._callbacks.wait()
        try:  # on failure the lease runs out by itself in `ttl` seconds
            if self._conn is None or self._conn.closed:
                self._conn = await connect(self.dsn, self.period, f"{self.name} {self.owner}")
            releasing = leases.arelease(self._conn, self.name, self.owner)
            await bounded(self._conn, releasing, self.period)
        except CONNECTION_ERRORS as exc:
            log.warning("leader_release_failed", lease=self.name, error=describe(exc))
        await close_quietly(self._conn)
        self._conn = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=min(0.1, self.period), maximum=self.period, jitter=0.2)
        while True:
            try:
                if self._conn is None:
                    self._conn = await connect(self.dsn, self.period, f"{self.name} {self.owner}")
                sent = loop.time()
                acquiring = leases.atry_acquire(self._conn, self.name, self.owner, self.ttl)
                won = await bounded(self._conn, acquiring, self.period)
                live = None
                if not won:
                    looking = leases.aholder(self._conn, self.name)
                    live = await bounded(self._conn, looking, self.period)
            except CONNECTION_ERRORS as exc:
                log.warning("leader_db_unreachable", lease=self.name, error=describe(exc))
                await close_quietly(self._conn)
                self._conn = None
                await asyncio.sleep(backoff.delay())
                continue
            backoff.reset()
            if won:
                self.holder = self.owner
                self._renewed(sent + self.ttl - self.margin)
                delay = self.period
            else:
                self._step_down("taken")
                self.holder = None if live is None else live[0]
                # Wake just after the holder's lease runs out, not up to ttl/3 later.
                left = 0.0 if live is None else live[1]
                delay = min(
                    self.period * random.uniform(0.8, 1.2), left + random.uniform(0.01, 0.05)
                )
            await asyncio.sleep(delay)

    def _renewed(self, act_until: float) -> None:
        loop = asyncio.get_running_loop()
        if act_until <= loop.time():
            self._step_down("renewal_too_slow")
            return
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = loop.call_at(act_until, self._step_down, "lease_expiring")
        if not self.is_leader and not self._stopping:
            self.is_leader = True
            self.gains += 1
            log.info("leader_gained", lease=self.name, owner=self.owner)
            self._callbacks.schedule(self.on_gain)

    def _step_down(self, reason: str) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if not self.is_leader:
            return
        self.is_leader = False
        self.losses += 1
        if self.holder == self.owner:
            self.holder = None
        # A clean stop hands the role over on purpose: not worth a warning.
        report = log.info if reason == "stopped" else log.warning
        report("leader_lost", lease=self.name, owner=self.owner, reason=reason)
        self._callbacks.schedule(self.on_lose)
