"""Agents: the echo, openai and module:factory backends, and the per-session AgentCache."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from config import AgentConfig, ConfigError
from gateway.agents.backends import (
    AgentBackendError,
    agent_signature,
    build_agent_factory,
    describe_backend,
)
from gateway.agents.cache import AgentCache
from gateway.agents.openai import OpenAIAgent
from gateway.agents.protocol import AgentError, TurnRequest, TurnResult
from gateway.session import TokenUsage
from tests.fakes.openai_server import FakeOpenAI
from tests.waiting import wait_for

KEY = "sk-secret-0123456789abcdef"


def turn(text: str = "hello", history: tuple[dict[str, Any], ...] = (), system: str = ""):
    return TurnRequest(
        session_key="agent:main:local:dm:me",
        session_id="20240101_000000_abcdef01",
        text=text,
        history=history,
        system_prompt=system,
    )


# --- echo ----------------------------------------------------------------------------------


async def test_echo_replies_exactly_echo_colon_text():
    agent = build_agent_factory(AgentConfig())("k")
    result = await agent.run_turn(turn("[alice] hi  there"))
    assert result.text == "echo: [alice] hi  there"


async def test_echo_delay_is_cancellable_mid_sleep():
    agent = build_agent_factory(AgentConfig(delay_seconds=30.0))("k")
    task = asyncio.create_task(agent.run_turn(turn()))
    await asyncio.sleep(0)  # one loop step: without its delay the turn would be done
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=1.0)


async def test_echo_usage_counts_words_of_text_history_and_reply():
    agent = build_agent_factory(AgentConfig())("k")
    history = (
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "echo: one two"},
        {"role": "tool", "content": [{"type": "image"}]},  # not text: counts nothing
    )
    result = await agent.run_turn(turn("a b c", history))
    assert result.usage == TokenUsage(input_tokens=3 + 2 + 3, output_tokens=4)


# --- openai --------------------------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def agents() -> AsyncIterator[list[Any]]:
    """Agents a test appends here are closed after it."""
    built: list[Any] = []
    yield built
    for agent in built:
        await agent.close()


@pytest.fixture
def openai_agent(fake: FakeOpenAI, agents: list[Any]) -> Callable[..., OpenAIAgent]:
    def make(**kwargs: Any) -> OpenAIAgent:
        kwargs.setdefault("base_url", fake.base_url)
        kwargs.setdefault("model", "m")
        agents.append(OpenAIAgent(**kwargs))
        return agents[-1]

    return make


async def test_openai_sends_system_history_then_user_with_model_and_bearer(fake, agents):
    history = (
        {"role": "user", "content": "first", "timestamp": "2024-01-01T00:00:00Z"},
        {"role": "assistant", "content": "reply one"},
        {"role": "tool", "content": {"not": "text"}},
        {"role": "tool", "content": "tool said", "tool_call_id": "call_1"},
        {"role": "session_meta", "content": "internal"},
    )
    fake.expected_key = KEY
    config = AgentConfig(backend="openai", base_url=fake.base_url + "/", api_key=KEY)
    agents.append(build_agent_factory(config)("k"))
    await agents[0].run_turn(turn("now", history, system="You are terse."))
    [seen] = fake.requests
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["Authorization"] == f"Bearer {KEY}"
    assert seen["json"] == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "reply one"},
            {"role": "tool", "content": "tool said", "tool_call_id": "call_1"},
            {"role": "user", "content": "now"},
        ],
    }


async def test_openai_omits_empty_system_prompt_and_auth_header_without_key(fake, openai_agent):
    await openai_agent(model="llama3").run_turn(turn("hi"))
    [seen] = fake.requests
    assert seen["headers"]["Authorization"] is None
    assert seen["json"]["messages"] == [{"role": "user", "content": "hi"}]
    assert seen["json"]["model"] == "llama3"


async def test_openai_parses_reply_and_usage_including_cached_tokens(fake, openai_agent):
    fake.usage = {
        "prompt_tokens": 120,
        "completion_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    result = await openai_agent().run_turn(turn("ping"))
    assert result == TurnResult(
        "fake: ping", TokenUsage(input_tokens=120, output_tokens=9, cache_read_tokens=64)
    )


async def test_openai_wrong_key_is_an_error_naming_401_but_not_the_key(fake, openai_agent):
    fake.expected_key = "sk-the-right-one"
    with pytest.raises(AgentError) as caught:
        await openai_agent(api_key=KEY).run_turn(turn())
    assert "401" in str(caught.value)
    assert "Incorrect API key" in str(caught.value)
    assert KEY not in str(caught.value)
    assert len(fake.requests) == 1  # 4xx other than 429 is not retried


async def test_openai_retries_429_honouring_retry_after(fake, openai_agent):
    fake.fail_next(429, "Rate limit reached", retry_after=0)
    agent = openai_agent(backoff=(10.0, 10.0))  # only Retry-After: 0 keeps this fast
    result = await asyncio.wait_for(agent.run_turn(turn("again")), timeout=5)
    assert result.text == "fake: again"
    assert len(fake.requests) == 2


async def test_openai_gives_up_after_three_server_errors(fake, openai_agent):
    fake.fail_next(500, "The server had an error", times=3)
    with pytest.raises(AgentError, match="HTTP 500: The server had an error"):
        await openai_agent(backoff=(0.01, 0.01)).run_turn(turn())
    assert len(fake.requests) == 3


async def test_openai_error_message_is_truncated_to_200_chars(fake, openai_agent):
    fake.fail_next(400, "x" * 5000)
    with pytest.raises(AgentError) as caught:
        await openai_agent().run_turn(turn())
    assert str(caught.value) == "model server returned HTTP 400: " + "x" * 200


async def test_openai_malformed_json_is_an_agent_error(fake, openai_agent):
    fake.malformed_next()
    with pytest.raises(AgentError, match="malformed"):
        await openai_agent().run_turn(turn())


async def test_openai_connection_refused_is_an_agent_error(fake, openai_agent):
    await fake.stop()
    with pytest.raises(AgentError, match=r"cannot connect.*connection refused") as caught:
        await openai_agent(api_key=KEY).run_turn(turn())
    assert KEY not in str(caught.value)


async def test_openai_turn_is_cancellable_while_waiting_for_the_server(fake, openai_agent):
    fake.delay_next(30)
    task = asyncio.create_task(openai_agent().run_turn(turn()))
    await wait_for(lambda: fake.requests)  # at the server, which answers in 30 s
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=1.0)


# --- module:factory ------------------------------------------------------------------------


@pytest.fixture
def user_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    module = tmp_path / "my_backend_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            from gateway.agents.protocol import TurnResult

            class MyAgent:
                def __init__(self, session_key, options):
                    self.session_key, self.options = session_key, options

                async def run_turn(self, request):
                    return TurnResult(f"{self.options['greeting']} {request.text}")

                async def close(self):
                    pass

            def make(*, session_key, options):
                return MyAgent(session_key, options)

            def make_nothing(*, session_key, options):
                return "not an agent"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_backend_mod"
    sys.modules.pop("my_backend_mod", None)


async def test_module_factory_receives_session_key_and_options(user_backend: str):
    config = AgentConfig(backend=f"{user_backend}:make", options={"greeting": "hey"})
    agent = build_agent_factory(config)("agent:main:local:dm:me")
    assert agent.session_key == "agent:main:local:dm:me"
    assert (await agent.run_turn(turn("you"))).text == "hey you"


@pytest.mark.parametrize(
    ("backend", "problem"),
    [("no_such_module_xyz:make", "cannot import"), ("{mod}:missing", "no callable 'missing'")],
)
def test_bad_module_factory_fails_at_build_time_naming_agent_backend(
    user_backend: str, backend: str, problem: str
):
    config = AgentConfig(backend=backend.format(mod=user_backend))
    with pytest.raises(AgentBackendError, match=problem) as caught:
        build_agent_factory(config)
    assert "agent.backend" in str(caught.value)
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, ValueError)


def test_module_factory_returning_a_non_agent_is_an_agent_error(user_backend: str):
    factory = build_agent_factory(AgentConfig(backend=f"{user_backend}:make_nothing"))
    with pytest.raises(AgentError, match="run_turn"):
        factory("k")


# --- signature and description -------------------------------------------------------------


def test_agent_signature_tracks_model_and_key_without_revealing_the_key():
    base = AgentConfig(backend="openai", api_key=KEY)
    signature = agent_signature(base)
    assert len(signature) == 16 and signature == agent_signature(base.model_copy())
    assert agent_signature(base.model_copy(update={"model": "gpt-4o"})) != signature
    assert agent_signature(base.model_copy(update={"api_key": KEY + "x"})) != signature
    assert agent_signature(base.model_copy(update={"options": {"a": 1}})) != signature
    assert KEY not in signature


def test_describe_backend_names_the_backend_and_hides_the_key():
    assert describe_backend(AgentConfig()).startswith("echo (replies 'echo: <text>'")
    config = AgentConfig(
        backend="openai", model="m1", base_url="http://user:pw@127.0.0.1:9/v1", api_key=KEY
    )
    line = describe_backend(config)
    assert line == "openai model=m1 base_url=http://***@127.0.0.1:9/v1 api_key=set"


# --- AgentCache ----------------------------------------------------------------------------


class FakeAgent:
    def __init__(self, key: str, fail_close: bool = False) -> None:
        self.key, self.fail_close, self.closed = key, fail_close, False

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        return TurnResult("ok")

    async def close(self) -> None:
        self.closed = True
        if self.fail_close:
            raise OSError("close exploded")


class Builder:
    """An AgentFactory that remembers every agent it built."""

    def __init__(self, failing_close: frozenset[str] = frozenset()) -> None:
        self.built: list[FakeAgent] = []
        self.failing_close = failing_close

    def __call__(self, session_key: str) -> FakeAgent:
        agent = FakeAgent(session_key, session_key in self.failing_close)
        self.built.append(agent)
        return agent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def use(cache: AgentCache, key: str, signature: str = "s1") -> FakeAgent:
    """One complete turn's worth of acquire + release."""
    async with cache.lease(key, signature) as agent:
        return agent


