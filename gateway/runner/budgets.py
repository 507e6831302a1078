"""Usage and budgets: who a turn is charged to, what it cost, and whether it may start.

    begin  (the turn's begin transaction)  `gate`: the owner's pace and totals against
           their limits; over one, the turn is refused before its model is called
    finish (the turn's finish transaction) `charge`: its tokens and cost added to the
           owner's row of the day (gateway.store.usage)

Both run inside the store's transactions, so whichever replica runs a user's turns
reads what the others committed: together they let a user past a limit by at most the
turns already running when it was reached. `turns_per_minute` is exact: each start is
recorded under a lock of the user's row.

A turn is charged to its owner: the sender (`platform:user_id`); for a scheduled run,
whoever made the schedule; for a turn an agent delegated (`agent_call`), the owner of
the calling session, followed up the chain; an A2A or OpenAI-compatible caller is
`a2a:CALLER` or `openai:USER`.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from config import LIMIT_NAMES, BudgetLimits, GatewayConfig
from config.models import EffectiveModel
from gateway.context.tokens import text_tokens
from gateway.domain.events import MessageEvent
from gateway.domain.session import Platform, SessionSource, TokenUsage, schedule_id_of_key
from gateway.ops.metrics import Metrics
from gateway.store import codec, usage
from gateway.store.turnlog import Refusal
from gateway.store.usage import Charge, Totals

#: how far `owner_of` follows delegations up to the user who started them
MAX_CHAIN = 16
_NATIVE_CALLER = "session:"

_WHAT = {
    "turns_per_minute": "messages per minute",
    "tokens_per_day": "tokens today",
    "cost_per_day": "spending today",
    "tokens_per_month": "tokens this month",
    "cost_per_month": "spending this month",
}


def user_key(source: SessionSource) -> str | None:
    return f"{source.platform.value}:{source.user_id}" if source.user_id else None


def owner_of(conn: sqlite3.Connection, key: str, source: SessionSource) -> str | None:
    """Who the session key's turn is charged to (None: nobody, such as a channel post
    without a user)."""
    schedule_id = schedule_id_of_key(key)
    if schedule_id is not None:
        row = conn.execute(
            "SELECT platform, user_id FROM schedules WHERE schedule_id = ?", (schedule_id,)
        ).fetchone()
        return f"{row[0]}:{row[1]}" if row and row[1] else None
    for _ in range(MAX_CHAIN):
        caller = source.user_id or ""
        if source.platform is not Platform.A2A or not caller.startswith(_NATIVE_CALLER):
            return user_key(source)
        row = conn.execute(
            "SELECT origin FROM session_entry_docs WHERE session_key = ?",
            (caller[len(_NATIVE_CALLER) :],),
        ).fetchone()
        origin = codec.loads(row[0]) if row and row[0] else None
        if not isinstance(origin, dict):
            return None
        source = SessionSource.from_dict(origin)
    return None


def _owned_elsewhere(key: str, source: SessionSource) -> bool:
    """Whether the turn's owner is not its sender (`owner_of` reads them from the store)."""
    if source.platform is Platform.A2A and (source.user_id or "").startswith(_NATIVE_CALLER):
        return True
    return schedule_id_of_key(key) is not None


def cost_of(model: EffectiveModel, input_tokens: int, output_tokens: int) -> float:
    price = model.price
    return (input_tokens * price.input_per_mtok + output_tokens * price.output_per_mtok) / 1e6


