"""Nothing blocks other chats: a command that calls a model runs in its session's lane
like a turn, and background summaries yield to turns.

The real runner, HTTP adapter and store; the model is the fake OpenAI-compatible server,
which labels each request (a turn or a summary, and whose chat) and records which were
at the server at once (`FakeOpenAI.spans`). Slow summaries are held at the fake until
the test releases them, so every check is by order, not by a clock.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.memory import summaries
from tests.fakes.openai_server import FakeOpenAI, last_user_content
from tests.gateway_client import RunningGateway
from tests.test_memory import fake_reply, fake_usage, is_summary_request
from tests.waiting import wait_for

CONDENSED = re.compile(r"Condensed (\d+) messages into [\d,]+ characters\.")


def label(body: dict[str, Any]) -> str:
    """`summary:c1`, `turn:c2`: the kind of request and whose chat (every text a test
    sends starts with its chat's tag, `[c1]`)."""
    kind = "summary" if is_summary_request(body) else "turn"
    chat = "c2" if "[c2]" in json.dumps(body["messages"]) else "c1"
    return f"{kind}:{chat}"


def asks(fragment: str) -> Callable[[dict[str, Any]], bool]:
    """A turn request whose new message contains `fragment`."""
    return lambda body: not is_summary_request(body) and fragment in last_user_content(body)


MakeGateway = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(reply=fake_reply, usage=fake_usage, label=label) as server:
        yield server


@pytest.fixture
async def make_gateway(tmp_path: Path, fake: FakeOpenAI) -> AsyncIterator[MakeGateway]:
    made: list[RunningGateway] = []

    async def make(home: str = "home", **agent: Any) -> RunningGateway:
        agent = {"backend": "openai", "base_url": fake.base_url, "model": "m", "tools": [], **agent}
        gateway = await RunningGateway.started({"timezone": "UTC", "agent": agent}, tmp_path / home)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


#: every turn past the first asks for a summary of the exchanges before the newest one
EAGER = {
    "context": {
        "window_tokens": 2000,
        "trigger_ratio": 0.01,
        "target_ratio": 0.005,
        "min_messages": 2,
    }
}


# --- /compress in the session's lane ---------------------------------------------------------


async def test_compress_is_accepted_at_once_and_other_chats_are_answered_while_it_runs(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway()
    await gw.say("[c1] one")
    await gw.say("[c1] two")
    release = fake.hold(is_summary_request)
    # The POST returns while the summary it asked for is still at the model (held).
    accepted = await asyncio.wait_for(gw.client.post("c1", "/compress"), 10)
    assert (accepted["status"], accepted["detail"]) == ("started", "compress")
    await wait_for(lambda: fake.held)
    assert fake.spans[-1].label == "summary:c1" and fake.spans[-1].end is None

    assert await gw.say("[c2] meanwhile", chat="c2") == "fake: [c2] meanwhile"
    assert fake.spans[-1].label == "turn:c2"
    assert fake.spans[-1].overlaps(fake.spans[-2])  # answered while the summary ran

    release.set()
    (reply,) = await gw.client.replies("c1", 1)
    match = CONDENSED.fullmatch(reply)
    assert match and match.group(1) == "4", reply


async def test_compress_waits_for_the_sessions_turn_and_the_next_message_waits_for_it(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway()
    await gw.say("[c1] one")
    turn = fake.hold(asks("hold"))
    await gw.client.post("c1", "[c1] hold on")
    await wait_for(lambda: fake.held)
    summary = fake.hold(is_summary_request)
    assert (await gw.client.post("c1", "/compress"))["status"] == "queued"
    turn.set()
    (answered,) = await gw.client.replies("c1", 1)
    assert answered == "fake: [c1] hold on"
    await wait_for(lambda: len(fake.held) == 2)  # the summary, after the turn
    assert (await gw.client.post("c1", "[c1] after"))["status"] == "pending"
    summary.set()
    condensed, after = await gw.client.replies("c1", 2)
    assert CONDENSED.fullmatch(condensed) and condensed.startswith("Condensed 4 "), condensed
    assert after == "fake: [c1] after"
    assert fake.order() == ["turn:c1", "turn:c1", "summary:c1", "turn:c1"]
    assert not fake.overlaps()


async def test_stop_cancels_a_running_compress_and_its_summary(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway()
    await gw.say("[c1] one")
    fake.hold(is_summary_request)  # never released
    await gw.client.post("c1", "/compress")
    await wait_for(lambda: fake.held)
    assert await gw.say("/stop") == "Stopped. Your next message starts a fresh session."
    await wait_for(lambda: fake.spans[-1].gone)  # the summary's request was given up
    await wait_for(lambda: not gw.runner.memory._tasks)


async def test_a_compress_interrupted_by_a_shutdown_runs_again_and_answers_once(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(restart_drain_timeout=0)
    await gw.say("[c1] one")
    await gw.say("[c1] two")
    first = fake.hold(is_summary_request)  # the first run cannot finish
    await gw.client.post("c1", "/compress")
    await wait_for(lambda: fake.held)
    await gw.stop()
    await wait_for(lambda: fake.spans[-1].gone)
    first.set()  # the second run's summary is answered

    again = await make_gateway(restart_drain_timeout=0)
    again.client.cursors = dict(gw.client.cursors)
    (reply,) = await again.client.replies("c1", 1)
    assert CONDENSED.fullmatch(reply) and reply.startswith("Condensed 4 "), reply
    # The session's turns run in order: a second answer to /compress would come before this.
    assert await again.say("[c1] marker") == "fake: [c1] marker"
    assert [s.label for s in fake.spans].count("summary:c1") == 2


# --- background summaries yield to turns --------------------------------------------------------


async def test_a_turn_cancels_its_sessions_summary_at_the_model_and_never_overlaps_it(
    make_gateway: MakeGateway, fake: FakeOpenAI
) -> None:
    gw = await make_gateway(**EAGER)
    await gw.say("[c1] one")
    summary = fake.hold(is_summary_request)
    await gw.say("[c1] two")  # its end starts a summary: at the model once the lane is idle
    await wait_for(lambda: fake.held)
    asked = fake.spans[-1]
    assert asked.label == "summary:c1"
    turn = fake.hold(asks("three"))
    assert (await gw.client.post("c1", "[c1] three"))["status"] == "started"
    await wait_for(lambda: asked.gone)  # the turn's arrival cancelled the summary's request
    turn.set()
    assert await gw.client.replies("c1", 1) == ["fake: [c1] three"]
    summary.set()  # the summary the turn's end asks for again is answered
    await wait_for(lambda: fake.order().count("summary:c1") == 2 and not gw.runner.memory._tasks)
    assert fake.order() == ["turn:c1", "turn:c1", "summary:c1", "turn:c1", "summary:c1"]
    assert not fake.overlaps()


async def test_a_turn_of_another_session_goes_before_a_waiting_summary(
    make_gateway: MakeGateway, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summaries, "YIELD_SECONDS", 600.0)
    gw = await make_gateway(**EAGER)
    other = fake.hold(asks("[c2]"))
    await gw.client.post("c2", "[c2] a long one")
    await wait_for(lambda: fake.held)
    await gw.say("[c1] one")
    await gw.say("[c1] two")  # its end schedules a summary: it waits for c2's turn
    assert await gw.say("[c1] three") == "fake: [c1] three"
    other.set()
    (answered,) = await gw.client.replies("c2", 1)
    assert answered == "fake: [c2] a long one"
    await wait_for(lambda: "summary:c1" in fake.order())
    assert fake.order()[:4] == ["turn:c2", "turn:c1", "turn:c1", "turn:c1"]
    summary = next(s for s in fake.spans if s.label == "summary:c1")
    assert not [s for s in fake.spans if s.label.startswith("turn") and s.overlaps(summary)]


async def test_a_summary_that_waited_its_bound_goes_while_another_session_runs(
    make_gateway: MakeGateway, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(summaries, "YIELD_SECONDS", 0.2)
    gw = await make_gateway(**EAGER)
    c2_turn = fake.hold(asks("[c2]"))
    await gw.client.post("c2", "[c2] a long one")
    await wait_for(lambda: fake.held)
    await gw.say("[c1] one")
    await gw.say("[c1] two")
    await wait_for(lambda: "summary:c1" in fake.order(), within=15)
    summary = next(s for s in fake.spans if s.label == "summary:c1")
    assert summary.overlaps(fake.spans[0])  # c2's turn was still at the model
    c2_turn.set()  # so the gateway's stop drains it at once
