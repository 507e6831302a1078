"""kill -9 between a side-effecting tool call's result and the model's answer, over and
over: after each restart the turn must give exactly one reply, the side effect must
exist exactly once, and the model's first request after the restart must carry the
recorded round. The side effect is a built-in's (`memory_save`: a note in the store) or,
with `--tool mcp`, an MCP server's (`create_ticket` of tests/fakes/mcp_server.py, a stdio
child of the daemon: a line in a file the server appends to).

    .venv/bin/python scripts/tool_crashloop.py --runs 20 [--tool mcp] [--postgres DSN]

Each run: a fresh home, the real daemon (`hermes-gateway run`, HTTP API, openai backend)
against the fake OpenAI server (tests/fakes/openai_server.py) scripted to call
`memory_save` and then answer. The daemon kills itself with SIGKILL right after the
call's result is recorded (`HERMES_CRASH_AT=after_tool_result:1`,
gateway/util/faults.py), is started again, and the run is judged:

    ok    one reply, one side effect, the round replayed to the model
    dup   the side effect twice (the call ran again) or two replies
    lost  no reply, or no side effect
    odd   anything else (the round not replayed, the daemon not killed where planned)

Prints the counts; exits 1 unless every run is ok. tests/test_tool_crash.py runs one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import Daemon
from tests.fakes.openai_server import serve_in_a_thread, tool_calls

NOTE = "the cat is called Tom"
REPLY = "Saved: I will remember your cat's name."
CHAT = "c1"
FAKE_MCP_SERVER = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "mcp_server.py"
# The tool each kind of run calls, and what its recorded result says.
CALLED = {"memory_save": "memory_save", "mcp": "desk__create_ticket"}


@dataclass(frozen=True)
class Run:
    """What one run saw."""

    killed: bool  # the daemon died at the crash point (exit -9)
    replies: list[str]  # every reply recorded for the chat
    notes: int  # side effects: notes saved with NOTE, or tickets the MCP server opened
    journal_rows: int  # tool_calls rows left after the turn
    requests: list[dict[str, Any]]  # the model's requests (bodies), in order
    tool: str = "memory_save"  # the kind of run: "memory_save" or "mcp"

    def replayed(self) -> bool:
        """The request after the restart carries the recorded round: the assistant's
        memory_save call and its recorded result."""
        if len(self.requests) != 2:
            return False
        messages = self.requests[1].get("messages", [])
        calls = [m for m in messages if m.get("role") == "assistant" and m.get("tool_calls")]
        results = [m for m in messages if m.get("role") == "tool"]
        said = results[0]["content"] if len(results) == 1 else ""
        recorded = "note_id" in said if self.tool == "memory_save" else said.startswith("ticket")
        return (
            len(calls) == 1
            and calls[0]["tool_calls"][0]["function"]["name"] == CALLED[self.tool]
            and recorded
        )

    def verdict(self) -> str:
        if self.notes > 1 or len(self.replies) > 1:
            return "dup"
        if self.notes == 0 or not self.replies:
            return "lost"
        if not self.killed or not self.replayed() or self.replies != [REPLY]:
            return "odd"
        return "ok"


def settings(
    model_url: str, dsn: str | None, tool: str = "memory_save", home: Path | None = None
) -> str:
    # On PostgreSQL the restarted daemon takes over the killed one's sessions once its
    # lease has lapsed: a short failover (the cluster tests' 3 s), not the default 15 s.
    storage = (
        f"storage:\n  backend: postgres\n  dsn: {json.dumps(dsn)}\n"
        "cluster:\n  failover_seconds: 3\n"
        if dsn
        else ""
    )
    agent = f"agent:\n  backend: openai\n  base_url: {model_url}\n  model: fake\n"
    if tool == "memory_save":
        return agent + "  tools: [memory_save]\n" + storage
    assert home is not None
    server = {
        "command": sys.executable,
        "args": [str(FAKE_MCP_SERVER), "stdio"],
        "env": {"MCP_FAKE_COUNTER": str(tickets_file(home))},
    }
    return (
        agent
        + '  tools: ["mcp:desk"]\n'
        + storage
        + f"mcp:\n  servers:\n    desk: {json.dumps(server)}\n"
    )


def tickets_file(home: Path) -> Path:
    return home.parent / f"{home.name}-tickets.txt"


def one_run(
    home: Path, dsn: str | None = None, timeout: float = 30.0, tool: str = "memory_save"
) -> Run:
    """One kill -9 after the call's result is recorded, and the restart (bounded waits)."""
    with serve_in_a_thread(check_pairing=True) as (model, _):
        if tool == "memory_save":
            model.script(tool_calls(("memory_save", {"content": NOTE})), REPLY)
        else:
            model.script(tool_calls((CALLED[tool], {"title": NOTE})), REPLY)
        daemon = Daemon(home, settings(model.base_url, dsn, tool, home))
        try:
            daemon.start(env={"HERMES_CRASH_AT": "after_tool_result:1"})
            daemon.post(CHAT, "remember: my cat is called Tom", message_id="m1")
            try:
                killed = daemon.wait_exit(timeout) == -9
            except Exception:
                killed = False
            daemon.ensure_stopped()
            daemon.start()
            daemon.wait_replies(CHAT, 1, timeout)
            daemon.stop()
        finally:
            daemon.ensure_stopped()
        requests = [r["json"] for r in model.requests if r["path"].endswith("/completions")]
    replies, notes, rows = _read_state(daemon, dsn)
    if tool != "memory_save":  # the MCP server's own count of what it did
        counter = tickets_file(home)
        notes = counter.read_text().splitlines().count(NOTE) if counter.exists() else 0
    return Run(killed, replies, notes, rows, requests, tool)


