"""Short runs of scripts/load_http.py and scripts/soak.py against the real daemon.

They check that the scripts work end to end and report what they should; no speed is
asserted (the machine is shared).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_script(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(90)
def test_load_http_fixed_rate_answers_everything() -> None:
    result = run_script("load_http.py", "--rate", "50", "--seconds", "3")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "replies missing: 0 " in out, out
    assert re.search(rf"reply latency ms .* p99=({NUMBER}) ", out), out
    assert "accepted 150 " in out, out  # every scheduled message was taken
    assert re.search(r"daemon /metrics \(this run\): turns=[1-9]", out), out
    assert "daemon exit code: 0" in out, out


@pytest.mark.timeout(90)
def test_soak_short_run_prints_rss_slope_and_lag() -> None:
    result = run_script("soak.py", "--minutes", "0.1", "--rate", "20", "--sample-seconds", "1")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(rf"RSS slope: [+-]{NUMBER} MiB/hour", out), out
    assert re.search(rf"event-loop lag PROXY .* p95=({NUMBER}) ", out), out
    assert "replies missing: 0 " in out, out
    samples = [line for line in out.splitlines() if re.match(rf"\s+\d+\s+{NUMBER}\s", line)]
    assert len(samples) >= 5, out  # one line per 1 s sample over 6 s
