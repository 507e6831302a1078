"""`hermes-gateway`: the command line and the composition root (config -> store -> daemon).

Exit codes: 0 ok, 1 lookup failure or refusal, 2 usage (argparse's, and ours for the
checks it cannot make), 70 internal error (a bug), 75 restart requested, 78 configuration
error, a damaged state database, or (`run`) a home already in use by another daemon or
unusable: nothing a restart would fix, so the service unit's `RestartPreventExitStatus=78`
stops systemd from retrying (`Restart=always` would otherwise start a loser every
`RestartSec`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import re
import signal
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import structlog

from adapters.base import PlatformAdapter
from config import EXIT_CONFIG, ConfigError, GatewayConfig, hermes_home, load_config
from config.envfile import EnvFileError, load_env_file
from gateway.agents.roster import Roster
from gateway.console.auth import check_config_line
from gateway.domain.agent_tasks import AgentTasks
from gateway.memory.embeddings import local_model_problem
from gateway.ops.agents import add_agents_parser, cmd_agents
from gateway.ops.doctor import add_doctor_parser
from gateway.ops.logs import LOG_LEVELS, configure_run_logging
from gateway.ops.memory import add_memory_parser, run_memory_command
from gateway.ops.schedules import add_schedules_parser, run_schedules_command
from gateway.ops.sdnotify import SystemdNotifier, run_watchdog
from gateway.ops.service import add_service_parser
from gateway.ops.sessions import (
    LISTING_PAGE,
    MAX_LISTING_PAGE,
    add_sessions_subcommands,
    agent_id,
    listing_after,
    listing_limit,
    run_sessions_command,
    sessions_list,
)
from gateway.ops.status import add_status_parser
from gateway.ops.storage import add_storage_parser
from gateway.ops.usage import add_usage_parser, run_usage_command
from gateway.runner.pairing import add_pairing_parser
from gateway.store.db import DatabaseError, DatabaseUnreachable
from gateway.store.entries import load_session_row
from gateway.store.homelock import HomeInUse, HomeLock, HomeUnusable
from gateway.store.session_store import SessionStore
from gateway.store.transcript import count_undone

EXIT_RESTART = 75  # EX_TEMPFAIL: drained for a restart; the service manager starts us again
EXIT_SOFTWARE = 70  # EX_SOFTWARE: an internal error (a bug), reported with its traceback
LINGER_SECONDS = 2.0  # how long worker threads get to end after the command is over
SESSION_ID_RE = re.compile(r"^\d{8}_\d{6}_[0-9a-f]{8}$")


def sessions_dir(home: Path) -> Path:
    return home / "sessions"


def _where(config: GatewayConfig) -> str:
    """The config file as a prefix for an error found after loading it."""
    return f"{config.source_path}: " if config.source_path is not None else ""


# --- commands ---------------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace, config: GatewayConfig) -> int:
    check_runnable(config)
    console = check_config_line(config)
    if console is not None:
        print(console)
    where = config.source_path or "(no file: zero-config defaults)"
    print(f"config ok: {where}")
    return 0


def build_adapters(config: GatewayConfig) -> list[PlatformAdapter]:
    """The adapters the config enables; the HTTP API when no other platform is enabled.

    A platform enabled without the settings it needs raises ConfigError (exit 78)."""
    from adapters.http import HttpAdapter

    adapters: list[PlatformAdapter] = []
    platforms = config.platforms
    try:
        if platforms.telegram.enabled:
            from adapters.telegram import TelegramAdapter

            adapters.append(TelegramAdapter(platforms.telegram))
        if platforms.discord.enabled:
            from adapters.discord import DiscordAdapter

            adapters.append(DiscordAdapter(platforms.discord))
        if platforms.slack.enabled:
            from adapters.slack import SlackAdapter

            adapters.append(SlackAdapter(platforms.slack))
        if platforms.matrix.enabled:
            from adapters.matrix import MatrixAdapter

            adapters.append(MatrixAdapter(platforms.matrix))
        if platforms.email.enabled:
            from adapters.mail import EmailAdapter

            adapters.append(EmailAdapter(platforms.email))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    http = config.platforms.http
    if http.enabled or not config.connected_platforms():
        adapters.append(HttpAdapter(http))
    return adapters


def check_runnable(config: GatewayConfig) -> list[PlatformAdapter]:
    """What `run` checks beyond the schema, touching nothing on disk: every agent's
    backend resolves (`agent.backend`, `agents.ID.backend`), and every enabled platform
    has the settings it needs. Returns the adapters. (Agent ids and routes are checked
    by the schema: `routes.N.agent` naming no agent never gets this far.)

    `check-config` calls this too, so the two commands accept and refuse the same
    configs. Raises ConfigError (exit 78) naming the key."""
    roster = Roster(config)
    problem = local_model_problem(config)  # memory.embedding: local's library and model
    if problem is not None:
        raise ConfigError(problem)
    problem = window_problem(config, roster)
    if problem is not None:
        raise ConfigError(problem)
    return build_adapters(config)


def mount_apis(config: GatewayConfig, tasks: AgentTasks, adapters: list[PlatformAdapter]) -> None:
    """Serve the agents on the HTTP API's port over A2A (`a2a.enabled`, docs/a2a.md) and
    OpenAI's chat API (`config.serves_openai()`); A2A's SDK loads only while A2A is on."""
    from adapters.http import HttpAdapter
    from gateway.openai_compat.server import OpenAiServer

    servers: list[Any] = [OpenAiServer(config, tasks)] if config.serves_openai() else []
    if config.a2a.enabled:  # the schema requires the HTTP API
        from gateway.a2a.server import A2aServer

        servers.append(A2aServer(config, tasks))
    for server in servers:
        http = next(a for a in adapters if isinstance(a, HttpAdapter))
        http.mount(
            server.routes(),
            server.public_paths(),
            on_shutdown=server.close,
            docs=server.route_docs(),
        )


def mount_console(config: GatewayConfig, runner: Any, adapters: list[PlatformAdapter]) -> None:
    """Serve the operator's console at /console/ (`platforms.http.console`, docs/console.md)."""
    from adapters.http import HttpAdapter
    from gateway.console.server import ConsoleServer
    from gateway.runner.console_desk import ConsoleDesk

    http = next((a for a in adapters if isinstance(a, HttpAdapter)), None)
    if http is not None and config.platforms.http.console:
        server = ConsoleServer(config, ConsoleDesk(runner))
        http.mount(
            server.routes(),
            server.public_paths(),
            on_shutdown=server.close,
            docs=server.route_docs(),
        )


