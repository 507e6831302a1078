"""Counting for the HTTP API's log and /metrics: a per-kind log line limit, and a
prometheus_client collector made of a function."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric


class RepeatLimit:
    """At most one log line per `seconds` for a kind of per-client event: `due()` says
    whether this one is logged, and `unlogged` counts those skipped since the last line
    (the next line carries them), so many clients cannot flood the log."""

    def __init__(self, seconds: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self.clock = clock
        self.unlogged = 0
        self._logged_at: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.seconds:
            self.unlogged += 1
            return False
        self._logged_at = now
        return True


class FunctionCollector:
    """A prometheus_client collector made of a function that yields metric families."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect
