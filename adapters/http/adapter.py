"""The local HTTP API: clients POST messages in and long-poll the replies out.

    POST /v1/messages                        one inbound message -> 202 {session_key, status}
                                             (503 + Retry-After while the gateway is busy
                                             or its store cannot write: nothing accepted)
    GET  /v1/chats/{chat_id}/messages        replies after a cursor (?after=SEQ&wait=SECONDS)
    GET  /v1/chats/{chat_id}/stream          server-sent events: `delta` ({"text": new
                                             text}) while a reply is written, `final`
                                             ({"seq", "text"}) per reply (?after=SEQ:
                                             replays the finals after SEQ first)
    GET  /v1/sessions                        a page of the gateway's session entries,
                                             with titles and agents, in session-key order
                                             (?limit=N&after=CURSOR: `next` of the page
                                             before; &agent=ID: one agent's)
    GET  /v1/sessions/{session_id}           one session and a page of its messages
                                             (?after=MESSAGE_ID&limit=N)
    DELETE /v1/sessions/{session_id}         delete it and all it owns (409 while its
                                             turn runs)
    GET  /v1/search?q=WORDS                  transcript search (&chat_id=C: only that
                                             HTTP chat's sessions; &agent=ID: only that
                                             agent's; &limit=N)
    GET  /v1/usage                           tokens and cost (?since=&until=&user=&agent=
                                             &by=user,agent,model,day)
    GET  /healthz                            gateway health (never needs the token)
    GET  /metrics                            Prometheus text format
    GET  /openapi.json                       this API as OpenAPI 3.1 (never needs the token)

Each route's parameters and body are read through its pydantic models, and the same
models describe it in /openapi.json (`adapters.http.schemas`, `adapters.http.openapi`).

Routes other parts serve on this port (the A2A server's, docs/a2a.md) are added with
`mount` before `start`, behind the same token check but for the paths named public,
with their `RouteDoc`s for /openapi.json.

With `platforms.http.token` set, `/v1/...` and `/metrics` need `Authorization: Bearer`.
The API is the operator's (like `hermes-gateway sessions ...`): it lists, reads,
searches and deletes the sessions of every platform and agent; `chat_id` narrows a
search to one HTTP chat, for a client that serves one, and `agent` to one agent's
sessions (with several agents in one chat, routed by user, a client serving one of them
passes both).
Replies are read from the gateway's delivery ledger (`GatewayHandle.replies_after`), so
they survive restarts and their `seq` (the ledger id) only grows: a client's cursor
stays valid across a gateway restart.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Iterator
from importlib import metadata
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from adapters.base import AcceptStatus, PlatformAdapter, SendResult
from adapters.http import schemas
from adapters.http.counting import FunctionCollector, RepeatLimit
from adapters.http.inputs import BadRequest, ClientGone
from adapters.http.openapi import build_spec
from adapters.http.schemas import API_ROUTES, MAX_REPLIES_PER_POLL, PROMETHEUS_CONTENT_TYPE
from adapters.http.validation import message_of, path_of, query_of
from config import HttpConfig
from gateway.domain import command_syntax
from gateway.domain.session import Platform, SessionSource, listing_cursor
from gateway.util.bounded_body import read_bounded
from gateway.util.route_doc import RouteDoc

__all__ = ["HttpAdapter"]

# Probes must work without the token; the API's description holds no secret, and a
# client learns from it that a token is needed.
_PUBLIC_ROUTES = frozenset({"/healthz", "/openapi.json"})
OPENAPI_ROUTE = RouteDoc(
    "GET", "/openapi.json", "This API as OpenAPI 3.1 (no token needed)", {200: "application/json"}
)
RETRY_AFTER_SECONDS = 1
STREAM_KEEPALIVE_SECONDS = 15.0
STORE_RETRY_AFTER_SECONDS = 5  # a full disk is not freed in a second
# The request line's bound (aiohttp's default is 8,190 bytes). Every URL the routes'
# models accept fits: the console's five filters of 200 characters, percent-encoded at
# up to 12 bytes a character, are 12,000 bytes; beyond it the parser answers 400 alone.
MAX_REQUEST_LINE = 65536


def _needs_token(request: web.Request, public: frozenset[str]) -> bool:
    # Decide on the matched route, not the raw path, so no spelling of a URL that reaches
    # a protected handler can skip the check. Unmatched requests get a plain 404/405.
    resource = request.match_info.route.resource
    return resource is not None and resource.canonical not in public


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _retry_later(why: str, seconds: int) -> web.Response:
    """503: nothing was accepted, so the client keeps the message and sends it again."""
    return _error(503, f"{why} in {seconds} s", **{"Retry-After": str(seconds)})


class HttpAdapter(PlatformAdapter):
    """The HTTP API adapter (aiohttp.web). Bind it to a gateway, then `start()`.

    `port` is the bound port after `start()` (config port 0 picks a free one).
    """

    platform = Platform.HTTP
    stream_mode = "push"  # deltas to GET /v1/chats/{chat_id}/stream listeners
    # Clients get whole replies; split only beyond this generous cap (characters).
    max_message_length = 65536

    def __init__(self, config: HttpConfig) -> None:
        super().__init__(config)
        self.config = config
        self.log.hide(config.token)
        self.host = config.host
        self.port = config.port
        self._runner: web.AppRunner | None = None
        self._stopping = False
        # Long-pollers waiting per chat; present only while someone waits, so GETs for
        # unknown chats cost no memory beyond the request itself.
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        # Several replicas: tells the others a chat has a new reply.
        self.publish: Callable[[str], object] | None = None
        # Stream listeners per chat, each a queue of ("delta", text) / ("final", "") /
        # ("stop", ""); present only while someone listens.
        self._listeners: dict[str, set[asyncio.Queue[tuple[str, str]]]] = {}
        self.shed_total = 0  # POSTs answered 503 because the gateway was busy
        self._shedding = False
        self.clients_gone_total = 0  # requests whose client left before sending them whole
        self._gone_log = RepeatLimit()
        self._registry = CollectorRegistry(auto_describe=False)  # this adapter's own
        self._registry.register(FunctionCollector(self._metric_families))
        # Routes other parts serve on this port (the A2A server), added by `mount`.
        self._mounted: list[web.RouteDef] = []
        self._mounted_docs: list[RouteDoc] = []
        self._spec: bytes | None = None  # /openapi.json, built at the first start
        self._public = _PUBLIC_ROUTES
        self._on_shutdown: list[Callable[[web.Application], Awaitable[None]]] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def mount(
        self,
        routes: Iterable[web.RouteDef],
        public_paths: Iterable[str] = (),
        on_shutdown: Callable[[web.Application], Awaitable[None]] | None = None,
        docs: Iterable[RouteDoc] = (),
    ) -> None:
        """Serve `routes` beside the API's own, from the next `start()`, behind the same
        token check but for `public_paths` (route patterns, e.g. `/a2a/{agent}/x`).
        `on_shutdown` runs when the server begins to stop (to end open streams). `docs`
        describe the routes in /openapi.json (one `RouteDoc` per method and path)."""
        self._mounted.extend(routes)
        self._mounted_docs.extend(docs)
        self._spec = None
        self._public = self._public | frozenset(public_paths)
        if on_shutdown is not None:
            self._on_shutdown.append(on_shutdown)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(
            middlewares=[self._auth_and_errors],
            client_max_size=self.config.max_body_bytes,
        )
        handlers = {
            "POST /v1/messages": self._post_message,
            "GET /v1/chats/{chat_id}/messages": self._get_replies,
            "GET /v1/chats/{chat_id}/stream": self._get_stream,
            "GET /v1/sessions": self._get_sessions,
            "GET /v1/sessions/{session_id}": self._get_session,
            "DELETE /v1/sessions/{session_id}": self._delete_session,
            "GET /v1/search": self._search,
            "GET /v1/usage": self._usage,
            "GET /healthz": self._get_health,
            "GET /metrics": self._get_metrics,
            "GET /openapi.json": self._get_openapi,
        }
        app.add_routes(
            [
                web.route(doc.method, doc.path, handlers[f"{doc.method} {doc.path}"])
                for doc in (*API_ROUTES, OPENAPI_ROUTE)
            ]
            + self._mounted
        )
        if self._spec is None:
            self._spec = self._build_spec()
        app.on_shutdown.extend(self._on_shutdown)
        # No access log: every long-poll would log a line; errors are logged below.
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=5.0, max_line_size=MAX_REQUEST_LINE
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.config.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                exc.errno,
                f"HTTP API cannot listen on {self.host}:{self.config.port} ({exc.strerror}); "
                "is another gateway running? Change platforms.http.port in hermes.yaml",
            ) from exc
        self.port = runner.addresses[0][1]
        self._runner = runner
        self._stopping = False
        self.set_state("running", listen=self.url, token_required=bool(self.config.token))

    async def stop(self) -> None:
        # Wake long-pollers first so the server's graceful shutdown does not wait on them.
        self._stopping = True
        for chat_id in list(self._waiters):
            self._wake(chat_id)
        for listeners in self._listeners.values():
            for queue in listeners:
                queue.put_nowait(("stop", ""))
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
            self.set_state("stopped")

    def health(self) -> dict[str, Any]:
        state = "running" if self._runner is not None and not self._stopping else "stopped"
        return {"state": state, "listen": self.url, "shed_total": self.shed_total}

    # --- outbound ------------------------------------------------------------------------

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """The reply is already in the gateway's delivery ledger, which is this API's
        outbox (durable, numbered across restarts): delivering it means waking the
        chat's long-pollers."""
        self._wake(target.chat_id)
        if self.publish is not None:
            self.publish(target.chat_id)  # the chat's long-pollers on other replicas
        return SendResult(message_id=str(delivery_id) if delivery_id is not None else None)

    def publish_replies(self, publish: Callable[[str], object]) -> None:
        self.publish = publish

    def wake(self, chat_id: str) -> None:
        """A reply for `chat_id` was recorded by another replica (gateway.runner.replica)."""
        self._wake(chat_id)

    def _wake(self, chat_id: str) -> None:
        for waiter in self._waiters.get(chat_id, ()):
            if not waiter.done():
                waiter.set_result(None)
        for queue in self._listeners.get(chat_id, ()):
            queue.put_nowait(("final", ""))

    def can_stream(self, target: SessionSource) -> bool:
        return self.config.streaming and target.chat_id in self._listeners

    async def push_delta(self, target: SessionSource, text: str) -> None:
        for queue in self._listeners.get(target.chat_id, ()):
            queue.put_nowait(("delta", text))

    # --- middleware ----------------------------------------------------------------------

    def _token_ok(self, request: web.Request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        expected = self.config.token or ""
        # Compare bytes: compare_digest rejects non-ASCII str, and a header may carry any.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), expected.encode("utf-8")
        )

    @web.middleware
    async def _auth_and_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            self.config.token
            and _needs_token(request, self._public)
            and not self._token_ok(request)
        ):
            return _error(401, "missing or wrong bearer token", **{"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        except (ClientGone, ConnectionError) as exc:
            self._client_gone(request, exc)
            return _error(400, "the request was not sent whole")  # nobody reads it
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
            return _error(exc.status, exc.reason, **allow)
        except Exception:
            self.log.exception("http_api_error", method=request.method, path=request.path)
            return _error(500, "internal error; see the gateway log")

    def _client_gone(self, request: web.Request, exc: Exception) -> None:
        """A client going away is the client's business: one info line, no traceback, at
        most one a minute (the line counts the others)."""
        self.clients_gone_total += 1
        if not self._gone_log.due():
            return
        self.log.info(
            "http_client_gone",
            method=request.method,
            path=request.path,
            remote=request.remote,
            reason=str(exc) if isinstance(exc, ClientGone) else f"{type(exc).__name__}: {exc}",
            unlogged=self._gone_log.unlogged,  # clients gone since the previous line
            clients_gone_total=self.clients_gone_total,
        )
        self._gone_log.unlogged = 0

    def _build_spec(self) -> bytes:
        try:
            version = metadata.version("hermes-gateway")
        except metadata.PackageNotFoundError:
            version = "0"
        spec = build_spec(
            [*API_ROUTES, OPENAPI_ROUTE, *self._mounted_docs],
            self._public,
            title="hermes-gateway HTTP API",
            version=version,
        )
        return json.dumps(spec, ensure_ascii=False).encode()

    # --- routes --------------------------------------------------------------------------

    async def _post_message(self, request: web.Request) -> web.Response:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error(413, f"request body is larger than {limit} bytes")
        body = await self._read_capped(request, limit)
        if body is None:
            return _error(413, f"request body is larger than {limit} bytes")
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        event = message_of(body)
        busy = self.gateway.busy_sessions()
        if busy >= self.config.max_busy_sessions and command_syntax.starts_work(event.text):
            return self._shed(busy)
        if self._shedding:
            self._shedding = False
            self.log.info("http_api_shedding_ended", shed_total=self.shed_total)
        accepted = await self.gateway.handle_message(event)
        if accepted.status is AcceptStatus.UNAVAILABLE:  # logged by the store, once a minute
            return _retry_later(f"{accepted.detail}, send it again", STORE_RETRY_AFTER_SECONDS)
        reply: dict[str, Any] = {
            "session_key": accepted.session_key,
            "status": accepted.status.value,
        }
        if accepted.detail is not None:
            reply["detail"] = accepted.detail
        return web.json_response(reply, status=202)

    def _shed(self, busy: int) -> web.Response:
        """Backpressure: refuse before anything is accepted, so the client keeps the
        message and sends it again. Logged when shedding starts, not per request."""
        self.shed_total += 1
        if not self._shedding:
            self._shedding = True
            self.log.warning(
                "http_api_shedding", busy_sessions=busy, limit=self.config.max_busy_sessions
            )
        return _retry_later(
            f"the gateway is busy ({busy} sessions have a turn running or waiting); "
            "nothing was accepted, send it again",
            RETRY_AFTER_SECONDS,
        )

    @staticmethod
    async def _read_capped(request: web.Request, limit: int) -> bytes | None:
        """The body, or None when it exceeds `limit` (also for chunked bodies)."""
        try:
            return await read_bounded(request.content, limit)
        except RequestPayloadError as exc:  # e.g. a Content-Encoding that does not decode
            raise BadRequest(f"the request body could not be read: {exc}") from None
        except ConnectionError as exc:  # the client closed the connection mid-body
            raise ClientGone(f"{type(exc).__name__}: {exc}") from None

    async def _get_replies(self, request: web.Request) -> web.Response:
        """Up to `limit` replies (1-500, default 500) after `after` (0 to 2**63-1), waiting
        up to `wait` seconds (0-60) for the first; each in plain ASCII digits."""
        chat_id = path_of(request, schemas.ChatPath).chat_id
        query = query_of(request, schemas.RepliesQuery)
        after, limit, wait = query.after, query.limit, query.wait
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            # Register before reading: a reply recorded while the read is in flight still
            # wakes this poller instead of leaving it waiting for the whole `wait`.
            waiter: asyncio.Future[None] = loop.create_future()
            waiters = self._waiters.setdefault(chat_id, set())
            waiters.add(waiter)
            try:
                messages = await self.gateway.replies_after(
                    self.platform.value, chat_id, after, limit
                )
                remaining = deadline - loop.time()
                if messages or self._stopping or remaining <= 0:
                    break
                await asyncio.wait([waiter], timeout=remaining)
            finally:
                waiters.discard(waiter)
                if not waiters:
                    self._waiters.pop(chat_id, None)
        next_seq = messages[-1]["seq"] if messages else after
        return web.json_response({"messages": messages, "next": next_seq})

    async def _get_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events for one chat until the client goes: `delta` events while a
        reply is written, a `final` event per recorded reply (seq and whole text), a
        comment every `STREAM_KEEPALIVE_SECONDS`. With `after`, the finals after it are
        sent first (a reconnecting client loses none); without, only new ones."""
        chat_id = path_of(request, schemas.ChatPath).chat_id
        after = query_of(request, schemas.StreamQuery).after
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        listeners = self._listeners.setdefault(chat_id, set())
        listeners.add(queue)  # before the cursor is read: no final falls between
        try:
            cursor = after
            if cursor is None:
                cursor = await self.gateway.last_reply_seq(self.platform.value, chat_id)
            else:
                queue.put_nowait(("final", ""))
            await response.prepare(request)
            while not self._stopping:
                try:
                    async with asyncio.timeout(STREAM_KEEPALIVE_SECONDS):
                        kind, text = await queue.get()
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if kind == "stop":
                    break
                if kind == "delta":
                    await response.write(_event("delta", {"text": text}))
                    continue
                for reply in await self.gateway.replies_after(
                    self.platform.value, chat_id, cursor, MAX_REPLIES_PER_POLL
                ):
                    cursor = reply["seq"]
                    await response.write(_event("final", {"seq": cursor, "text": reply["text"]}))
        except ConnectionError:
            pass  # the client went away
        finally:
            listeners.discard(queue)
            if not listeners:
                self._listeners.pop(chat_id, None)
        return response

    async def _get_sessions(self, request: web.Request) -> web.Response:
        """A page of the session entries: up to `limit` (1-1000, default 100) after the
        cursor `after`; `next` is the cursor of the following page, null on the last."""
        query = query_of(request, schemas.SessionsQuery)
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        page, next_key = await self.gateway.list_sessions_page(
            query.agent, query.after, query.limit
        )
        next_cursor = None if next_key is None else listing_cursor(next_key)
        return web.json_response({"sessions": page, "next": next_cursor})

    async def _get_session(self, request: web.Request) -> web.Response:
        """A session and up to `limit` (1-500, default 100) of its messages after transcript
        id `after`; `next` is the `after` of the following page."""
        session_id = path_of(request, schemas.SessionPath).session_id
        query = query_of(request, schemas.SessionQuery)
        after = query.after
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        session = await self.gateway.get_session(session_id, after, query.limit)
        if session is None:
            return _error(404, f"no session {session_id}")
        messages = session["messages"]
        session["next"] = messages[-1]["id"] if messages else after
        return web.json_response(session)

    async def _delete_session(self, request: web.Request) -> web.Response:
        session_id = path_of(request, schemas.SessionPath).session_id
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        done = await self.gateway.delete_session(session_id)
        if done["status"] == "not_found":
            return _error(404, f"no session {session_id}")
        if done["status"] == "busy":
            return _error(409, f"a turn is running in session {session_id}; try again later")
        return web.json_response(
            {key: done[key] for key in ("session_id", "session_key", "messages", "was_current")}
        )

    async def _search(self, request: web.Request) -> web.Response:
        """Transcript search: `q` (any text), `chat_id` (one HTTP chat's sessions), `agent`
        (one agent's sessions), `limit` (1-100, default 20)."""
        query = query_of(request, schemas.SearchQuery)
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        results = await self.gateway.search_sessions(
            query.q,
            platform=None if query.chat_id is None else self.platform.value,
            chat_id=query.chat_id,
            agent=query.agent,
            limit=query.limit,
        )
        return web.json_response({"results": results})

    async def _usage(self, request: web.Request) -> web.Response:
        """The operator's usage report: `since`/`until` (YYYY-MM-DD), `user`
        (platform:user_id), `agent`, `by` (user,agent,model,day)."""
        query = query_of(request, schemas.UsageQuery)
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        report = await self.gateway.usage_report(
            since=query.since,
            until=query.until,
            user_key=query.user,
            agent_id=query.agent,
            by=tuple(query.by.split(",")),
        )
        return web.json_response(report)

    async def _get_health(self, request: web.Request) -> web.Response:
        if self.gateway is None:
            return web.json_response(self.health())
        return web.json_response(self.gateway.health())

    async def _get_metrics(self, request: web.Request) -> web.Response:
        if self.gateway is None:
            return _error(503, "the gateway is not ready")
        text = self.gateway.metrics_text() + generate_latest(self._registry).decode("utf-8")
        return web.Response(
            body=text.encode("utf-8"), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE}
        )

    async def _get_openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._spec, content_type="application/json")

    def _metric_families(self) -> Iterator[Metric]:
        """This adapter's counters for /metrics (after the gateway's), read when scraped."""
        yield CounterMetricFamily(
            "hermes_http_shed_total",
            "POSTs refused with 503 while the gateway was busy",
            value=self.shed_total,
        )
        yield CounterMetricFamily(
            "hermes_http_clients_gone_total",
            "Requests whose client closed the connection before sending them whole",
            value=self.clients_gone_total,
        )


def _event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event (JSON on one data line: JSON escapes every newline)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()