# Estimated tokens a turn needs besides the tools and a configured prompt: the default
# prompt's two lines, the session-context block and a short message.
MESSAGE_ROOM = 256


def window_problem(config: GatewayConfig, roster: Roster) -> str | None:
    """An agent whose tool specs and configured system prompt leave no `MESSAGE_ROOM` in
    its context window (less the reply's reserve) could answer nothing: every message
    would be refused as too large. Counted as a session's first turn counts them (the estimate
    with its margin, `UNCALIBRATED_FACTOR`): a first turn refused never reaches the model,
    so no count of the model's could ever bring the estimate down."""
    from gateway.context.tokens import UNCALIBRATED_FACTOR, text_tokens
    from gateway.tools import BUILTIN_TOOLS
    from gateway.tools.registry import Toolbox

    for spec in roster.every_model():
        agent = spec.config
        if agent.backend == "echo" or not agent.builtin_tools:
            continue  # the echo agent calls no model and carries no tools
        tools = Toolbox(BUILTIN_TOOLS, agent.builtin_tools).spec_tokens
        fixed = int((tools + text_tokens(agent.system_prompt or "")) * UNCALIBRATED_FACTOR)
        if fixed + MESSAGE_ROOM > spec.plan.budget:
            where = f"agents.{spec.agent_id}" if spec.agent_id in config.agents else "agent"
            window = f"{where}.context.window_tokens"
            name = spec.model.name
            if name is not None and config.models[name].context_window is not None:
                window = f"models.{name}.context_window"  # the chosen model's own window
            return (
                f"{window}: {agent.context.window_tokens} leaves no"
                f" room for a message (about {MESSAGE_ROOM} tokens with the session's"
                f" context): the {len(agent.builtin_tools)} tools' specs"
                + (" and the system prompt" if agent.system_prompt else "")
                + f" alone take about {fixed:,} of its {spec.plan.budget:,} tokens (estimated"
                " with a margin until the model reports its count; the rest is the reply's"
                " reserve); raise it to the model's context size, or list fewer in"
                f" {where}.tools"
            )
    return None


