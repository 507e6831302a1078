"""Scheduled jobs at unit level: the WHEN syntax, next fire times in a time zone across DST
changes, grace, and what a due schedule does after downtime (`plan_fire`). The clock is
set with time_machine; the runner's view of the same rules is tests/test_schedules*.py.
"""

from __future__ import annotations

import calendar
import time
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
import time_machine
from hypothesis import given
from hypothesis import strategies as st

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
        parse_when("in 3 fortnights", "UTC", now)


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
    with pytest.raises(CadenceError, match=r"five fields .* this one has 4"):
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


# --- units -----------------------------------------------------------------------------------

UNIT_SECONDS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "wk", "wks", "week", "weeks"), 604800),
}


def test_spelled_out_units_are_read_whole_and_the_prompt_starts_after_them() -> None:
    now = utc(2026, 6, 1, 12, 0)
    assert split_when("every 6 months renew passport") == ("every 6 months", "renew passport")
    assert split_when("in 30 minutes call mum") == ("in 30 minutes", "call mum")
    assert split_when("every 2 hours stretch") == ("every 2 hours", "stretch")
    assert split_when("in 2 days pay rent") == ("in 2 days", "pay rent")
    assert split_when("in 1h 30m tea") == ("in 1h 30m", "tea")
    assert split_when("in 1 hour and 30 minutes tea") == ("in 1 hour and 30 minutes", "tea")
    assert split_when("in 2h, call Bob") == ("in 2h", "call Bob")
    assert parse_when("in 30 minutes", "UTC", now) == Cadence("once", "UTC", at=now + 1800)
    assert parse_when("in 2 days", "UTC", now).at == now + 2 * 86400
    assert parse_when("in 1 hour and 30 minutes", "UTC", now).at == now + 5400
    hours = parse_when("every 2 hours", "UTC", now)
    assert hours.kind == "interval" and hours.seconds == 2 * HOUR
    weeks = parse_when("every 2 weeks", "UTC", now)
    assert weeks.seconds == 14 * 86400 and weeks.describe() == "every 2w"
    months = parse_when("every 6 months", "UTC", now + 0.25)
    assert months.kind == "monthly" and months.describe() == "every 6 months"
    assert local_time(months.next_after(now), "UTC") == "2026-12-01 12:00 UTC"
    assert (
        months.shortest_gap(now) == (datetime(2027, 6, 1) - datetime(2026, 12, 1)).total_seconds()
    )


@given(
    amount=st.integers(min_value=1, max_value=9999),
    unit=st.sampled_from(sorted(UNIT_SECONDS)),
    space=st.sampled_from(["", " "]),
    upper=st.booleans(),
    prompt=st.from_regex(r"[A-Za-z][A-Za-z ]{0,20}[a-z]", fullmatch=True),
)
def test_every_unit_spelling_gives_its_seconds_and_the_whole_prompt(
    amount: int, unit: str, space: str, upper: bool, prompt: str
) -> None:
    written = f"{amount}{space}{unit.upper() if upper else unit}"
    when, rest = split_when(f"in {written} {prompt}")
    assert (when, rest) == (f"in {written}", prompt)
    now = utc(2026, 6, 1, 12, 0)
    assert parse_when(when, "UTC", now).at == now + amount * UNIT_SECONDS[unit]


_UNITISH = st.sampled_from(
    ["m", "min", "minutes", "minuets", "mo", "mon", "months", "h", "hours", "hx", "d", "days",
     "dz", "s", "secs", "sx", "w", "weeks", "call", "and", "2h", "09:00", "30m"]
)  # fmt: skip


@given(
    keyword=st.sampled_from(["in", "every", "at", "In"]),
    amount=st.sampled_from(["6", "30", "2", "0", "09:00", "2026-12-01 09:00", "2026-12-01"]),
    gaps=st.lists(st.sampled_from(["", " ", ", ", ","]), min_size=4, max_size=4),
    words=st.lists(_UNITISH, min_size=1, max_size=4),
)
def test_a_prompt_never_starts_inside_a_word(
    keyword: str, amount: str, gaps: list[str], words: list[str]
) -> None:
    text = f"{keyword} {amount}" + "".join(g + w for g, w in zip(gaps, words, strict=False))
    try:
        when, prompt = split_when(text)
        cadence = parse_when(when, "UTC", utc(2026, 6, 1, 12, 0))
    except CadenceError:
        return  # refused: nothing would be stored
    assert cadence.kind in ("once", "interval", "monthly", "cron")
    if prompt:
        start = len(text) - len(prompt)
        assert text.endswith(prompt) and text[start - 1] in " ,", (text, when, prompt)


