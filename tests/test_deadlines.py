"""Turn deadlines with one shared timer (gateway.runner.deadlines)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.runner.deadlines import Deadlines


async def guarded(deadlines: Deadlines, seconds: float) -> str:
    task = asyncio.current_task()
    assert task is not None
    deadlines.arm(task)  # type: ignore[arg-type]
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if deadlines.disarm(task) and task.uncancel() == 0:  # type: ignore[arg-type]
            return "timed out"
        raise
    finally:
        deadlines.disarm(task)  # type: ignore[arg-type]
    return "done"


async def test_a_turn_over_its_limit_is_cancelled_and_told_apart_from_a_stop() -> None:
    deadlines = Deadlines(0.2)
    slow = asyncio.create_task(guarded(deadlines, 5))
    quick = asyncio.create_task(guarded(deadlines, 0.01))
    stopped = asyncio.create_task(guarded(deadlines, 5))
    await asyncio.sleep(0.05)
    stopped.cancel()  # a /stop: not the deadline's
    assert await quick == "done"
    with pytest.raises(asyncio.CancelledError):
        await stopped
    assert await asyncio.wait_for(slow, 2) == "timed out"


async def test_the_timer_runs_only_while_a_turn_has_a_deadline() -> None:
    deadlines = Deadlines(0.2)
    assert await guarded(deadlines, 0.01) == "done"
    await asyncio.sleep(0.12)  # one tick (0.05 s) and more: it found nothing and stopped
    assert deadlines._timer is None
    assert await asyncio.wait_for(guarded(deadlines, 5), 2) == "timed out"
    assert deadlines._timer is None


async def test_a_paused_clock_does_not_run_and_goes_on_with_the_time_left() -> None:
    deadlines = Deadlines(0.3)
    waited = asyncio.Event()

    async def turn() -> str:
        task = asyncio.current_task()
        assert task is not None
        deadlines.arm(task)  # type: ignore[arg-type]
        try:
            with deadlines.paused(task):  # type: ignore[arg-type]
                await asyncio.sleep(0.9)  # three limits: the user takes their time
            waited.set()
            await asyncio.sleep(5)  # the agent's own work: over the time it has left
        except asyncio.CancelledError:
            if deadlines.disarm(task) and task.uncancel() == 0:  # type: ignore[arg-type]
                return "timed out"
            raise
        finally:
            deadlines.disarm(task)  # type: ignore[arg-type]
        return "done"

    assert await asyncio.wait_for(turn(), 3) == "timed out"
    assert waited.is_set()  # cancelled after the pause, not during it
    assert deadlines._due == {} and deadlines._expired == set()


async def test_pausing_a_task_without_a_clock_changes_nothing() -> None:
    deadlines = Deadlines(0.2)
    task = asyncio.current_task()
    with deadlines.paused(task):  # type: ignore[arg-type]
        pass
    with deadlines.paused(None):
        pass
    assert deadlines._due == {} and deadlines._timer is None