class Budgets:
    """The gateway's usage accounting and budget checks (`budgets:` in hermes.yaml)."""

    def __init__(
        self,
        config: GatewayConfig,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = config.budgets
        self.enabled = self.settings.enabled
        self.zone = config.tzinfo()
        self.zone_name = config.timezone or "the server's time zone"
        self.admins = frozenset(config.admins) if self.settings.exempt_admins else frozenset()
        self.metrics = metrics
        self.clock = clock
        self._limits: dict[str, BudgetLimits | None] = {}
        # The local day last asked for, and its bounds (epoch): every turn asks.
        self._day, self._day_start, self._day_end = "", 0.0, 0.0

    def day(self, now: float) -> str:
        """The local date of `now` in the gateway's zone, as usage rows name days."""
        if not self._day_start <= now < self._day_end:
            local = datetime.fromtimestamp(now, self.zone)
            midnight = datetime(local.year, local.month, local.day, tzinfo=self.zone)
            # Wall-clock arithmetic: the next local midnight, whatever DST does between.
            self._day_start = midnight.timestamp()
            self._day_end = (midnight + timedelta(days=1)).timestamp()
            self._day = usage.local_day(now, self.zone)
        return self._day

    def limits_for(self, owner: str) -> BudgetLimits | None:
        if owner in self.admins:
            return None
        if owner not in self._limits:
            if len(self._limits) >= 10_000:
                self._limits.clear()
            self._limits[owner] = self.settings.limits_for(owner)
        return self._limits[owner]

    # --- begin: may the turn start? ---------------------------------------------------

    def gate(self, conn: sqlite3.Connection, key: str, event: MessageEvent) -> Refusal | None:
        """In the turn's begin transaction: None when the turn may call its model, else
        the refusal: its limit, and what the user is told (their usage, when it resets).
        Counted by the turn once it is answered, not here: a transaction may run again."""
        source = event.source
        owner = owner_of(conn, key, source) if _owned_elsewhere(key, source) else user_key(source)
        limits = self.limits_for(owner) if owner is not None else None
        if limits is None:
            return None
        now = self.clock()
        day = self.day(now)
        today, month = usage.user_totals(conn, owner, day)
        refused = _over(limits, today, month)
        if refused is None and limits.turns_per_minute is not None:
            free_at = usage.take_start(conn, owner, now, limits.turns_per_minute)
            if free_at is not None:
                wait = max(1, round(free_at - now))
                return Refusal(
                    "turns_per_minute",
                    f"You are sending messages faster than this bot allows "
                    f"({limits.turns_per_minute} per minute); this one was not answered. "
                    f"Send it again in {wait} s.",
                )
        if refused is None:
            return None
        name, used, limit = refused
        resets = self._reset_time(name, now)
        return Refusal(
            name,
            f"You have reached your budget for {_WHAT[name]} ({name}: {amount(name, limit)};"
            f" used {amount(name, used)}), so this message was not answered. It resets"
            f" {resets}. /usage shows what you have used.",
        )

    def _reset_time(self, name: str, now: float) -> str:
        local = datetime.fromtimestamp(now, self.zone)
        midnight = datetime(local.year, local.month, local.day, tzinfo=self.zone)
        if name.endswith("_day"):
            at = midnight + timedelta(days=1)
        elif local.month == 12:
            at = datetime(local.year + 1, 1, 1, tzinfo=self.zone)
        else:
            at = datetime(local.year, local.month + 1, 1, tzinfo=self.zone)
        return f"at {at.strftime('%Y-%m-%d %H:%M')} ({self.zone_name})"

    # --- finish: what the turn cost ---------------------------------------------------

    def priced(
        self, model: EffectiveModel, reported: TokenUsage | None, sent_tokens: int, reply: str
    ) -> TokenUsage:
        """The turn's usage with its cost: the backend's counts, or (when it reported
        none) an estimate from what the request carried and the reply, marked so."""
        if reported is None or (reported.input_tokens == 0 and reported.output_tokens == 0):
            counted = TokenUsage(
                input_tokens=sent_tokens, output_tokens=text_tokens(reply), estimated=True
            )
        else:
            counted = reported
        cost = cost_of(model, counted.input_tokens, counted.output_tokens)
        return TokenUsage(
            counted.input_tokens,
            counted.output_tokens,
            counted.cache_read_tokens,
            counted.cache_write_tokens,
            cost,
            counted.estimated,
        )

    def charge(
        self,
        key: str,
        source: SessionSource,
        agent_id: str,
        model: EffectiveModel,
        spent: TokenUsage,
    ) -> Callable[[sqlite3.Connection], Any]:
        """The write that charges `spent` to the turn's owner, for its finish transaction."""
        day = self.day(self.clock())
        name = model.name or model.model
        # A sender is known here; a scheduled run's or a delegated turn's owner is read
        # in the transaction.
        known = None if _owned_elsewhere(key, source) else user_key(source)

        def write(conn: sqlite3.Connection) -> None:
            owner = known if known is not None else owner_of(conn, key, source)
            if owner is None:
                return
            usage.charge(
                conn,
                Charge(
                    owner,
                    day,
                    agent_id,
                    name,
                    spent.input_tokens,
                    spent.output_tokens,
                    spent.estimated_cost_usd,
                    spent.estimated,
                ),
            )

        return write

    def seed_counters(self, models: Iterable[tuple[str, EffectiveModel]]) -> None:
        """Each (agent, model) a turn may run with, at 0: a scrape shows every series
        from the start, not only once a turn used it."""
        for agent_id, model in models:
            self.metrics.count_usage(agent_id, model.name or model.model, 0, 0, 0.0)

    def counted(self, agent_id: str, model: EffectiveModel, spent: TokenUsage) -> None:
        """Once the finish committed: the Prometheus counters."""
        self.metrics.count_usage(
            agent_id,
            model.name or model.model,
            spent.input_tokens,
            spent.output_tokens,
            spent.estimated_cost_usd,
        )


def spending(limits: BudgetLimits, today: Totals, month: Totals) -> list[tuple[str, float, float]]:
    """Each token or cost limit that is set, with what was used against it:
    (name, used, limit), in `LIMIT_NAMES` order (`turns_per_minute` is a pace, not a sum)."""
    found = []
    for name in LIMIT_NAMES:
        limit = getattr(limits, name)
        if limit is None or name == "turns_per_minute":
            continue
        totals = today if name.endswith("_day") else month
        found.append((name, totals.tokens if name.startswith("tokens") else totals.cost_usd, limit))
    return found


def _over(limits: BudgetLimits, today: Totals, month: Totals) -> tuple[str, float, float] | None:
    """The first limit the totals reached: (name, used, limit)."""
    return next((item for item in spending(limits, today, month) if item[1] >= item[2]), None)


def amount(name: str, value: float) -> str:
    """A limit's value as people read it: dollars for cost, tokens for tokens."""
    if name.startswith("cost"):
        return f"${value:,.2f}"
    return f"{int(value):,} tokens"
