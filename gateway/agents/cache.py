"""Agents: the protocol the runner talks to, the built-in backends and the per-session cache.

Backends (``agent.backend``): ``echo`` (the zero-config default), ``openai`` (any
OpenAI-compatible chat-completions endpoint, in `gateway.agents.openai`) and
``module.path:factory`` for your own. A user factory is called as
``factory(session_key=str, options=dict)`` and must return an object with
``async run_turn(TurnRequest) -> TurnResult`` and ``async close()``.

`AgentCache` keeps one agent per session key (LRU, idle TTL) and never evicts an agent
while a turn is using it. Cancelling the task that awaits ``run_turn`` stops the turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import structlog

from config import AgentConfig, ConfigError
from gateway.session import SessionSource, TokenUsage

__all__ = [
    "Agent",
    "AgentBackendError",
    "AgentCache",
    "AgentError",
    "AgentFactory",
    "EchoAgent",
    "TurnRequest",
    "TurnResult",
    "agent_signature",
    "build_agent_factory",
    "describe_backend",
]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn for an agent: the user's text plus what came before it."""

    session_key: str
    session_id: str
    text: str  # this turn's user message ([sender]-prefixed in shared sessions)
    history: tuple[dict[str, Any], ...]  # earlier transcript messages, oldest first
    system_prompt: str  # session-context block (+ configured system prompt); may be ""
    source: SessionSource | None = None


@dataclass(frozen=True, slots=True)
class TurnResult:
    text: str
    usage: TokenUsage = field(default_factory=TokenUsage)


class Agent(Protocol):
    async def run_turn(self, request: TurnRequest) -> TurnResult: ...

    async def close(self) -> None: ...


class AgentError(RuntimeError):
    """The backend failed; ``str()`` is a short, user-safe reason (never a key or token)."""


class AgentBackendError(ConfigError, ValueError):
    """``agent.backend`` names a module or factory that cannot be used (exit code 78)."""


AgentFactory = Callable[[str], Agent]


# --- backends ------------------------------------------------------------------------------


def _word_count(content: Any) -> int:
    return len(content.split()) if isinstance(content, str) else 0


class EchoAgent:
    """Replies ``echo: <text>``, optionally after ``delay_seconds`` (a stand-in slow model).

    Usage is counted in words so token counters move deterministically.
    """

    def __init__(self, delay_seconds: float = 0.0) -> None:
        self.delay_seconds = delay_seconds

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if self.delay_seconds > 0:
            await asyncio.sleep(self.delay_seconds)
        reply = f"echo: {request.text}"
        input_tokens = _word_count(request.text) + sum(
            _word_count(message.get("content")) for message in request.history
        )
        return TurnResult(reply, TokenUsage(input_tokens, _word_count(reply)))

    async def close(self) -> None:
        return None


