"""`$HERMES_HOME/.env`: every command reads it (the file the service unit names as its
EnvironmentFile), never over a variable already set, never showing a value; and the
commands that connect to no platform do not need the platforms' secrets at all."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from config.envfile import EnvFileError, load_env_file, read_env_file
from tests.commandline import cli, finish, spawn, wait_ready

SECRET = "s3cr3t-value-never-shown"
# Telegram enabled with its token from the environment: what docs/cli.md's service
# section recommends. Nothing here connects to Telegram.
TELEGRAM_FROM_ENV = "platforms:\n  telegram:\n    enabled: true\n    token: ${HERMES_TEST_TG}\n"

OPERATOR_COMMANDS = [
    ["status"],
    ["sessions", "list"],
    ["doctor"],
    ["pairing", "list"],
    ["schedules", "list"],
    ["memory", "list", "--user", "telegram:55"],
]


@pytest.fixture(autouse=True)
def _no_inherited_test_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HERMES_TEST_TG", "HERMES_TEST_HTTP", "HERMES_TEST_OTHER"):
        monkeypatch.delenv(name, raising=False)


def _home(tmp_path: Path, config: str, env: str | None) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "hermes.yaml").write_text(config)
    if env is not None:
        (home / ".env").write_text(env)
        (home / ".env").chmod(0o600)
    return home


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=" ".join)
def test_operator_commands_read_the_secrets_in_the_homes_env_file(
    tmp_path: Path, argv: list[str]
) -> None:
    home = _home(tmp_path, TELEGRAM_FROM_ENV, f"HERMES_TEST_TG={SECRET}\n")
    result = cli(home, *argv)
    out = result.stdout + result.stderr
    assert result.returncode in (0, 3), out  # status: 3, not running
    assert "is not set" not in out
    assert SECRET not in out


@pytest.mark.parametrize("argv", OPERATOR_COMMANDS, ids=" ".join)
def test_operator_commands_do_not_need_a_platforms_secret(tmp_path: Path, argv: list[str]) -> None:
    home = _home(tmp_path, TELEGRAM_FROM_ENV, env=None)
    result = cli(home, *argv)
    assert result.returncode in (0, 3), result.stdout + result.stderr


def test_check_config_still_needs_every_secret_and_finds_it_in_the_env_file(
    tmp_path: Path,
) -> None:
    home = _home(tmp_path, TELEGRAM_FROM_ENV, env=None)
    missing = cli(home, "check-config")
    assert missing.returncode == 78
    assert "platforms.telegram.token: environment variable HERMES_TEST_TG is not set" in (
        missing.stderr
    )
    (home / ".env").write_text(f"# the bot\nHERMES_TEST_TG='{SECRET}'\n")
    found = cli(home, "check-config")
    assert found.returncode == 0, found.stderr
    assert SECRET not in found.stdout + found.stderr


def test_the_store_settings_are_still_needed_by_every_command(tmp_path: Path) -> None:
    config = "storage:\n  backend: postgres\n  dsn: ${HERMES_TEST_OTHER}\n"
    home = _home(tmp_path, config, env=None)
    result = cli(home, "sessions", "list")
    assert result.returncode == 78
    assert "storage.dsn: environment variable HERMES_TEST_OTHER is not set" in result.stderr


def test_chat_with_token_does_not_need_the_platforms_secrets(tmp_path: Path) -> None:
    home = _home(tmp_path, TELEGRAM_FROM_ENV, env=None)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = cli(home, "chat", "--url", f"http://127.0.0.1:{port}", "--token", "t")
    # A refused connection, not a configuration error.
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot reach the gateway" in result.stdout + result.stderr


def test_chat_says_which_variable_its_token_needs(tmp_path: Path) -> None:
    home = _home(tmp_path, "platforms:\n  http:\n    token: ${HERMES_TEST_HTTP}\n", env=None)
    result = cli(home, "chat")
    assert result.returncode == 78
    assert "platforms.http.token: environment variable HERMES_TEST_HTTP is not set" in (
        result.stderr
    )


@pytest.mark.timeout(90)
def test_run_reads_the_env_file_and_a_set_variable_wins(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = f"platforms:\n  http:\n    port: {port}\n    token: ${{HERMES_TEST_HTTP}}\n"
    home = _home(tmp_path, config, f"HERMES_TEST_HTTP={SECRET}\n")
    procs.append(proc := spawn(home, "run", "--log-json"))
    lines = wait_ready(proc)
    assert '"token_required":true' in "".join(lines)
    assert _status(port, SECRET) == 200
    code, out = finish(proc)
    assert code == 0, out
    assert SECRET not in "".join(lines) + out

    procs.append(proc := spawn(home, "run", "--log-json", env={"HERMES_TEST_HTTP": "from-env"}))
    wait_ready(proc)
    assert _status(port, SECRET) == 401
    assert _status(port, "from-env") == 200
    assert finish(proc)[0] == 0


def _status(port: int, token: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/sessions", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_malformed_env_file_is_exit_78_naming_the_line_not_the_value(tmp_path: Path) -> None:
    home = _home(tmp_path, TELEGRAM_FROM_ENV, f"# ok\nHERMES_TEST_TG={SECRET}\nexport X={SECRET}\n")
    result = cli(home, "status")
    assert result.returncode == 78
    assert f"{home / '.env'}: line 3: not NAME=value" in result.stderr
    assert SECRET not in result.stdout + result.stderr


# --- the parser -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A=1\n", {"A": "1"}),
        ("  A = spaced out  \n", {"A": "spaced out"}),
        ("# c\n; c\n\nA=x#not-a-comment\n", {"A": "x#not-a-comment"}),
        ("A='single $NOT \\n expanded'\n", {"A": "single $NOT \\n expanded"}),
        ('A="double \\" \\\\ quote"\n', {"A": 'double " \\ quote'}),
        ('A=\nB=""\n', {"A": "", "B": ""}),
        ("A=1\nA=2\n", {"A": "2"}),
        ("A=b=c\n", {"A": "b=c"}),
    ],
)
def test_env_file_lines(tmp_path: Path, text: str, expected: dict[str, str]) -> None:
    path = tmp_path / ".env"
    path.write_text(text)
    assert read_env_file(path) == expected


@pytest.mark.parametrize(
    "text",
    [
        "export A=1\n",
        "A\n",
        "1A=2\n",
        "A-B=1\n",
        "A='open\n",
        'A="open\n',
        'A="x\\"\n',
        'A="a"b"\n',
    ],
)
def test_env_file_refuses_what_it_cannot_read_alike_with_systemd(tmp_path: Path, text: str) -> None:
    path = tmp_path / ".env"
    path.write_text(f"OK=1\n{text}")
    with pytest.raises(EnvFileError, match=r": line 2: "):
        read_env_file(path)


def test_env_file_sets_only_what_is_not_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".env").write_text("HERMES_TEST_TG=from-file\nHERMES_TEST_OTHER=from-file\n")
    monkeypatch.setenv("HERMES_TEST_TG", "from-env")
    # Set, then unset through monkeypatch: what the loader sets is undone after the test.
    monkeypatch.setenv("HERMES_TEST_OTHER", "placeholder")
    monkeypatch.delenv("HERMES_TEST_OTHER")
    assert load_env_file(tmp_path) == ["HERMES_TEST_OTHER"]
    assert os.environ["HERMES_TEST_TG"] == "from-env"
    assert os.environ["HERMES_TEST_OTHER"] == "from-file"
