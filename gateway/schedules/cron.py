"""Five-field cron expressions: bounded before they are parsed, read as crontab reads them.

APScheduler parses a list item by item and walks every item on each next-fire
computation, so an expression's size is checked first (`CRON_MAX_CHARS`,
`CRON_MAX_ITEMS` per field): a refusal costs microseconds whatever the message size.
Whether an expression fires at all is looked for over `HORIZON` only (APScheduler
would walk the calendar to the year 9999: seconds of CPU for `0 0 31 2,4,6,9,11 *`).

Read as crontab reads it, where APScheduler 3.x differs:
- the weekday field: 0 and 7 Sunday, 1 Monday .. 6 Saturday, names `sun`..`sat`
  (APScheduler counts 0 Monday .. 6 Sunday, so `0 9 * * 1-5` would fire Tuesday to
  Saturday). The field is rewritten as day names; a range may wrap (`fri-mon`).
- both day fields restricted (neither starts with `*`): a day matching either fires
  (`0 9 1 * mon`: the 1st and every Monday); APScheduler wants both.
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, datetime, timedelta, tzinfo

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.combining import OrTrigger
from apscheduler.triggers.cron import CronTrigger

CRON_MAX_CHARS = 100
CRON_MAX_ITEMS = 24  # comma-separated items in one field
# Every expression that fires at all fires within this: a date on a given weekday (the
# rarest, both day fields starting with `*`: Feb 1 on a Monday) recurs within 12 years.
HORIZON = timedelta(days=366 * 40)
FIELDS = ("minute", "hour", "day of month", "month", "day of week")
LIMITS = (
    f"at most {CRON_MAX_CHARS} characters and {CRON_MAX_ITEMS} comma-separated items per"
    " field; use ranges and steps such as 9-17 or */15"
)

_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")  # crontab's order: 0 = Sunday
_WEEKDAY = re.compile(r"(\*|[0-7]|[a-z]{3})(?:-([0-7]|[a-z]{3}))?(?:/(\d{1,2}))?")


class CronError(ValueError):
    """An expression that cannot be used; the message is for the user."""


def check(expression: str) -> list[str]:
    """The expression's five fields, after the size checks (CronError otherwise)."""
    if len(expression) > CRON_MAX_CHARS:
        raise CronError(f"the cron expression is {len(expression)} characters long ({LIMITS})")
    fields = expression.split()
    if len(fields) != len(FIELDS):
        raise CronError(
            f"a cron expression has five fields (minute hour day-of-month month"
            f" day-of-week), this one has {len(fields)}"
        )
    for name, field in zip(FIELDS, fields, strict=True):
        items = field.count(",") + 1
        if items > CRON_MAX_ITEMS:
            raise CronError(f"the {name} field lists {items} items ({LIMITS})")
    return fields


def trigger(expression: str, zone: tzinfo) -> BaseTrigger:
    """APScheduler's trigger for a crontab expression (CronError naming what is wrong).
    Made once per expression and zone: next-fire computations reuse it."""
    return _trigger(expression, zone)


def fires_within(expression: str, zone: tzinfo, after: datetime) -> bool:
    """Whether the expression fires within `HORIZON` of `after`."""
    return _build(expression, zone, after).get_next_fire_time(None, after) is not None


@functools.lru_cache(maxsize=512)
def _trigger(expression: str, zone: tzinfo) -> BaseTrigger:
    return _build(expression, zone, None)


def _build(expression: str, zone: tzinfo, after: datetime | None) -> BaseTrigger:
    """The trigger; with `after`, one that looks no further than `HORIZON` from it."""
    minute, hour, day, month, weekday = check(expression)
    day = "*" if day == "?" else day
    weekdays = _weekdays(weekday)
    start = after or datetime.now(UTC)

    def cron(day: str, day_of_week: str, end: datetime | None) -> CronTrigger:
        return CronTrigger(
            minute=minute,
            hour=hour,
            day=day,
            month=month,
            day_of_week=day_of_week,
            timezone=zone,
            end_date=end,
        )

    end = None if after is None else after + HORIZON
    try:
        if day.startswith("*") or weekday.startswith(("*", "?")):
            return cron(day, weekdays, end)
        # Either day field. A part that never fires (`31 2 *`) is left out: asked for
        # its next fire time it would walk the calendar to the year 9999, every time.
        parts = [
            part
            for part in ((day, "*"), ("*", weekdays))
            if cron(*part, start + HORIZON).get_next_fire_time(None, start) is not None
        ]
        if len(parts) == 1:
            return cron(*parts[0], end)
        return OrTrigger([cron(*part, end) for part in parts or ((day, "*"), ("*", weekdays))])
    except ValueError as exc:
        raise CronError(str(exc)) from None


def _weekdays(field: str) -> str:
    """A crontab weekday field as APScheduler day names (`*` stays `*`)."""
    if field in ("*", "?"):
        return "*"
    days: set[int] = set()
    for item in field.lower().split(","):
        match = _WEEKDAY.fullmatch(item)
        if match is None:
            raise CronError(f"cannot read {item!r} in the day-of-week field (0-7 or sun-sat)")
        first, last, step = match.groups()
        if first == "*":
            if last is not None:
                raise CronError(f"cannot read {item!r} in the day-of-week field")
            start, end = 0, 6
        else:
            start = _day(first)
            # `1/2`: from Monday to the end of the week (7, Sunday), as crontab reads it
            end = _day(last) if last is not None else 7 if step is not None else start
        increment = int(step) if step is not None else 1
        if increment < 1:
            raise CronError(f"the step in {item!r} must be 1 or more")
        if start > end:  # `fri-mon`: on through the weekend
            end += 7
        days.update(day % 7 for day in range(start, end + 1, increment))
    return ",".join(_DAY_NAMES[day] for day in sorted(days))


def _day(text: str) -> int:
    if text.isdigit():
        return int(text)  # 0..7, the pattern allows no more
    if text not in _DAY_NAMES:
        raise CronError(f"unknown day {text!r} in the day-of-week field (sun, mon, .., sat)")
    return _DAY_NAMES.index(text)
