"""Deliberate crash points, for the crash-loop driver only.

Inactive unless the environment variable `HERMES_CRASH_AT` is set, e.g.
`HERMES_CRASH_AT=before_ledger_mark:3`: the third time that point is reached, the
process kills itself with SIGKILL, exactly as `kill -9` would, in the middle of the
persistence step. Points: after_turn_begin, after_transcript_write,
before_ledger_mark, mid_sessions_json_write, after_schedule_claim (a scheduled run claimed
and its turn begun), tool_call_in_flight (a tool call recorded as started, not yet run),
after_tool_result (a tool call's result recorded).
"""

from __future__ import annotations

import os
import signal
import threading

POINTS = frozenset(
    {
        "after_turn_begin",
        "after_transcript_write",
        "before_ledger_mark",
        "mid_sessions_json_write",
        "after_schedule_claim",
        "tool_call_in_flight",
        "after_tool_result",
    }
)


def _plan() -> tuple[str, int] | None:
    raw = os.environ.get("HERMES_CRASH_AT")
    if not raw:
        return None
    name, _, count = raw.partition(":")
    if name not in POINTS:
        raise ValueError(f"HERMES_CRASH_AT: unknown crash point {name!r}")
    return name, int(count or 1)


_PLAN = _plan()
_hits = 0
_lock = threading.Lock()


def crash_point(name: str) -> None:
    """Kill the process here if the plan says so (a no-op in normal operation)."""
    global _hits
    if _PLAN is None or _PLAN[0] != name:
        return
    with _lock:
        _hits += 1
        if _hits == _PLAN[1]:
            os.kill(os.getpid(), signal.SIGKILL)
