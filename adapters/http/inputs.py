"""What an HTTP API client sends, checked one value at a time: ids, whole numbers and
seconds written in ASCII digits, agent ids, listing cursors. The route models
(`adapters.http.schemas`) call these from their validators; each refusal is a
ValueError whose message names the field and says what was wrong, and becomes the 400
body (`adapters.http.validation`)."""

from __future__ import annotations

import math
import re
from typing import Any

from config import AGENT_ID_PATTERN
from gateway.domain.session import coerce_id, listing_cursor_key, validate_chat_id, validate_id

MAX_WAIT_SECONDS = 60.0


class BadRequest(Exception):
    """Invalid client input; the message names the field and becomes a 400 body."""


class ClientGone(Exception):
    """The client closed its connection before its request was read whole: nobody is
    left to answer, and nothing on the gateway's side went wrong."""


#: ASCII digits only: int() and float() would also take "+1", " 1", "1_0", "1e3" or "٣"
_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def shown(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def is_encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "a string"


def whole_number(label: str, raw: Any, minimum: int, maximum: int) -> int:
    """A whole number in ASCII digits within [minimum, maximum]; ValueError otherwise."""
    if not isinstance(raw, str) or not _DIGITS.fullmatch(raw):
        raise ValueError(f"{label} must be a whole number in digits 0-9, got {_raw(raw)}")
    digits = raw.lstrip("0") or "0"
    # Compared by length first: int() refuses strings of more than 4,300 digits.
    value = int(digits) if len(digits) <= len(str(maximum)) else maximum + 1
    if not minimum <= value <= maximum:
        raise ValueError(f"{label} must be between {minimum} and {maximum}, got {shown(raw)}")
    return value


def seconds(label: str, raw: Any) -> float:
    """Seconds in ASCII digits, with an optional decimal fraction, 0 to MAX_WAIT_SECONDS."""
    wait = float(raw) if isinstance(raw, str) and _DECIMAL.fullmatch(raw) else math.nan
    if not 0 <= wait <= MAX_WAIT_SECONDS:  # also false for nan
        raise ValueError(
            f"{label} must be a number of seconds from 0 to {MAX_WAIT_SECONDS:g} in digits "
            f"0-9 (a decimal fraction such as 2.5 is allowed), got {_raw(raw)}"
        )
    return wait


def agent_id(label: str, raw: Any) -> str:
    """An agent id (`agents:` in hermes.yaml)."""
    if not isinstance(raw, str) or not AGENT_ID_PATTERN.fullmatch(raw):
        raise ValueError(
            f"{label} must be an agent id (1-32 of a-z, 0-9, - and _), got {_raw(raw)}"
        )
    return raw


def listing_key(label: str, raw: Any) -> str:
    """The session key a `next` cursor of GET /v1/sessions stands for."""
    try:
        return listing_cursor_key(raw)
    except (ValueError, TypeError):
        raise ValueError(
            f"{label} must be a `next` cursor of this listing, got {_raw(raw)}"
        ) from None


#: a search's words: more than anyone types, and a bound on the full-text query built
MAX_SEARCH_CHARS = 1000


def search_text(label: str, raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{label} must be text, got {json_type(raw)}")
    if len(raw) > MAX_SEARCH_CHARS:
        raise ValueError(f"{label} must be at most {MAX_SEARCH_CHARS} characters")
    if not is_encodable(raw):
        raise ValueError(f"{label} contains an unpaired surrogate")
    return raw


def checked_id(name: str, raw: Any, *, required: bool = False) -> str | None:
    """An id as kept (a JSON whole number as its digits), refused when it could escape a
    path or forge a log line; `chat_id` must not be blank, and `required` ids not null."""
    value = coerce_id(name, raw)
    if value is None and required:
        raise ValueError(f"{name} must be a string, got null")
    if required and value is not None and not value.strip():
        raise ValueError(f"{name} must not be empty or blank")
    if value is not None and not is_encodable(value):
        raise ValueError(f"{name} contains an unpaired surrogate (\\ud800-\\udfff escape)")
    if name == "chat_id":
        validate_chat_id(value)  # the one id a message cannot do without: blank is refused
    else:
        validate_id(name, value)
    return value


def _raw(raw: Any) -> str:
    return shown(raw) if isinstance(raw, str) else json_type(raw)
