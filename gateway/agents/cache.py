"""`AgentCache`: one agent per session key (LRU, idle TTL), never evicted mid-turn.

Cancelling the task that awaits ``run_turn`` stops the turn; the lease is released in
its ``finally`` all the same.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gateway.agents.protocol import Agent, AgentFactory

__all__ = ["AgentCache", "AgentLease"]

log = structlog.get_logger(__name__)


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
        self._entries: dict[str, _CacheEntry] = {}
        # The keys of the agents not in use, least recently released first: eviction
        # takes from its front, so no acquire scans past the agents in use.
        self._idle: OrderedDict[str, None] = OrderedDict()
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
            if not entry.in_use:
                del self._idle[session_key]
            entry.in_use += 1
        else:
            self._misses += 1
            agent = self._factory(session_key)
            in_use = 1
            if entry is not None:
                del self._entries[session_key]
                self._idle.pop(session_key, None)
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
        else:
            self._idle[session_key] = None

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
        del self._idle[session_key]
        self._evictions += 1
        await self._close_quietly(entry.agent, session_key)
        return True

    async def sweep_idle(self) -> int:
        """Evict agents not in use and unused for longer than ``idle_ttl``; returns how many."""
        cutoff = self._clock() - self.idle_ttl
        stale = [key for key in self._idle if self._entries[key].last_used < cutoff]
        for key in stale:
            del self._idle[key]
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
        self._idle.clear()
        self._retired.clear()
        for key, agent in victims:
            await self._close_quietly(agent, key)
        if self._closing:
            await asyncio.gather(*self._closing)

    def _pop_lru_overflow(self) -> list[Agent]:
        overflow = len(self._entries) - self.max_size
        victims: list[Agent] = []
        idle = self._idle
        while overflow > 0 and idle:
            key, _ = idle.popitem(last=False)
            victims.append(self._entries.pop(key).agent)
            overflow -= 1
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
