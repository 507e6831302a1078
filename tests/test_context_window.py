"""The context fits the model's window, and drops nothing.

The real runner, HTTP adapter and store (SQLite and PostgreSQL), against the fake
OpenAI-compatible server started as a llama.cpp server with `n_ctx` = the configured
`agent.context.window_tokens`: it counts every prompt by a stated tokenizer-free upper
bound (a token per 3 bytes of the JSON of the messages and the tool specs,
`tests.fakes.openai_server.prompt_tokens`; our estimate reads 4 characters a token),
reports that count as `usage.prompt_tokens`, and refuses with 400 a request over n_ctx.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from config import TOOL_NAMES, GatewayConfig
from gateway.context import condense
from gateway.context.strategy import SUMMARY_PREFIX
from gateway.context.tokens import MAX_FACTOR
from gateway.store.summary_checkpoints import Checkpoint
from tests.fakes.openai_server import (
    FakeOpenAI,
    counted_usage,
    last_user_content,
    prompt_tokens,
)
from tests.pg_support import StorageBackend
from tests.test_condense_notice import split_notice
from tests.test_memory import Gateway, is_summary_request, start_gateway

MakeGateway = Callable[..., Awaitable[Gateway]]


def fake_reply(body: dict[str, Any]) -> str:
    """Turns: a short acknowledgement. Summaries: a short text naming what they took in."""
    if is_summary_request(body):
        return "SUMMARY: " + last_user_content(body)[-200:]
    return "noted: " + last_user_content(body)[:60]


def user_text(n: int, long: int) -> str:
    """The n-th user message: a marker, then 20 to 400 characters of words; every
    seventh one `long` (what pushes earlier rows out of a small window at once, before
    a background summary could make room)."""
    rng = random.Random(n)
    size = rng.randint(long * 4 // 5, long) if n % 7 == 3 else rng.randint(20, 400)
    words = []
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(["carpenter", "Oslo", "timber", "fjord", "tool", "plan", "ок"]))
    return f"fact {n}: " + " ".join(words)


@pytest.fixture
async def make_gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[MakeGateway]:
    made: list[Gateway] = []

    async def make(fake: FakeOpenAI, window: int, tools: list[str]) -> Gateway:
        config = store_backend.apply(
            GatewayConfig.model_validate(
                {
                    "timezone": "UTC",
                    "platforms": {"http": {"enabled": True, "port": 0}},
                    "agent": {
                        "backend": "openai",
                        "base_url": fake.base_url,
                        "model": "m",
                        "tools": tools,
                        "context": {"window_tokens": window},
                    },
                    "session_reset": {"mode": "none"},
                }
            )
        )
        gateway = await start_gateway(config, tmp_path / f"home{len(made)}")
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        await gateway.stop()


@pytest.mark.parametrize(
    ("window", "tools", "long"),
    [
        (1024, [], 1300),
        (2048, ["memory_save", "memory_search", "scratchpad_write"], 2400),
        (4096, list(TOOL_NAMES), 4000),  # every built-in tool: about 2,000 tokens of specs
    ],
    ids=["no-tools", "three-tools", "all-tools"],
)
async def test_no_request_exceeds_the_window_and_no_user_message_is_lost(
    make_gateway: MakeGateway, window: int, tools: list[str], long: int
) -> None:
    """45 turns with summaries: every request (turns and summaries) fits n_ctx, and at
    every turn each earlier user message is either in the history sent or covered by
    the summary checkpoint the turn sent (read as the model receives the request; the
    background summaries are let finish between turns, so that checkpoint is the
    turn's own)."""
    async with FakeOpenAI(reply=fake_reply, usage=counted_usage, n_ctx=window) as fake:
        gw = await make_gateway(fake, window, tools)
        seen: list[tuple[dict[str, Any], Checkpoint | None]] = []

        async def snapshot(body: dict[str, Any]) -> None:
            if not is_summary_request(body):
                seen.append((body, await gw.checkpoint()))

        fake.on_request = snapshot
        cut = told = 0
        for n in range(45):
            text = user_text(n, long)
            condensed, reply = split_notice(await gw.say(text))
            assert reply == "noted: " + text[:60], f"turn {n}"
            body, checkpoint = seen[-1]
            # Every condensed message was told once, with the first reply after it was.
            told += condensed
            assert told == (checkpoint.messages if checkpoint is not None else 0), n
            assert last_user_content(body) == text
            sent = {m.get("content") for m in body["messages"]}
            covered = checkpoint.covered_up_to if checkpoint is not None else 0
            for row_id, message in (await gw.rows())[:-2]:  # less this turn's own
                if message["role"] == "user":
                    assert message["content"] in sent or row_id <= covered, (n, message)
            if checkpoint is not None and checkpoint.summary:
                # Sent whole, or cut (to nothing, at worst) for a turn whose own message
                # leaves it less room; the summary stored keeps it all for the next.
                found = [c for c in sent if str(c).startswith(SUMMARY_PREFIX)]
                shown = found[0][len(SUMMARY_PREFIX) :] if found else ""
                assert checkpoint.summary.startswith(shown), (checkpoint, body)
                cut += shown != checkpoint.summary
            await gw.summaries_idle()

        assert fake.over_window == []
        counts = [prompt_tokens(r["json"]) for r in fake.requests]
        assert len(counts) > 45 and max(counts) <= window
        # Not by luck: the conversation outgrew the window many times over, summaries
        # were written by the model, and rows that did not fit were condensed on the
        # turn's path (the extractive list the model's summaries do not write).
        assert sum(len(user_text(n, long)) for n in range(45)) // 3 > window
        assert any(is_summary_request(r["json"]) for r in fake.requests)
        assert any(c is not None and condense.HEADER in (c.summary or "") for _, c in seen)
        assert cut <= 45 // 7  # only a turn with a long message sends the summary cut
        if tools:
            assert all(body.get("tools") for body, _ in seen)
        # The factor learnt is the model's real ratio to everything sent, not the cap.
        factor = gw.runner.memory.calibration.factor(await gw.session_id())
        assert 1.0 < factor < MAX_FACTOR


async def test_a_message_too_long_for_the_window_is_refused_once_and_not_sent(
    make_gateway: MakeGateway,
) -> None:
    """A message that alone (with the system prompt and tools) cannot fit: the user is
    told its size against the window and what to do, the model is not asked, the turn
    ends answered once; the next message is answered, and the long one, left in the
    transcript, goes into the summary rather than being dropped."""
    async with FakeOpenAI(reply=fake_reply, usage=counted_usage, n_ctx=1024) as fake:
        gw = await make_gateway(fake, 1024, [])
        assert await gw.say("hello") == "noted: hello"
        long = "fact long: " + "timber " * 900  # about 6,300 characters
        await gw.client.post("c1", long)
        (notice,) = await gw.client.replies("c1", 1)
        assert notice.startswith("Your message is too long for this agent's model:")
        assert "window of 1,024 tokens" in notice and "Send a shorter message" in notice
        assert len(fake.requests) == 1  # only the first turn's
        # The session's turns run in order: a second answer to the long message would come
        # before this one's.
        # The turn condensed the long message (and what came before it) to fit: its
        # reply says so.
        condensed, reply = split_notice(await gw.say("and now?"))
        assert reply == "noted: and now?"
        rows = await gw.rows()
        assert [m["role"] for _, m in rows] == ["user", "assistant", "user", "user", "assistant"]
        body = fake.requests[-1]["json"]
        assert prompt_tokens(body) <= 1024 and long not in str(body)
        checkpoint = await gw.checkpoint()
        assert checkpoint is not None and checkpoint.covered_up_to >= rows[2][0]
        assert "fact long: timber" in (checkpoint.summary or "")
        assert condensed == checkpoint.messages == 3
        assert fake.over_window == []


@pytest.mark.parametrize("size", [2_000, 7_600])
async def test_the_first_request_of_a_session_fits_before_any_calibration(
    make_gateway: MakeGateway, size: int
) -> None:
    """Nothing is learnt before the first reply: the estimate is taken with its stated
    margin (`UNCALIBRATED_FACTOR`). With every built-in tool, a message that fits is
    answered, and one that fits only by the bare estimate (4 characters a token) is
    refused with the notice: neither reaches the model over its window."""
    async with FakeOpenAI(reply=fake_reply, usage=counted_usage, n_ctx=4096) as fake:
        gw = await make_gateway(fake, 4096, list(TOOL_NAMES))
        text = "fact: " + "x" * size
        reply = await gw.say(text)
        assert fake.over_window == []
        if size < 4_000:
            assert reply == "noted: " + text[:60]
            (request,) = fake.requests
            assert prompt_tokens(request["json"]) <= 4096 and request["json"]["tools"]
        else:
            assert reply.startswith("Your message is too long for this agent's model:")
            assert fake.requests == []
