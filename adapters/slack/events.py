"""What Slack sends, read: the signature of an Events API request and whether bolt can
handle its body, and from an event its files, the sender's name and the text as written
(Slack escapes `&`, `<` and `>`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.parse
from typing import Any

from adapters.base import InboundMedia

SIGNATURE_MAX_AGE_SECONDS = 300


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def media_of(file: dict[str, Any]) -> InboundMedia:
    """A shared file as the turn fetches it: an image, a voice clip, audio or a file."""
    mime = file.get("mimetype")
    kind = "document"
    if isinstance(mime, str) and mime.startswith("image/"):
        kind = "photo"
    elif file.get("subtype") == "slack_audio":  # a voice clip recorded in Slack
        kind = "voice"
    elif isinstance(mime, str) and mime.startswith("audio/"):
        kind = "audio"
    size = file.get("size")
    return InboundMedia(
        kind,
        str(file["url_private"]),
        str(file.get("name") or file.get("id") or "file"),
        mime if isinstance(mime, str) else None,
        size if isinstance(size, int) else None,
    )


def user_name(event: dict[str, Any]) -> str | None:
    # Some message events carry the sender's profile; asking users.info per message
    # would cost a rate-limited call each time, so without it the id stands in.
    profile = event.get("user_profile") or {}
    return profile.get("display_name") or profile.get("real_name") or profile.get("name")


def signed_by_slack(secret: bytes, body: bytes, headers: Any) -> bool:
    """Slack's v0 request signature over the raw bytes, with a fresh timestamp."""
    timestamp = headers.get("X-Slack-Request-Timestamp", "")
    signature = headers.get("X-Slack-Signature", "")
    try:
        if abs(time.time() - int(timestamp)) > SIGNATURE_MAX_AGE_SECONDS:
            return False
    except ValueError:
        return False
    base = b"v0:" + timestamp.encode() + b":" + body
    expected = "v0=" + hmac.new(secret, base, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "surrogateescape"))


def malformed_events_body(body: bytes, content_type: str) -> str | None:
    """Why bolt could not handle this (signed) Events API body, or None when it can."""
    try:
        text = body.decode("utf-8")
        if content_type == "application/x-www-form-urlencoded":
            payload = urllib.parse.parse_qs(text).get("payload", ["{}"])[0]
            data = json.loads(payload)
        else:
            data = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "body is not UTF-8 JSON"
    if not isinstance(data, dict):
        return "body is not a JSON object"
    if data.get("type") == "event_callback" or "event" in data:
        event = data.get("event")
        if not isinstance(event, dict):
            return "an event that is not an object"
        for key in ("user", "channel", "ts", "text", "channel_type", "thread_ts"):
            if key in event and event[key] is not None and not isinstance(event[key], str):
                return f"event.{key} is not a string"
    authorizations = data.get("authorizations")
    if authorizations is not None and (
        not isinstance(authorizations, list) or not all(isinstance(a, dict) for a in authorizations)
    ):
        return "authorizations is not a list of objects"
    return None
