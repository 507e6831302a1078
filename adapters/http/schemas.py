"""The HTTP API's wire shapes as pydantic models: what each route takes (path
parameters, query parameters, JSON body) and what it answers, and `API_ROUTES`, the
routes themselves as OpenAPI tells them (`adapters.http.openapi`).

The request models validate (`adapters.http.validation`); their validators call the
checks of `adapters.http.inputs`, so a refusal says what it always said. Query values
arrive as text and are read as ASCII digits only (`1e3`, `+1`, `٣` are refused). The
response models describe; handlers answer plain dicts, so no reply is built twice.
Response models allow fields beyond those named: the store's rows carry more (each
message's tool calls, an entry's counters), and a client ignores what it does not know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema

from adapters.http import inputs
from gateway.domain.session import CHAT_TYPES, MAX_CURSOR_LENGTH
from gateway.util.route_doc import RouteDoc

MAX_SEQ = 2**63 - 1  # reply numbers are SQLite integers: 64-bit signed
MAX_REPLIES_PER_POLL = 500
SEARCH_LIMIT, MAX_SEARCH_LIMIT = 20, 100
SESSION_PAGE, MAX_SESSION_PAGE = 100, 500
LISTING_PAGE, MAX_LISTING_PAGE = 100, 1000  # GET /v1/sessions
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# An id as `gateway.domain.session.validate_id` takes it: no path separator, no `..`, no
# control or bidi character (blank chat and user ids are refused besides).
_ID_CHAR = r"[^/\\.\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
ID_PATTERN = rf"^{_ID_CHAR}*(?:\.{_ID_CHAR}+)*\.?$"


def _query_whole_number(minimum: int, maximum: int) -> Any:
    def check(raw: Any, info: ValidationInfo) -> int:
        return inputs.whole_number(f"query parameter {info.field_name}", raw, minimum, maximum)

    schema = {"type": "integer", "minimum": minimum, "maximum": maximum}
    return Annotated[int, BeforeValidator(check), WithJsonSchema(schema)]


def _query_check(check: Any) -> Any:
    """A validator calling `check(label, raw)` with the query parameter's name."""
    return BeforeValidator(lambda raw, info: check(f"query parameter {info.field_name}", raw))


def _id_check(*, required: bool) -> Any:
    return BeforeValidator(
        lambda raw, info: inputs.checked_id(info.field_name, raw, required=required)
    )


# The validators decide; `WithJsonSchema` tells clients the same rule in JSON Schema
# terms (pydantic's own constraints would run again after the validators, on the value
# they return).
Seq = _query_whole_number(0, MAX_SEQ)
PollLimit = _query_whole_number(1, MAX_REPLIES_PER_POLL)
ListingLimit = _query_whole_number(1, MAX_LISTING_PAGE)
SessionLimit = _query_whole_number(1, MAX_SESSION_PAGE)
SearchLimit = _query_whole_number(1, MAX_SEARCH_LIMIT)
Wait = Annotated[
    float,
    _query_check(inputs.seconds),
    WithJsonSchema({"type": "number", "minimum": 0, "maximum": inputs.MAX_WAIT_SECONDS}),
]
AgentId = Annotated[
    str,
    _query_check(inputs.agent_id),
    WithJsonSchema({"type": "string", "pattern": r"^[a-z0-9][a-z0-9_-]{0,31}$"}),
]
PathId = Annotated[
    str,
    _id_check(required=True),
    WithJsonSchema({"type": "string", "minLength": 1, "pattern": ID_PATTERN}),
]
_ID_SCHEMA = {"anyOf": [{"type": "string", "pattern": ID_PATTERN}, {"type": "integer"}]}
BodyId = Annotated[str, _id_check(required=True), WithJsonSchema(_ID_SCHEMA)]
OptionalBodyId = Annotated[
    str | None,
    _id_check(required=False),
    WithJsonSchema({"anyOf": [*_ID_SCHEMA["anyOf"], {"type": "null"}]}),
]


def _text(raw: Any, info: ValidationInfo) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{info.field_name} must be a string, got {inputs.json_type(raw)}")
    if not inputs.is_encodable(raw):
        raise ValueError(
            f"{info.field_name} contains an unpaired surrogate (\\ud800-\\udfff escape)"
        )
    return raw


def _optional_text(raw: Any, info: ValidationInfo) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise ValueError(f"{info.field_name} must be a string or null, got {inputs.json_type(raw)}")
    return raw if raw is None else _text(raw, info)


