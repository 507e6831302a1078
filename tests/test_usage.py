"""Usage and budgets over the whole gateway, on SQLite and PostgreSQL: every turn's tokens
and cost charged to its user (as the model server reported them, or estimated and marked
so), shown alike by `/usage`, `GET /v1/usage`, `hermes-gateway usage` and the Prometheus
counters; budgets that refuse a turn before its model is called, name the limit and
reset the next day; `turns_per_minute` refusing a burst; two replicas on PostgreSQL that
together let a user past a budget by no more than the turns running; and the real daemon,
killed -9 mid-turn, whose counts still agree with the model server's own tally."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.domain.events import MessageEvent
from gateway.domain.session import Platform, SessionSource
from gateway.run import GatewayRunner
from gateway.store import usage
from scripts.harness import Daemon, parse_metrics
from tests.commandline import cli
from tests.fakes.openai_server import (
    FakeOpenAI,
    last_user_content,
    serve_in_a_thread,
    tool_calls,
)
from tests.gateway_client import GatewayClient, RunningGateway
from tests.pg_support import StorageBackend, fresh_schema

pytestmark = pytest.mark.timeout(120)

PROMPT, COMPLETION = 90, 30  # what the fake model server reports per answer
PRICE = {"input_per_mtok": 2.0, "output_per_mtok": 10.0}
TURN_COST = (PROMPT * 2.0 + COMPLETION * 10.0) / 1e6


class Tally:
    """The model server's own count of what it answered (thread-safe: the daemon tests
    run the server on a thread of its own)."""

    def __init__(self, prompt: int = PROMPT, completion: int = COMPLETION) -> None:
        self.answers = 0
        self.prompt, self.completion = prompt, completion
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.answers += 1
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion}

    @property
    def tokens(self) -> tuple[int, int]:
        return self.answers * self.prompt, self.answers * self.completion


def settings_of(server: FakeOpenAI, **more: Any) -> dict[str, Any]:
    return {
        "timezone": "UTC",
        "models": {"m": {"base_url": server.base_url, "model": "m-1", "price": PRICE}},
        "agent": {"backend": "openai", "model": "m"},
        **more,
    }


@pytest.fixture
async def tallied() -> AsyncIterator[tuple[FakeOpenAI, Tally]]:
    tally = Tally()
    async with FakeOpenAI(usage=tally) as server:
        yield server, tally


async def test_usage_is_charged_per_user_and_shown_alike_everywhere(
    tmp_path: Path, tallied: tuple[FakeOpenAI, Tally], store_backend: StorageBackend
) -> None:
    server, tally = tallied
    settings = settings_of(server, storage=store_backend.storage(), admins=["http:boss"])
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        for text in ("one", "two", "three"):
            assert await gw.say(text) == f"fake: {text}"
        assert await gw.say("four", chat="c2", user="u2") == "fake: four"
        assert tally.answers == 4

        mine = await gw.say("/usage")
        assert "Your usage (http:u1)" in mine, mine
        tokens = 3 * (PROMPT + COMPLETION)
        assert f"3 turns, {tokens} tokens (in {3 * PROMPT}, out {3 * COMPLETION})" in mine
        assert f"${3 * TURN_COST:.4f}" in mine and "Budget: no limits." in mine
        # /usage all is for admins only.
        assert "Only an admin" in await gw.say("/usage all")
        everyone = await gw.say("/usage all", chat="c9", user="boss")
        assert "http:u1: 3 turns" in everyone and "http:u2: 1 turns" in everyone, everyone

        report = await gw.client.get_json("/v1/usage?by=user")
        rows = {row["user"]: row for row in report["rows"]}
        assert rows["http:u1"]["turns"] == 3 and rows["http:u2"]["turns"] == 1
        assert sum(r["input_tokens"] for r in report["rows"]) == tally.tokens[0]
        assert sum(r["output_tokens"] for r in report["rows"]) == tally.tokens[1]
        assert rows["http:u1"]["cost_usd"] == pytest.approx(3 * TURN_COST)
        assert rows["http:u1"]["estimated_turns"] == 0
        by_model = await gw.client.get_json("/v1/usage?by=agent,model&user=http:u2")
        assert by_model["rows"] == [
            {
                "agent": "main",
                "model": "m",
                "turns": 1,
                "input_tokens": PROMPT,
                "output_tokens": COMPLETION,
                "estimated_turns": 0,
                "cost_usd": pytest.approx(TURN_COST),
            }
        ]
        future = await gw.client.get_json("/v1/usage?since=2999-01-01")
        assert future["rows"] == []
        async with gw.client.session.get(f"{gw.client.url}/v1/usage?by=colour") as resp:
            assert resp.status == 400
        async with gw.client.session.get(f"{gw.client.url}/v1/usage?since=yesterday") as resp:
            assert resp.status == 400

        metrics = parse_metrics(await gw.client.get_text("/metrics"))
        label = 'agent="main",direction="input",model="m"'
        assert metrics[f"hermes_model_tokens_total{{{label}}}"] == tally.tokens[0]
        assert metrics['hermes_model_cost_usd_total{agent="main",model="m"}'] == pytest.approx(
            4 * TURN_COST
        )
        # The session's own counters carry the cost too (`/status`, the console).
        entry = await gw.runner.store.get_entry("agent:main:http:dm:c1")
        assert entry is not None and entry.estimated_cost_usd == pytest.approx(3 * TURN_COST)
        status = await gw.say("/status")
        assert "Model: m (m-1)" in status and f", ${3 * TURN_COST:.4f}" in status, status
    finally:
        await gw.stop()
    if store_backend.postgres:
        return
    # The operator's command reads the same rows.
    result = cli(tmp_path / "home", "usage", "--json", "--by", "user")
    assert result.returncode == 0, result.stderr
    rows = {row["user"]: row for row in json.loads(result.stdout)["rows"]}
    assert (rows["http:u1"]["turns"], rows["http:u2"]["turns"]) == (3, 1)
    table = cli(tmp_path / "home", "usage", "--user", "http:u2")
    assert "http:u2" in table.stdout and f"{PROMPT}" in table.stdout, table.stdout
    # Deleting a user's data takes their usage too, and only theirs.
    gone = cli(tmp_path / "home", "memory", "delete", "--user", "http:u1", "--all", "--yes")
    assert gone.returncode == 0, gone.stderr
    result = cli(tmp_path / "home", "usage", "--json", "--by", "user")
    assert [row["user"] for row in json.loads(result.stdout)["rows"]] == ["http:u2"]


async def test_counts_the_backend_does_not_report_are_estimated_and_marked(
    tmp_path: Path,
) -> None:
    async with FakeOpenAI(usage={"prompt_tokens": 0, "completion_tokens": 0}) as server:
        gw = await RunningGateway.started(settings_of(server), tmp_path / "home")
        try:
            assert await gw.say("a question of several words") == (
                "fake: a question of several words"
            )
            (row,) = (await gw.client.get_json("/v1/usage"))["rows"]
        finally:
            await gw.stop()
    assert row["estimated_turns"] == 1 and row["turns"] == 1
    assert row["input_tokens"] > 5 and row["output_tokens"] > 2, row


async def test_a_daily_token_budget_refuses_before_the_model_and_resets_the_next_day(
    tmp_path: Path, tallied: tuple[FakeOpenAI, Tally], store_backend: StorageBackend
) -> None:
    server, tally = tallied
    per_turn = PROMPT + COMPLETION
    settings = settings_of(
        server,
        storage=store_backend.storage(),
        budgets={
            "default": {"tokens_per_day": 2 * per_turn + 1},
            "users": {"http:rich": {"unlimited": True}},
        },
    )
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        assert await gw.say("one") == "fake: one"
        assert await gw.say("two") == "fake: two"
        assert await gw.say("three") == "fake: three"  # 240 used < 241: it may start
        refused = await gw.say("four")
        assert "tokens_per_day" in refused and f"used {3 * per_turn:,} tokens" in refused
        assert "resets at" in refused and "(UTC)" in refused, refused
        assert tally.answers == 3  # the model was not asked
        assert "not answered" in await gw.say("five")
        assert tally.answers == 3
        # An unlimited user is not held to the default.
        assert await gw.say("six", chat="c2", user="rich") == "fake: six"
        shown = await gw.say("/usage")
        assert f"{2 * per_turn + 1:,} tokens a day" in shown, shown
        # The refused messages are not in the transcript: the next turn's history is clean.
        history = [m["content"] for m in server.requests[-1]["json"]["messages"]]
        assert "four" not in history

        # The next day (the budget's clock moved on): turns run again.
        gw.runner.budgets.clock = lambda: time.time() + 86_400
        assert await gw.say("seven") == "fake: seven"
        assert tally.answers == 5
        metrics = parse_metrics(await gw.client.get_text("/metrics"))
        assert metrics['hermes_budget_refusals_total{limit="tokens_per_day"}'] == 2
        # The check itself counts nothing (a begin transaction may run again after a
        # batch failed): a refusal is counted once its turn is answered.
        gw.runner.budgets.clock = time.time
        source = SessionSource(Platform.HTTP, chat_id="c1", user_id="u1")
        event = MessageEvent(source=source, text="eight", message_id="probe-1")
        key = "agent:main:http:dm:c1"
        for _ in range(2):
            refusal = await gw.runner.store.read(
                lambda conn: gw.runner.budgets.gate(conn, key, event)
            )
            assert refusal is not None and refusal.reason == "tokens_per_day", refusal
        metrics = parse_metrics(await gw.client.get_text("/metrics"))
        assert metrics['hermes_budget_refusals_total{limit="tokens_per_day"}'] == 2
    finally:
        await gw.stop()


async def test_turns_per_minute_refuses_a_burst_without_queueing_it(
    tmp_path: Path, tallied: tuple[FakeOpenAI, Tally], store_backend: StorageBackend
) -> None:
    server, tally = tallied
    settings = settings_of(
        server, storage=store_backend.storage(), budgets={"default": {"turns_per_minute": 2}}
    )
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        assert await gw.say("a") == "fake: a"
        assert await gw.say("b", chat="c2") == "fake: b"  # the user's, in another chat
        refused = await gw.say("c")
        assert "2 per minute" in refused and "again in" in refused, refused
        assert tally.answers == 2
        # A minute later (the clock moved on) the user may send again.
        gw.runner.budgets.clock = lambda: time.time() + 61
        assert await gw.say("d") == "fake: d"
        # Another user has a pace of their own.
        assert await gw.say("e", chat="c3", user="u3") == "fake: e"
    finally:
        await gw.stop()


async def test_admins_are_exempt_when_configured(
    tmp_path: Path, tallied: tuple[FakeOpenAI, Tally]
) -> None:
    server, _ = tallied
    settings = settings_of(server, admins=["http:boss"], budgets={"default": {"tokens_per_day": 0}})
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        assert "tokens_per_day" in await gw.say("hello")
        assert await gw.say("hello", chat="c2", user="boss") == "fake: hello"
        assert "admins are exempt" in await gw.say("/usage", chat="c2", user="boss")
    finally:
        await gw.stop()


async def test_a_delegated_turn_is_charged_to_the_user_whose_chat_started_it(
    tmp_path: Path,
) -> None:
    tally = Tally()

    def answer(body: dict[str, Any]) -> str | dict[str, Any]:
        messages = body["messages"]
        if body["model"] == "main-model" and messages[-1]["role"] == "user":
            return tool_calls(("agent_call", {"agent": "helper", "task": "sub task"}))
        return f"{body['model']} says: {messages[-1]['content']}"

    async with FakeOpenAI(reply=answer, usage=tally) as server:
        settings = {
            "timezone": "UTC",
            "agent": {
                "backend": "openai",
                "base_url": server.base_url,
                "model": "main-model",
                "delegates": ["helper"],
            },
            "agents": {
                "helper": {"backend": "openai", "base_url": server.base_url, "model": "h-model"}
            },
        }
        gw = await RunningGateway.started(settings, tmp_path / "home")
        try:
            reply = await gw.say("please delegate")
            assert reply.startswith("main-model says:") and "h-model says" in reply, reply
            report = await gw.client.get_json("/v1/usage?by=user,agent")
        finally:
            await gw.stop()
    rows = {(row["user"], row["agent"]): row for row in report["rows"]}
    assert set(rows) == {("http:u1", "main"), ("http:u1", "helper")}, rows
    # main asked its model twice (the tool round, then the answer); the helper once.
    assert rows["http:u1", "main"]["input_tokens"] == 2 * PROMPT
    assert rows["http:u1", "helper"]["turns"] == 1
    assert tally.answers == 3


# --- two replicas on PostgreSQL ----------------------------------------------------------


async def test_two_replicas_let_a_user_past_a_budget_by_no_more_than_the_turns_running(
    tmp_path: Path,
) -> None:
    budget_turns, chats, per_chat = 5, 4, 5
    tally = Tally(prompt=8, completion=2)
    in_flight = peak = 0

    async def count(body: dict[str, Any]) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)  # long enough for the other replica's turns to overlap
        in_flight -= 1

    with fresh_schema() as dsn:
        async with FakeOpenAI(usage=tally) as server:
            server.on_request = count
            replicas: list[tuple[GatewayRunner, GatewayClient]] = []
            try:
                for i in range(2):
                    config = GatewayConfig.model_validate(
                        settings_of(
                            server,
                            storage={"backend": "postgres", "dsn": dsn},
                            cluster={"failover_seconds": 2},
                            platforms={"http": {"enabled": True, "port": 0}},
                            budgets={"default": {"tokens_per_day": budget_turns * 10}},
                        )
                    )
                    adapter = HttpAdapter(config.platforms.http)
                    runner = GatewayRunner(config, [adapter], home=tmp_path / f"home{i}")
                    await runner.start()
                    replicas.append((runner, GatewayClient(adapter.url)))

                async def hammer(chat: str) -> list[str]:
                    """One chat of the user: each message waits for its answer, and the
                    chat's messages alternate between the replicas."""
                    texts = []
                    for n in range(per_chat):
                        client = replicas[n % 2][1]
                        await client.post(chat, f"{chat}-{n}", user_id="u1")
                        texts += await client.replies(chat, 1, within=30)
                        replicas[(n + 1) % 2][1].cursors[chat] = client.cursors[chat]
                    return texts

                answers = await asyncio.gather(*(hammer(f"c{i}") for i in range(chats)))
                report = await replicas[1][1].get_json("/v1/usage?by=user")
            finally:
                for runner, client in replicas:
                    await client.close()
                    await runner.stop()
    texts = [text for chat in answers for text in chat]
    ran = [t for t in texts if t.startswith("fake: ")]
    refused = [t for t in texts if "tokens_per_day" in t]
    assert len(ran) + len(refused) == chats * per_chat, texts  # each answered once
    assert tally.answers == len(ran)
    # At most the budget plus the turns that were running when it was reached.
    assert budget_turns <= len(ran) <= budget_turns + peak, (len(ran), peak)
    assert peak <= chats
    (row,) = report["rows"]
    assert (row["turns"], row["input_tokens"] + row["output_tokens"]) == (len(ran), 10 * len(ran))


