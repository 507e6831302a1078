"""The agent's tools: the openai backend's bounded function-calling loop, the
built-in tools, tool rounds in the transcript, /stop mid-loop, and the same tools for a
module:factory agent.

The real runner with the real HTTP adapter and store; the model is the fake
OpenAI-compatible server (tests/fakes/openai_server.py), which is scripted per request,
records every request and refuses badly paired tool calls and results as the real API
does. The note tools (memory_*) are tested against the recall store in test_recall*.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from config import TOOL_NAMES, GatewayConfig
from gateway.agents.openai import OpenAIAgent, build_messages
from gateway.agents.protocol import AgentError, TurnRequest, TurnResult, check_tool_rounds
from gateway.run import GatewayRunner
from gateway.store import scratchpad
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.builtin import Args
from gateway.tools.registry import Tool, Toolbox, TurnScope, agent_id_of
from scripts.harness import Daemon
from tests.fakes.openai_server import (
    FakeOpenAI,
    last_user_content,
    serve_in_a_thread,
    tool_calls,
    tool_results,
)
from tests.gateway_client import GatewayClient, RunningGateway
from tests.waiting import wait_blocking, wait_for

KEY = "agent:main:http:dm:c1"


@dataclass
class Gateway(RunningGateway):
    home: Path

    async def session_id(self, key: str = KEY) -> str:
        entry = await self.runner.store.get_entry(key)
        assert entry is not None
        return entry.session_id

    async def rows(self, key: str = KEY, sid: str | None = None) -> list[dict[str, Any]]:
        """The session's active transcript, oldest first (`sid`: of that session)."""
        sid = sid or await self.session_id(key)
        rows = await self.runner.store.read(
            lambda conn: conn.execute(
                "SELECT message FROM messages WHERE session_id = ? AND active = 1 ORDER BY id",
                (sid,),
            ).fetchall()
        )
        return [json.loads(message) for (message,) in rows]

    async def pad(self, key: str = KEY, sid: str | None = None) -> list[str]:
        sid = sid or await self.session_id(key)
        return await self.runner.store.read(lambda conn: scratchpad.read(conn, sid))


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(tmp_path: Path) -> AsyncIterator[MakeGateway]:
    made: list[Gateway] = []

    async def make(agent: dict[str, Any], agent_factory: Any = None, home: str = "h") -> Gateway:
        config = GatewayConfig.model_validate(
            {"timezone": "UTC", "platforms": {"http": {"enabled": True, "port": 0}}, "agent": agent}
        )
        adapter = HttpAdapter(config.platforms.http)
        runner = GatewayRunner(config, [adapter], agent_factory=agent_factory, home=tmp_path / home)
        await runner.start()
        gateway = Gateway(runner, GatewayClient(adapter.url), tmp_path / home)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(check_pairing=True) as server:
        yield server


def openai(fake: FakeOpenAI, **agent: Any) -> dict[str, Any]:
    return {"backend": "openai", "base_url": fake.base_url, "model": "m", **agent}


def sent(fake: FakeOpenAI) -> list[dict[str, Any]]:
    return [r["json"] for r in fake.requests]


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages]


# --- the loop -------------------------------------------------------------------------------