def _chat_type(raw: Any) -> str:
    if raw not in CHAT_TYPES:
        raise ValueError(f"chat_type must be one of {', '.join(CHAT_TYPES)}")
    return raw


# --- requests ------------------------------------------------------------------------------


class _Query(BaseModel):
    """Query parameters: any not named is refused (`validation.query_of`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ChatPath(BaseModel):
    chat_id: PathId = Field(description="the HTTP chat (not blank)")


class SessionPath(BaseModel):
    session_id: PathId = Field(description="a session id (from /v1/sessions or a search)")


class RepliesQuery(_Query):
    after: Seq = Field(0, description="the last `seq` read (replies after it come)")
    limit: PollLimit = MAX_REPLIES_PER_POLL
    wait: Wait = Field(0.0, description="seconds to wait for the first reply (long poll)")


class StreamQuery(_Query):
    after: Seq | None = Field(
        None, description="replay the final replies after this `seq` first; else only new"
    )


class SessionsQuery(_Query):
    limit: ListingLimit = LISTING_PAGE
    after: Annotated[
        str | None,
        _query_check(inputs.listing_key),
        WithJsonSchema(
            {"type": "string", "maxLength": MAX_CURSOR_LENGTH, "pattern": r"^k1\.[A-Za-z0-9_-]+$"}
        ),
    ] = Field(None, description="the `next` cursor of the page before (opaque)")
    agent: AgentId | None = Field(None, description="only this agent's sessions")


class SessionQuery(_Query):
    after: Seq = Field(0, description="the transcript id messages come after")
    limit: SessionLimit = SESSION_PAGE


class SearchQuery(_Query):
    q: Annotated[
        str,
        _query_check(inputs.search_text),
        WithJsonSchema({"type": "string", "maxLength": inputs.MAX_SEARCH_CHARS}),
    ] = Field(description="the words")
    chat_id: PathId | None = Field(None, description="only this HTTP chat's sessions")
    agent: AgentId | None = Field(None, description="only this agent's sessions")
    limit: SearchLimit = SEARCH_LIMIT


_DAY = Annotated[str, Field(pattern=r"^\d{4}-\d{2}-\d{2}$")]
_GROUP = "(user|agent|model|day)"


class UsageQuery(_Query):
    since: _DAY | None = Field(
        None, description="from this date (the gateway's time zone; default: this month's 1st)"
    )
    until: _DAY | None = Field(None, description="before this date")
    user: Annotated[str, Field(pattern=r"^[a-z0-9_]+:[^\x00-\x1f]{1,256}$")] | None = Field(
        None, description="only this user's, as platform:user_id"
    )
    agent: AgentId | None = Field(None, description="only this agent's")
    by: Annotated[str, Field(pattern=rf"^{_GROUP}(,{_GROUP}){{0,3}}$")] = Field(
        "user,agent,model", description="what the rows sum by, comma-separated"
    )


class MessageIn(BaseModel):
    """One inbound message. Ids are strings, or whole JSON numbers taken as their
    digits (`42` is `"42"`); an empty `message_id` counts as none (no dedup)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chat_id: BodyId = Field(description="the chat (not blank)")
    user_id: BodyId = Field(description="the sender (not blank)")
    text: Annotated[str, BeforeValidator(_text)]
    chat_type: Annotated[Literal[CHAT_TYPES], BeforeValidator(_chat_type)] = "dm"
    thread_id: OptionalBodyId = None
    message_id: OptionalBodyId = Field(None, description="dedup key within the chat")
    user_name: Annotated[str | None, BeforeValidator(_optional_text)] = None


# --- responses -----------------------------------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class UsageRow(_Open):
    turns: int
    input_tokens: int
    output_tokens: int
    estimated_turns: int = Field(description="turns whose counts are estimates")
    cost_usd: float = Field(description="USD at the models' configured prices")


class UsageReport(BaseModel):
    since: str
    until: str | None
    rows: list[UsageRow] = Field(description="largest cost first; each names its groups")


class ErrorBody(BaseModel):
    error: str = Field(description="what was wrong, for people")


class MessageAccepted(BaseModel):
    session_key: str | None
    status: Literal["started", "pending", "queued", "refused", "duplicate", "command", "ignored"]
    detail: str | None = Field(None, description="present when there is more to say")


class Reply(_Open):
    seq: int = Field(description="the delivery ledger's id: grows across restarts")
    text: str
    thread_id: str | None
    in_reply_to: str | None
    attachment: dict[str, Any] | None = None


