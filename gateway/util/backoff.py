"""Reconnect backoff: the delays between attempts to reach a server that went away (a
platform's gateway, the PostgreSQL server), for the adapters and the replicas' cluster
loops alike."""

from __future__ import annotations

import asyncio
import random


class Backoff:
    """Exponential backoff with jitter and a cap, for reconnect loops.

    `delay()` gives the next wait: `initial`, times `factor` each attempt, at most
    `maximum`, each jittered by +-`jitter` (a fraction) so that clients that lost a
    server together do not retry in step; `reset()` after a connection that worked.
    `attempt` counts the delays given since the last reset.
    """

    def __init__(
        self, initial: float = 1.0, maximum: float = 60.0, factor: float = 2.0, jitter: float = 0.1
    ) -> None:
        self.initial, self.maximum, self.factor, self.jitter = initial, maximum, factor, jitter
        self.attempt = 0
        # The running base, not initial * factor**attempt: that power overflows a float
        # after about a thousand attempts, which a loop retrying for hours reaches.
        self._next = initial

    def delay(self) -> float:
        base = min(self.maximum, self._next)
        self._next = min(self.maximum, self._next * self.factor)
        self.attempt += 1
        return base * (1 + random.uniform(-self.jitter, self.jitter))

    def reset(self) -> None:
        self.attempt = 0
        self._next = self.initial

    async def sleep(self) -> float:
        seconds = self.delay()
        await asyncio.sleep(seconds)
        return seconds
