"""Waiting in async tests for a condition, polled: bounded in time, never a bare sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(predicate: Callable[[], Any], within: float = 5.0) -> None:
    """Until `predicate()` (a value or an awaitable) is truthy; AssertionError after
    `within` seconds."""
    deadline = time.monotonic() + within
    while not await _truthy(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {within} s")
        await asyncio.sleep(0.02)


async def _truthy(value: Any) -> bool:
    return bool(await value) if isinstance(value, Awaitable) else bool(value)
