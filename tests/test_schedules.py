"""Scheduled jobs through the real runner: /schedule and /sethome in chat, the
schedule tools through the fake model, runs in their own session delivered through the
ledger, pausing after failures, /status and /metrics, deleting a user's data.

The real runner with the real HTTP adapter and store, short schedules (`in 1s`, `every
1s` with a test-only `schedules.min_interval`). The daemon as a subprocess (the CLI,
kill -9) is tests/test_schedules_daemon.py; calendars and downtime at unit level are
tests/test_schedule_cadence.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from adapters.http import HttpAdapter
from config import TOOL_NAMES, GatewayConfig, HttpConfig
from gateway.agents.protocol import AgentError, TurnRequest, TurnResult
from gateway.ops.doctor import Paths, run_checks
from gateway.run import GatewayRunner
from gateway.schedules.cadence import Cadence
from gateway.session import SessionSource, schedule_session_key
from gateway.store import codec
from gateway.store import schedules as rows
from gateway.store.pg.dialect import translate
from tests.fakes.openai_server import FakeOpenAI, serve_in_a_thread, tool_calls, tool_results
from tests.gateway_client import GatewayClient, RunningGateway
from tests.pg_support import StorageBackend
from tests.scanning import pg_tables_holding, tables_holding
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

ID = re.compile(r"sch_[0-9a-f]{8}")


@dataclass
class Gateway(RunningGateway):
    home: Path = field(kw_only=True)
    backend: StorageBackend = field(kw_only=True)

    async def schedule(self, text: str, chat: str = "c1", user: str = "u1") -> str:
        reply = await self.say(f"/schedule add {text}", chat, user)
        found = ID.search(reply)
        assert found is not None and reply.startswith("Scheduled"), reply
        return found.group(0)

    async def runs(self, schedule_id: str) -> list[dict[str, Any]]:
        return await self.runner.store.read(lambda conn: rows.runs(conn, schedule_id, 100))

    async def row(self, schedule_id: str) -> dict[str, Any] | None:
        return await self.runner.store.read(lambda conn: rows.get(conn, schedule_id))

    async def fire_marker(self, chat: str = "marker", when: str = "in 2s") -> None:
        """Schedule a one-shot marker in a chat of its own and wait until it ran. The
        scheduler fires due schedules in passes, in `next_run_at` order, and records a run
        when it claims the fire: once the marker ran, every fire due before it has a row
        in the run history (or never comes)."""
        marker = await self.schedule(f"{when} marker", chat=chat)
        (reply,) = await self.client.replies(chat, 1, within=15)
        assert "marker" in reply, reply
        await wait_for(lambda: _settled(self, marker))

    async def sent_after_stop(self, chat: str) -> list[str]:
        """Stop the gateway (stopping drains every turn), then read the replies the ledger
        (`outbound`) holds for `chat`: every reply it ever sends there, a duplicate too."""
        await self.stop()
        sql = "SELECT text FROM outbound WHERE chat_id = ? ORDER BY id"
        if self.backend.postgres:
            with psycopg.connect(self.backend.dsn or "") as pg:
                return [text for (text,) in pg.execute(translate(sql).sql, (chat,))]
        conn = sqlite3.connect(self.home / "sessions" / "state.db")
        try:
            return [text for (text,) in conn.execute(sql, (chat,))]
        finally:
            conn.close()


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[MakeGateway]:
    """Gateways on the backend under test (`store_backend`; on PostgreSQL a replica,
    whose scheduler runs once it leads housekeeping)."""
    made: list[Gateway] = []

    async def make(
        agent: dict[str, Any] | None = None,
        agent_factory: Any = None,
        home: Path | None = None,
        **settings: Any,
    ) -> Gateway:
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "platforms": {"http": {"enabled": True, "port": 0}},
                "agent": agent or {"backend": "echo"},
                "schedules": {"min_interval": 1},
                **settings,
            }
        )
        config = store_backend.apply(config)
        adapter = HttpAdapter(config.platforms.http)
        home = home or tmp_path / f"home{len(made)}"
        runner = GatewayRunner(config, [adapter], agent_factory=agent_factory, home=home)
        await runner.start()
        gateway = Gateway(runner, GatewayClient(adapter.url), home=home, backend=store_backend)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


# --- /schedule ---------------------------------------------------------------------------------


async def test_an_in_1s_reminder_is_delivered_once_in_its_own_session(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway()
    schedule_id = await gw.schedule("in 1s water the plants")
    (reply,) = await gw.client.replies("c1", 1, within=10)
    assert reply.startswith("echo: [Scheduled task") and "water the plants" in reply
    await wait_for(lambda: _settled(gw, schedule_id))
    runs = await gw.runs(schedule_id)
    assert [r["status"] for r in runs] == ["ok"]
    assert "water the plants" in runs[0]["output_summary"]
    # Done, with no next fire time: the scheduler never fires it again.
    row = await gw.row(schedule_id)
    assert row is not None and row["status"] == "done" and row["next_run_at"] is None
    # Its own session, never the chat's: the chat's transcript has only the command.
    key = schedule_session_key("main", schedule_id)
    assert await gw.runner.store.get_entry(key) is not None
    listed = await gw.say("/schedule list")
    assert schedule_id in listed and "[done]" in listed
    # Delivered once: no second copy of the run's reply in the ledger.
    sent = await gw.sent_after_stop("c1")
    assert sent[1:] == [reply, listed] and sent[0].startswith(f"Scheduled {schedule_id}")


async def test_an_every_schedule_fires_each_period_and_keeps_its_context(
    make_gateway: MakeGateway,
) -> None:
    seen: list[TurnRequest] = []

    class Recorder:
        def __init__(self, session_key: str) -> None:
            pass

        async def run_turn(self, request: TurnRequest) -> TurnResult:
            if request.text.endswith("] marker"):
                return TurnResult("marker")
            seen.append(request)
            return TurnResult(f"tick {len(seen)}")

        async def close(self) -> None:
            pass

    gw = await make_gateway(agent_factory=Recorder)
    schedule_id = await gw.schedule("every 1s count")
    replies = await gw.client.replies("c1", 3, within=10)
    assert replies == ["tick 1", "tick 2", "tick 3"]
    assert await gw.say(f"/schedule pause {schedule_id}") == (
        f"Paused {schedule_id}; /schedule resume {schedule_id} starts it again."
    )
    fired = len(seen)
    # Due two periods after the pause: a schedule still firing would run twice before it.
    await gw.fire_marker()
    # At most the run that was starting when it paused.
    assert len(await gw.runs(schedule_id)) <= fired + 1 and len(seen) <= fired + 1
    assert [m["text"] for m in await gw.client.poll("c1")] in ([], [f"tick {fired}"])
    # One session for every run: the third run saw the first two in its history.
    key = schedule_session_key("main", schedule_id)
    assert {r.session_key for r in seen} == {key}
    assert [m["content"] for m in seen[2].history if m["role"] == "assistant"] == [
        "tick 1",
        "tick 2",
    ]
    fire_times = [r["fire_time"] for r in await gw.runs(schedule_id)]
    assert len(set(fire_times)) == len(fire_times)  # one run per fire time
    gaps = [a - b for a, b in itertools.pairwise(fire_times)]
    assert all(0.99 <= gap <= 1.01 for gap in gaps), gaps
    resumed = await gw.say(f"/schedule resume {schedule_id}")
    assert resumed.startswith(f"Resumed {schedule_id}; next run")
    assert (await gw.client.replies("c1", 1, within=5))[0].startswith("tick")


async def test_schedule_validation_names_what_is_wrong(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(schedules={"min_interval": 300, "max_per_user": 2})
    assert "is in the past" in await gw.say("/schedule add at 2001-01-01 09:00 too late")
    bad_cron = await gw.say('/schedule add "61 * * * *" nope')
    assert "cannot read the cron expression '61 * * * *'" in bad_cron
    assert "higher than the maximum value (59)" in bad_cron
    short = await gw.say("/schedule add every 1m too often")
    assert "repeats every 1m; the shortest interval allowed is 5m (schedules.min_interval)" in (
        short
    )
    minutely = await gw.say('/schedule add "* * * * *" too often')
    assert "repeats every 1m" in minutely
    assert "give a whole number and a unit" in await gw.say("/schedule add in 5x hi")
    assert "WHEN must start with" in await gw.say("/schedule add tomorrow hi")
    assert "say what to do" in await gw.say("/schedule add in 5m")
    # One-shot times have no minimum.
    await gw.schedule("in 30s soon")
    await gw.schedule("every 5m fine")
    too_many = await gw.say("/schedule add in 1h third")
    assert "you have 2 schedules, the most allowed (schedules.max_per_user: 2)" in too_many
    # Another user's count is their own.
    await gw.schedule("in 1h theirs", chat="c2", user="u2")
    assert "no schedule 'sch_00000000'" in await gw.say("/schedule remove sch_00000000")


async def test_spelled_out_units_are_read_whole(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    made: dict[str, tuple[str, str]] = {
        "every 6 months renew passport": ("every 6 months", "renew passport"),
        "in 30 minutes call mum": ("once", "call mum"),
        "every 2 hours stretch": ("every 2h", "stretch"),
        "in 2 days pay rent": ("once", "pay rent"),
    }
    for text, (cadence, prompt) in made.items():
        before = time.time()
        row = await gw.row(await gw.schedule(text))
        assert row is not None and row["prompt"] == prompt
        assert Cadence.from_json(row["cadence"]).describe() == cadence
        assert row["next_run_at"] - before > {"call mum": 1790, "pay rent": 2 * 86400 - 10}.get(
            prompt, 7190
        )
    refused = await gw.say("/schedule add in 30 minuets call mum")
    assert refused.startswith("Not scheduled: in '30 minuets': give a whole number and a unit")
    assert "units: s/sec/seconds, m/min/minutes, h/hr/hours" in refused
    assert len(await gw.runner.schedule_book.list(None)) == len(made)


@pytest.mark.parametrize("limit", [HttpConfig().max_body_bytes, 256 * 1024])
async def test_a_cron_list_in_the_largest_body_is_refused_without_stalling_the_loop(
    make_gateway: MakeGateway, limit: int
) -> None:
    """A /schedule add message as large as the HTTP API accepts (the default limit, and a
    raised one), its cron expression one long list: refused by its size, and the event
    loop never waits on it (APScheduler walks a list item by item, for every fire time
    it looks for)."""
    http = {"enabled": True, "port": 0, "max_body_bytes": limit}
    gw = await make_gateway(platforms={"http": http})
    envelope = {"chat_id": "c1", "user_id": "u1", "text": ""}
    frame = '/schedule add "{} * * * *" hi'
    room = limit - len(json.dumps({**envelope, "text": frame.format("")}).encode())
    cron_list = ",".join(str(i % 60) for i in range(room))[:room].rstrip(",")
    body = json.dumps({**envelope, "text": frame.format(cron_list)}).encode()
    assert limit - 1 <= len(body) <= limit
    stalls: list[float] = []

    async def probe() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            stalls.append(time.perf_counter() - started - 0.005)

    probing = asyncio.create_task(probe())
    try:
        async with gw.client.session.post(
            f"{gw.client.url}/v1/messages",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            assert resp.status == 202, await resp.text()
        reply = (await gw.client.replies("c1", 1, within=60))[0]
        sampled = len(stalls)
        await wait_for(lambda: len(stalls) >= sampled + 2)  # each stall measured to its end
    finally:
        probing.cancel()
    assert max(stalls) < 1.0, f"the event loop stalled {max(stalls):.2f} s"
    assert reply.startswith("Not scheduled: WHEN is ")
    assert "at most 100 characters and 24 comma-separated items per field" in reply
    assert len(reply) < 400  # the expression is not echoed back
    assert await gw.runner.schedule_book.list(None) == []


async def test_at_a_time_replies_with_the_next_fire_in_the_schedules_zone(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway(timezone="Europe/Berlin")
    reply = await gw.say("/schedule add at 2099-12-01 09:00 plan the year")
    assert "next run 2099-12-01 09:00 CET" in reply
    cron = await gw.say('/schedule add "0 9 * * 1-5" standup')
    assert "cron 0 9 * * 1-5 (Europe/Berlin)" in cron and " 09:00 CE" in cron


async def test_users_see_and_change_only_their_own_schedules(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    mine = await gw.schedule("in 1h mine")
    theirs = await gw.schedule("in 1h theirs", chat="c2", user="u2")
    listed = await gw.say("/schedule list")
    assert mine in listed and theirs not in listed
    assert "no schedule" in await gw.say(f"/schedule remove {theirs}")
    assert "no schedule" in await gw.say(f"/schedule runs {theirs}")
    assert await gw.row(theirs) is not None
    assert await gw.say(f"/schedule remove {mine}") == f"Removed {mine} and its run history."
    assert await gw.row(mine) is None
    assert (await gw.say("/schedule list")).startswith("No schedules")


async def test_removing_a_schedule_deletes_its_runs_and_session(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    schedule_id = await gw.schedule("in 1s once")
    await gw.client.replies("c1", 1, within=10)
    await wait_for(lambda: _settled(gw, schedule_id))
    key = schedule_session_key("main", schedule_id)
    assert await gw.runner.store.get_entry(key) is not None
    await gw.say(f"/schedule remove {schedule_id}")
    assert await gw.runs(schedule_id) == []
    assert await _sessions_of(gw, key) == 0


async def _sessions_of(gw: Gateway, key: str) -> int:
    return await gw.runner.store.read(
        lambda conn: conn.execute(
            "SELECT count(*) FROM sessions WHERE session_key = ?", (key,)
        ).fetchone()[0]
    )


async def _settled(gw: Gateway, schedule_id: str) -> bool:
    runs = await gw.runs(schedule_id)
    return bool(runs) and all(r["status"] != "running" for r in runs)


async def test_run_now_and_the_run_history(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    schedule_id = await gw.schedule("every 1h report")
    assert "has not run yet; next run" in await gw.say(f"/schedule runs {schedule_id}")
    await gw.client.post("c1", f"/schedule run {schedule_id}")
    replies = await gw.client.replies("c1", 2, within=10)
    assert f"Running {schedule_id} now." in replies
    assert any("report" in r and r.startswith("echo:") for r in replies)
    await wait_for(lambda: _settled(gw, schedule_id))
    history = await gw.say(f"/schedule runs {schedule_id}")
    assert history.startswith(f"Last 1 runs of {schedule_id}") and " ok " in history
    row = await gw.row(schedule_id)
    assert row is not None and row["status"] == "active" and row["next_run_at"] is not None


async def test_three_failures_in_a_row_pause_with_a_notice(make_gateway: MakeGateway) -> None:
    class Failing:
        def __init__(self, session_key: str) -> None:
            pass

        async def run_turn(self, request: TurnRequest) -> TurnResult:
            if request.text.endswith("] marker"):
                return TurnResult("marker")
            raise AgentError("the model is down")

        async def close(self) -> None:
            pass

    gw = await make_gateway(agent_factory=Failing)
    schedule_id = await gw.schedule("every 1s doomed")
    replies = await gw.client.replies("c1", 3, within=10)
    assert all("the model is down" in r for r in replies)
    assert f"failed 3 times in a row and is paused; /schedule resume {schedule_id}" in replies[2]
    # Due two periods later: a schedule still firing would run twice before it.
    await gw.fire_marker()
    assert await gw.client.poll("c1") == []
    row = await gw.row(schedule_id)
    assert row is not None and row["status"] == "paused" and row["consecutive_failures"] == 3
    assert [r["status"] for r in await gw.runs(schedule_id)] == ["failed"] * 3
    metrics = await _metrics(gw)
    assert metrics['hermes_schedule_runs_total{status="failed"}'] == 3


async def _metrics(gw: Gateway) -> dict[str, float]:
    async with gw.client.session.get(f"{gw.client.url}/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_status_and_metrics_show_schedules(make_gateway: MakeGateway) -> None:
    gw = await make_gateway()
    await gw.say("hello")
    schedule_id = await gw.schedule("in 1h later")
    status = await gw.say("/status")
    assert f"Next scheduled: {schedule_id} at " in status
    await wait_for(lambda: gw.runner.scheduler.next_fire is not None)
    snapshot = gw.runner.status_snapshot()
    assert snapshot["next_schedule"]["schedule_id"] == schedule_id
    await gw.schedule("in 1s now")
    await gw.client.replies("c1", 1, within=10)
    await wait_for(lambda: gw.runner.metrics.schedule_runs["ok"] == 1)
    metrics = await _metrics(gw)
    assert metrics['hermes_schedule_runs_total{status="ok"}'] == 1
    assert metrics["hermes_schedule_fire_delay_seconds_count"] == 1
    assert metrics["hermes_schedule_fire_delay_seconds_sum"] < 1.5


# --- /sethome -------------------------------------------------------------------------------


async def test_sethome_takes_deliveries_made_for_the_home_channel(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway()
    assert (await gw.say("/sethome", chat="home-room")).startswith(
        "This chat is now the home channel on http"
    )
    await gw.schedule("--home in 1s to the home room")
    (reply,) = await gw.client.replies("home-room", 1, within=10)
    assert "to the home room" in reply
    # The run's turn drained: the chat that made it got the acknowledgement only.
    (ack,) = await gw.sent_after_stop("c1")
    assert ack.startswith("Scheduled sch_")


async def test_sethome_is_for_admins_when_admins_are_set(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(admins=["http:boss"])
    assert (await gw.say("/sethome")).startswith("Only an admin")
    assert (await gw.say("/sethome", user="boss")).startswith("This chat is now")


async def test_a_home_delivery_without_a_home_channel_is_refused(
    make_gateway: MakeGateway,
) -> None:
    gw = await make_gateway(platforms={"http": {"enabled": True, "port": 0}})
    refused = await gw.say("/schedule add --home in 1s nowhere to go")
    assert refused == (
        "Not scheduled: http has no home channel: /sethome in the chat that should get the"
        " runs, or set platforms.http.home_channel"
    )
    misspelt = await gw.say("/schedule add --homeroom in 1s x")
    assert misspelt.startswith('Not scheduled: WHEN must start with "in"')
    assert await gw.runner.schedule_book.list(None) == []


async def test_a_schedule_with_nowhere_to_deliver_is_recorded_undeliverable(
    make_gateway: MakeGateway, tmp_path: Path, store_backend: StorageBackend
) -> None:
    """Made while its platform was enabled (or its home channel set), due after that
    changed: nothing runs, each fire time is `undeliverable`, a warning says so, no
    reply waits in the ledger, and `doctor` names it."""
    home = tmp_path / "gone"
    gw = await make_gateway(home=home)
    to_telegram = await gw.schedule("every 1h telegram digest")
    to_home = await gw.schedule("every 1h home digest")
    await gw.stop()
    telegram = {"platform": "telegram", "chat_id": "55", "chat_type": "dm"}
    soon = time.time() + 1
    _rewrite(
        store_backend,
        home,
        "UPDATE schedules SET platform = 'telegram', chat_id = '55', target = ?,"
        " next_run_at = ? WHERE schedule_id = ?",
        codec.dumps(SessionSource.from_dict(telegram).to_dict()),
        soon,
        to_telegram,
    )
    _rewrite(
        store_backend,
        home,
        "UPDATE schedules SET deliver = 'home', next_run_at = ? WHERE schedule_id = ?",
        soon,
        to_home,
    )
    with capture_logs() as logs:
        gw = await make_gateway(home=home)
        for schedule_id in (to_telegram, to_home):
            await wait_for(lambda schedule_id=schedule_id: _settled(gw, schedule_id), within=10)
    (telegram_run,) = await gw.runs(to_telegram)
    (home_run,) = await gw.runs(to_home)
    assert telegram_run["status"] == "undeliverable" == home_run["status"]
    assert "telegram is not enabled in this gateway" in telegram_run["output_summary"]
    assert "no home channel on http" in home_run["output_summary"]
    warned = [e for e in logs if e["event"] == "schedule_undeliverable"]
    assert {e["schedule_id"] for e in warned} == {to_telegram, to_home}
    assert all(e["log_level"] == "warning" for e in warned)
    assert gw.runner.metrics.schedule_runs["undeliverable"] == 2
    for schedule_id in (to_telegram, to_home):  # no turn ran: no session, no reply
        assert await _sessions_of(gw, schedule_session_key("main", schedule_id)) == 0
        row = await gw.row(schedule_id)
        assert row is not None and row["status"] == "active" and row["next_run_at"] > soon
    pending = await gw.runner.store.read(
        lambda conn: conn.execute(
            "SELECT count(*) FROM outbound WHERE state = 'pending'"
        ).fetchone()[0]
    )
    assert pending == 0
    await gw.stop()
    if not store_backend.postgres:
        found = {f.name: f for f in run_checks(Paths.of(home), gw.runner.config)}
        assert found["schedules"].status == "warn"
        assert f"{to_telegram} (telegram not enabled)" in found["schedules"].detail
        assert f"{to_home} (no home channel on http)" in found["schedules"].detail
        assert "2 runs on record were undeliverable" in found["schedules"].detail
        assert found["outbound"].detail.startswith("0 reply chunks pending")


async def test_config_home_channel_is_used_without_sethome(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(platforms={"http": {"enabled": True, "port": 0, "home_channel": "ops"}})
    await gw.schedule("--home in 1s for ops")
    (reply,) = await gw.client.replies("ops", 1, within=10)
    assert "for ops" in reply


# --- the tools --------------------------------------------------------------------------------


def test_the_schedule_tools_are_built_in() -> None:
    assert {"schedule_create", "schedule_list", "schedule_delete"} <= set(TOOL_NAMES)


async def test_the_tool_path_creates_a_schedule_the_list_command_shows(
    make_gateway: MakeGateway,
) -> None:
    with serve_in_a_thread() as (fake, _):
        fake: FakeOpenAI
        agent = {"backend": "openai", "base_url": fake.base_url, "model": "m"}
        gw = await make_gateway(agent=agent)
        fake.script(
            tool_calls(("schedule_create", {"when": "at 09:00", "prompt": "Remind: call Bob"})),
            "I will remind you at 9.",
        )
        assert await gw.say("remind me tomorrow at 9 to call Bob") == "I will remind you at 9."
        (created,) = tool_results(fake.requests[-1]["json"])
        result = created["content"]
        assert result["status"] == "active" and result["cadence"] == "once"
        assert result["next_run_local"].endswith("09:00 UTC")
        listed = await gw.say("/schedule list")
        assert result["id"] in listed and "Remind: call Bob" in listed

        fake.script(tool_calls(("schedule_list", {})), "You have one.")
        await gw.say("what is scheduled?")
        (found,) = tool_results(fake.requests[-1]["json"])
        assert [s["id"] for s in found["content"]["schedules"]] == [result["id"]]

        fake.script(tool_calls(("schedule_delete", {"schedule_id": result["id"]})), "Deleted.")
        assert await gw.say("forget the reminder") == "Deleted."
        assert await gw.row(result["id"]) is None


async def test_the_tool_refusal_is_a_result_for_the_model(make_gateway: MakeGateway) -> None:
    with serve_in_a_thread() as (fake, _):
        agent = {"backend": "openai", "base_url": fake.base_url, "model": "m"}
        gw = await make_gateway(agent=agent)
        home = {"when": "in 1h", "prompt": "digest", "deliver": "home"}
        fake.script(
            tool_calls(
                ("schedule_create", {"when": "at 2001-01-01 09:00", "prompt": "late"}),
                ("schedule_create", home),
            ),
            "That time has passed, and there is no home channel.",
        )
        await gw.say("remind me in 2001, and send a digest to the home channel")
        past, homeless = tool_results(fake.requests[-1]["json"])
        assert "is in the past" in past["content"]["error"]
        assert "http has no home channel" in homeless["content"]["error"]
        assert await gw.runner.schedule_book.list(None) == []


# --- deleting a user's data -------------------------------------------------------------------


async def test_forgetting_a_user_deletes_their_schedules(
    make_gateway: MakeGateway, store_backend: StorageBackend, tmp_path: Path
) -> None:
    """...and every row naming them: their commands' journal rows (sent while their chat
    had no session of its own), their runs' sessions, replies and journal rows."""
    gw = await make_gateway(home=tmp_path)
    mine = await gw.schedule("in 1s once")
    await gw.client.replies("c1", 1, within=10)
    await wait_for(lambda: _settled(gw, mine))
    kept = await gw.schedule("in 1h other user's", chat="c2", user="u2")
    later = await gw.schedule("every 1h still mine")
    await gw.runner.recall.forget_user("http", "u1")
    assert await gw.row(mine) is None and await gw.row(later) is None
    assert await gw.runs(mine) == []
    assert await gw.row(kept) is not None
    key = schedule_session_key("main", mine)
    assert await _sessions_of(gw, key) == 0
    if store_backend.postgres:
        held = pg_tables_holding(store_backend.dsn or "", "u1")
    else:
        held = [t for f in (tmp_path / "sessions").glob("*.db") for t in tables_holding(f, "u1")]
    assert held == []
    assert (await gw.runner.recall.forget_user("http", "u1")).total == 0


