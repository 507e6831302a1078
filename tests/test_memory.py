"""What a turn sends the model: context strategies, rolling summaries, /compress.

The real runner with the real HTTP adapter and store; the model is either the fake
OpenAI-compatible server (tests/fakes/openai_server.py, which records every request and
counts each prompt with a tokenizer of its own) or a recording agent without a model.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.agents.protocol import SummaryRequest, TurnRequest, TurnResult
from gateway.context.strategy import SUMMARY_PREFIX, Plan
from gateway.context.tokens import STORE_CHANGE, UNCALIBRATED_FACTOR
from gateway.run import GatewayRunner
from gateway.store import summary_checkpoints
from gateway.store.summary_checkpoints import Checkpoint
from scripts.harness import Daemon
from tests.fakes.openai_server import FakeOpenAI, last_user_content, serve_in_a_thread
from tests.gateway_client import GatewayClient, RunningGateway
from tests.pg_support import StorageBackend
from tests.waiting import wait_for

KEY = "agent:main:http:dm:c1"
SUMMARY_REQUEST = "You maintain the running summary"


def fake_tokens(body: dict[str, Any]) -> int:
    """The fake model's own count: denser than the gateway's ~4 characters a token
    (3 a token, plus 5 per message), so the gateway must learn it from prompt_tokens."""
    messages = body["messages"]
    return sum(-(-len(str(m.get("content") or "")) // 3) + 5 for m in messages)


def fake_usage(body: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": fake_tokens(body), "completion_tokens": 10}


def is_summary_request(body: dict[str, Any]) -> bool:
    first = body["messages"][0]
    return first["role"] == "system" and first["content"].startswith(SUMMARY_REQUEST)


def fake_reply(body: dict[str, Any]) -> str:
    """Turns: a reply as long as the question. Summaries: name the last message they
    condensed, so a test knows what a summary covers."""
    if is_summary_request(body):
        new = last_user_content(body).split("New messages:\n", 1)[1]
        last = new.split("\n\nWrite the updated summary.")[0].splitlines()[-1]
        return f"SUMMARY up to: {last}"
    return "fake: " + last_user_content(body)


def turns_sent(fake: FakeOpenAI) -> list[dict[str, Any]]:
    return [r["json"] for r in fake.requests if not is_summary_request(r["json"])]


def text_of(n: int) -> str:
    return f"message {n}: " + " ".join(f"word{n}x{i}" for i in range(30))


@dataclass
class Gateway(RunningGateway):
    async def session_id(self) -> str:
        entry = await self.runner.store.get_entry(KEY)
        assert entry is not None
        return entry.session_id

    async def checkpoint(self) -> Checkpoint | None:
        sid = await self.session_id()
        return await self.runner.store.read(lambda conn: summary_checkpoints.read(conn, sid))

    async def rows(self) -> list[tuple[int, dict[str, Any]]]:
        """The active transcript with row ids, oldest first."""
        sid = await self.session_id()
        rows = await self.runner.store.read(
            lambda conn: conn.execute(
                "SELECT id, message FROM messages WHERE session_id = ? AND active = 1 ORDER BY id",
                (sid,),
            ).fetchall()
        )
        return [(row_id, json.loads(message)) for row_id, message in rows]

    async def say(self, text: str) -> str:
        await self.client.post("c1", text)
        (reply,) = await self.client.replies("c1", 1)
        return reply

    async def summaries_idle(self) -> None:
        sid = await self.session_id()
        await wait_for(lambda: not self.runner.memory.running(sid), within=15)


async def start_gateway(config: GatewayConfig, home: Path, agent_factory: Any = None) -> Gateway:
    """A runner with the HTTP adapter on `config`, started, and a client of its API."""
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], agent_factory=agent_factory, home=home)
    await runner.start()
    return Gateway(runner, GatewayClient(adapter.url))


MakeGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def make_gateway(tmp_path: Path) -> AsyncIterator[MakeGateway]:
    made: list[Gateway] = []

    async def make(agent: dict[str, Any], agent_factory: Any = None) -> Gateway:
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "platforms": {"http": {"enabled": True, "port": 0}},
                # The built-in tools' specs alone outweigh the small windows here: these
                # tests are about the transcript (tests/test_context_window.py counts them).
                "agent": {"tools": [], **agent},
            }
        )
        gateway = await start_gateway(config, tmp_path / f"home{len(made)}", agent_factory)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


def openai_agent(fake: FakeOpenAI, **context: Any) -> dict[str, Any]:
    return {
        "backend": "openai",
        "base_url": fake.base_url,
        "model": "m",
        "context": {"window_tokens": 1000, **context},
        "tools": [],  # as `make_gateway` has it
    }


class Recorder:
    """An agent without a model (no `summarize`: summaries are extractive) that keeps
    the history of every turn; a text containing "hold" waits for `Recorder.release`."""

    seen: list[TurnRequest]
    release: asyncio.Event

    def __init__(self, session_key: str) -> None:
        pass

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        Recorder.seen.append(request)
        if "hold" in request.text:
            await Recorder.release.wait()
        return TurnResult(f"echo: {request.text}")

    async def close(self) -> None:
        pass


@pytest.fixture
def recorder() -> type[Recorder]:
    Recorder.seen = []
    Recorder.release = asyncio.Event()
    return Recorder


# --- window ---------------------------------------------------------------------------------


async def test_window_strategy_never_sends_more_than_the_budget(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake, strategy="window"))
        budget = Plan.from_config(gw.runner.config.agent).budget
        for n in range(12):
            assert await gw.say(text_of(n)) == "fake: " + text_of(n)
        sent = turns_sent(fake)
        assert len(sent) == 12
        assert max(fake_tokens(body) for body in sent) <= budget
        # Not by luck: the conversation outgrew the budget, and the oldest messages went.
        last = [m["content"] for m in sent[-1]["messages"]]
        assert text_of(0) not in last and text_of(10) in last
        assert sum(len(text_of(n)) * 2 for n in range(12)) // 3 > budget
        assert not [r for r in fake.requests if is_summary_request(r["json"])]


async def test_window_strategy_sends_at_most_max_messages(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({"context": {"strategy": "window", "max_messages": 3}}, recorder)
    for n in range(4):
        await gw.say(f"m{n}")
    # The newest 3 rows open with a reply whose question is older: it goes too (what is
    # sent opens with a user message).
    assert [m["content"] for m in recorder.seen[-1].history] == ["m2", "echo: m2"]


@pytest.mark.parametrize(
    ("max_messages", "roles"),
    [
        (3, []),  # the newest 3 rows: two results and the answer, not their call
        (4, []),  # the call and all its results, but not the question they answer
        (5, ["user", "assistant", "tool", "tool", "assistant"]),  # the question is in: all
    ],
)
async def test_a_tool_call_and_its_results_are_sent_whole_or_not_at_all(
    make_gateway: MakeGateway, recorder: type[Recorder], max_messages: int, roles: list[str]
) -> None:
    gw = await make_gateway(
        {"context": {"strategy": "window", "max_messages": max_messages}}, recorder
    )
    await gw.say("first")
    sid = await gw.session_id()
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    for message in (
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "result one"},
        {"role": "tool", "tool_call_id": "c1", "content": "result two"},
        {"role": "assistant", "content": "found it"},
    ):
        await gw.runner.store.append_to_transcript(sid, message)
    await gw.say("next")
    # Results without their call would be rejected by any chat API, a history opening
    # with the assistant by several local models' chat templates: neither is sent.
    assert [m["role"] for m in recorder.seen[-1].history] == roles
    assert [m["content"] for m in recorder.seen[-1].history][-1:] == ["found it"][: len(roles)]


async def test_the_budget_never_splits_a_tool_call(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    """The call and its results do not fit together: neither goes, nor anything older
    (nor the answer after them, whose question went with them)."""
    gw = await make_gateway({"context": {"strategy": "window", "window_tokens": 800}}, recorder)
    await gw.say("first")
    sid = await gw.session_id()
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    for message in (
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x" * 2400},  # ~600 tokens
        {"role": "assistant", "content": "found it"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "welcome"},
    ):
        await gw.runner.store.append_to_transcript(sid, message)
    await gw.say("next")
    assert [m["content"] for m in recorder.seen[-1].history] == ["thanks", "welcome"]


# --- summary --------------------------------------------------------------------------------


async def test_summary_strategy_sends_one_summary_and_only_the_newer_messages(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake))
        budget = Plan.from_config(gw.runner.config.agent).budget
        for n in range(10):
            await gw.say(text_of(n))
        await wait_for(gw.checkpoint, within=15)
        await gw.summaries_idle()
        await gw.say("the last question")

        body = turns_sent(fake)[-1]
        systems = [m for m in body["messages"] if m["role"] == "system"]
        assert len(systems) == 2  # the system prompt, then the summary
        assert body["messages"][1] is systems[1]
        summary = systems[1]["content"]
        assert summary.startswith(SUMMARY_PREFIX + "SUMMARY up to: assistant: fake: message ")
        # The newest rows were sent, then the question, and the summary covers every
        # row before them: it names the row just before the first one sent (the model's
        # "up to", or the last line of the list a turn appends when it had to condense
        # more itself, as a slow background summary leaves it to), and not that one.
        rows = await gw.rows()
        earlier = rows[:-2]  # less this turn's
        sent = [m["content"] for m in body["messages"][2:]]
        assert sent[-1] == "the last question"
        kept = sent[:-1]
        assert kept and kept == [m["content"] for _, m in earlier[len(earlier) - len(kept) :]]
        covered_id, covered = earlier[len(earlier) - len(kept) - 1]
        assert covered["content"][:40] in summary and kept[0][:40] not in summary
        assert text_of(0) not in " ".join(sent)
        assert fake_tokens(body) <= budget
        checkpoint = await gw.checkpoint()
        assert checkpoint is not None and checkpoint.covered_up_to >= covered_id


async def test_compress_writes_a_checkpoint_and_the_next_turn_loads_it(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({}, recorder)
    for n in range(3):
        await gw.say(f"fact number {n}")
    assert await gw.checkpoint() is None
    reply = await gw.say("/compress")
    match = re.fullmatch(r"Condensed 6 messages into ([\d,]+) characters\.", reply)
    assert match, reply
    checkpoint = await gw.checkpoint()
    assert checkpoint is not None and checkpoint.messages == 6
    assert checkpoint.summary is not None
    assert len(checkpoint.summary) == int(match.group(1).replace(",", ""))
    rows = await gw.rows()
    assert checkpoint.covered_up_to == rows[-1][0]
    assert "- user: fact number 0" in checkpoint.summary  # the extractive list

    await gw.say("and now?")
    history = recorder.seen[-1].history
    assert len(history) == 1 and history[0]["role"] == "system"
    assert history[0]["content"] == SUMMARY_PREFIX + checkpoint.summary
    assert await gw.say("/compress") == "Condensed 2 messages into " + (
        f"{len((await gw.checkpoint()).summary):,} characters."  # type: ignore[union-attr]
    )


async def test_compress_asks_the_agents_own_model_and_falls_back_when_it_fails(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        gw = await make_gateway(openai_agent(fake, window_tokens=32000))
        await gw.say("tell me about otters")
        reply = await gw.say("/compress otters")
        assert reply.startswith("Condensed 2 messages into ")
        asked = [r["json"] for r in fake.requests if is_summary_request(r["json"])]
        assert len(asked) == 1 and "Focus on: otters" in asked[0]["messages"][0]["content"]
        checkpoint = await gw.checkpoint()
        assert checkpoint is not None
        assert checkpoint.summary == "SUMMARY up to: assistant: fake: tell me about otters"

        await gw.say("and beavers")
        fake.fail_next(400, "no summaries today")
        assert (await gw.say("/compress")).startswith("Condensed 2 messages into ")
        checkpoint = await gw.checkpoint()
        assert checkpoint is not None and checkpoint.summary is not None
        # The model's summary so far, then the extractive list of what came after.
        assert checkpoint.summary.startswith("SUMMARY up to: assistant: fake: tell me")
        assert "- user: and beavers" in checkpoint.summary
        assert checkpoint.messages == 4


async def test_compress_while_a_turn_runs_waits_for_it_in_the_sessions_lane(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({}, recorder)
    await gw.say("one")
    await gw.client.post("c1", "hold on")
    await wait_for(lambda: len(recorder.seen) == 2)
    accepted = await gw.client.post("c1", "/compress")
    assert (accepted["status"], accepted["detail"]) == ("queued", "compress")
    assert await gw.checkpoint() is None
    recorder.release.set()
    answered, condensed = await gw.client.replies("c1", 2)
    assert answered == "echo: hold on"
    # The running turn's exchange is condensed too: /compress ran after it.
    assert condensed.startswith("Condensed 4 messages into "), condensed
    checkpoint = await gw.checkpoint()
    assert checkpoint is not None and checkpoint.messages == 4


async def test_compress_under_the_window_strategy_refuses(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({"context": {"strategy": "window"}}, recorder)
    await gw.say("one")
    assert "needs the summary strategy" in await gw.say("/compress")
    assert await gw.checkpoint() is None


async def test_undo_into_a_summarized_range_invalidates_the_checkpoint(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({}, recorder)
    for n in range(3):
        await gw.say(f"turn {n}")
    await gw.say("/compress")
    before = await gw.checkpoint()
    assert before is not None and before.summary is not None
    assert (await gw.say("/undo")).startswith("Undid 1 turn(s)")
    after = await gw.checkpoint()
    assert after is not None
    assert after.summary is None and after.covered_up_to == 0
    assert after.epoch > before.epoch
    await gw.say("again")
    # No summary: the messages that are still active are sent as they are.
    assert [m["content"] for m in recorder.seen[-1].history] == [
        "turn 0",
        "echo: turn 0",
        "turn 1",
        "echo: turn 1",
    ]


async def test_undo_after_the_summarized_range_keeps_the_checkpoint(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    gw = await make_gateway({}, recorder)
    await gw.say("turn 0")
    await gw.say("/compress")
    before = await gw.checkpoint()
    await gw.say("turn 1")
    assert (await gw.say("/undo")).startswith("Undid 1 turn(s)")
    after = await gw.checkpoint()
    assert before is not None and after is not None
    assert after.summary == before.summary and after.covered_up_to == before.covered_up_to
    assert after.epoch == before.epoch + 1  # a summary of "turn 1" in flight would not land


async def test_a_summarizer_that_finishes_after_an_undo_changes_nothing(
    make_gateway: MakeGateway,
) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        release = fake.hold(is_summary_request)
        gw = await make_gateway(openai_agent(fake))
        sid = ""
        n = 0
        while not gw.runner.memory.running(sid):  # turns until one starts a summary
            await gw.say(text_of(n))
            await wait_for(lambda: not gw.runner.is_busy(KEY))  # its summary is started
            sid = await gw.session_id()
            n += 1
            assert n < 20, "no summary was started"
        await wait_for(lambda: fake.held)
        assert await gw.checkpoint() is None
        assert (await gw.say("/undo")).startswith("Undid 1 turn(s)")
        advanced = await gw.checkpoint()
        assert advanced is not None and advanced.epoch == 1
        release.set()  # the summarizer now finishes, against an advanced epoch
        await gw.summaries_idle()
        assert await gw.checkpoint() == advanced
        # Its request was answered: it did finish. (A summary asked before it may have
        # yielded to the next turn: its request was held too.)
        assert len(fake.requests) == n + len(fake.held)


async def test_a_late_summary_loses_to_a_newer_checkpoint(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    """Two summarizers of one session (as two replicas would run): the slower one read
    epoch 0, the faster one wrote epoch 1; the slower one's write changes nothing."""
    gw = await make_gateway({}, recorder)
    for n in range(3):
        await gw.say(f"turn {n}")
    sid = await gw.session_id()
    asked, release = asyncio.Event(), asyncio.Event()

    class SlowModel:
        async def summarize(self, request: SummaryRequest) -> str:
            asked.set()
            await release.wait()
            return "the slow summary"

    class Lease:
        async def __aenter__(self) -> SlowModel:
            return SlowModel()

        async def __aexit__(self, *exc: object) -> None:
            return None

    from gateway.memory.summaries import Memory

    slow = Memory(gw.runner.store, gw.runner.memory.plan, lambda key: Lease())
    late = asyncio.create_task(slow.compress(KEY, sid, None))
    await asyncio.wait_for(asked.wait(), 10)
    assert (await gw.say("/compress")).startswith("Condensed 6 messages")
    newer = await gw.checkpoint()
    release.set()
    outcome = await late
    assert outcome is not None and outcome.stale and outcome.messages == 0
    assert await gw.checkpoint() == newer
    assert newer is not None and newer.summary is not None
    assert "the slow summary" not in newer.summary
    await slow.close()


