"""Reset-policy arithmetic: has a session gone idle or crossed its daily boundary? And
the notice a user gets with the first reply after an automatic reset.

Times are stored in UTC; the daily hour is evaluated in the configured time zone with
`zoneinfo`, so the boundary moves with DST instead of drifting by an hour.
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta, tzinfo
from typing import Literal

from config import SessionResetPolicy

ResetReason = Literal["idle", "daily"]

RESET_NOTICES = {
    "idle": "Your previous session ended after inactivity, so this is a fresh start.",
    "daily": "Your previous session ended at the daily reset, so this is a fresh start.",
    "suspended": "Your previous session was stopped, so this is a fresh start.",
}


def _boundary_on(day: date, at_hour: int, tz: tzinfo) -> datetime:
    # On a DST-gap day a missing wall time resolves with the pre-transition offset (fold=0),
    # i.e. the boundary lands one hour later in wall-clock terms; it still happens once.
    return datetime.combine(day, time(hour=at_hour), tzinfo=tz)


#: per (hour, zone), the last boundary computed and the one after it: every turn asks,
#: and all the turns between two boundaries get the same answer without the zone's
#: arithmetic
_BOUNDARIES: dict[tuple[int, tzinfo], tuple[datetime, datetime]] = {}


def last_daily_boundary(now: datetime, at_hour: int, tz: tzinfo) -> datetime:
    """The most recent `at_hour` o'clock in `tz` at or before `now`."""
    known = _BOUNDARIES.get((at_hour, tz))
    if known is not None and known[0] <= now < known[1]:
        return known[0]
    local_day = now.astimezone(tz).date()
    boundary = _boundary_on(local_day, at_hour, tz)
    if boundary > now:
        boundary = _boundary_on(local_day - timedelta(days=1), at_hour, tz)
    _BOUNDARIES[(at_hour, tz)] = (boundary, next_daily_boundary(boundary, at_hour, tz))
    return boundary


def next_daily_boundary(after: datetime, at_hour: int, tz: tzinfo) -> datetime:
    """The first `at_hour` o'clock in `tz` strictly after `after`."""
    local_day = after.astimezone(tz).date()
    boundary = _boundary_on(local_day, at_hour, tz)
    if boundary <= after:
        boundary = _boundary_on(local_day + timedelta(days=1), at_hour, tz)
    return boundary


def reset_reason(
    updated_at: datetime, policy: SessionResetPolicy, now: datetime, tz: tzinfo
) -> ResetReason | None:
    """Why a session last touched at `updated_at` must reset at `now`, or None.

    Idle is checked first, as in the seed; under mode `both` whichever fired is reported.
    """
    if policy.mode in ("idle", "both"):
        if now > updated_at + timedelta(minutes=policy.idle_minutes):
            return "idle"
    if policy.mode in ("daily", "both"):
        if updated_at < last_daily_boundary(now, policy.at_hour, tz):
            return "daily"
    return None


def next_reset_at(updated_at: datetime, policy: SessionResetPolicy, tz: tzinfo) -> datetime | None:
    """When the next message would find this session reset (None for mode `none`)."""
    candidates: list[datetime] = []
    if policy.mode in ("idle", "both"):
        candidates.append(updated_at + timedelta(minutes=policy.idle_minutes))
    if policy.mode in ("daily", "both"):
        candidates.append(next_daily_boundary(updated_at, policy.at_hour, tz))
    return min(candidates) if candidates else None


def reset_notice(reason: str | None) -> str:
    """The line put before the first reply after an automatic reset (idle, daily, or a
    suspended session's fresh start); an unknown reason reads as idle."""
    why = RESET_NOTICES.get(reason or "", RESET_NOTICES["idle"])
    return f"({why} /resume to go back.)"