# --- after downtime, after a crash -------------------------------------------------------------


def _rewrite(backend: StorageBackend, home: Path, sql: str, *params: Any) -> None:
    """Change the store while no gateway runs on it (what hours of downtime leave)."""
    if backend.postgres:
        with psycopg.connect(backend.dsn or "", autocommit=True) as pg:
            pg.execute(translate(sql).sql, params)
        return
    conn = sqlite3.connect(home / "sessions" / "state.db")
    try:
        conn.execute(sql, params)
        conn.commit()
    finally:
        conn.close()


@pytest.mark.parametrize("catch_up", ["once", "skip"])
async def test_three_hours_down_with_an_hourly_schedule(
    make_gateway: MakeGateway, tmp_path: Path, catch_up: str, store_backend: StorageBackend
) -> None:
    home = tmp_path / "down"
    gw = await make_gateway(home=home)
    schedule_id = await gw.schedule("every 1h hourly digest")
    await gw.stop()
    # It last fired at 09:00 and the gateway went down at 09:05; it is 12:10 now: 10:00
    # and 11:00 are past their grace (30 min), 12:00 is 10 minutes late.
    now = time.time()
    anchor = now - 3 * 3600 - 600
    cadence = Cadence("interval", "UTC", seconds=3600, anchor=anchor)
    _rewrite(
        store_backend,
        home,
        "UPDATE schedules SET cadence = ?, next_run_at = ? WHERE schedule_id = ?",
        cadence.to_json(),
        anchor + 3600,
        schedule_id,
    )
    gw = await make_gateway(home=home, schedules={"min_interval": 1, "catch_up": catch_up})
    expected = 3 if catch_up == "once" else 2  # the first gateway's /schedule reply, too
    # On PostgreSQL the scheduler runs on the leader: a loaded machine may take the
    # lease's whole ttl to hand it over when the stopped gateway could not release it.
    replies = await gw.client.replies("c1", expected, within=30)
    assert replies[0].startswith(f"Scheduled {schedule_id}")
    await wait_for(lambda: _settled(gw, schedule_id))
    runs = await gw.runs(schedule_id)
    row = await gw.row(schedule_id)
    # Next due in an hour; its turn drained: the ledger holds no reply beyond these.
    assert await gw.sent_after_stop("c1") == replies
    replies.pop(0)
    missed_line = [r for r in replies if "missed" in r]
    assert len(missed_line) == 1
    if catch_up == "once":
        assert "missed 2 runs due" in missed_line[0]
        assert sorted(r["status"] for r in runs) == ["missed", "ok"]
        (ran,) = [r for r in runs if r["status"] == "ok"]
        assert ran["fire_time"] == pytest.approx(anchor + 3 * 3600)
        assert any("hourly digest" in r and r.startswith("echo:") for r in replies)
    else:
        assert "missed 3 runs due" in missed_line[0]
        assert [r["status"] for r in runs] == ["missed"]
    assert row is not None and row["next_run_at"] == pytest.approx(anchor + 4 * 3600)


