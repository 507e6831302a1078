"""The `openai` backend's streaming against the fake server's server-sent
events: the reply handed over as it grows, usage from the last chunk, tool calls
assembled from their deltas, retries before the first byte."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.agents.openai import OpenAIAgent
from gateway.agents.protocol import TurnRequest
from tests.fakes.openai_server import FakeOpenAI, tool_calls

pytestmark = pytest.mark.timeout(30)


class RecordingTools:
    """A turn's tools (the `Tools` protocol): one tool that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def specs(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": "note",
                    "description": "remember",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]

    async def call(self, name: str, arguments: str | dict[str, Any]) -> str:
        self.calls.append(
            (name, json.loads(arguments) if isinstance(arguments, str) else arguments)
        )
        return json.dumps({"ok": True})

    async def resume(self) -> list[dict[str, Any]]:
        return []

    async def run_round(self, content: Any, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {"role": "assistant", "content": content, "tool_calls": calls}
        ]
        for call in calls:
            function = call["function"]
            result = await self.call(function["name"], function["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return messages


def request(text: str, tools: Any = None) -> TurnRequest:
    return TurnRequest("k", "s", text, (), "", tools=tools)


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(usage={"prompt_tokens": 11, "completion_tokens": 5}) as server:
        yield server


async def test_the_reply_is_handed_over_as_it_grows_and_usage_comes_last(
    fake: FakeOpenAI,
) -> None:
    fake.script("one two three four")
    agent = OpenAIAgent(base_url=fake.base_url, model="m")
    seen: list[str] = []
    try:
        result = await agent.stream_turn(request("hi"), seen.append)
    finally:
        await agent.close()
    assert seen == ["one ", "one two ", "one two three ", "one two three four"]
    assert result.text == "one two three four"
    assert (result.usage.input_tokens, result.usage.output_tokens) == (11, 5)
    body = fake.requests[-1]["json"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


async def test_tool_calls_are_assembled_from_their_deltas(fake: FakeOpenAI) -> None:
    arguments = {"items": ["a long argument", "split across two deltas"], "n": 3}
    fake.script(tool_calls(("note", arguments), ("note", {"x": 1})), "done, noted")
    tools = RecordingTools()
    agent = OpenAIAgent(base_url=fake.base_url, model="m")
    seen: list[str] = []
    try:
        result = await agent.stream_turn(request("remember", tools), seen.append)
    finally:
        await agent.close()
    assert tools.calls == [("note", arguments), ("note", {"x": 1})]
    assert result.text == "done, noted" and seen[-1] == "done, noted"
    call_round = result.messages[0]
    assert [c["function"]["name"] for c in call_round["tool_calls"]] == ["note", "note"]
    assert json.loads(call_round["tool_calls"][0]["function"]["arguments"]) == arguments
    assert [m["role"] for m in result.messages] == ["assistant", "tool", "tool"]
    assert all(r["json"]["stream"] for r in fake.requests)


async def test_a_429_before_the_stream_is_retried(fake: FakeOpenAI) -> None:
    fake.fail_next(429, "slow down", retry_after=0)
    fake.script("fine")
    agent = OpenAIAgent(base_url=fake.base_url, model="m", backoff=(0.01,))
    try:
        result = await agent.stream_turn(request("hi"), lambda text: None)
    finally:
        await agent.close()
    assert result.text == "fine" and len(fake.requests) == 2
