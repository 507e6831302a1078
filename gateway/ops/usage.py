"""`hermes-gateway usage [--user P:U] [--agent ID] [--since DATE] [--until DATE]
[--by user,agent,model,day] [--json]`: the operator's view of who used what.

Reads the usage rows each turn's finish writes (gateway.store.usage), beside a running
daemon or without one; on PostgreSQL, every replica's. Dates are the gateway's
`timezone`; `--since` defaults to the first of this month, `--until` (exclusive) to
none. Cost is USD at the models' configured `price`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from config import GatewayConfig
from gateway.ops.cliargs import platform_pair
from gateway.runner.usage_commands import usage_report
from gateway.store import usage
from gateway.store.session_store import SessionStore

COLUMNS = ("turns", "input_tokens", "output_tokens", "estimated_turns", "cost_usd")


def day_arg(text: str) -> str:
    if not usage.DAY_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError("must be a date as YYYY-MM-DD")
    return text


def groups_arg(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in usage.GROUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"must be a list of {', '.join(usage.GROUPS)}")
    return names


def add_usage_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "usage", parents=parents, help="tokens and cost by user, agent, model or day"
    )
    parser.add_argument(
        "--user", type=platform_pair("USER_ID"), metavar="PLATFORM:USER_ID", help="only theirs"
    )
    parser.add_argument("--agent", default=None, help="only this agent's")
    parser.add_argument(
        "--since", type=day_arg, default=None, help="from this date (default: this month's 1st)"
    )
    parser.add_argument("--until", type=day_arg, default=None, help="before this date")
    parser.add_argument(
        "--by",
        type=groups_arg,
        default=("user", "agent", "model"),
        help="group by (default user,agent,model)",
    )
    parser.add_argument("--json", action="store_true")


async def run_usage_command(
    store: SessionStore, config: GatewayConfig, args: argparse.Namespace
) -> int:
    by = args.by
    report = await usage_report(
        store,
        config,
        since=args.since,
        until=args.until,
        user_key=f"{args.user[0]}:{args.user[1]}" if args.user else None,
        agent_id=args.agent,
        by=by,
    )
    rows = report["rows"]
    if args.json:
        print(json.dumps(report))
        return 0
    period = f"from {report['since']}" + (f" until {report['until']}" if report["until"] else "")
    if not rows:
        print(f"No usage {period}.")
        return 0
    print(f"Usage {period} (USD at the configured prices):")
    header = [*by, *COLUMNS]
    table = [header] + [[str(row[name]) for name in header] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    return 0
