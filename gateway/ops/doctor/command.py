"""The `doctor` command: its arguments, the repairs under the home's lock, the report."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from config import GatewayConfig, hermes_home
from gateway.ops.doctor.checks import run_checks
from gateway.ops.doctor.findings import ERROR, OK, Finding, Paths, gateway_running
from gateway.ops.doctor.repairs import run_repairs
from gateway.store.homelock import HomeInUse, HomeLock, HomeUnusable, held_by

# --- the command --------------------------------------------------------------------------


def _repair(paths: Paths) -> dict[str, str] | None:
    """Run the repairs holding the home's lock (a daemon cannot start meanwhile); None
    when a gateway runs (the reason is printed)."""
    try:
        lock = HomeLock.acquire(paths.home)
    except HomeInUse as exc:
        print(f"--repair refused: {exc}; stop it first", file=sys.stderr)
        return None
    except HomeUnusable as exc:
        print(f"--repair refused: {exc}", file=sys.stderr)
        return None
    with lock:
        # A gateway without the lock (an older version) still holds state.db open.
        if gateway_running(paths.db):
            print(
                "--repair refused: the gateway seems to be running (state.db is open in"
                " another process); stop it first",
                file=sys.stderr,
            )
            return None
        return run_repairs(paths)


def cmd_doctor(args: argparse.Namespace, config: GatewayConfig) -> int:
    paths = Paths.of(hermes_home())
    repaired: dict[str, str] = {}
    if args.repair and paths.home.is_dir():
        done = _repair(paths)
        if done is None:
            return 1
        repaired = done
    findings = run_checks(paths, config)
    if findings[0].status != ERROR:
        holder = held_by(paths.home)
        if holder is not None:
            state = f"running (pid {holder.pid or 'unknown'})"
        elif gateway_running(paths.db):
            state = "seems to be running (state.db is open in another process)"
        else:
            state = "not running"
        findings.insert(1, Finding("gateway", OK, state))
    for finding in findings:
        finding.repaired = repaired.get(finding.name)
    if args.json:
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for finding in findings:
            print(finding.line())
    return 1 if any(f.status == ERROR for f in findings) else 0


def add_doctor_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: list[argparse.ArgumentParser],
) -> None:
    """Add ``doctor``; ``parents`` carry the common options."""
    doctor = subparsers.add_parser(
        "doctor", parents=parents, help="check the state directory (and --repair it)"
    )
    doctor.add_argument(
        "--repair",
        action="store_true",
        help="fix what can be fixed (the gateway must be stopped); damaged files are set aside",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.set_defaults(handler=cmd_doctor)
