"""The schedule book: creating, listing, pausing, resuming and removing schedules, with
the validation users read (`/schedule`, the schedule tools, `hermes-gateway schedules`).

Every read that lists or changes schedules for a chat is scoped by `Asker`: the agent,
and the user (their own schedules, plus those the operator made for their chat); a
user never sees another user's schedules. The CLI (the operator) passes no asker.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from config import GatewayConfig
from gateway.domain.session import SessionSource, schedule_session_key
from gateway.schedules.cadence import (
    Cadence,
    CadenceError,
    duration,
    local_time,
    parse_when,
    zone_name,
)
from gateway.store import codec
from gateway.store import schedules as rows
from gateway.store.session_store import SessionStore

PROMPT_MAX_CHARS = 4000
RUNS_SHOWN = 10  # /schedule runs ID


class ScheduleError(ValueError):
    """A request that cannot be done; the message says why, for the user."""


@dataclass(frozen=True, slots=True)
class Asker:
    """Who asks, from which chat: what their schedule commands may see."""

    agent_id: str
    platform: str
    user_id: str | None
    chat_id: str | None


def new_schedule_id() -> str:
    return f"sch_{secrets.token_hex(4)}"


def iso(moment: float | None) -> str | None:
    return None if moment is None else datetime.fromtimestamp(moment, UTC).isoformat()


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A schedule for listings and `--json`: times in ISO 8601 UTC."""
    cadence = Cadence.from_json(row["cadence"])
    return {
        "id": row["schedule_id"],
        "agent": row["agent_id"],
        "platform": row["platform"],
        "chat_id": row["chat_id"],
        "user_id": row["user_id"],
        "deliver": row["deliver"],
        "prompt": row["prompt"],
        "cadence": cadence.describe(),
        "timezone": cadence.timezone,
        "status": row["status"],
        "next_run_at": iso(row["next_run_at"]),
        "last_run_at": iso(row.get("last_run_at")),
        "last_run_status": row.get("last_run_status"),
        "created_at": iso(row["created_at"]),
    }


def shown_run(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run["run_id"],
        "status": run["status"],
        "fire_time": iso(run["fire_time"]),
        "started_at": iso(run["started_at"]),
        "finished_at": iso(run["finished_at"]),
        "output_summary": run["output_summary"],
        "input_tokens": run["input_tokens"],
        "output_tokens": run["output_tokens"],
    }


def next_fire_text(row: dict[str, Any]) -> str:
    """`2026-12-01 09:00 CET`, or why it will not fire."""
    if row["next_run_at"] is None:
        return {"paused": "paused", "done": "done"}.get(row["status"], "running now")
    timezone = Cadence.from_json(row["cadence"]).timezone
    return local_time(row["next_run_at"], timezone)


