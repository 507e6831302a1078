"""When a schedule fires: the WHEN syntax, and each cadence's next fire time.

    in 90s | in 30 minutes | in 2h 30m    once, that long from now
    in 3 months                           once, on the same day of the month (or its last)
    at 2026-12-01 09:00 | at 09:00        once, in the schedule's time zone (a bare time:
                                          the next time the clock shows it)
    every 10m | every 2 hours | every 1w  an interval, first fire one period from now
    every 6 months                        calendar months: the same day and time of day,
                                          the month's last day when it has fewer days
    "0 9 * * 1-5"                         five-field cron, in the schedule's time zone

Units: s/sec/second(s), m/min/minute(s), h/hr/hour(s), d/day(s), w/wk/week(s),
mo/month(s); a unit ends at a space, a comma or the end (`in 2hours` is read, `in 2hx`
is not). Next-fire computation is APScheduler 3.x's (`DateTrigger`, `IntervalTrigger`,
`CronTrigger`, correct across DST changes; gateway.schedules.cron bounds and reads the
expression) and, for months, day-of-month arithmetic here; the triggers are made from
the stored cadence, never kept in a job store. Times are Unix seconds.
"""

from __future__ import annotations

import calendar
import itertools
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import orjson
from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from gateway.schedules import cron

UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}  # for display, largest first
GRACE_MIN = 120.0  # a missed fire time runs late within its grace: half its period,
GRACE_MAX = 7200.0  # clamped to 2 min .. 2 h
CRON_GAPS_CHECKED = 24  # fire times looked at to find a cron expression's shortest gap
MISSED_COUNTED = 10_000  # fire times counted after downtime, at most
WHEN_MAX_CHARS = 200
MAX_AHEAD_DAYS = 36_525  # `in` and `every`: at most 100 years
MAX_MONTHS = 1200

MONTH = "month"  # the calendar unit; every other unit is a fixed number of seconds
_UNIT_WORDS: dict[str, int | str] = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
    **dict.fromkeys(("w", "wk", "wks", "week", "weeks"), 604800),
    **dict.fromkeys(("mo", "month", "months"), MONTH),
}
_UNIT_ALTERNATIVES = "|".join(sorted(_UNIT_WORDS, key=len, reverse=True))
# An amount: a whole number and a unit that ends at a space, a comma or the end, so a
# prompt never starts inside the word the unit began (`in 6 months` is not `in 6 m`).
_AMOUNT = re.compile(rf"(\d{{1,7}})[ \t]*({_UNIT_ALTERNATIVES})(?=[\s,]|$)", re.IGNORECASE)
_AMOUNT_JOIN = re.compile(r"\s*,?\s*(?:and\s+)?", re.IGNORECASE)  # `2h 30m`, `1 day and 2 hours`
_DATE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{1,2}):(\d{2})(?=\s|$)")
_TIME = re.compile(r"(\d{1,2}):(\d{2})")
_PROMPT_LEAD = " \t\r\n,"  # between a WHEN and its prompt
FORMS = (
    "in 30 minutes, in 2h 30m, at 09:00, at 2026-12-01 09:00, every 2 hours, every 6 months,"
    ' or a five-field cron expression in quotes such as "0 9 * * 1-5"; units: s/sec/seconds,'
    " m/min/minutes, h/hr/hours, d/days, w/weeks, months"
)

Kind = Literal["once", "interval", "monthly", "cron"]


class CadenceError(ValueError):
    """A WHEN that cannot be used; the message says what is wrong, for the user."""


