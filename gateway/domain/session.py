"""The session data model: where a message came from, the session it belongs to, and its key.

Owns `SessionSource`, `SessionEntry`, `SessionContext`, session-key building and the
session-context prompt block. Nothing here touches disk; `SessionStore` in
`gateway.store.session_store` does (the public facade `gateway.domain.session` names both).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from enum import StrEnum
from operator import attrgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from config import GatewayConfig

__all__ = [
    "CHAT_TYPES",
    "MAX_CURSOR_LENGTH",
    "SCHEDULE_KEY_SEGMENT",
    "Platform",
    "SessionContext",
    "SessionEntry",
    "SessionSource",
    "TokenUsage",
    "agent_id_of_key",
    "build_session_context",
    "build_session_context_prompt",
    "build_session_key",
    "canonical_whatsapp_identifier",
    "coerce_id",
    "is_shared_multi_user_session",
    "listing_cursor",
    "listing_cursor_key",
    "schedule_id_of_key",
    "schedule_session_key",
    "scrub_name",
    "scrub_text",
    "validate_chat_id",
    "validate_id",
]

CHAT_TYPES = ("dm", "group", "channel", "thread")


class Platform(StrEnum):
    """Messaging platforms a session can come from (the last three only for key building)."""

    TELEGRAM = "telegram"
    DISCORD = "discord"
    SLACK = "slack"
    EMAIL = "email"
    HTTP = "http"
    A2A = "a2a"  # agent tasks: the A2A server's and native delegations' sessions
    LOCAL = "local"
    WHATSAPP = "whatsapp"
    SIGNAL = "signal"
    MATRIX = "matrix"


# --- ids -------------------------------------------------------------------------------------

# C0/C1 controls plus Unicode line separators and bidi overrides (both can forge log lines),
# and lone surrogates (JSON can carry them; they cannot be stored as UTF-8).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


# The controls that break a line or tab apart: in a name they become one space.
_BREAKS = re.compile(r"[\t\n\v\f\r\x1c-\x1f\x85\u2028\u2029]+")


def scrub_text(value: str) -> str:
    """Replace lone surrogates (valid in JSON escapes, not in UTF-8) with U+FFFD."""
    return _SURROGATE.sub("\ufffd", value)


def scrub_name(value: str) -> str | None:
    """A display name (user_name, chat_name, chat_topic) fit for the prompt and the logs.

    Names are free text the model is shown, so the characters an id is rejected for
    (`validate_id`) are taken out rather than the message refused: line breaks and tabs
    become one space, the other controls go, lone surrogates become U+FFFD. A name left
    blank is None."""
    cleaned = _CONTROL.sub("", _BREAKS.sub(" ", scrub_text(value))).strip()
    return cleaned or None


def validate_id(field_name: str, value: str | None) -> None:
    """Reject ids that could escape a path or forge a log line; they end up in both."""
    if value is None or value == "":
        return
    if not isinstance(value, str):
        raise ValueError(f"{field_name} must be a string, got {type(value).__name__}")
    if "/" in value or "\\" in value:
        raise ValueError(f"{field_name} must not contain a path separator")
    if ".." in value:
        raise ValueError(f"{field_name} must not contain '..'")
    if _CONTROL.search(value):
        raise ValueError(f"{field_name} must not contain control characters")


def coerce_id(field_name: str, value: Any) -> str | None:
    """An id read from JSON, as the string we keep it as.

    Platforms number their ids (Telegram chat ids, Discord snowflakes), so an older
    sessions.json or a webhook body may say 12345 where we keep "12345": a whole number
    is taken as its decimal digits. A bool is no id, and neither is a float: JSON numbers
    past 2**53 lose digits as floats, so 1.0 cannot be trusted to name the chat "1"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"{field_name} must be a string or a whole number, got {type(value).__name__}")


def validate_chat_id(value: str | None) -> None:
    """An inbound message needs a chat to be answered in: a blank chat_id (empty or only
    whitespace) is refused, as is any id `validate_id` refuses."""
    validate_id("chat_id", value)
    if value is None or not value.strip():
        raise ValueError("chat_id must not be empty or blank")