def _read_state(daemon: Daemon, dsn: str | None) -> tuple[list[str], int, int]:
    queries = (
        "SELECT text FROM outbound WHERE chat_id = %s ORDER BY id",
        "SELECT COUNT(*) FROM notes WHERE content = %s",
        "SELECT COUNT(*) FROM tool_calls",
    )
    if dsn is not None:
        import psycopg  # only the PostgreSQL variant needs it

        with psycopg.connect(dsn) as conn:
            replies = [t for (t,) in conn.execute(queries[0], (CHAT,)).fetchall()]
            notes = conn.execute(queries[1], (NOTE,)).fetchone()[0]  # type: ignore[index]
            rows = conn.execute(queries[2]).fetchone()[0]  # type: ignore[index]
        return replies, notes, rows
    conn = daemon.db()
    try:
        replies = [t for (t,) in conn.execute(queries[0].replace("%s", "?"), (CHAT,))]
        notes = conn.execute(queries[1].replace("%s", "?"), (NOTE,)).fetchone()[0]
        rows = conn.execute(queries[2]).fetchone()[0]
    finally:
        conn.close()
    return replies, notes, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--postgres", metavar="DSN", help="run on this PostgreSQL schema")
    parser.add_argument(
        "--tool",
        choices=sorted(CALLED),
        default="memory_save",
        help="whose side effect: a built-in's (memory_save) or an MCP server's (mcp)",
    )
    args = parser.parse_args()
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="hermes-toolcrash-") as tmp:
        for number in range(args.runs):
            if args.postgres:
                _empty_schema(args.postgres)
            run = one_run(Path(tmp) / f"run{number}", args.postgres, tool=args.tool)
            counts[run.verdict()] += 1
            print(f"run {number + 1}: {run.verdict()}", flush=True)
    print(" ".join(f"{name}={counts[name]}" for name in ("ok", "dup", "lost", "odd")))
    return 0 if counts["ok"] == args.runs else 1


def _empty_schema(dsn: str) -> None:
    """Each run on an empty store: drop what the schema on `dsn` holds."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        schema = conn.execute("SELECT current_schema()").fetchone()[0]  # type: ignore[index]
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        conn.execute(f'CREATE SCHEMA "{schema}"')


if __name__ == "__main__":
    sys.exit(main())