@dataclass(frozen=True, slots=True)
class Cadence:
    """A stored cadence (`schedules.cadence`, JSON). `at`: the one fire time (once);
    `seconds` and `anchor`: the period and its first fire time (interval); `months`,
    `start` and `anchor`: every `months` calendar months from the local time `start`
    (ISO, no zone), its day of month kept or clamped to the month's last, first fire
    `anchor` (monthly); `cron`: the expression (cron). `timezone`: an IANA name, for
    cron fields, months and display."""

    kind: Kind
    timezone: str
    at: float | None = None
    seconds: float | None = None
    anchor: float | None = None
    cron: str | None = None
    months: int | None = None
    start: str | None = None

    def to_json(self) -> str:
        return orjson.dumps({k: v for k, v in asdict(self).items() if v is not None}).decode()

    @classmethod
    def from_json(cls, raw: str) -> Cadence:
        data: dict[str, Any] = orjson.loads(raw)
        return cls(**data)

    @property
    def recurring(self) -> bool:
        return self.kind != "once"

    def zone(self) -> tzinfo:
        return zone_named(self.timezone)

    def _trigger(self) -> BaseTrigger:
        zone = self.zone()
        if self.kind == "once":
            assert self.at is not None
            return DateTrigger(_utc(self.at), timezone=zone)
        if self.kind == "interval":
            assert self.seconds is not None and self.anchor is not None
            return IntervalTrigger(
                seconds=self.seconds, start_date=_utc(self.anchor), timezone=zone
            )
        assert self.cron is not None
        try:
            return cron.trigger(self.cron, zone)
        except cron.CronError as exc:
            raise CadenceError(str(exc)) from None

    def next_after(self, moment: float) -> float | None:
        """The first fire time strictly after `moment` (None: it never fires again)."""
        if self.kind == "once":
            assert self.at is not None
            return self.at if self.at > moment else None
        if self.kind in ("interval", "monthly"):
            assert self.anchor is not None
            if moment < self.anchor:
                return self.anchor
        if self.kind == "monthly":
            return self._next_month_after(moment)
        # The triggers return the first fire time at or after `now`: one microsecond on.
        after = _utc(moment) + timedelta(microseconds=1)
        fire = self._trigger().get_next_fire_time(None, after)
        return None if fire is None else fire.timestamp()

    def _next_month_after(self, moment: float) -> float | None:
        assert self.months is not None and self.start is not None
        start = datetime.fromisoformat(self.start)
        local = _utc(moment).astimezone(self.zone())
        elapsed = (local.year - start.year) * 12 + local.month - start.month
        # One step before the estimate, then on: a fire later in the month than `moment`.
        step = max(1, elapsed // self.months - 1)
        while True:
            fire = months_later(start, step * self.months, self.zone())
            if fire is None or fire > moment:
                return fire
            step += 1

    def period(self, fire_time: float) -> float | None:
        """The time from `fire_time` to the next fire (None for a one-shot)."""
        following = self.next_after(fire_time) if self.recurring else None
        return None if following is None else following - fire_time

    def grace(self, fire_time: float) -> float:
        """How late a missed fire time may still run: half the period, 2 min .. 2 h."""
        period = self.period(fire_time)
        half = GRACE_MAX if period is None else period / 2
        return min(max(half, GRACE_MIN), GRACE_MAX)

    def shortest_gap(self, now: float) -> float | None:
        """A recurring cadence's shortest time between two fires (cron and months: over
        the next `CRON_GAPS_CHECKED` fire times); None for a one-shot."""
        if self.kind == "once":
            return None
        if self.kind == "interval":
            return self.seconds
        fires: list[float] = []
        moment = now
        for _ in range(CRON_GAPS_CHECKED):
            fire = self.next_after(moment)
            if fire is None:
                break
            fires.append(fire)
            moment = fire
        gaps = [b - a for a, b in itertools.pairwise(fires)]
        return min(gaps) if gaps else None

    def describe(self) -> str:
        """For people: `every 2h`, `every 6 months`, `cron 0 9 * * 1-5 (Europe/Berlin)`,
        `once`."""
        if self.kind == "interval":
            assert self.seconds is not None
            return f"every {duration(self.seconds)}"
        if self.kind == "monthly":
            return "every month" if self.months == 1 else f"every {self.months} months"
        if self.kind == "cron":
            return f"cron {self.cron} ({self.timezone})"
        return "once"


def zone_named(name: str) -> tzinfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CadenceError(
            f"unknown time zone {_quoted(name)} (an IANA name, e.g. Europe/Berlin)"
        ) from None


def zone_name(zone: tzinfo) -> str:
    """An IANA name for a zone (a fixed offset without one: UTC)."""
    key = getattr(zone, "key", None)
    return key if isinstance(key, str) else "UTC"


def duration(seconds: float) -> str:
    """90 -> 90s, 1800 -> 30m, 7200 -> 2h, 86400 -> 1d, 1209600 -> 2w (the largest
    whole unit)."""
    for unit in ("w", "d", "h", "m"):
        if seconds >= UNITS[unit] and seconds % UNITS[unit] == 0:
            return f"{int(seconds // UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def local_time(moment: float, timezone: str) -> str:
    """`2026-12-01 09:00 CET`: a Unix time as the schedule's clock shows it."""
    local = _utc(moment).astimezone(zone_named(timezone))
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()}"


