"""What an HTTP API client sends, checked: the body of POST /v1/messages and the query
parameters. Each refusal is a `BadRequest` whose message names the field and says what
was wrong; it becomes the 400 body."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from aiohttp import web

from adapters.base import MessageEvent
from config import AGENT_ID_PATTERN
from gateway.domain.session import (
    CHAT_TYPES,
    Platform,
    SessionSource,
    coerce_id,
    validate_chat_id,
    validate_id,
)

MAX_WAIT_SECONDS = 60.0
_MESSAGE_FIELDS = (
    "chat_id",
    "user_id",
    "text",
    "chat_type",
    "thread_id",
    "message_id",
    "user_name",
)
_ID_FIELDS = ("chat_id", "user_id", "thread_id", "message_id")


class BadRequest(Exception):
    """Invalid client input; the message names the field and becomes a 400 body."""


class ClientGone(Exception):
    """The client closed its connection before its request was read whole: nobody is
    left to answer, and nothing on the gateway's side went wrong."""


def parse_message(body: bytes) -> MessageEvent:
    """Validate a POST /v1/messages body and build its event; BadRequest names the field."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest("request body must be UTF-8 encoded JSON") from exc
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_type(data)}")
    unknown = sorted(set(data) - set(_MESSAGE_FIELDS))
    if unknown:
        raise BadRequest(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(_MESSAGE_FIELDS)}"
        )
    for name in ("chat_id", "user_id", "text"):
        if name not in data:
            raise BadRequest(f"{name} is required")
    for name in _ID_FIELDS:  # a JSON number is taken as its digits, as from any JSON
        try:
            data[name] = coerce_id(name, data.get(name))
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    for name in ("chat_id", "user_id", "text"):
        if not isinstance(data[name], str):
            raise BadRequest(f"{name} must be a string, got {json_type(data[name])}")
    for name in ("chat_id", "user_id"):
        if not data[name].strip():
            raise BadRequest(f"{name} must not be empty or blank")
    chat_type = data.get("chat_type", "dm")
    if chat_type not in CHAT_TYPES:
        raise BadRequest(f"chat_type must be one of {', '.join(CHAT_TYPES)}")
    user_name = data.get("user_name")
    if user_name is not None and not isinstance(user_name, str):
        raise BadRequest(f"user_name must be a string or null, got {json_type(user_name)}")
    for name in _MESSAGE_FIELDS:
        value = data.get(name)
        if isinstance(value, str) and not is_encodable(value):
            raise BadRequest(f"{name} contains an unpaired surrogate (\\ud800-\\udfff escape)")
    for name in _ID_FIELDS:
        check_id(name, data.get(name))
    source = SessionSource(
        platform=Platform.HTTP,
        chat_id=data["chat_id"],
        chat_type=chat_type,
        user_id=data["user_id"],
        user_name=data.get("user_name"),
        thread_id=data.get("thread_id"),
        message_id=data.get("message_id"),
    )
    return MessageEvent(source=source, text=data["text"], message_id=data.get("message_id"))


def check_id(name: str, value: str | None) -> None:
    try:
        # The chat is the one id a message cannot do without: blank is refused too.
        validate_chat_id(value) if name == "chat_id" else validate_id(name, value)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def agent_param(request: web.Request) -> str | None:
    """The `agent` filter: an agent id (`agents:` in hermes.yaml), or None."""
    agent = query_value(request, "agent")
    if agent is not None and not AGENT_ID_PATTERN.fullmatch(agent):
        raise BadRequest(
            f"query parameter agent must be an agent id (1-32 of a-z, 0-9, - and _), "
            f"got {shown(agent)}"
        )
    return agent


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


#: ASCII digits only: int() and float() would also take "+1", " 1", "1_0", "1e3" or "٣"
_DIGITS = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def query_value(request: web.Request, name: str) -> str | None:
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise BadRequest(f"query parameter {name} is given more than once")
    return values[0] if values else None


def shown(raw: str) -> str:
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def int_param(request: web.Request, name: str, default: int, minimum: int, maximum: int) -> int:
    """A whole number in ASCII digits within [minimum, maximum]; BadRequest otherwise."""
    raw = query_value(request, name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw):
        raise BadRequest(
            f"query parameter {name} must be a whole number in digits 0-9, got {shown(raw)}"
        )
    digits = raw.lstrip("0") or "0"
    # Compared by length first: int() refuses strings of more than 4,300 digits.
    value = int(digits) if len(digits) <= len(str(maximum)) else maximum + 1
    if not minimum <= value <= maximum:
        raise BadRequest(
            f"query parameter {name} must be between {minimum} and {maximum}, got {shown(raw)}"
        )
    return value


def wait_param(request: web.Request) -> float:
    """Seconds in ASCII digits, with an optional decimal fraction, 0 to MAX_WAIT_SECONDS."""
    raw = query_value(request, "wait")
    if raw is None:
        return 0.0
    wait = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not 0 <= wait <= MAX_WAIT_SECONDS:  # also false for nan
        raise BadRequest(
            f"query parameter wait must be a number of seconds from 0 to {MAX_WAIT_SECONDS:g} "
            f"in digits 0-9 (a decimal fraction such as 2.5 is allowed), got {shown(raw)}"
        )
    return wait