async def test_a_tool_round_runs_the_tool_and_sends_its_result_back(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    fake.script(tool_calls(("scratchpad_write", {"items": ["find the file"]})), "done")
    assert await gw.say("plan it") == "done"
    first, second = sent(fake)
    assert [t["function"]["name"] for t in first["tools"]] == list(TOOL_NAMES)
    assert roles(second["messages"])[-3:] == ["user", "assistant", "tool"]
    call = second["messages"][-2]["tool_calls"][0]
    (result,) = tool_results(second)
    assert result["tool_call_id"] == call["id"]
    assert result["content"] == {"items": 1}
    assert await gw.pad() == ["find the file"]


async def test_tool_rounds_are_stored_in_order_and_sent_back_after_a_restart(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    fake.script(
        tool_calls(("scratchpad_write", {"items": ["a"]}), ("scratchpad_read", {})),
        tool_calls(("scratchpad_clear", {})),
        "all done",
    )
    assert await gw.say("work") == "all done"
    stored = await gw.rows()
    assert roles(stored) == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    first_calls = [c["id"] for c in stored[1]["tool_calls"]]
    assert [stored[2]["tool_call_id"], stored[3]["tool_call_id"]] == first_calls
    assert stored[5]["tool_call_id"] == stored[4]["tool_calls"][0]["id"]
    assert stored[-1]["content"] == "all done"
    await gw.stop()

    gw = await make_gateway(openai(fake))  # the same home: a restart
    await gw.client.poll("c1")  # skip the replies delivered before
    assert await gw.say("next") == "fake: next"
    history = sent(fake)[-1]["messages"][1:]  # after the system prompt
    assert roles(history) == [*roles(stored), "user"]
    assert [m.get("tool_call_id") for m in history] == [m.get("tool_call_id") for m in stored] + [
        None
    ]


@pytest.mark.parametrize("max_messages", [3, 4, 5, 6])
async def test_the_window_never_separates_a_stored_call_from_its_results_after_a_restart(
    make_gateway: MakeGateway, fake: FakeOpenAI, max_messages: int
) -> None:
    agent = openai(fake, context={"strategy": "window", "max_messages": max_messages})
    gw = await make_gateway(agent)
    fake.script(tool_calls(("scratchpad_read", {}), ("scratchpad_read", {})), "read it")
    assert await gw.say("look") == "read it"
    await gw.stop()
    gw = await make_gateway(agent)
    await gw.client.poll("c1")
    # The fake refuses a result without its call (400): the reply proves the pairing.
    assert await gw.say("again") == "fake: again"
    history = sent(fake)[-1]["messages"][1:-1]
    # The rows are user, call, result, result, answer: the window takes the call with
    # both results, or neither (3: the results without their call are dropped), and
    # what it sends opens with a user message (3, 4: the question is outside the window,
    # so its call, results and answer are not sent either).
    whole = ["assistant", "tool", "tool", "assistant"]
    expected = {3: [], 4: [], 5: ["user", *whole], 6: ["user", *whole]}
    assert roles(history) == expected[max_messages]


async def test_a_model_that_keeps_calling_tools_stops_at_the_bound_with_a_clear_reply(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake, max_tool_rounds=3))
    fake.reply = lambda body: tool_calls(("scratchpad_read", {}))  # forever
    reply = await gw.say("loop")
    assert reply.startswith("I stopped after 3 rounds of tool calls")
    assert len(fake.requests) == 4  # three rounds run, the fourth call not
    stored = await gw.rows()
    assert roles(stored) == ["user", *["assistant", "tool"] * 3, "assistant"]
    assert stored[-1]["content"] == reply and "tool_calls" not in stored[-1]
    # The unrun calls were not stored: the next turn's request is well paired.
    fake.reply = lambda body: "fake: " + last_user_content(body)
    assert await gw.say("after") == "fake: after"


async def test_at_the_bound_the_models_own_text_is_the_reply(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake, max_tool_rounds=1))
    fake.script(
        tool_calls(("scratchpad_read", {})),
        tool_calls(("scratchpad_read", {}), content="Still checking, the pad is empty."),
    )
    assert await gw.say("go") == "Still checking, the pad is empty."


async def test_usage_of_every_round_is_counted(make_gateway: MakeGateway, fake: FakeOpenAI):
    gw = await make_gateway(openai(fake))
    fake.script(tool_calls(("scratchpad_read", {})), tool_calls(("scratchpad_read", {})), "ok")
    await gw.say("count")
    entry = await gw.runner.store.get_entry(KEY)
    assert entry is not None
    assert (entry.input_tokens, entry.output_tokens) == (3 * 7, 3 * 3)  # the fake's usage


