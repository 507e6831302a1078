"""The chat commands of scheduled jobs: /schedule and /sethome.

    /schedule add [--home] WHEN PROMPT   WHEN: in 30 minutes | at 09:00 | every 2 hours |
                                         every 6 months | "0 9 * * 1-5" (see
                                         gateway.schedules.cadence)
    /schedule list | remove ID | pause ID | resume ID | run ID | runs ID
    /sethome                             this chat is the platform's home channel

Each handler returns the text sent back. What a user sees is scoped by
`gateway.schedules.book.Asker`: their own schedules under this chat's agent.
"""

from __future__ import annotations

from gateway.domain.command_syntax import Command
from gateway.domain.events import MessageEvent
from gateway.domain.session import agent_id_of_key
from gateway.runner.ports import CommandContext
from gateway.schedules.book import Asker, ScheduleError, next_fire_text, shown
from gateway.schedules.cadence import CadenceError, local_time, split_when

USAGE = (
    "Usage: /schedule add [--home] WHEN PROMPT, where WHEN is in 30 minutes, in 2h 30m,"
    " at 09:00, at 2026-12-01 09:00, every 2 hours, every 6 months or a cron expression in"
    ' quotes ("0 9 * * 1-5"); /schedule list | remove ID | pause ID | resume ID | run ID |'
    " runs ID"
)


def asker_of(event: MessageEvent, key: str) -> Asker:
    source = event.source
    return Asker(agent_id_of_key(key), source.platform.value, source.user_id, source.chat_id)


async def cmd_schedule(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    action, _, rest = cmd.args.partition(" ")
    action, rest = action.lower(), rest.strip()
    asker = asker_of(event, key)
    book = ctx.schedule_book
    try:
        if action == "add":
            return await _add(ctx, event, asker, rest)
        if action in ("list", "ls", ""):
            return _listing(await book.list(asker))
        schedule_id = rest.split()[0] if rest else ""
        if action not in ("remove", "rm", "delete", "pause", "resume", "run", "runs"):
            return USAGE
        if not schedule_id:
            return f"Usage: /schedule {action} ID (/schedule list shows the ids)"
        if action in ("remove", "rm", "delete"):
            await book.remove(schedule_id, asker)
            return f"Removed {schedule_id} and its run history."
        if action == "pause":
            await book.pause(schedule_id, asker)
            return f"Paused {schedule_id}; /schedule resume {schedule_id} starts it again."
        if action == "resume":
            row = await book.resume(schedule_id, asker)
            return f"Resumed {schedule_id}; next run {next_fire_text(row)}."
        if action == "run":
            row = await book.get(schedule_id, asker)
            refused = await ctx.scheduler.run_now(row)
            if refused is not None:
                return f"{schedule_id} could not start now: {refused}."
            return f"Running {schedule_id} now."
        return await _runs(ctx, schedule_id, asker)
    except ScheduleError as exc:
        return f"Not done: {exc}"


async def _add(ctx: CommandContext, event: MessageEvent, asker: Asker, rest: str) -> str:
    deliver = "chat"
    flag, _, after = rest.partition(" ")
    if flag == "--home":
        deliver, rest = "home", after.strip()
    if not rest:
        return USAGE
    try:
        when, prompt = split_when(rest)
    except CadenceError as exc:
        return f"Not scheduled: {exc}. {USAGE}"
    try:
        row = await ctx.schedule_book.add(
            agent_id=asker.agent_id,
            target=event.source,
            user_id=asker.user_id,
            when=when,
            prompt=prompt,
            deliver=deliver,
        )
    except ScheduleError as exc:
        return f"Not scheduled: {exc}"
    listed = shown(row)
    where = " to the home channel" if deliver == "home" else ""
    return (
        f"Scheduled {listed['id']} ({listed['cadence']}){where}: next run"
        f" {next_fire_text(row)}. /schedule remove {listed['id']} cancels it."
    )


def _listing(found: list[dict]) -> str:
    if not found:
        return "No schedules. /schedule add WHEN PROMPT makes one."
    lines = [f"Your schedules ({len(found)}):"]
    for row in found:
        listed = shown(row)
        prompt = listed["prompt"] if len(listed["prompt"]) <= 60 else listed["prompt"][:59] + "…"
        lines.append(
            f"{listed['id']}  {listed['cadence']}  [{listed['status']}]"
            f"  next: {next_fire_text(row)} — {prompt}"
        )
    return "\n".join(lines)


async def _runs(ctx: CommandContext, schedule_id: str, asker: Asker) -> str:
    row = await ctx.schedule_book.get(schedule_id, asker)
    runs = await ctx.schedule_book.runs(schedule_id, asker)
    if not runs:
        return f"{schedule_id} has not run yet; next run {next_fire_text(row)}."
    timezone = shown(row)["timezone"]
    lines = [f"Last {len(runs)} runs of {schedule_id} (newest first):"]
    for run in runs:
        summary = " ".join((run["output_summary"] or "").split())[:80]
        lines.append(f"{local_time(run['fire_time'], timezone)}  {run['status']}  {summary}")
    return "\n".join(lines)


async def cmd_sethome(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    if ctx.config.admins and not ctx.is_admin(event.source):
        return "Only an admin can set the home channel (see `admins` in hermes.yaml)."
    await ctx.schedule_book.set_home(event.source)
    platform = event.source.platform.value
    return (
        f"This chat is now the home channel on {platform}: scheduled tasks made with"
        " --home (or by the operator without a chat) deliver here."
    )


async def next_run_line(ctx: CommandContext, event: MessageEvent, key: str) -> str | None:
    """/status's line: the asker's next scheduled run, if any."""
    upcoming = [
        row
        for row in await ctx.schedule_book.list(asker_of(event, key))
        if row["next_run_at"] is not None and row["status"] == "active"
    ]
    if not upcoming:
        return None
    first = min(upcoming, key=lambda row: row["next_run_at"])
    return f"Next scheduled: {first['schedule_id']} at {next_fire_text(first)}"
