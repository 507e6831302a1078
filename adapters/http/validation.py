"""A request read through its route's models (`adapters.http.schemas`): path
parameters, query parameters and the JSON body of POST /v1/messages. Every refusal is a
`BadRequest` naming the field, the first one found; it becomes the 400 body."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from adapters.base import MessageEvent
from adapters.http.inputs import BadRequest, json_type, shown
from adapters.http.schemas import MessageIn
from gateway.domain.session import Platform, SessionSource

Model = TypeVar("Model", bound=BaseModel)


def path_of(request: web.Request, model: type[Model]) -> Model:
    try:
        return model.model_validate(dict(request.match_info))
    except ValidationError as exc:
        raise refusal(exc) from None


def query_of(request: web.Request, model: type[Model]) -> Model:
    """The model's parameters, each given at most once; any other is refused (a typo
    such as `limt` would otherwise pass unnoticed)."""
    unknown = sorted(set(request.query) - set(model.model_fields))
    if unknown:
        raise BadRequest(
            f"unknown query parameter(s) {', '.join(shown(name) for name in unknown[:5])}; "
            f"allowed: {', '.join(model.model_fields) or 'none'}"
        )
    given: dict[str, str] = {}
    for name in model.model_fields:
        values = request.query.getall(name, [])
        if len(values) > 1:
            raise BadRequest(f"query parameter {name} is given more than once")
        if values:
            given[name] = values[0]
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise refusal(exc, prefix="query parameter ") from None


def message_of(body: bytes) -> MessageEvent:
    """Validate a POST /v1/messages body and build its event."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest("request body must be UTF-8 encoded JSON") from exc
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_type(data)}")
    try:
        message = MessageIn.model_validate(data)
    except ValidationError as exc:
        raise refusal(exc, allowed=MessageIn.model_fields) from None
    source = SessionSource(
        platform=Platform.HTTP,
        chat_id=message.chat_id,
        chat_type=message.chat_type,
        user_id=message.user_id,
        user_name=message.user_name,
        thread_id=message.thread_id,
        message_id=message.message_id,
    )
    return MessageEvent(source=source, text=message.text, message_id=message.message_id)


def refusal(exc: ValidationError, prefix: str = "", allowed: Iterable[str] = ()) -> BadRequest:
    """One message for the client: unknown fields first (`allowed` lists the known),
    then a missing one, then the first field refused (the models' validators say what
    was wrong in full)."""
    errors = exc.errors(include_url=False, include_input=False)
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        known = ", ".join(allowed)
        return BadRequest(f"unknown field(s) {', '.join(unknown)}; allowed: {known}")
    missing = [e for e in errors if e["type"] == "missing"]
    first = (missing or errors)[0]
    name = ".".join(str(part) for part in first["loc"])
    if first["type"] == "missing":
        return BadRequest(f"{prefix}{name} is required")
    reason = (first.get("ctx") or {}).get("error")
    if first["type"] == "value_error" and reason is not None:
        return BadRequest(str(reason))
    return BadRequest(f"{prefix}{name}: {first['msg']}")
