"""The benchmark scripts run end to end (their figures are not checked: speed is not a test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pg_support import pg_available

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, timeout: float = 100) -> str:
    """`scripts/<script> args` in a fresh interpreter: its standard output, once it
    exited 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.timeout(150)
def test_bench_gateway_quick_runs_and_prints_its_table() -> None:
    # --quick's 1,000 sessions, with fewer messages: the table and the split, not a figure.
    out = run_script(
        "bench_gateway.py",
        *("--quick", "--split", "--messages", "500", "--baseline-seconds", "0.5"),
        timeout=120,
    )
    lines = out.splitlines()
    header = next((line for line in lines if line.split()[:1] == ["sessions"]), None)
    assert header is not None, out
    assert "turns/s" in header and "naive/s" in header, header
    row = next((line for line in lines if line.split()[:1] == ["1000"]), None)
    assert row is not None, out
    turns_per_s = row.split()[header.split().index("turns/s")]
    assert re.fullmatch(r"\d+", turns_per_s) and int(turns_per_s) > 0, row
    assert "targets:" in out
    # The floor ran beside the gateway, on the same sessions: its CPU per turn and the
    # ratio, which the targets lead with.
    floor_us = row.split()[header.split().index("floor")]
    ratio = row.split()[header.split().index("cpu/fl")]
    assert re.fullmatch(r"\d+", floor_us) and int(floor_us) > 0, row
    assert re.fullmatch(r"\d+\.\dx", ratio), row
    assert re.search(r"cpu_us <= 3x floor_us at every size: 1,000: [\d.]+x", out), out
    # --split timed the store's own writer: a turn is at least its inbox row, two
    # transcript messages, the marker set and cleared, the entry and the ledger row.
    split = re.search(
        r"split: of (\d+) us CPU per turn, (\d+) us in the store's transactions .*"
        r" of which (\d+) us in ([\d.]+) SQLite statements",
        out,
    )
    assert split is not None, out
    _, store_us, sql_us, statements = (float(g) for g in split.groups())
    assert 0 < sql_us <= store_us, split.group(0)
    assert float(statements) >= 8, split.group(0)
    assert "INSERT INTO messages" in out, out


@pytest.mark.timeout(120)
def test_bench_context_runs_and_prints_each_case() -> None:
    out = run_script("bench_context.py", "--messages", "500", "--runs", "5")
    sent = {}
    for case in ("window", "summary, none", "summary, checkpoint"):
        line = next((line for line in out.splitlines() if line.startswith(case + " ")), None)
        assert line is not None, out
        sent[case] = int(line.split()[-1])
    # What each strategy sends of the 500 messages: the window's 40, the summary's
    # history_limit (100) before a checkpoint, and after one the summary + 60 newer.
    assert sent == {"window": 40, "summary, none": 100, "summary, checkpoint": 61}
    assert re.search(r"a turn's context loads in [\d.]+ ms", out), out


@pytest.mark.timeout(120)
def test_bench_recall_indexes_the_users_chunks_and_times_searches() -> None:
    """The recall benchmark measures searches over chunks it really indexed (it once
    timed an empty index when transcript indexing became opt-in)."""
    out = run_script(
        "bench_recall.py",
        *("--chunks", "400", "--per-session", "50", "--others", "2", "--queries", "20"),
    )
    found = re.search(r"recall over (\d+) chunks of one user .*p99 ([\d.]+) ms", out)
    assert found is not None, out
    assert int(found.group(1)) == 400, out


@pytest.mark.timeout(120)
def test_bench_gateway_schedules_reports_idle_cpu_and_fire_delay() -> None:
    """`--schedules N`: the scheduler's idle CPU at N schedules and the delay from fire
    times to turns begun, measured on runs that really fired (all of them)."""
    out = run_script("bench_gateway.py", "--schedules", "300", "--quick")
    idle = re.search(r"scheduler at 300 schedules .*idle CPU ([\d.]+)% of one core", out)
    assert idle is not None, out
    spread = re.search(r"turn begun, (\d+) runs one every 50 ms: p50 ([\d.]+) ms", out)
    burst = re.search(r"turn begun, (\d+) runs at once: p50 ([\d.]+) ms", out)
    assert spread is not None and burst is not None, out
    assert int(spread.group(1)) == 20 and int(burst.group(1)) == 10, out
    assert float(spread.group(2)) < 1000, out  # fired on time, not a poll later
    assert "daemon log warnings/errors" not in out, out


@pytest.mark.timeout(150)
def test_bench_gateway_stream_reports_edits_and_first_visible_text() -> None:
    """`--stream`: streamed replies through the real daemon, Telegram and a streaming
    model: each reply one message, edits per reply and first token -> first text."""
    out = run_script("bench_gateway.py", "--stream", "--quick")
    assert "messages per reply 1.00" in out, out
    edits = re.search(r"edits per reply ([\d.]+)", out)
    first = re.search(r"first token -> first visible text: p50 ([\d.]+) ms, p99 ([\d.]+) ms", out)
    assert edits is not None and float(edits.group(1)) >= 1, out
    assert first is not None, out


@pytest.mark.timeout(180)
def test_bench_gateway_replicas_prints_sqlite_then_each_postgres_count() -> None:
    """`--backend postgres --replicas N,...` (scripts/bench_replicas.py) in its
    quickest form: a row for SQLite on one node, then two daemons on one PostgreSQL
    schema in a closed loop over both HTTP APIs; every message answered once (read back
    through the other replica) at a positive rate."""
    reason = pg_available()
    if reason is not None:
        pytest.skip(reason)
    out = run_script(
        "bench_gateway.py",
        *("--backend", "postgres", "--replicas", "2", "--quick", "--concurrency", "4"),
        timeout=150,
    )
    rows = [
        line.split() for line in out.splitlines() if line.split()[:1] in (["sqlite"], ["postgres"])
    ]
    assert [row[:2] for row in rows] == [["sqlite", "1"], ["postgres", "2"]], out
    header = next(line.split() for line in out.splitlines() if line.startswith("backend "))
    for row in rows:
        assert float(row[header.index("turns/s")]) > 0, out
        assert row[header.index("missing")] == row[header.index("dup")] == "0", out
        assert row[header.index("errors")] == "0", out