async def test_shutdown_cancels_a_summary_in_flight(make_gateway: MakeGateway) -> None:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        fake.hold(is_summary_request)  # never released
        gw = await make_gateway(openai_agent(fake))
        n = 0
        await gw.say(text_of(n))
        sid = await gw.session_id()
        memory = gw.runner.memory
        while not fake.held:
            # A summary the last turn started reaches the model (and is held there) before
            # the next turn, whose arrival would cancel it at the model.
            await wait_for(lambda: bool(fake.held) or not memory.running(sid), 15)
            if fake.held:
                break
            n += 1
            assert n < 20, "no summary was started"
            await gw.say(text_of(n))
        assert gw.runner.memory.running(sid)
        await gw.stop()  # returns: the held summary was cancelled, not awaited
        assert not gw.runner.memory.running(sid)


async def test_after_a_summary_that_ends_on_a_question_the_history_opens_with_a_user_message(
    make_gateway: MakeGateway, recorder: type[Recorder]
) -> None:
    """A checkpoint whose cut falls between a question and its answer (one written before
    summaries ended on whole turns, or cut so by the budget): what is sent after the system
    prompt and the summary opens with a user message, never with that orphan answer."""
    gw = await make_gateway({}, recorder)
    for n in range(3):
        await gw.say(f"turn {n}")
    sid = await gw.session_id()
    rows = await gw.rows()
    (question,) = [i for i, m in rows if m["content"] == "turn 1"]
    written = await gw.runner.store.write(
        lambda conn: summary_checkpoints.write(
            conn,
            sid,
            expected_epoch=0,
            covered_up_to=question,
            summary="condensed: turn 0 and the question turn 1",
            messages=3,
            now=time.time(),
        )
    )
    assert written
    await gw.say("next")
    history = recorder.seen[-1].history
    assert history[0]["role"] == "system" and history[0]["content"].startswith(SUMMARY_PREFIX)
    assert [m["content"] for m in history[1:]] == ["turn 2", "echo: turn 2"]
    assert history[1]["role"] == "user"


