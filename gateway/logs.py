"""Logging setup: structlog, JSON lines for services, a readable console for people.

Records from the standard `logging` module (adapters, platform libraries) go through the
same renderer, so a service's log is one JSON object per line whoever wrote it.
"""

from __future__ import annotations

import logging
import sys

import structlog

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


def configure_logging(json_output: bool | None = None, level: str = "INFO") -> None:
    """JSON when stderr is not a TTY (systemd, pipes) or when asked; console otherwise."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
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
    root.setLevel(level.upper())
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
