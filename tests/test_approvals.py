"""Approvals: a tool call that needs the user's yes asks the chat once and waits for
/approve, /deny or the timeout; only the user who started the turn or an admin answers;
/stop ends the wait; the wait does not count against the turn's deadline. And /tools.

The real runner with the real HTTP adapter and store; the model is the fake
OpenAI-compatible server, scripted to call the tool. The tool is the built-in
`scratchpad_write` marked `approve=True`, with its runs counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.domain.session import Platform, SessionSource
from gateway.runner import agent_call
from gateway.runner.approvals import SHOWN_CHARS, SHOWN_LINES, Approvals, shown_arguments
from gateway.runner.deadlines import Deadlines
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.approval import ApprovalRequest, Verdict
from gateway.tools.registry import Tool, Toolbox, TurnScope
from tests.fakes.openai_server import FakeOpenAI, tool_calls, tool_results
from tests.gateway_client import RunningGateway
from tests.waiting import wait_for

KEY = "agent:main:http:dm:c1"
GROUP_KEY = "agent:main:http:group:g1"
TOOL = "scratchpad_write"
ASK = tool_calls((TOOL, {"items": ["launch the rocket"]}))

MakeGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The arguments of every run of the approve-first tool (built into every runner
    made after this fixture)."""
    calls: list[Any] = []
    (original,) = [tool for tool in BUILTIN_TOOLS if tool.name == TOOL]

    async def counted(scope: TurnScope, args: Any) -> Any:
        calls.append(args)
        return await original.run(scope, args)

    guarded: Tool = replace(original, approve=True, run=counted)
    tools = [guarded if tool.name == TOOL else tool for tool in BUILTIN_TOOLS]
    monkeypatch.setattr(agent_call, "BUILTIN_TOOLS", tools)
    return calls


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(check_pairing=True) as server:
        yield server


@pytest.fixture
async def make_gateway(tmp_path: Path, fake: FakeOpenAI) -> AsyncIterator[MakeGateway]:
    made: list[RunningGateway] = []

    async def make(approval_timeout: float = 30.0, **settings: Any) -> RunningGateway:
        agent = {"backend": "openai", "base_url": fake.base_url, "model": "m", "tools": [TOOL]}
        settings = {
            "timezone": "UTC",
            "agent": {**agent, **settings.pop("agent", {})},
            "mcp": {"approval_timeout_seconds": approval_timeout},
            **settings,
        }
        gateway = await RunningGateway.started(settings, tmp_path / "home")
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


async def asked(gw: RunningGateway, text: str = "go", chat: str = "c1", **post: Any) -> str:
    """Post `text`; the one question the tool call puts to the chat."""
    await gw.client.post(chat, text, **post)
    (question,) = await gw.client.replies(chat, 1)
    return question


def results(fake: FakeOpenAI) -> list[Any]:
    """What the model was told each call of the last round gave."""
    return [result["content"] for result in tool_results(fake.requests[-1]["json"])]


