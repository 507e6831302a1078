"""The session state machine on a loaded routing entry: which session a message belongs
to (a new key, a forced reset, a suspended session, one its reset policy expired, or
the one that continues), and the latest `updated_at` any configured policy could find
expired (the expiry watcher's bound), and the host's "is work running" check that holds
a reset back. SessionStore runs these in its transactions.

Priority: suspended > resume_pending > reset policy (idle / daily) > plain touch.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime, timedelta, tzinfo
from enum import Enum

import structlog

from config import GatewayConfig, SessionResetPolicy
from gateway.domain.policy import last_daily_boundary, reset_reason
from gateway.domain.session import SessionEntry, SessionSource
from gateway.store import entries

# The check is the store's: its lines keep the store's logger name.
log = structlog.get_logger("gateway.store.session_store")


def route_entry(
    conn: sqlite3.Connection,
    entry: SessionEntry | None,
    *,
    key: str,
    source: SessionSource,
    force_new: bool,
    now: datetime,
    policy: SessionResetPolicy,
    active: bool,
    tz: tzinfo,
) -> tuple[SessionEntry, bool]:
    """The entry the message belongs to (`entry` None: the key has none), and whether a
    new session was written for it (new key, forced, suspended or expired); a session
    that continues is not written here. `active`: the key has a running process, which
    keeps its session from expiring."""
    if entry is None:
        new = entries.fresh_entry(key, source, now)
        entries.start_session_row(conn, new)
        entries.save_entry(conn, new)
        return new, True
    if force_new:
        return entries.replace_session(conn, entry, source, now), True
    reason = None
    if entry.suspended:
        reason = "suspended"
    elif not entry.resume_pending and not active:
        reason = reset_reason(entry.updated_at, policy, now, tz)
    if reason is None:
        return entry, False
    replaced = entries.replace_session(
        conn,
        entry,
        source,
        now,
        was_auto_reset=True,
        auto_reset_reason=reason,
        reset_had_activity=entry.total_tokens > 0,
    )
    return replaced, True


def expiry_cutoff(config: GatewayConfig, now: datetime, tz: tzinfo) -> datetime | None:
    """The latest `updated_at` any configured policy could consider expired (None: no
    policy ever expires a session)."""
    policies = [config.session_reset, *(p for p in vars(config.reset_by_type).values() if p)]
    policies += [p.session_reset for _, p in config.platforms if p.session_reset]
    cutoffs: list[datetime] = []
    for policy in policies:
        if policy.mode in ("idle", "both"):
            cutoffs.append(now - timedelta(minutes=policy.idle_minutes))
        if policy.mode in ("daily", "both"):
            cutoffs.append(last_daily_boundary(now, policy.at_hour, tz))
    return max(cutoffs) if cutoffs else None


class ResetPolicies:
    """The reset policy of each platform and chat type, looked up in the config once
    (it is frozen): a lookup walks pydantic models, and every message routes."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._known: dict[tuple[str | Enum, str], SessionResetPolicy] = {}

    def __call__(self, platform: str | Enum, chat_type: str) -> SessionResetPolicy:
        policy = self._known.get((platform, chat_type))
        if policy is None:
            policy = self._config.get_reset_policy(platform, chat_type)
            self._known[(platform, chat_type)] = policy
        return policy


class ActiveCheck:
    """Asks the host whether a session has work running (`has_active_processes_fn`).

    A check that raises counts as active and never fails the message: a wrong reset
    cannot be taken back, a late one costs nothing. Logged when it starts failing (or
    fails differently) and when it works again, not per message."""

    def __init__(self) -> None:
        self._failure: str | None = None  # the failing check's error type

    def __call__(self, fn: Callable[[str], bool] | None, session_key: str) -> bool:
        if fn is None:
            return False
        try:
            active = bool(fn(session_key))
        except Exception as exc:
            if type(exc).__name__ != self._failure:
                self._failure = type(exc).__name__
                log.error(
                    "has_active_processes_failed",
                    error_type=type(exc).__name__,
                    error=str(exc),
                    effect="sessions count as active: no automatic reset until it works",
                )
            return True
        if self._failure is not None:
            self._failure = None
            log.info("has_active_processes_recovered")
        return active
