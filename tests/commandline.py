"""Running `hermes-gateway` as the operator does: a real subprocess on a given home."""

from __future__ import annotations

import os
import subprocess
import sys
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
