"""A replica's pulse: every lease it holds renewed together, and whether it may act.

Every `interval` seconds one UPDATE extends every live lease of `owner` (turns, the
schedule claims, ...) by `ttl` seconds, on a connection of its own. The replica is
`healthy` while its last successful renewal was sent less than `ttl - margin` seconds
ago: its leases are then certainly still its own. When that stops being true it calls
`on_unhealthy()` once (the replica answers 503 and cancels its turns, before any other
replica may take them over) and `on_healthy()` once the database answers again. Leases
that ran out meanwhile are no longer renewed: other replicas may have taken them.

It starts healthy (the replica has just opened its store, and holds no lease yet) and
turns unhealthy `ttl - margin` seconds later if no renewal ever succeeds.
"""

from __future__ import annotations

import asyncio
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

log = structlog.get_logger("gateway.cluster.heartbeat")


class Heartbeat:
    """Renews every lease of `owner` every `interval` seconds (default ttl/3)."""

    def __init__(
        self,
        dsn: str,
        owner: str,
        *,
        ttl: float,
        interval: float | None = None,
        margin: float | None = None,
        on_unhealthy: Callback = nothing,
        on_healthy: Callback = nothing,
    ) -> None:
        self.dsn = dsn
        self.owner = owner
        self.ttl = ttl
        self.interval = ttl / 3 if interval is None else interval
        self.margin = ttl * 0.2 if margin is None else margin
        if self.interval >= ttl - self.margin:
            raise ValueError(
                f"Heartbeat: interval {self.interval}s must be shorter than "
                f"ttl - margin ({ttl} - {self.margin}s), or every lease lapses between beats"
            )
        self.on_unhealthy = on_unhealthy
        self.on_healthy = on_healthy
        self.healthy = True
        self.renewed = 0  # leases extended by the last successful beat
        self.beats = 0
        self.failures = 0
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._callbacks = SerialCallbacks("heartbeat")

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._arm(loop.time() + self.ttl - self.margin)
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        await self._callbacks.wait()
        await close_quietly(self._conn)
        self._conn = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial=min(0.1, self.interval), maximum=self.interval, jitter=0.2)
        while True:
            try:
                if self._conn is None:
                    self._conn = await connect(self.dsn, self.interval, f"heartbeat {self.owner}")
                sent = loop.time()
                renewing = leases.arenew(self._conn, self.owner, self.ttl)
                count = await bounded(self._conn, renewing, self.interval)
            except CONNECTION_ERRORS as exc:
                self.failures += 1
                log.warning("heartbeat_failed", owner=self.owner, error=describe(exc))
                await close_quietly(self._conn)
                self._conn = None
                await asyncio.sleep(backoff.delay())
                continue
            backoff.reset()
            self.beats += 1
            self.renewed = count
            act_until = sent + self.ttl - self.margin
            if act_until > loop.time():  # else the timer has fired or is about to
                self._arm(act_until)
                if not self.healthy:
                    self.healthy = True
                    log.info("heartbeat_healthy", owner=self.owner)
                    self._callbacks.schedule(self.on_healthy)
            await asyncio.sleep(self.interval)

    def _arm(self, act_until: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = asyncio.get_running_loop().call_at(act_until, self._turn_unhealthy)

    def _turn_unhealthy(self) -> None:
        self._expiry = None
        if self.healthy:
            self.healthy = False
            log.warning("heartbeat_unhealthy", owner=self.owner, ttl=self.ttl)
            self._callbacks.schedule(self.on_unhealthy)
