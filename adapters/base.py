"""What every platform adapter shares: the inbound event, the adapter interface, and the
handle through which an adapter talks to the gateway, plus reply splitting.

The runner knows adapters only through this module, and adapters know the runner only
through `GatewayHandle`, so neither imports the other.
"""

from __future__ import annotations

import asyncio
import logging
import mimetypes
import re
import sys
import traceback
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import structlog

# Re-exported so a platform module needs nothing but this module and its library.
from config import (
    ChatPlatformConfig,
    DiscordConfig,
    PlatformConfig,
    SlackConfig,
    TelegramConfig,
)
from gateway.domain.attachments import Attachment, InboundMedia, MediaTooLarge
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.domain.session import Platform, SessionSource, validate_id
from gateway.util.backoff import Backoff

__all__ = [
    "MAX_RETRY_AFTER_SECONDS",
    "AcceptStatus",
    "Accepted",
    "AdapterLog",
    "Attachment",
    "Backoff",
    "ChatPlatformConfig",
    "DiscordConfig",
    "FloodWait",
    "GatewayHandle",
    "InboundMedia",
    "MediaTooLarge",
    "MessageEvent",
    "Platform",
    "PlatformAdapter",
    "SendResult",
    "SessionSource",
    "SlackConfig",
    "TelegramConfig",
    "split_message",
    "utf16_len",
    "validate_id",
]

#: the log line of each connection state an adapter enters (see `set_state`)
_STATE_EVENTS = {
    "running": "adapter_connected",
    "reconnecting": "adapter_disconnected",
    "stopped": "adapter_stopped",
    "failed": "adapter_failed",
}


@dataclass(frozen=True, slots=True)
class SendResult:
    """The platform's acknowledgement of one sent chunk."""

    message_id: str | None = None


