"""The scheduler: fires due schedules as agent turns, each fire time exactly once.

    loop:   sleep until the earliest active next_run_at (one index descent), waking at
            least once a second to ask SQLite whether another process (the CLI) wrote
            (`PRAGMA data_version`: no read unless it did), or when a command changed one
    fire:   plan (on time; after downtime: within grace, once; older: one `missed` row
            and one line to the user) -> claim + begin the turn in one transaction
            (`SchedulerHost.start_scheduled`) -> the turn runs in the schedule's own
            session (`agent:{id}:cron:{schedule_id}`) and its reply goes through the
            delivery ledger
    settle: in the turn's finish transaction (`settle_turn`): ok or failed, the first
            500 characters, tokens; 3 failures in a row pause it with a notice
    start:  a run claimed before a crash is resumed by the turn's marker like any
            interrupted turn; one whose marker is gone is recorded `interrupted`

The scheduler is handed the runner typed as `SchedulerHost`: exactly what it calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from config import GatewayConfig
from gateway.domain.events import MessageEvent
from gateway.domain.session import (
    Platform,
    SessionSource,
    TokenUsage,
    schedule_id_of_key,
    schedule_session_key,
)
from gateway.schedules.book import ScheduleBook, home_target
from gateway.schedules.cadence import Cadence, CadenceError, local_time, missed_fire_times
from gateway.store import codec, journal
from gateway.store import schedules as rows
from gateway.store.session_store import SessionStore
from gateway.util.faults import crash_point

log = structlog.get_logger("gateway.schedules")

POLL_SECONDS = 1.0  # how soon a schedule written by another process (the CLI) is seen
DUE_PAGE = 500  # due schedules fired per pass
FAILURES_TO_PAUSE = 3
LATE_SECONDS = 60.0  # a fire time later than this is planned off the event loop
INTERRUPTED_NOTICE = (
    "Scheduled task {id} was interrupted by a restart while it ran ({due}); it was not run again."
)


class RecordedSender(Protocol):
    """Sends reply chunks already recorded in the delivery ledger (`Delivery`)."""

    async def send_recorded(
        self,
        target: SessionSource,
        chunks: list[tuple[int, str]],
        reply_to: str | None,
    ) -> int: ...


class ScheduleMetrics(Protocol):
    def observe_schedule_delay(self, seconds: float) -> None: ...

    def count_schedule_run(self, status: str) -> None: ...


class SchedulerHost(Protocol):
    """What the scheduler reaches in the runner: the store, the session lanes (a run is
    a turn), the reply path and its counters."""

    config: GatewayConfig
    store: SessionStore

    @property
    def metrics(self) -> ScheduleMetrics: ...

    @property
    def delivery(self) -> RecordedSender: ...

    @property
    def adapters(self) -> Mapping[Platform, Any]: ...

    def is_busy(self, key: str) -> bool: ...

    def split_reply(self, target: SessionSource, text: str) -> list[str]: ...

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class FirePlan:
    """What to do with a schedule whose fire time has come: run `run_at` (None: run
    nothing), record `missed` fire times as one `missed` row, and fire next at
    `next_run_at` (None: never again)."""

    run_at: float | None
    missed: list[float] = field(default_factory=list)
    next_run_at: float | None = None


def plan_fire(
    cadence: Cadence, due: float, now: float, started_at: float, catch_up: str
) -> FirePlan:
    """Decide a due schedule's fire (pure: the downtime rules in one place).

    A fire time that came while the gateway ran is on time (run it). One that came
    while it was down (before `started_at`) runs late only within its grace (half the
    period, 2 min .. 2 h) and with `catch_up: once`; older ones, and every one with
    `skip`, are missed. However many were missed, one runs at most: the latest."""
    fires = missed_fire_times(cadence, due, now)
    latest = fires[-1]
    following = cadence.next_after(max(now, latest))
    if latest >= started_at:
        return FirePlan(latest, fires[:-1], following)
    if catch_up == "once" and now - latest <= cadence.grace(latest):
        return FirePlan(latest, fires[:-1], following)
    return FirePlan(None, fires, following)


class Scheduler:
    def __init__(self, runner: SchedulerHost, book: ScheduleBook) -> None:
        self.runner = runner
        self.book = book
        self.settings = runner.config.schedules
        self.started_at = time.time()
        self.next_fire: tuple[str, float] | None = None  # (schedule id, time), for status
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._firing: set[str] = set()
        book.changed = self.wake

    async def start(self) -> None:
        """After recovery re-queued interrupted turns: settle what a crash left, then run."""
        self.started_at = time.time()
        await self._record_interrupted()
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def wake(self) -> None:
        """A schedule changed in this process: look at the earliest fire time again."""
        self._wake.set()

    # --- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        store = self.runner.store
        version = store.data_version()
        stale = True
        while True:
            try:
                if stale:
                    self.next_fire = await store.read(rows.earliest)
                    stale = False
                now = time.time()
                if self.next_fire is not None and self.next_fire[1] <= now:
                    fired = await self._fire_due(now)
                    stale = True
                    if not fired:  # nothing could fire (all busy or refused): not a spin
                        await asyncio.sleep(POLL_SECONDS / 10)
                    continue
                timeout = POLL_SECONDS
                if self.next_fire is not None:
                    timeout = min(timeout, self.next_fire[1] - now)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
                if self._wake.is_set():
                    self._wake.clear()
                    stale = True
                current = store.data_version()
                if current != version:  # another process committed: maybe a schedule
                    version, stale = current, True
                if self.next_fire is not None and self.next_fire[1] <= time.time():
                    stale = True
            except asyncio.CancelledError:
                raise
            except Exception:
                # The store refusing a write (disk full), a bug: keep the loop alive.
                log.exception("scheduler_pass_failed")
                stale = True
                await asyncio.sleep(POLL_SECONDS)

    async def _fire_due(self, now: float) -> int:
        due = await self.runner.store.read(lambda conn: rows.due(conn, now, DUE_PAGE))
        due = [row for row in due if row["schedule_id"] not in self._firing]
        results = await asyncio.gather(
            *(self._fire(row, now) for row in due), return_exceptions=True
        )
        fired = 0
        for row, result in zip(due, results, strict=True):
            if isinstance(result, BaseException):
                log.error("schedule_fire_failed", schedule_id=row["schedule_id"], error=str(result))
            elif result:
                fired += 1
        return fired

    async def _fire(self, row: dict[str, Any], now: float) -> bool:
        """Fire one due schedule; False when nothing was written (the caller retries)."""
        schedule_id = row["schedule_id"]
        self._firing.add(schedule_id)
        try:
            cadence = Cadence.from_json(row["cadence"])
            due = row["next_run_at"]
            plan_args = (cadence, due, now, self.started_at, self.settings.catch_up)
            try:
                if now - due > LATE_SECONDS:
                    # In a worker thread: after downtime a frequent cadence counts up to
                    # MISSED_COUNTED fire times, too long a walk for the event loop.
                    plan = await asyncio.to_thread(plan_fire, *plan_args)
                else:
                    plan = plan_fire(*plan_args)
            except CadenceError as exc:  # stored before today's checks: never retried
                return await self._pause_unreadable(row, str(exc))
            target, nowhere = await self._destination(row)
            key = schedule_session_key(row["agent_id"], schedule_id)
            if nowhere is not None:
                return await self._skip(row, cadence, plan, None, nowhere, undeliverable=True)
            skipped = None
            if plan.run_at is not None and self.runner.is_busy(key):
                skipped = "its previous run was still running"
            if plan.run_at is None or skipped is not None:
                return await self._skip(row, cadence, plan, target, skipped)
            assert target is not None
            return await self._start(row, cadence, plan, target, key)
        finally:
            self._firing.discard(schedule_id)

    async def _start(
        self,
        row: dict[str, Any],
        cadence: Cadence,
        plan: FirePlan,
        target: SessionSource | None,
        key: str,
    ) -> bool:
        assert plan.run_at is not None and target is not None
        schedule_id, fire_time = row["schedule_id"], plan.run_at
        notice = self._missed_notice(row, cadence, plan.missed, target)
        summary = _missed_summary(cadence, plan.missed, None) if plan.missed else ""
        keep = self.settings.keep_runs
        noticed: list[int] = []

        def claim(conn: sqlite3.Connection) -> bool:
            now = time.time()
            run_id = rows.claim(
                conn, schedule_id, fire_time, row["next_run_at"], plan.next_run_at, now
            )
            if run_id is None:
                return False
            if plan.missed:
                rows.record_not_run(
                    conn, schedule_id, plan.missed[0], rows.MISSED, summary, now, keep
                )
                noticed.extend(_record_notice(conn, notice, now))
            rows.prune(conn, schedule_id, keep)
            return True

        event = MessageEvent(source=target, text=row["prompt"], synthetic=True)
        due = local_time(fire_time, cadence.timezone)
        text = f"[Scheduled task {schedule_id}, {cadence.describe()}, due {due}] {row['prompt']}"
        started = await self.runner.start_scheduled(key, event, text, claim)
        if not started:
            return False
        crash_point("after_schedule_claim")
        self.runner.metrics.observe_schedule_delay(max(0.0, time.time() - fire_time))
        if noticed:
            self.runner.metrics.count_schedule_run(rows.MISSED)
            await self._send(target, noticed, notice)
        return True

    async def _skip(
        self,
        row: dict[str, Any],
        cadence: Cadence,
        plan: FirePlan,
        target: SessionSource | None,
        reason: str | None,
        *,
        undeliverable: bool = False,
    ) -> bool:
        """Move past fire times that do not run: one `missed` row, one line to the user.
        `undeliverable` (nowhere to deliver: `reason` says why): the fire time that was
        due is recorded `undeliverable`, nothing runs and nothing is sent; the operator
        is told by a warning (and `doctor`)."""
        schedule_id = row["schedule_id"]
        undelivered = plan.run_at if undeliverable else None
        missed = list(plan.missed)
        if plan.run_at is not None and not undeliverable:
            missed.append(plan.run_at)
        notice = None
        if target is not None:
            notice = self._missed_notice(row, cadence, missed, target, reason)
        why = None if undeliverable else reason  # a run before it was not missed for it
        summary = _missed_summary(cadence, missed, why) if missed else ""
        keep = self.settings.keep_runs
        noticed: list[int] = []

        def write(conn: sqlite3.Connection) -> bool:
            now = time.time()
            if not rows.advance(conn, schedule_id, row["next_run_at"], plan.next_run_at, now):
                return False
            if missed:
                rows.record_not_run(conn, schedule_id, missed[0], rows.MISSED, summary, now, keep)
            if undelivered is not None:
                note = f"not run: {reason}."
                rows.record_not_run(
                    conn, schedule_id, undelivered, rows.UNDELIVERABLE, note, now, keep
                )
            noticed.extend(_record_notice(conn, notice, now))
            return True

        if not await self.runner.store.write(write, dirty=False):
            return False
        if missed:
            self.runner.metrics.count_schedule_run(rows.MISSED)
            log.info("schedule_missed", schedule_id=schedule_id, fire_times=len(missed), reason=why)
        if undelivered is not None:
            self.runner.metrics.count_schedule_run(rows.UNDELIVERABLE)
            log.warning(
                "schedule_undeliverable",
                schedule_id=schedule_id,
                platform=row["platform"],
                reason=reason,
                hint="enable the platform (or set its home channel), or remove the schedule",
            )
        if notice is not None:
            await self._send(notice[0], noticed, notice)
        return True

    async def _pause_unreadable(self, row: dict[str, Any], error: str) -> bool:
        """A stored cadence this gateway cannot read (a cron expression beyond today's
        bounds): paused with a warning, not retried every pass."""
        schedule_id = row["schedule_id"]
        now = time.time()
        await self.runner.store.write(
            lambda conn: rows.set_status(conn, schedule_id, rows.PAUSED, None, now), dirty=False
        )
        log.warning(
            "schedule_unreadable",
            schedule_id=schedule_id,
            error=error,
            hint="paused; remove it and add it again",
        )
        return True

    def _missed_notice(
        self,
        row: dict[str, Any],
        cadence: Cadence,
        missed: list[float],
        target: SessionSource,
        reason: str | None = None,
    ) -> tuple[SessionSource, list[str]] | None:
        if not missed:
            return None
        text = f"Scheduled task {row['schedule_id']} ({_short(row['prompt'])}): " + _missed_summary(
            cadence, missed, reason
        )
        return target, self.runner.split_reply(target, text)

    async def _send(
        self, target: SessionSource, ids: list[int], notice: tuple[SessionSource, list[str]] | None
    ) -> None:
        if notice is None:
            return
        await self.runner.delivery.send_recorded(
            target, list(zip(ids, notice[1], strict=True)), None
        )

    async def _destination(self, row: dict[str, Any]) -> tuple[SessionSource | None, str | None]:
        """Where a run's reply goes, or (None, why it cannot be delivered): the home
        channel is not set, or the platform is not enabled (no adapter)."""
        platform = row["platform"]
        if row["deliver"] == "home":
            stored = await self.runner.store.read(lambda conn: rows.get_home(conn, platform))
            target = home_target(stored, platform, self.runner.config)
        else:
            target = SessionSource.from_dict(codec.loads(row["target"]))
        if target is None:
            return None, f"no home channel on {platform} (/sethome, or home_channel)"
        if not self.deliverable(target):
            return None, f"{platform} is not enabled in this gateway"
        return target, None

    def deliverable(self, target: SessionSource) -> bool:
        return target.platform in self.runner.adapters

    # --- /schedule run ID ---------------------------------------------------------------------

    async def run_now(self, row: dict[str, Any]) -> str | None:
        """Run a schedule now, outside its cadence (its next fire time stays); None when
        it started, else why not."""
        cadence = Cadence.from_json(row["cadence"])
        target, nowhere = await self._destination(row)
        if target is None:
            return nowhere
        key = schedule_session_key(row["agent_id"], row["schedule_id"])
        now = round(time.time(), 3)
        plan = FirePlan(now, [], row["next_run_at"])
        if await self._start({**row, "next_run_at": None}, cadence, plan, target, key):
            return None
        return "a run of it is still going"

    # --- a run's end ----------------------------------------------------------------------------

    @staticmethod
    def schedule_of(session_key: str) -> str | None:
        return schedule_id_of_key(session_key)

    async def settle_turn(
        self, schedule_id: str, reply: str | None, text: str, usage: TokenUsage | None
    ) -> tuple[str, Callable[[sqlite3.Connection], object], str]:
        """What a scheduled run's turn ends with: the text to send (with a notice when
        this failure pauses the schedule), the write for its finish transaction, and the
        run's status."""
        row = await self.runner.store.read(lambda conn: rows.get(conn, schedule_id))
        status = rows.OK if reply is not None else rows.FAILED
        final = None
        if row is not None:
            if not Cadence.from_json(row["cadence"]).recurring:
                final = rows.DONE
            elif status == rows.FAILED and row["consecutive_failures"] + 1 >= FAILURES_TO_PAUSE:
                final = rows.PAUSED
                text += (
                    f"\n\nScheduled task {schedule_id} failed {FAILURES_TO_PAUSE} times in a"
                    f" row and is paused; /schedule resume {schedule_id} starts it again."
                )
        tokens = (usage.input_tokens, usage.output_tokens) if usage is not None else (0, 0)
        keep = self.settings.keep_runs
        output = reply if reply is not None else text

        def write(conn: sqlite3.Connection) -> None:
            rows.settle(
                conn, schedule_id, status, output, tokens, time.time(), final=final, keep=keep
            )

        if final == rows.PAUSED:
            self.wake()
        return text, write, status

    # --- start-up ---------------------------------------------------------------------------

    async def _record_interrupted(self) -> None:
        """Runs claimed before a crash whose turn is gone (dropped as a stuck loop, or
        the schedule's session deleted): `interrupted`, with a short notice. A run whose
        marker is still there is being resumed by recovery, and settles as usual."""
        store = self.runner.store
        for run in await store.read(rows.running_runs):
            key = schedule_session_key(run["agent_id"], run["schedule_id"])
            if self.runner.is_busy(key) or await store.read(
                lambda conn, key=key: journal.get_turn(conn, key)
            ):
                continue
            await self._interrupt(run)

    async def _interrupt(self, run: dict[str, Any]) -> None:
        target = SessionSource.from_dict(codec.loads(run["target"]))
        cadence = Cadence.from_json(run["cadence"])
        due = local_time(run["fire_time"], cadence.timezone)
        text = INTERRUPTED_NOTICE.format(id=run["schedule_id"], due=due)
        notice = None  # none for a platform no longer enabled: it would wait forever
        if self.deliverable(target):
            notice = (target, self.runner.split_reply(target, text))
        final = None if cadence.recurring else rows.DONE
        keep = self.settings.keep_runs

        def write(conn: sqlite3.Connection) -> list[int]:
            now = time.time()
            rows.settle(
                conn,
                run["schedule_id"],
                rows.INTERRUPTED,
                text,
                (0, 0),
                now,
                final=final,
                keep=keep,
            )
            return _record_notice(conn, notice, now)

        ids = await self.runner.store.write(write, dirty=False)
        self.runner.metrics.count_schedule_run(rows.INTERRUPTED)
        log.warning("schedule_run_interrupted", schedule_id=run["schedule_id"])
        await self._send(target, ids, notice)


def _record_notice(
    conn: sqlite3.Connection, notice: tuple[SessionSource, list[str]] | None, now: float
) -> list[int]:
    if notice is None:
        return []
    target, chunks = notice
    return journal.record_outbound(conn, target, chunks, reply_to=None, session_key=None, now=now)


def _missed_summary(cadence: Cadence, missed: list[float], reason: str | None) -> str:
    when = local_time(missed[0], cadence.timezone)
    if len(missed) > 1:
        when += f" .. {local_time(missed[-1], cadence.timezone)}"
    count = f"{len(missed)} runs" if len(missed) > 1 else "the run"
    why = reason or "the gateway was not running"
    return f"missed {count} due {when}: {why}."


def _short(prompt: str, size: int = 40) -> str:
    prompt = " ".join(prompt.split())
    return prompt if len(prompt) <= size else prompt[: size - 1] + "…"
