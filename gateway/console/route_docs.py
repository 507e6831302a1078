"""The console's routes as /openapi.json tells them (`RouteDoc`s handed to the HTTP
adapter's `mount` beside the routes), from the models that read their input
(`gateway.console.inputs`).

The console checks its own login, not the bearer token: the routes behind the login
name the console's session cookie as their security (an `apiKey` in cookie); the login
page, its form, the static files and `/console` need nothing. Pages answer HTML, a
change answers a 303 redirect to the page that shows it, a refusal `{"error": ...}`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.console.auth import COOKIE
from gateway.console.inputs import (
    CsrfForm,
    LoginForm,
    NoteForm,
    NotesQuery,
    PairingForm,
    PairingPath,
    ScheduleActionPath,
    SchedulePath,
    SearchQuery,
    SessionPath,
    SessionsQuery,
    StaticPath,
    TranscriptQuery,
)
from gateway.util.route_doc import ResponseDoc, RouteDoc

FORM = "application/x-www-form-urlencoded"
TAGS = ("console",)


class ConsoleErrorBody(BaseModel):
    error: str = Field(description="what was wrong, for people")


class SessionExport(BaseModel):
    """A session's row, its counters and every message (at most 20,000)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]]
    truncated: bool = Field(description="more messages than an export holds")


_BEHIND_LOGIN = (
    "Needs a console session: the `hermes-console` cookie from `POST /console/login` (with"
    " no `platforms.http.token`, served on a loopback address only and the cookie comes"
    " with the first page). 403 text: the console is not served (the loopback rule)."
)
_PAGE: dict[int, ResponseDoc] = {
    200: "text/html",
    303: None,  # no console session: to /console/login
    400: ConsoleErrorBody,
    403: "text/plain",
}
_CHANGE: dict[int, ResponseDoc] = {
    303: None,  # to the page that shows what was done
    400: ConsoleErrorBody,
    403: (ConsoleErrorBody, "text/plain"),
    404: ConsoleErrorBody,
    413: ConsoleErrorBody,
}
_CHANGE_NOTE = (
    " A change is a form POST carrying the session's CSRF token (form field `csrf` or the"
    " `X-CSRF-Token` header) from this server's own pages (Origin); 403 JSON without."
)


def console_route_docs() -> list[RouteDoc]:
    def page(path: str, summary: str, **more: Any) -> RouteDoc:
        responses = {**_PAGE, **more.pop("responses", {})}
        return RouteDoc(
            "GET",
            path,
            summary,
            responses,
            description=_BEHIND_LOGIN,
            tags=TAGS,
            cookie=COOKIE,
            **more,
        )

    def change(path: str, summary: str, form: type[BaseModel], **more: Any) -> RouteDoc:
        return RouteDoc(
            "POST",
            path,
            summary,
            _CHANGE,
            body=form,
            body_media=FORM,
            description=_BEHIND_LOGIN + _CHANGE_NOTE,
            tags=TAGS,
            cookie=COOKIE,
            **more,
        )

    return [
        RouteDoc("GET", "/console", "To /console/", {303: None}, tags=TAGS),
        page("/console/", "The overview"),
        RouteDoc(
            "GET",
            "/console/events",
            "Server-sent `overview` events while open",
            {
                200: "text/event-stream",
                401: ConsoleErrorBody,
                403: "text/plain",
                429: ConsoleErrorBody,
            },
            description="An `overview` event (data {html}) when the overview changed, a "
            "`: keep-alive` comment every 15 s; at most 16 streams at once (429). "
            + _BEHIND_LOGIN.replace("Needs", "401 without"),
            tags=TAGS,
            cookie=COOKIE,
        ),
        RouteDoc(
            "GET",
            "/console/login",
            "The login page (no cookie needed)",
            {200: "text/html", 303: None, 403: "text/plain"},
            description="303 to /console/ when no token is set (no login then).",
            tags=TAGS,
        ),
        RouteDoc(
            "POST",
            "/console/login",
            "Log in with the HTTP API's token (no cookie needed)",
            {
                303: None,
                400: ConsoleErrorBody,
                403: (ConsoleErrorBody, "text/html", "text/plain"),
                413: ConsoleErrorBody,
                429: ConsoleErrorBody,
            },
            body=LoginForm,
            body_media=FORM,
            description="303 to /console/ with the session cookie; a wrong token is the "
            "login page again (403 HTML); ten wrong tokens in a minute: 429 for the rest "
            "of it. 403 JSON: the form came from another site (Origin).",
            tags=TAGS,
        ),
        change("/console/logout", "Log out (ends the console session)", CsrfForm),
        page("/console/sessions", "Session entries in key order, 50 a page", query=SessionsQuery),
        page(
            "/console/sessions/{session_id}",
            "A session's transcript, 200 messages a page",
            path_params=SessionPath,
            query=TranscriptQuery,
            responses={404: ConsoleErrorBody},
        ),
        page(
            "/console/sessions/{session_id}/export",
            "The whole session as a JSON download",
            path_params=SessionPath,
            responses={200: SessionExport, 404: ConsoleErrorBody},
        ),
        change(
            "/console/sessions/{session_id}/delete",
            "Delete a session (refused while a turn runs in it)",
            CsrfForm,
            path_params=SessionPath,
        ),
        page("/console/search", "Transcript search, newest first", query=SearchQuery),
        page("/console/schedules", "Every schedule"),
        page(
            "/console/schedules/{schedule_id}",
            "A schedule's last runs",
            path_params=SchedulePath,
            responses={404: ConsoleErrorBody},
        ),
        change(
            "/console/schedules/{schedule_id}/{action}",
            "Pause, resume, run now or remove a schedule",
            CsrfForm,
            path_params=ScheduleActionPath,
        ),
        page("/console/notes", "A user's long-term notes", query=NotesQuery),
        change("/console/notes/delete", "Delete one of a user's notes", NoteForm),
        page("/console/pairing", "Pending DM pairing codes"),
        change(
            "/console/pairing/{decision}",
            "Approve or deny a pairing code",
            PairingForm,
            path_params=PairingPath,
        ),
        RouteDoc(
            "GET",
            "/console/static/{name}",
            "The console's stylesheet and script (no cookie needed)",
            {
                200: ("text/css", "text/javascript"),
                403: "text/plain",
                404: ConsoleErrorBody,
            },
            path_params=StaticPath,
            tags=TAGS,
        ),
    ]
