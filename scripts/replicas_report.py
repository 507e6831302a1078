"""What scripts/bench_replicas.py prints of its runs: a row per run, the notes under it
(failures, CPU waits, where PostgreSQL's backends spent the window, log warnings), and
the ratios against the targets."""

from __future__ import annotations

import math
import os
import platform
from collections import Counter
from datetime import UTC, datetime
from typing import Any

TARGET_ONE = 0.6  # one PostgreSQL replica's turns/s against one SQLite node's
TARGET_TWO = 1.6  # two replicas' turns/s against one replica's
HEADER = (
    f"{'backend':<8} {'replicas':>8} {'turns/s':>8} {'p50_ms':>7} {'p99_ms':>7} {'max_ms':>7}"
    f" {'errors':>6} {'missing':>7} {'dup':>4} {'gw_cpu%':>7} {'pg_cpu%':>7} {'client%':>7}"
)


def machine_line() -> str:
    return (
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, client, daemons and"
        f" PostgreSQL on this machine, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC,"
        f" load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


def format_row(r: dict[str, Any]) -> str:
    cpu = r["cpu_percent"]
    pg = "-" if math.isnan(cpu["pg"]) else f"{cpu['pg']:.0f}"
    return (
        f"{r['backend']:<8} {r['replicas']:>8} {r['turns_per_s']:>8.0f} {r['p50_ms']:>7.1f}"
        f" {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} {r['errors']:>6} {r['missing']:>7}"
        f" {r['duplicated']:>4} {cpu['daemons']:>7.0f} {pg:>7} {cpu['client']:>7.0f}"
    )


def waits_line(r: dict[str, Any]) -> str | None:
    """Where the replicas' PostgreSQL backends spent the window (sampled), or None."""
    waits = dict(r.get("pg_waits") or {})
    samples = waits.pop("(samples)", 0)
    if not samples:
        return None
    busy = sum(waits.values())
    shares = ", ".join(f"{what} {100 * n / busy:.0f}%" for what, n in Counter(waits).most_common(5))
    return (
        f"PostgreSQL: {r['pg_backends']} backends of the replicas, on average"
        f" {busy / samples:.2f} busy ({samples} samples){': ' + shares if busy else ''}"
    )


def ratio_lines(results: list[dict[str, Any]]) -> list[str]:
    """The ratios of the targets among `results` (rows of one invocation), where both of
    a ratio's rows ran: 1 replica / the SQLite node, 2 replicas / 1 replica."""
    rate = {(r["backend"], r["replicas"]): r["turns_per_s"] for r in results}
    lines = []
    for top, bottom, target in (
        (("postgres", 1), ("sqlite", 1), TARGET_ONE),
        (("postgres", 2), ("postgres", 1), TARGET_TWO),
    ):
        if top in rate and bottom in rate and rate[bottom] > 0:
            ratio = rate[top] / rate[bottom]
            verdict = "met" if ratio >= target else "NOT met"
            # Cut, not rounded, to two places: 1.598 is shown as 1.59, not as a 1.60
            # that reads as meeting a target of 1.6 beside "NOT met".
            shown = math.floor(ratio * 100 + 1e-9) / 100  # 0.29 * 100 is 28.999...
            lines.append(
                f"ratio {_row_name(top)} / {_row_name(bottom)}: {shown:.2f}"
                f" (target >= {target:g}: {verdict})"
            )
    return lines


def _row_name(row: tuple[str, int]) -> str:
    backend, replicas = row
    if backend == "sqlite":
        return "SQLite node"
    return f"{replicas} replica{'s' if replicas > 1 else ''}"


def failures(r: dict[str, Any]) -> list[str]:
    """What went wrong in a run, one line each (none when it was clean)."""
    lines = []
    if r["errors"]:
        lines.append(f"errors: {r['error_kinds']}")
    if r["missing"] or r["duplicated"] or r["unexpected"]:
        lines.append(
            f"replies missing {r['missing']}, duplicated {r['duplicated']},"
            f" unexpected {r['unexpected']}"
        )
    if any(code != 0 for code in r.get("exit_codes", [])):
        lines.append(f"daemon exit codes after SIGTERM: {r['exit_codes']}")
    return lines


def notes(r: dict[str, Any]) -> list[str]:
    """The failures, then the daemons' log warnings (shown, not failing the run: a
    replica that stops logs the leader role it gives up as a warning)."""
    lines = failures(r)
    cpu = r["cpu_percent"]
    pg_runq = (
        "" if math.isnan(cpu["pg_runq"]) else f", its PostgreSQL processes {cpu['pg_runq']:.0f}%"
    )
    lines.append(
        f"waiting for a CPU (runnable, not running; % of one core): the daemons' threads"
        f" {cpu['daemons_runq']:.0f}%{pg_runq}"
    )
    if (waits := waits_line(r)) is not None:
        lines.append(waits)
    if r["log_problems"]:
        lines.append(f"daemon log warnings/errors: {r['log_problems']}")
        lines += [f"  {sample}" for sample in r["log_samples"][:5]]
    return lines