class Replies(BaseModel):
    messages: list[Reply]
    next: int = Field(description="pass as `after` for newer replies")


class SessionListing(_Open):
    session_key: str
    session_id: str
    agent: str | None
    title: str | None


class SessionsPage(BaseModel):
    sessions: list[SessionListing]
    next: str | None = Field(description="the cursor of the next page; null on the last")


class TranscriptMessage(_Open):
    id: int
    role: str | None
    content: Any
    timestamp: str | None


class SessionDetail(_Open):
    session_id: str
    session_key: str
    title: str | None
    messages: list[TranscriptMessage]
    next: int = Field(description="pass as `after` for the next page of messages")


class SessionDeleted(BaseModel):
    session_id: str
    session_key: str
    messages: int = Field(description="messages deleted")
    was_current: bool = Field(description="it was its chat's current session")


class SearchHit(_Open):
    session_id: str
    session_key: str
    title: str | None
    role: str | None
    snippet: str
    timestamp: str


class SearchResults(BaseModel):
    results: list[SearchHit]


class Health(_Open):
    """The gateway's health (status, accepting, store, adapters, ... where present);
    only this adapter's `state` before the gateway is bound."""

    status: Literal["ok", "degraded"] | None = None
    state: str | None = None


# --- the routes ----------------------------------------------------------------------------

_MAY_FAIL = {400: ErrorBody, 401: ErrorBody}
_NOT_READY = {503: ErrorBody}
_NO_ROUTE = {404: ErrorBody}  # an id URL normalisation removes (`.`) matches no route

API_ROUTES: tuple[RouteDoc, ...] = (
    RouteDoc(
        "POST",
        "/v1/messages",
        "Accept one inbound message",
        {202: MessageAccepted, **_MAY_FAIL, 413: ErrorBody, **_NOT_READY},
        body=MessageIn,
        description="503 with Retry-After while the gateway is busy or its store cannot "
        "write: nothing was accepted, send it again.",
    ),
    RouteDoc(
        "GET",
        "/v1/chats/{chat_id}/messages",
        "The chat's replies after a cursor (long poll)",
        {200: Replies, **_MAY_FAIL, **_NO_ROUTE, **_NOT_READY},
        path_params=ChatPath,
        query=RepliesQuery,
    ),
    RouteDoc(
        "GET",
        "/v1/chats/{chat_id}/stream",
        "Server-sent events: `delta` while a reply is written, `final` per reply",
        {200: "text/event-stream", **_MAY_FAIL, **_NO_ROUTE, **_NOT_READY},
        path_params=ChatPath,
        query=StreamQuery,
        description="Events `delta` (data {text}) and `final` (data {seq, text}), a "
        "`: keep-alive` comment every 15 s; the stream lasts until the client goes.",
    ),
    RouteDoc(
        "GET",
        "/v1/sessions",
        "A page of session entries, in session-key order",
        {200: SessionsPage, **_MAY_FAIL, **_NOT_READY},
        query=SessionsQuery,
    ),
    RouteDoc(
        "GET",
        "/v1/sessions/{session_id}",
        "One session and a page of its messages",
        {200: SessionDetail, **_MAY_FAIL, **_NO_ROUTE, **_NOT_READY},
        path_params=SessionPath,
        query=SessionQuery,
    ),
    RouteDoc(
        "DELETE",
        "/v1/sessions/{session_id}",
        "Delete a session and all it owns",
        {200: SessionDeleted, **_MAY_FAIL, **_NO_ROUTE, 409: ErrorBody, **_NOT_READY},
        path_params=SessionPath,
        description="409 while a turn runs in it.",
    ),
    RouteDoc(
        "GET",
        "/v1/search",
        "Transcript search, newest first",
        {200: SearchResults, **_MAY_FAIL, **_NOT_READY},
        query=SearchQuery,
    ),
    RouteDoc(
        "GET",
        "/v1/usage",
        "Tokens and cost by user, agent, model or day",
        {200: UsageReport, **_MAY_FAIL, **_NOT_READY},
        query=UsageQuery,
    ),
    RouteDoc("GET", "/healthz", "Gateway health (no token needed)", {200: Health}),
    RouteDoc(
        "GET",
        "/metrics",
        "Prometheus text format 0.0.4",
        {200: PROMETHEUS_CONTENT_TYPE, 401: ErrorBody, **_NOT_READY},
    ),
)
