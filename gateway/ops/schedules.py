"""`hermes-gateway schedules list | add | remove | pause | resume | runs`: the operator's
view of scheduled jobs.

Works beside a running daemon or without one, like `sessions`: state.db's writes are
serialised by SQLite (WAL), and the daemon sees a schedule added here within a second
(it asks SQLite whether another process wrote, `PRAGMA data_version`, once a second).
Times in `--json` are ISO 8601 UTC. Exit codes: 0 done, 1 refused or not found (`add`
refuses a platform the config does not enable, and `--home-channel` a platform with no
home channel).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from config import MAIN_AGENT, GatewayConfig
from gateway.domain.session import SessionSource
from gateway.ops.cliargs import platform_pair
from gateway.schedules.book import ScheduleBook, ScheduleError, next_fire_text, shown, shown_run
from gateway.store.session_store import SessionStore

RUNS_LISTED = 50


def add_schedules_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    schedules = sub.add_parser("schedules", parents=parents, help="scheduled jobs")
    schedules_sub = schedules.add_subparsers(dest="schedules_command", required=True)
    listing = schedules_sub.add_parser("list", parents=parents, help="every schedule")
    listing.add_argument("--agent", default=None, help="only this agent's")
    listing.add_argument("--json", action="store_true")
    add = schedules_sub.add_parser("add", parents=parents, help="a new schedule")
    where = add.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--chat", type=platform_pair("CHAT_ID"), metavar="PLATFORM:CHAT_ID", help="deliver here"
    )
    where.add_argument(
        "--home-channel", metavar="PLATFORM", help="deliver to the platform's home channel"
    )
    add.add_argument("--agent", default=MAIN_AGENT, help="whose turn runs it (default main)")
    add.add_argument("--user", default=None, metavar="USER_ID", help="on whose behalf")
    add.add_argument("--chat-type", default="dm", choices=("dm", "group", "channel", "thread"))
    add.add_argument("--timezone", default=None, help="IANA zone (default the gateway's)")
    add.add_argument("--json", action="store_true")
    add.add_argument(
        "when",
        metavar="WHEN",
        help='"in 30 minutes", "at 09:00", "every 2 hours", "every 6 months", "0 9 * * *"',
    )
    add.add_argument("prompt", nargs="+", metavar="PROMPT")
    for name, text in (
        ("remove", "delete a schedule and its runs"),
        ("pause", "stop a schedule firing"),
        ("resume", "start a paused schedule again"),
        ("runs", "a schedule's run history, newest first"),
    ):
        cmd = schedules_sub.add_parser(name, parents=parents, help=text)
        cmd.add_argument("schedule_id", metavar="ID")
        cmd.add_argument("--json", action="store_true")
    schedules.set_defaults(handler=None)  # set by gateway.cli


async def run_schedules_command(
    store: SessionStore, config: GatewayConfig, args: argparse.Namespace
) -> int:
    book = ScheduleBook(store, config)
    command = args.schedules_command
    try:
        if command == "list":
            return await _list(book, args)
        if command == "add":
            return await _add(book, args)
        if command == "runs":
            return await _runs(book, args)
        change = {"remove": book.remove, "pause": book.pause, "resume": book.resume}[command]
        row = await change(args.schedule_id, None)
    except ScheduleError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # an id a session key cannot hold, an unknown platform
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    done = {"remove": "removed", "pause": "paused", "resume": "resumed"}[command]
    if args.json:
        print(json.dumps({"id": args.schedule_id, "done": done}))
    else:
        print(f"{done} {args.schedule_id} ({shown(row)['cadence']})")
    return 0


async def _list(book: ScheduleBook, args: argparse.Namespace) -> int:
    found = [shown(row) for row in await book.list(None)]
    if args.agent is not None:
        found = [row for row in found if row["agent"] == args.agent]
    if args.json:
        print(json.dumps(found, indent=2, ensure_ascii=False))
        return 0
    if not found:
        print("no schedules")
        return 0
    for row in found:
        where = f"{row['platform']}:{row['chat_id']}"
        if row["deliver"] == "home":
            where = f"{row['platform']} home channel"
        print(
            f"{row['id']}  [{row['status']}]  {row['cadence']}  next {row['next_run_at'] or '-'}"
            f"  ({row['agent']}, {where})"
        )
        print(f"    {row['prompt']}")
    return 0


async def _add(book: ScheduleBook, args: argparse.Namespace) -> int:
    agents = book.config.agent_configs()
    if args.agent not in agents:
        raise ScheduleError(f"unknown agent {args.agent!r} (agents: {', '.join(agents)})")
    if args.chat is not None:
        platform, chat_id = args.chat
        deliver = "chat"
    else:
        platform, chat_id, deliver = args.home_channel, "home", "home"
    target = SessionSource.from_dict(
        {
            "platform": platform,
            "chat_id": chat_id,
            "chat_type": args.chat_type,
            "user_id": args.user,
        }
    )
    row = await book.add(
        agent_id=args.agent,
        target=target,
        user_id=args.user,
        when=args.when,
        prompt=" ".join(args.prompt),
        deliver=deliver,
        timezone=args.timezone,
        limited=False,
    )
    if args.json:
        print(json.dumps(shown(row), indent=2, ensure_ascii=False))
    else:
        print(f"added {row['schedule_id']}: next run {next_fire_text(row)}")
    return 0


async def _runs(book: ScheduleBook, args: argparse.Namespace) -> int:
    runs = [shown_run(run) for run in await book.runs(args.schedule_id, None, RUNS_LISTED)]
    if args.json:
        print(json.dumps(runs, indent=2, ensure_ascii=False))
        return 0
    if not runs:
        print(f"{args.schedule_id} has not run yet")
        return 0
    for run in runs:
        summary = " ".join((run["output_summary"] or "").split())[:100]
        print(f"{run['fire_time']}  {run['status']:11}  {summary}")
    return 0
