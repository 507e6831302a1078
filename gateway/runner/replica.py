"""One replica of several on a shared PostgreSQL store: which replica runs a
session, and what moves when a replica dies or loses the database.

Rule: a replica touches a session's turns only while it holds the session's lease
(`session:{key}` in `leases`, gateway.cluster.leases), for `cluster.failover_seconds`,
renewed by the heartbeat and by every turn's own begin and finish transactions (the
fence: a transaction of a replica that lost the lease fails, nothing of it commits).

    message for key K arrives at replica A
      A runs K already, or takes K's free lease -> as on one node (accept, run)
      another replica B holds K               -> A records it `accepted` in the inbox
                                                 and NOTIFYs B, which queues it
    B's worker for K ends                     -> B releases K, unless messages wait
    a replica dies (no heartbeat)             -> its leases expire; the sweeper of any
                                                 replica finds K's open messages with
                                                 no live lease, takes K and resumes
                                                 the interrupted turn (its marker) once

Messages are journaled before they are acknowledged, so the worst a race can do is leave
one waiting a sweep (a second at most), never run it twice: taking a lease is one row
in the database, and a turn begins and finishes only under it. Replicas agree on time by
the database's clock. Leader roles (the Telegram polling loop, the Discord gateway, Slack
Socket Mode, and housekeeping with the scheduler) are leases too (gateway.cluster.leader).

Start-up recovery as on one node (`.clean_shutdown`, marking recently active sessions)
does not run: another replica may be in the middle of those turns. The sweeper is the
recovery, key by key.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Any

import structlog
from psycopg import errors as pg_errors

from gateway.cluster import leases
from gateway.cluster.heartbeat import Heartbeat
from gateway.cluster.leader import LeaderRole
from gateway.cluster.notify import Listener, notify
from gateway.domain.command_syntax import MessageKind
from gateway.domain.events import MessageEvent
from gateway.runner.housekeeping import RESEND_AFTER_SECONDS
from gateway.runner.ports import ReplicaHost
from gateway.runner.recovery import STUCK_LOOP_THRESHOLD, stuck_notice, task_failure
from gateway.store import codec, journal, schedules

log = structlog.get_logger("gateway.replica")

INBOX_CHANNEL = "hermes_inbox"  # payload: a session key with a message waiting
REPLIES_CHANNEL = "hermes_replies"  # payload: an HTTP API chat id with a new reply
SEND_PENDING_CHANNEL = "hermes_send_pending"  # a reply another process recorded
SWEEP_SECONDS = 1.0
# A lease lives this share of `cluster.failover_seconds`: a standby retries every third
# of a lease's life, so a dead holder's role moves within 0.7 * (1 + 1/3) of it, and its
# sessions within 0.7 of it plus one sweep.
LEASE_SHARE = 0.7
IDLE_LEASE_CHECK_ROUNDS = 5  # sweeps between looks for leases held with nothing running
SWEEP_LIMIT = 200
# The one leader: the single-connection platforms, housekeeping and the scheduler. One
# role, so the replica that sends a platform's pending replies is connected to it.
LEADER = "leader:housekeeping"
# In a turn marker's event: how often a replica died while running it (a takeover of a
# marker that was only waiting, never reached by the replica that died, does not count).
TAKEOVERS = "takeovers"


class LeaseLost(RuntimeError):
    """This replica no longer holds the session's lease: another one runs it now."""


LeaseBusy = (pg_errors.DeadlockDetected, pg_errors.LockNotAvailable)  # taking it met another


class LeaseClaim:
    """Takes a session's lease inside another transaction (the one that accepts and
    begins a turn: `TurnLog.accept_and_begin`'s `claim`): False, and nothing of that
    transaction is written, when another replica holds it. `won` tells the caller."""

    __slots__ = ("name", "owner", "ttl", "won")

    def __init__(self, name: str, owner: str, ttl: float) -> None:
        self.name, self.owner, self.ttl = name, owner, ttl
        self.won: bool | None = None  # None: the transaction never ran (it failed)

    def __call__(self, conn: Any) -> bool:
        self.won = leases.try_acquire(conn.raw, self.name, self.owner, self.ttl)
        return self.won


PRESENCE_PREFIX = "replica:"  # a replica's own lease, held while it lives


def lease_name(session_key: str) -> str:
    return f"session:{session_key}"


