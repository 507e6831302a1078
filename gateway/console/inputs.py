"""What the console's routes take, as pydantic models: path parameters, query parameters
and form fields, read by `path_of`, `query_of` and `form_of`; the same models describe
the routes in /openapi.json (`gateway.console.route_docs`).

Every value is short text (`MAX_FIELD_CHARS`); query and form values are trimmed after
the length check, and a blank optional value counts as none. A refusal is a
`ConsoleError` (400, or 404 for a path naming no such thing) with the message the
console always gave. Each validator's JSON Schema says the rule it checks, so what the
description refuses, the console refuses too. Query parameters the model does not name
are ignored, as a browser's form may send them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic import ValidationInfo as Info

from gateway.domain.session import listing_cursor_key

MAX_FIELD_CHARS = 200  # any query or form value
MAX_AFTER_DIGITS = 18  # a transcript message id: fits a 64-bit integer
SESSION_ID = r"^[A-Za-z0-9_.-]{1,64}$"
SCHEDULE_ID = r"^[A-Za-z0-9_-]{1,64}$"
#: PLATFORM:USER_ID as the console splits it once trimmed: something before the first
#: colon and something after it.
USER = r"^[^:]*[^:\s][^:]*:[\s\S]*\S[\s\S]*$"
CURSOR = r"^(k1\.[A-Za-z0-9_-]+)?$"
STATIC_FILES = ("console.css", "console.js")
SCHEDULE_ACTIONS = ("pause", "resume", "run", "remove")
PAIRING_DECISIONS = ("approve", "deny")

Model = TypeVar("Model", bound=BaseModel)


class ConsoleError(Exception):
    """An answer `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NotFound(ValueError):
    """A path parameter that names nothing the console has: 404, not 400."""


# --- validators --------------------------------------------------------------------------


def _label(info: Info) -> str:
    where = (info.context or {}).get("where", "field")
    return f"{where} {info.field_name}"


def _short(raw: Any, info: Info) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{_label(info)} is not a short text")
    if len(raw) > MAX_FIELD_CHARS:
        raise ValueError(f"{_label(info)} is longer than {MAX_FIELD_CHARS}")
    return raw


def _text(raw: Any, info: Info) -> str:
    return _short(raw, info).strip()


def _required(raw: Any, info: Info) -> str:
    text = _text(raw, info)
    if not text:
        raise ValueError(f"{_label(info)} is required")
    return text


def _cursor(raw: Any, info: Info) -> str | None:
    text = _short(raw, info)
    if not text:
        return None
    try:
        return listing_cursor_key(text)
    except ValueError:
        raise ValueError("after must be a cursor of this listing") from None


def _whole_number(raw: Any, info: Info) -> int:
    text = _short(raw, info)
    if not text.isascii() or not text.isdigit() or len(text) > MAX_AFTER_DIGITS:
        raise ValueError(f"{_label(info)} must be a whole number")
    return int(text)


def _matching(pattern: str, message: str, error: type[ValueError] = ValueError) -> Any:
    compiled = re.compile(pattern)

    def check(raw: Any, info: Info) -> str:
        if not isinstance(raw, str) or not compiled.fullmatch(raw):
            raise error(message.format(raw=str(raw)[:32]))
        return raw.strip()

    return BeforeValidator(check)


def _one_of(names: tuple[str, ...], message: str) -> Any:
    def check(raw: Any, info: Info) -> str:
        if raw not in names:
            raise NotFound(message.format(raw=str(raw)[:32]))
        return raw

    return BeforeValidator(check)


def _string(**rules: Any) -> Any:
    return WithJsonSchema({"type": "string", **rules})


_SHORT = {"maxLength": MAX_FIELD_CHARS}
Text = Annotated[str, BeforeValidator(_text), _string(**_SHORT)]
Required = Annotated[str, BeforeValidator(_required), _string(**_SHORT, pattern=r"\S")]
User = Annotated[
    str,
    BeforeValidator(_short),
    _matching(USER, "user must be PLATFORM:USER_ID, e.g. telegram:12345"),
    _string(**_SHORT, pattern=USER),
]
MaybeUser = Annotated[
    str,
    BeforeValidator(_short),
    _matching(rf"^\s*$|{USER}", "user must be PLATFORM:USER_ID, e.g. telegram:12345"),
    _string(**_SHORT, pattern=rf"^\s*$|{USER}"),
]
Cursor = Annotated[str | None, BeforeValidator(_cursor), _string(**_SHORT, pattern=CURSOR)]
MessageId = Annotated[
    int,
    BeforeValidator(_whole_number),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 10**MAX_AFTER_DIGITS - 1}),
]


# --- the models --------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class SessionPath(_Model):
    session_id: Annotated[
        str, _matching(SESSION_ID, "not a session id"), _string(pattern=SESSION_ID)
    ] = Field(description="a session id (letters, digits, `_.-`)")


class SchedulePath(_Model):
    schedule_id: Annotated[
        str, _matching(SCHEDULE_ID, "not a schedule id"), _string(pattern=SCHEDULE_ID)
    ]


class ScheduleActionPath(SchedulePath):
    action: Annotated[
        Literal["pause", "resume", "run", "remove"],
        _one_of(SCHEDULE_ACTIONS, "no schedule action {raw!r}"),
    ]


class PairingPath(_Model):
    decision: Annotated[
        Literal["approve", "deny"], _one_of(PAIRING_DECISIONS, "no pairing decision {raw!r}")
    ]


class StaticPath(_Model):
    name: Annotated[Literal["console.css", "console.js"], _one_of(STATIC_FILES, "no file {raw!r}")]


class SessionsQuery(_Model):
    q: Text = Field("", description="the title or key contains this (case-blind)")
    agent: Text = Field("", description="only this agent's sessions (a configured agent)")
    platform: Text = Field("", description="only this platform's sessions")
    user: Text = Field("", description="the user's id or name contains this")
    after: Cursor = Field(None, description="the `Next page` cursor of the page before")


class TranscriptQuery(_Model):
    after: MessageId = Field(0, description="the message id the page starts after")


class SearchQuery(_Model):
    q: Text = Field("", description="the words (none: no results)")


class NotesQuery(_Model):
    user: MaybeUser = Field("", description="PLATFORM:USER_ID (none: only the form)")


class LoginForm(_Model):
    token: Annotated[str, BeforeValidator(_short), _string(**_SHORT)] = Field(
        "", description="platforms.http.token"
    )


class CsrfForm(_Model):
    csrf: Text = Field(
        "", description="the console session's CSRF token (or the X-CSRF-Token header)"
    )


class NoteForm(CsrfForm):
    user: User = Field(description="PLATFORM:USER_ID")
    note_id: Required


class PairingForm(CsrfForm):
    platform: Required
    code: Required


# --- reading a request -------------------------------------------------------------------


def path_of(request: web.Request, model: type[Model]) -> Model:
    return _validated(model, dict(request.match_info), "path parameter")


def query_of(request: web.Request, model: type[Model]) -> Model:
    """The model's parameters, each given at most once."""
    given: dict[str, str] = {}
    for name in model.model_fields:
        values = request.query.getall(name, [])
        if len(values) > 1:
            raise ConsoleError(400, f"query parameter {name} is given more than once")
        if values:
            given[name] = values[0]
    return _validated(model, given, "query parameter")


def form_of(form: Mapping[str, str], model: type[Model]) -> Model:
    return _validated(
        model, {k: v for k, v in form.items() if k in model.model_fields}, "form field"
    )


def _validated(model: type[Model], given: dict[str, Any], where: str) -> Model:
    try:
        return model.model_validate(given, context={"where": where})
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        missing = [e for e in errors if e["type"] == "missing"]
        first = (missing or errors)[0]
        name = ".".join(str(part) for part in first["loc"])
        if first["type"] == "missing":
            raise ConsoleError(400, f"{where} {name} is required") from None
        reason = (first.get("ctx") or {}).get("error")
        if isinstance(reason, ValueError):
            raise ConsoleError(404 if isinstance(reason, NotFound) else 400, str(reason)) from None
        raise ConsoleError(400, f"{where} {name}: {first['msg']}") from None