async def test_approve_runs_the_call_once_and_the_reply_comes(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway()
    fake.script(ASK, "launched")
    question = await asked(gw)
    assert TOOL in question and "launch the rocket" in question
    assert "/approve" in question and "/deny" in question
    assert runs == [] and gw.runner.is_busy(KEY)  # it waits for the answer
    # The answer reaches the handler while the turn runs: inline, not behind the turn.
    await gw.client.post("c1", "/approve")
    assert await gw.client.replies("c1", 2) == [f"Approved: {TOOL} runs now.", "launched"]
    assert len(runs) == 1 and runs[0].items == ["launch the rocket"]
    assert results(fake) == [{"items": 1}]
    assert gw.runner.approvals.waiting_count() == 0


async def test_deny_never_runs_the_call_and_the_model_gets_the_refusal(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway()
    fake.script(ASK, "understood, not launching")
    await asked(gw)
    await gw.client.post("c1", "/deny")
    assert await gw.client.replies("c1", 2) == [
        f"Denied: {TOOL} does not run.",
        "understood, not launching",
    ]
    assert runs == []
    assert results(fake) == [{"error": "the user denied this call"}]


async def test_no_answer_within_the_timeout_never_runs_the_call(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway(approval_timeout=0.3)
    fake.script(ASK, "no answer, so no launch")
    await asked(gw)
    assert await gw.client.replies("c1", 1) == ["no answer, so no launch"]
    assert runs == []
    assert results(fake) == [{"error": "the user did not answer"}]
    assert await gw.say("/approve") == "Nothing is waiting for approval."


async def test_approve_with_nothing_waiting_says_so_and_changes_nothing(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway()
    assert await gw.say("/approve") == "Nothing is waiting for approval."
    assert await gw.say("/deny") == "Nothing is waiting for approval."
    assert fake.requests == [] and runs == []


async def test_in_a_group_another_users_answer_is_refused_and_an_admin_may_answer(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway(group_sessions_per_user=False, admins=["http:boss"])
    fake.script(ASK, "launched")
    group = {"chat_type": "group"}
    await asked(gw, chat="g1", user_id="alice", **group)
    await gw.client.post("g1", "/approve", user_id="mallory", **group)
    (refused,) = await gw.client.replies("g1", 1)
    assert refused.startswith("Only alice") and "nothing changed" in refused
    await gw.client.post("g1", "/deny", user_id="mallory", **group)
    (refused,) = await gw.client.replies("g1", 1)
    assert refused.startswith("Only alice")
    request = gw.runner.approvals.waiting(GROUP_KEY)
    assert request is not None and request.tool == TOOL  # still waiting, untouched
    assert runs == []
    await gw.client.post("g1", "/approve", user_id="boss", **group)
    assert await gw.client.replies("g1", 2) == [f"Approved: {TOOL} runs now.", "launched"]
    assert len(runs) == 1


async def test_stop_during_the_wait_ends_the_turn_and_the_wait(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway()
    fake.script(ASK, "must not be sent")
    await asked(gw)
    assert gw.runner.approvals.waiting_count() == 1
    await gw.client.post("c1", "/stop")
    (stopped,) = await gw.client.replies("c1", 1)
    assert stopped.startswith("Stopped.")
    assert gw.runner.approvals.waiting_count() == 0  # no wait, no future left behind
    assert not gw.runner.is_busy(KEY)
    assert await gw.say("/approve") == "Nothing is waiting for approval."
    assert runs == [] and len(fake.requests) == 1  # the model was not asked again


async def test_a_shutdown_ends_the_wait_and_the_resumed_turn_asks_again(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    gw = await make_gateway(agent={"restart_drain_timeout": 0.2})
    fake.script(ASK)
    await asked(gw)
    await asyncio.wait_for(gw.stop(), 10)  # the drain gives up on the waiting turn
    assert gw.runner.approvals.waiting_count() == 0
    assert runs == []
    # The next start resumes the turn; its call was never answered, so it asks again.
    fake.script(ASK, "launched after the restart")
    gw = await make_gateway()
    first, again = await gw.client.replies("c1", 2)  # the ledger from its start
    assert first == again and TOOL in again
    await gw.client.post("c1", "/approve")
    assert (await gw.client.replies("c1", 2))[1] == "launched after the restart"
    assert len(runs) == 1


async def test_the_turn_deadline_does_not_run_while_the_call_waits(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    limit = 0.4
    gw = await make_gateway(agent={"gateway_timeout": limit})
    fake.script(ASK, "launched after a long wait")
    await asked(gw)
    since = time.monotonic()
    # Twice the turn's limit and more (its deadline checks tick every limit / 4).
    await wait_for(lambda: time.monotonic() - since > 3 * limit)
    assert gw.runner.approvals.waiting(KEY) is not None
    await gw.client.post("c1", "/approve")
    assert await gw.client.replies("c1", 2) == [
        f"Approved: {TOOL} runs now.",
        "launched after a long wait",
    ]
    assert len(runs) == 1


async def test_the_deadline_still_holds_outside_the_wait(
    make_gateway: MakeGateway, fake: FakeOpenAI, runs: list[Any]
) -> None:
    """The paused clock goes on afterwards: a model slower than the limit after an
    approval still times the turn out."""
    limit = 0.4
    gw = await make_gateway(agent={"gateway_timeout": limit})
    fake.script(ASK)
    release = fake.hold(lambda body: any(m["role"] == "tool" for m in body["messages"]))
    await asked(gw)
    await gw.client.post("c1", "/approve")
    (timed_out,) = (await gw.client.replies("c1", 2))[1:]
    release.set()
    assert timed_out.startswith(f"The agent did not answer within {limit:g} seconds")
    assert len(runs) == 1


async def test_tools_lists_the_agents_tools_and_which_ask_first(
    make_gateway: MakeGateway, runs: list[Any]
) -> None:
    gw = await make_gateway(agent={"tools": [TOOL, "scratchpad_read"]})
    assert await gw.say("/tools") == (
        f"Tools of agent main (2):\n{TOOL} (asks /approve first)\nscratchpad_read"
    )


async def test_tools_shows_each_tool_servers_state(
    make_gateway: MakeGateway, runs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = await make_gateway()
    servers = {
        "tickets": {"state": "down", "tools": 2, "last_error": "connection refused"},
        "time": {"state": "up", "tools": 1, "last_error": None},
    }
    monkeypatch.setattr(gw.runner, "tool_servers", lambda: servers)
    assert (await gw.say("/tools")).splitlines()[-3:] == [
        "Tool servers:",
        "tickets: down, 2 tools (last error: connection refused)",
        "time: up, 1 tools",
    ]


async def test_tools_says_when_the_agent_has_none(make_gateway: MakeGateway) -> None:
    gw = await make_gateway(agent={"tools": []})
    assert await gw.say("/tools") == "Agent main has no tools."


def test_long_arguments_are_cut_to_a_few_lines_saying_so() -> None:
    arguments = {"items": [f"line {n}" for n in range(40)], "note": "x" * 2000}
    shown = shown_arguments(arguments)
    *kept, marker = shown.splitlines()
    assert len(kept) <= SHOWN_LINES and len("\n".join(kept)) <= SHOWN_CHARS
    assert marker.startswith("… (cut: ") and marker.endswith(" more characters)")
    short = {"items": ["a"]}
    assert shown_arguments(short) == json.dumps(short, indent=2)


# --- the gate's edges (no runner: a sender that keeps what it is given) -----------------


class Kept:
    """An `ApprovalSender` that keeps the questions instead of sending them."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def deliver(self, target: Any, text: str, reply_to: str | None = None) -> int:
        self.sent.append(text)
        return 1


def request(source: SessionSource | None) -> ApprovalRequest:
    return ApprovalRequest(KEY, source, TOOL, {"items": ["x"]})


async def test_a_call_without_a_chat_to_ask_is_not_run_and_nothing_is_sent() -> None:
    kept = Kept()
    gate = Approvals(kept, Deadlines(10), timeout=30)
    assert await asyncio.wait_for(gate.ask(request(None)), 2) is Verdict.TIMEOUT
    assert kept.sent == []


async def test_a_second_call_while_one_waits_is_denied_and_the_first_still_waits() -> None:
    kept, source = Kept(), SessionSource(Platform.HTTP, "c1", user_id="u1")
    gate = Approvals(kept, Deadlines(10), timeout=30)
    first = asyncio.create_task(gate.ask(request(source)))
    await wait_for(lambda: gate.waiting(KEY) is not None)
    assert await asyncio.wait_for(gate.ask(request(source)), 2) is Verdict.DENIED
    assert len(kept.sent) == 1
    assert gate.answer(KEY, Verdict.APPROVED)
    assert await asyncio.wait_for(first, 2) is Verdict.APPROVED
    assert not gate.answer(KEY, Verdict.APPROVED) and gate.waiting_count() == 0


async def test_a_turn_without_a_gate_never_runs_a_call_that_needs_approval(
    runs: list[Any],
) -> None:
    (guarded,) = [tool for tool in agent_call.BUILTIN_TOOLS if tool.name == TOOL]
    scope = TurnScope(None, None, KEY, "s1", None, "main")  # type: ignore[arg-type]
    result = await Toolbox([guarded], [TOOL]).bind(scope).call(TOOL, {"items": ["x"]})
    assert json.loads(result) == {"error": "the user denied this call"}
    assert runs == []
