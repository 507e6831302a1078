"""Leases, leader roles, the heartbeat and LISTEN/NOTIFY on a real PostgreSQL.

Each test gets a schema of its own with the `leases` table; the server is the one at
HERMES_TEST_PG_DSN. Faults are real: backends killed with `pg_terminate_backend`, a
database behind a TCP relay that stops forwarding (a partition), a closed port.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.cluster import Heartbeat, LeaderRole, Listener, leases, make_owner_id, notify
from tests.pg_support import fresh_schema
from tests.waiting import wait_blocking, wait_for

PG_DSN = os.environ.get("HERMES_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")

# The same table as gateway/store/pg/schema.py's, made here so these tests stand alone.
LEASES_DDL = """
CREATE TABLE leases (
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    acquired_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX leases_owner ON leases (owner);
"""


@pytest.fixture
def dsn() -> Iterator[str]:
    try:
        admin = psycopg.connect(PG_DSN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        reason = f"no PostgreSQL answers at HERMES_TEST_PG_DSN={PG_DSN}: {exc}"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    schema = f"t_{secrets.token_hex(6)}"
    admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        scoped = make_conninfo(PG_DSN, options=f"-c search_path={schema}")
        with psycopg.connect(scoped, autocommit=True) as conn:
            conn.execute(LEASES_DDL)
        yield scoped
    finally:
        admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        admin.close()


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def lease_expiry(dsn: str, name: str) -> float:
    """The lease's `expires_at` (database epoch seconds): each renewal moves it on."""
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT expires_at FROM leases WHERE name = %s", (name,)).fetchone()
    assert row is not None, f"no lease {name}"
    return float(row[0])


def terminate(dsn: str, app_name_prefix: str) -> int:
    """Kill every backend whose application_name starts with the prefix; how many."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
            (app_name_prefix.replace("_", "\\_").replace("%", "\\%") + "%",),
        ).fetchall()
    return len(rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- leases: plain SQL -------------------------------------------------------------------


def test_a_lease_is_exclusive_until_it_expires(conn: psycopg.Connection) -> None:
    assert leases.try_acquire(conn, "turn:s1", "a", 0.4)
    first_acquired = conn.execute("SELECT acquired_at FROM leases").fetchone()[0]
    assert not leases.try_acquire(conn, "turn:s1", "b", 10)
    assert leases.holder(conn, "turn:s1") == "a"
    assert leases.try_acquire(conn, "turn:s1", "a", 0.4)  # ours: renewed, not re-taken
    assert conn.execute("SELECT acquired_at FROM leases").fetchone()[0] == first_acquired
    wait_blocking(lambda: leases.holder(conn, "turn:s1") is None)  # its 0.4 s ran out
    assert leases.try_acquire(conn, "turn:s1", "b", 10)
    assert leases.holder(conn, "turn:s1") == "b"
    assert conn.execute("SELECT acquired_at FROM leases").fetchone()[0] > first_acquired
    assert not leases.release(conn, "turn:s1", "a")
    assert leases.release(conn, "turn:s1", "b")
    assert leases.holder(conn, "turn:s1") is None


def test_expiry_is_read_on_the_database_clock_inside_a_long_transaction(dsn: str) -> None:
    # now() is frozen at the start of a transaction; a lease must still run out in it.
    with psycopg.connect(dsn) as conn, conn.transaction():
        assert leases.try_acquire(conn, "leader:x", "a", 0.3)
        assert leases.holder(conn, "leader:x") == "a"
        wait_blocking(lambda: leases.holder(conn, "leader:x") is None)  # its 0.3 s ran out
        assert leases.try_acquire(conn, "leader:x", "b", 5)


def test_expiry_ignores_the_replica_clock(conn: psycopg.Connection) -> None:
    # The row holds database epoch seconds: a lease taken now expires ttl after the
    # database's now, whatever time.time() says on this machine.
    leases.try_acquire(conn, "leader:clock", "a", 30)
    expires, db_now = conn.execute(
        "SELECT expires_at, extract(epoch from clock_timestamp()) FROM leases"
    ).fetchone()
    assert 29.5 < expires - float(db_now) <= 30


async def test_renew_extends_every_live_lease_of_the_owner_only(
    dsn: str, conn: psycopg.Connection
) -> None:
    leases.try_acquire(conn, "turn:1", "a", 10)
    leases.try_acquire(conn, "turn:2", "a", 10)
    leases.try_acquire(conn, "turn:3", "a", 0.05)
    leases.try_acquire(conn, "turn:4", "b", 10)
    await wait_for(lambda: leases.holder(conn, "turn:3") is None)  # turn:3 runs out
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as heartbeat:
        assert await leases.arenew(heartbeat, "a", 30) == 2  # turn:3 is up for grabs now
    rows = dict(
        conn.execute(
            "SELECT name, expires_at - extract(epoch from clock_timestamp()) FROM leases"
        ).fetchall()
    )
    assert rows["turn:1"] > 29 and rows["turn:2"] > 29
    assert rows["turn:3"] < 0 and rows["turn:4"] < 10
    assert leases.try_acquire(conn, "turn:3", "b", 5)
    assert leases.release_all(conn, "a") == 2
    assert leases.holder(conn, "turn:1") is None
    assert leases.holder(conn, "turn:4") == "b"


def test_racing_replicas_take_an_expired_lease_once(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        leases.try_acquire(c, "turn:race", "dead", 0.01)
        wait_blocking(lambda: leases.holder(c, "turn:race") is None)
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(8)]
    start = threading.Barrier(len(conns))
    won: list[str] = []

    def race(i: int) -> None:
        start.wait(timeout=5)
        if leases.try_acquire(conns[i], "turn:race", f"r{i}", 10):
            won.append(f"r{i}")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(conns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for c in conns:
        c.close()
    assert len(won) == 1
    with psycopg.connect(dsn, autocommit=True) as c:
        assert leases.holder(c, "turn:race") == won[0]


def test_owner_ids_name_the_host_and_process_and_differ() -> None:
    a, b = make_owner_id(), make_owner_id()
    assert a != b
    host, pid, rand = a.split(":")
    assert host == socket.gethostname() and pid == str(os.getpid()) and len(rand) == 8


# -- leader roles --------------------------------------------------------------------------


class Overlap:
    """Samples `is_leader` of every role every 20 ms; records any moment with two."""

    def __init__(self, roles: list[LeaderRole]) -> None:
        self.roles = roles
        self.samples = 0
        self.both: list[float] = []
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.samples += 1
            if sum(r.is_leader for r in self.roles) > 1:
                self.both.append(time.monotonic())
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def roles(dsn: str) -> AsyncIterator[list[LeaderRole]]:
    made: list[LeaderRole] = []
    yield made
    for role in made:
        await role.stop()


def leader_role(dsn: str, name: str, events: list[tuple[str, str]], ttl: float) -> LeaderRole:
    """A role on "leader:test" whose owner id is `name` and a part unique to this run
    (a backend is killed by its application_name: never another run's)."""
    owner = f"{name}-{secrets.token_hex(4)}"

    async def gained() -> None:
        events.append(("gain", owner))

    async def lost() -> None:
        events.append(("lose", owner))

    return LeaderRole(dsn, "leader:test", owner, on_gain=gained, on_lose=lost, ttl=ttl)


async def test_two_roles_elect_exactly_one_and_stop_hands_over_at_once(
    dsn: str, roles: list[LeaderRole]
) -> None:
    events: list[tuple[str, str]] = []
    a, b = leader_role(dsn, "ra", events, 1.5), leader_role(dsn, "rb", events, 1.5)
    roles += [a, b]
    a.start()
    b.start()
    watch = Overlap([a, b])
    await wait_for(lambda: a.is_leader or b.is_leader, within=3)
    expiries: set[float] = set()

    def renewed_twice() -> bool:
        expiries.add(lease_expiry(dsn, "leader:test"))
        return len(expiries) >= 3 and watch.samples > 30

    await wait_for(renewed_twice)
    await watch.stop()
    assert watch.both == [] and watch.samples > 30
    leader, standby = (a, b) if a.is_leader else (b, a)
    assert leader.gains == 1 and standby.gains == 0
    assert leader.holder == leader.owner and standby.holder == leader.owner
    stopped = time.monotonic()
    await leader.stop()
    assert events[-1] == ("lose", leader.owner)
    await wait_for(lambda: standby.is_leader, within=1.5)
    handover = time.monotonic() - stopped
    assert handover < 0.8, handover  # released: no waiting for the 1.5 s lease to run out
    await wait_for(lambda: events[-1] == ("gain", standby.owner), within=1)


async def test_a_role_stopped_as_its_connection_opens_stops_and_never_leads(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stop()` lands in the very loop step in which the role's connection opens: the
    cancellation must not be lost (it was, with `asyncio.wait_for` on Python 3.11: the
    role then took the lease, ran on_gain and its stop waited forever)."""
    real_connect = psycopg.AsyncConnection.connect
    opened: asyncio.Queue[tuple[asyncio.Future[object], object]] = asyncio.Queue()

    async def held_open(*args: object, **kwargs: object) -> object:
        conn = await real_connect(*args, **kwargs)
        gate = asyncio.get_running_loop().create_future()
        opened.put_nowait((gate, conn))
        return await gate

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", held_open)
    events: list[tuple[str, str]] = []
    role = leader_role(dsn, "rc", events, 1.5)
    role.start()
    async with asyncio.timeout(5):
        gate, conn = await opened.get()
    gate.set_result(conn)  # the connection is there ...
    stopping = asyncio.create_task(role.stop())  # ... and stop() arrives in the same step
    try:
        async with asyncio.timeout(5):
            await stopping
    finally:
        stopping.cancel()
    assert role.gains == 0 and events == [] and not role.is_leader


async def test_a_leader_whose_backend_is_killed_keeps_or_hands_over_never_both(
    dsn: str, roles: list[LeaderRole]
) -> None:
    events: list[tuple[str, str]] = []
    a, b = leader_role(dsn, "killa", events, 1.5), leader_role(dsn, "killb", events, 1.5)
    roles += [a, b]
    a.start()
    await wait_for(lambda: a.is_leader, within=3)
    b.start()
    watch = Overlap([a, b])
    await wait_for(lambda: b.holder == a.owner)  # B polls, as the standby
    killed_expiry = lease_expiry(dsn, "leader:test")
    assert terminate(dsn, f"hermes leader:test {a.owner}") == 1
    # Renewed past the expiry it had when killed: B never found the lease free.
    await wait_for(lambda: lease_expiry(dsn, "leader:test") > killed_expiry + 1.5)
    await watch.stop()
    assert watch.both == []
    # It reconnected and renewed in time: the role never moved.
    assert a.is_leader and a.losses == 0 and not b.is_leader


async def test_a_partitioned_leader_steps_down_before_another_takes_over(
    dsn: str, roles: list[LeaderRole]
) -> None:
    relay = await Relay.open(dsn)
    events: list[tuple[str, str]] = []
    a = leader_role(relay.dsn, "parta", events, 1.5)
    b = leader_role(dsn, "partb", events, 1.5)
    roles += [a, b]
    times: dict[str, float] = {}

    async def a_lost() -> None:
        times["a_lost"] = time.monotonic()

    async def b_gained() -> None:
        times["b_gained"] = time.monotonic()

    a.on_lose, b.on_gain = a_lost, b_gained
    try:
        a.start()
        await wait_for(lambda: a.is_leader, within=3)
        b.start()
        watch = Overlap([a, b])
        await wait_for(lambda: b.holder == a.owner)  # B polls, as the standby
        relay.freeze()  # the leader's packets go nowhere, its socket stays open
        frozen = time.monotonic()
        await wait_for(lambda: b.is_leader, within=3)
        failover = time.monotonic() - frozen
        await watch.stop()
        assert watch.both == []
        assert not a.is_leader and times["a_lost"] < times["b_gained"]
        # within the ttl, plus the poll's slack and a loaded machine's
        assert failover < 1.5 + 1.0, failover
    finally:
        await relay.close()


async def test_a_dead_leaders_role_moves_within_the_ttl(dsn: str, roles: list[LeaderRole]) -> None:
    events: list[tuple[str, str]] = []
    b = leader_role(dsn, "alive", events, 1.5)
    roles.append(b)
    # A replica killed with SIGKILL: a fresh lease nobody renews.
    with psycopg.connect(dsn, autocommit=True) as c:
        assert leases.try_acquire(c, "leader:test", "killed", 1.5)
    died = time.monotonic()
    b.start()
    await wait_for(lambda: b.holder == "killed", within=1)
    await wait_for(lambda: b.is_leader, within=3)
    took = time.monotonic() - died
    # Never before the lease runs out; after it, at once (a second of slack for a loaded
    # machine, well short of waiting another lease's life).
    assert 1.4 < took < 1.5 + 1.0, took


# -- heartbeat -----------------------------------------------------------------------------


async def test_heartbeat_renews_all_leases_of_its_owner(dsn: str, conn: psycopg.Connection) -> None:
    leases.try_acquire(conn, "turn:1", "hb", 1.5)
    leases.try_acquire(conn, "turn:2", "hb", 1.5)
    leases.try_acquire(conn, "turn:3", "other", 1.5)
    beat = Heartbeat(dsn, "hb", ttl=1.5)
    beat.start()
    try:
        # turn:3, taken last and never renewed, runs out: turn:1 and turn:2 would too.
        await wait_for(lambda: leases.holder(conn, "turn:3") is None)
        assert beat.healthy and beat.renewed == 2 and beat.failures == 0
        assert leases.holder(conn, "turn:1") == "hb" and leases.holder(conn, "turn:2") == "hb"
        assert leases.holder(conn, "turn:3") is None
    finally:
        await beat.stop()


async def test_heartbeat_survives_a_killed_backend_and_turns_unhealthy_when_cut_off(
    dsn: str,
) -> None:
    calls: list[str] = []

    async def unhealthy() -> None:
        calls.append("unhealthy")

    async def healthy() -> None:
        calls.append("healthy")

    relay = await Relay.open(dsn)
    owner = f"hbcut{secrets.token_hex(3)}"
    beat = Heartbeat(relay.dsn, owner, ttl=1.5, on_unhealthy=unhealthy, on_healthy=healthy)
    beat.start()
    try:
        await wait_for(lambda: beat.beats >= 1, within=2)
        # A killed backend is replaced at the next beat, well within ttl - margin.
        for _ in range(3):
            assert terminate(dsn, f"hermes heartbeat {owner}") == 1
            beats = beat.beats
            await wait_for(lambda: beat.beats > beats, within=1.5)  # noqa: B023
        assert beat.healthy and calls == [] and beat.failures == 3
        relay.freeze()
        cut = time.monotonic()
        await wait_for(lambda: not beat.healthy, within=2)
        # At ttl - margin after the last beat, which was before the cut: before its
        # leases can lapse (the margin absorbs a loaded machine's late timer).
        assert time.monotonic() - cut < 1.5
        failed = beat.failures
        await wait_for(lambda: beat.failures >= failed + 2, within=5)  # beats go on failing
        assert calls == ["unhealthy"]
        relay.thaw()
        await wait_for(lambda: beat.healthy, within=2)
        await wait_for(lambda: calls == ["unhealthy", "healthy"], within=1)
    finally:
        await beat.stop()
        await relay.close()


async def test_heartbeat_on_a_closed_port_turns_unhealthy_once() -> None:
    calls: list[str] = []

    async def unhealthy() -> None:
        calls.append("unhealthy")

    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    beat = Heartbeat(dead, "nobody", ttl=0.9, on_unhealthy=unhealthy)
    started = time.monotonic()
    beat.start()
    try:
        await wait_for(lambda: not beat.healthy, within=2)
        assert 0.6 < time.monotonic() - started < 0.9  # at ttl - margin
        failed = beat.failures
        await wait_for(lambda: beat.failures >= max(failed + 2, 3), within=5)
        assert calls == ["unhealthy"] and beat.beats == 0
    finally:
        await beat.stop()


# -- LISTEN/NOTIFY -------------------------------------------------------------------------


async def test_listener_delivers_committed_notifies_and_rescans_after_reconnect(
    dsn: str,
) -> None:
    got: list[str] = []
    got_async: list[str] = []
    rescans: list[int] = []

    async def on_async(payload: str) -> None:
        got_async.append(payload)

    async def rescan() -> None:
        rescans.append(listener.connections)

    label = f"test-{secrets.token_hex(4)}"
    listener = Listener(dsn, on_reconnect=rescan, label=label)
    marks: list[str] = []
    listener.add("replies", got.append)
    listener.add("replies", on_async)
    listener.add("mark", marks.append)
    listener.start()
    try:
        await asyncio.wait_for(listener.subscribed(), 3)
        with psycopg.connect(dsn) as writer, psycopg.connect(dsn, autocommit=True) as marker:
            with writer.transaction():
                notify(writer, "replies", "s1:7")
                # Notifications arrive in commit order: a mark committed after it was
                # sent, heard while the sender's transaction is open, proves it waits.
                notify(marker, "mark", "after s1:7")
                await wait_for(lambda: marks == ["after s1:7"], within=2)
                assert got == []  # not before the sender's commit
            await wait_for(lambda: got == ["s1:7"] and got_async == ["s1:7"], within=2)

            assert terminate(dsn, f"hermes listener {label}") == 1
            await wait_for(lambda: rescans == [2], within=3)
            await asyncio.wait_for(listener.subscribed(), 3)
            notify(writer, "replies", "s1:8")
            writer.commit()
            await wait_for(lambda: got == ["s1:7", "s1:8"], within=2)

            # A channel added while running is listened to without a reconnection.
            other: list[str] = []
            listener.add("wake", other.append)
            await asyncio.wait_for(listener.subscribed(), 2)
            notify(writer, "wake", "")
            writer.commit()
            await wait_for(lambda: other == [""], within=2)
            assert listener.connections == 2
    finally:
        await listener.stop()


async def test_a_listener_hears_its_own_schemas_notifies_only(dsn: str) -> None:
    """Channels are per database: a store in another schema of it (a parallel test
    worker, another deployment) notifies on the same channel name unheard."""
    got: list[str] = []
    listener = Listener(dsn, label=f"test-{secrets.token_hex(4)}")
    listener.add("replies", got.append)
    listener.start()
    try:
        await asyncio.wait_for(listener.subscribed(), 3)
        with (
            fresh_schema() as other_dsn,
            psycopg.connect(other_dsn, autocommit=True) as other,
            psycopg.connect(dsn, autocommit=True) as own,
        ):
            notify(other, "replies", "theirs")
            notify(own, "replies", "ours")  # delivered in commit order: after "theirs"
            await wait_for(lambda: "ours" in got, within=2)
        assert got == ["ours"]
    finally:
        await listener.stop()


# -- a database behind a relay that can stop forwarding ------------------------------------


class Relay:
    """A TCP relay to the database on a free port of 127.0.0.1. `freeze()` stops
    forwarding in both directions and leaves every socket open (a network partition:
    no error, no answer), new connections included; `thaw()` heals it."""

    def __init__(self, server: asyncio.Server, dsn: str) -> None:
        self.server = server
        self.dsn = dsn
        self.frozen = False
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task[object]] = []

    @classmethod
    async def open(cls, dsn: str) -> Relay:
        params = conninfo_to_dict(dsn)
        target = (str(params.get("host", "127.0.0.1")), int(params.get("port", 5432)))
        relay: Relay

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                if relay.frozen:
                    await asyncio.Event().wait()  # swallow: hold the socket, say nothing
                writer.write(data)
                await writer.drain()
            writer.close()  # pass the end on: the other side sees its peer go

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            relay.writers.append(writer)
            task = asyncio.current_task()
            assert task is not None
            relay.tasks.append(task)
            if relay.frozen:
                await asyncio.Event().wait()
            up_reader, up_writer = await asyncio.open_connection(*target)
            relay.writers.append(up_writer)
            await asyncio.gather(
                pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
            )
            writer.close()
            up_writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        relay = cls(server, make_conninfo(dsn, host="127.0.0.1", port=port))
        return relay

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        """Forward new connections again (the frozen ones stay hung)."""
        self.frozen = False

    async def close(self) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()


def test_live_lists_each_owner_with_its_sessions_and_other_leases(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for key in ("agent:main:http:dm:a", "agent:main:http:dm:b"):
            assert leases.try_acquire(conn, f"session:{key}", "r1", 30)
        assert leases.try_acquire(conn, "session:agent:main:http:dm:c", "r2", 30)
        assert leases.try_acquire(conn, "scheduler", "r1/lead", 30)
        assert leases.try_acquire(conn, "session:agent:main:http:dm:gone", "r3", -1)  # expired
        assert leases.live(conn) == [
            ("r1", 2, []),
            ("r1/lead", 0, ["scheduler"]),
            ("r2", 1, []),
        ]