_FENCE = (
    "UPDATE leases SET expires_at = extract(epoch from clock_timestamp()) + ?"
    " WHERE name = ? AND owner = ? AND expires_at >= extract(epoch from clock_timestamp())"
)
_RELEASE_IF_IDLE = (
    "DELETE FROM leases WHERE name = ? AND owner = ? AND NOT EXISTS"
    " (SELECT 1 FROM inbox WHERE session_key = ? AND state = 'accepted')"
)
_ORPHANED = (
    "SELECT DISTINCT i.session_key FROM inbox i WHERE i.state = 'accepted' AND NOT EXISTS"
    " (SELECT 1 FROM leases l WHERE l.name = 'session:' || i.session_key"
    " AND l.expires_at >= extract(epoch from clock_timestamp())) LIMIT ?"
)
_HELD = "SELECT name FROM leases WHERE owner = ? AND name LIKE 'session:%'"
_OPEN_FOR_KEY = (
    "SELECT id, kind, event FROM inbox WHERE session_key = ? AND state = 'accepted' ORDER BY id"
)


class Replica:
    """The runner's side of the cluster: leases of the sessions it runs, the sweeper,
    the heartbeat, the LISTEN connection and the leader roles."""

    LEADER = LEADER
    LEASE_BUSY = LeaseBusy  # (the runner imports this module only for PostgreSQL)

    def __init__(self, runner: ReplicaHost) -> None:
        self.runner = runner
        settings = runner.config.cluster
        self.dsn = runner.config.storage.dsn or ""
        self.ttl = settings.failover_seconds * LEASE_SHARE
        self.owner = leases.make_owner_id()
        self.healthy = True
        self.takeovers = 0  # sessions resumed from another replica's leftovers
        self.forwarded = 0  # messages handed to the replica running their session
        self._locks: dict[str, _KeyLock] = {}
        self._taken: dict[str, set[int]] = {}  # key -> inbox ids this replica runs
        self._sweep_wake = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.heartbeat = Heartbeat(
            self.dsn,
            self.owner,
            ttl=self.ttl,
            on_unhealthy=self._unhealthy,
            on_healthy=self._healthy,
        )
        self.listener = Listener(self.dsn, on_reconnect=self._reconnected, label=self.owner)
        self.listener.add(INBOX_CHANNEL, self._on_inbox)
        self.listener.add(REPLIES_CHANNEL, self._on_reply)
        self.listener.add(schedules.CHANNEL, lambda _: runner.scheduler.wake())
        self.listener.add(SEND_PENDING_CHANNEL, self._on_send_pending)
        self.roles: list[LeaderRole] = []
        self._platform_roles: dict[str, LeaderRole] = {}  # platform -> its leader role

    # --- lifecycle -----------------------------------------------------------------------

    def lead(
        self,
        name: str,
        on_gain: Callable[[], Awaitable[None]],
        on_lose: Callable[[], Awaitable[None]],
        platforms: Collection[str] = (),
    ) -> LeaderRole:
        """A leader role: `on_gain` runs on the one replica holding `name`; sessions of
        `platforms` (their only connection runs on the leader) run there only."""
        # An owner id of its own: the heartbeat (which renews every lease of `owner`)
        # must not keep a leader lease alive while the role's own connection is down.
        role = LeaderRole(
            self.dsn, name, f"{self.owner}/lead", on_gain=on_gain, on_lose=on_lose, ttl=self.ttl
        )
        self.roles.append(role)
        for platform in platforms:
            self._platform_roles[platform] = role
        return role

    async def start(self) -> None:
        self.runner.turnlog.fence = self.fence
        # Present while alive: the heartbeat renews this with the rest, and `cluster()`
        # lists a replica holding nothing else.
        presence, owner, ttl = f"{PRESENCE_PREFIX}{self.owner}", self.owner, self.ttl
        await self.runner.store.write(
            lambda conn: leases.try_acquire(conn.raw, presence, owner, ttl)
        )
        self.listener.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl):
                await self.listener.subscribed()
        self.heartbeat.start()
        for role in self.roles:
            role.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="replica-sweeper")
        log.info(
            "replica_started",
            owner=self.owner,
            failover_seconds=self.runner.config.cluster.failover_seconds,
            lease_seconds=round(self.ttl, 2),
        )

    async def stop_leading(self) -> None:
        """First step of a shutdown: hand the leader roles over at once."""
        for role in self.roles:
            await role.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    async def stop(self) -> None:
        """Last step: give every session lease back, so other replicas resume at once
        what this one left (drained turns keep their markers), then disconnect."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.runner.store.write(lambda conn: leases.release_all(conn.raw, self.owner))
            await self.runner.store.write(lambda conn: _notify(conn, INBOX_CHANNEL, ""))
        await self.heartbeat.stop()
        await self.listener.stop()

    async def cluster(self) -> list[dict[str, Any]]:
        """Every replica that holds a live lease, from the leases table: its sessions
        and leader roles (a leader lease's owner is `<replica>/lead`)."""
        rows = await self.runner.store.read(lambda conn: leases.live(conn.raw))
        replicas: dict[str, dict[str, Any]] = {}
        for owner, sessions, others in rows:
            name = owner.removesuffix("/lead")
            found = replicas.setdefault(
                name, {"owner": name, "sessions_held": 0, "leader_of": [], "this": False}
            )
            found["this"] = name == self.owner
            found["sessions_held"] += sessions
            if owner.endswith("/lead"):
                found["leader_of"].extend(others)
        return list(replicas.values())

    def status(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "healthy": self.healthy,
            "sessions_held": len(self._taken),
            "leader_of": [role.name for role in self.roles if role.is_leader],
            "takeovers": self.takeovers,
            "forwarded": self.forwarded,
        }

    # --- one session ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def key_lock(self, key: str) -> AsyncIterator[None]:
        """Taking, using and giving back one key's lease, one at a time in this process:
        a message accepted meanwhile is never also picked up from the inbox."""
        # Counted, not "unlocked": between a release and its next waiter taking the lock
        # it is unlocked, and dropping it then would let a newcomer take a second one.
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = _KeyLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if not entry.users:
                del self._locks[key]

    def lease_claim(self, key: str) -> LeaseClaim:
        """`key`'s lease, to take inside the transaction of the caller (`LeaseClaim`)."""
        return LeaseClaim(lease_name(key), self.owner, self.ttl)

    async def claim(self, key: str) -> bool:
        """Take (or keep) `key`'s lease; False when another replica holds it, or when
        taking it ran into another replica's transaction (a deadlock PostgreSQL broke):
        the message is then journaled for whoever runs the session, which is safe."""
        name, owner, ttl = lease_name(key), self.owner, self.ttl
        try:
            return await self.runner.store.write(
                lambda conn: leases.try_acquire(conn.raw, name, owner, ttl)
            )
        except LeaseBusy:
            return False

    def took(self, key: str, inbox_ids: Iterable[int]) -> None:
        """This replica runs these messages of `key` (a pickup skips them)."""
        self._taken.setdefault(key, set()).update(inbox_ids)

    def fence(self, conn: Any, key: str) -> None:
        """In a turn's own transaction: renew `key`'s lease, or fail the transaction when
        another replica holds it now (the turn is theirs to resume). The check waits for
        the end of the batch (`PgConn.check_later`): the transaction fails all the same,
        and the batch's other statements need not wait for this one's answer."""
        renewed = conn.execute(_FENCE, (self.ttl, lease_name(key), self.owner))

        def check() -> None:
            if renewed.rowcount != 1:
                raise LeaseLost(f"session {key} is run by another replica now")

        conn.check_later(check)

    async def forward(self, key: str, event: MessageEvent, kind: MessageKind) -> int | None:
        """Another replica runs `key`: journal the message for it and wake it."""

        def tx(conn: Any) -> int | None:
            inbox_id = journal.accept(
                conn,
                source=event.source,
                message_id=event.message_id,
                session_key=key,
                kind=kind,
                event=codec.dumps(event.to_dict()),
                now=time.time(),
            )
            if inbox_id is not None:
                _notify(conn, INBOX_CHANNEL, key)
            return inbox_id

        inbox_id = await self.runner.store.write(tx)
        if inbox_id is not None:
            self.forwarded += 1
        return inbox_id

    def worker_ended(self, key: str) -> None:
        """The key's worker ran out of messages: give its lease back (in the background)."""
        if self.runner.draining:
            return  # stop() gives every lease back at once
        task = asyncio.create_task(self._release(key), name=f"release:{key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, key: str) -> None:
        async with self.key_lock(key):
            if self.runner.is_busy(key):
                return  # a new message started it again meanwhile: the lease stays
            self._taken.pop(key, None)
            name, owner = lease_name(key), self.owner
            try:
                outcome = await self.runner.store.write(
                    lambda conn: _release_if_idle(conn, name, owner, key, self.ttl)
                )
            except Exception as exc:  # the database is away: the lease expires by itself
                log.warning("lease_release_failed", session_key=key, error=str(exc))
                return
            if outcome == "busy":
                await self._pick_up(key)  # messages forwarded while it ran

    # --- picking up --------------------------------------------------------------------

    def _on_inbox(self, key: str) -> None:
        """A message waits for `key`: queue it if this replica runs the key, else let
        the sweeper see whether the key is free."""
        if key and self.runner.is_busy(key):
            self._spawn(self._pick_up_held(key))
        else:
            self._wake_sweeper()

    async def _pick_up_held(self, key: str) -> None:
        async with self.key_lock(key):
            if self.runner.is_busy(key):
                await self._pick_up(key)

    async def _pick_up(self, key: str) -> int:
        """Queue `key`'s open messages this replica does not run yet (its lease held,
        under its lock); an interrupted turn's marker is resumed first. Returns how many."""
        marker, rows = await self.runner.store.read(lambda conn: _open_work(conn, key))
        taken = self._taken.setdefault(key, set())
        queued = 0
        runner = self.runner
        if marker is not None and not taken.issuperset(marker["inbox_ids"]):
            taken.update(marker["inbox_ids"])
            if await self._resume(key, marker):
                queued += 1
        for inbox_id, kind, data in rows:
            if inbox_id in taken:
                continue
            taken.add(inbox_id)
            event = MessageEvent.from_dict(codec.loads(data), inbox_ids=(inbox_id,))
            await runner.requeue(key, event, MessageKind(kind))
            queued += 1
        if not runner.is_busy(key):
            # Nothing left to run (commands only): give the lease back.
            self._taken.pop(key, None)
            name, owner = lease_name(key), self.owner
            await runner.store.write(
                lambda conn: conn.execute(_RELEASE_IF_IDLE, (name, owner, key))
            )
        return queued

    async def _resume(self, key: str, marker: dict[str, Any]) -> bool:
        """Run an interrupted turn again, or, when replicas died running it
        STUCK_LOOP_THRESHOLD times already (a message that kills each replica that runs
        it would otherwise take the fleet down one by one), set it aside, suspend the
        session and tell the user, as one node's stuck-loop guard does (gateway.runner.recovery).
        A holder that died while the turn only waited (its marker's `running` unset) does
        not count against it. False when set aside."""
        runner = self.runner
        data = dict(marker["event"])
        attempts = int(data.get(TAKEOVERS, 0)) + (1 if marker["running"] else 0)
        if attempts >= STUCK_LOOP_THRESHOLD:
            source = MessageEvent.from_dict(data).source
            await runner.store.suspend_session(key)
            ids, chunks = await runner.turnlog.set_aside(
                key,
                marker["inbox_ids"],
                source,
                lambda events: runner.split_reply(source, stuck_notice(events or [data], key)),
                task_failure(source),
            )
            log.warning("stuck_session_suspended", session_key=key, takeovers=attempts)
            await runner.delivery.send_recorded(source, list(zip(ids, chunks, strict=True)), None)
            return False
        data[TAKEOVERS] = attempts  # counted in the marker: it survives the next crash
        await runner.store.write(
            lambda conn: conn.execute(
                # Waiting again: running once this replica reaches its agent slot.
                "UPDATE turns SET event = ?, running = 0 WHERE session_key = ?",
                (codec.dumps(data), key),
            )
        )
        entry = await runner.store.get_entry(key)
        if entry is not None and not entry.resume_pending:
            await runner.store.mark_resume_pending(key, "replica_takeover")
        event = MessageEvent.from_dict(
            data, inbox_ids=tuple(marker["inbox_ids"]), resume=True, synthetic=True
        )
        await runner.submit(key, event)
        return True

    # --- the sweeper -----------------------------------------------------------------------

    def _wake_sweeper(self) -> None:
        self._sweep_wake.set()

    async def _reconnected(self) -> None:
        """Notifications sent while the listener was away are lost: sweep now."""
        self._wake_sweeper()

    async def _sweep_loop(self) -> None:
        rounds = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SWEEP_SECONDS):
                    await self._sweep_wake.wait()
            self._sweep_wake.clear()
            if not self.healthy or not self.runner.accepting:
                continue
            rounds += 1
            try:
                await self.sweep()
                if rounds % IDLE_LEASE_CHECK_ROUNDS == 0:
                    await self.release_idle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("sweep_failed", error=str(exc))

    async def sweep(self) -> int:
        """Take the sessions whose messages wait with no live lease: a dead replica's,
        or ones forwarded just as their holder let go. Returns how many it took."""
        keys = await self.runner.store.read(
            lambda conn: [row[0] for row in conn.execute(_ORPHANED, (SWEEP_LIMIT,))]
        )
        taken = 0
        for key in keys:
            if not self.can_run(key):
                continue
            async with self.key_lock(key):
                if self.runner.is_busy(key) or not await self.claim(key):
                    continue
                if await self._pick_up(key):
                    taken += 1
        if taken:
            self.takeovers += taken
            log.info("sessions_taken_over", sessions=taken, owner=self.owner)
            # Replies a dead replica recorded but did not send (older than a live sender
            # can still be busy with): sent now, not at the next housekeeping pass.
            await self.runner.resend_pending(RESEND_AFTER_SECONDS)
        return taken

    async def release_idle(self) -> int:
        """Give back session leases this replica holds with nothing running for them (a
        safety net: the heartbeat would renew a forgotten one for ever, and messages
        forwarded to it would wait)."""
        owner = self.owner
        names = await self.runner.store.read(
            lambda conn: [row[0] for row in conn.execute(_HELD, (owner,))]
        )
        idle = [
            name.removeprefix("session:")
            for name in names
            if not self.runner.is_busy(name.removeprefix("session:"))
            and name.removeprefix("session:") not in self._locks
        ]
        for key in idle:
            await self._release(key)
        return len(idle)

    def can_run(self, key: str) -> bool:
        """Whether this replica may run `key`: a session of a single-connection platform
        (Telegram polling, Discord, Slack Socket Mode) only on the leader, the one
        replica connected there."""
        parts = key.split(":")
        role = self._platform_roles.get(parts[2] if len(parts) > 2 else "")
        return role is None or role.is_leader

    # --- health and replies ----------------------------------------------------------------

    async def _unhealthy(self) -> None:
        """The database has not renewed this replica's leases for nearly their whole
        life: before another replica may take them, stop every turn (their markers stay;
        whoever takes the session resumes it) and refuse messages (503)."""
        self.healthy = False
        log.warning(
            "replica_lost_database", owner=self.owner, running_turns=self.runner.busy_sessions()
        )
        await self.runner.cancel_all_turns()
        self._taken.clear()

    async def _healthy(self) -> None:
        self.healthy = True
        log.info("replica_database_back", owner=self.owner)
        self._wake_sweeper()

    def publish_reply(self, chat_id: str) -> None:
        """A reply for an HTTP API chat was recorded: wake its long-pollers everywhere."""
        self._spawn(self.runner.store.write(lambda conn: _notify(conn, REPLIES_CHANNEL, chat_id)))

    def send_pending_soon(self) -> None:
        """A reply recorded by another process (`pairing approve`): the leader, which is
        connected to every platform, sends it."""
        self._spawn(self.runner.store.write(lambda conn: _notify(conn, SEND_PENDING_CHANNEL, "")))

    def _on_send_pending(self, _: str) -> None:
        if any(role.name == LEADER and role.is_leader for role in self.roles):
            self.send_pending_later()

    def send_pending_later(self) -> None:
        """Send recorded replies nobody sent, once they are RESEND_AFTER_SECONDS old.
        Not sooner: no row says which replica is sending a younger one, and the leader
        must not send it a second time (the same rule as housekeeping's passes)."""

        async def send() -> None:
            await asyncio.sleep(RESEND_AFTER_SECONDS)
            await self.runner.resend_pending(RESEND_AFTER_SECONDS)

        self._spawn(send())

    def _on_reply(self, chat_id: str) -> None:
        for adapter in self.runner.adapters.values():
            adapter.wake(chat_id)

    def _spawn(self, work: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await work
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("replica_task_failed", error=str(exc))

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _notify(conn: Any, channel: str, payload: str) -> None:
    """NOTIFY from a store write (`PgConn`): delivered when its transaction commits."""
    notify(conn.raw, channel, payload)


class _KeyLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0  # holding it or waiting for it


def _release_if_idle(conn: Any, name: str, owner: str, key: str, ttl: float) -> str:
    """Give the lease back unless messages wait: `released`, `busy` (they wait, the lease
    stays, renewed), or `lost` (another replica holds it now: nothing here is ours to run).
    One statement in the common case (nothing waits)."""
    if conn.execute(_RELEASE_IF_IDLE, (name, owner, key)).rowcount:
        return "released"
    if conn.execute(_FENCE, (ttl, name, owner)).rowcount != 1:
        return "lost"
    return "busy"


def _open_work(conn: Any, key: str) -> tuple[dict[str, Any] | None, list[Any]]:
    return journal.get_turn(conn, key), conn.execute(_OPEN_FOR_KEY, (key,)).fetchall()