async def serve(config: GatewayConfig, home: Path) -> int:
    """Run the gateway until a signal; returns the exit code (0 stop, 75 restart).

    SIGINT/SIGTERM drain and stop; SIGUSR1 (or an admin's /restart) drains and exits 75
    so the service manager starts a fresh process. systemd is told READY once the
    adapters are up and recovery ran, pinged from the event loop for its watchdog, and
    told STOPPING when the drain begins.
    """
    from gateway.run import GatewayRunner

    log = structlog.get_logger("gateway")
    notifier = SystemdNotifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        runner = GatewayRunner(config, home=home)  # resolves agent.backend
        # At 100,000 sessions start-up was the store's integrity check (0.2 s) after
        # importing the platform libraries (0.5 s, in build_adapters). The check runs inside
        # SQLite with the GIL released, so it overlaps the imports; a config error leaves
        # the home as it was.
        runner.store.check_soon()
        adapters = check_runnable(config)
        runner.add_adapters(adapters)
        mount_apis(config, runner.agent_tasks, adapters)
        mount_console(config, runner, adapters)
    except ConfigError as exc:
        log.error("configuration_error", error=f"{_where(config)}{exc}")
        return EXIT_CONFIG
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, runner.request_restart)
    loop.add_signal_handler(signal.SIGUSR2, runner.send_pending_soon)  # pairing approve
    try:
        await runner.start()
    except OSError as exc:  # e.g. the HTTP port is taken, a platform unreachable
        log.error("gateway_start_failed", error=str(exc))
        await runner.stop()
        return 1
    except DatabaseUnreachable as exc:  # PostgreSQL did not answer: try again later
        log.error("state_database_unreachable", error=str(exc))
        await runner.stop()
        return EXIT_RESTART  # not 78: the service manager starts it again
    except (ValueError, RuntimeError) as exc:  # a platform refused its settings (token ...)
        log.error("configuration_error", error=str(exc))
        await runner.stop()
        return EXIT_CONFIG
    except DatabaseError as exc:
        log.error("state_database_unusable", error=str(exc))
        await runner.stop()
        raise
    except sqlite3.Error as exc:  # an index beside state.db (memory.db, search.db)
        log.error("gateway_start_failed", error=f"{type(exc).__name__}: {exc}")
        await runner.stop()
        # Busy, full, unreadable may pass; anything else a restart would only repeat.
        return 1 if isinstance(exc, sqlite3.OperationalError) else EXIT_CONFIG
    except BaseException:
        # Whatever else failed, the runner's threads (aiosqlite's worker is not a daemon
        # thread) must end with it, or the process outlives its fatal error.
        await runner.stop()
        raise
    notifier.ready(status="serving")
    interval = notifier.watchdog_interval()
    watchdog = asyncio.create_task(run_watchdog(notifier, interval)) if interval else None
    restart = asyncio.create_task(runner.restart_requested.wait())
    stopped = asyncio.create_task(stop.wait())
    try:
        log.info("gateway_ready", home=str(home), health=runner.health())
        await asyncio.wait({restart, stopped}, return_when=asyncio.FIRST_COMPLETED)
        restarting = runner.restart_requested.is_set()
        log.info("gateway_stopping", restart=restarting)
        notifier.stopping()
    finally:
        for task in (watchdog, restart, stopped):
            if task is not None:
                task.cancel()
        await runner.stop(restart=runner.restart_requested.is_set())
    return EXIT_RESTART if restarting else 0


def cmd_run(args: argparse.Namespace, config: GatewayConfig) -> int:
    configure_run_logging(config.logging, args.log_level, args.log_json)
    home = hermes_home()
    try:  # before anything reads or writes state: one daemon per home
        lock = HomeLock.acquire(home)
    except HomeInUse as exc:
        structlog.get_logger("gateway").error("home_in_use", error=str(exc), pid=exc.pid)
        return EXIT_CONFIG
    except HomeUnusable as exc:
        structlog.get_logger("gateway").error("home_unusable", error=str(exc))
        return EXIT_CONFIG
    with lock:
        return asyncio.run(serve(config, home))


