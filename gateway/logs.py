"""Logging setup: structlog, JSON lines for services, a readable console for people."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json_output: bool | None = None, level: str = "INFO") -> None:
    """JSON when stderr is not a TTY (systemd, pipes) or when asked; console otherwise."""
    if json_output is None:
        json_output = not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    numeric_level = logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
