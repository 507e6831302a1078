"""Logging setup: structlog, JSON lines for services, a readable console for people.

Records from the standard `logging` module (the platform libraries) go through the
same renderer, so a service's log is one JSON object per line whoever wrote it.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO, get_args

import structlog

from config import LoggingConfig
from config.schema import LogLevel
from gateway.domain.session import TokenUsage
from gateway.store import codec

LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)

# Chatty or risky at INFO: httpx logs every request URL, and Telegram's URLs carry the
# bot token. Their warnings and errors still come through.
QUIET_LIBRARIES = (
    "httpx",
    "httpcore",
    "telegram",
    "discord",
    "slack_sdk",
    "slack_bolt",
    "nio",
    "aioimaplib",
    "aiosmtplib",
    "aiohttp.access",
    "apscheduler",
)


class PassBufferedStream:
    """stderr, written once per event-loop pass instead of once per line.

    A busy gateway logs a `turn_done` line per turn; a `write` and `flush` per line cost a
    system call each (about a sixth of the line's cost). On the event loop's thread,
    lines are gathered and written together when the loop pass ends, in order; from any
    other thread (or with no loop running) a line is written at once, after what is
    gathered. A kill -9 loses at most the lines of the pass it interrupted; a normal
    exit writes them (atexit)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._pending: asyncio.Handle | None = None

    def write(self, text: str) -> int:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._lines.append(text)
            if loop is not None:
                if self._pending is None:
                    self._pending = loop.call_soon(self.drain)
                return len(text)
        self.drain()
        return len(text)

    def flush(self) -> None:
        """Called after every line by the loggers: the pass's end writes them instead."""

    def drain(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            self._pending = None
            if not lines:
                return
            try:
                self.stream.write("".join(lines))
                self.stream.flush()
            except (OSError, ValueError):
                pass  # stderr closed or gone (a daemon whose journal went away): nothing to do

    def isatty(self) -> bool:
        return self.stream.isatty()


_sink: PassBufferedStream | None = None
# (the processor chain, its sink) while `configure_logging` writes JSON at info or below:
# `TurnLine` then renders its line itself (see `TurnLine.log`).
_turn_lines: tuple[list[Any], Any, PassBufferedStream] | None = None


@atexit.register
def _drain_at_exit() -> None:
    if _sink is not None:
        _sink.drain()


def configure_run_logging(
    settings: LoggingConfig, level: str | None = None, log_json: bool | None = None
) -> None:
    """`run`'s logging: `--log-level` and `--log-json` win over the config's `logging:`."""
    form = "json" if log_json else settings.format
    configure_logging(
        json_output=None if form == "auto" else form == "json", level=level or settings.level
    )


def configure_logging(json_output: bool | None = None, level: str = "INFO") -> None:
    """JSON when stderr is not a TTY (systemd, pipes) or when asked; console otherwise.

    Our own events go straight from structlog to stderr, filtered by level before any
    work is done; records of the `logging` module (the platform libraries) go
    through a handler with the same renderer. The stdlib route costs a turn's log line
    several times more (two LogRecords, a stack walk for the caller)."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=codec.dumps)  # orjson: faster than json
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    numeric = logging.getLevelName(level.upper())
    global _sink
    if _sink is not None:
        _sink.drain()  # what the previous configuration gathered goes out first
    sink = _sink = PassBufferedStream(sys.stderr)
    processors = [*shared, structlog.processors.format_exc_info, renderer]
    global _turn_lines
    _turn_lines = (processors, renderer, sink) if json_output and numeric <= logging.INFO else None
    structlog.configure(
        processors=processors,
        logger_factory=structlog.WriteLoggerFactory(sink),  # type: ignore[arg-type]
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sink)  # the same sink: lines stay in order
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    # A library's own level wins over the root's: at `error`, their warnings stay out too.
    quiet = max(logging.WARNING, numeric)
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)


class TurnLine:
    """The one `turn_done` line (at info) of a turn, filled in as the turn goes.

    `outcome` is ok, failed (the agent raised an error), timeout, error (the agent
    crashed, or the gateway failed around it) or cancelled (/stop, or a shutdown that
    could not wait). No message text unless `texts` is set (`logging.include_text`)."""

    __slots__ = ("chunks", "outcome", "platform", "sent", "session_id", "started", "texts", "usage")

    def __init__(self, platform: str, started: float) -> None:
        self.platform = platform
        self.started = started  # time.monotonic() at the turn's start
        self.outcome = "error"  # until the turn gets to its end
        self.session_id: str | None = None
        self.usage: TokenUsage | None = None
        self.chunks = 0
        self.sent = 0
        self.texts: tuple[str, str] | None = None  # (the user's text, the reply)

    def log(self, logger: Any) -> None:
        fields: dict[str, Any] = {
            "platform": self.platform,
            "outcome": self.outcome,
            "duration_ms": round((time.monotonic() - self.started) * 1000, 1),
            "session_id": self.session_id,
            "reply_chunks": self.chunks,
            "chunks_sent": self.sent,
        }
        if self.usage is not None:
            fields["input_tokens"] = self.usage.input_tokens
            fields["output_tokens"] = self.usage.output_tokens
            fields["total_tokens"] = self.usage.total_tokens
        if self.texts is not None:
            fields["text"], fields["reply"] = self.texts
        fast = _turn_lines
        if fast is not None:
            # The line structlog's chain would write (`_render_turn_line`), without the
            # chain: one line per turn, and the chain's walk cost more than the rest of it.
            # Only while the chain is still ours (tests swap it in place to capture logs).
            chain, renderer, sink = fast
            current = structlog.get_config()["processors"]
            if current is chain and current and current[-1] is renderer:
                sink.write(_render_turn_line(fields))
                return
        logger.info("turn_done", **fields)


def _render_turn_line(fields: dict[str, Any]) -> str:
    """What `configure_logging`'s JSON chain makes of `info("turn_done", **fields)`: the
    fields, the event, the bound context (session_key), the level and a UTC timestamp."""
    line = {**fields, "event": "turn_done", **structlog.contextvars.get_contextvars()}
    line["level"] = "info"
    line["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return codec.dumps(line) + "\n"