async def _sessions_show(store: SessionStore, args: argparse.Namespace) -> int:
    target = args.key_or_id
    entry = await store.lookup_by_session_id(target) if SESSION_ID_RE.match(target) else None
    if entry is None:
        entry = await store.get_entry(target)
    session_id = entry.session_id if entry else target
    # Every incarnation has its `sessions` row, also one no key points at any more and
    # one whose messages were all undone (kept, inactive): its transcript may be empty.
    session, undone = await store.read(
        lambda conn: (
            load_session_row(conn, session_id),
            count_undone(conn, session_id),
        )
    )
    if entry is None and session is None:
        print(f"no session with key or id {target!r}", file=sys.stderr)
        return 1
    messages = await store.load_transcript(session_id)
    if args.json:
        shown = {
            "entry": entry.to_dict() if entry else None,
            "session": session,
            "transcript": messages,
            "undone_messages": undone,
        }
        print(json.dumps(shown, indent=2))
        return 0
    if entry is not None:
        for name, value in entry.to_dict().items():
            if name != "origin":
                print(f"{name:24} {value}")
        if entry.origin is not None:
            print(f"{'origin':24} {entry.origin.description} ({entry.origin.platform.value})")
    elif session is not None:
        print(f"session {session_id} (no longer the current session of its key)")
        for name, value in session.items():
            print(f"{name:24} {value}")
    undone_note = f"; {undone} undone with /undo or /retry" if undone else ""
    print(f"\ntranscript ({len(messages)} messages{undone_note}):")
    for message in messages:
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        print(f"  [{message.get('role')}] {text}")
    return 0


def _on_store(config: GatewayConfig, command: Callable[[SessionStore], Awaitable[int]]) -> int:
    async def run() -> int:
        async with SessionStore(sessions_dir(hermes_home()), config) as store:
            return await command(store)

    return asyncio.run(run())


def cmd_sessions(args: argparse.Namespace, config: GatewayConfig) -> int:
    handler = {"list": sessions_list, "show": _sessions_show}.get(
        args.sessions_command, run_sessions_command
    )
    return _on_store(config, lambda store: handler(store, args))


def cmd_memory(args: argparse.Namespace, config: GatewayConfig) -> int:
    return _on_store(config, lambda store: run_memory_command(store, config, args))


def cmd_schedules(args: argparse.Namespace, config: GatewayConfig) -> int:
    return _on_store(config, lambda store: run_schedules_command(store, config, args))


def cmd_usage(args: argparse.Namespace, config: GatewayConfig) -> int:
    return _on_store(config, lambda store: run_usage_command(store, config, args))


# --- parser -----------------------------------------------------------------------------

# The commands that connect to the platforms: every ${NAME} in the config must be set.
# The others (status, sessions, doctor, ...) need only the store's settings.
NEEDS_SECRETS = {cmd_run, cmd_check_config}


def cmd_chat(args: argparse.Namespace, config: GatewayConfig) -> int:
    from gateway.ops.chat import main_chat

    if args.url is None:
        http = config.platforms.http
        args.url = f"http://{http.host}:{http.port}"
    if args.token is None:
        args.token = os.environ.get("HERMES_HTTP_TOKEN") or config.platforms.http.token
    unset = config.unset_env.get("platforms.http.token")
    if args.token is None and unset is not None:
        raise ConfigError(
            f"platforms.http.token: environment variable {unset} is not set"
            " (set it, or pass --token or $HERMES_HTTP_TOKEN)"
        )
    return main_chat(args)


def _global_options(default: Any) -> argparse.ArgumentParser:
    """``--home`` and ``--config``, as a parent parser.

    They are accepted before the subcommand and after it (and after a sub-subcommand).
    The top-level copy defaults to None; every subcommand's copy defaults to SUPPRESS,
    because argparse copies all of a subparser's values over the top-level ones: a None
    default there would erase ``--home H`` given before the subcommand. Given in both
    places, the later one wins.
    """
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--home",
        type=Path,
        default=default,
        help="state directory (default $HERMES_HOME or ~/.hermes)",
    )
    options.add_argument(
        "--config",
        type=Path,
        default=default,
        help="config file (default $HERMES_CONFIG or HOME/hermes.yaml)",
    )
    return options