def canonical_whatsapp_identifier(value: str | None) -> str | None:
    """Fold the alias forms of one WhatsApp identity into one (E.164 digits, no '+').

    The bridge reports the same number as `15551234567@s.whatsapp.net`, `+1 555 123 4567`
    or with a device suffix `15551234567:12@s.whatsapp.net`; all become `15551234567`.
    Group JIDs (`...@g.us`) keep their local part.
    """
    if not value:
        return value
    local = value.split("@", 1)[0].split(":", 1)[0].strip()
    digits = re.sub(r"[\s\-()+.]", "", local)
    return digits if digits.isdigit() else local


def _key_part(value: str) -> str:
    # ':' separates key segments; escaping it (and '%') keeps keys injective for ids that
    # contain colons (Matrix room ids) while leaving every common id unchanged.
    return value.replace("%", "%25").replace(":", "%3A")


# --- SessionSource -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionSource:
    """Where one inbound message came from; attached to every `MessageEvent`."""

    platform: Platform
    chat_id: str
    chat_name: str | None = None
    chat_type: str = "dm"
    user_id: str | None = None
    user_name: str | None = None
    thread_id: str | None = None
    chat_topic: str | None = None
    user_id_alt: str | None = None
    chat_id_alt: str | None = None
    is_bot: bool = False
    guild_id: str | None = None
    parent_chat_id: str | None = None
    message_id: str | None = None
    role_authorized: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.platform, Platform):
            object.__setattr__(self, "platform", Platform(self.platform))
        if self.chat_type not in CHAT_TYPES:
            raise ValueError(f"chat_type must be one of {', '.join(CHAT_TYPES)}")

    @property
    def description(self) -> str:
        """Human-readable summary, e.g. 'DM with Alice' or 'group: Dev, thread: 17'."""
        if self.chat_type == "dm":
            text = f"DM with {self.user_name or self.user_id or 'unknown user'}"
        else:
            text = f"{self.chat_type}: {self.chat_name or self.chat_id or 'unknown'}"
        if self.thread_id:
            text += f", thread: {self.thread_id}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = dict(zip(_SOURCE_FIELDS, _source_values(self), strict=True))
        data["platform"] = self.platform.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionSource:
        """From `to_dict()` output or any other JSON: numeric ids become strings
        (`coerce_id`); a bool or float id raises ValueError."""
        return cls(**_coerce_ids(_known_fields(data, _SOURCE_FIELDS), _SOURCE_ID_FIELDS))


