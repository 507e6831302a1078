"""Running `hermes-gateway` as the operator does: a real subprocess on a given home."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


def cli(home: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`python -m gateway.cli ARGS` with HERMES_HOME=home and no HERMES_CONFIG."""
    env = {**os.environ, "HERMES_HOME": str(home)}
    env.pop("HERMES_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def spawn(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`python -m gateway.cli ARGS` started in the background (stderr merged into stdout);
    the caller ends it with `finish`."""
    full = {**os.environ, "HERMES_HOME": str(home), **(env or {})}
    full.pop("HERMES_CONFIG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_ready(proc: subprocess.Popen[str], within: float = 30) -> list[str]:
    """The daemon's log lines up to `gateway_ready`; fails if it exits or takes longer
    than `within` seconds (it is killed then, its output in the failure)."""
    assert proc.stdout is not None
    lines: list[str] = []
    timer = threading.Timer(within, proc.kill)  # a daemon that hangs ends the read below
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if "gateway_ready" in line:
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"no gateway_ready (exit {proc.wait()}):\n{''.join(lines)}")


def finish(
    proc: subprocess.Popen[str], within: float = 30, *, interrupt: bool = True
) -> tuple[int, str]:
    """SIGINT (unless `interrupt` is false: a process expected to exit by itself), then
    its exit code and the rest of its output; killed if it does not exit within `within`
    seconds (the code is then -9)."""
    if interrupt and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out