@pytest.mark.parametrize("pairs", range(4, 24))
def test_a_summary_round_ends_before_a_user_message(pairs: int) -> None:
    """Whatever the history's length, a round condenses whole turns: the first message it
    leaves is a question, never the answer to one it condensed."""
    from gateway.memory.summaries import Memory

    messages = []
    for n in range(pairs):
        messages.append({"role": "user", "content": f"question {n}"})
        messages.append({"role": "assistant", "content": f"answer {n} " + "y" * (40 * (n % 5))})
    text = sum(len(str(m["content"])) for m in messages)
    plan = Plan.from_config(
        GatewayConfig.model_validate({"agent": {"context": {"window_tokens": 1000}}}).agent
    )
    memory = Memory(None, plan)  # type: ignore[arg-type]  # _pick reads nothing
    for read in (len(messages), len(messages) - 3):  # the whole rest, or the oldest rows
        work = summary_checkpoints.Unsummarized(
            None, tuple(range(1, read + 1)), tuple(messages[:read]), len(messages), text, text
        )
        for first in (True, False):
            take = memory._pick(plan, "s", work, 50, False, first)
            assert take == 0 or messages[take]["role"] == "user", (read, first, take)
        take = memory._pick(plan, "s", work, 50, True, True)  # /compress
        assert take > 0
        assert take == len(messages) or messages[take]["role"] == "user", (read, take)


