"""`/usage`: what the asking user used today and this month, against their budget;
`/usage all` (admins): every user's month, largest cost first.

Read from the usage rows each turn's finish writes (gateway.store.usage), so the numbers
are those of every replica and survive restarts. Days are the gateway's `timezone`.
"""

from __future__ import annotations

import time
from typing import Any

from config import BudgetLimits, GatewayConfig
from gateway.domain.command_syntax import Command
from gateway.domain.events import MessageEvent
from gateway.runner.budgets import amount, spending
from gateway.runner.ports import CommandContext
from gateway.store import usage
from gateway.store.session_store import SessionStore
from gateway.store.usage import Totals

ALL_LISTED = 20  # users `/usage all` lists


async def usage_report(
    store: SessionStore,
    config: GatewayConfig,
    *,
    since: str | None = None,
    until: str | None = None,
    user_key: str | None = None,
    agent_id: str | None = None,
    by: tuple[str, ...] = ("user", "agent", "model"),
) -> dict[str, Any]:
    """The operator's report (`GET /v1/usage`, `hermes-gateway usage`): sums grouped
    `by`, from `since` (default: the first of this month) up to `until` (exclusive)."""
    if since is None:
        since = usage.month_range(usage.local_day(time.time(), config.tzinfo()))[0]
    rows = await store.read(
        lambda conn: usage.report(
            conn, since=since, until=until, user_key=user_key, agent_id=agent_id, by=by
        )
    )
    return {"since": since, "until": until, "rows": rows}


async def cmd_usage(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> str:
    source = event.source
    day = usage.local_day(time.time(), ctx.config.tzinfo())
    if cmd.args.strip().lower() == "all":
        if not ctx.is_admin(source):
            return "Only an admin can see everyone's usage (see `admins` in hermes.yaml)."
        return await _everyone(ctx, day)
    if not source.user_id:
        return "Usage is counted per user; this message has no user to count it for."
    owner = f"{source.platform.value}:{source.user_id}"
    today, month = await ctx.store.read(lambda conn: usage.user_totals(conn, owner, day))
    lines = [
        f"Your usage ({owner}):",
        f"Today ({day}): {_totals(today)}",
        f"This month ({day[:7]}): {_totals(month)}",
    ]
    budgets = ctx.config.budgets
    if budgets.exempt_admins and ctx.is_admin(source):
        limits = None
        lines.append("Budget: none (admins are exempt).")
    else:
        limits = budgets.limits_for(owner)
        lines.append(_limits(limits, today, month) if limits else "Budget: no limits.")
    return "\n".join(lines)


async def _everyone(ctx: CommandContext, day: str) -> str:
    since, until = usage.month_range(day)
    rows = await ctx.store.read(
        lambda conn: usage.report(conn, since=since, until=until, by=("user",))
    )
    if not rows:
        return f"No usage this month ({day[:7]})."
    lines = [f"Usage this month ({day[:7]}), largest cost first:"]
    for row in rows[:ALL_LISTED]:
        totals = Totals(row["turns"], row["input_tokens"], row["output_tokens"], row["cost_usd"])
        lines.append(f"{row['user']}: {_totals(totals)}")
    if len(rows) > ALL_LISTED:
        lines.append(f"... and {len(rows) - ALL_LISTED} more (hermes-gateway usage).")
    return "\n".join(lines)


def _totals(totals: Totals) -> str:
    return (
        f"{totals.turns:,} turns, {totals.tokens:,} tokens (in {totals.input_tokens:,},"
        f" out {totals.output_tokens:,}), ${totals.cost_usd:,.4f}"
    )


def _limits(limits: BudgetLimits, today: Totals, month: Totals) -> str:
    parts = [f"{limits.turns_per_minute} messages per minute"] if limits.turns_per_minute else []
    for name, used, limit in spending(limits, today, month):
        share = f"{100 * used / limit:.0f}% used" if limit else "reached"
        parts.append(f"{amount(name, limit)} a {name.rsplit('_', 1)[1]} ({share})")
    return "Budget: " + "; ".join(parts) + "."