def _known_fields(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The keyword arguments for a dataclass from `data`, dropping unknown keys. Keyed by
    the interned field names on purpose: CPython matches those to parameters by
    identity, while keys decoded from JSON are compared character by character (that
    made decoding an entry twice as slow)."""
    return {name: data[name] for name in names if name in data}


def _coerce_ids(kwargs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`kwargs` with its ids among `names` made strings (`coerce_id`), in place."""
    for name in names:
        value = kwargs.get(name)
        if value is not None and type(value) is not str:
            kwargs[name] = coerce_id(name, value)
    return kwargs


# Computed once: entries and sources are encoded and decoded on every turn.
_SOURCE_FIELDS = tuple(f.name for f in fields(SessionSource))
_source_values = attrgetter(*_SOURCE_FIELDS)
_SOURCE_ID_FIELDS = (
    "chat_id",
    "user_id",
    "thread_id",
    "user_id_alt",
    "chat_id_alt",
    "guild_id",
    "parent_chat_id",
    "message_id",
)


# --- keys ----------------------------------------------------------------------------------


def _is_threaded(source: SessionSource) -> bool:
    return bool(source.thread_id) or source.chat_type == "thread"


def _is_per_user(
    source: SessionSource, group_sessions_per_user: bool, thread_sessions_per_user: bool
) -> bool:
    # Whether a non-DM key gets the participant suffix. The key and the "shared session"
    # flag both derive from this, so they cannot disagree.
    return group_sessions_per_user and (not _is_threaded(source) or thread_sessions_per_user)


def build_session_key(
    source: SessionSource,
    group_sessions_per_user: bool = True,
    thread_sessions_per_user: bool = False,
    agent_id: str = "main",
) -> str:
    """The deterministic conversation-lane key (format and rules in docs/design.md)."""
    validate_id("agent_id", agent_id)
    if not agent_id or ":" in agent_id:
        raise ValueError("agent_id must be non-empty and must not contain ':'")
    chat_id, user_id, user_id_alt = source.chat_id, source.user_id, source.user_id_alt
    # Validate the ids as received: WhatsApp canonicalisation strips whitespace and dots,
    # so checking only its result would let e.g. "1..2" or "12\n34" through.
    for name, value in (
        ("chat_id", chat_id),
        ("thread_id", source.thread_id),
        ("user_id", user_id),
        ("user_id_alt", user_id_alt),
    ):
        validate_id(name, value)
    if source.platform == Platform.WHATSAPP:
        chat_id = canonical_whatsapp_identifier(chat_id)
        user_id = canonical_whatsapp_identifier(user_id)
        user_id_alt = canonical_whatsapp_identifier(user_id_alt)

    parts = ["agent", agent_id, source.platform.value, source.chat_type]
    participant = user_id_alt or user_id
    if source.chat_type == "dm":
        lane = chat_id or participant
        if lane:
            parts.append(_key_part(lane))
        if source.thread_id:
            parts.append(_key_part(source.thread_id))
        return ":".join(parts)

    if chat_id:
        parts.append(_key_part(chat_id))
    if source.thread_id:
        parts.append(_key_part(source.thread_id))
    per_user = _is_per_user(source, group_sessions_per_user, thread_sessions_per_user)
    if per_user and participant:
        parts.append(_key_part(participant))
    return ":".join(parts)


#: the segment of a scheduled job's session key (`agent:{agent_id}:cron:{schedule_id}`);
#: no platform is called this, so no chat's key can take the form
SCHEDULE_KEY_SEGMENT = "cron"


def schedule_session_key(agent_id: str, schedule_id: str) -> str:
    """The session of a scheduled job: its runs keep their own context there and never
    interleave with the chat's own turns."""
    validate_id("agent_id", agent_id)
    validate_id("schedule_id", schedule_id)
    if ":" in agent_id or ":" in schedule_id or not agent_id or not schedule_id:
        raise ValueError("agent_id and schedule_id must be non-empty and must not contain ':'")
    return f"agent:{agent_id}:{SCHEDULE_KEY_SEGMENT}:{schedule_id}"


def schedule_id_of_key(session_key: str) -> str | None:
    """The schedule id of a scheduled job's session key; None for any other key."""
    parts = session_key.split(":")
    if len(parts) == 4 and parts[0] == "agent" and parts[2] == SCHEDULE_KEY_SEGMENT:
        return parts[3]
    return None


def agent_id_of_key(session_key: str) -> str:
    """The agent id of a session key (`agent:{agent_id}:...`): whose session it is.

    Ids cannot contain ':' (`build_session_key` refuses them), so the id is exactly the
    text between the first and the second colon."""
    prefix, _, rest = session_key.partition(":")
    agent_id, sep, _ = rest.partition(":")
    if prefix != "agent" or not sep or not agent_id:
        raise ValueError(f"not a session key: {session_key!r}")
    return agent_id


#: a listing cursor's version prefix, so a later format can tell old cursors apart
_CURSOR_PREFIX = "k1."
MAX_CURSOR_LENGTH = 4096
_CURSOR_BODY = re.compile(r"[A-Za-z0-9_-]+")


def listing_cursor(session_key: str) -> str:
    """An opaque cursor that resumes a session listing after `session_key` (the listing
    pages in session-key order: a key never moves, so no entry is listed twice or
    skipped while a client pages)."""
    body = base64.urlsafe_b64encode(session_key.encode("utf-8")).decode("ascii").rstrip("=")
    return _CURSOR_PREFIX + body


def listing_cursor_key(cursor: str) -> str:
    """The session key a `listing_cursor` resumes after; ValueError for any other text."""
    body = cursor.removeprefix(_CURSOR_PREFIX)
    if len(cursor) > MAX_CURSOR_LENGTH or body == cursor or not _CURSOR_BODY.fullmatch(body):
        raise ValueError("not a cursor of this listing")
    try:
        key = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("not a cursor of this listing") from None
    if not key or listing_cursor(key) != cursor:  # one spelling per key
        raise ValueError("not a cursor of this listing")
    return key


def is_shared_multi_user_session(
    source: SessionSource, *, group_sessions_per_user: bool, thread_sessions_per_user: bool
) -> bool:
    """True when several people talk in one session (messages get a [sender] prefix)."""
    if source.chat_type == "dm":
        return False
    # Threads are shared unless thread_sessions_per_user; but a per-user thread lane also
    # needs group_sessions_per_user, exactly as in build_session_key.
    return not _is_per_user(source, group_sessions_per_user, thread_sessions_per_user)


# --- SessionEntry --------------------------------------------------------------------------


def _dt_to_str(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo is UTC else value.astimezone(UTC)).isoformat()


def _dt_from_str(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        dt = value
    else:
        dt = datetime.fromisoformat(str(value))
    if dt is not None and dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)  # older files wrote naive times; they were UTC
    return dt


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token counts of one turn, as the model reported them."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    estimated_cost_usd: float = 0.0
    estimated: bool = False  # the backend reported no counts: these are estimates

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


_DATETIME_FIELDS = ("created_at", "updated_at", "last_resume_marked_at")


@dataclass(slots=True)
class SessionEntry:
    """The routing record of one session key: its current session id, counters and flags.

    Entries handed out by `SessionStore` are snapshots; change them through the store.
    """

    session_key: str
    session_id: str
    created_at: datetime
    updated_at: datetime
    origin: SessionSource | None = None
    display_name: str | None = None
    platform: Platform | None = None
    chat_type: str = "dm"
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    total_tokens: int = 0
    estimated_cost_usd: float = 0.0
    cost_status: str = "unknown"
    last_prompt_tokens: int = 0
    # One-shot and state-machine flags (seed section 2).
    was_auto_reset: bool = False
    auto_reset_reason: str | None = None
    reset_had_activity: bool = False
    is_fresh_reset: bool = False
    expiry_finalized: bool = False
    suspended: bool = False
    resume_pending: bool = False
    resume_reason: str | None = None
    last_resume_marked_at: datetime | None = None

    def add_usage(self, usage: TokenUsage) -> None:
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cache_read_tokens += usage.cache_read_tokens
        self.cache_write_tokens += usage.cache_write_tokens
        self.total_tokens += usage.total_tokens
        self.estimated_cost_usd += usage.estimated_cost_usd
        if usage.estimated_cost_usd:
            self.cost_status = "estimated"

    def copy(self) -> SessionEntry:
        return SessionEntry(*_entry_values(self))

    def to_dict(self) -> dict[str, Any]:
        data = dict(zip(_ENTRY_FIELDS, _entry_values(self), strict=True))
        for name in _DATETIME_FIELDS:
            data[name] = _dt_to_str(data[name])
        if self.origin is not None:
            data["origin"] = self.origin.to_dict()
        if self.platform is not None:
            data["platform"] = self.platform.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionEntry:
        kwargs = _coerce_ids(_known_fields(data, _ENTRY_FIELDS), ("session_key", "session_id"))
        for name in _DATETIME_FIELDS:
            if kwargs.get(name) is not None:
                kwargs[name] = _dt_from_str(kwargs[name])
        if kwargs.get("origin") is not None:
            kwargs["origin"] = SessionSource.from_dict(kwargs["origin"])
        if kwargs.get("platform") is not None:
            kwargs["platform"] = Platform(kwargs["platform"])
        return cls(**kwargs)


_ENTRY_FIELDS = tuple(f.name for f in fields(SessionEntry))
_entry_values = attrgetter(*_ENTRY_FIELDS)


# --- SessionContext ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What the agent is told about where it is talking (seed section 9)."""

    source: SessionSource
    connected_platforms: tuple[str, ...] = ()
    home_channels: dict[str, str] = field(default_factory=dict)
    shared_multi_user_session: bool = False
    session_key: str | None = None
    session_id: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None


def build_session_context(
    source: SessionSource,
    config: GatewayConfig,
    session_entry: SessionEntry | None = None,
    *,
    platforms: tuple[str, ...] | None = None,
    homes: dict[str, str] | None = None,
) -> SessionContext:
    """`platforms` and `homes`: the config's connected platforms and home channels, when
    the caller keeps them (the runner: they are the same for every turn)."""
    return SessionContext(
        source=source,
        connected_platforms=tuple(config.connected_platforms()) if platforms is None else platforms,
        home_channels=dict(config.home_channels()) if homes is None else homes,
        shared_multi_user_session=is_shared_multi_user_session(
            source,
            group_sessions_per_user=config.group_sessions_per_user,
            thread_sessions_per_user=config.thread_sessions_per_user,
        ),
        session_key=session_entry.session_key if session_entry else None,
        session_id=session_entry.session_id if session_entry else None,
        created_at=session_entry.created_at if session_entry else None,
        updated_at=session_entry.updated_at if session_entry else None,
    )


# Discord needs raw ids to write @mentions, so it is never redacted (seed section 9).
_NEVER_REDACTED = frozenset({Platform.DISCORD.value})


def _hash12(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()[:12]


def _redact_user(value: str) -> str:
    return f"user_{_hash12(value)}"


def _redact_chat(platform: str, value: str) -> str:
    return f"{platform}:{_hash12(value)}"


def build_session_context_prompt(context: SessionContext, redact_pii: bool = False) -> str:
    """The `## Current Session Context` system-prompt block.

    With `redact_pii`, user ids become `user_<12hex>` and chat ids `<platform>:<12hex>`
    (SHA-256 prefixes) except on Discord. Only this text is redacted; routing keeps raw ids.
    """
    src = context.source
    platform = src.platform.value
    redact = redact_pii and platform not in _NEVER_REDACTED

    def chat(value: str, on_platform: str = platform) -> str:
        if redact_pii and on_platform not in _NEVER_REDACTED:
            return _redact_chat(on_platform, value)
        return value

    def user(value: str) -> str:
        return _redact_user(value) if redact else value

    lines = ["## Current Session Context", f"- Platform: {platform}"]
    if src.chat_type == "dm":
        who = src.user_name or (user(src.user_id) if src.user_id else "unknown user")
        lines.append(f"- Chat: DM with {who}")
    else:
        lines.append(f"- Chat: {src.chat_type}: {src.chat_name or chat(src.chat_id)}")
    lines.append(f"- Chat type: {src.chat_type}")
    if src.chat_id:
        lines.append(f"- Chat ID: {chat(src.chat_id)}")
    if src.thread_id:
        lines.append(f"- Thread: {src.thread_id}")
    if src.chat_topic:
        lines.append(f"- Channel topic: {src.chat_topic}")
    if context.shared_multi_user_session:
        kind = "thread" if _is_threaded(src) else "session"
        lines.append(
            f"- Multi-user {kind} — messages are prefixed with [sender name]. "
            "Multiple users may participate."
        )
    else:
        if src.user_name:
            lines.append(f"- User: {src.user_name}")
        if src.user_id:
            lines.append(f"- User ID: {user(src.user_id)}")
    if context.connected_platforms:
        lines.append(f"- Connected platforms: {', '.join(context.connected_platforms)}")
    if context.home_channels:
        homes = ", ".join(f"{p} -> {chat(c, p)}" for p, c in sorted(context.home_channels.items()))
        lines.append(f"- Home channels (scheduled deliveries): {homes}")
    if context.session_id:
        lines.append(f"- Session ID: {context.session_id}")
    if context.created_at:
        lines.append(f"- Session started: {_dt_to_str(context.created_at)}")
    return "\n".join(lines)