# --- errors are results -----------------------------------------------------------------------


async def test_bad_arguments_and_unknown_tools_are_error_results_and_the_turn_goes_on(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    fake.script(
        tool_calls(
            ("scratchpad_write", "{not json"),
            ("scratchpad_write", {}),
            ("scratchpad_write", {"items": "a string"}),
            ("scratchpad_read", {"extra": 1}),
            ("read_session", {"limit": 0}),
            ("launch_rockets", {}),
        ),
        "sorry",
    )
    assert await gw.say("try") == "sorry"
    errors = [r["content"]["error"] for r in tool_results(sent(fake)[1])]
    assert errors[0] == "scratchpad_write: bad arguments: the arguments are not valid JSON"
    assert errors[1] == "scratchpad_write: bad arguments: items: Field required"
    assert errors[2].startswith("scratchpad_write: bad arguments: items: Input should be")
    assert errors[3].startswith("scratchpad_read: bad arguments: extra: Extra inputs")
    assert errors[4].startswith("read_session: bad arguments: limit: Input should be greater")
    assert errors[5].startswith("no tool named 'launch_rockets'; the tools are: memory_save")
    assert await gw.pad() == []


class _Boom(Args):
    pass


async def _explode(scope: TurnScope, args: _Boom) -> None:
    raise RuntimeError("disk on fire")


async def _refuse(scope: TurnScope, args: _Boom) -> None:
    raise ValueError("that id is not yours")


async def test_a_tool_that_raises_is_an_error_result_naming_only_the_error_type() -> None:
    box = Toolbox(
        [Tool("boom", "raises", _Boom, _explode), Tool("no", "refuses", _Boom, _refuse)],
        ["boom", "no"],
    )
    tools = box.bind(TurnScope(None, None, KEY, "s1", None, "main"))  # type: ignore[arg-type]
    assert json.loads(await tools.call("boom", "{}")) == {
        "error": "boom failed (RuntimeError); the error was logged"
    }
    assert json.loads(await tools.call("no", {})) == {"error": "no: that id is not yours"}
    assert tools.writes() == []


async def test_the_note_tools_without_a_recall_store_say_so() -> None:
    """A scope without a recall store (an embedding that builds its own runner parts)
    gets an error result from the note tools, never an exception."""
    box = Toolbox(BUILTIN_TOOLS, ["memory_search"])
    tools = box.bind(TurnScope(None, None, KEY, "s1", None, "main"))  # type: ignore[arg-type]
    assert json.loads(await tools.call("memory_search", {"query": "x"})) == {
        "error": "memory_search: long-term memory is not available in this gateway"
    }


# --- the scratchpad ----------------------------------------------------------------------------


async def test_the_scratchpad_limits_hold_and_a_write_replaces_the_pad(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    full = [f"{n:02d} " + "x" * 237 for n in range(32)]  # 32 items of exactly 240
    fake.script(
        tool_calls(("scratchpad_write", {"items": full})),
        tool_calls(
            ("scratchpad_write", {"items": [*full, "one more"]}),
            ("scratchpad_write", {"items": ["y" * 241]}),
            ("scratchpad_read", {}),
        ),
        "noted",
    )
    assert await gw.say("fill it") == "noted"
    too_many, too_long, read = tool_results(sent(fake)[2])
    assert "at most 32 items, got 33" in too_many["content"]["error"]
    assert "item 1 has 241 characters; at most 240" in too_long["content"]["error"]
    assert read["content"] == {"items": full}  # the refused writes changed nothing
    assert await gw.pad() == full

    fake.script(tool_calls(("scratchpad_write", {"items": ["only this"]})), "replaced")
    assert await gw.say("replace") == "replaced"
    assert await gw.pad() == ["only this"]
    fake.script(tool_calls(("scratchpad_clear", {})), tool_calls(("scratchpad_read", {})), "gone")
    assert await gw.say("clear") == "gone"
    assert tool_results(sent(fake)[-2])[-1]["content"] == {"cleared": True}
    assert tool_results(sent(fake)[-1])[-1]["content"] == {"items": []}
    assert await gw.pad() == []


async def test_the_scratchpad_belongs_to_its_session(make_gateway: MakeGateway, fake: FakeOpenAI):
    gw = await make_gateway(openai(fake))
    fake.script(tool_calls(("scratchpad_write", {"items": ["step 1"]})), "ok")
    await gw.say("start")
    old = await gw.session_id()
    assert "new session" in (await gw.say("/new")).lower()
    fake.script(tool_calls(("scratchpad_read", {})), "empty")
    assert await gw.say("what was I doing?") == "empty"
    assert tool_results(sent(fake)[-1])[-1]["content"] == {"items": []}
    # Deleting the old session takes its pad with it (purge: every session_id table).
    assert (await gw.runner.delete_session(old))["status"] == "deleted"
    left = await gw.runner.store.read(
        lambda conn: conn.execute(
            "SELECT count(*) FROM scratchpads WHERE session_id = ?", (old,)
        ).fetchone()[0]
    )
    assert left == 0


# --- session_search, read_session ---------------------------------------------------------------


async def test_session_search_finds_only_this_chats_sessions(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    await gw.say("my pineapple recipe", chat="c2")
    await gw.say("hello", chat="c1")
    fake.script(tool_calls(("session_search", {"query": "pineapple"})), "nothing here")
    assert await gw.say("find pineapple talk", chat="c1") == "nothing here"
    hits = tool_results(sent(fake)[-1])[0]["content"]["hits"]
    # c1's own question (stored before the turn ran) is the only match it may see.
    assert [h["snippet"] for h in hits] == ["find **pineapple** talk"]
    assert hits[0]["current_session"] is True
    fake.script(tool_calls(("session_search", {"query": "pineapple", "limit": 5})), "found")
    assert await gw.say("and here?", chat="c2") == "found"
    hits = tool_results(sent(fake)[-1])[0]["content"]["hits"]
    assert [h["snippet"] for h in hits] == [  # newest first
        "fake: my **pineapple** recipe",
        "my **pineapple** recipe",
    ]


async def test_read_session_lists_and_pages_this_chats_sessions_only(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    for text in ("one", "two", "three"):
        await gw.say(text)
    earlier = await gw.session_id()
    await gw.say("/new")
    await gw.say("elsewhere", chat="c2")
    other = await gw.session_id("agent:main:http:dm:c2")

    fake.script(
        tool_calls(("read_session", {})),
        tool_calls(("read_session", {"session_id": earlier, "limit": 4})),
        "read",
    )
    assert await gw.say("what did we say?") == "read"
    listing = tool_results(sent(fake)[-2])[0]["content"]["sessions"]
    assert [s["session_id"] for s in listing] == [await gw.session_id(), earlier]
    assert [s["current_session"] for s in listing] == [True, False]
    page = tool_results(sent(fake)[-1])[-1]["content"]
    assert [m["content"] for m in page["messages"]] == ["one", "fake: one", "two", "fake: two"]
    assert page["next_after"] == page["messages"][-1]["id"]

    after = page["next_after"]
    fake.script(
        tool_calls(("read_session", {"session_id": earlier, "after": after, "limit": 4})),
        tool_calls(("read_session", {"session_id": other})),
        "ok",
    )
    await gw.say("more")
    page = tool_results(sent(fake)[-2])[-1]["content"]
    assert [m["content"] for m in page["messages"]] == ["three", "fake: three"]
    assert page["next_after"] is None
    refused = tool_results(sent(fake)[-1])[-1]["content"]
    assert refused["error"].startswith(f"read_session: no session '{other}' in this chat")


# --- /stop ---------------------------------------------------------------------------------------


async def test_stop_between_tool_rounds_cancels_the_turn_and_keeps_nothing_of_it(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(openai(fake))
    fake.script(tool_calls(("scratchpad_write", {"items": ["half way"]})))
    release = fake.hold(lambda body: any(m["role"] == "tool" for m in body["messages"]))
    await gw.client.post("c1", "long task")
    await wait_for(lambda: fake.held)  # round one ran; the model "thinks" about its result
    await gw.client.post("c1", "/stop")
    (stopped,) = await gw.client.replies("c1", 1)
    assert "stopped" in stopped.lower()
    release.set()
    stopped = await gw.session_id()
    # The session's turns run in order: a reply of the stopped turn would come before this.
    assert (await gw.say("next")).endswith("fake: next")
    assert roles(await gw.rows(sid=stopped)) == ["user"]  # no call, no result, no reply
    assert await gw.pad(sid=stopped) == []  # the pad changes with its turn, or not at all


class ToolUser:
    """A module:factory agent using the tools through `request.tools`: "remember X"
    writes X to the scratchpad, "recall" reads it, "hold" waits inside a tool call's
    turn for `ToolUser.release`, "broken" returns a call without its result."""

    seen: list[TurnRequest] = []
    release: asyncio.Event
    entered: asyncio.Event

    def __init__(self, session_key: str) -> None:
        pass

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        ToolUser.seen.append(request)
        tools = request.tools
        assert tools is not None
        if request.text == "broken":
            call = {"id": "x", "type": "function", "function": {"name": "n", "arguments": "{}"}}
            return TurnResult(
                "?", messages=({"role": "assistant", "content": None, "tool_calls": [call]},)
            )
        if request.text.startswith("remember "):
            name, args = "scratchpad_write", {"items": [request.text.removeprefix("remember ")]}
        else:
            name, args = "scratchpad_read", {}
        result = await tools.call(name, args)
        if request.text == "hold":
            ToolUser.entered.set()
            await ToolUser.release.wait()
        call = {
            "id": "t1",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        return TurnResult(
            f"tool said {result}",
            messages=(
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "t1", "content": result},
            ),
        )

    async def close(self) -> None:
        pass


@pytest.fixture
def tool_user() -> type[ToolUser]:
    ToolUser.seen = []
    ToolUser.release = asyncio.Event()
    ToolUser.entered = asyncio.Event()
    return ToolUser


async def test_a_factory_agent_uses_the_same_tools_and_its_rounds_are_stored(
    make_gateway: MakeGateway, tool_user: type[ToolUser]
) -> None:
    gw = await make_gateway({"tools": ["scratchpad_read", "scratchpad_write"]}, tool_user)
    assert await gw.say("remember the milk") == 'tool said {"items": 1}'
    specs = tool_user.seen[0].tools.specs()  # type: ignore[union-attr]
    assert [s["function"]["name"] for s in specs] == ["scratchpad_read", "scratchpad_write"]
    assert await gw.say("recall") == 'tool said {"items": ["the milk"]}'
    stored = await gw.rows()
    assert roles(stored) == ["user", "assistant", "tool", "assistant"] * 2
    # The stored rounds go back to the agent as history, paired.
    assert roles(list(tool_user.seen[-1].history)) == ["user", "assistant", "tool", "assistant"]


async def test_a_factory_agents_broken_rounds_fail_its_turn_and_store_nothing(
    make_gateway: MakeGateway, tool_user: type[ToolUser]
) -> None:
    gw = await make_gateway({}, tool_user)
    reply = await gw.say("broken")
    assert reply.startswith("Sorry, the agent failed: the agent returned tool rounds")
    assert roles(await gw.rows()) == ["user"]


async def test_stop_during_a_tool_using_turn_drops_its_scratchpad_write(
    make_gateway: MakeGateway, tool_user: type[ToolUser]
) -> None:
    gw = await make_gateway({}, tool_user)
    await gw.client.post("c1", "remember x")
    await gw.client.replies("c1", 1)
    await gw.client.post("c1", "hold")  # reads the pad, then waits
    await asyncio.wait_for(tool_user.entered.wait(), 10)
    await gw.client.post("c1", "/stop")
    assert "stopped" in (await gw.client.replies("c1", 1))[0].lower()
    assert roles(await gw.rows()) == ["user", "assistant", "tool", "assistant", "user"]


# --- configuration ----------------------------------------------------------------------------


async def test_agent_tools_enables_a_subset(make_gateway: MakeGateway, fake: FakeOpenAI):
    gw = await make_gateway(openai(fake, tools=["session_search"]))
    fake.script(tool_calls(("scratchpad_read", {})), "no pad")
    assert await gw.say("pad?") == "no pad"
    first, second = sent(fake)
    assert [t["function"]["name"] for t in first["tools"]] == ["session_search"]
    (result,) = tool_results(second)
    assert (
        result["content"]["error"]
        == "no tool named 'scratchpad_read'; the tools are: session_search"
    )


async def test_no_tools_means_plain_requests(make_gateway: MakeGateway, fake: FakeOpenAI):
    gw = await make_gateway(openai(fake, tools=[]))
    assert await gw.say("hi") == "fake: hi"
    assert "tools" not in sent(fake)[0]
    assert gw.runner.toolbox_for("main") is None


async def test_the_echo_backend_gets_no_tools(make_gateway: MakeGateway) -> None:
    gw = await make_gateway({})
    assert gw.runner.toolbox_for("main") is None
    assert await gw.say("hi") == "echo: hi"


def test_the_registry_implements_exactly_the_configurable_tools() -> None:
    assert [tool.name for tool in BUILTIN_TOOLS] == list(TOOL_NAMES)
    for spec in Toolbox(BUILTIN_TOOLS, TOOL_NAMES).specs():
        params = spec["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert "title" not in params


def test_agent_id_comes_from_the_session_key() -> None:
    assert agent_id_of("agent:main:http:dm:c1") == "main"
    assert agent_id_of("agent:helper:telegram:group:-100:7") == "helper"
    with pytest.raises(ValueError):
        agent_id_of("telegram:dm:1")


# --- a crash mid-loop ---------------------------------------------------------------------------


def test_a_crash_mid_loop_replays_the_recorded_round_and_applies_the_pad_again(
    tmp_path: Path,
) -> None:
    """kill -9 while the model holds its answer to round one's results: the round is in
    the tool-call journal, so the restart replays it to the model (the scratchpad write
    applied again from its record, not asked of the model again) and asks only for the
    rest; the transcript holds the user message once and the one round."""
    with serve_in_a_thread(check_pairing=True) as (fake, loop):
        daemon = Daemon(
            tmp_path / "home",
            f"agent:\n  backend: openai\n  base_url: {fake.base_url}\n  model: m\n",
        )
        fake.script(tool_calls(("scratchpad_write", {"items": ["before the crash"]})))
        # Only the first round-two request waits (released when the test ends).
        release = fake.hold(
            lambda body: not fake.held and any(m["role"] == "tool" for m in body["messages"])
        )
        try:
            daemon.start()
            daemon.post("c1", "long task", message_id="m1")
            wait_blocking(lambda: fake.held)  # round one finished
            daemon.kill9()

            fake.script("finished")
            daemon.start()
            replies = daemon.wait_replies("c1", 1)
            assert [r["text"] for r in replies] == ["finished"]
            conn = daemon.db()
            try:
                (sid,) = conn.execute("SELECT session_id FROM sessions").fetchone()
                rows = conn.execute(
                    "SELECT message FROM messages WHERE session_id = ? ORDER BY id", (sid,)
                ).fetchall()
                pad = conn.execute("SELECT items FROM scratchpads").fetchall()
                journal = conn.execute("SELECT COUNT(*) FROM tool_calls").fetchone()[0]
            finally:
                conn.close()
            stored = [json.loads(m) for (m,) in rows]
            assert roles(stored) == ["user", "assistant", "tool", "assistant"]
            assert stored[0]["content"] == "long task"
            assert json.loads(stored[1]["tool_calls"][0]["function"]["arguments"]) == {
                "items": ["before the crash"]
            }
            assert [json.loads(items) for (items,) in pad] == [["before the crash"]]
            assert journal == 0  # gone with the turn's finish
            assert len(fake.requests) == 3  # two before the crash, one after it
            replayed = fake.requests[-1]["json"]["messages"]
            assert [m["role"] for m in replayed[-3:]] == ["user", "assistant", "tool"]
            assert json.loads(replayed[-1]["content"]) == {"items": 1}
        finally:
            loop.call_soon_threadsafe(release.set)
            daemon.ensure_stopped()


# --- the backend on its own ---------------------------------------------------------------------


async def test_a_malformed_tool_call_is_an_agent_error(fake: FakeOpenAI) -> None:
    agent = OpenAIAgent(base_url=fake.base_url, model="m")
    tools = Toolbox(BUILTIN_TOOLS, ["scratchpad_clear"]).bind(
        TurnScope(None, None, KEY, "s1", None, "main")  # type: ignore[arg-type]
    )
    request = TurnRequest(KEY, "s1", "hi", (), "", tools=tools)
    fake.script({"content": None, "tool_calls": [{"type": "function", "function": {}}]})
    try:
        with pytest.raises(AgentError, match="malformed tool call"):
            await agent.run_turn(request)
    finally:
        await agent.close()


def test_history_keeps_a_tool_call_without_content() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "{}"},
        {"role": "assistant", "content": "a"},
    )
    messages = build_messages(TurnRequest(KEY, "s1", "next", history, ""))
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert messages[2] == {"role": "tool", "content": "{}", "tool_call_id": "c1"}


_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_ASKED = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
_ANSWERED = {"role": "tool", "tool_call_id": "c1", "content": "{}"}


@pytest.mark.parametrize(
    "messages",
    [
        (_ASKED,),  # a call without its result
        (_ANSWERED,),  # a result without its call
        (_ASKED, _ANSWERED, _ANSWERED),  # two results for one call
        (_ASKED, {**_ANSWERED, "content": {"not": "text"}}),
        ({**_ASKED, "tool_calls": [{"id": "c1"}]}, _ANSWERED),  # no function
        ({**_ASKED, "tool_calls": [_CALL, _CALL]}, _ANSWERED, _ANSWERED),  # one id twice
        ({"role": "assistant", "content": "plain"},),  # not a round
        (_ASKED, {"role": "user", "content": "hi"}, _ANSWERED),
    ],
)
def test_tool_rounds_that_would_break_later_requests_are_refused(messages: tuple) -> None:
    with pytest.raises(AgentError, match="tool rounds the transcript cannot keep"):
        check_tool_rounds(messages)


def test_well_paired_rounds_are_accepted() -> None:
    two = {**_ASKED, "tool_calls": [_CALL, {**_CALL, "id": "c2"}]}
    check_tool_rounds(())
    check_tool_rounds((two, {**_ANSWERED, "tool_call_id": "c2"}, _ANSWERED, _ASKED, _ANSWERED))


def test_each_agent_gets_its_own_tools(tmp_path: Path) -> None:
    """`tools` is per agent: one agent's subset is not another's, and an echo agent
    beside a model agent carries none."""
    config = GatewayConfig.model_validate(
        {
            "agent": {"backend": "openai", "tools": ["session_search", "scratchpad_read"]},
            "agents": {
                "coder": {"backend": "openai", "tools": ["memory_search"]},
                "plain": {"backend": "echo"},
            },
        }
    )
    runner = GatewayRunner(config, [], home=tmp_path / "home")
    names = {
        agent: [spec["function"]["name"] for spec in box.specs()]
        for agent in ("main", "coder")
        if (box := runner.toolbox_for(agent)) is not None
    }
    assert names == {"main": ["session_search", "scratchpad_read"], "coder": ["memory_search"]}
    assert runner.toolbox_for("plain") is None