async def test_cache_counts_hits_and_misses_and_reuses_the_agent():
    builder = Builder()
    cache = AgentCache(builder)
    first = await use(cache, "a")
    assert await use(cache, "a") is first
    await use(cache, "b")
    assert cache.stats() == {"size": 2, "in_use": 0, "hits": 1, "misses": 2, "evictions": 0}
    assert "a" in cache and len(cache) == 2


async def test_cache_evicts_least_recently_used_and_closes_it():
    builder = Builder()
    cache = AgentCache(builder, max_size=2)
    a, b = await use(cache, "a"), await use(cache, "b")
    await use(cache, "a")  # a is now most recent, b the LRU
    await use(cache, "c")
    assert "b" not in cache and b.closed
    assert "a" in cache and not a.closed
    await use(cache, "d")
    assert "a" not in cache and a.closed
    assert cache.stats()["evictions"] == 2


async def test_cache_never_evicts_an_agent_in_use():
    builder = Builder()
    cache = AgentCache(builder, max_size=2)
    agents = [await cache.acquire(key, "s1") for key in ("a", "b", "c")]
    assert len(cache) == 3 and not any(agent.closed for agent in agents)
    assert cache.stats()["in_use"] == 3
    for key in ("a", "b", "c"):
        cache.release(key)
    await use(cache, "d")
    assert [agent.closed for agent in agents] == [True, True, False]
    assert "c" in cache and "d" in cache and len(cache) == 2


