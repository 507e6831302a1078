"""Waiting in tests for a condition, polled: bounded in time, never a bare sleep.

The bounds are generous: a wait ends as soon as its condition holds, so a long bound
costs nothing when the code works, and a loaded machine (two suites on two cores) is
slow to get there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(predicate: Callable[[], Any], within: float = 15.0) -> None:
    """Until `predicate()` (a value or an awaitable) is truthy; AssertionError after
    `within` seconds."""
    deadline = time.monotonic() + within
    while not await _truthy(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {within} s")
        await asyncio.sleep(0.02)


async def _truthy(value: Any) -> bool:
    return bool(await value) if isinstance(value, Awaitable) else bool(value)


def wait_blocking(predicate: Callable[[], Any], within: float = 30.0) -> None:
    """`wait_for` for tests with no loop of their own (a daemon in a subprocess, the
    fakes on a thread): blocks until `predicate()` is truthy."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {within} s")
        time.sleep(0.02)