def test_bench_replicas_takes_counts_and_runs_the_sqlite_node_first() -> None:
    """`--replicas 1,2,3` as the docs write it: each count in one invocation, after the
    SQLite node the ratios are taken against; the ratios name their targets."""
    from scripts import bench_replicas, replicas_report

    args = bench_replicas.parse_args(["--backend", "postgres", "--replicas", "1,2,3"])
    assert bench_replicas.plan(args) == [
        ("sqlite", 1),
        ("postgres", 1),
        ("postgres", 2),
        ("postgres", 3),
    ]
    args = bench_replicas.parse_args(["--replicas", "3", "--no-baseline"])
    assert bench_replicas.plan(args) == [("postgres", 3)]
    assert bench_replicas.plan(bench_replicas.parse_args(["--backend", "sqlite"])) == [
        ("sqlite", 1)
    ]
    for wrong in (
        ["--replicas", "1,x"],
        ["--replicas", "0"],
        ["--backend", "sqlite", "--replicas", "2"],
    ):
        with pytest.raises(SystemExit):
            bench_replicas.parse_args(wrong)
    rows = [
        {"backend": "sqlite", "replicas": 1, "turns_per_s": 1000.0},
        {"backend": "postgres", "replicas": 1, "turns_per_s": 500.0},
        {"backend": "postgres", "replicas": 2, "turns_per_s": 900.0},
    ]
    assert replicas_report.ratio_lines(rows) == [
        "ratio 1 replica / SQLite node: 0.50 (target >= 0.6: NOT met)",
        "ratio 2 replicas / 1 replica: 1.80 (target >= 1.6: met)",
    ]
    rows[2]["turns_per_s"] = 799.0  # 1.598: short of 1.6, and not shown as 1.60
    assert replicas_report.ratio_lines(rows)[1] == (
        "ratio 2 replicas / 1 replica: 1.59 (target >= 1.6: NOT met)"
    )


def test_bench_mcp_call_times_the_three_ways_of_one_call() -> None:
    out = run_script("bench_mcp_call.py", "--calls", "20", timeout=120)
    for way in ("sdk", "hub", "turn"):
        assert re.search(rf"^\s*{way}: median\s+[\d.]+ ms", out, re.M), out
    assert re.search(r"what a turn with one MCP call adds\): -?[\d.]+ ms", out), out


def test_bench_tool_journal_times_a_round_each_way() -> None:
    out = run_script("bench_tool_journal.py", "--rounds", "50", timeout=120)
    assert "journaled: median" in out and "plain: median" in out, out
    assert re.search(r"journal per round of one call: -?\d+ us", out), out


def test_bench_store_api_sets_each_call_beside_plain_sqlite() -> None:
    out = run_script(
        "bench_store_api.py", *("--sizes", "300", "--visits", "40", "--runs", "2"), timeout=120
    )
    for call in ("get_or_create_session", "append_to_transcript", "load_transcript"):
        row = next((line for line in out.splitlines() if f" {call} " in line), None)
        assert row is not None, out
        assert re.search(r"[\d.]+ / [\d.]+ / [\d.]+x$", row), row


def test_bench_console_times_each_sessions_page() -> None:
    out = run_script("bench_console.py", "--sessions", "500", "--runs", "2")
    for page in ("first page", "deep page", "q search", "q, last match"):
        assert re.search(rf"^{re.escape(page)} +[\d.]+ +[\d.]+$", out, re.M), out
    assert "slowest median" in out, out


@pytest.mark.timeout(150)
def test_probe_turn_io_runs_each_probe() -> None:
    """Pages a turn writes, what commits wait on, RSS by phase, CPU by thread."""
    pages = run_script("probe_turn_io.py", "pages", "--sessions", "300", "--turns", "20")
    assert re.search(r"20 turns 1 at a time: \d+ commits .* ([\d.]+) a turn; by B-tree", pages)
    per_tree = dict(
        (line.split()[1], float(line.split()[0]))
        for line in pages.splitlines()
        if line.startswith("  ")
    )
    # every turn stores its two transcript messages and its inbox row
    assert per_tree.get("messages", 0) >= 1 and per_tree.get("inbox", 0) >= 1, pages
    commits = run_script(
        "probe_turn_io.py", "commits", "--sessions", "300", "--messages", "300", "--rate", "300"
    )
    assert re.search(r"300 sessions, \d+ turns at 300/s offered: p50 [\d.]+ ms", commits), commits
    assert re.search(r"group commits: \d+, of them \d+ of 2 ms or more", commits), commits
    assert "the event loop's thread inside commits" in commits
    memory = run_script(
        "probe_turn_io.py", "memory", "--sessions", "300", "--messages", "200", "--warmup", "50"
    )
    peaks = {k.strip(): v for k, v in (line.rsplit(None, 1) for line in memory.splitlines()[1:])}
    assert list(peaks) == ["imports", "start", "warm-up", "closed loop", "open loop", "stop"]
    assert float(peaks["open loop"]) >= float(peaks["imports"]) > 20, memory
    threads = run_script("probe_turn_io.py", "threads", "--sessions", "300", "--turns", "300")
    assert re.search(r"indexing on: \d+ us of CPU a turn .*\n +[\d.]+ +MainThread", threads)
    assert "transcript indexing off:" in threads