class ScheduleBook:
    """Schedules over the store; `changed()` is called after each change (the scheduler
    wakes to look at the earliest fire time again)."""

    def __init__(
        self,
        store: SessionStore,
        config: GatewayConfig,
        platforms: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.settings = config.schedules
        self.changed: Any = lambda: None
        # Where runs can be delivered: the running gateway's adapters, or (the CLI)
        # the platforms the config enables.
        self.platforms = platforms or config.connected_platforms

    def timezone(self) -> str:
        return zone_name(self.config.tzinfo())

    async def add(
        self,
        *,
        agent_id: str,
        target: SessionSource,
        user_id: str | None,
        when: str,
        prompt: str,
        deliver: str = "chat",
        timezone: str | None = None,
        limited: bool = True,
    ) -> dict[str, Any]:
        """Validate and store a new schedule; returns its row. `limited`: apply
        `schedules.max_per_user` (the operator's CLI is not limited)."""
        prompt = prompt.strip()
        if not prompt:
            raise ScheduleError("say what to do: /schedule add WHEN PROMPT")
        if len(prompt) > PROMPT_MAX_CHARS:
            raise ScheduleError(f"the prompt is too long ({len(prompt)} > {PROMPT_MAX_CHARS})")
        await self._check_delivery(target, deliver)
        now = time.time()
        # In a worker thread: a cron expression is bounded (gateway.schedules.cron), yet
        # finding the fire times of a rare one walks years of the calendar.
        cadence, gap, first = await asyncio.to_thread(
            _read_when, when, timezone or self.timezone(), now
        )
        minimum = self.settings.min_interval
        if gap is not None and gap < minimum:
            raise ScheduleError(
                f"{when.strip()} repeats every {duration(gap)}; the shortest interval allowed"
                f" is {duration(minimum)} (schedules.min_interval)"
            )
        schedule_id = new_schedule_id()
        target = _target(target)
        row = {
            "schedule_id": schedule_id,
            "agent_id": agent_id,
            "platform": target.platform.value,
            "chat_id": target.chat_id,
            "user_id": user_id,
            "target": codec.dumps(target.to_dict()),
            "deliver": deliver,
            "prompt": prompt,
            "cadence": cadence.to_json(),
            "status": rows.ACTIVE,
            "created_at": now,
            "updated_at": now,
            "next_run_at": first,
            "consecutive_failures": 0,
        }
        schedule_session_key(agent_id, schedule_id)  # the ids make a valid key
        limit = self.settings.max_per_user if limited and user_id is not None else None

        def write(conn: Any) -> None:
            if limit is not None:
                held = rows.count_for_user(conn, target.platform.value, user_id or "")
                if held >= limit:
                    raise ScheduleError(
                        f"you have {held} schedules, the most allowed"
                        f" (schedules.max_per_user: {limit}); remove one first"
                    )
            rows.insert(conn, row)

        await self.store.write(write, dirty=False)
        self.changed()
        return row

    async def _check_delivery(self, target: SessionSource, deliver: str) -> None:
        """Refuse a schedule whose runs could never be delivered: its platform is not
        enabled here, or it goes to a home channel the platform does not have."""
        platform = target.platform.value
        enabled = sorted(self.platforms())
        if platform not in enabled:
            raise ScheduleError(
                f"{platform} is not enabled in this gateway, so its runs could never be"
                f" delivered (enabled: {', '.join(enabled) or 'none'}; platforms.{platform}"
                ".enabled)"
            )
        if deliver == "home" and await self.home_of(platform) is None:
            raise ScheduleError(
                f"{platform} has no home channel: /sethome in the chat that should get"
                f" the runs, or set platforms.{platform}.home_channel"
            )

    async def list(self, asker: Asker | None) -> list[dict[str, Any]]:
        return await self.store.read(lambda conn: rows.listed(conn, **_scope(asker)))

    async def get(self, schedule_id: str, asker: Asker | None) -> dict[str, Any]:
        """The schedule, if the asker may see it; ScheduleError otherwise."""
        found = await self.store.read(lambda conn: rows.get(conn, schedule_id))
        if found is None or not _visible(found, asker):
            raise ScheduleError(f"no schedule {schedule_id!r} (/schedule list shows yours)")
        return found

    async def remove(self, schedule_id: str, asker: Asker | None) -> dict[str, Any]:
        """Delete the schedule, its runs and (unless a run is in progress) its session."""
        found = await self.get(schedule_id, asker)
        key = schedule_session_key(found["agent_id"], schedule_id)
        now = datetime.now(UTC)

        def write(conn: Any) -> None:
            rows.delete(conn, schedule_id)
            # Left while a run still answers: the session goes with the user's data.
            rows.delete_sessions(conn, key, now)

        await self.store.write(write)
        self.changed()
        return found

    async def pause(self, schedule_id: str, asker: Asker | None) -> dict[str, Any]:
        found = await self.get(schedule_id, asker)
        if found["status"] != rows.ACTIVE:
            raise ScheduleError(f"{schedule_id} is {found['status']}, not active")
        now = time.time()
        await self.store.write(
            lambda conn: rows.set_status(conn, schedule_id, rows.PAUSED, None, now), dirty=False
        )
        self.changed()
        return {**found, "status": rows.PAUSED, "next_run_at": None}

    async def resume(self, schedule_id: str, asker: Asker | None) -> dict[str, Any]:
        """Active again from now (fire times during the pause are not made up); a
        one-shot whose time passed meanwhile fires now."""
        found = await self.get(schedule_id, asker)
        if found["status"] != rows.PAUSED:
            raise ScheduleError(f"{schedule_id} is {found['status']}, not paused")
        now = time.time()
        try:
            following = Cadence.from_json(found["cadence"]).next_after(now) or now
        except CadenceError as exc:
            raise ScheduleError(f"{schedule_id} cannot run again: {exc}; remove it") from None
        await self.store.write(
            lambda conn: rows.set_status(conn, schedule_id, rows.ACTIVE, following, now),
            dirty=False,
        )
        self.changed()
        return {**found, "status": rows.ACTIVE, "next_run_at": following}

    async def runs(
        self, schedule_id: str, asker: Asker | None, limit: int = RUNS_SHOWN
    ) -> list[dict[str, Any]]:
        await self.get(schedule_id, asker)
        return await self.store.read(lambda conn: rows.runs(conn, schedule_id, limit))

    # --- home channels ------------------------------------------------------------------

    async def set_home(self, target: SessionSource) -> None:
        encoded = codec.dumps(_target(target).to_dict())
        now = time.time()
        await self.store.write(
            lambda conn: rows.set_home(conn, target.platform.value, encoded, now), dirty=False
        )

    async def home_of(self, platform: str) -> SessionSource | None:
        """The platform's home channel: `/sethome`'s, else `platforms.P.home_channel`."""
        stored = await self.store.read(lambda conn: rows.get_home(conn, platform))
        return home_target(stored, platform, self.config)


def _read_when(when: str, timezone: str, now: float) -> tuple[Cadence, float | None, float | None]:
    """The cadence of `when`, its shortest gap and its first fire time."""
    try:
        cadence = parse_when(when, timezone, now)
    except CadenceError as exc:
        raise ScheduleError(str(exc)) from None
    return cadence, cadence.shortest_gap(now), cadence.next_after(now)


def home_target(stored: str | None, platform: str, config: GatewayConfig) -> SessionSource | None:
    if stored is not None:
        return SessionSource.from_dict(codec.loads(stored))
    chat_id = config.home_channels().get(platform)
    if chat_id is None:
        return None
    return SessionSource.from_dict(
        {"platform": platform, "chat_id": chat_id, "chat_type": "channel"}
    )


def _target(source: SessionSource) -> SessionSource:
    """Where a schedule's replies go: the chat, without the message that made it (a
    reminder is not an answer to it)."""
    data = source.to_dict()
    data["message_id"] = None
    return SessionSource.from_dict(data)


def _scope(asker: Asker | None) -> dict[str, Any]:
    if asker is None:
        return {}
    return {
        "agent_id": asker.agent_id,
        "platform": asker.platform,
        "user_id": asker.user_id,
        "chat_id": asker.chat_id,
    }


def _visible(row: dict[str, Any], asker: Asker | None) -> bool:
    if asker is None:
        return True
    if row["agent_id"] != asker.agent_id or row["platform"] != asker.platform:
        return False
    if asker.user_id is None:
        return row["chat_id"] == asker.chat_id
    return row["user_id"] == asker.user_id or (
        row["user_id"] is None and row["chat_id"] == asker.chat_id
    )
