"""The schedule tools: `schedule_create`, `schedule_list`, `schedule_delete`, so
"remind me tomorrow at 9 to call Bob" works through the model.

The same book and validation as `/schedule` (gateway.schedules.book), scoped the same
way: the asking user's schedules under this agent, delivered to the asking chat (or the
platform's home channel). A refusal (a time in the past, too short an interval, too
many schedules, no home channel) is a ValueError: a result the model reads and can
explain.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.schedules.book import Asker, ScheduleBook, ScheduleError, next_fire_text, shown
from gateway.tools.builtin import Args
from gateway.tools.registry import Tool, TurnScope

WHEN_HELP = (
    'When: "in 30 minutes" / "in 2h 30m" / "in 3 days" / "in 1 month" (once, from now),'
    ' "at 09:00" (once, the next time the clock shows it) or "at 2026-12-01 09:00" (once),'
    ' "every 2 hours" / "every 1 week" / "every 6 months" (repeating; months keep the day'
    ' of the month), or a five-field cron expression such as "0 9 * * 1-5" (weekdays at'
    " 9:00). Units: s, m/min, h/hr, d/day, w/week, month (singular or plural). Times are"
    " in the gateway's time zone unless `timezone` is given."
)


def _book(scope: TurnScope) -> tuple[ScheduleBook, Asker]:
    if scope.schedules is None:
        raise ValueError("scheduled jobs are not available in this gateway")
    if scope.source is None:
        raise ValueError("this turn has no chat to deliver a schedule's runs to")
    source = scope.source
    asker = Asker(scope.agent_id, source.platform.value, source.user_id, source.chat_id)
    return scope.schedules, asker


class CreateArgs(Args):
    when: str = Field(min_length=1, description=WHEN_HELP)
    prompt: str = Field(
        min_length=1,
        description="What to do at that time, as an instruction to yourself (e.g. 'Remind"
        " the user to call Bob')",
    )
    deliver: Literal["chat", "home"] = Field(
        default="chat",
        description="chat: this chat (default); home: the platform's home channel",
    )
    timezone: str | None = Field(
        default=None, description="An IANA time zone such as Europe/Berlin (optional)"
    )


async def schedule_create(scope: TurnScope, args: CreateArgs) -> dict[str, Any]:
    book, asker = _book(scope)
    assert scope.source is not None
    try:
        row = await book.add(
            agent_id=asker.agent_id,
            target=scope.source,
            user_id=asker.user_id,
            when=args.when,
            prompt=args.prompt,
            deliver=args.deliver,
            timezone=args.timezone,
        )
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None
    return {**_brief(row), "next_run_local": next_fire_text(row)}


async def schedule_list(scope: TurnScope, args: Args) -> dict[str, Any]:
    book, asker = _book(scope)
    return {"schedules": [_brief(row) for row in await book.list(asker)]}


class DeleteArgs(Args):
    schedule_id: str = Field(min_length=1, description="The schedule's id (from schedule_list)")


async def schedule_delete(scope: TurnScope, args: DeleteArgs) -> dict[str, Any]:
    book, asker = _book(scope)
    try:
        await book.remove(args.schedule_id, asker)
    except ScheduleError as exc:
        raise ValueError(str(exc)) from None
    return {"deleted": args.schedule_id}


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    listed = shown(row)
    keep = ("id", "prompt", "cadence", "status", "next_run_at", "deliver")
    return {name: listed[name] for name in keep}


class _NoArgs(Args):
    pass


SCHEDULE_TOOLS = (
    Tool(
        "schedule_create",
        "Schedule a reminder or a recurring task: at its time, `prompt` is run as a turn of"
        " its own and the answer is sent to this chat. Returns its id and next run time.",
        CreateArgs,
        schedule_create,
    ),
    Tool(
        "schedule_list",
        "List the user's scheduled tasks (id, what, when, status, next run in UTC).",
        _NoArgs,
        schedule_list,
        read_only=True,
    ),
    Tool(
        "schedule_delete", "Delete one of the user's scheduled tasks.", DeleteArgs, schedule_delete
    ),
)
