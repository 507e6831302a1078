"""The tool-call journal (gateway/store/tool_calls.py, gateway/tools/call_journal.py) and
the resume rules of `TurnTools`, on a real store of each backend (`store_backend`).

A crash is played in-process by cancelling a turn's task while a call runs (its row then
says "in flight", as after kill -9), and the resumed turn is a new `TurnTools` on the
same turn with `resumed=True`, as the runner builds it after a restart. The kill -9 of
a real daemon is tests/test_tool_crash.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import Platform, SessionSource
from gateway.store import purge
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.approval import ApprovalRequest, Verdict
from gateway.tools.registry import INTERRUPTED, Tool, Toolbox, TurnScope, TurnTools
from tests.pg_support import StorageBackend

pytestmark = pytest.mark.timeout(30)

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = 0


@dataclass
class World:
    """What the test tools did: each run, and an event a run may wait on (a call that is
    in flight until the test cancels it)."""

    runs: list[tuple[str, int]] = field(default_factory=list)
    hold: asyncio.Event | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    def tools(self) -> list[Tool]:
        async def effect(scope: TurnScope, args: Args) -> dict[str, Any]:
            return await self._run("effect", args)

        async def peek(scope: TurnScope, args: Args) -> dict[str, Any]:
            return await self._run("peek", args)

        return [
            Tool("effect", "a side effect", Args, effect),
            Tool("peek", "only reads", Args, peek, read_only=True),
            Tool("gated", "needs a yes", Args, effect, approve=True),
        ]

    async def _run(self, name: str, args: Args) -> dict[str, Any]:
        self.runs.append((name, args.n))
        self.started.set()
        if self.hold is not None:
            await self.hold.wait()
        return {"did": name, "n": args.n}


class Gate:
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.asked: list[ApprovalRequest] = []

    async def ask(self, request: ApprovalRequest) -> Verdict:
        self.asked.append(request)
        return self.verdict


@pytest.fixture
async def store(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[SessionStore]:
    async with SessionStore(tmp_path / "sessions", store_backend.apply(CONFIG)) as opened:
        yield opened


@pytest.fixture
async def turn(store: SessionStore) -> tuple[TurnLog, str, TurnStart, MessageEvent]:
    log = TurnLog(store)
    key = store.session_key_for(SOURCE)
    event = MessageEvent(source=SOURCE, text="do it", message_id="m1")
    return log, key, await log.begin(event, key, "do it"), event


def bind(
    store: SessionStore,
    turn: tuple[TurnLog, str, TurnStart, MessageEvent],
    world: World,
    *,
    resumed: bool = False,
    gate: Gate | None = None,
    tools: list[Tool] | None = None,
) -> TurnTools:
    _, key, start, _ = turn
    box_tools = tools if tools is not None else world.tools()
    box = Toolbox(box_tools, [tool.name for tool in box_tools])
    return box.bind(
        TurnScope(
            store,
            None,
            key,
            start.entry.session_id,
            SOURCE,
            "main",
            user_row=start.user_row,
            resumed=resumed,
            approvals=gate,
        )
    )


def call(name: str, n: int = 0, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or f"call_{name}_{n}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps({"n": n})},
    }


def results(messages: list[dict[str, Any]]) -> list[Any]:
    return [json.loads(m["content"]) for m in messages if m["role"] == "tool"]


async def journal_rows(store: SessionStore) -> list[tuple[Any, ...]]:
    return await store.read(
        lambda conn: conn.execute(
            "SELECT seq, kind, call_id, tool, result FROM tool_calls ORDER BY seq"
        ).fetchall()
    )


async def crash_mid_call(tools: TurnTools, world: World, calls: list[dict[str, Any]]) -> None:
    """Run a round until its first call is running, then stop it there as a crash would."""
    world.hold = asyncio.Event()
    task = asyncio.create_task(tools.run_round("working on it", calls))
    await asyncio.wait_for(world.started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    world.hold = None


async def test_a_recorded_round_is_replayed_as_it_was_and_not_run_again(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    first = await bind(store, turn, world).run_round("on it", [call("effect", 1), call("peek")])
    assert world.runs == [("effect", 1), ("peek", 0)]
    assert [row[1] for row in await journal_rows(store)] == ["round", "call", "call"]

    replayed = await bind(store, turn, world, resumed=True).resume()
    assert replayed == first
    assert world.runs == [("effect", 1), ("peek", 0)]  # neither ran again, read-only or not


async def test_a_side_effect_in_flight_at_the_crash_is_answered_interrupted_not_run(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    await crash_mid_call(bind(store, turn, world), world, [call("effect", 7)])
    assert [row[4] for row in await journal_rows(store)] == [None, None]  # round, in flight

    replayed = await bind(store, turn, world, resumed=True).resume()
    assert results(replayed) == [{"error": INTERRUPTED}]
    assert world.runs == [("effect", 7)]
    # The answer is recorded: a second restart replays it, still without running.
    again = await bind(store, turn, world, resumed=True).resume()
    assert again == replayed and world.runs == [("effect", 7)]


async def test_a_read_only_call_in_flight_at_the_crash_runs_again(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    await crash_mid_call(bind(store, turn, world), world, [call("peek", 3)])
    replayed = await bind(store, turn, world, resumed=True).resume()
    assert results(replayed) == [{"did": "peek", "n": 3}]
    assert world.runs == [("peek", 3), ("peek", 3)]


async def test_the_calls_of_the_last_round_that_never_started_run_on_resume(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    calls = [call("effect", 1), call("effect", 2)]
    await crash_mid_call(bind(store, turn, world), world, calls)
    replayed = await bind(store, turn, world, resumed=True).resume()
    assert results(replayed) == [{"error": INTERRUPTED}, {"did": "effect", "n": 2}]
    assert world.runs == [("effect", 1), ("effect", 2)]
    assert [m.get("tool_call_id") for m in replayed[1:]] == [c["id"] for c in calls]


@pytest.mark.parametrize(
    ("verdict", "answer"),
    [
        (Verdict.DENIED, {"error": "the user denied this call"}),
        (Verdict.TIMEOUT, {"error": "the user did not answer"}),
    ],
)
async def test_a_refused_call_is_its_recorded_answer_and_is_not_asked_again(
    store: SessionStore, turn: Any, verdict: Verdict, answer: dict[str, str]
) -> None:
    world, gate = World(), Gate(verdict)
    first = await bind(store, turn, world, gate=gate).run_round(None, [call("gated", 5)])
    assert results(first) == [answer]
    assert [(r.tool, r.arguments, r.session_key) for r in gate.asked] == [
        ("gated", {"n": 5}, turn[1])
    ]

    replayed = await bind(store, turn, world, resumed=True, gate=gate).resume()
    assert replayed == first
    assert len(gate.asked) == 1 and world.runs == []


async def test_an_approved_call_is_not_asked_again_after_a_crash(
    store: SessionStore, turn: Any
) -> None:
    world, gate = World(), Gate(Verdict.APPROVED)
    await crash_mid_call(bind(store, turn, world, gate=gate), world, [call("gated", 1)])
    replayed = await bind(store, turn, world, resumed=True, gate=gate).resume()
    assert results(replayed) == [{"error": INTERRUPTED}]
    assert len(gate.asked) == 1 and world.runs == [("effect", 1)]


async def test_without_a_gate_an_approve_tool_is_denied_and_never_runs(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    got = await bind(store, turn, world).run_round(None, [call("gated")])
    assert results(got) == [{"error": "the user denied this call"}] and world.runs == []


async def test_direct_calls_replay_by_their_ordinal_with_the_same_tool_and_arguments(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    tools = bind(store, turn, world)
    assert json.loads(await tools.call("effect", {"n": 1})) == {"did": "effect", "n": 1}
    assert json.loads(await tools.call("effect", {"n": 2})) == {"did": "effect", "n": 2}

    resumed = bind(store, turn, world, resumed=True)
    assert json.loads(await resumed.call("effect", {"n": 1})) == {"did": "effect", "n": 1}
    # The second call differs from the second recorded: it is a new call, and runs.
    assert json.loads(await resumed.call("effect", {"n": 9})) == {"did": "effect", "n": 9}
    assert world.runs == [("effect", 1), ("effect", 2), ("effect", 9)]


async def test_a_recorded_scratchpad_write_is_applied_again_without_a_second_record(
    store: SessionStore, turn: Any
) -> None:
    box_tools = [t for t in BUILTIN_TOOLS if t.name.startswith("scratchpad")]
    world = World()
    write = {
        "id": "w1",
        "type": "function",
        "function": {"name": "scratchpad_write", "arguments": '{"items": ["step one"]}'},
    }
    await bind(store, turn, world, tools=box_tools).run_round(None, [write])
    recorded = await journal_rows(store)

    resumed = bind(store, turn, world, resumed=True, tools=box_tools)
    replayed = await resumed.resume()
    assert results(replayed) == [{"items": 1}]
    assert resumed.scope.pad == ["step one"]  # what the finish will write
    assert await journal_rows(store) == recorded


async def test_the_finish_forgets_the_record_whatever_the_outcome(
    store: SessionStore, turn: Any
) -> None:
    log, key, start, event = turn
    world = World()
    tools = bind(store, turn, world)
    await tools.run_round(None, [call("effect")])
    assert await journal_rows(store)
    await log.finish(
        key, start, event, reply=None, usage=None, chunks=["failed"], settles=tools.settles()
    )
    assert await journal_rows(store) == []


async def test_a_stopped_turn_forgets_its_record(store: SessionStore, turn: Any) -> None:
    log, key, _, event = turn
    await bind(store, turn, World()).run_round(None, [call("effect")])
    await log.abandon(key, list(event.inbox_ids))
    assert await journal_rows(store) == []


async def test_a_fresh_turn_without_calls_writes_and_reads_no_journal(
    store: SessionStore, turn: Any
) -> None:
    tools = bind(store, turn, World())
    reads: list[object] = []
    real_read = store.read

    async def counted(fn: Any) -> Any:
        reads.append(fn)
        return await real_read(fn)

    store.read = counted  # type: ignore[method-assign]
    assert await tools.resume() == []
    assert reads == [] and tools.settles() == []


async def test_a_round_of_invalid_calls_is_recorded_and_replayed_with_their_errors(
    store: SessionStore, turn: Any
) -> None:
    world = World()
    bad = {"id": "b1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}
    tools = bind(store, turn, world)
    first = await tools.run_round(None, [bad, call("effect", n=1)])
    assert [row[1] for row in await journal_rows(store)] == ["round", "call"]
    first_only_bad = await tools.run_round(None, [dict(bad, id="b2")])
    assert [row[1] for row in await journal_rows(store)] == ["round", "call", "round"]

    replayed = await bind(store, turn, world, resumed=True).resume()
    assert replayed == first + first_only_bad
    assert world.runs == [("effect", 1)]


async def test_the_record_goes_with_its_session(store: SessionStore, turn: Any) -> None:
    """Rows a turn left behind (its finish never ran them out) are deleted with the
    session, as everything of it is (gateway.store.purge)."""
    log, key, start, event = turn
    await bind(store, turn, World()).run_round(None, [call("effect")])
    await log.finish(key, start, event, reply="done", usage=None, chunks=["done"])
    assert await journal_rows(store)  # no settles handed to the finish: still there
    session_id = start.entry.session_id
    deleted = await store.write(
        lambda conn: purge.delete_session(conn, session_id, datetime.now(UTC))
    )
    assert deleted is not None and deleted["rows"]["tool_calls"] == 2
    assert await journal_rows(store) == []
