"""The systemd unit: render it from the config, install it, and drive it (`service ...`).

A user unit by default (``~/.config/systemd/user``, honouring ``$XDG_CONFIG_HOME``),
a system unit with ``--system`` (``/etc/systemd/system``, runs as ``User=``).

Test and packaging hooks (environment variables):
  HERMES_SYSTEMD_UNIT_DIR  directory the unit file is written to, for either kind
  HERMES_SYSTEMCTL         program run instead of ``systemctl``
  HERMES_JOURNALCTL        program run instead of ``journalctl``

Exit codes: those of systemctl/journalctl when they ran; 1 when they are missing, or
`logs` found no journal or no line of the unit; 2 on a usage error.
"""

from __future__ import annotations

import argparse
import getpass
import os
import shutil
import subprocess
import sys
from pathlib import Path

from config import EXIT_CONFIG, GatewayConfig, hermes_home
from config.envfile import ENV_FILE
from gateway.ops.cliargs import EXIT_USAGE
from gateway.util.fsutil import atomic_write_bytes

UNIT_NAME = "hermes-gateway.service"
# Secrets for the service, as NAME=value lines in the home (mode 0600, checked by
# `doctor`); hermes.yaml refers to them as ${NAME}. Every command reads the same file
# (config.envfile), the unit names it as its EnvironmentFile.
WATCHDOG_SEC = 60
# Time for the drain on SIGTERM plus the runner's own shutdown.
STOP_MARGIN_SEC = 30


# --- the unit ---------------------------------------------------------------------------


def render_unit(
    config: GatewayConfig,
    *,
    home: Path,
    system: bool,
    user: str | None,
    python: str = sys.executable,
    config_path: Path | None = None,
) -> str:
    """The unit file text. ``user`` is the ``User=`` of a system unit (default: the
    invoking user, see `default_user`) and is ignored for a user unit. ``python`` is
    made absolute but not resolved: a venv's interpreter symlink must stay the venv's.
    """
    home_dir = os.path.abspath(home)
    exec_start = [os.path.abspath(python), "-m", "gateway.cli", "run", "--home", home_dir]
    if config_path is not None:
        exec_start += ["--config", os.path.abspath(config_path)]
    stop_timeout = int(config.agent.restart_drain_timeout) + STOP_MARGIN_SEC
    service = [
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(_quote(arg.replace("$", "$$")) for arg in exec_start),
        "Environment=" + _quote(f"HERMES_HOME={home_dir}"),
        # The leading "-": a missing file is fine. systemd takes the rest as one path (no
        # quoting, spaces allowed) and expands only % specifiers in it.
        "EnvironmentFile=-" + os.path.join(home_dir, ENV_FILE).replace("%", "%%"),
        "Environment=PYTHONUNBUFFERED=1",
        # Restarts after any exit, the clean 0 and the restart-requested 75 included,
        # but not after a configuration error: that needs a person.
        "Restart=always",
        "RestartSec=2",
        f"RestartPreventExitStatus={EXIT_CONFIG}",
        f"TimeoutStopSec={stop_timeout}",
        f"WatchdogSec={WATCHDOG_SEC}",
        "KillSignal=SIGTERM",
        "KillMode=mixed",
    ]
    if system:
        service.append("User=" + _quote(user or default_user()))
    service += ["UMask=0077", "NoNewPrivileges=yes"]
    sections = {
        "Unit": [
            "Description=hermes-gateway (LLM chat gateway)",
            "Documentation=https://github.com/hermes-gateway/hermes-gateway",
            "After=network-online.target",
            "Wants=network-online.target",
        ],
        "Service": service,
        "Install": ["WantedBy=" + ("multi-user.target" if system else "default.target")],
    }
    return "\n".join(
        f"[{name}]\n" + "".join(line + "\n" for line in lines) for name, lines in sections.items()
    )