# --- the real daemon, killed mid-turn ----------------------------------------------------


def test_counts_agree_with_the_model_servers_tally_after_a_kill9_mid_turn(
    tmp_path: Path,
) -> None:
    tally = Tally()
    with serve_in_a_thread(usage=tally) as (server, loop):
        held: list[dict[str, Any]] = []

        def first_two(body: dict[str, Any]) -> bool:
            if last_user_content(body) == "two" and not held:
                held.append(body)
                return True
            return False

        asyncio.run_coroutine_threadsafe(_hold(server, first_two), loop).result(5)
        settings = (
            "timezone: UTC\n"
            "models:\n"
            f"  m: {{base_url: '{server.base_url}', model: m-1,"
            " price: {input_per_mtok: 2.0, output_per_mtok: 10.0}}\n"
            "agent: {backend: openai, model: m}\n"
        )
        daemon = Daemon(tmp_path / "home", settings)
        try:
            daemon.start()
            daemon.post("d1", "one")
            daemon.wait_replies("d1", 1)
            daemon.post("d1", "two")
            deadline = time.monotonic() + 20
            while not held and time.monotonic() < deadline:  # the model has it, unanswered
                time.sleep(0.02)
            assert held, "the turn never reached the model"
            daemon.kill9()
            daemon.start()  # resumes the turn: the model is asked again, and answers
            texts = [m["text"] for m in daemon.wait_replies("d1", 2)]
            assert texts == ["fake: one", "fake: two"], texts
            daemon.post("d1", "three")
            daemon.wait_replies("d1", 3)
            report = daemon.get("/v1/usage")
            assert daemon.stop() == 0
        finally:
            daemon.ensure_stopped()
    assert tally.answers == 3
    (row,) = report["rows"]
    assert (row["turns"], row["input_tokens"], row["output_tokens"]) == (3, *tally.tokens)
    assert row["cost_usd"] == pytest.approx(3 * TURN_COST)
    result = cli(tmp_path / "home", "usage", "--json")
    (cli_row,) = json.loads(result.stdout)["rows"]
    assert cli_row == row


async def _hold(server: FakeOpenAI, predicate: Any) -> None:
    server.hold(predicate)  # never released: the held request dies with the daemon


def test_month_ranges_cross_the_year() -> None:
    assert usage.month_range("2026-12-31") == ("2026-12-01", "2027-01-01")
    assert usage.month_range("2026-02-03") == ("2026-02-01", "2026-03-01")