async def test_the_token_calibration_survives_a_restart(
    tmp_path: Path, store_backend: StorageBackend
) -> None:
    """The factor learnt from what the model counted is stored with the session: a new
    process (the store closed and opened again) starts from it, not from 1.0."""
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage) as fake:
        config = store_backend.apply(
            GatewayConfig.model_validate(
                {
                    "timezone": "UTC",
                    "platforms": {"http": {"enabled": True, "port": 0}},
                    "agent": openai_agent(fake, window_tokens=32000),
                    "session_reset": {"mode": "none"},
                }
            )
        )

        gw = await start_gateway(config, tmp_path / "home")
        try:
            for n in range(2):
                await gw.say(text_of(n))
            sid = await gw.session_id()
            learnt = gw.runner.memory.calibration.factor(sid)
        finally:
            await gw.stop()
        assert learnt > 1.1  # the fake counts denser than the estimate

        fake.usage = {"prompt_tokens": 0, "completion_tokens": 1}  # nothing to learn from
        gw = await start_gateway(config, tmp_path / "home")
        try:
            # A new process: nothing learnt yet, the margin for an uncalibrated estimate.
            assert gw.runner.memory.calibration.factor(sid) == UNCALIBRATED_FACTOR
            await gw.client.post("c1", "after the restart")
            # The replies of before the restart are read again by this new client.
            replies = await gw.client.replies("c1", 3)
            assert replies[-1] == "fake: after the restart"
            assert await gw.session_id() == sid
            # Stored again only when it moved by more than STORE_CHANGE.
            restored = gw.runner.memory.calibration.factor(sid)
            assert restored == pytest.approx(learnt, rel=STORE_CHANGE) and restored > 1.1
        finally:
            await gw.stop()


