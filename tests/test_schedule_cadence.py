"""Issue 17 at unit level: the WHEN syntax, next fire times in a time zone across DST
changes, grace, and what a due schedule does after downtime (`plan_fire`). The clock is
set with time_machine; the runner's view of the same rules is tests/test_schedules*.py.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
import time_machine

from gateway.schedules.cadence import (
    Cadence,
    CadenceError,
    local_time,
    missed_fire_times,
    parse_when,
    split_when,
)
from gateway.schedules.loop import plan_fire

BERLIN = "Europe/Berlin"
HOUR = 3600.0


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def test_split_when_takes_each_form_apart() -> None:
    assert split_when("in 30m water the plants") == ("in 30m", "water the plants")
    assert split_when("in 2 h call") == ("in 2 h", "call")
    assert split_when("every 2h stretch") == ("every 2h", "stretch")
    assert split_when("at 09:00 standup") == ("at 09:00", "standup")
    assert split_when("at 2026-12-01 09:00 plan") == ("at 2026-12-01 09:00", "plan")
    assert split_when('"0 9 * * 1-5" weekday report') == ('"0 9 * * 1-5"', "weekday report")
    with pytest.raises(CadenceError, match="closing quote"):
        split_when('"0 9 * * 1-5 report')
    with pytest.raises(CadenceError, match="WHEN must start with"):
        split_when("tomorrow call Bob")


def test_in_and_every_count_from_now() -> None:
    now = utc(2026, 6, 1, 12, 0)
    assert parse_when("in 90s", "UTC", now) == Cadence("once", "UTC", at=now + 90)
    assert parse_when("in 1d", "UTC", now).at == now + 86400
    every = parse_when("every 2h", "UTC", now)
    assert every.kind == "interval" and every.anchor == now + 2 * HOUR
    assert every.next_after(now) == now + 2 * HOUR
    assert every.next_after(now + 2 * HOUR) == now + 4 * HOUR
    assert every.describe() == "every 2h"
    with pytest.raises(CadenceError, match="give a whole number and a unit"):
        parse_when("in 3 weeks", "UTC", now)


def test_at_a_bare_time_is_the_next_time_the_clock_shows_it() -> None:
    # 10:00 in Berlin (CEST): 09:00 has passed today, so tomorrow; 11:00 is still today.
    with time_machine.travel(datetime(2026, 6, 1, 8, 0, tzinfo=UTC), tick=False):
        now = time.time()
        nine = parse_when("at 09:00", BERLIN, now)
        eleven = parse_when("at 11:00", BERLIN, now)
    assert local_time(nine.at, BERLIN) == "2026-06-02 09:00 CEST"
    assert local_time(eleven.at, BERLIN) == "2026-06-01 11:00 CEST"


def test_at_a_date_in_the_past_is_refused_with_its_zone() -> None:
    with time_machine.travel(datetime(2026, 6, 1, 8, 0, tzinfo=UTC), tick=False):
        with pytest.raises(
            CadenceError, match=r"at 2026-05-31 09:00 \(Europe/Berlin\) is in the past"
        ):
            parse_when("at 2026-05-31 09:00", BERLIN, time.time())
        with pytest.raises(CadenceError, match=r"month must be in 1\.\.12"):
            parse_when("at 2026-13-01 09:00", BERLIN, time.time())


def test_cron_fires_at_the_right_local_time_across_a_dst_change() -> None:
    # Berlin leaves CET (UTC+1) for CEST (UTC+2) on 2026-03-29: 09:00 local moves from
    # 08:00 to 07:00 UTC, and back on 2026-10-25.
    with time_machine.travel(datetime(2026, 3, 27, 12, 0, tzinfo=UTC), tick=False):
        cron = parse_when('"0 9 * * *"', BERLIN, time.time())
        fires = missed_fire_times(cron, cron.next_after(time.time()), utc(2026, 3, 31, 0, 0))
    assert [datetime.fromtimestamp(f, UTC).hour for f in fires] == [8, 7, 7]
    assert [local_time(f, BERLIN) for f in fires] == [
        "2026-03-28 09:00 CET",
        "2026-03-29 09:00 CEST",
        "2026-03-30 09:00 CEST",
    ]
    autumn = cron.next_after(utc(2026, 10, 24, 12, 0))
    assert autumn is not None and local_time(autumn, BERLIN) == "2026-10-25 09:00 CET"
    assert datetime.fromtimestamp(autumn, UTC).hour == 8
    # The period across the spring change is 23 hours: its grace is still capped at 2 h.
    assert cron.period(fires[0]) == 23 * HOUR
    assert cron.grace(fires[0]) == 2 * HOUR


def test_an_interval_is_absolute_time_across_dst() -> None:
    start = utc(2026, 3, 29, 0, 30)  # 01:30 CET, half an hour before the change
    every = Cadence("interval", BERLIN, seconds=HOUR, anchor=start)
    second = every.next_after(start)
    assert second == start + HOUR
    assert local_time(start, BERLIN) == "2026-03-29 01:30 CET"
    assert local_time(second, BERLIN) == "2026-03-29 03:30 CEST"  # 02:30 does not exist


def test_a_cron_expression_is_checked() -> None:
    now = utc(2026, 6, 1, 12, 0)
    with pytest.raises(CadenceError, match="Wrong number of fields"):
        parse_when('"0 9 * *"', "UTC", now)
    with pytest.raises(CadenceError, match="cannot read the cron expression"):
        parse_when('"0 25 * * *"', "UTC", now)
    assert parse_when('"*/10 * * * *"', "UTC", now).shortest_gap(now) == 600
    assert parse_when('"0 9 * * 1-5"', "UTC", now).shortest_gap(now) == 86400


def test_grace_is_half_the_period_within_2_min_and_2_h() -> None:
    now = utc(2026, 6, 1, 12, 0)
    assert Cadence("interval", "UTC", seconds=HOUR, anchor=now).grace(now) == HOUR / 2
    assert Cadence("interval", "UTC", seconds=60, anchor=now).grace(now) == 120
    assert Cadence("interval", "UTC", seconds=86400, anchor=now).grace(now) == 2 * HOUR
    assert Cadence("once", "UTC", at=now).grace(now) == 2 * HOUR


# --- after downtime ------------------------------------------------------------------------


def hourly() -> Cadence:
    return Cadence("interval", "UTC", seconds=HOUR, anchor=utc(2026, 6, 1, 0, 0))


def test_three_hours_down_runs_the_latest_once_and_misses_the_rest() -> None:
    # Ran at 09:00, down from 09:05 to 12:10: 10:00 and 11:00 are past their grace
    # (30 min), 12:00 is 10 minutes late.
    started = utc(2026, 6, 1, 12, 10)
    plan = plan_fire(hourly(), utc(2026, 6, 1, 10, 0), started + 0.5, started, "once")
    assert plan.run_at == utc(2026, 6, 1, 12, 0)
    assert plan.missed == [utc(2026, 6, 1, 10, 0), utc(2026, 6, 1, 11, 0)]
    assert plan.next_run_at == utc(2026, 6, 1, 13, 0)


def test_with_skip_nothing_missed_runs() -> None:
    started = utc(2026, 6, 1, 12, 10)
    plan = plan_fire(hourly(), utc(2026, 6, 1, 10, 0), started, started, "skip")
    assert plan.run_at is None
    assert plan.missed == [utc(2026, 6, 1, h, 0) for h in (10, 11, 12)]
    assert plan.next_run_at == utc(2026, 6, 1, 13, 0)


def test_a_fire_time_past_its_grace_is_missed_even_with_once() -> None:
    started = utc(2026, 6, 1, 12, 40)  # 12:00 is 40 min late, its grace 30
    plan = plan_fire(hourly(), utc(2026, 6, 1, 12, 0), started, started, "once")
    assert plan.run_at is None and plan.missed == [utc(2026, 6, 1, 12, 0)]


def test_a_fire_time_that_came_while_running_is_on_time_whatever_catch_up_says() -> None:
    started = utc(2026, 6, 1, 8, 0)
    due = utc(2026, 6, 1, 12, 0)
    for catch_up in ("once", "skip"):
        plan = plan_fire(hourly(), due, due + 0.2, started, catch_up)
        assert plan.run_at == due and plan.missed == []


def test_a_one_shot_after_downtime_runs_within_two_hours() -> None:
    at = utc(2026, 6, 1, 12, 0)
    once = Cadence("once", "UTC", at=at)
    late = plan_fire(once, at, at + 90 * 60, at + 90 * 60, "once")
    assert late.run_at == at and late.next_run_at is None
    too_late = plan_fire(once, at, at + 3 * HOUR, at + 3 * HOUR, "once")
    assert too_late.run_at is None and too_late.missed == [at]


def test_missed_fire_times_are_bounded() -> None:
    every_minute = Cadence("interval", "UTC", seconds=60, anchor=utc(2020, 1, 1))
    fires = missed_fire_times(every_minute, utc(2020, 1, 1), utc(2026, 1, 1))
    assert len(fires) == 10_000


def test_a_zone_is_an_iana_name() -> None:
    with pytest.raises(CadenceError, match="unknown time zone 'Mars/Olympus'"):
        parse_when("in 1h", "Mars/Olympus", 0)
    assert ZoneInfo(BERLIN)  # the suite's tzdata knows Berlin