def months_later(start: datetime, months: int, zone: tzinfo) -> float | None:
    """The local wall time `start` (naive), `months` calendar months on, as a Unix time:
    the same day of the month, or the month's last day when it has fewer (Jan 31 ->
    Feb 28). None past the calendar's end."""
    year, month = divmod(start.year * 12 + start.month - 1 + months, 12)
    if year > 9999:
        return None
    day = min(start.day, calendar.monthrange(year, month + 1)[1])
    return start.replace(year=year, month=month + 1, day=day, tzinfo=zone).timestamp()


def split_when(text: str) -> tuple[str, str]:
    """`/schedule add` arguments -> (WHEN, PROMPT): `in 30m ...`, `every 2 hours ...`,
    `at 09:00 ...`, `at 2026-12-01 09:00 ...` or `"0 9 * * 1-5" ...`. The prompt starts
    after a space or comma (or the cron expression's closing quote), never inside a
    word; a WHEN that cannot be read is returned whole and refused by `parse_when`."""
    text = text.strip()
    if text.startswith(('"', "'")):
        end = text.find(text[0], 1)
        if end < 0:
            raise CadenceError("the cron expression's closing quote is missing")
        return text[: end + 1], text[end + 1 :].lstrip(_PROMPT_LEAD)
    words = text.split(None, 1)
    first = words[0].lower() if words else ""
    if first not in ("in", "every", "at") or len(words) < 2:
        raise CadenceError(
            'WHEN must start with "in", "at" or "every", or be a cron expression in quotes'
        )
    rest = words[1]
    tokens = rest.split(None, 2)
    size = len(tokens[0])
    if first == "at" and (match := _DATE_TIME.match(rest)):
        size = match.end()
    elif first in ("in", "every"):
        if (end := _amounts_end(rest)) is not None:
            size = end  # `in 2 h` as well as `in 2h`, `in 1h 30m`
        elif tokens[0].isdigit() and len(tokens) > 1:  # `in 30 minuets`: refused whole
            size = rest.index(tokens[1], len(tokens[0])) + len(tokens[1])
    return f"{first} {rest[:size]}", rest[size:].lstrip(_PROMPT_LEAD)


def _amounts_end(text: str) -> int | None:
    """Where the amounts at the start of `text` end (`2h 30m`), None without one."""
    match = _AMOUNT.match(text)
    if match is None:
        return None
    end = match.end()
    while (following := _AMOUNT.match(text, _AMOUNT_JOIN.match(text, end).end())) is not None:
        end = following.end()
    return end


def _amounts(text: str) -> tuple[int, int] | None:
    """`2h 30m` -> (seconds, months); None unless all of `text` is amounts."""
    if _amounts_end(text) != len(text):
        return None
    seconds = months = 0
    position = 0
    while (match := _AMOUNT.search(text, position)) is not None:
        unit = _UNIT_WORDS[match.group(2).lower()]
        if unit == MONTH:
            months += int(match.group(1))
        else:
            seconds += int(match.group(1)) * int(unit)
        position = match.end()
    return seconds, months


def parse_when(when: str, timezone: str, now: float) -> Cadence:
    """A WHEN (see the module's docstring) as a cadence in `timezone`; CadenceError
    naming what is wrong (an unknown unit, a time in the past, a bad cron field)."""
    if len(when) > WHEN_MAX_CHARS:
        raise CadenceError(
            f"WHEN is {len(when)} characters long (at most {WHEN_MAX_CHARS}; a cron"
            f" expression {cron.LIMITS})"
        )
    zone = zone_named(timezone)
    text = when.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    words = text.split(None, 1)
    first = words[0].lower() if words else ""
    rest = words[1].strip() if len(words) > 1 else ""
    if first in ("in", "every"):
        return _in_or_every(first, rest, zone, timezone, now)
    if first == "at":
        return Cadence("once", timezone, at=_near(_at(rest, zone, timezone, now), now, text))
    if not text or not (text[0].isdigit() or text[0] in "*?"):
        raise CadenceError(f"cannot read WHEN {_quoted(when)}: use {FORMS}")
    return _cron(text, zone, timezone, now)


