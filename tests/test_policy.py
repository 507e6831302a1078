"""Reset-policy arithmetic (gateway/policy.py): idle, daily, both, none, and DST."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config import SessionResetPolicy
from gateway.domain.policy import (
    last_daily_boundary,
    next_daily_boundary,
    next_reset_at,
    reset_reason,
)

NY = ZoneInfo("America/New_York")


def policy(mode: str, *, at_hour: int = 4, idle_minutes: int = 60) -> SessionResetPolicy:
    return SessionResetPolicy(mode=mode, at_hour=at_hour, idle_minutes=idle_minutes)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# --- idle ----------------------------------------------------------------------------------


def test_idle_just_before_and_just_after_deadline() -> None:
    p = policy("idle", idle_minutes=60)
    updated = utc(2026, 5, 1, 10, 0)
    deadline = updated + timedelta(minutes=60)
    assert reset_reason(updated, p, deadline - timedelta(seconds=1), UTC) is None
    assert reset_reason(updated, p, deadline, UTC) is None  # "now > deadline", strictly
    assert reset_reason(updated, p, deadline + timedelta(seconds=1), UTC) == "idle"


# --- daily ---------------------------------------------------------------------------------


def test_daily_crossing_the_hour_same_day() -> None:
    p = policy("daily", at_hour=4)
    assert reset_reason(utc(2026, 5, 1, 3, 59), p, utc(2026, 5, 1, 4, 1), UTC) == "daily"


def test_daily_touched_after_todays_boundary() -> None:
    p = policy("daily", at_hour=4)
    assert reset_reason(utc(2026, 5, 1, 4, 1), p, utc(2026, 5, 1, 23, 0), UTC) is None


def test_daily_next_day_before_and_after_boundary() -> None:
    p = policy("daily", at_hour=4)
    updated = utc(2026, 5, 1, 5, 0)
    assert reset_reason(updated, p, utc(2026, 5, 2, 3, 0), UTC) is None
    assert reset_reason(updated, p, utc(2026, 5, 2, 3, 59, 59), UTC) is None
    assert reset_reason(updated, p, utc(2026, 5, 2, 4, 0, 1), UTC) == "daily"


def test_daily_boundary_exactly_at_the_hour() -> None:
    now = utc(2026, 5, 2, 4, 0)
    assert last_daily_boundary(now, 4, UTC) == now  # "at or before"
    assert next_daily_boundary(now, 4, UTC) == utc(2026, 5, 3, 4, 0)  # "strictly after"
    # Touched exactly on the boundary: not before it, so no reset.
    assert reset_reason(now, policy("daily"), now + timedelta(hours=1), UTC) is None


# --- modes ---------------------------------------------------------------------------------


def test_mode_none_never_resets() -> None:
    p = policy("none", idle_minutes=1)
    updated = utc(2020, 1, 1, 0, 0)
    assert reset_reason(updated, p, utc(2026, 1, 1, 12, 0), UTC) is None
    assert next_reset_at(updated, p, UTC) is None


def test_mode_idle_ignores_the_daily_boundary() -> None:
    p = policy("idle", at_hour=4, idle_minutes=600)
    # Crosses 04:00 but is only 2 h idle.
    assert reset_reason(utc(2026, 5, 1, 3, 0), p, utc(2026, 5, 1, 5, 0), UTC) is None


def test_mode_daily_ignores_idle() -> None:
    p = policy("daily", at_hour=4, idle_minutes=1)
    # 10 hours idle but no boundary crossed.
    assert reset_reason(utc(2026, 5, 1, 5, 0), p, utc(2026, 5, 1, 15, 0), UTC) is None


def test_mode_both_reports_idle_first() -> None:
    p = policy("both", at_hour=4, idle_minutes=60)
    updated, now = utc(2026, 5, 1, 3, 0), utc(2026, 5, 1, 5, 0)
    assert reset_reason(updated, p, now, UTC) == "idle"
    # Only the daily one applies.
    assert reset_reason(utc(2026, 5, 1, 3, 59), p, utc(2026, 5, 1, 4, 1), UTC) == "daily"
    # Only the idle one applies.
    assert reset_reason(utc(2026, 5, 1, 5, 0), p, utc(2026, 5, 1, 7, 0), UTC) == "idle"
    # Neither.
    assert reset_reason(utc(2026, 5, 1, 5, 0), p, utc(2026, 5, 1, 5, 30), UTC) is None


# --- DST -----------------------------------------------------------------------------------


def test_spring_forward_boundary_instants() -> None:
    # 2026-03-08: clocks go 02:00 EST -> 03:00 EDT. 04:00 EDT is 08:00 UTC;
    # the day before, 04:00 EST is 09:00 UTC.
    spring_boundary = utc(2026, 3, 8, 8, 0)
    day_before_boundary = utc(2026, 3, 7, 9, 0)

    assert last_daily_boundary(utc(2026, 3, 8, 12, 0), 4, NY) == spring_boundary
    assert last_daily_boundary(utc(2026, 3, 8, 7, 59), 4, NY) == day_before_boundary
    assert last_daily_boundary(utc(2026, 3, 8, 8, 0), 4, NY) == spring_boundary
    assert next_daily_boundary(utc(2026, 3, 7, 12, 0), 4, NY) == spring_boundary
    assert next_daily_boundary(utc(2026, 3, 7, 8, 59), 4, NY) == day_before_boundary
    assert next_daily_boundary(utc(2026, 3, 8, 8, 0), 4, NY) == utc(2026, 3, 9, 8, 0)


def test_spring_forward_reset_flips_at_0800_utc() -> None:
    p = policy("daily", at_hour=4)
    now = utc(2026, 3, 8, 12, 0)
    assert reset_reason(utc(2026, 3, 8, 7, 59), p, now, NY) == "daily"
    assert reset_reason(utc(2026, 3, 8, 8, 1), p, now, NY) is None
    # A fixed-offset (EST) computation would put it at 09:00 UTC; 08:30 must not reset.
    assert reset_reason(utc(2026, 3, 8, 8, 30), p, now, NY) is None


def test_fall_back_boundary_instants() -> None:
    # 2026-11-01: clocks go 02:00 EDT -> 01:00 EST. 04:00 EST is 09:00 UTC;
    # the day before, 04:00 EDT is 08:00 UTC.
    fall_boundary = utc(2026, 11, 1, 9, 0)
    day_before_boundary = utc(2026, 10, 31, 8, 0)
    assert last_daily_boundary(utc(2026, 11, 1, 12, 0), 4, NY) == fall_boundary
    assert last_daily_boundary(utc(2026, 11, 1, 8, 30), 4, NY) == day_before_boundary
    assert next_daily_boundary(utc(2026, 10, 31, 12, 0), 4, NY) == fall_boundary

    p = policy("daily", at_hour=4)
    now = utc(2026, 11, 1, 12, 0)
    assert reset_reason(utc(2026, 11, 1, 8, 59), p, now, NY) == "daily"
    assert reset_reason(utc(2026, 11, 1, 9, 1), p, now, NY) is None


def test_fall_back_ambiguous_hour_resolves_to_one_boundary() -> None:
    # 01:00 happens twice on 2026-11-01 (05:00 UTC in EDT, 06:00 UTC in EST).
    boundary = last_daily_boundary(utc(2026, 11, 1, 12, 0), 1, NY)
    assert boundary.astimezone(UTC) in (utc(2026, 11, 1, 5, 0), utc(2026, 11, 1, 6, 0))
    assert next_daily_boundary(utc(2026, 10, 31, 12, 0), 1, NY) == boundary
    # Only one reset that day: a session touched after the boundary does not reset again.
    p = policy("daily", at_hour=1)
    touched = utc(2026, 11, 1, 6, 30)
    assert reset_reason(touched, p, utc(2026, 11, 1, 23, 0), NY) is None


def test_spring_forward_nonexistent_hour_resolves_to_one_boundary() -> None:
    # 02:00 does not exist in New York on 2026-03-08.
    after = utc(2026, 3, 7, 12, 0)
    boundary = next_daily_boundary(after, 2, NY)
    # Either side of the gap is acceptable (06:00 UTC = 01:00 EST, 07:00 UTC = 03:00 EDT),
    # but it must be on that day and consistent between last/next.
    assert boundary.astimezone(UTC) in (utc(2026, 3, 8, 6, 0), utc(2026, 3, 8, 7, 0))
    assert last_daily_boundary(utc(2026, 3, 8, 12, 0), 2, NY) == boundary
    assert next_daily_boundary(boundary, 2, NY) == utc(2026, 3, 9, 6, 0)  # 02:00 EDT

    p = policy("daily", at_hour=2)
    now = utc(2026, 3, 8, 12, 0)
    assert reset_reason(boundary - timedelta(minutes=1), p, now, NY) == "daily"
    assert reset_reason(boundary + timedelta(minutes=1), p, now, NY) is None


@given(
    now=st.datetimes(
        min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
    ),
    at_hour=st.integers(0, 23),
)
def test_boundaries_bracket_now(now: datetime, at_hour: int) -> None:
    last = last_daily_boundary(now, at_hour, NY)
    nxt = next_daily_boundary(now, at_hour, NY)
    assert last <= now < nxt
    # Consecutive boundaries are one local day apart: 23 to 25 hours.
    assert timedelta(hours=23) <= nxt - last <= timedelta(hours=25)
    assert next_daily_boundary(last, at_hour, NY) == nxt


# --- next_reset_at -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "updated", "expected"),
    [
        ("idle", utc(2026, 5, 1, 3, 0), utc(2026, 5, 1, 4, 30)),
        ("daily", utc(2026, 5, 1, 3, 0), utc(2026, 5, 1, 4, 0)),
        ("daily", utc(2026, 5, 1, 5, 0), utc(2026, 5, 2, 4, 0)),
        ("both", utc(2026, 5, 1, 3, 0), utc(2026, 5, 1, 4, 0)),  # daily comes first
        ("both", utc(2026, 5, 1, 5, 0), utc(2026, 5, 1, 6, 30)),  # idle comes first
        ("none", utc(2026, 5, 1, 5, 0), None),
    ],
)
def test_next_reset_at(mode: str, updated: datetime, expected: datetime | None) -> None:
    p = policy(mode, at_hour=4, idle_minutes=90)
    assert next_reset_at(updated, p, UTC) == expected


def test_next_reset_at_across_dst() -> None:
    p = policy("daily", at_hour=4)
    assert next_reset_at(utc(2026, 3, 7, 12, 0), p, NY) == utc(2026, 3, 8, 8, 0)
    assert next_reset_at(utc(2026, 10, 31, 12, 0), p, NY) == utc(2026, 11, 1, 9, 0)


def test_next_reset_at_agrees_with_reset_reason() -> None:
    p = policy("both", at_hour=4, idle_minutes=90)
    for updated in (utc(2026, 3, 7, 23, 0), utc(2026, 3, 8, 7, 0), utc(2026, 3, 8, 9, 0)):
        at = next_reset_at(updated, p, NY)
        assert at is not None
        assert reset_reason(updated, p, at - timedelta(seconds=1), NY) is None
        assert reset_reason(updated, p, at + timedelta(seconds=1), NY) is not None