async def test_eviction_takes_the_least_recently_released_agents_past_those_in_use():
    cache = AgentCache(Builder(), max_size=2)
    a, b = [await cache.acquire(key, "s1") for key in ("a", "b")]
    c = await use(cache, "c")  # over the size: nothing was idle to make room
    assert len(cache) == 3 and not c.closed
    d = await use(cache, "d")  # c is the one idle agent: it goes, a and b stay
    assert c.closed and not (a.closed or b.closed or d.closed)
    cache.release("b")
    cache.release("a")  # idle, least recently released first: d, b, a
    e = await use(cache, "e")
    assert d.closed and b.closed and not a.closed and not e.closed
    assert "a" in cache and "e" in cache and len(cache) == 2
    assert cache.stats()["evictions"] == 3


async def test_cache_rebuilds_and_closes_old_agent_when_signature_changes():
    builder = Builder()
    cache = AgentCache(builder)
    old = await use(cache, "a", "s1")
    new = await use(cache, "a", "s2")
    assert new is not old and old.closed and not new.closed
    assert cache.stats()["misses"] == 2 and len(cache) == 1


async def test_cache_signature_change_mid_turn_closes_old_agent_after_release():
    cache = AgentCache(Builder())
    old = await cache.acquire("a", "s1")
    new = await cache.acquire("a", "s2")
    assert new is not old and not old.closed
    cache.release("a")
    cache.release("a")
    await wait_for(lambda: old.closed)  # closed in the background
    assert not new.closed


async def test_sweep_idle_evicts_only_idle_agents_past_the_ttl():
    clock = Clock()
    cache = AgentCache(Builder(), idle_ttl=60, clock=clock)
    stale = await use(cache, "stale")
    busy = await cache.acquire("busy", "s1")
    clock.now += 30
    fresh = await use(cache, "fresh")
    clock.now += 31
    assert await cache.sweep_idle() == 1
    assert stale.closed and not fresh.closed and not busy.closed
    assert "stale" not in cache and "busy" in cache and "fresh" in cache


async def test_evict_while_in_use_is_deferred_until_release():
    cache = AgentCache(Builder())
    agent = await cache.acquire("a", "s1")
    assert await cache.evict("a") is False
    assert "a" in cache and not agent.closed
    cache.release("a")
    await wait_for(lambda: agent.closed)  # closed in the background
    assert "a" not in cache
    assert await cache.evict("a") is False  # nothing left to evict


async def test_evict_idle_agent_closes_it_now():
    cache = AgentCache(Builder())
    agent = await use(cache, "a")
    assert await cache.evict("a") is True
    assert agent.closed and "a" not in cache


async def test_a_failing_close_does_not_break_eviction():
    cache = AgentCache(Builder(failing_close=frozenset({"a", "b"})), max_size=1)
    a = await use(cache, "a")
    b = await use(cache, "b")  # evicts a, whose close raises
    assert a.closed and "a" not in cache
    assert await cache.evict("b") is True
    assert b.closed and len(cache) == 0


async def test_lease_releases_when_the_turn_raises():
    cache = AgentCache(Builder())
    with pytest.raises(RuntimeError):
        async with cache.lease("a", "s1"):
            raise RuntimeError("turn failed")
    assert cache.stats()["in_use"] == 0


async def test_close_all_closes_every_agent_including_in_use():
    cache = AgentCache(Builder())
    idle = await use(cache, "idle")
    busy = await cache.acquire("busy", "s1")
    await cache.close_all()
    assert idle.closed and busy.closed and len(cache) == 0
