"""The inbound message event and what the gateway answers when it accepts one.

Adapters build a `MessageEvent` for each platform message; the runner answers with an
`Accepted`. Both live in the domain so the store (which journals events) and the
adapters (which make them) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from gateway.domain.attachments import InboundMedia
from gateway.domain.session import SessionSource, coerce_id, scrub_name, scrub_text

__all__ = ["AcceptStatus", "Accepted", "MessageEvent"]


@dataclass(slots=True)
class MessageEvent:
    """One inbound message, normalised by its adapter."""

    source: SessionSource
    text: str
    #: the platform's delivery id, used for redelivery dedup (Telegram update_id, Slack
    #: event_id, Discord message id); replies thread onto `source.message_id`
    message_id: str | None = None
    received_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    synthetic: bool = False  # made by the gateway itself (auto-resume, /retry)
    #: the gateway's durable inbox rows this event answers (several after a merge)
    inbox_ids: tuple[int, ...] = ()
    #: re-run of a turn interrupted by a restart (its user message is already stored)
    resume: bool = False
    #: files sent with the message (downloaded by the turn, see `gateway.runner.media`)
    media: tuple[InboundMedia, ...] = ()

    def __post_init__(self) -> None:
        # An empty (or blank) delivery id is no id. Kept, it would take part in dedup,
        # and every later message with the same "" would pass for a redelivery.
        if isinstance(self.message_id, str) and not self.message_id.strip():
            self.message_id = None

    @property
    def reply_to(self) -> str | None:
        """The platform message an answer to this event threads onto (turn replies,
        command replies and refusals alike)."""
        return self.source.message_id or self.message_id

    def with_inbox_ids(self, inbox_ids: tuple[int, ...]) -> MessageEvent:
        """The event bound to its inbox rows (a copy: the adapter's event stays as sent).
        Built directly, not with `dataclasses.replace` (which looks the fields up on every
        call): every turn makes one."""
        return MessageEvent(
            self.source,
            self.text,
            self.message_id,
            self.received_at,
            self.synthetic,
            inbox_ids,
            self.resume,
            self.media,
        )

    def scrubbed(self) -> MessageEvent:
        """The event with its free-text fields made safe (ids are validated, not changed):
        lone surrogates replaced in the text, control characters taken out of the names."""
        src = self.source
        names = {
            name: cleaned
            for name in ("chat_name", "user_name", "chat_topic")
            if isinstance(value := getattr(src, name), str)
            and (cleaned := scrub_name(value)) != value
        }
        text = scrub_text(self.text)
        if not names and text == self.text:
            return self  # the usual case: nothing to copy
        return replace(self, text=text, source=replace(src, **names) if names else src)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "source": self.source.to_dict(),
            "text": self.text,
            "message_id": self.message_id,
            "received_at": self.received_at.isoformat(),
            "synthetic": self.synthetic,
        }
        if self.media:  # absent for plain text: the journal's record stays as it was
            data["media"] = [m.to_dict() for m in self.media]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], **changes: Any) -> MessageEvent:
        event = cls(
            source=SessionSource.from_dict(data["source"]),
            text=data["text"],
            message_id=coerce_id("message_id", data.get("message_id")),
            received_at=datetime.fromisoformat(data["received_at"]),
            synthetic=bool(data.get("synthetic")),
            media=tuple(InboundMedia.from_dict(m) for m in data.get("media") or ()),
        )
        for name, value in changes.items():
            setattr(event, name, value)
        return event


class AcceptStatus(StrEnum):
    """What the gateway did with an inbound message."""

    STARTED = "started"  # a turn started for it now
    PENDING = "pending"  # a turn is running; it went to (or merged into) the next-up slot
    QUEUED = "queued"  # /queue: appended to the FIFO overflow
    REFUSED = "refused"  # the queue is full (or the gateway is stopping)
    UNAVAILABLE = "unavailable"  # not accepted: the store cannot write (disk full); resend later
    DUPLICATE = "duplicate"  # this message id was already accepted
    COMMAND = "command"  # a chat command, answered directly
    IGNORED = "ignored"  # not for us (unauthorized, empty)


@dataclass(frozen=True, slots=True)
class Accepted:
    status: AcceptStatus
    session_key: str | None = None
    detail: str | None = None
