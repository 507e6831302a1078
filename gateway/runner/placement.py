"""Where a session runs: in this process alone (`LocalPlacement`, SQLite), or in one of
several replicas sharing a PostgreSQL store (`ReplicaPlacement`, `gateway.runner.replica`:
a session runs where its lease is). The runner and the turn engine call one interface;
every difference between the two lives here.

                    local                                 replica
    start           recovery, adapters, held messages     adapters here (single-connection
                    re-dispatched, scheduler, housekeeper ones, scheduler and housekeeper
                                                          on the leader), the sweeper
    intake          accept (and begin) here               here under the session's lease,
                                                          else journaled for its holder
    lane hooks      nothing                               inbox ids taken; lease given back
    pending replies the housekeeper sends them            the leader sends them
    health          every adapter serves                  single-connection ones stand by
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog

from adapters.base import PlatformAdapter
from gateway.domain.command_syntax import Command, MessageKind
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.ops.metrics import Metrics
from gateway.runner.engine import TurnEngine, in_lane
from gateway.runner.housekeeping import Housekeeper
from gateway.runner.ports import ReplicaHost
from gateway.runner.recovery import Recovery
from gateway.schedules.loop import Scheduler
from gateway.store.turnlog import TurnLog

log = structlog.get_logger("gateway.run")

Held = tuple[str, MessageEvent, MessageKind, Command | None]


class Placement(Protocol):
    """What differs between one process and one replica of several."""

    async def start(
        self, adapters: list[PlatformAdapter], open_intake: Callable[[], None]
    ) -> dict[str, Any]:
        """Start the adapters and the background parts, calling `open_intake` once
        messages may be taken; returns facts for the start's log line."""
        ...

    async def intake(
        self, key: str, event: MessageEvent, kind: MessageKind, command: Command | None
    ) -> Accepted:
        """A valid, authorized message: accepted, and run, queued or handed on."""
        ...

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool:
        """A scheduled run's turn, claimed and begun in one transaction; False: not now."""
        ...

    def took(self, key: str, inbox_ids: Iterable[int]) -> None: ...

    def lane_ended(self, key: str) -> None: ...

    def send_pending_soon(self) -> None:
        """Another process recorded a reply: send it soon."""
        ...

    @property
    def healthy(self) -> bool: ...

    def standing_by(self, adapter: PlatformAdapter) -> bool:
        """Is this adapter idle here on purpose (another replica runs it)?"""
        ...

    def status(self) -> dict[str, Any] | None:
        """The replica's part of the health report (None: one process alone)."""
        ...

    async def cluster(self) -> list[dict[str, Any]] | None:
        """Every replica holding a lease, with its sessions and leader roles (None: one
        process alone)."""
        ...

    async def stop_leading(self) -> None:
        """First step of a shutdown."""
        ...

    async def stop(self) -> None:
        """Last step of a shutdown, before the store closes."""
        ...


