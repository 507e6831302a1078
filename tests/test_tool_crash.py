"""kill -9 of the real daemon right after a side-effecting tool call's result was
recorded (scripts/tool_crashloop.py repeats it and counts): after the restart the turn
gives exactly one reply, the note is saved once, and the model is sent the recorded
round instead of the call being run again. On SQLite and on PostgreSQL.

Repeat it with ``HERMES_TOOL_CRASH_RUNS=20 pytest tests/test_tool_crash.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.tool_crashloop import REPLY, one_run
from tests.pg_support import fresh_schema

pytestmark = pytest.mark.timeout(180)

RUNS = range(int(os.environ.get("HERMES_TOOL_CRASH_RUNS", "1")))


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize(
    ("backend", "tool"),
    [
        ("sqlite", "memory_save"),
        ("postgres", "memory_save"),
        ("sqlite", "mcp"),
        ("postgres", "mcp"),
    ],
)
def test_kill9_after_a_tool_result_gives_one_reply_and_one_side_effect(
    tmp_path: Path, backend: str, tool: str, run: int
) -> None:
    """`tool`: the side effect is a built-in's (a note) or an MCP server's (a ticket the
    test server counts in a file)."""
    if backend == "postgres":
        with fresh_schema() as dsn:
            seen = one_run(tmp_path / "home", dsn, tool=tool)
    else:
        seen = one_run(tmp_path / "home", tool=tool)
    assert seen.killed  # it died at the crash point, after the result was recorded
    assert seen.replies == [REPLY]
    assert seen.notes == 1  # the side effect, once
    assert seen.replayed()  # the round went to the model from the journal
    assert seen.journal_rows == 0  # gone with the turn's finish
    assert seen.verdict() == "ok"
