"""`hermes-gateway doctor` (gateway/ops/doctor/) on real homes built by a real SessionStore."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from config import GatewayConfig
from gateway.ops.doctor import add_doctor_parser
from gateway.session import Platform, SessionEntry, SessionSource, TokenUsage
from gateway.store.migrations import SCHEMA_VERSION
from gateway.store.session_store import SessionStore

CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})


def dm(chat_id: str) -> SessionSource:
    return SessionSource(
        platform=Platform.TELEGRAM,
        chat_id=chat_id,
        chat_type="dm",
        user_id=chat_id,
        user_name=f"user {chat_id}",
        chat_name=f"chat {chat_id}",
    )


@dataclass
class Home:
    path: Path
    entries: dict[str, SessionEntry]  # by session key, as the store left them

    @property
    def sessions(self) -> Path:
        return self.path / "sessions"

    @property
    def db(self) -> Path:
        return self.sessions / "state.db"

    @property
    def sessions_json(self) -> Path:
        return self.sessions / "sessions.json"


async def _populate(sessions: Path) -> dict[str, SessionEntry]:
    async with SessionStore(sessions, CONFIG) as store:
        for n in range(3):
            entry = await store.get_or_create_session(dm(f"c{n}"))
            for turn in range(2):
                await store.append_to_transcript(
                    entry.session_id, {"role": "user", "content": f"hello {n}.{turn}"}
                )
                await store.append_to_transcript(
                    entry.session_id, {"role": "assistant", "content": f"reply {n}.{turn}"}
                )
            usage = TokenUsage(input_tokens=10 * (n + 1), output_tokens=n)
            await store.update_session(entry.session_key, usage=usage)
        return {e.session_key: e for e in await store.list_sessions()}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Home:
    path = tmp_path / "home"
    path.mkdir()
    path.chmod(0o700)
    monkeypatch.setenv("HERMES_HOME", str(path))
    return Home(path, asyncio.run(_populate(path / "sessions")))


def doctor(*argv: str, config: GatewayConfig = CONFIG) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_doctor_parser(sub, parents=[])
    args = parser.parse_args(["doctor", *argv])
    return int(args.handler(args, config))


def findings(
    capsys: pytest.CaptureFixture[str], *argv: str, config: GatewayConfig = CONFIG
) -> tuple[int, dict[str, Any]]:
    """Run `doctor --json ARGV` and return its exit code and findings by name."""
    capsys.readouterr()
    rc = doctor("--json", *argv, config=config)
    data = json.loads(capsys.readouterr().out)
    return rc, {f["name"]: f for f in data}


def statuses(found: dict[str, Any]) -> dict[str, str]:
    return {name: f["status"] for name, f in found.items()}


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def damage_table(db: Path, table: str) -> None:
    """Overwrite the root page of `table` with garbage (the store must be closed)."""
    conn = sqlite3.connect(db)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    sql = "SELECT rootpage FROM sqlite_master WHERE name = ?"
    (root,) = conn.execute(sql, (table,)).fetchone()
    conn.close()
    with db.open("r+b") as file:
        file.seek((root - 1) * page_size)
        file.write(b"\xff" * page_size)


def integrity(db: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [row[0] for row in conn.execute("PRAGMA integrity_check")]
    finally:
        conn.close()


async def _reopen(sessions: Path) -> tuple[list[SessionEntry], dict[str, list[Any]], int]:
    """What a new store sees: entries, transcripts by key, full-text hits for 'hello'."""
    async with SessionStore(sessions, CONFIG) as store:
        listed = await store.list_sessions()
        transcripts = {e.session_key: await store.load_transcript(e.session_id) for e in listed}
        await store.search_index.catch_up()
        search = sqlite3.connect(f"file:{store.search_index.path}?mode=ro", uri=True)
        try:
            sql = "SELECT COUNT(*) FROM messages_fts WHERE messages_fts MATCH 'hello'"
            hits = search.execute(sql).fetchone()[0]
        finally:
            search.close()
    return listed, transcripts, hits


def reopen(home: Home) -> tuple[list[SessionEntry], dict[str, list[Any]], int]:
    return asyncio.run(_reopen(home.sessions))


# --- a healthy home -------------------------------------------------------------------------


def test_healthy_home_is_all_ok(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("[ok] ") for line in lines)
    assert any(line.startswith("[ok] state.db: integrity ok") for line in lines)

    rc, found = findings(capsys)
    assert rc == 0
    assert set(statuses(found).values()) == {"ok"}
    assert {"home directory", "file permissions", "state.db", "sessions.json"} <= set(found)
    assert found["sessions.json"]["detail"] == "3 entries"
    assert found["gateway"]["detail"] == "not running"
    assert set(found["state.db"]) >= {"name", "status", "detail", "repairable"}


def test_missing_home_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HERMES_HOME", str(tmp_path / "nowhere"))
    assert doctor("--repair") == 1
    assert capsys.readouterr().out.startswith("[error] home directory:")


def test_reports_clean_shutdown_marker_and_pending_work(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    (home.path / ".clean_shutdown").write_text("clean shutdown\n")
    conn = sqlite3.connect(home.db)
    with conn:
        for platform in ("http", "telegram", "telegram"):
            conn.execute(
                "INSERT INTO outbound (platform, chat_id, target, text, state, created_at)"
                " VALUES (?, 'c0', 'c0', 'hi', 'pending', 0)",
                (platform,),
            )
    conn.close()
    http_only = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"http": {"enabled": True}}}
    )
    _, found = findings(capsys, config=http_only)
    assert "marker present" in found["clean shutdown"]["detail"]
    # What waits for a platform that is not enabled is not a reply that will go.
    assert found["outbound"]["status"] == "warn"
    assert found["outbound"]["detail"] == (
        "1 reply chunks pending (sent at the next start); 2 for platforms not enabled"
        " (telegram: 2), sent only once enabled"
    )


# --- warnings that --repair fixes -----------------------------------------------------------


def test_open_permissions_warn_and_repair_sets_private_modes(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    home.path.chmod(0o777)
    home.db.chmod(0o644)
    home.sessions_json.chmod(0o640)
    rc, found = findings(capsys)
    assert rc == 0  # warnings only
    assert found["home directory"]["status"] == "warn"
    assert found["file permissions"]["status"] == "warn"
    assert "sessions/state.db is 0644" in found["file permissions"]["detail"]

    rc, found = findings(capsys, "--repair")
    assert rc == 0
    assert set(statuses(found).values()) == {"ok"}
    assert "0600" in found["file permissions"]["repaired"]
    assert (mode(home.path), mode(home.db), mode(home.sessions_json)) == (0o700, 0o600, 0o600)


def test_damaged_sessions_json_is_set_aside_and_rewritten(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    home.sessions_json.write_bytes(b'{"truncated": ')
    rc, found = findings(capsys)
    assert rc == 0
    assert found["sessions.json"]["status"] == "warn"
    assert found["sessions.json"]["repairable"]
    assert home.sessions_json.read_bytes() == b'{"truncated": '  # a check changes nothing

    capsys.readouterr()
    assert doctor("--repair") == 0
    out = capsys.readouterr().out
    assert "[ok] sessions.json: 3 entries (--repair: set aside as sessions.json.corrupt-" in out
    (aside,) = home.sessions.glob("sessions.json.corrupt-*")
    assert aside.read_bytes() == b'{"truncated": '
    assert set(json.loads(home.sessions_json.read_bytes())) == set(home.entries)


def test_stale_temp_files_are_deleted(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    stale = [
        home.sessions / ".sessions.json.tmp-123-0badcafe",
        home.path / ".restart_counts.json.tmp-9-deadbeef",
    ]
    fresh = home.sessions / ".sessions.json.tmp-456-00c0ffee"  # a write in progress
    for path in [*stale, fresh]:
        path.write_bytes(b"partial")
    old = time.time() - 600
    for path in stale:
        os.utime(path, (old, old))
    _, found = findings(capsys)
    assert found["temp files"]["status"] == "warn"
    assert found["temp files"]["detail"].startswith("2 stale")

    rc, found = findings(capsys, "--repair")
    assert rc == 0 and found["temp files"]["status"] == "ok"
    assert not any(path.exists() for path in stale)
    assert fresh.exists()


def test_damaged_restart_counts_is_deleted(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    counts = home.path / "restart_counts.json"
    counts.write_text("[1, 2")
    _, found = findings(capsys)
    assert found["restart_counts.json"]["status"] == "warn"
    _, found = findings(capsys, "--repair")
    assert found["restart_counts.json"]["status"] == "ok"
    assert not counts.exists()


def test_orphan_turn_markers_are_removed_queued_messages_kept(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    known_key, known = next(iter(home.entries.items()))
    conn = sqlite3.connect(home.db)
    with conn:
        turn = "INSERT INTO turns (session_key, session_id, inbox_ids, event, started_at)"
        turn += " VALUES (?, ?, '[]', '{}', 0)"
        conn.execute(turn, ("agent:main:telegram:dm:gone", known.session_id))
        conn.execute(turn, (known_key, "20260101_000000_00000000"))  # unknown session id
        conn.execute(
            "INSERT INTO inbox (platform, chat_id, session_key, kind, event, state, accepted_at)"
            " VALUES ('telegram', 'new', 'agent:main:telegram:dm:new', 'message', '{}',"
            " 'accepted', 0)"
        )
    conn.close()
    _, found = findings(capsys)
    assert found["turn markers"]["status"] == "warn"
    assert found["turn markers"]["detail"].startswith("2 of 2")
    assert found["inbox"]["status"] == "ok"
    assert "1 for keys without a session yet" in found["inbox"]["detail"]

    rc, found = findings(capsys, "--repair")
    assert rc == 0 and found["turn markers"]["status"] == "ok"
    assert found["turn markers"]["repaired"] == "deleted 2"
    conn = sqlite3.connect(home.db)
    assert conn.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 0
    assert conn.execute("SELECT COUNT(*) FROM inbox").fetchone()[0] == 1
    conn.close()


# --- a damaged state.db ---------------------------------------------------------------------


def test_damaged_state_db_is_an_error(home: Home, capsys: pytest.CaptureFixture[str]) -> None:
    damage_table(home.db, "session_entries")
    before = home.db.read_bytes()
    capsys.readouterr()
    assert doctor() == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "state.db:" in line)
    assert line.startswith("[error] state.db: integrity check failed: ")
    assert line.endswith("(repairable: --repair sets it aside and rebuilds)")
    assert "turn markers" not in out  # not read from a damaged database
    assert home.db.read_bytes() == before


def test_an_empty_state_db_is_an_error_and_repair_rebuilds_it_from_the_mirror(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    # What `run` refuses (exit 78): SQLite alone would call the empty file a sound database.
    for path in home.sessions.glob("state.db*"):
        path.unlink()
    home.db.write_bytes(b"")
    rc, found = findings(capsys)
    assert rc == 1
    assert found["state.db"]["status"] == "error" and found["state.db"]["repairable"]
    assert found["state.db"]["detail"].startswith("empty (0 bytes)")

    rc, found = findings(capsys, "--repair")
    assert rc == 0, found
    (aside,) = home.sessions.glob("state.db.corrupt-*")
    assert aside.read_bytes() == b""
    listed, _, _ = reopen(home)
    assert {e.session_key: e for e in listed} == home.entries  # the routing index, only


def test_a_missing_state_db_says_what_importing_the_mirror_cannot_restore(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in home.sessions.glob("state.db*"):
        path.unlink()
    rc, found = findings(capsys)
    assert rc == 0  # a warning: the next start imports sessions.json, as from an old install
    state = found["state.db"]
    assert state["status"] == "warn" and not state["repairable"]
    assert state["detail"].startswith("missing: the next start imports the 3 routing entries")
    for lost in ("transcripts", "duplicate memory", "delivery ledger", "paired users"):
        assert lost in state["detail"]

    (home.sessions / "state.db-wal").write_bytes(b"\x37\x7f\x06\x82" + bytes(28))
    rc, found = findings(capsys)  # the log without its database: `run` refuses it too
    assert rc == 1 and found["state.db"]["status"] == "error"
    assert "state.db-wal" in found["state.db"]["detail"]


def test_repair_rebuilds_routing_index_from_transcripts_and_mirror(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    damage_table(home.db, "session_entries")
    original = home.db.read_bytes()
    rc, found = findings(capsys, "--repair")
    assert rc == 0, found
    assert found["state.db"]["status"] == "ok"
    report = found["state.db"]["repaired"]
    assert "sessions 3" in report and "messages 12" in report
    assert "Routing entries rebuilt: 3 (3 from sessions.json)" in report

    (aside,) = home.sessions.glob("state.db.corrupt-*")
    assert aside.read_bytes() == original  # never deleted, never changed
    assert integrity(home.db) == ["ok"]
    assert mode(home.db) == 0o600
    assert set(json.loads(home.sessions_json.read_bytes())) == set(home.entries)

    listed, transcripts, hits = reopen(home)
    # The mirror had them: flags and counters come back exactly.
    assert {e.session_key: e for e in listed} == home.entries
    assert all(len(messages) == 4 for messages in transcripts.values())
    assert hits == 6  # the FTS index was rebuilt by the insert trigger


def test_repair_without_mirror_builds_entries_from_sessions_rows(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    damage_table(home.db, "session_entries")
    home.sessions_json.unlink()
    rc, found = findings(capsys, "--repair")
    assert rc == 0
    assert "Routing entries rebuilt: 3 (0 from sessions.json)" in found["state.db"]["repaired"]

    listed, transcripts, _ = reopen(home)
    assert {e.session_key for e in listed} == set(home.entries)
    for entry in listed:
        was = home.entries[entry.session_key]
        assert entry.session_id == was.session_id
        assert entry.origin == was.origin and entry.origin is not None
        assert entry.platform == Platform.TELEGRAM
        assert entry.display_name == was.display_name
        assert entry.created_at == was.created_at
        assert entry.updated_at >= was.created_at
        assert [m["content"] for m in transcripts[entry.session_key]][-1].startswith("reply")


def test_repair_restores_lost_sessions_rows_from_the_mirror(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    damage_table(home.db, "sessions")
    rc, found = findings(capsys, "--repair")
    assert rc == 0
    assert "sessions 0, then stopped: " in found["state.db"]["repaired"]

    listed, transcripts, _ = reopen(home)
    assert {e.session_key: e.session_id for e in listed} == {
        k: e.session_id for k, e in home.entries.items()
    }
    # The entries survived, so their session rows were recreated and messages kept.
    assert all(len(messages) == 4 for messages in transcripts.values())


def test_newer_schema_is_an_error_repair_leaves_alone(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = sqlite3.connect(home.db)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    rc, found = findings(capsys, "--repair")
    assert rc == 1
    assert found["state.db"]["status"] == "error"
    assert not found["state.db"]["repairable"]
    assert "upgrade hermes-gateway" in found["state.db"]["detail"]
    assert not list(home.sessions.glob("state.db.corrupt-*"))


# --- a running gateway ----------------------------------------------------------------------


@pytest.mark.parametrize("hold", ["write lock", "idle connection"])
def test_repair_refuses_while_the_gateway_runs(
    home: Home, capsys: pytest.CaptureFixture[str], hold: str
) -> None:
    damage_table(home.db, "session_entries")
    holder = sqlite3.connect(home.sessions / "state.db", isolation_level=None)
    try:
        if hold == "write lock":
            holder.execute("BEGIN EXCLUSIVE")
        else:
            holder.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
        capsys.readouterr()
        assert doctor("--repair") == 1
        captured = capsys.readouterr()
        assert "the gateway seems to be running" in captured.err
        assert "stop it first" in captured.err
        assert not list(home.sessions.glob("state.db.corrupt-*"))

        rc, found = findings(capsys)  # a plain check still reports
        assert rc == 1
        assert found["gateway"]["detail"].startswith("seems to be running")
        assert found["state.db"]["status"] == "error"
    finally:
        holder.close()


# --- memory embedding -----------------------------------------------------------------------


def test_doctor_says_plainly_that_hash_recall_is_lexical(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    _, found = findings(capsys)
    detail = found["memory embedding"]["detail"]
    assert detail.startswith("hash: lexical, finds notes sharing the question's words")
    assert "not its meaning" in detail and "memory.embedding: openai" in detail


def test_a_missing_local_model_is_an_error(
    home: Home, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = GatewayConfig.model_validate(
        {"memory": {"embedding": "local", "model_path": str(tmp_path / "no-model")}}
    )
    rc, found = findings(capsys, config=local)
    assert rc == 1
    assert found["memory embedding"]["status"] == "error"
    assert "memory.model_path" in found["memory embedding"]["detail"]


def test_each_mcp_server_is_connected_once_and_reported_without_its_secrets(
    home: Home, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real stdio server (the SDK test server) is up with its tools; an unreachable
    HTTP one is an error naming why, with no header value in it."""
    import sys

    fake = Path(__file__).resolve().parent / "fakes" / "mcp_server.py"
    servers = {
        "local": {"command": sys.executable, "args": [str(fake), "stdio"]},
        "web": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Token": "doc-SECRET-77"}},
    }
    config = GatewayConfig.model_validate({"mcp": {"servers": servers}})
    from structlog.testing import capture_logs

    with capture_logs():  # the CLI logs to stderr; structlog's test default is stdout
        rc, found = findings(capsys, config=config)
    assert rc == 1
    assert found["mcp server local"]["status"] == "ok"
    assert found["mcp server local"]["detail"] == "up, 6 tools"
    web = found["mcp server web"]
    assert web["status"] == "error" and web["detail"].startswith("down")
    assert "doc-SECRET-77" not in json.dumps(found)
    assert not (home.path / "mcp").exists()  # the real home's children are not touched