def test_an_unreadable_when_is_refused_with_the_accepted_forms() -> None:
    now = utc(2026, 6, 1, 12, 0)
    for text in ("in 30 minuets call mum", "in 2hx go", "every day water", "in 30 3 x"):
        when, _ = split_when(text)
        with pytest.raises(CadenceError, match="units: s/sec/seconds, m/min/minutes") as caught:
            parse_when(when, "UTC", now)
        assert "every 6 months" in str(caught.value)
    with pytest.raises(CadenceError, match="give HH:MM or YYYY-MM-DD HH:MM"):
        parse_when(split_when("at 2026-12-01 09:00abc")[0], "UTC", now)
    with pytest.raises(CadenceError, match="months cannot be mixed"):
        parse_when("every 1 month 2 days", "UTC", now)
    with pytest.raises(CadenceError, match="at most 100 years"):
        parse_when("in 101000 weeks", "UTC", now)
    with pytest.raises(CadenceError, match="at most 100 years"):
        parse_when("every 1201 months", "UTC", now)
    with pytest.raises(CadenceError, match="at most 100 years"):
        parse_when("in 1199 months 36500 days", "UTC", now)
    # The calendar's last minute in New York is in the year 10000 in UTC.
    with pytest.raises(CadenceError, match="at most 100 years"):
        parse_when("at 9999-12-31 23:59", "America/New_York", now)


# --- calendar months ---------------------------------------------------------------------------


def test_months_keep_the_day_or_take_the_months_last() -> None:
    with time_machine.travel(datetime(2027, 1, 31, 8, 30, tzinfo=UTC), tick=False):
        now = time.time()
        monthly = parse_when("every 1 month", BERLIN, now)
        once = parse_when("in 1 month", BERLIN, now)
    fires = missed_fire_times(monthly, monthly.next_after(now), utc(2028, 3, 31, 12, 0))
    assert [local_time(f, BERLIN) for f in fires[:4]] == [
        "2027-02-28 09:30 CET",
        "2027-03-31 09:30 CEST",  # the time of day is local, across the DST change
        "2027-04-30 09:30 CEST",
        "2027-05-31 09:30 CEST",
    ]
    assert local_time(fires[12], BERLIN) == "2028-02-29 09:30 CET"  # a leap year
    assert local_time(once.at, BERLIN) == "2027-02-28 09:30 CET"
    assert monthly.grace(fires[0]) == 2 * HOUR
    assert Cadence.from_json(monthly.to_json()) == monthly


ZONES = ("UTC", BERLIN, "America/New_York", "Australia/Sydney")


@given(
    start=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2090, 12, 31)),
    months=st.integers(min_value=1, max_value=30),
    zone=st.sampled_from(ZONES),
    probe=st.floats(min_value=0, max_value=1),
)
def test_a_monthly_fire_is_the_first_calendar_step_after_any_moment(
    start: datetime, months: int, zone: str, probe: float
) -> None:
    start = start.replace(microsecond=0)
    now = start.replace(tzinfo=ZoneInfo(zone)).timestamp()
    cadence = parse_when(f"every {months} months", zone, now)
    fires = [cadence.next_after(now)]
    for _ in range(5):
        fires.append(cadence.next_after(fires[-1]))
    assert all(f is not None for f in fires) and fires == sorted(set(fires))
    for step, fire in enumerate(fires, start=1):
        local = datetime.fromtimestamp(fire, ZoneInfo(zone))
        year, month = divmod(start.year * 12 + start.month - 1 + step * months, 12)
        assert (local.year, local.month) == (year, month + 1)
        assert local.day == min(start.day, calendar.monthrange(year, month + 1)[1])
        if zone == "UTC":
            assert local.time() == start.time()
    # From any moment between two fires, the next is the later one.
    moment = fires[2] + probe * (fires[3] - fires[2] - 1)
    assert cadence.next_after(moment) == fires[3]


# --- cron -------------------------------------------------------------------------------------


