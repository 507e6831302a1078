"""The systemd unit (`service ...`) and the sd_notify client."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from config import GatewayConfig
from gateway.ops.sdnotify import SystemdNotifier, run_watchdog
from gateway.ops.service import UNIT_NAME, add_service_parser, cmd_service, render_unit

PYTHON = "/opt/venv/bin/python"


def config_with_drain(seconds: float) -> GatewayConfig:
    return GatewayConfig.model_validate({"agent": {"restart_drain_timeout": seconds}})


# --- render_unit ------------------------------------------------------------------------


def test_user_unit_is_notify_with_watchdog_and_restart_policy(tmp_path: Path) -> None:
    text = render_unit(config_with_drain(45), home=tmp_path, system=False, user=None, python=PYTHON)
    lines = text.splitlines()
    for expected in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=60",
        "Restart=always",
        "RestartPreventExitStatus=78",
        "TimeoutStopSec=75",
        "KillMode=mixed",
        f"ExecStart={PYTHON} -m gateway.cli run --home {tmp_path}",
        f"Environment=HERMES_HOME={tmp_path}",
        "WantedBy=default.target",
    ):
        assert expected in lines
    assert not any(line.startswith("User=") for line in lines)
    assert not any(line.startswith("SuccessExitStatus=") for line in lines)
    assert lines.index("[Install]") > lines.index("[Service]") > lines.index("[Unit]")


def test_system_unit_runs_as_a_user_and_is_wanted_by_multi_user(tmp_path: Path) -> None:
    config_file = tmp_path / "conf.yaml"
    text = render_unit(
        config_with_drain(10),
        home=tmp_path,
        system=True,
        user="alice",
        python=PYTHON,
        config_path=config_file,
    )
    lines = text.splitlines()
    assert "User=alice" in lines
    assert "WantedBy=multi-user.target" in lines
    assert "TimeoutStopSec=40" in lines
    assert f"ExecStart={PYTHON} -m gateway.cli run --home {tmp_path} --config {config_file}" in (
        lines
    )


def test_system_unit_defaults_to_the_user_behind_sudo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUDO_USER", "bob")
    text = render_unit(GatewayConfig(), home=tmp_path, system=True, user=None, python=PYTHON)
    assert "User=bob" in text.splitlines()


def test_paths_with_spaces_percent_and_dollar_are_quoted_for_systemd(tmp_path: Path) -> None:
    home = tmp_path / "my home 100%" / "$HOME"
    text = render_unit(GatewayConfig(), home=home, system=False, user=None, python=PYTHON)
    lines = text.splitlines()
    escaped = str(home).replace("%", "%%")
    assert f'ExecStart={PYTHON} -m gateway.cli run --home "{escaped.replace("$", "$$")}"' in lines
    assert f'Environment="HERMES_HOME={escaped}"' in lines
    # One path to systemd, never quoted (quotes would be part of it); % still escaped.
    assert f"EnvironmentFile=-{escaped}/.env" in lines


def test_python_keeps_the_venv_symlink_path(tmp_path: Path) -> None:
    link = tmp_path / "venv-python"
    link.symlink_to(sys.executable)
    text = render_unit(GatewayConfig(), home=tmp_path, system=False, user=None, python=str(link))
    assert f"ExecStart={link} -m gateway.cli run --home {tmp_path}" in text.splitlines()


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path, system: bool) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    home = tmp_path / "state dir"
    home.mkdir()
    unit = tmp_path / UNIT_NAME
    unit.write_text(
        render_unit(config_with_drain(45), home=home, system=system, user="root", config_path=None)
    )
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    argv = [analyze, "verify", str(unit)] if system else [analyze, "--user", "verify", str(unit)]
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    output = result.stdout + result.stderr
    if result.returncode != 0 and "Failed to initialize manager" in output:
        pytest.skip(f"systemd-analyze cannot run here: {output.strip()}")
    # Only complaints about our file count; the host's own units may be imperfect.
    ours = [line for line in output.splitlines() if UNIT_NAME in line or str(unit) in line]
    assert ours == []
    assert result.returncode == 0, output


# --- service commands -------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_service_parser(parser.add_subparsers(dest="command", required=True), parents=[])
    return parser.parse_args(["service", *argv])


class FakeSystemd:
    """Fake systemctl/journalctl programs that record one argv line per call."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log = tmp_path / "calls.log"
        self.monkeypatch = monkeypatch
        for name, env_var in (
            ("systemctl", "HERMES_SYSTEMCTL"),
            ("journalctl", "HERMES_JOURNALCTL"),
        ):
            program = tmp_path / f"fake-{name}"
            program.write_text(
                f'#!/bin/sh\necho "{name} $*" >> "{self.log}"\n'
                '[ -n "$FAKE_STDOUT" ] && printf "%s\\n" "$FAKE_STDOUT"\n'
                '[ -n "$FAKE_STDERR" ] && printf "%s\\n" "$FAKE_STDERR" >&2\n'
                'exit "${FAKE_RC:-0}"\n'
            )
            program.chmod(0o755)
            monkeypatch.setenv(env_var, str(program))

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def exit_with(self, code: int, stderr: str = "") -> None:
        self.monkeypatch.setenv("FAKE_RC", str(code))
        self.monkeypatch.setenv("FAKE_STDERR", stderr)


