"""The OpenAI-compatible endpoint (gateway/openai_compat/, docs/http-api.md) through the
unmodified `openai` SDK, against a live daemon (`hermes-gateway run` subprocess) whose
agent's model is the fake OpenAI server in this process: answers, streamed and not,
with the turn's usage; conversations kept by the gateway (the model sees the earlier
exchange; two sessions of one user apart); dedup by message id; refusals (a wrong
token, client tools, an unknown model, bad input). Then, in this process over the A2A
tests' harness (tests/a2a_support.py, which mounts both protocols) where a test needs
the runner's hand: a tool approval asked and answered, a client gone mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.domain.agent_tasks import TaskState
from scripts.harness import Daemon
from tests.a2a_support import A2aGateway
from tests.fakes.openai_server import FakeOpenAI
from tests.test_agent_tasks import AskingAgent
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-openai-token"
USAGE = {"prompt_tokens": 11, "completion_tokens": 5}


@dataclass
class Rig:
    daemon: Daemon
    fake: FakeOpenAI
    client: AsyncOpenAI

    def chats(self) -> list[list[dict[str, Any]]]:
        """The messages of each request the model got, oldest first."""
        return [r["json"]["messages"] for r in self.fake.requests if r["json"]]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with FakeOpenAI(usage=USAGE) as fake:
        daemon = Daemon(tmp_path / "home", f"    token: {TOKEN}\n")
        (daemon.home / "hermes.yaml").write_text(
            f"platforms:\n  http:\n    enabled: true\n    port: {daemon.port}\n"
            f"    token: {TOKEN}\n"
            "agent:\n  backend: openai\n"
            f"  base_url: {fake.base_url}\n  model: fake-model\n"
            "agents:\n  helper:\n    backend: echo\n"
        )
        client = AsyncOpenAI(base_url=f"{daemon.url}/v1", api_key=TOKEN, max_retries=0)
        try:
            await asyncio.to_thread(daemon.start)
            yield Rig(daemon, fake, client)
        finally:
            await client.close()
            if daemon.alive():
                await asyncio.to_thread(daemon.stop)
            daemon.ensure_stopped()


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def test_a_chat_completion_is_the_agents_reply_with_the_turns_usage(rig: Rig) -> None:
    answer = await rig.client.chat.completions.create(
        model="main", messages=user("hello there"), user="ann"
    )
    assert answer.object == "chat.completion"
    assert answer.model == "main"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == "fake: hello there"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (11, 5)
    assert answer.usage.total_tokens == 16


async def test_the_second_request_has_the_first_exchange_in_the_models_history(
    rig: Rig,
) -> None:
    first = await rig.client.chat.completions.create(
        model="main", messages=user("my name is Ann"), user="ann"
    )
    # The client resends the whole conversation; only its last message is new.
    resent = [
        {"role": "system", "content": "ignored: the agent has its own prompt"},
        *user("my name is Ann"),
        {"role": "assistant", "content": first.choices[0].message.content},
        *user("what is my name?"),
    ]
    second = await rig.client.chat.completions.create(model="main", messages=resent, user="ann")
    assert second.choices[0].message.content == "fake: what is my name?"
    history = [(m["role"], m["content"]) for m in rig.chats()[-1] if m["role"] != "system"]
    assert history == [
        ("user", "my name is Ann"),
        ("assistant", "fake: my name is Ann"),
        ("user", "what is my name?"),
    ]
    assert "ignored" not in str(rig.chats()[-1])


async def test_two_sessions_of_one_user_are_kept_apart(rig: Rig) -> None:
    for session, text in (("a", "first in a"), ("b", "first in b"), ("a", "second in a")):
        await rig.client.chat.completions.create(
            model="main",
            messages=user(text),
            user="ann",
            extra_headers={"X-Hermes-Session": session},
        )
    users = [[m["content"] for m in chat if m["role"] == "user"] for chat in rig.chats()]
    assert users == [["first in a"], ["first in b"], ["first in a", "second in a"]]
    # another user's default conversation is theirs alone too
    await rig.client.chat.completions.create(model="main", messages=user("bob here"), user="bob")
    assert [m["content"] for m in rig.chats()[-1] if m["role"] == "user"] == ["bob here"]


async def test_a_streamed_answer_arrives_in_deltas_that_join_to_the_reply(rig: Rig) -> None:
    rig.fake.stream_delay = 0.05  # 60 words over 3 s: the runner pushes several pieces
    words = " ".join(f"word{n}" for n in range(60))
    stream = await rig.client.chat.completions.create(
        model="main",
        messages=user(words),
        user="ann",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in with_choices if c.choices[0].delta.content]
    assert len(pieces) >= 2, pieces
    assert "".join(pieces) == f"fake: {words}"
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (11, 5)


async def test_the_same_message_id_twice_is_one_turn_with_one_reply(rig: Rig) -> None:
    headers = {"X-Hermes-Message-Id": "m-1"}
    answers = [
        await rig.client.chat.completions.create(
            model="main", messages=user("once only"), user="ann", extra_headers=headers
        )
        for _ in range(2)
    ]
    assert len(rig.fake.requests) == 1
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].id == answers[1].id
    # without the header every request is a turn of its own
    for _ in range(2):
        await rig.client.chat.completions.create(
            model="main", messages=user("once only"), user="ann"
        )
    assert len(rig.fake.requests) == 3


async def test_models_lists_the_agents(rig: Rig) -> None:
    models = [model async for model in rig.client.models.list()]
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        ("main", "model", "hermes-gateway"),
        ("helper", "model", "hermes-gateway"),
    ]
    answer = await rig.client.chat.completions.create(model="helper", messages=user("hi"))
    assert "hi" in (answer.choices[0].message.content or "")


async def test_refusals_are_openai_errors_and_run_no_turn(rig: Rig) -> None:
    wrong = AsyncOpenAI(base_url=f"{rig.daemon.url}/v1", api_key="wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model="main", messages=user("hi"))
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
    finally:
        await wrong.close()
    with pytest.raises(openai.NotFoundError) as missing:
        await rig.client.chat.completions.create(model="gpt-4o", messages=user("hi"))
    assert missing.value.code == "model_not_found"
    assert "main" in missing.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as tools:
        await rig.client.chat.completions.create(model="main", messages=user("hi"), tools=[tool])
    assert "tools run in the gateway" in tools.value.message
    bad: list[Any] = [
        [{"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": "   "}],
        [],
    ]
    for messages in bad:
        with pytest.raises(openai.BadRequestError):
            await rig.client.chat.completions.create(model="main", messages=messages)
    with pytest.raises(openai.BadRequestError):
        await rig.client.chat.completions.create(
            model="main", messages=user("hi"), extra_headers={"X-Hermes-Session": "x" * 300}
        )
    async with httpx.AsyncClient(timeout=10) as http:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        url = f"{rig.daemon.url}/v1/chat/completions"
        not_json = await http.post(url, content=b"{", headers=auth)
        huge = await http.post(url, content=b"x" * 70_000, headers=auth)
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    assert huge.status_code == 413
    assert rig.fake.requests == []


async def test_text_parts_are_joined_and_unknown_fields_ignored(rig: Rig) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    answer = await rig.client.chat.completions.create(
        model="main",
        messages=[{"role": "user", "content": parts}],
        temperature=0.2,
        max_tokens=5,
    )
    assert answer.choices[0].message.content == "fake: one\ntwo"


# --- in process: the runner's hand ------------------------------------------------------


def sdk(gateway: A2aGateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


async def test_an_approval_question_is_the_answer_and_approve_gets_the_reply(
    tmp_path: Path,
) -> None:
    agent = AskingAgent()
    running = await A2aGateway.started(tmp_path, agent_factory=lambda key: agent)
    agent.runner = running.runner
    client = sdk(running)
    try:
        asked = await client.chat.completions.create(model="main", messages=user("go"))
        answered = await client.chat.completions.create(model="main", messages=user("/approve"))
    finally:
        await client.close()
        await running.stop()
    question = asked.choices[0].message.content or ""
    assert "launch" in question and "/approve" in question
    assert asked.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.content == "verdict: approved"
    assert answered.id == asked.id  # the answer continued the waiting turn


async def test_a_client_gone_mid_stream_leaves_the_turn_running_to_its_end(
    tmp_path: Path,
) -> None:
    running = await A2aGateway.started(tmp_path)
    client = sdk(running)
    words = " ".join(f"stream{n}" for n in range(40))  # "stream": 0.05 s a word
    try:
        stream = await client.chat.completions.create(
            model="main", messages=user(words), user="ann", stream=True
        )
        first = await anext(aiter(stream))
        await stream.close()  # gone, the turn still running
        tasks = running.runner.agent_tasks
        await wait_for(
            lambda: _done(tasks, "openai:ann"),
            within=30,
        )
        after = await client.chat.completions.create(
            model="main", messages=user("next"), user="ann"
        )
    finally:
        await client.close()
        await running.stop()
    assert first.choices[0].delta.role == "assistant"
    # the agent says the user's previous message: the one whose stream was left
    assert after.choices[0].message.content == f"echo: next (after: {words})"


async def _done(tasks: Any, caller: str) -> bool:
    listed = await tasks.list(caller)
    return bool(listed) and listed[-1].state is TaskState.COMPLETED