async def test_a_claimed_run_whose_turn_is_gone_is_recorded_interrupted(
    make_gateway: MakeGateway, tmp_path: Path, store_backend: StorageBackend
) -> None:
    home = tmp_path / "crashed"
    gw = await make_gateway(home=home)
    schedule_id = await gw.schedule("every 1h nightly job")
    await gw.stop()
    # A run claimed before a crash, whose turn marker the stuck-loop guard then dropped.
    fire = time.time() - 60
    _rewrite(
        store_backend,
        home,
        "INSERT INTO schedule_runs (schedule_id, fire_time, status, started_at)"
        " VALUES (?, ?, 'running', ?)",
        schedule_id,
        fire,
        fire,
    )
    gw = await make_gateway(home=home)
    ack, notice = await gw.client.replies("c1", 2, within=10)
    assert ack.startswith(f"Scheduled {schedule_id}")
    assert notice.startswith(f"Scheduled task {schedule_id} was interrupted by a restart")
    (run,) = await gw.runs(schedule_id)
    assert run["status"] == "interrupted"
    assert gw.runner.metrics.schedule_runs["interrupted"] == 1
    row = await gw.row(schedule_id)
    assert row is not None and row["status"] == "active"  # a recurring job goes on
    # Next due in an hour, and the interrupted run not run again: no reply beyond these.
    assert await gw.sent_after_stop("c1") == [ack, notice]


