"""Logging setup: structlog, JSON lines for services, a readable console for people.

Records from the standard `logging` module (adapters, platform libraries) go through the
same renderer, so a service's log is one JSON object per line whoever wrote it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, get_args

import structlog

from config import LoggingConfig
from config.schema import LogLevel
from gateway.session import TokenUsage
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
    "aiohttp.access",
    "apscheduler",
)


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
    work is done; records of the `logging` module (platform libraries, adapters) go
    through a handler with the same renderer. The stdlib route cost a turn's one log
    line about 30 µs (two LogRecords, a stack walk for the caller), the direct one 8."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(serializer=codec.dumps)  # orjson: 8 µs a line, not 12
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
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
    handler = logging.StreamHandler(sys.stderr)
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
        logger.info("turn_done", **fields)
