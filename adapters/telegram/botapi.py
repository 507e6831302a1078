"""The Bot API's ways, as the adapter needs them: the command menu it registers, the
parameters that put a message into a forum topic or make it a reply, and which errors
are worth retrying."""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import telegram
from telegram.error import BadRequest, NetworkError, RetryAfter, TelegramError
from telegram.warnings import PTBDeprecationWarning

from adapters.base import SessionSource

#: the gateway's chat commands, as shown in Telegram's command menu
COMMANDS: tuple[tuple[str, str], ...] = (
    ("new", "Start a new session"),
    ("reset", "Start a new session (same as /new)"),
    ("stop", "Cancel the running reply and clear the queue"),
    ("queue", "Run a message as its own turn after the current one"),
    ("status", "Session id, age, messages, tokens, next reset"),
    ("resume", "List earlier sessions or switch back to one"),
    ("retry", "Re-run your last message"),
    ("undo", "Take back your last message and its reply"),
    ("tools", "The agent's tools and the tool servers' states"),
    ("approve", "Let the waiting tool call run"),
    ("deny", "Refuse the waiting tool call"),
    ("help", "List the commands"),
)


def send_options(target: SessionSource, reply_to: str | None) -> dict[str, Any]:
    """sendMessage's forum topic and reply-to parameters for `target`."""
    options: dict[str, Any] = {}
    if target.thread_id:
        options["message_thread_id"] = int(target.thread_id)
    if reply_to is not None and reply_to.isdigit():
        options["reply_parameters"] = telegram.ReplyParameters(
            message_id=int(reply_to), allow_sending_without_reply=True
        )
    return options


def is_transient(exc: TelegramError) -> bool:
    """Worth retrying later: the network, a timeout, flood control (not a refusal)."""
    if isinstance(exc, RetryAfter):
        return True
    return isinstance(exc, NetworkError) and not isinstance(exc, BadRequest)


def retry_after_seconds(exc: RetryAfter) -> float:
    with warnings.catch_warnings():
        # PTB 22.2+ warns that retry_after becomes a timedelta; accept either form.
        warnings.simplefilter("ignore", PTBDeprecationWarning)
        value: int | float | timedelta = exc.retry_after
    return value.total_seconds() if isinstance(value, timedelta) else float(value)