def _load_user_factory(backend: str) -> Callable[..., Any]:
    module_name, _, attr = backend.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AgentBackendError(
            f"agent.backend: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc}); check the name and that it is on PYTHONPATH"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AgentBackendError(
            f"agent.backend: module {module_name!r} has no callable {attr!r}; "
            "expected a function factory(session_key=..., options=...) returning an agent"
        )
    return factory


def _user_factory(backend: str, options: dict[str, Any]) -> AgentFactory:
    factory = _load_user_factory(backend)

    def build(session_key: str) -> Agent:
        try:
            agent = factory(session_key=session_key, options=dict(options))
        except Exception as exc:
            log.exception("agent_factory_failed", backend=backend)
            raise AgentError(f"the agent backend could not start ({type(exc).__name__})") from exc
        if inspect.isawaitable(agent) or not all(
            callable(getattr(agent, name, None)) for name in ("run_turn", "close")
        ):
            if inspect.iscoroutine(agent):
                agent.close()  # never awaited; silence the "never awaited" warning
            raise AgentError(
                f"agent.backend {backend!r} returned {type(agent).__name__}, "
                "not an object with async run_turn() and close()"
            )
        return agent

    return build


def build_agent_factory(config: AgentConfig) -> AgentFactory:
    """A function session_key -> new Agent for ``config.backend``.

    A ``module:factory`` backend is imported here, so a bad name fails at start-up with
    `AgentBackendError` (a `ConfigError`) rather than at the first message.
    """
    if config.backend == "echo":
        return lambda session_key: EchoAgent(config.delay_seconds)
    if config.backend == "openai":
        # Imported here because gateway.agents.openai imports this module's types.
        from gateway.agents.openai import OpenAIAgent

        return lambda session_key: OpenAIAgent(
            base_url=config.base_url, model=config.model, api_key=config.api_key
        )
    return _user_factory(config.backend, config.options)


def agent_signature(config: AgentConfig) -> str:
    """A stable hash of the settings that shape an agent; a change means rebuild it.

    The API key enters only as its own sha256, so the signature never reveals it.
    """
    key_hash = hashlib.sha256(config.api_key.encode()).hexdigest() if config.api_key else None
    shape = {
        "backend": config.backend,
        "model": config.model,
        "base_url": config.base_url,
        "system_prompt": config.system_prompt,
        "delay_seconds": config.delay_seconds,
        "options": config.options,
        "api_key_sha256": key_hash,
    }
    encoded = json.dumps(shape, sort_keys=True, default=repr).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def _redacted_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}:{parts.port}" if parts.port else f"***@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def describe_backend(config: AgentConfig) -> str:
    """One line for the start-up log (never includes the API key)."""
    if config.backend == "echo":
        delay = f", delay {config.delay_seconds:g}s" if config.delay_seconds else ""
        return f"echo (replies 'echo: <text>'{delay}; set agent.backend to use a real model)"
    if config.backend == "openai":
        key = "set" if config.api_key else "unset"
        return (
            f"openai model={config.model} base_url={_redacted_url(config.base_url)} api_key={key}"
        )
    return f"custom factory {config.backend} (options: {', '.join(sorted(config.options)) or '-'})"


# --- cache ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _CacheEntry:
    agent: Agent
    signature: str
    last_used: float
    in_use: int = 0
    evict_on_release: bool = False