async def test_a_stored_cron_beyond_the_bounds_is_paused_not_retried(
    make_gateway: MakeGateway, tmp_path: Path, store_backend: StorageBackend
) -> None:
    """A cron expression stored before the size checks (a 30-item list): paused with a
    warning at its fire time, once, and `resume` says why it cannot run."""
    home = tmp_path / "old"
    gw = await make_gateway(home=home)
    schedule_id = await gw.schedule('"0 9 * * *" old digest')
    await gw.stop()
    legacy = Cadence("cron", "UTC", cron=",".join(map(str, range(30))) + " 9 * * *")
    _rewrite(
        store_backend,
        home,
        "UPDATE schedules SET cadence = ?, next_run_at = ? WHERE schedule_id = ?",
        legacy.to_json(),
        time.time() + 0.5,
        schedule_id,
    )
    with capture_logs() as logs:
        gw = await make_gateway(home=home)
        await wait_for(lambda: _status_is(gw, schedule_id, "paused"), within=10)
    assert [e["schedule_id"] for e in logs if e["event"] == "schedule_unreadable"] == [schedule_id]
    assert await gw.runs(schedule_id) == []
    (ack,) = await gw.client.replies("c1", 1)  # the first gateway's /schedule reply
    assert ack.startswith(f"Scheduled {schedule_id}")
    refused = await gw.say(f"/schedule resume {schedule_id}")
    assert refused.startswith(f"Not done: {schedule_id} cannot run again: ")
    assert "the minute field lists 30 items" in refused


async def _status_is(gw: Gateway, schedule_id: str, status: str) -> bool:
    row = await gw.row(schedule_id)
    return row is not None and row["status"] == status


async def test_run_history_is_pruned_to_keep_runs(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(schedules={"min_interval": 1, "keep_runs": 3})
    schedule_id = await gw.schedule("every 1s prune me")
    await gw.client.replies("c1", 5, within=10)
    await gw.say(f"/schedule pause {schedule_id}")
    await wait_for(lambda: _settled(gw, schedule_id))
    runs = await gw.runs(schedule_id)
    assert len(runs) == 3
    assert runs == sorted(runs, key=lambda r: -r["fire_time"])  # the newest kept