# --- the real daemon ------------------------------------------------------------------------


def test_the_daemon_summarizes_and_after_a_restart_still_sends_the_summary(
    tmp_path: Path,
) -> None:
    """`hermes-gateway run` as a subprocess against the fake model: a long chat gets a
    summary checkpoint written by the model, it survives a restart, and the first turn
    after it sends the summary and only the newer messages, within the budget."""
    with serve_in_a_thread(reply=fake_reply, usage=fake_usage) as (fake, _):
        daemon = Daemon(
            tmp_path / "home",
            f"agent:\n  backend: openai\n  base_url: {fake.base_url}\n  model: m\n"
            "  tools: []\n  context:\n    window_tokens: 1000\n",
        )
        try:
            daemon.start()
            for n in range(10):
                daemon.post("c1", text_of(n), message_id=f"m{n}")
                assert len(daemon.wait_replies("c1", n + 1)) == n + 1
            deadline = time.monotonic() + 20
            while not checkpoint_of(daemon) and time.monotonic() < deadline:
                time.sleep(0.05)
            summary = checkpoint_of(daemon)
            assert summary is not None and summary.startswith("SUMMARY up to: "), summary
            daemon.signal(signal.SIGTERM)
            assert daemon.wait_exit() == 0, daemon.log_tail()

            daemon.start()
            daemon.post("c1", "after the restart", message_id="m-last")
            assert daemon.wait_replies("c1", 11)[-1]["text"].endswith("fake: after the restart")
        finally:
            daemon.ensure_stopped()
        body = turns_sent(fake)[-1]
        systems = [m["content"] for m in body["messages"] if m["role"] == "system"]
        assert len(systems) == 2 and systems[1].startswith(SUMMARY_PREFIX + "SUMMARY up to: ")
        sent = " ".join(str(m["content"]) for m in body["messages"][2:])
        assert text_of(0) not in sent and sent.endswith("after the restart")
        assert (
            fake_tokens(body)
            <= Plan.from_config(
                GatewayConfig.model_validate({"agent": {"context": {"window_tokens": 1000}}}).agent
            ).budget
        )


def checkpoint_of(daemon: Daemon) -> str | None:
    conn = daemon.db()
    try:
        row = conn.execute("SELECT summary FROM summary_checkpoints").fetchone()
    finally:
        conn.close()
    return row[0] if row else None