class AgentCache:
    """One agent per session key, least recently used first out.

    ``acquire``/``release`` bracket a turn (or use ``async with cache.lease(...)``). An
    agent in use is never closed: LRU eviction skips it (the cache may exceed
    ``max_size`` until it is released) and ``evict`` defers to its release. Agents idle
    longer than ``idle_ttl`` seconds go on ``sweep_idle``. Errors from ``close()`` are
    logged, never raised.
    """

    def __init__(
        self,
        factory: AgentFactory,
        max_size: int = 128,
        idle_ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self._factory = factory
        self.max_size = max_size
        self.idle_ttl = idle_ttl
        self._clock = clock
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        # Agents replaced (signature change) while in use; closed when the key goes idle.
        self._retired: dict[str, list[Agent]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._hits = self._misses = self._evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_key: object) -> bool:
        return session_key in self._entries

    def stats(self) -> dict[str, int]:
        return {
            "size": len(self._entries),
            "in_use": sum(1 for entry in self._entries.values() if entry.in_use),
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
        }

    async def acquire(self, session_key: str, signature: str) -> Agent:
        """The session's agent, built (or rebuilt on a new signature) if needed; marks it in use."""
        # All bookkeeping happens before the first await, so concurrent callers never see
        # a half-updated cache; closing old agents comes last.
        entry = self._entries.get(session_key)
        to_close: list[Agent] = []
        if entry is not None and entry.signature == signature:
            self._hits += 1
            self._entries.move_to_end(session_key)
            entry.in_use += 1
        else:
            self._misses += 1
            agent = self._factory(session_key)
            in_use = 1
            if entry is not None:
                del self._entries[session_key]
                if entry.in_use:
                    # Another lease still runs on the old agent: close it once the key is idle.
                    self._retired.setdefault(session_key, []).append(entry.agent)
                    in_use += entry.in_use
                else:
                    to_close.append(entry.agent)
            entry = _CacheEntry(agent, signature, self._clock(), in_use=in_use)
            self._entries[session_key] = entry
            to_close.extend(self._pop_lru_overflow())
        entry.last_used = self._clock()
        for old in to_close:
            await self._close_quietly(old, session_key)
        return entry.agent

    def release(self, session_key: str) -> None:
        """End of a turn: the agent may be evicted again; closes it if eviction was deferred."""
        entry = self._entries.get(session_key)
        if entry is None or entry.in_use == 0:
            return
        entry.in_use -= 1
        entry.last_used = self._clock()
        if entry.in_use:
            return
        for old in self._retired.pop(session_key, []):
            self._close_in_background(old, session_key)
        if entry.evict_on_release:
            del self._entries[session_key]
            self._evictions += 1
            self._close_in_background(entry.agent, session_key)

    def lease(self, session_key: str, signature: str) -> AgentLease:
        """``async with cache.lease(key, sig) as agent:`` = acquire, then release in finally."""
        return AgentLease(self, session_key, signature)

    async def evict(self, session_key: str) -> bool:
        """Close and drop the session's agent. If it is in use, do that at release and
        return False; also False when there is no agent for the key."""
        entry = self._entries.get(session_key)
        if entry is None:
            return False
        if entry.in_use:
            entry.evict_on_release = True
            return False
        del self._entries[session_key]
        self._evictions += 1
        await self._close_quietly(entry.agent, session_key)
        return True

    async def sweep_idle(self) -> int:
        """Evict agents not in use and unused for longer than ``idle_ttl``; returns how many."""
        cutoff = self._clock() - self.idle_ttl
        stale = [
            key
            for key, entry in self._entries.items()
            if not entry.in_use and entry.last_used < cutoff
        ]
        victims = [(key, self._entries.pop(key).agent) for key in stale]
        self._evictions += len(victims)
        for key, agent in victims:
            await self._close_quietly(agent, key)
        return len(victims)

    async def close_all(self) -> None:
        """Close every agent, in use or not (shutdown), and wait for pending closes."""
        victims = [(key, entry.agent) for key, entry in self._entries.items()]
        victims += [(key, agent) for key, agents in self._retired.items() for agent in agents]
        self._entries.clear()
        self._retired.clear()
        for key, agent in victims:
            await self._close_quietly(agent, key)
        if self._closing:
            await asyncio.gather(*self._closing)

    def _pop_lru_overflow(self) -> list[Agent]:
        overflow = len(self._entries) - self.max_size
        if overflow <= 0:
            return []
        # Oldest first (LRU order): the first idle entries are the victims, so stop there
        # instead of scanning the whole cache on every acquire.
        idle_keys: list[str] = []
        for key, entry in self._entries.items():
            if not entry.in_use:
                idle_keys.append(key)
                if len(idle_keys) == overflow:
                    break
        victims = [self._entries.pop(key).agent for key in idle_keys]
        self._evictions += len(victims)
        return victims

    def _close_in_background(self, agent: Agent, session_key: str) -> None:
        # release() is sync (it runs in finally blocks), so the close runs as a task that
        # close_all() waits for.
        task = asyncio.get_running_loop().create_task(self._close_quietly(agent, session_key))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_quietly(self, agent: Agent, session_key: str) -> None:
        try:
            await agent.close()
        except Exception:
            log.exception("agent_close_failed", session_key=session_key)


class AgentLease:
    """What `AgentCache.lease` returns. A plain class rather than `@asynccontextmanager`:
    every turn enters one, and the generator machinery cost more than the lease."""

    __slots__ = ("_cache", "_key", "_signature")

    def __init__(self, cache: AgentCache, session_key: str, signature: str) -> None:
        self._cache = cache
        self._key = session_key
        self._signature = signature

    async def __aenter__(self) -> Agent:
        return await self._cache.acquire(self._key, self._signature)

    async def __aexit__(self, *exc_info: object) -> None:
        self._cache.release(self._key)
