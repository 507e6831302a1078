"""When a schedule fires: the WHEN syntax, and each cadence's next fire time.

    in 90s | in 30m | in 2h | in 1d      once, that long from now
    at 2026-12-01 09:00 | at 09:00        once, in the schedule's time zone (a bare time:
                                          the next time the clock shows it)
    every 10m | every 2h | every 1d       an interval, first fire one period from now
    "0 9 * * 1-5"                         five-field cron, in the schedule's time zone

Next-fire computation is APScheduler 3.x's (`DateTrigger`, `IntervalTrigger`,
`CronTrigger.from_crontab`, which is correct across DST changes); the triggers are made
on demand from the stored cadence, never kept in a job store. Times are Unix seconds.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import orjson
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
GRACE_MIN = 120.0  # a missed fire time runs late within its grace: half its period,
GRACE_MAX = 7200.0  # clamped to 2 min .. 2 h
CRON_GAPS_CHECKED = 24  # fire times looked at to find a cron expression's shortest gap
MISSED_COUNTED = 10_000  # fire times counted after downtime, at most

_AMOUNT = re.compile(r"(\d{1,7})\s*([smhd])", re.IGNORECASE)
_DATE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{1,2}):(\d{2})")
_TIME = re.compile(r"(\d{1,2}):(\d{2})")

Kind = Literal["once", "interval", "cron"]


class CadenceError(ValueError):
    """A WHEN that cannot be used; the message says what is wrong, for the user."""


@dataclass(frozen=True, slots=True)
class Cadence:
    """A stored cadence (`schedules.cadence`, JSON). `at`: the one fire time (once);
    `seconds` and `anchor`: the period and its first fire time (interval); `cron`: the
    expression (cron). `timezone`: an IANA name, for cron fields and for display."""

    kind: Kind
    timezone: str
    at: float | None = None
    seconds: float | None = None
    anchor: float | None = None
    cron: str | None = None

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

    def _trigger(self) -> DateTrigger | IntervalTrigger | CronTrigger:
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
        return CronTrigger.from_crontab(self.cron, timezone=zone)

    def next_after(self, moment: float) -> float | None:
        """The first fire time strictly after `moment` (None: it never fires again)."""
        if self.kind == "once":
            assert self.at is not None
            return self.at if self.at > moment else None
        if self.kind == "interval":
            assert self.anchor is not None
            if moment < self.anchor:
                return self.anchor
        # The triggers return the first fire time at or after `now`: one microsecond on.
        after = _utc(moment) + timedelta(microseconds=1)
        fire = self._trigger().get_next_fire_time(None, after)
        return None if fire is None else fire.timestamp()

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
        """A recurring cadence's shortest time between two fires (cron: over the next
        `CRON_GAPS_CHECKED` fire times); None for a one-shot."""
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
        """For people: `every 2h`, `cron 0 9 * * 1-5 (Europe/Berlin)`, `once`."""
        if self.kind == "interval":
            assert self.seconds is not None
            return f"every {duration(self.seconds)}"
        if self.kind == "cron":
            return f"cron {self.cron} ({self.timezone})"
        return "once"


def zone_named(name: str) -> tzinfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CadenceError(
            f"unknown time zone {name!r} (an IANA name, e.g. Europe/Berlin)"
        ) from None


def zone_name(zone: tzinfo) -> str:
    """An IANA name for a zone (a fixed offset without one: UTC)."""
    key = getattr(zone, "key", None)
    return key if isinstance(key, str) else "UTC"


def duration(seconds: float) -> str:
    """90 -> 90s, 1800 -> 30m, 7200 -> 2h, 86400 -> 1d (the largest whole unit)."""
    for unit in ("d", "h", "m"):
        if seconds >= UNITS[unit] and seconds % UNITS[unit] == 0:
            return f"{int(seconds // UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def local_time(moment: float, timezone: str) -> str:
    """`2026-12-01 09:00 CET`: a Unix time as the schedule's clock shows it."""
    local = _utc(moment).astimezone(zone_named(timezone))
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()}"


def split_when(text: str) -> tuple[str, str]:
    """`/schedule add` arguments -> (WHEN, PROMPT): `in 30m ...`, `every 2h ...`,
    `at 09:00 ...`, `at 2026-12-01 09:00 ...` or `"0 9 * * 1-5" ...`."""
    text = text.strip()
    if text.startswith(('"', "'")):
        end = text.find(text[0], 1)
        if end < 0:
            raise CadenceError("the cron expression's closing quote is missing")
        return text[: end + 1], text[end + 1 :].strip()
    words = text.split(None, 1)
    first = words[0].lower() if words else ""
    if first not in ("in", "every", "at") or len(words) < 2:
        raise CadenceError(
            'WHEN must start with "in", "at" or "every", or be a cron expression in quotes'
        )
    rest = words[1]
    if first == "at" and (match := _DATE_TIME.match(rest)):
        size = match.end()
    else:
        size = len(rest.split(None, 1)[0])
        if first in ("in", "every") and (match := _AMOUNT.match(rest)):
            size = match.end()  # `in 2 h` as well as `in 2h`
    return f"{first} {rest[:size]}", rest[size:].strip()


def parse_when(when: str, timezone: str, now: float) -> Cadence:
    """A WHEN (see the module's docstring) as a cadence in `timezone`; CadenceError
    naming what is wrong (an unknown unit, a time in the past, a bad cron field)."""
    zone = zone_named(timezone)
    text = when.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    first, _, rest = text.partition(" ")
    first, rest = first.lower(), rest.strip()
    if first in ("in", "every"):
        match = _AMOUNT.fullmatch(rest)
        if match is None:
            raise CadenceError(
                f"{first} {rest!r}: give a whole number and a unit s, m, h or d (e.g. {first} 30m)"
            )
        seconds = float(int(match.group(1)) * UNITS[match.group(2).lower()])
        if seconds <= 0:
            raise CadenceError(f"{first} {rest}: the time must be more than 0")
        if first == "in":
            return Cadence("once", timezone, at=round(now + seconds, 3))
        return Cadence("interval", timezone, seconds=seconds, anchor=round(now + seconds, 3))
    if first == "at":
        return Cadence("once", timezone, at=_at(rest, zone, timezone, now))
    if not text or not (text[0].isdigit() or text[0] in "*?"):
        raise CadenceError(
            f"cannot read WHEN {when!r}: use in 30m, at 09:00, at 2026-12-01 09:00, every 2h,"
            ' or a five-field cron expression such as "0 9 * * 1-5"'
        )
    try:
        CronTrigger.from_crontab(text, timezone=zone)
    except ValueError as exc:
        raise CadenceError(f"cannot read the cron expression {text!r}: {exc}") from None
    cadence = Cadence("cron", timezone, cron=" ".join(text.split()))
    if cadence.next_after(now) is None:
        raise CadenceError(f"the cron expression {text!r} never fires")
    return cadence


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
    raise CadenceError(f"at {text!r}: give HH:MM or YYYY-MM-DD HH:MM")


def _local(
    zone: tzinfo, year: int, month: int, day: int, hour: int, minute: int, text: str
) -> float:
    try:
        return datetime(year, month, day, hour, minute, tzinfo=zone).timestamp()
    except ValueError as exc:
        raise CadenceError(f"at {text}: {exc}") from None


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
