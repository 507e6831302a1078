"""The console's routes on the HTTP API's app (docs/console.md), mounted like the A2A
server's: public for the API's bearer check, guarded here by the console's own login.

    GET  /console/                          overview (live through /console/events)
    GET  /console/events                    server-sent overview fragments, while open
    GET  /console/login, POST /console/login, POST /console/logout
    GET  /console/sessions                  ?q= &agent= &platform= &user= &after=CURSOR
    GET  /console/sessions/{id}             a transcript (?after=MESSAGE_ID)
    GET  /console/sessions/{id}/export      the whole session as a JSON download
    POST /console/sessions/{id}/delete
    GET  /console/search?q=WORDS
    GET  /console/schedules, /console/schedules/{id} (last runs)
    POST /console/schedules/{id}/{pause|resume|run|remove}
    GET  /console/notes?user=PLATFORM:USER_ID, POST /console/notes/delete
    GET  /console/pairing, POST /console/pairing/{approve|deny}
    GET  /console/static/{console.css|console.js}

Every POST carries its console session's CSRF token (form field `csrf` or header
`X-CSRF-Token`) and, when the browser sends one, an Origin of this very server.

Each route's input is read through its models (`gateway.console.inputs`), which also
describe it in /openapi.json (`route_docs`). A page's path and query are read before the
login is asked for: a malformed request is refused alike for anyone, and only a
well-formed one is sent to log in. A change's form is read after its CSRF check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlencode

from aiohttp import web
from pydantic import BaseModel

from config import GatewayConfig
from gateway.console import pages
from gateway.console.auth import (
    COOKIE,
    COOKIE_PATH,
    SESSION_SECONDS,
    ConsoleSession,
    ConsoleSessions,
    csrf_ok,
    open_problem,
    token_matches,
)
from gateway.console.html import layout, notice
from gateway.console.inputs import (
    MAX_FIELD_CHARS,
    ConsoleError,
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
    form_of,
    path_of,
    query_of,
)
from gateway.console.port import ConsolePort, ConsoleRefused, SessionQuery
from gateway.console.route_docs import console_route_docs
from gateway.util.route_doc import RouteDoc

__all__ = ["ConsoleServer"]

PAGE_SIZE = 50  # sessions per listing page
SEARCH_LIMIT = 50
TRANSCRIPT_PAGE = 200  # messages per transcript page
MAX_EXPORT_MESSAGES = 20_000
UPCOMING_SHOWN = 5
EVENTS_SECONDS = 3.0  # how often an open overview is refreshed
KEEPALIVE_SECONDS = 15.0
MAX_STREAMS = 16  # open overview streams at once
_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


Model = TypeVar("Model", bound=BaseModel)


@dataclass(slots=True)
class Visit:
    """One request's console session and its input, read through the route's models:
    path parameters, query parameters, form fields (each None where the route takes
    none)."""

    session: ConsoleSession
    path: BaseModel | None = None
    query: BaseModel | None = None
    form: BaseModel | None = None

    def of(self, part: BaseModel | None, model: type[Model]) -> Model:
        assert isinstance(part, model), (part, model)  # the route table pairs them
        return part


Handler = Callable[[web.Request, Visit], Awaitable[web.StreamResponse]]


class ConsoleServer:
    """Build it, hand `routes()` and `public_paths()` to the HTTP adapter's `mount`, and
    `close()` it when the app shuts down (ends open overview streams)."""

    def __init__(self, config: GatewayConfig, port: ConsolePort) -> None:
        self.http = config.platforms.http
        self.port = port
        self.agents = sorted(config.agent_configs())
        self.sessions = ConsoleSessions()
        self._closing = asyncio.Event()
        self._streams = 0
        folder = resources.files("gateway.console").joinpath("static")
        self._static = {name: folder.joinpath(name).read_bytes() for name in _STATIC}

    def routes(self) -> list[web.RouteDef]:
        page, post = self._page, self._post
        return [
            web.get("/console", self._to_root),
            web.get("/console/", page(self._overview)),
            web.get("/console/events", page(self._events)),
            web.get("/console/login", self._guarded(self._login_page)),
            web.post("/console/login", self._guarded(self._login)),
            web.post("/console/logout", post(self._logout, form=CsrfForm)),
            web.get("/console/sessions", page(self._sessions, query=SessionsQuery)),
            web.get(
                "/console/sessions/{session_id}",
                page(self._transcript, path=SessionPath, query=TranscriptQuery),
            ),
            web.get("/console/sessions/{session_id}/export", page(self._export, path=SessionPath)),
            web.post(
                "/console/sessions/{session_id}/delete",
                post(self._delete, path=SessionPath, form=CsrfForm),
            ),
            web.get("/console/search", page(self._search, query=SearchQuery)),
            web.get("/console/schedules", page(self._schedules)),
            web.get("/console/schedules/{schedule_id}", page(self._runs, path=SchedulePath)),
            web.post(
                "/console/schedules/{schedule_id}/{action}",
                post(self._change_schedule, path=ScheduleActionPath, form=CsrfForm),
            ),
            web.get("/console/notes", page(self._notes, query=NotesQuery)),
            web.post("/console/notes/delete", post(self._delete_note, form=NoteForm)),
            web.get("/console/pairing", page(self._pairing)),
            web.post(
                "/console/pairing/{decision}",
                post(self._decide_pairing, path=PairingPath, form=PairingForm),
            ),
            web.get("/console/static/{name}", self._guarded(self._static_file)),
        ]

    def route_docs(self) -> list[RouteDoc]:
        """The routes as /openapi.json tells them, one per method and path."""
        return console_route_docs()

    def public_paths(self) -> frozenset[str]:
        """Every console route: the console checks its own login, not the bearer token."""
        return frozenset(route.path for route in self.routes())

    async def close(self, app: web.Application | None = None) -> None:
        self._closing.set()

    # --- guards --------------------------------------------------------------------------

    def _guarded(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        """The loopback rule, errors as JSON, and the security headers on every answer."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            problem = open_problem(self.http)
            if problem is not None:
                response: web.StreamResponse = web.Response(status=403, text=problem + "\n")
            else:
                try:
                    response = await handler(request)
                except ConsoleError as exc:
                    response = web.json_response({"error": str(exc)}, status=exc.status)
            if not response.prepared:
                response.headers.update(_HEADERS)
            return response

        return guarded

    def _page(
        self,
        handler: Handler,
        path: type[BaseModel] | None = None,
        query: type[BaseModel] | None = None,
    ) -> Any:
        async def page(request: web.Request) -> web.StreamResponse:
            path_given = path_of(request, path) if path is not None else None
            query_given = query_of(request, query) if query is not None else None
            sid = request.cookies.get(COOKIE)
            session = self.sessions.find(sid)
            fresh = None
            if session is None:
                if self.http.token:
                    if request.path == "/console/events":
                        raise ConsoleError(401, "log in first: /console/login")
                    return _redirect("/console/login")
                fresh, session = self.sessions.open()  # no token: loopback only, no login
            response = await handler(request, Visit(session, path_given, query_given))
            if fresh is not None and not response.prepared:
                self._set_cookie(request, response, fresh)
            return response

        return self._guarded(page)

    def _post(
        self,
        handler: Handler,
        path: type[BaseModel] | None = None,
        form: type[BaseModel] | None = None,
    ) -> Any:
        async def post(request: web.Request) -> web.StreamResponse:
            session = self.sessions.find(request.cookies.get(COOKIE))
            fields = await _form(request)
            if session is None:
                raise ConsoleError(403, "no console session: open /console/ (and log in) first")
            given = fields.get("csrf") or request.headers.get("X-CSRF-Token")
            if not csrf_ok(session, given) or not _same_origin(request):
                raise ConsoleError(403, "missing or wrong CSRF token: reload the page, try again")
            visit = Visit(session)
            visit.path = path_of(request, path) if path is not None else None
            visit.form = form_of(fields, form) if form is not None else None
            return await handler(request, visit)

        return self._guarded(post)

    def _set_cookie(self, request: web.Request, response: web.StreamResponse, sid: str) -> None:
        response.set_cookie(
            COOKIE,
            sid,
            max_age=SESSION_SECONDS,
            path=COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )

    def _html(self, title: str, body: str, visit: Visit, active: str) -> web.Response:
        """The page, after what the last action did (the session's flash, shown once)."""
        message, error = visit.session.take_flash()
        text = layout(
            title, notice(message, error) + body, visit.session.csrf, active, bool(self.http.token)
        )
        return web.Response(text=text, content_type="text/html")

    # --- login ---------------------------------------------------------------------------

    async def _to_root(self, request: web.Request) -> web.StreamResponse:
        return _redirect("/console/")

    async def _login_page(
        self, request: web.Request, error: str | None = None, status: int = 200
    ) -> web.StreamResponse:
        if not self.http.token:
            return _redirect("/console/")
        text = layout("Log in", pages.login_body(error), None)
        return web.Response(text=text, status=status, content_type="text/html")

    async def _login(self, request: web.Request) -> web.StreamResponse:
        if not self.http.token:
            return _redirect("/console/")
        form = form_of(await _form(request), LoginForm)
        if not _same_origin(request):
            raise ConsoleError(403, "the login came from another site")
        if not self.sessions.login_allowed():
            raise ConsoleError(429, "too many wrong tokens in the last minute; wait a minute")
        if not token_matches(form.token, self.http.token):
            self.sessions.login_failed()
            return await self._login_page(request, "That is not the token.", 403)
        sid, _ = self.sessions.open()
        response = _redirect("/console/")
        self._set_cookie(request, response, sid)
        return response

    async def _logout(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        self.sessions.close(request.cookies.get(COOKIE))
        response = _redirect("/console/login" if self.http.token else "/console/")
        response.del_cookie(COOKIE, path=COOKIE_PATH)
        return response

    async def _static_file(self, request: web.Request) -> web.StreamResponse:
        name = path_of(request, StaticPath).name
        return web.Response(body=self._static[name], content_type=_STATIC[name])

    # --- overview ------------------------------------------------------------------------

    async def _overview(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        live = pages.overview_live(await self.port.overview(), None)
        upcoming = await self.port.upcoming_schedules(UPCOMING_SHOWN)
        return self._html("Overview", pages.overview_body(live, upcoming), visit, "/console/")

    async def _events(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        """The overview's live part every `EVENTS_SECONDS` while this stream is open:
        nothing is computed for the overview while no browser has it open."""
        if self._streams >= MAX_STREAMS:
            raise ConsoleError(429, f"{MAX_STREAMS} overviews are open already")
        self._streams += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **_HEADERS})
        counted: deque[tuple[float, int]] = deque(maxlen=32)  # (time, turns) over a minute
        sent, quiet = "", 0.0
        try:
            await response.prepare(request)
            while not self._closing.is_set():
                snapshot = await self.port.overview()
                now = time.monotonic()
                counted.append((now, int(snapshot.get("turns_total", 0))))
                while counted and now - counted[0][0] > 60:
                    counted.popleft()
                live = pages.overview_live(snapshot, _per_minute(counted))
                if live != sent:
                    data = json.dumps({"html": live})
                    await response.write(f"event: overview\ndata: {data}\n\n".encode())
                    sent, quiet = live, 0.0
                elif quiet >= KEEPALIVE_SECONDS:
                    await response.write(b": keep-alive\n\n")
                    quiet = 0.0
                try:
                    await asyncio.wait_for(self._closing.wait(), EVENTS_SECONDS)
                except TimeoutError:
                    quiet += EVENTS_SECONDS
        except ConnectionError:
            pass  # the browser went away
        finally:
            self._streams -= 1
        return response

    # --- sessions ------------------------------------------------------------------------

    async def _sessions(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        given = visit.of(visit.query, SessionsQuery)
        filters = {"q": given.q, "agent": given.agent, "platform": given.platform}
        filters["user"] = given.user
        agent = given.agent or None
        if agent is not None and agent not in self.agents:
            raise ConsoleError(400, f"no agent {agent!r} (agents: {', '.join(self.agents)})")
        query = SessionQuery(agent, given.platform, given.user, given.q)
        page, next_key = await self.port.sessions_page(query, given.after, PAGE_SIZE)
        body = pages.sessions_body(filters, page, next_key, self.agents)
        return self._html("Sessions", body, visit, "/console/sessions")

    async def _transcript(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        session_id = visit.of(visit.path, SessionPath).session_id
        after = visit.of(visit.query, TranscriptQuery).after
        found = await self.port.session(session_id, after, TRANSCRIPT_PAGE + 1)
        if found is None:
            raise ConsoleError(404, f"no session {session_id}")
        messages = found["messages"]
        next_after = None
        if len(messages) > TRANSCRIPT_PAGE:
            del messages[TRANSCRIPT_PAGE:]
            next_after = messages[-1]["id"]
        body = pages.transcript_body(found, visit.session.csrf, next_after)
        return self._html(found["title"], body, visit, "/console/sessions")

    async def _export(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        session_id = visit.of(visit.path, SessionPath).session_id
        doc = await self.port.export(session_id, MAX_EXPORT_MESSAGES + 1)
        if doc is None:
            raise ConsoleError(404, f"no session {session_id}")
        doc["truncated"] = len(doc["messages"]) > MAX_EXPORT_MESSAGES
        del doc["messages"][MAX_EXPORT_MESSAGES:]
        # Up to MAX_EXPORT_MESSAGES messages: encoded off the event loop.
        body = await asyncio.to_thread(lambda: json.dumps(doc, ensure_ascii=False, indent=1))
        return web.Response(
            body=body.encode(),
            content_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="session-{session_id}.json"'},
        )

    async def _delete(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        session_id = visit.of(visit.path, SessionPath).session_id
        done = await self.port.delete_session(session_id)
        if done["status"] == "not_found":
            raise ConsoleError(404, f"no session {session_id}")
        if done["status"] == "busy":
            visit.session.flash = (f"A turn runs in {session_id}; try again later.", True)
            return _redirect(f"/console/sessions/{session_id}")
        count = done.get("messages", 0)
        visit.session.flash = (f"Deleted session {session_id} ({count} messages).", False)
        return _redirect("/console/sessions")

    async def _search(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        text = visit.of(visit.query, SearchQuery).q
        results = await self.port.search(text, SEARCH_LIMIT) if text.strip() else []
        return self._html("Search", pages.search_body(text, results), visit, "/console/search")

    # --- schedules, notes, pairing ---------------------------------------------------------

    async def _schedules(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        listed = await self.port.schedules()
        body = pages.schedules_body(listed, visit.session.csrf)
        return self._html("Schedules", body, visit, "/console/schedules")

    async def _runs(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        schedule_id = visit.of(visit.path, SchedulePath).schedule_id
        try:
            runs = await self.port.schedule_runs(schedule_id)
        except ConsoleRefused as exc:
            raise ConsoleError(404, str(exc)) from None
        body = pages.runs_body(schedule_id, runs)
        return self._html(f"Runs of {schedule_id}", body, visit, "/console/schedules")

    async def _change_schedule(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        given = visit.of(visit.path, ScheduleActionPath)
        schedule_id, action = given.schedule_id, given.action
        try:
            visit.session.flash = (await self.port.change_schedule(schedule_id, action), False)
        except ConsoleRefused as exc:
            visit.session.flash = (f"Not done: {exc}", True)
        return _redirect("/console/schedules")

    async def _notes(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        user = visit.of(visit.query, NotesQuery).user
        notes = []
        if user:
            platform, user_id = _user(user)
            notes = await self.port.notes(platform, user_id)
        body = pages.notes_body(user, notes, visit.session.csrf)
        return self._html("Notes", body, visit, "/console/notes")

    async def _delete_note(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        form = visit.of(visit.form, NoteForm)
        user, note_id = form.user, form.note_id
        platform, user_id = _user(user)
        deleted = await self.port.delete_note(platform, user_id, note_id)
        visit.session.flash = (
            ("Deleted the note.", False) if deleted else (f"{user} has no note {note_id}.", True)
        )
        return _redirect("/console/notes?" + urlencode({"user": user}))

    async def _pairing(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        listed = await self.port.pairing_requests()
        body = pages.pairing_body(listed, visit.session.csrf)
        return self._html("Pairing requests", body, visit, "/console/pairing")

    async def _decide_pairing(self, request: web.Request, visit: Visit) -> web.StreamResponse:
        decision = visit.of(visit.path, PairingPath).decision
        form = visit.of(visit.form, PairingForm)
        platform, code = form.platform, form.code
        if await self.port.decide_pairing(platform, code, decision == "approve"):
            done = "Approved" if decision == "approve" else "Denied"
            visit.session.flash = (f"{done} {platform} code {code}.", False)
        else:
            visit.session.flash = (f"No pending {platform} code {code} (expired?).", True)
        return _redirect("/console/pairing")


# --- request reading ---------------------------------------------------------------------


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _per_minute(counted: deque[tuple[float, int]]) -> float | None:
    if len(counted) < 2:
        return None
    (first_at, first), (last_at, last) = counted[0], counted[-1]
    return (last - first) * 60.0 / (last_at - first_at) if last_at > first_at else None


async def _form(request: web.Request) -> dict[str, str]:
    form = await request.post()
    fields: dict[str, str] = {}
    for name, value in form.items():
        if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
            raise ConsoleError(400, f"form field {name[:32]!r} is not a short text")
        fields[name] = value
    return fields


def _user(text: str) -> tuple[str, str]:
    platform, sep, user_id = text.partition(":")
    if not sep or not platform or not user_id:
        raise ConsoleError(400, "user must be PLATFORM:USER_ID, e.g. telegram:12345")
    return platform, user_id


def _same_origin(request: web.Request) -> bool:
    """A browser's POST names its page's origin; one from another site is refused."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return origin == f"{request.scheme}://{request.host}"
