"""The `hermes-gateway` command line, run as a real subprocess."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from config import GatewayConfig
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from tests.commandline import cli

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_check_config_accepts_the_zero_config_default(tmp_path: Path) -> None:
    result = cli(tmp_path, "check-config")
    assert result.returncode == 0, result.stderr
    assert "zero-config defaults" in result.stdout


def test_check_config_names_the_key_path_and_exits_78(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text(
        "session_reset:\n  at_hour: 25\nplatforms:\n  telegram:\n    token: 123:SECRET\n"
        "    bogus: 1\n"
    )
    result = cli(tmp_path, "check-config")
    assert result.returncode == 78
    assert "session_reset.at_hour" in result.stderr
    assert "platforms.telegram.bogus: unknown key" in result.stderr
    assert "SECRET" not in result.stderr + result.stdout


def test_explicit_config_path_and_home_flag(tmp_path: Path) -> None:
    config = tmp_path / "custom.yaml"
    config.write_text("queue:\n  max_depth: 0\n")
    result = cli(tmp_path / "elsewhere", "check-config", "--config", str(config))
    assert result.returncode == 78 and "queue.max_depth" in result.stderr
    missing = cli(tmp_path, "check-config", "--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 78 and "config file not found" in missing.stderr


def test_version_prints_the_package_version(tmp_path: Path) -> None:
    from importlib import metadata

    result = cli(tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"hermes-gateway {metadata.version('hermes-gateway')}\n"


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_option_counts_before_or_after_the_subcommand(tmp_path: Path, where: str) -> None:
    config = tmp_path / "custom.yaml"
    config.write_text("queue:\n  max_depth: 0\n")
    option = ["--config", str(config)]
    argv = [*option, "check-config"] if where == "before" else ["check-config", *option]
    result = cli(tmp_path / "elsewhere", *argv)
    assert result.returncode == 78, result.stdout + result.stderr
    assert "queue.max_depth" in result.stderr


def test_a_global_option_after_the_subcommand_beats_the_one_before(tmp_path: Path) -> None:
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text("queue:\n  max_depth: 0\n")
    good.write_text("queue:\n  max_depth: 5\n")
    result = cli(tmp_path, "--config", str(bad), "check-config", "--config", str(good))
    assert result.returncode == 0, result.stderr
    assert f"config ok: {good}" in result.stdout


@pytest.mark.parametrize("where", ["before", "after"])
def test_home_option_counts_before_or_after_the_subcommand(tmp_path: Path, where: str) -> None:
    home = tmp_path / "other home"
    home.mkdir()
    option = ["--home", str(home)]
    argv = [*option, "status"] if where == "before" else ["status", *option]
    result = cli(tmp_path / "env home", *argv)
    assert f"not running in {home}" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--home", "{home}", "sessions", "list"],
        ["sessions", "--home", "{home}", "list"],
        ["sessions", "list", "--home", "{home}"],
    ],
    ids=["before", "between", "after-sub-subcommand"],
)
def test_home_option_reaches_sessions_list_wherever_it_is_written(
    tmp_path: Path, argv: list[str]
) -> None:
    home = tmp_path / "seeded"
    key, _ = _seed_sessions(home)
    result = cli(tmp_path / "env home", *[arg.format(home=home) for arg in argv])
    assert result.returncode == 0, result.stderr
    assert key in result.stdout


def test_chat_connects_to_the_port_of_a_config_given_before_the_subcommand(
    tmp_path: Path,
) -> None:
    port = free_port()  # nobody listens there: the error names the URL chat tried
    config = tmp_path / "chat.yaml"
    config.write_text(f"platforms:\n  http:\n    port: {port}\n")
    env = {**os.environ, "HERMES_HOME": str(tmp_path / "env home")}
    env.pop("HERMES_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--config", str(config), "chat"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=30,
    )
    assert result.returncode == 1
    assert f"cannot reach the gateway at http://127.0.0.1:{port}" in result.stdout


@pytest.mark.parametrize("argv", [["doctor", "--json"], ["doctor"], ["status", "--json"]])
def test_a_closed_stdout_pipe_ends_the_command_quietly(tmp_path: Path, argv: list[str]) -> None:
    # `hermes-gateway doctor --json | head -1` with head already gone: the reader's end is
    # closed before the command writes, so every write fails with EPIPE.
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "HERMES_HOME": str(tmp_path)}
    env.pop("HERMES_CONFIG", None)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=30,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 1


@pytest.mark.parametrize("verb", [["approve", "whatsapp", "ABCDEFGH"], ["revoke", "whatsapp", "1"]])
def test_pairing_on_an_unknown_platform_names_it_and_the_valid_ones(
    tmp_path: Path, verb: list[str]
) -> None:
    result = cli(tmp_path, "pairing", *verb)
    assert result.returncode == 2  # a usage error
    [error] = [line for line in result.stderr.splitlines() if "error:" in line]
    assert "'whatsapp'" in error
    assert all(name in error for name in ("telegram", "discord", "slack"))
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before the store was opened


def _seed_sessions(home: Path) -> tuple[str, str]:
    async def seed() -> tuple[str, str]:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        async with SessionStore(home / "sessions", config) as store:
            source = SessionSource(platform=Platform.TELEGRAM, chat_id="99", user_name="Ann")
            entry = await store.get_or_create_session(source)
            await store.append_to_transcript(entry.session_id, {"role": "user", "content": "hi"})
            await store.append_to_transcript(
                entry.session_id, {"role": "assistant", "content": "echo: hi"}
            )
            return entry.session_key, entry.session_id

    return asyncio.run(seed())


def test_sessions_list_and_show(tmp_path: Path) -> None:
    key, session_id = _seed_sessions(tmp_path)
    listing = cli(tmp_path, "sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert key in listing.stdout and session_id in listing.stdout

    as_json = json.loads(cli(tmp_path, "sessions", "list", "--json").stdout)
    assert [e["session_id"] for e in as_json["sessions"]] == [session_id]
    assert as_json["next"] is None

    for target in (key, session_id):
        shown = cli(tmp_path, "sessions", "show", target)
        assert shown.returncode == 0, shown.stderr
        assert "[user] hi" in shown.stdout and "[assistant] echo: hi" in shown.stdout
        assert "DM with Ann" in shown.stdout

    missing = cli(tmp_path, "sessions", "show", "agent:main:telegram:dm:nobody")
    assert missing.returncode == 1 and "no session" in missing.stderr


def test_sessions_show_finds_a_session_whose_messages_were_all_undone(tmp_path: Path) -> None:
    async def seed() -> tuple[str, str, str]:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        async with SessionStore(tmp_path / "sessions", config) as store:
            source = SessionSource(platform=Platform.TELEGRAM, chat_id="99", user_name="Ann")
            old = await store.get_or_create_session(source)
            for role, content in (("user", "hi"), ("assistant", "echo: hi")):
                await store.append_to_transcript(old.session_id, {"role": role, "content": content})
            assert (await store.rewind_session(old.session_id, 1))["turns_undone"] == 1
            current = await store.reset_session(old.session_key)  # as /undo, then /new
            assert current is not None
            await store.rewind_session(current.session_id, 1)  # nothing to undo: no-op
            return old.session_key, old.session_id, current.session_id

    key, old_id, current_id = asyncio.run(seed())
    shown = cli(tmp_path, "sessions", "show", old_id)
    assert shown.returncode == 0, shown.stderr
    assert "no longer the current session of its key" in shown.stdout
    assert f"session_key              {key}" in shown.stdout
    assert "end_reason               session_reset" in shown.stdout
    assert "transcript (0 messages; 2 undone with /undo or /retry):" in shown.stdout
    as_json = json.loads(cli(tmp_path, "sessions", "show", old_id, "--json").stdout)
    assert as_json["entry"] is None and as_json["transcript"] == []
    assert as_json["session"]["session_key"] == key and as_json["undone_messages"] == 2
    current = cli(tmp_path, "sessions", "show", current_id)
    assert current.returncode == 0 and "transcript (0 messages):" in current.stdout
    unknown = cli(tmp_path, "sessions", "show", "20200101_000000_0123abcd")
    assert unknown.returncode == 1 and "no session" in unknown.stderr


def test_sessions_list_active_minutes_filter(tmp_path: Path) -> None:
    _seed_sessions(tmp_path)
    recent = cli(tmp_path, "sessions", "list", "--active-minutes", "5")
    assert "agent:main:telegram:dm:99" in recent.stdout


def test_sessions_list_pages_with_a_cursor(tmp_path: Path) -> None:
    async def seed() -> list[str]:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        async with SessionStore(tmp_path / "sessions", config) as store:
            return [
                (
                    await store.get_or_create_session(SessionSource(Platform.TELEGRAM, f"{n}"))
                ).session_key
                for n in range(7)
            ]

    keys = sorted(asyncio.run(seed()))
    seen: list[str] = []
    options: list[str] = []
    for _ in range(3):
        page = cli(tmp_path, "sessions", "list", "--limit", "3", "--json", *options)
        assert page.returncode == 0, page.stderr
        listed = json.loads(page.stdout)
        seen += [e["session_key"] for e in listed["sessions"]]
        options = ["--after", listed["next"]] if listed["next"] else []
    assert seen == keys and options == []  # three pages: 3, 3 and the last 1

    text = cli(tmp_path, "sessions", "list", "--limit", "5")
    assert text.returncode == 0, text.stderr
    assert [key for key in keys if key in text.stdout] == keys[:5]
    more = text.stdout.strip().splitlines()[-1]
    assert more.startswith("more: the same command with --after ")
    rest = cli(tmp_path, "sessions", "list", "--limit", "5", "--after", more.split()[-1])
    assert [key for key in keys if key in rest.stdout] == keys[5:]
    assert "more:" not in rest.stdout

    for bad in (["--limit", "1001"], ["--limit", "0"], ["--after", keys[0]]):
        refused = cli(tmp_path, "sessions", "list", *bad)
        assert refused.returncode != 0 and refused.stdout == "", bad  # a usage error
        assert bad[0] in refused.stderr


def test_damaged_state_db_is_reported_with_exit_78(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "state.db").write_bytes(b"this is not a database" * 200)
    result = cli(tmp_path, "sessions", "list")
    assert result.returncode == 78
    assert "state.db" in result.stderr


def test_run_reports_a_damaged_state_db_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    sessions.mkdir(parents=True)
    damaged = b"this is not a database" * 200
    (sessions / "state.db").write_bytes(damaged)
    (tmp_path / "hermes.yaml").write_text(f"platforms:\n  http:\n    port: {free_port()}\n")
    result = cli(tmp_path, "run")
    assert result.returncode == 78, result.stderr
    assert "state.db cannot be used" in result.stderr
    assert (sessions / "state.db").read_bytes() == damaged


# Each config passes the schema but cannot run; the key the one-line error must name.
UNRUNNABLE_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "telegram-without-token": (
        {"platforms": {"telegram": {"enabled": True}}},
        "platforms.telegram.token",
    ),
    "telegram-webhook-without-secret": (
        {
            "platforms": {
                "telegram": {
                    "enabled": True,
                    "token": "1:x",
                    "mode": "webhook",
                    "webhook_url": "https://bot.example/hook",
                }
            }
        },
        "platforms.telegram.webhook_secret",
    ),
    "slack-http-mode-without-signing-secret": (
        {"platforms": {"slack": {"enabled": True, "bot_token": "xoxb-1", "mode": "http"}}},
        "platforms.slack.signing_secret",
    ),
    "backend-module-does-not-import": (
        {"agent": {"backend": "no_such_module_hermes.agent:factory"}},
        "agent.backend",
    ),
    "backend-module-lacks-the-factory": (
        {"agent": {"backend": "json:no_such_factory"}},
        "agent.backend",
    ),
    "http-token-empty-from-an-unset-variable": (
        {"platforms": {"http": {"token": "${HERMES_TEST_UNSET_TOKEN:-}"}}},
        "platforms.http.token",
    ),
}


@pytest.mark.parametrize("command", ["check-config", "run"])
@pytest.mark.parametrize("case", sorted(UNRUNNABLE_CONFIGS))
def test_check_config_and_run_refuse_the_same_configs_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, command: str
) -> None:
    monkeypatch.delenv("HERMES_TEST_UNSET_TOKEN", raising=False)
    data, key = copy.deepcopy(UNRUNNABLE_CONFIGS[case])
    # Were the config accepted, `run` would serve on a free port, not on the default one.
    data.setdefault("platforms", {}).setdefault("http", {})["port"] = free_port()
    (tmp_path / "hermes.yaml").write_text(yaml.safe_dump(data))
    result = cli(tmp_path, command, timeout=20)
    assert result.returncode == 78, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert key in line
    assert "Traceback" not in result.stdout + result.stderr
    # No state written (`run` holds the home's lock file from its first step; it is empty
    # of state and never removed, see gateway.store.homelock).
    written = {p.name for p in tmp_path.iterdir()} - {"hermes.yaml", "gateway.lock"}
    assert written == set()


def test_run_with_an_adapter_config_error_creates_no_state(tmp_path: Path) -> None:
    # The store's start-up check begins before the adapters are built; a settings error
    # found while building them must still leave a fresh home without a database.
    (tmp_path / "hermes.yaml").write_text("platforms:\n  telegram:\n    enabled: true\n")
    result = cli(tmp_path, "run")
    assert result.returncode == 78, result.stderr
    assert "platforms.telegram.token is not set" in result.stderr
    assert not (tmp_path / "sessions" / "state.db").exists()


def test_run_with_a_config_error_and_a_damaged_state_db_reports_only_the_config(
    tmp_path: Path,
) -> None:
    # The early integrity check fails too, but nobody opens the store: its failure must
    # not surface as asyncio's "Task exception was never retrieved" traceback.
    sessions = tmp_path / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "state.db").write_bytes(b"this is not a database" * 200)
    (tmp_path / "hermes.yaml").write_text("platforms:\n  telegram:\n    enabled: true\n")
    result = cli(tmp_path, "run")
    assert result.returncode == 78, result.stderr
    assert "platforms.telegram.token is not set" in result.stderr
    assert "never retrieved" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_run_serves_http_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "hermes.yaml").write_text(f"platforms:\n  http:\n    port: {port}\n")
    env = {**os.environ, "HERMES_HOME": str(tmp_path)}
    env.pop("HERMES_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "run", "--log-json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("the daemon never listened")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    events = [json.loads(line)["event"] for line in stderr.splitlines() if line.startswith("{")]
    assert "gateway_started" in events and events[-1] == "gateway_stopped"
    assert "echo" in stderr  # the zero-config agent is announced
    assert (tmp_path / "sessions" / "sessions.json").exists()


def test_status_shows_each_adapters_reconnects_errors_and_refusals(tmp_path: Path) -> None:
    from gateway.ops.status import write_status

    home = tmp_path / "home"
    home.mkdir()
    adapters = {
        "http": {"state": "running", "shed_total": 7},
        "discord": {"state": "reconnecting", "reconnects": 2, "last_error": "socket closed"},
    }
    # The pid written is the test's own: a live process, as a running daemon's would be.
    write_status(home, {"state": "running", "health": {"status": "degraded", "adapters": adapters}})
    result = cli(home, "status")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "  http: running, refused while busy: 7\n" in result.stdout
    assert "  discord: reconnecting, reconnects 2, last error: socket closed\n" in result.stdout


def test_a_window_the_tools_alone_fill_is_refused_at_start_naming_the_key(
    tmp_path: Path,
) -> None:
    """Every message to such an agent would be refused as too large: `check-config` and
    `run` say so at once (exit 78), and a window with room, or fewer tools, is accepted."""
    agent = "agent:\n  backend: openai\n  base_url: http://127.0.0.1:9/v1\n  model: m\n"
    (tmp_path / "hermes.yaml").write_text(agent + "  context: {window_tokens: 1024}\n")
    for command in ("check-config", "run"):
        result = cli(tmp_path, command)
        assert result.returncode == 78, result.stderr
        assert "agent.context.window_tokens: 1024 leaves no room" in result.stderr
        assert "agent.tools" in result.stderr and "Traceback" not in result.stderr
    for fits in (
        "  context: {window_tokens: 4096}\n",
        "  context: {window_tokens: 1024}\n  tools: [memory_save]\n",
    ):
        (tmp_path / "hermes.yaml").write_text(agent + fits)
        result = cli(tmp_path, "check-config")
        assert result.returncode == 0, result.stderr


def test_the_matrix_and_email_libraries_load_only_when_their_platform_is_enabled(
    tmp_path: Path,
) -> None:
    """A gateway without `platforms.matrix` or `platforms.email` builds its adapters and
    runner without importing matrix-nio, aioimaplib or aiosmtplib; enabled, each is
    imported by its adapter."""
    libraries = ("nio", "aioimaplib", "aiosmtplib")
    probe = (
        "import sys, json; from pathlib import Path; from config import GatewayConfig;"
        " from gateway.cli import build_adapters; from gateway.run import GatewayRunner;"
        " config = GatewayConfig.model_validate(json.loads(sys.argv[1]));"
        " GatewayRunner(config, build_adapters(config), home=Path(sys.argv[2]));"
        f" print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(libraries)!r}))"
    )

    def loaded(settings: dict) -> str:
        done = subprocess.run(
            [sys.executable, "-c", probe, json.dumps(settings), str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert loaded({}) == "[]"
    enabled = {
        "platforms": {
            "matrix": {
                "enabled": True,
                "homeserver": "http://127.0.0.1:9",
                "user_id": "@bot:example.org",
                "access_token": "t",
            },
            "email": {
                "enabled": True,
                "address": "bot@example.org",
                "imap": {"host": "127.0.0.1", "username": "u", "password": "p", "tls": False},
                "smtp": {"host": "127.0.0.1", "tls": False},
            },
        }
    }
    assert loaded(enabled) == str(sorted(libraries))