class FloodWait(Exception):
    """The platform asked us to wait (HTTP 429 / `retry_after`) before the next call; raised
    by the streaming calls (`send_draft`, `edit`) instead of sleeping, so a streamed
    reply skips interim edits rather than holding its turn."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"flood control: retry after {retry_after:g} s")
        self.retry_after = retry_after


class GatewayHandle(Protocol):
    """The gateway as an adapter sees it (implemented by `GatewayRunner`)."""

    async def handle_message(self, event: MessageEvent) -> Accepted: ...

    async def list_sessions_page(
        self, agent: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Up to `limit` routing entries (`SessionEntry.to_dict()`, plus the session's
        `title` and `agent`, the id in its key) with a session key after `after`, in key
        order, and the key the next page starts after (None on the last); only one
        agent's when `agent` is given."""
        ...

    async def search_sessions(
        self,
        query: str,
        *,
        session_key: str | None = None,
        platform: str | None = None,
        chat_id: str | None = None,
        agent: str | None = None,
        limit: int = 5,
    ) -> list[dict[str, Any]]:
        """Transcript hits, newest first: `{session_id, session_key, title, message_id, role,
        snippet, timestamp}`; only one key's, or one platform chat's, or one agent's
        sessions when given."""
        ...

    async def get_session(
        self, session_id: str, after: int = 0, limit: int = 500
    ) -> dict[str, Any] | None:
        """A session's row and its messages with transcript id > `after` (`messages`)."""
        ...

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        """Delete a session and all it owns; `status`: deleted, not_found or busy."""
        ...

    async def usage_report(
        self,
        *,
        since: str | None = None,
        until: str | None = None,
        user_key: str | None = None,
        agent_id: str | None = None,
        by: tuple[str, ...] = ("user", "agent", "model"),
    ) -> dict[str, Any]:
        """Tokens and cost summed by `by` (user, agent, model, day) over the days from
        `since` (YYYY-MM-DD; default this month's first) up to `until`:
        `{"since", "until", "rows": [{..groups, turns, input_tokens, output_tokens,
        estimated_turns, cost_usd}]}`."""
        ...

    async def replies_after(
        self, platform: str, chat_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        """Recorded replies to one chat with delivery id > `after`, oldest first:
        `{"seq", "text", "thread_id", "in_reply_to"}` (the HTTP API's outbox)."""
        ...

    async def last_reply_seq(self, platform: str, chat_id: str) -> int:
        """The newest reply's seq (delivery id) in one chat, 0 when none."""
        ...

    def health(self) -> dict[str, Any]: ...

    def busy_sessions(self) -> int:
        """Sessions with a turn running or waiting to run, on every platform."""
        ...

    def metrics_text(self) -> str: ...

    async def is_paired(self, platform: str, user_id: str) -> bool:
        """Did the operator approve this user (`hermes-gateway pairing approve`)?"""
        ...

    async def request_pairing(self, source: SessionSource) -> str | None:
        """The pairing code of the user who wrote from `source` (a DM, where they are told
        once approved), or None when too many are pending on the platform."""
        ...

    async def notify(self, target: SessionSource, text: str) -> None:
        """Send a gateway notice (recorded in the delivery ledger like any reply)."""
        ...

    async def load_cursor(self, platform: str, name: str) -> str | None:
        """Where the platform's event stream stood when `save_cursor` last wrote it."""
        ...

    async def save_cursor(self, platform: str, name: str, value: str) -> None:
        """Store where the platform's event stream stands (durably, before returning):
        call it once every event before `value` was accepted."""
        ...


class PlatformAdapter(ABC):
    """One chat platform. Subclasses convert platform events into `MessageEvent`s and
    hand them to `gateway.handle_message`; the runner calls `send` for replies.

    Shared here: access control (allowlists, DM pairing), the mention rule for groups,
    reply splitting, reconnect backoff and the health state. Platform quirks stay in the
    subclass."""

    platform: Platform
    max_message_length: int = 4096
    #: how the platform measures length; a plain function must be wrapped in
    #: staticmethod() (Telegram counts UTF-16 code units: `staticmethod(utf16_len)`)
    length_fn: Callable[[str], int] = len
    #: the bot's own @name, so `/new@otherbot` in a group is left alone
    bot_username: str | None = None

    @property
    def single_connection(self) -> bool:
        """One connection per bot (long polling, a gateway socket): with several replicas
        only the leader runs it (gateway.runner.replica). False: every replica may serve it."""
        return False

    def __init__(self, config: PlatformConfig | None = None) -> None:
        self.config = config
        #: this adapter's log lines (each with `platform`); a subclass `hide()`s its secrets
        self.log = AdapterLog(f"adapters.{self.platform.value}", self.platform.value)
        self.gateway: GatewayHandle | None = None
        self.state = "stopped"
        self.state_since = datetime.now(UTC)
        self.last_error: str | None = None
        self.reconnects = 0

    def bind(self, gateway: GatewayHandle) -> None:
        self.gateway = gateway

    # --- several replicas --------------------------------------------------------------------

    def publish_replies(self, publish: Callable[[str], object]) -> None:
        """Several replicas: `publish(chat_id)` tells the other replicas that a reply for
        the chat was recorded. An adapter whose clients may wait for replies on any
        replica (the HTTP API's long polls) keeps it; one that pushes replies ignores it."""
        return None

    def wake(self, chat_id: str) -> None:
        """Another replica recorded a reply for `chat_id` (its `publish`): clients waiting
        here for that chat's replies read them now. Nothing waits on a pushing platform."""
        return None

    # --- health ----------------------------------------------------------------------------

    def set_state(self, state: str, error: str | None = None, **details: Any) -> None:
        """Record the adapter's real connection state: starting, running, reconnecting,
        stopped or failed (shown by /healthz and `hermes-gateway status`), and log each
        change once: adapter_connected (adapter_reconnected after a reconnect),
        adapter_disconnected, adapter_stopped, adapter_failed. `details` go into the line."""
        previous = self.state
        if state == "reconnecting" and previous != "reconnecting":
            self.reconnects += 1
        if state != previous:
            self.state, self.state_since = state, datetime.now(UTC)
        if error is not None:
            self.last_error = error
        event = _STATE_EVENTS.get(state)
        if event is None or state == previous:
            return
        log = self.log
        if state == "running" and previous == "reconnecting":
            log.info("adapter_reconnected", reconnects=self.reconnects, **details)
        elif state == "running" or state == "stopped":
            log.info(event, **details)
        elif state == "reconnecting":
            log.warning(event, error=error, reconnecting=True, **details)
        else:
            log.error(event, error=error, **details)

    async def retry_pause(self, operation: str, attempt: int, delay: float, error: str) -> None:
        """Wait `delay` seconds before retrying a platform call that failed, with one log
        line per attempt (no traceback: the error message says what went wrong)."""
        self.log.warning(
            "platform_retry",
            operation=operation,
            attempt=attempt,
            delay_seconds=round(delay, 2),
            error=error,
        )
        await asyncio.sleep(delay)

    def health(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "since": self.state_since.isoformat(),
            "last_error": self.last_error,
            "reconnects": self.reconnects,
        }

    # --- access ------------------------------------------------------------------------------

    async def authorize(self, event: MessageEvent) -> bool:
        """Deny by default: allowed user, allowed chat, paired user or allow_all_users.

        An unknown user in a DM gets a pairing code (unless `unauthorized_dm_behavior`
        is `ignore`). Platforms without these settings (the HTTP API: bearer token) allow.
        """
        access = self.config if isinstance(self.config, ChatPlatformConfig) else None
        if access is None or access.allow_all_users:
            return True
        src = event.source
        if src.user_id and src.user_id in access.allowed_users:
            return True
        if src.chat_id in access.allowed_chats or (
            src.parent_chat_id is not None and src.parent_chat_id in access.allowed_chats
        ):
            return True
        assert self.gateway is not None
        if src.user_id and await self.gateway.is_paired(self.platform.value, src.user_id):
            return True
        if src.chat_type == "dm" and src.user_id and access.unauthorized_dm_behavior == "pair":
            self._log_denied(src, "pairing")
            code = await self.gateway.request_pairing(src)
            if code is None:
                text = (
                    "Hi! I only talk to people my operator approved, and too many pairing "
                    "requests are waiting right now. Please try again later."
                )
            else:
                text = (
                    f"Hi! I only talk to people my operator approved. Your pairing code is "
                    f"{code} (valid for 1 hour). Ask the operator to run:\n"
                    f"hermes-gateway pairing approve {self.platform.value} {code}"
                )
            await self.gateway.notify(src, text)
            return False
        self._log_denied(src, "ignored")
        return False

    def _log_denied(self, src: SessionSource, action: str) -> None:
        """One line per denied message (never its text): who, where, and what followed."""
        self.log.info(
            "access_denied",
            user_id=src.user_id,
            chat_id=src.chat_id,
            chat_type=src.chat_type,
            action=action,
        )

    def addressed_to_bot(
        self, source: SessionSource, *, mentioned: bool, replied_to_bot: bool
    ) -> bool:
        """In groups and channels the bot answers only when mentioned or replied to,
        unless `require_mention` is off or the chat is a free-response channel."""
        if source.chat_type == "dm":
            return True
        access = self.config if isinstance(self.config, ChatPlatformConfig) else None
        if access is None or not access.require_mention:
            return True
        free = access.free_response_channels
        if source.chat_id in free or (source.parent_chat_id and source.parent_chat_id in free):
            return True
        return mentioned or replied_to_bot

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    async def send(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        """Send one chunk (already within `max_message_length`) to the target's chat/thread."""

    async def send_typing(self, target: SessionSource) -> None:  # noqa: B027 (optional)
        """Show a typing indicator; platforms without one ignore it."""

    # --- streamed replies ---------------------------------------------------------------------

    #: how a streamed reply reaches the chat: "edit" (a message sent, then edited in
    #: place: `send_draft`, `edit`, `delete`), "push" (text deltas to listeners:
    #: `push_delta`), or None (the platform gets whole replies only)
    stream_mode: str | None = None

    def can_stream(self, target: SessionSource) -> bool:
        """Would a streamed reply to `target` be seen now? (The HTTP API: only while a
        client listens.) Cheap: asked once per turn."""
        return self.stream_mode is not None and bool(getattr(self.config, "streaming", False))

    async def send_draft(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        """Send the first message of a streamed reply; raises `FloodWait` on a 429
        rather than sleeping."""
        raise NotImplementedError

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        """Replace a sent message's text; raises `FloodWait` on a 429. Editing to the text
        it already has is no error ("message is not modified")."""
        raise NotImplementedError

    async def delete(self, target: SessionSource, message_id: str) -> None:
        """Delete a sent message (a streamed partial that the final reply replaces)."""
        raise NotImplementedError

    async def push_delta(self, target: SessionSource, text: str) -> None:  # noqa: B027
        """Hand new reply text to `target`'s listeners ("push" platforms)."""

    def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:
        """The bytes of a file a user sent, in pieces, as the platform serves them (the
        caller stops reading past `media.max_bytes`). Platforms without files raise."""
        raise NotImplementedError(f"{self.platform.value} cannot download files")

    async def send_attachment(
        self,
        target: SessionSource,
        attachment: Attachment,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """Send one file (a photo, document or voice note) with its caption. Platforms
        without uploads send the caption and where the file is, as text."""
        text = f"{attachment.caption}\n" if attachment.caption else ""
        return await self.send(target, f"{text}[{attachment.kind}: {attachment.source}]", reply_to)

    def split(self, text: str) -> list[str]:
        return split_message(text, self.max_message_length, self.length_fn)


#: longest a platform's 429 `retry_after` is honoured before the send is given up
MAX_RETRY_AFTER_SECONDS = 300.0


# --- secrets in library logs ------------------------------------------------------------------


class RedactSecret(logging.Filter):
    """Replaces a secret (a bot token) in the records of the named loggers, whatever
    level they log at, from `install()` to `remove()`: for platform libraries that log
    request URLs with the token in them."""

    def __init__(self, secret: str, loggers: tuple[str, ...]) -> None:
        super().__init__()
        self.secret = secret
        self.loggers = loggers

    def install(self) -> None:
        for name in self.loggers:
            logging.getLogger(name).addFilter(self)

    def remove(self) -> None:
        for name in self.loggers:
            logging.getLogger(name).removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.secret in message:
            record.msg, record.args = message.replace(self.secret, "<token>"), None
        return True


class AdapterLog:
    """An adapter's structlog logger: every line carries the `platform`, and no secret
    the adapter `hide()`s (a bot token) reaches a field. String fields have it replaced by
    `<token>`; other values but numbers, booleans and None are logged as their text,
    replaced the same way; `exception()` logs the traceback as such text, because a
    platform library's error can quote a request URL and Telegram's carry the token."""

    _PLAIN = (int, float, bool, type(None))

    def __init__(self, name: str, platform: str) -> None:
        self._log = structlog.get_logger(name)
        self.platform = platform
        self._secrets: tuple[str, ...] = ()

    def hide(self, *secrets: str | None) -> None:
        """Keep these out of every line from now on (None and empty ones are ignored)."""
        known = {*self._secrets, *(secret for secret in secrets if secret)}
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = tuple(sorted(known, key=len, reverse=True))

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "<token>")
        return text

    def _fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        clean: dict[str, Any] = {"platform": self.platform}
        for key, value in fields.items():
            clean[key] = value if isinstance(value, self._PLAIN) else self.redact(str(value))
        return clean

    def debug(self, event: str, **fields: Any) -> None:
        self._log.debug(event, **self._fields(fields))

    def info(self, event: str, **fields: Any) -> None:
        self._log.info(event, **self._fields(fields))

    def warning(self, event: str, **fields: Any) -> None:
        self._log.warning(event, **self._fields(fields))

    def error(self, event: str, **fields: Any) -> None:
        self._log.error(event, **self._fields(fields))

    def exception(self, event: str, exc: BaseException | None = None, **fields: Any) -> None:
        """An error line with the traceback of `exc` (by default, the exception being
        handled) in its `exception` field."""
        exc = exc if exc is not None else sys.exc_info()[1]
        if exc is not None:
            fields["exception"] = "".join(traceback.format_exception(exc)).rstrip()
        self._log.error(event, **self._fields(fields))


# --- splitting ------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)", re.MULTILINE)


#: the largest local file an adapter reads into memory to send (`read_local_file`)
MAX_SEND_FILE = 20 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class LocalFile:
    """A reply's local file as an upload needs it."""

    name: str
    mime: str
    data: bytes


async def read_local_file(attachment: Attachment, default_mime: str) -> LocalFile:
    """A reply's local file (not a URL), read off the event loop, its type guessed from
    its name; ValueError past MAX_SEND_FILE (the ledger keeps the row, and the error
    says why it was not sent)."""
    path = Path(attachment.source)

    def read() -> bytes:
        if path.stat().st_size > MAX_SEND_FILE:
            raise ValueError(f"{path.name} is larger than {MAX_SEND_FILE // 1024 // 1024} MiB")
        return path.read_bytes()

    data = await asyncio.to_thread(read)
    return LocalFile(path.name, mimetypes.guess_type(path.name)[0] or default_mime, data)


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, as Telegram counts it."""
    return len(text.encode("utf-16-le")) // 2


def _cut_point(text: str, limit: int, length_fn: Callable[[str], int]) -> int:
    """Largest prefix length (in characters) that fits, preferring paragraph, line, word."""
    lo, hi = 1, len(text)
    while lo < hi:  # binary search: length_fn is monotonic in the prefix length
        mid = (lo + hi + 1) // 2
        if length_fn(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid - 1
    fit = lo
    if fit < len(text) and "\ud800" <= text[fit - 1] <= "\udbff":
        fit -= 1  # never separate a surrogate pair
    window = text[:fit]
    for sep in ("\n\n", "\n", " "):
        at = window.rfind(sep)
        if at > fit // 4:  # not absurdly early: better a hard cut than a tiny chunk
            return at + len(sep)
    return fit


def _fenced_chunk(
    rest: str, reopen: str, budget: int, length_fn: Callable[[str], int]
) -> tuple[str, int, str | None]:
    """The next chunk, where it cuts `rest`, and the fence left open in it (if any)."""
    cut = _cut_point(rest, budget, length_fn)
    chunk = reopen + rest[:cut]
    fences = _FENCE.findall(chunk)
    return chunk, cut, (fences[-1] if len(fences) % 2 == 1 else None)


def split_message(text: str, limit: int, length_fn: Callable[[str], int] = len) -> list[str]:
    """Split `text` into chunks of at most `limit` (as `length_fn` counts), in order.

    Cuts at a paragraph break, else a line break, else a space, else hard. A code fence
    open at a cut is closed at the end of the chunk and reopened at the start of the next,
    so every chunk renders on its own; without fences the chunks concatenate to `text`.
    """
    if limit < 16:
        raise ValueError("limit must be at least 16")
    chunks: list[str] = []
    rest = text
    reopen = ""
    while rest:
        if length_fn(reopen + rest) <= limit:
            chunks.append(reopen + rest)
            break
        budget = limit - length_fn(reopen)
        chunk, cut, marker = _fenced_chunk(rest, reopen, budget, length_fn)
        if marker is not None:
            closing = ("" if chunk.endswith("\n") else "\n") + marker
            if length_fn(chunk + closing) > limit:  # make room for the closing fence
                chunk, cut, marker = _fenced_chunk(rest, reopen, budget - 4, length_fn)
        if marker is not None:
            chunk += ("" if chunk.endswith("\n") else "\n") + marker
        reopen = f"{marker}\n" if marker is not None else ""
        chunks.append(chunk)
        rest = rest[cut:]
    return chunks or [""]
