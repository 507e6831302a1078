"""scripts/bench_floor.py runs, and its turns really write what a durable turn writes
(its speed is not checked: speed is not a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench_floor import TOKENS_IN, TOKENS_OUT, measure_floor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_bench_floor_quick_json_counts_every_turn_in_the_database() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_floor.py"), "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    rows = json.loads(proc.stdout)["rows"]
    assert [row["sessions"] for row in rows] == [200, 1000]
    for row in rows:
        turns, counted = row["turns"], row["rows"]
        assert turns == 500 and row["duplicates"] == 0, row
        assert row["turns_per_s"] > 0 and row["floor_us"] > 0 and row["wall_us"] > 0, row
        # Every session that got a turn was seeded with a full history window first.
        assert row["seeded_messages"] == counted["touched_entries"] * row["history"] > 0, row
        # Each turn: one inbox row (done), two transcript rows that the production
        # schema's trigger logged for the search index, its counters, and a ledger row
        # that a later commit marked sent.
        assert counted["inbox"] == counted["inbox_done"] == turns, counted
        assert counted["messages"] == 2 * turns + row["seeded_messages"], counted
        assert counted["fts_log"] == counted["messages"], counted
        assert counted["total_tokens"] == turns * (TOKENS_IN + TOKENS_OUT), counted
        assert counted["outbound"] == counted["outbound_sent"] == turns, counted
        assert row["redelivery_refused"] is True, row


def test_measure_floor_leaves_nothing_in_its_workdir(tmp_path: Path) -> None:
    # 20 turns at 8 per commit: 3 commits of turns, then one that marks the last replies.
    result = measure_floor(50, 20, 8, tmp_path, history=4)
    assert result["commits"] == 4, result
    assert result["rows"]["outbound_sent"] == 20, result
    assert list(tmp_path.iterdir()) == []


def test_measure_floor_as_the_gateway_bench_runs_it_reads_what_its_turns_wrote(
    tmp_path: Path,
) -> None:
    # As bench_gateway runs it: empty sessions, each turn reading up to 100 messages.
    result = measure_floor(5, 40, 8, tmp_path, history=0, read_limit=100)
    assert result["seeded_messages"] == 0 and result["read_limit"] == 100, result
    assert result["rows"]["messages"] == 80, result