def _quote(word: str) -> str:
    """One word for a unit file: ``%`` specifiers escaped, double-quoted (with C escapes)
    when it holds whitespace, quotes or backslashes."""
    word = word.replace("%", "%%")
    if word and not any(c.isspace() or c in "\"'\\" for c in word):
        return word
    escaped = word.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def default_user() -> str:
    """Who a system unit runs as: the user behind sudo, else whoever runs this."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def unit_path(system: bool) -> Path:
    override = os.environ.get("HERMES_SYSTEMD_UNIT_DIR")
    if override:
        return Path(override) / UNIT_NAME
    if system:
        return Path("/etc/systemd/system") / UNIT_NAME
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "systemd" / "user" / UNIT_NAME


# --- running systemctl / journalctl -----------------------------------------------------


# What systemctl says when there is no service manager to talk to: no user manager (never
# logged in, or only through su/sudo) for --user, or no systemd as init for the system.
NO_BUS = "Failed to connect to bus"


def _run_tool(
    name: str,
    env_var: str,
    argv: list[str],
    *,
    stderr: int | None = None,
    stdout: int | None = None,
) -> subprocess.CompletedProcess[str] | None:
    """Run the tool; None (after saying why) when it cannot be run."""
    program = os.environ.get(env_var) or shutil.which(name)
    if program is None:
        print(f"{name} not found: this command needs systemd", file=sys.stderr)
        return None
    try:
        return subprocess.run(
            [program, *argv],
            check=False,
            stdout=stdout,
            stderr=stderr,
            text=True,
            errors="replace",  # a log line is shown, not judged
        )
    except FileNotFoundError:
        print(f"{name} not found: this command needs systemd ({program})", file=sys.stderr)
    except OSError as exc:
        print(f"cannot run {name} ({program}): {exc}", file=sys.stderr)
    return None


def no_bus_hint(user: bool) -> str:
    """One line on what to do when systemctl cannot reach the service manager."""
    if user:
        return (
            "systemctl --user cannot reach your user's service manager (no user bus): run "
            "`loginctl enable-linger $USER`, log in again (ssh or console, not su/sudo) "
            "and retry, or use a system unit with --system (as root)"
        )
    return (
        "systemctl cannot reach systemd (no system bus: systemd is not running as init "
        "here); run `hermes-gateway run` under another supervisor"
    )


def run_systemctl(argv: list[str]) -> int:
    """``systemctl ARGV...``; its exit code, or 1 when it cannot be run.

    Its errors pass through, except the D-Bus one for a missing service manager, which
    becomes one line saying what to do."""
    result = _run_tool("systemctl", "HERMES_SYSTEMCTL", argv, stderr=subprocess.PIPE)
    if result is None:
        return 1
    if result.returncode != 0 and NO_BUS in result.stderr:
        print(no_bus_hint(user="--user" in argv), file=sys.stderr)
    else:
        sys.stderr.write(result.stderr)
    return result.returncode


# journalctl exits 0 when it has nothing to show, saying so in these words.
NO_JOURNAL = "No journal files were found"
NO_ENTRIES = "-- No entries --"


def run_journalctl(argv: list[str], *, follow: bool = False) -> int:
    """``journalctl ARGV...``; its exit code, 1 when it cannot be run, and 1 when it
    found no journal or no line of the unit (it exits 0 then), with a line saying why.
    Its output passes through (while following, as it comes)."""
    result = _run_tool(
        "journalctl",
        "HERMES_JOURNALCTL",
        argv,
        stderr=subprocess.PIPE,
        stdout=None if follow else subprocess.PIPE,
    )
    if result is None:
        return 1
    if result.stdout:
        sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        return result.returncode
    if NO_JOURNAL in result.stderr:
        print(
            "no journal to read here (journald keeps none: a container, or no systemd);"
            " the gateway logs to its stderr, wherever its supervisor puts that",
            file=sys.stderr,
        )
        return 1
    if not follow and (result.stdout or "").strip() == NO_ENTRIES:
        print(f"no journal lines of {UNIT_NAME} (has it run?)", file=sys.stderr)
        return 1
    return 0


def _scope(system: bool) -> list[str]:
    return [] if system else ["--user"]


# --- commands ---------------------------------------------------------------------------


def _config_path_for_unit(config: GatewayConfig, home: Path) -> Path | None:
    """The config file to name in ExecStart: none when it is (or would be) the default."""
    source = config.source_path
    if source is None or os.path.abspath(source) == os.path.abspath(home / "hermes.yaml"):
        return None
    return Path(os.path.abspath(source))


def _install(args: argparse.Namespace, config: GatewayConfig) -> int:
    if args.run_as is not None and not args.system:
        print("--user applies to a system unit only: add --system", file=sys.stderr)
        return EXIT_USAGE
    home = Path(os.path.abspath(hermes_home()))
    text = render_unit(
        config,
        home=home,
        system=args.system,
        user=args.run_as,
        config_path=_config_path_for_unit(config, home),
    )
    if args.dry_run:
        print(text, end="")
        return 0

    path = unit_path(args.system)
    old = path.read_bytes() if path.exists() else None
    if old == text.encode():
        print(f"unit up to date: {path}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, text.encode(), mode=0o644)
        path.chmod(0o644)  # the umask may have narrowed it; systemd must read it
        print(f"unit {'written' if old is None else 'updated'}: {path}")
        if rc := run_systemctl([*_scope(args.system), "daemon-reload"]):
            return rc
    if rc := run_systemctl([*_scope(args.system), "enable", UNIT_NAME]):
        return rc
    scope = " --system" if args.system else ""
    print(
        f"secrets: put NAME=value lines (e.g. TELEGRAM_BOT_TOKEN=...) in {home / ENV_FILE}"
        f" (chmod 600), and use them in hermes.yaml as ${{NAME}}; the unit loads that file"
    )
    print(f"start it with: hermes-gateway service start{scope}")
    if not args.system:
        print("to keep it running after you log out: loginctl enable-linger $USER")
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    path = unit_path(args.system)
    if not path.exists():
        print(f"not installed: no unit at {path}")
        return 0
    # Fails when the unit was never loaded; removing the file is what matters.
    run_systemctl([*_scope(args.system), "disable", "--now", UNIT_NAME])
    path.unlink()
    print(f"unit removed: {path}")
    return run_systemctl([*_scope(args.system), "daemon-reload"])


def _logs(args: argparse.Namespace) -> int:
    # `--user-unit` finds a user unit's lines whether or not journald keeps per-user
    # journals, which `journalctl --user` would depend on.
    argv = ["-u", UNIT_NAME] if args.system else ["--user-unit", UNIT_NAME]
    argv += ["-n", str(args.lines)]
    if args.follow:
        argv.append("-f")
    return run_journalctl(argv, follow=args.follow)


def cmd_service(args: argparse.Namespace, config: GatewayConfig) -> int:
    action = args.service_command
    if action == "install":
        return _install(args, config)
    if action == "uninstall":
        return _uninstall(args)
    if action == "logs":
        return _logs(args)
    # start | stop | restart | status: systemctl's exit code is the answer (status: 3 = inactive)
    return run_systemctl([*_scope(args.system), action, UNIT_NAME])


def add_service_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: list[argparse.ArgumentParser],
) -> None:
    """Add ``service`` and its actions; ``parents`` carry the common options."""
    scope = argparse.ArgumentParser(add_help=False)
    scope.add_argument(
        "--system", action="store_true", help="the system unit (default: your user unit)"
    )
    both = [*parents, scope]

    service = subparsers.add_parser(
        "service", parents=parents, help="install and control the systemd unit"
    )
    actions = service.add_subparsers(dest="service_command", required=True, metavar="ACTION")
    install = actions.add_parser("install", parents=both, help="write and enable the unit")
    install.add_argument(
        "--user",
        dest="run_as",
        metavar="NAME",
        help="user a system unit runs as (default: $SUDO_USER or you)",
    )
    install.add_argument("--dry-run", action="store_true", help="print the unit, change nothing")
    actions.add_parser("uninstall", parents=both, help="disable, stop and remove the unit")
    for verb in ("start", "stop", "restart", "status"):
        actions.add_parser(verb, parents=both, help=f"systemctl {verb}")
    logs = actions.add_parser("logs", parents=both, help="the unit's journal")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--lines", type=int, default=100, help="lines to show (default 100)")
    service.set_defaults(handler=cmd_service)
