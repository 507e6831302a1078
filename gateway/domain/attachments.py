"""Media as the domain sees it: a file a user sent (`InboundMedia`, a handle the adapter
can download) and a file a reply carries (`Attachment`). Plain data, JSON both ways: an
inbound event with media is journaled like any other, an attachment waits in the
delivery ledger like a text chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ATTACHMENT_KINDS", "MEDIA_KINDS", "Attachment", "InboundMedia", "MediaTooLarge"]

MEDIA_KINDS = ("photo", "voice", "audio", "document")
ATTACHMENT_KINDS = ("photo", "document", "voice")


class MediaTooLarge(Exception):
    """A download passed `media.max_bytes` (declared or counted); nothing was kept."""

    def __init__(self, size: int | None, limit: int) -> None:
        super().__init__(f"file of {size if size is not None else 'unknown'} bytes > {limit}")
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class InboundMedia:
    """One file attached to an inbound message, not downloaded yet.

    `ref` is what the adapter needs to fetch it (Telegram's file_id, a Discord or Slack
    URL); `size` is the size the platform declares (None when it says nothing)."""

    kind: Literal["photo", "voice", "audio", "document"]
    ref: str
    name: str
    mime: str | None = None
    size: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ref": self.ref,
            "name": self.name,
            "mime": self.mime,
            "size": self.size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InboundMedia:
        return cls(data["kind"], data["ref"], data["name"], data.get("mime"), data.get("size"))


@dataclass(frozen=True, slots=True)
class Attachment:
    """A file a reply carries: `source` is a local path or an http(s) URL."""

    source: str
    kind: Literal["photo", "document", "voice"] = "document"
    caption: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTACHMENT_KINDS:
            raise ValueError(f"attachment kind must be one of {ATTACHMENT_KINDS}: {self.kind!r}")

    @property
    def is_url(self) -> bool:
        return self.source.startswith(("http://", "https://"))

    @property
    def name(self) -> str:
        return self.source.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0] or "file"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "caption": self.caption}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attachment:
        return cls(data["source"], data.get("kind", "document"), data.get("caption"))
