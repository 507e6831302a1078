"""Turn deadlines: `agent.gateway_timeout` (each agent's own) for every running turn,
with one timer.

`asyncio.timeout` per turn would make a Timeout object and a timer handle for every
turn, a cost the turn's path notices. Here a turn's deadline is a dict entry, and one
timer, running only while some turn has a deadline, cancels the turns whose time
is up. A deadline is therefore met up to a tick late: a quarter of the limit, at most a
second, which a limit of minutes cannot tell apart.

A turn waiting for someone else (the user's /approve) stops its clock meanwhile
(`paused`): the limit guards the agent's work, not the user's answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class Deadlines:
    """`limit`: the default deadline, and the shortest any turn gets (it sets the tick:
    several agents pass the smallest of their timeouts)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.tick = min(1.0, limit / 4)
        self._due: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def arm(self, task: asyncio.Task[object], limit: float | None = None) -> None:
        """Start `task`'s clock (`limit` seconds, default `self.limit`); `disarm` it
        when the guarded await is over."""
        loop = task.get_loop()
        self._due[task] = loop.time() + (self.limit if limit is None else limit)
        if self._timer is None:
            self._timer = loop.call_later(self.tick, self._check, loop)

    def disarm(self, task: asyncio.Task[object]) -> bool:
        """Stop `task`'s clock; True when its time ran out (this cancelled it)."""
        self._due.pop(task, None)
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    @contextmanager
    def paused(self, task: asyncio.Task[object] | None) -> Iterator[None]:
        """Stop `task`'s clock for the `with` block; it then goes on with the time it had
        left. A task without a clock (none armed, or not a turn) is left alone."""
        due = self._due.pop(task, None) if task is not None else None
        if task is None or due is None:
            yield
            return
        left = due - task.get_loop().time()
        try:
            yield
        finally:
            self.arm(task, max(left, 0.0))

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        late = [task for task, due in self._due.items() if due <= now]
        for task in late:
            del self._due[task]
            self._expired.add(task)
            task.cancel("turn deadline")
        self._timer = loop.call_later(self.tick, self._check, loop) if self._due else None