def _in_or_every(first: str, rest: str, zone: tzinfo, timezone: str, now: float) -> Cadence:
    amounts = _amounts(rest)
    if amounts is None:
        raise CadenceError(
            f"{first} {_quoted(rest)}: give a whole number and a unit, e.g. {first} 30 minutes"
            f" ({FORMS})"
        )
    seconds, months = amounts
    if seconds <= 0 and months <= 0:
        raise CadenceError(f"{first} {rest}: the time must be more than 0")
    if seconds > MAX_AHEAD_DAYS * 86400 or months > MAX_MONTHS:
        raise CadenceError(f"{first} {rest}: at most 100 years ahead")
    if first == "every" and months and seconds:
        raise CadenceError(
            f"every {rest}: months cannot be mixed with other units (every 1 month, every 30d)"
        )
    if not months:
        if first == "in":
            return Cadence("once", timezone, at=round(_near(now + seconds, now, rest), 3))
        return Cadence("interval", timezone, seconds=float(seconds), anchor=round(now + seconds, 3))
    # Whole seconds: every fire, the first included, is computed the same way from it.
    start = _utc(now).astimezone(zone).replace(tzinfo=None, microsecond=0)
    later = months_later(start, months, zone)
    if later is None:
        raise CadenceError(f"{first} {rest}: past the end of the calendar")
    if first == "in":
        return Cadence("once", timezone, at=_near(later + seconds, now, rest))
    return Cadence("monthly", timezone, months=months, start=start.isoformat(), anchor=later)


def _near(moment: float, now: float, text: str) -> float:
    """A one-shot's time, if it is within the 100 years a schedule may look ahead."""
    if moment - now > MAX_AHEAD_DAYS * 86400:
        raise CadenceError(f"{text}: at most 100 years ahead")
    return moment


def _cron(text: str, zone: tzinfo, timezone: str, now: float) -> Cadence:
    try:
        cron.trigger(text, zone)
    except cron.CronError as exc:
        raise CadenceError(f"cannot read the cron expression {_quoted(text)}: {exc}") from None
    if not cron.fires_within(text, zone, _utc(now)):
        raise CadenceError(f"the cron expression {text!r} never fires")
    return Cadence("cron", timezone, cron=" ".join(text.split()))


def _at(text: str, zone: tzinfo, timezone: str, now: float) -> float:
    today = _utc(now).astimezone(zone)
    if match := _DATE_TIME.fullmatch(text):
        year, month, day, hour, minute = (int(g) for g in match.groups())
        moment = _local(zone, year, month, day, hour, minute, text)
        if moment <= now:
            raise CadenceError(f"at {text} ({timezone}) is in the past")
        return moment
    if match := _TIME.fullmatch(text):
        hour, minute = int(match.group(1)), int(match.group(2))
        moment = _local(zone, today.year, today.month, today.day, hour, minute, text)
        if moment <= now:  # the clock shows it next tomorrow
            tomorrow = today + timedelta(days=1)
            moment = _local(zone, tomorrow.year, tomorrow.month, tomorrow.day, hour, minute, text)
        return moment
    raise CadenceError(f"at {_quoted(text)}: give HH:MM or YYYY-MM-DD HH:MM")


def _local(
    zone: tzinfo, year: int, month: int, day: int, hour: int, minute: int, text: str
) -> float:
    try:
        return datetime(year, month, day, hour, minute, tzinfo=zone).timestamp()
    except ValueError as exc:
        raise CadenceError(f"at {text}: {exc}") from None


def _quoted(text: str, size: int = 60) -> str:
    """`text` for an error message: quoted, and cut to `size` characters."""
    return repr(text if len(text) <= size else text[: size - 1] + "…")


def missed_fire_times(cadence: Cadence, first: float, now: float) -> list[float]:
    """The fire times from `first` (due, not yet run) up to `now`, oldest first, at most
    `MISSED_COUNTED` of them."""
    fires = [first]
    while len(fires) < MISSED_COUNTED:
        following = cadence.next_after(fires[-1])
        if following is None or following > now:
            break
        fires.append(following)
    return fires


def _utc(moment: float) -> datetime:
    return datetime.fromtimestamp(moment, UTC)