class LocalPlacement:
    """One process holds every session. Messages that arrive while start-up recovery
    re-queues old work are accepted (durably) and held, then run after it, so nothing
    jumps ahead of an interrupted turn."""

    healthy = True

    def __init__(
        self,
        engine: TurnEngine,
        turnlog: TurnLog,
        recovery: Recovery,
        scheduler: Scheduler,
        housekeeper: Housekeeper,
    ) -> None:
        self.engine = engine
        self.turnlog = turnlog
        self.recovery = recovery
        self.scheduler = scheduler
        self.housekeeper = housekeeper
        self._held: list[Held] | None = None

    async def start(
        self, adapters: list[PlatformAdapter], open_intake: Callable[[], None]
    ) -> dict[str, Any]:
        await self.recovery.prepare()
        self._held = []
        open_intake()
        for adapter in adapters:
            await adapter.start()
        # Only now, with every adapter up, does recovery write anything: a start that
        # failed above (a port taken) leaves the sessions and markers for the next one.
        await self.recovery.mark()
        await self.recovery.resume()
        held, self._held = self._held, None
        for key, event, kind, command in held:
            await self.engine.dispatch(key, event, kind, command)
        await self.scheduler.start()  # after recovery: a resumed run is not interrupted
        self.housekeeper.start()
        return {"clean_start": self.recovery.was_clean}

    async def intake(
        self, key: str, event: MessageEvent, kind: MessageKind, command: Command | None
    ) -> Accepted:
        engine = self.engine
        if kind is not MessageKind.COMMAND and self._held is None and not engine.is_busy(key):
            return await engine.accept_and_start(key, event, kind)
        # A lane command is answered by its own transaction (the engine's lane), so it
        # stays open in the inbox until then: a crash before it re-runs it at next start.
        inline = kind is MessageKind.COMMAND and not in_lane(command)
        inbox_id = await self.turnlog.accept(event, key, kind, done=inline)
        if inbox_id is None:
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        event = event.with_inbox_ids((inbox_id,))
        if self._held is not None:
            self._held.append((key, event, kind, command))
            return Accepted(AcceptStatus.PENDING, session_key=key, detail="gateway is starting")
        return await engine.dispatch(key, event, kind, command)

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool:
        if self.engine.is_busy(key):
            return False
        accepted = await self.engine.accept_and_start(key, event, MessageKind.TURN, text, claim)
        return accepted.status == AcceptStatus.STARTED

    def took(self, key: str, inbox_ids: Iterable[int]) -> None:
        pass

    def lane_ended(self, key: str) -> None:
        pass

    def send_pending_soon(self) -> None:
        self.housekeeper.send_pending_soon()

    def standing_by(self, adapter: PlatformAdapter) -> bool:
        return False

    def status(self) -> dict[str, Any] | None:
        return None

    async def cluster(self) -> list[dict[str, Any]] | None:
        return None

    async def stop_leading(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class ReplicaPlacement:
    """One replica of several (`gateway.runner.replica`): no start-up recovery (the
    sweeper resumes, key by key, what no live replica holds); the single-connection
    platforms, the scheduler and housekeeping only on the leader."""

    def __init__(
        self,
        host: ReplicaHost,
        engine: TurnEngine,
        turnlog: TurnLog,
        metrics: Metrics,
        scheduler: Scheduler,
        housekeeper: Housekeeper,
    ) -> None:
        # Imported here: a gateway on SQLite never loads psycopg.
        from gateway.runner.replica import Replica

        self.replica = Replica(host)
        self.engine = engine
        self.turnlog = turnlog
        self.metrics = metrics
        self.scheduler = scheduler
        self.housekeeper = housekeeper

    @property
    def healthy(self) -> bool:
        return self.replica.healthy

    async def start(
        self, adapters: list[PlatformAdapter], open_intake: Callable[[], None]
    ) -> dict[str, Any]:
        replica = self.replica
        open_intake()
        single: list[PlatformAdapter] = []
        for adapter in adapters:
            if adapter.single_connection:
                single.append(adapter)  # started by the leader role
            else:
                await adapter.start()
            adapter.publish_replies(replica.publish_reply)

        async def gain() -> None:
            for adapter in single:
                await adapter.start()
            await self.scheduler.start()
            self.housekeeper.start()
            replica.send_pending_later()  # what the last leader (or the CLI) left

        async def lose() -> None:
            await self.scheduler.stop()
            await self.housekeeper.stop()
            for adapter in single:
                try:
                    await adapter.stop()
                except Exception:
                    log.exception("adapter_stop_failed", platform=adapter.platform.value)

        replica.lead(replica.LEADER, gain, lose, platforms={a.platform.value for a in single})
        await replica.start()
        return {"replica": replica.owner}

    async def intake(
        self, key: str, event: MessageEvent, kind: MessageKind, command: Command | None
    ) -> Accepted:
        """Run the message here when this replica holds (or takes) its session's lease,
        else journal it for the holder."""
        replica, engine = self.replica, self.engine
        if not replica.healthy:
            self.metrics.messages_unavailable_total += 1
            return Accepted(AcceptStatus.UNAVAILABLE, detail="the database is unreachable")
        async with replica.key_lock(key):
            if not engine.is_busy(key):
                if kind is not MessageKind.COMMAND:
                    # The lease is taken in the transaction that accepts and begins the
                    # turn: one transaction for a message to an idle session, as on SQLite.
                    lease = replica.lease_claim(key)
                    with contextlib.suppress(*replica.LEASE_BUSY):
                        accepted = await engine.accept_and_start(
                            key, event, kind, claim=lease, claim_fences=True
                        )
                    if lease.won:
                        return accepted
                    # Nothing was written; the worker made for it ends on its own.
                    await engine.wait_lane(key)
                    return await self._forward(key, event, kind)
                if not await replica.claim(key):
                    return await self._forward(key, event, kind)
            try:
                inline = kind is MessageKind.COMMAND and not in_lane(command)
                inbox_id = await self.turnlog.accept(event, key, kind, done=inline)
                if inbox_id is not None:
                    replica.took(key, (inbox_id,))
                    event = event.with_inbox_ids((inbox_id,))
                    if not inline:  # queued behind the running turn, under the lock
                        return await engine.dispatch(key, event, kind, command)
            except BaseException:
                if not engine.is_busy(key):
                    replica.worker_ended(key)  # nothing runs here: the lease goes back
                raise
        if inbox_id is None:
            if not engine.is_busy(key):
                replica.worker_ended(key)
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        # A command runs under the lease but outside the lock: /stop waits for the worker,
        # whose end takes the lock. The lease goes back after it, unless a turn runs.
        try:
            return await engine.dispatch(key, event, kind, command)
        finally:
            if not engine.is_busy(key):
                replica.worker_ended(key)

    async def _forward(self, key: str, event: MessageEvent, kind: MessageKind) -> Accepted:
        """Another replica runs `key`: the message is journaled for it."""
        if await self.replica.forward(key, event, kind) is None:
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        return Accepted(AcceptStatus.PENDING, session_key=key, detail="run by another replica")

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool:
        engine = self.engine
        if engine.is_busy(key):
            return False
        async with self.replica.key_lock(key):
            if engine.is_busy(key) or not await self.replica.claim(key):
                return False
            accepted = await engine.accept_and_start(key, event, MessageKind.TURN, text, claim)
        return accepted.status == AcceptStatus.STARTED

    def took(self, key: str, inbox_ids: Iterable[int]) -> None:
        self.replica.took(key, inbox_ids)

    def lane_ended(self, key: str) -> None:
        self.replica.worker_ended(key)

    def send_pending_soon(self) -> None:
        self.replica.send_pending_soon()

    def standing_by(self, adapter: PlatformAdapter) -> bool:
        # A single-connection platform runs on the leader only: elsewhere it is on
        # standby, not down.
        return adapter.single_connection

    def status(self) -> dict[str, Any] | None:
        return self.replica.status()

    async def cluster(self) -> list[dict[str, Any]] | None:
        return await self.replica.cluster()

    async def stop_leading(self) -> None:
        await self.replica.stop_leading()  # another replica leads from now on

    async def stop(self) -> None:
        await self.replica.stop()  # the sessions' leases, for the others to resume
