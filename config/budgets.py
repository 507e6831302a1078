"""Budgets (`budgets:`): per-user limits on tokens, cost and pace, checked before a turn
calls its model (gateway.runner.budgets).

```yaml
budgets:
  default: {tokens_per_day: 200000, cost_per_month: 5.00, turns_per_minute: 6}
  users: {"telegram:4242": {cost_per_month: 50.00}, "slack:U1": {unlimited: true}}
  exempt_admins: true
```

A user's own entry replaces the default's value for each limit it names and keeps the
others; `unlimited: true` lifts every limit. Days and months are those of the gateway's
`timezone`.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field, field_validator

from config.base import MODEL_CONFIG

#: who a budget entry is for: "platform:user_id", as in `admins`
USER_KEY_PATTERN = re.compile(r"[a-z0-9_]+:.{1,256}")

#: every limit by its key, in the order refusals and `/usage` list them
LIMIT_NAMES = (
    "turns_per_minute",
    "tokens_per_day",
    "cost_per_day",
    "tokens_per_month",
    "cost_per_month",
)


class BudgetLimits(BaseModel):
    """Limits of one user; None: not limited by that measure."""

    model_config = MODEL_CONFIG

    tokens_per_day: int | None = Field(default=None, ge=0)
    tokens_per_month: int | None = Field(default=None, ge=0)
    # USD, at the models' `price` (a model without a price costs 0)
    cost_per_day: float | None = Field(default=None, ge=0)
    cost_per_month: float | None = Field(default=None, ge=0)
    turns_per_minute: int | None = Field(default=None, ge=1, le=10_000)

    def is_set(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_NAMES)


class UserBudget(BudgetLimits):
    """One user's entry: limits that replace the default's, or no limit at all."""

    unlimited: bool = False


class BudgetsConfig(BaseModel):
    model_config = MODEL_CONFIG

    default: BudgetLimits = BudgetLimits()
    users: dict[str, UserBudget] = Field(default_factory=dict)
    # Admins (`admins:`) are never refused by a budget; their usage is still recorded.
    exempt_admins: bool = True

    @field_validator("users")
    @classmethod
    def _check_users(cls, value: dict[str, UserBudget]) -> dict[str, UserBudget]:
        for key in value:
            if not USER_KEY_PATTERN.fullmatch(key):
                raise ValueError(f"{key!r} is not a user as platform:user_id (telegram:4242)")
        return value

    @property
    def enabled(self) -> bool:
        """Whether any limit applies to anyone (off: turns check nothing)."""
        return self.default.is_set() or any(
            entry.is_set() and not entry.unlimited for entry in self.users.values()
        )

    def limits_for(self, user_key: str) -> BudgetLimits | None:
        """The user's limits (their entry over the default's), None when unlimited."""
        entry = self.users.get(user_key)
        if entry is None:
            return self.default if self.default.is_set() else None
        if entry.unlimited:
            return None
        merged = {
            name: getattr(entry, name)
            if getattr(entry, name) is not None
            else getattr(self.default, name)
            for name in LIMIT_NAMES
        }
        limits = BudgetLimits(**merged)
        return limits if limits.is_set() else None