@pytest.fixture
def unit_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    directory = tmp_path / "units"
    monkeypatch.setenv("HERMES_SYSTEMD_UNIT_DIR", str(directory))
    return directory


@pytest.fixture
def systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSystemd:
    return FakeSystemd(tmp_path, monkeypatch)


def test_install_dry_run_prints_the_unit_and_touches_nothing(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cmd_service(parse("install", "--dry-run"), GatewayConfig()) == 0
    out = capsys.readouterr().out
    assert out.startswith("[Unit]\n")
    assert "Type=notify" in out
    assert not unit_dir.exists()
    assert systemd.calls() == []


def test_install_writes_the_unit_reloads_and_enables(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cmd_service(parse("install"), config_with_drain(45)) == 0
    unit = unit_dir / UNIT_NAME
    assert "TimeoutStopSec=75" in unit.read_text()
    assert unit.stat().st_mode & 0o777 == 0o644
    assert systemd.calls() == [
        "systemctl --user daemon-reload",
        f"systemctl --user enable {UNIT_NAME}",
    ]
    out = capsys.readouterr().out
    assert f"unit written: {unit}" in out
    assert "loginctl enable-linger" in out


def test_second_install_with_the_same_config_writes_nothing(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    cmd_service(parse("install"), config_with_drain(45))
    unit = unit_dir / UNIT_NAME
    before = unit.stat()
    capsys.readouterr()

    assert cmd_service(parse("install"), config_with_drain(45)) == 0
    after = unit.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert "unit up to date" in capsys.readouterr().out
    assert systemd.calls()[2:] == [f"systemctl --user enable {UNIT_NAME}"]


def test_install_with_a_changed_drain_timeout_rewrites_the_unit(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    cmd_service(parse("install"), config_with_drain(45))
    capsys.readouterr()
    assert cmd_service(parse("install"), config_with_drain(90)) == 0
    assert "TimeoutStopSec=120" in (unit_dir / UNIT_NAME).read_text()
    assert f"unit updated: {unit_dir / UNIT_NAME}" in capsys.readouterr().out
    assert systemd.calls()[2:] == [
        "systemctl --user daemon-reload",
        f"systemctl --user enable {UNIT_NAME}",
    ]


def test_system_install_uses_the_system_manager_and_the_given_user(
    unit_dir: Path, systemd: FakeSystemd
) -> None:
    assert cmd_service(parse("install", "--system", "--user", "svc"), GatewayConfig()) == 0
    assert "User=svc" in (unit_dir / UNIT_NAME).read_text().splitlines()
    assert systemd.calls() == ["systemctl daemon-reload", f"systemctl enable {UNIT_NAME}"]


def test_install_user_option_needs_system(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cmd_service(parse("install", "--user", "svc"), GatewayConfig()) == 2  # usage
    assert "--system" in capsys.readouterr().err
    assert not unit_dir.exists()


def test_install_stops_at_a_failing_daemon_reload(unit_dir: Path, systemd: FakeSystemd) -> None:
    systemd.exit_with(1)
    assert cmd_service(parse("install"), GatewayConfig()) == 1
    assert systemd.calls() == ["systemctl --user daemon-reload"]


def test_uninstall_disables_removes_and_reloads(unit_dir: Path, systemd: FakeSystemd) -> None:
    cmd_service(parse("install"), GatewayConfig())
    assert cmd_service(parse("uninstall"), GatewayConfig()) == 0
    assert not (unit_dir / UNIT_NAME).exists()
    assert systemd.calls()[2:] == [
        f"systemctl --user disable --now {UNIT_NAME}",
        "systemctl --user daemon-reload",
    ]


def test_uninstall_without_a_unit_is_fine(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cmd_service(parse("uninstall", "--system"), GatewayConfig()) == 0
    assert "not installed" in capsys.readouterr().out
    assert systemd.calls() == []


@pytest.mark.parametrize("verb", ["start", "stop", "restart", "status"])
def test_control_verbs_pass_argv_and_exit_code_through(
    unit_dir: Path, systemd: FakeSystemd, verb: str
) -> None:
    systemd.exit_with(3)
    assert cmd_service(parse(verb), GatewayConfig()) == 3
    assert cmd_service(parse(verb, "--system"), GatewayConfig()) == 3
    assert systemd.calls() == [
        f"systemctl --user {verb} {UNIT_NAME}",
        f"systemctl {verb} {UNIT_NAME}",
    ]


def test_logs_builds_the_journalctl_argv(unit_dir: Path, systemd: FakeSystemd) -> None:
    assert cmd_service(parse("logs", "-f", "-n", "5"), GatewayConfig()) == 0
    assert cmd_service(parse("logs", "--system"), GatewayConfig()) == 0
    assert systemd.calls() == [
        f"journalctl --user-unit {UNIT_NAME} -n 5 -f",
        f"journalctl -u {UNIT_NAME} -n 100",
    ]


def test_logs_without_a_journal_is_exit_1_saying_so(
    unit_dir: Path,
    systemd: FakeSystemd,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # What journalctl does in a container: exit 0, a line on stderr, "no entries" on stdout.
    monkeypatch.setenv("FAKE_STDOUT", "-- No entries --")
    systemd.exit_with(0, "No journal files were found.")
    assert cmd_service(parse("logs"), GatewayConfig()) == 1
    err = capsys.readouterr().err
    assert "No journal files were found." in err
    assert "no journal to read here" in err


def test_logs_with_no_line_of_the_unit_is_exit_1(
    unit_dir: Path,
    systemd: FakeSystemd,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FAKE_STDOUT", "-- No entries --")
    assert cmd_service(parse("logs"), GatewayConfig()) == 1
    out = capsys.readouterr()
    assert "-- No entries --" in out.out
    assert f"no journal lines of {UNIT_NAME}" in out.err


def test_logs_passes_the_journal_through(
    unit_dir: Path,
    systemd: FakeSystemd,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("FAKE_STDOUT", "Nov 27 gateway_ready")
    assert cmd_service(parse("logs"), GatewayConfig()) == 0
    assert "Nov 27 gateway_ready" in capsys.readouterr().out


def test_missing_systemctl_is_exit_1_with_a_message(
    tmp_path: Path,
    unit_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HERMES_SYSTEMCTL", str(tmp_path / "no-such-systemctl"))
    assert cmd_service(parse("start"), GatewayConfig()) == 1
    assert "systemctl not found: this command needs systemd" in capsys.readouterr().err


def test_install_says_how_tokens_reach_the_service(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cmd_service(parse("install"), GatewayConfig()) == 0
    env_file = unit_dir.parent / "home" / ".env"
    assert f"EnvironmentFile=-{env_file}" in (unit_dir / UNIT_NAME).read_text().splitlines()
    out = capsys.readouterr().out
    assert f"TELEGRAM_BOT_TOKEN=...) in {env_file} (chmod 600)" in out
    assert "${NAME}" in out


def test_unit_loads_the_env_file_of_the_resolved_home(tmp_path: Path) -> None:
    # --home given relative to the working directory, before the subcommand; the
    # package is imported from this checkout, whatever the working directory.
    checkout = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HERMES_HOME": str(tmp_path / "ignored"), "PYTHONPATH": path}
    env.pop("HERMES_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--home", "state", "service", "install", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"EnvironmentFile=-{tmp_path / 'state' / '.env'}" in lines
    assert f"Environment=HERMES_HOME={tmp_path / 'state'}" in lines


@pytest.mark.parametrize(
    ("system", "advice"),
    [(False, "loginctl enable-linger $USER"), (True, "another supervisor")],
    ids=["user", "system"],
)
def test_no_service_manager_is_one_line_of_advice(
    unit_dir: Path,
    systemd: FakeSystemd,
    capsys: pytest.CaptureFixture[str],
    system: bool,
    advice: str,
) -> None:
    systemd.exit_with(1, "Failed to connect to bus: No medium found")
    argv = ["install", "--system"] if system else ["install"]
    assert cmd_service(parse(*argv), GatewayConfig()) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert advice in line
    assert "Failed to connect to bus" not in line


def test_other_systemctl_errors_pass_through(
    unit_dir: Path, systemd: FakeSystemd, capsys: pytest.CaptureFixture[str]
) -> None:
    systemd.exit_with(5, "Unit hermes-gateway.service not loaded.")
    assert cmd_service(parse("start"), GatewayConfig()) == 5
    assert capsys.readouterr().err == "Unit hermes-gateway.service not loaded.\n"


def test_install_with_the_real_systemctl_and_no_user_bus(tmp_path: Path) -> None:
    systemctl = shutil.which("systemctl")
    if systemctl is None:
        pytest.skip("systemctl is not installed")
    runtime = tmp_path / "runtime"  # an empty runtime dir: no user bus in it
    runtime.mkdir(mode=0o700)
    env = {
        **os.environ,
        "HERMES_HOME": str(tmp_path / "home"),
        "HERMES_SYSTEMD_UNIT_DIR": str(tmp_path / "units"),
        "XDG_RUNTIME_DIR": str(runtime),
    }
    for name in ("DBUS_SESSION_BUS_ADDRESS", "HERMES_SYSTEMCTL", "HERMES_CONFIG"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "service", "install"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert result.returncode != 0
    [line] = result.stderr.splitlines()
    assert "loginctl enable-linger $USER" in line and "--system" in line


# --- doctor and the secrets file --------------------------------------------------------


def doctor(home: Path, *args: str) -> dict[str, dict[str, object]]:
    env = {**os.environ, "HERMES_HOME": str(home)}
    env.pop("HERMES_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    return {finding["name"]: finding for finding in json.loads(result.stdout)}


def test_doctor_flags_a_readable_env_file_with_the_chmod_to_run(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("TELEGRAM_BOT_TOKEN=123:secret\n")
    env_file.chmod(0o644)
    finding = doctor(tmp_path)["secrets file"]
    assert finding["status"] == "warn"
    assert f"chmod 600 {env_file}" in str(finding["detail"])
    assert "secret" not in str(finding["detail"]).replace("secrets", "")  # never the value

    repaired = doctor(tmp_path, "--repair")["secrets file"]
    assert repaired["status"] == "ok"
    assert env_file.stat().st_mode & 0o777 == 0o600


def test_doctor_accepts_a_private_or_absent_env_file(tmp_path: Path) -> None:
    assert doctor(tmp_path)["secrets file"]["status"] == "ok"
    env_file = tmp_path / ".env"
    env_file.write_text("X=1\n")
    env_file.chmod(0o600)
    assert doctor(tmp_path)["secrets file"]["status"] == "ok"


# --- sd_notify --------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        yield sock


def test_notifier_sends_exact_datagrams(notify_socket: socket.socket) -> None:
    notifier = SystemdNotifier()
    assert notifier.ready(status="serving 2 adapters")
    assert notifier.watchdog()
    assert notifier.stopping()
    assert notifier.status("draining")
    assert [notify_socket.recv(4096) for _ in range(4)] == [
        b"READY=1\nSTATUS=serving 2 adapters",
        b"WATCHDOG=1",
        b"STOPPING=1",
        b"STATUS=draining",
    ]


def test_notifier_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"hermes-test-{os.getpid()}-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert SystemdNotifier().ready()
        assert sock.recv(4096) == b"READY=1"


def test_without_notify_socket_every_method_is_a_no_op(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET")
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    notifier = SystemdNotifier()
    assert not notifier.enabled
    assert [notifier.ready(), notifier.watchdog(), notifier.stopping()] == [False] * 3
    assert notifier.status("x") is False
    assert notifier.watchdog_interval() is None
    notify_socket.setblocking(False)
    with pytest.raises(BlockingIOError):
        notify_socket.recv(4096)


def test_a_vanished_socket_is_reported_as_false_not_raised(
    notify_socket: socket.socket, tmp_path: Path
) -> None:
    notifier = SystemdNotifier()
    (tmp_path / "notify.sock").unlink()
    assert notifier.ready() is False


def test_watchdog_interval_is_half_of_watchdog_usec(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    assert SystemdNotifier().watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert SystemdNotifier().watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert SystemdNotifier().watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    monkeypatch.delenv("WATCHDOG_USEC")
    assert SystemdNotifier().watchdog_interval() is None


async def test_run_watchdog_pings_until_cancelled(notify_socket: socket.socket) -> None:
    task = asyncio.create_task(run_watchdog(SystemdNotifier(), 0.01))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    notify_socket.setblocking(False)
    received = []
    while True:
        try:
            received.append(notify_socket.recv(4096))
        except BlockingIOError:
            break
    assert len(received) >= 3
    assert set(received) == {b"WATCHDOG=1"}
    await asyncio.sleep(0.05)
    with pytest.raises(BlockingIOError):
        notify_socket.recv(4096)
