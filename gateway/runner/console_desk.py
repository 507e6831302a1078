"""The console's port (`gateway.console.port.ConsolePort`) over the runner's parts: the
session archive, the schedule book and its scheduler, pairing and the notes store.
Each method delegates; the few reads of its own are in `gateway.store.console_reads`."""

from __future__ import annotations

from typing import Any, Protocol

from gateway.console.port import ConsoleRefused, SessionQuery
from gateway.memory.recall import Namespace, Recall
from gateway.ops.metrics import Metrics
from gateway.runner.pairing import Pairing
from gateway.runner.sessions import SessionArchive
from gateway.schedules.book import (
    ScheduleBook,
    ScheduleError,
    iso,
    next_fire_text,
    shown,
    shown_run,
)
from gateway.schedules.loop import Scheduler
from gateway.store import archive, console_reads
from gateway.store import schedules as rows
from gateway.store.pg import driver_errors

_SCHEDULE_ACTIONS = ("pause", "resume", "run", "remove")


class Cluster(Protocol):
    async def cluster(self) -> list[dict[str, Any]] | None: ...


class RunnerParts(Protocol):
    """The parts of the runner the desk delegates to (`GatewayRunner` has them all)."""

    sessions: SessionArchive
    schedule_book: ScheduleBook
    scheduler: Scheduler
    pairing: Pairing
    recall: Recall
    metrics: Metrics
    placement: Cluster

    def status_snapshot(self) -> dict[str, Any]: ...

    def send_pending_soon(self) -> None: ...


class ConsoleDesk:
    def __init__(self, parts: RunnerParts) -> None:
        self.parts = parts
        self.store = parts.sessions.store

    async def overview(self) -> dict[str, Any]:
        snapshot = {**self.parts.status_snapshot(), "turns_total": self.parts.metrics.turns_total}
        try:
            replicas = await self.parts.placement.cluster()
        except driver_errors():  # the database is away: the rest of the page still shows
            replicas = None
        if replicas is not None:
            snapshot["replicas"] = replicas
        return snapshot

    async def upcoming_schedules(self, limit: int) -> list[dict[str, Any]]:
        listed = await self.parts.schedule_book.list(None)
        active = [row for row in listed if row["status"] == rows.ACTIVE and row["next_run_at"]]
        active.sort(key=lambda row: row["next_run_at"])
        return [{**shown(row), "next_run": next_fire_text(row)} for row in active[:limit]]

    async def sessions_page(
        self, query: SessionQuery, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], str | None]:
        page, next_key = await self.store.read(
            lambda conn: console_reads.filtered_page(
                conn,
                after,
                limit,
                agent=query.agent,
                platform=query.platform,
                user=query.user,
                text=query.text,
            )
        )
        for entry in page:
            entry["updated_at"] = iso(entry["updated_at"])
        return page, next_key

    async def search(self, text: str, limit: int) -> list[dict[str, Any]]:
        return await self.parts.sessions.search_sessions(text, limit=limit)

    async def session(self, session_id: str, after: int, limit: int) -> dict[str, Any] | None:
        found = await self.parts.sessions.get_session(session_id, after, limit)
        if found is None:
            return None
        counts = await self.store.read(lambda conn: console_reads.session_counts(conn, session_id))
        return {**found, "counts": counts}

    async def export(self, session_id: str, limit: int) -> dict[str, Any] | None:
        return await self.store.read(lambda conn: archive.export_session(conn, session_id, limit))

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        return await self.parts.sessions.delete_session(session_id)

    async def schedules(self) -> list[dict[str, Any]]:
        listed = await self.parts.schedule_book.list(None)
        return [{**shown(row), "next_run": next_fire_text(row)} for row in listed]

    async def schedule_runs(self, schedule_id: str) -> list[dict[str, Any]]:
        try:
            return [
                shown_run(run) for run in await self.parts.schedule_book.runs(schedule_id, None)
            ]
        except ScheduleError as exc:
            raise ConsoleRefused(str(exc)) from None

    async def change_schedule(self, schedule_id: str, action: str) -> str:
        if action not in _SCHEDULE_ACTIONS:
            raise ConsoleRefused(f"no schedule action {action[:32]!r}")
        book = self.parts.schedule_book
        try:
            if action == "pause":
                await book.pause(schedule_id, None)
                return f"Paused {schedule_id}."
            if action == "resume":
                row = await book.resume(schedule_id, None)
                return f"Resumed {schedule_id}; next run {next_fire_text(row)}."
            if action == "remove":
                await book.remove(schedule_id, None)
                return f"Removed {schedule_id} and its run history."
            refused = await self.parts.scheduler.run_now(await book.get(schedule_id, None))
        except ScheduleError as exc:
            raise ConsoleRefused(str(exc)) from None
        if refused is not None:
            raise ConsoleRefused(f"{schedule_id} could not start now: {refused}")
        return f"Running {schedule_id} now."

    async def notes(self, platform: str, user_id: str) -> list[dict[str, Any]]:
        return await self.parts.recall.export(platform, user_id)

    async def delete_note(self, platform: str, user_id: str, note_id: str) -> bool:
        held = [n for n in await self.parts.recall.export(platform, user_id) if n["id"] == note_id]
        if not held:
            return False
        return await self.parts.recall.delete(
            Namespace(held[0]["agent"], platform, user_id), note_id
        )

    async def pairing_requests(self) -> list[dict[str, Any]]:
        return [
            {
                "platform": request.platform,
                "code": request.code,
                "user_id": request.user_id,
                "user_name": request.user_name,
                "created_at": iso(request.created_at),
            }
            for request in await self.parts.pairing.pending()
        ]

    async def decide_pairing(self, platform: str, code: str, approve: bool) -> bool:
        if not approve:
            return await self.parts.pairing.deny(platform, code)
        approved = await self.parts.pairing.approve(platform, code)
        if approved is None:
            return False
        self.parts.send_pending_soon()  # the user's notice is in the ledger: send it now
        return True