def test_cron_weekdays_count_from_sunday_as_crontab_does() -> None:
    now = utc(2026, 6, 1, 0, 0)  # a Monday
    weekdays = parse_when('"0 9 * * 1-5"', "UTC", now)
    fires = missed_fire_times(weekdays, weekdays.next_after(now), utc(2026, 6, 8, 0, 0))
    days = [datetime.fromtimestamp(f, UTC).strftime("%a") for f in fires]
    assert days == ["Mon", "Tue", "Wed", "Thu", "Fri"]
    for sunday in ("0", "7", "sun", "SUN"):
        fire = parse_when(f'"0 9 * * {sunday}"', "UTC", now).next_after(now)
        assert datetime.fromtimestamp(fire, UTC).strftime("%a %H:%M") == "Sun 09:00"
    every_other = parse_when('"0 9 * * 1/2"', "UTC", now)
    fires = missed_fire_times(every_other, every_other.next_after(now), utc(2026, 6, 8, 0, 0))
    assert [datetime.fromtimestamp(f, UTC).strftime("%a") for f in fires] == [
        "Mon",
        "Wed",
        "Fri",
        "Sun",
    ]
    weekend = parse_when('"0 9 * * fri-mon"', "UTC", now)
    fires = missed_fire_times(weekend, weekend.next_after(now), utc(2026, 6, 8, 12, 0))
    assert [datetime.fromtimestamp(f, UTC).strftime("%a") for f in fires] == [
        "Mon",
        "Fri",
        "Sat",
        "Sun",
        "Mon",
    ]
    with pytest.raises(CadenceError, match="day-of-week field"):
        parse_when('"0 9 * * 8"', "UTC", now)


def test_a_cron_expression_is_bounded_before_it_is_parsed() -> None:
    now = utc(2026, 6, 1, 12, 0)
    limits = "at most 100 characters and 24 comma-separated items per field"
    longest = ",".join(["0"] * 24) + " 9 * * *"
    assert parse_when(f'"{longest}"', "UTC", now).kind == "cron"
    with pytest.raises(CadenceError, match=f"the minute field lists 25 items .{limits}"):
        parse_when(f'"{",".join(["0"] * 25)} 9 * * *"', "UTC", now)
    wide = ",".join(map(str, range(0, 60, 3))) + " " + ",".join(map(str, range(24))) + " * * *"
    with pytest.raises(CadenceError, match=f"is {len(wide)} characters long .{limits}"):
        parse_when(f'"{wide}"', "UTC", now)
    huge = ",".join(str(i % 60) for i in range(200_000)) + " * * * *"
    started = time.perf_counter()
    with pytest.raises(CadenceError, match=f"WHEN is {len(huge) + 2} characters long"):
        parse_when(f'"{huge}"', "UTC", now)
    assert time.perf_counter() - started < 1.0  # refused by its size, never parsed


def test_both_day_fields_restricted_fire_on_either_as_in_crontab() -> None:
    now = utc(2026, 6, 1, 0, 0)  # a Monday
    either = parse_when('"0 9 13 * fri"', "UTC", now)
    fires = missed_fire_times(either, either.next_after(now), utc(2026, 6, 30, 0, 0))
    assert [datetime.fromtimestamp(f, UTC).strftime("%d %a") for f in fires] == [
        "05 Fri",
        "12 Fri",
        "13 Sat",
        "19 Fri",
        "26 Fri",
    ]
    # A day-of-month part that never fires leaves the weekdays: found in bounded time.
    started = time.perf_counter()
    weekdays = parse_when('"0 9 31 2,4,6,9,11 mon"', "UTC", now)
    assert weekdays.shortest_gap(now) == 7 * 86400
    assert time.perf_counter() - started < 0.5


def test_an_expression_that_never_fires_is_refused_in_bounded_time() -> None:
    now = utc(2026, 6, 1, 0, 0)
    started = time.perf_counter()
    for expression in ("0 0 31 2 *", "0 0 30,31 2 *", "0 0 31 2,4,6,9,11,2,4,6,9,11,2,4,6,9,11 *"):
        with pytest.raises(CadenceError, match="never fires"):
            parse_when(f'"{expression}"', "UTC", now)
    # Looked for over a bounded horizon, not to the year 9999.
    assert time.perf_counter() - started < 0.5
