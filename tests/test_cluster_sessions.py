"""Sessions across two replicas in one event loop on one PostgreSQL schema:
messages and commands that reach the replica not running the session are handed to the
one that does, and a replica holds a session's lease only while something runs there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from gateway.runner.recovery import stuck_notice
from tests.gateway_client import GatewayClient
from tests.pg_support import fresh_schema
from tests.waiting import wait_for

NAMED = "tests.fakes.agents:named"  # "hang" in a text: the turn never ends by itself


@dataclass
class Replica:
    runner: GatewayRunner
    client: GatewayClient


@pytest.fixture
def dsn() -> AsyncIterator[str]:
    with fresh_schema() as schema_dsn:
        yield schema_dsn


@pytest.fixture
async def pair(dsn: str, tmp_path: Path) -> AsyncIterator[list[Replica]]:
    made: list[Replica] = []
    for i in range(2):
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "agent": {
                    "backend": NAMED,
                    "options": {"name": "bot"},
                    "restart_drain_timeout": 1,  # a hanging turn holds up no stop
                },
                "storage": {"backend": "postgres", "dsn": dsn},
                "cluster": {"failover_seconds": 2},
                "platforms": {"http": {"enabled": True, "port": 0}},
            }
        )
        adapter = HttpAdapter(config.platforms.http)
        runner = GatewayRunner(config, [adapter], home=tmp_path / f"home{i}")
        await runner.start()
        made.append(Replica(runner, GatewayClient(adapter.url)))
    yield made
    for replica in made:
        await replica.client.close()
        await replica.runner.stop()


def ledger_texts(dsn: str, chat_id: str) -> list[str]:
    """The replies the shared ledger (`outbound`) holds for `chat_id`, in order."""
    with psycopg.connect(dsn) as conn:
        query = "SELECT text FROM outbound WHERE chat_id = %s ORDER BY id"
        return [text for (text,) in conn.execute(query, (chat_id,))]


def session_leases(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT name, owner FROM leases WHERE name LIKE 'session:%' ORDER BY name"
        ).fetchall()


async def test_a_message_and_a_stop_sent_to_the_other_replica_reach_the_running_turn(
    pair: list[Replica], dsn: str
) -> None:
    a, b = pair
    await a.client.post("c1", "hang on")
    await wait_for(lambda: a.runner.is_busy("agent:main:http:dm:c1"))
    # B does not run the session: it journals the message for A, which queues it.
    answer = await b.client.post("c1", "/queue next please")
    assert answer["status"] == "pending"
    await wait_for(lambda: a.runner.queue_depth("agent:main:http:dm:c1") == 1)
    assert not b.runner.is_busy("agent:main:http:dm:c1")
    # /stop sent to B stops A's turn and drops the queue.
    await b.client.post("c1", "/stop")
    await wait_for(lambda: not a.runner.is_busy("agent:main:http:dm:c1"))
    replies = await b.client.replies("c1", 1)
    assert "stop" in replies[0].lower(), replies
    # Nothing runs: no replica keeps the session's lease.
    await wait_for(lambda: session_leases(dsn) == [], within=3)
    # The session's turns run in order: a reply from the stopped turn or the dropped one
    # would come before the marker's.
    await b.client.post("c1", "marker")
    (marked,) = await b.client.replies("c1", 1)
    assert marked.endswith("\n\nbot: marker") and "session was stopped" in marked
    await wait_for(lambda: session_leases(dsn) == [], within=3)


async def test_a_command_to_an_idle_session_leaves_no_lease_behind(
    pair: list[Replica], dsn: str
) -> None:
    a, b = pair
    await b.client.post("c2", "/status")
    (status,) = await b.client.replies("c2", 1)
    assert "main" in status
    await wait_for(lambda: session_leases(dsn) == [], within=3)
    # The session is free: a message to A now runs on A.
    await a.client.post("c2", "hello")
    assert await b.client.replies("c2", 1) == ["bot: hello"]  # the reply, on either replica
    await wait_for(lambda: session_leases(dsn) == [], within=3)


async def test_a_long_poll_on_one_replica_wakes_for_a_reply_made_on_the_other(
    pair: list[Replica],
) -> None:
    a, b = pair
    b.client.cursors["c3"] = await b.runner.last_reply_seq("http", "c3")
    poll = asyncio.create_task(b.client.poll("c3", wait=20))
    await wait_for(lambda: "c3" in b.runner.adapters["http"]._waiters)  # B's poll waits
    started = time.monotonic()
    await a.client.post("c3", "wake the other one")
    replies = await asyncio.wait_for(poll, 10)
    # Woken by A's NOTIFY, not by the end of its 20 s wait.
    assert time.monotonic() - started < 3
    assert [m["text"] for m in replies] == ["bot: wake the other one"]


async def test_a_turn_taken_over_three_times_suspends_its_session_with_one_notice(
    pair: list[Replica], dsn: str
) -> None:
    """The stuck-loop guard across replicas: a marker already resumed twice elsewhere is
    not run a third time (it may be what killed them); the user is told once."""
    a, b = pair
    key = "agent:main:http:dm:c4"
    await a.client.post("c4", "hang forever")
    await wait_for(lambda: a.runner.is_busy(key))
    # As if two replicas had died running it: counted in the marker, and A's lease gone.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE turns SET event = jsonb_set(event::jsonb, '{takeovers}', '2')::text"
            " WHERE session_key = %s",
            (key,),
        )
        conn.execute("UPDATE leases SET expires_at = 0 WHERE name = %s", (f"session:{key}",))
    (notice,) = await b.client.replies("c4", 1, within=10)
    assert notice == stuck_notice([{"text": "hang forever"}])
    assert '"hang forever"' in notice and "/retry" in notice
    entry = await b.runner.store.get_entry(key)
    assert entry is not None and entry.suspended
    with psycopg.connect(dsn) as conn:
        assert conn.execute(
            "SELECT count(*) FROM turns WHERE session_key = %s", (key,)
        ).fetchone() == (0,)
    # Its marker set aside, no replica can take the turn over again: the ledger's one
    # notice is all the user ever gets.
    assert ledger_texts(dsn, "c4") == [notice]


async def test_a_takeover_of_a_turn_that_only_waited_does_not_count_against_it(
    pair: list[Replica], dsn: str
) -> None:
    """A replica that died before the turn it held began (its marker not `running`:
    waiting behind another turn or for a slot, or resumed and not reached yet) is no
    evidence against the turn: taken over again, it runs, its count unchanged."""
    a, b = pair
    key = "agent:main:http:dm:c5"
    await a.client.post("c5", "hang for a while")
    await wait_for(lambda: a.runner.is_busy(key))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE turns SET event = jsonb_set(event::jsonb, '{takeovers}', '2')::text,"
            " running = 0 WHERE session_key = %s",
            (key,),
        )
        conn.execute("UPDATE leases SET expires_at = 0 WHERE name = %s", (f"session:{key}",))
    await wait_for(lambda: b.runner.is_busy(key), within=10)  # resumed, not set aside

    def marker() -> tuple[str, int] | None:
        with psycopg.connect(dsn) as conn:
            return conn.execute(
                "SELECT event::jsonb ->> 'takeovers', running FROM turns WHERE session_key = %s",
                (key,),
            ).fetchone()

    # B reached the turn's agent slot: running again, and the takeover not counted.
    await wait_for(lambda: marker() == ("2", 1), within=10)
    # Resumed, not set aside (that drops the marker): no stuck notice is recorded.
    assert ledger_texts(dsn, "c5") == []
    entry = await b.runner.store.get_entry(key)
    assert entry is not None and not entry.suspended