def _version() -> str:
    try:
        return metadata.version("hermes-gateway")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    common = _global_options(default=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(
        prog="hermes-gateway",
        description="Durable chat gateway for an LLM agent.",
        parents=[_global_options(default=None)],
    )
    parser.add_argument("--version", action="version", version=f"hermes-gateway {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", parents=[common], help="run the daemon in the foreground")
    run.add_argument("--log-json", action="store_true", default=None, help="JSON log lines")
    run.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, help="overrides logging.level"
    )
    run.set_defaults(handler=cmd_run)

    chat = sub.add_parser("chat", parents=[common], help="talk to the running daemon")
    user = getpass.getuser()
    chat.add_argument("--url", default=None, help="gateway HTTP API (default from the config)")
    chat.add_argument("--chat-id", default=f"local-{user}", help="chat id to talk in")
    chat.add_argument("--user-id", default=user, help="your user id")
    chat.add_argument("--token", default=None, help="bearer token (default $HERMES_HTTP_TOKEN)")
    chat.set_defaults(handler=cmd_chat)

    check = sub.add_parser("check-config", parents=[common], help="validate the config file")
    check.set_defaults(handler=cmd_check_config)

    sessions = sub.add_parser("sessions", parents=[common], help="inspect stored sessions")
    sessions_sub = sessions.add_subparsers(dest="sessions_command", required=True)
    listing = sessions_sub.add_parser("list", parents=[common], help="list session entries")
    listing.add_argument("--active-minutes", type=float, default=None)
    listing.add_argument("--agent", type=agent_id, default=None, help="only this agent's")
    listing.add_argument(
        "--limit",
        type=listing_limit,
        default=LISTING_PAGE,
        help=f"at most N entries, in session-key order (1-{MAX_LISTING_PAGE}, {LISTING_PAGE})",
    )
    listing.add_argument(
        "--after",
        type=listing_after,
        default=None,
        metavar="CURSOR",
        help="the page after the one that printed this cursor",
    )
    listing.add_argument("--json", action="store_true")
    show = sessions_sub.add_parser("show", parents=[common], help="an entry and its transcript")
    show.add_argument("key_or_id", metavar="KEY_OR_ID")
    show.add_argument("--json", action="store_true")
    add_sessions_subcommands(sessions_sub, [common])
    sessions.set_defaults(handler=cmd_sessions)

    add_memory_parser(sub, [common])
    sub.choices["memory"].set_defaults(handler=cmd_memory)
    add_schedules_parser(sub, [common])
    sub.choices["schedules"].set_defaults(handler=cmd_schedules)
    add_usage_parser(sub, [common])
    sub.choices["usage"].set_defaults(handler=cmd_usage)
    add_agents_parser(sub, [common])
    sub.choices["agents"].set_defaults(handler=cmd_agents)
    add_doctor_parser(sub, [common])
    add_pairing_parser(sub, [common])
    add_status_parser(sub, [common])
    add_service_parser(sub, [common])
    add_storage_parser(sub, [common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: one command, then stdout flushed while a closed pipe can still
    be handled here (`doctor --json | head -1`): the reader has gone, so exit quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # As the Python docs advise: point stdout at devnull, so the interpreter's own
        # flush at exit does not fail again and print "Exception ignored".
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    except Exception:  # a bug: its traceback, and an exit all the same (below)
        traceback.print_exc()
        code = EXIT_SOFTWARE
    _exit_if_threads_linger(code)
    return code


def _exit_if_threads_linger(code: int) -> None:
    """The command is over: exit now even if a worker thread is still alive.

    The interpreter would wait for every non-daemon thread (aiosqlite's worker is one) at
    exit; one left behind by a failed start kept the daemon alive, under systemd a
    start-timeout loop instead of an exit code. They get a moment to finish first."""
    deadline = time.monotonic() + LINGER_SECONDS
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    left = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if left:
        print(f"exiting with threads still running: {', '.join(left)}", file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.home is not None:
        # One place decides where state lives; everything below reads HERMES_HOME.
        os.environ["HERMES_HOME"] = str(args.home.expanduser().resolve())
    try:
        # The secrets file the service unit names (EnvironmentFile): the commands typed
        # by hand see what `run` sees under systemd.
        load_env_file(hermes_home())
        config = load_config(args.config, require_env=args.handler in NEEDS_SECRETS)
    except (ConfigError, EnvFileError) as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return int(args.handler(args, config))
    except ConfigError as exc:  # found beyond the schema (check_runnable)
        print(f"configuration error: {_where(config)}{exc}", file=sys.stderr)
        return EXIT_CONFIG
    except DatabaseUnreachable as exc:
        print(f"state database unreachable: {exc}", file=sys.stderr)
        return EXIT_RESTART  # not 78: the service manager starts it again
    except DatabaseError as exc:
        print(f"state database error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
