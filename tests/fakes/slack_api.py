"""A fake Slack on 127.0.0.1, for adapter tests: the Web API, Socket Mode and signed
Events API requests, speaking the real wire formats.

    Web API     POST /api/{method}   form, query or JSON body; `Authorization: Bearer`
                auth.test, chat.postMessage, apps.connections.open (app token) ...
    Socket Mode GET /socket          websocket: `hello` on connect, `events_api` envelopes
                                     out, `{"envelope_id"}` acks in, `disconnect` out
    Events API  post_event(url, payload, secret=...)   a signed POST, as Slack sends it
    Files       GET /files/{id}/{name}  url_private: needs `Authorization: Bearer <bot
                token>` (Slack answers a login page otherwise); `add_file` stores one
                and returns its file object for a message's `files`
                files.getUploadURLExternal -> POST /upload/{id} -> files.completeUploadExternal
                (files_upload_v2); completed uploads are recorded in `uploads`

    async with FakeSlack() as slack:
        adapter = SlackAdapter(SlackConfig(..., api_base_url=slack.api_base_url))
        await slack.deliver(dm("U42", "hello"))

Faults are queued per API method, each for one call: `fail_next` (e.g. a 429 with
Retry-After), `delay_next`. Recorded: `posted` (chat.postMessage), `acks` (envelope ids),
`requests` (every Web API call, tokens left out).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import itertools
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

BOT_USER_ID = "UBOT"
BOT_NAME = "hermes"
BOT_ID = "B1"
TEAM_ID = "T1"
APP_ID = "A1"

_event_ids = itertools.count(1)
_timestamps = itertools.count(1)


@dataclass(slots=True)
class _Fault:
    status: int = 200
    error: str | None = None
    retry_after: int | None = None
    delay: float = 0.0


# --- event builders ----------------------------------------------------------------------


def next_ts() -> str:
    """A fresh message ts ("seconds.micro", unique per process)."""
    return f"{1_700_000_000 + next(_timestamps)}.000100"


def event_callback(event: dict[str, Any], *, event_id: str | None = None) -> dict[str, Any]:
    """Wrap one event the way the Events API delivers it (`type: event_callback`)."""
    return {
        "token": "legacy-verification-token",
        "team_id": TEAM_ID,
        "api_app_id": APP_ID,
        "event": event,
        "type": "event_callback",
        "event_id": event_id or f"Ev{next(_event_ids):08d}",
        "event_time": int(time.time()),
        "authorizations": [
            {
                "enterprise_id": None,
                "team_id": TEAM_ID,
                "user_id": BOT_USER_ID,
                "is_bot": True,
                "is_enterprise_install": False,
            }
        ],
        "is_ext_shared_channel": False,
    }


def _message(
    channel: str, channel_type: str, user: str, text: str, **fields: Any
) -> dict[str, Any]:
    ts = fields.pop("ts", None) or next_ts()
    event = {
        "type": "message",
        "channel": channel,
        "channel_type": channel_type,
        "user": user,
        "text": text,
        "ts": ts,
        "event_ts": ts,
        "team": TEAM_ID,
    }
    event.update({k: v for k, v in fields.items() if v is not None})
    return event


def dm(user: str, text: str, *, channel: str | None = None, **fields: Any) -> dict[str, Any]:
    """A direct message (`channel_type: im`); the channel defaults to "D" + user."""
    return event_callback(_message(channel or f"D{user}", "im", user, text, **fields))


def channel_message(
    channel: str, user: str, text: str, thread_ts: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A message in a public channel, in a thread when `thread_ts` is given."""
    return event_callback(_message(channel, "channel", user, text, thread_ts=thread_ts, **fields))


def app_mention(message: dict[str, Any]) -> dict[str, Any]:
    """The `app_mention` event Slack sends alongside a channel message that mentions the
    bot: the same message (user, text, ts), its own event_id, no channel_type."""
    event = {k: v for k, v in message["event"].items() if k != "channel_type"}
    event["type"] = "app_mention"
    return event_callback(event)


def redeliver(payload: dict[str, Any]) -> dict[str, Any]:
    """The same event again (same event_id), as Slack retries an unacknowledged one."""
    return copy.deepcopy(payload)


def url_verification(challenge: str) -> dict[str, Any]:
    return {
        "token": "legacy-verification-token",
        "challenge": challenge,
        "type": "url_verification",
    }


# --- signed Events API requests ----------------------------------------------------------


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """Slack's v0 request signature: HMAC-SHA256 of `v0:{timestamp}:{body}`, hex."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


async def post_event(
    url: str,
    payload: dict[str, Any],
    *,
    secret: str,
    retry_num: int | None = None,
    bad_signature: bool = False,
    timestamp: float | None = None,
) -> tuple[int, str]:
    """POST `payload` to an Events API Request URL, signed as Slack signs it; returns
    (status, body). `retry_num` adds X-Slack-Retry-Num/-Reason as Slack's retries do."""
    body = json.dumps(payload).encode()
    stamp = str(int(timestamp if timestamp is not None else time.time()))
    signed = signature("not-the-secret" if bad_signature else secret, stamp, body)
    headers = {
        "Content-Type": "application/json",
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signed,
    }
    if retry_num is not None:
        headers["X-Slack-Retry-Num"] = str(retry_num)
        headers["X-Slack-Retry-Reason"] = "http_timeout"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as resp,
    ):
        return resp.status, await resp.text()


# --- the server --------------------------------------------------------------------------


class FakeSlack:
    """Web API and Socket Mode server. `connections` counts websocket connections made."""

    def __init__(self, *, bot_token: str = "xoxb-test", app_token: str = "xapp-test") -> None:
        self.bot_token = bot_token
        self.app_token = app_token
        self.api_base_url = ""
        self.posted: list[dict[str, Any]] = []  # {"channel", "text", "thread_ts", "ts"}
        self.updates: list[dict[str, Any]] = []  # chat.update: {"channel", "ts", "text", "at"}
        self.acks: list[str] = []
        self.requests: list[dict[str, Any]] = []  # {"method", "params"}
        self.connections = 0
        self._faults: dict[str, deque[_Fault]] = defaultdict(deque)
        self._envelopes = itertools.count(1)
        self._socket: web.WebSocketResponse | None = None
        self._socket_request: web.Request | None = None
        self._changed = asyncio.Event()  # set (and replaced) on each post, ack, (dis)connect
        self._runner: web.AppRunner | None = None
        self._port = 0
        self.files: dict[str, bytes] = {}  # file id -> content
        self.downloads: list[str] = []
        self.uploads: list[dict[str, Any]] = []  # {filename, data, channel, comment, thread_ts}
        self._pending_uploads: dict[str, dict[str, Any]] = {}
        self._file_ids = itertools.count(1)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/api/{method}", self._api)
        app.router.add_get("/socket", self._websocket)
        app.router.add_get("/files/{fid}/{name}", self._download)
        app.router.add_post("/upload/{fid}", self._upload)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self._port = self._runner.addresses[0][1]
        self.api_base_url = f"http://127.0.0.1:{self._port}/api/"
        return self.api_base_url

    async def stop(self) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSlack:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- fault injection -----------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        *,
        status: int = 429,
        retry_after: int | None = 1,
        error: str = "ratelimited",
        times: int = 1,
    ) -> None:
        """Answer the next `times` calls of `method` with HTTP `status` and
        `{"ok": false, "error"}` (Retry-After in whole seconds, as Slack sends it)."""
        self._faults[method].extend(_Fault(status, error, retry_after) for _ in range(times))

    def delay_next(self, method: str, seconds: float) -> None:
        """Sleep before answering the next call of `method` (normally)."""
        self._faults[method].append(_Fault(delay=seconds))

    # --- files ---------------------------------------------------------------------------

    def add_file(
        self,
        name: str,
        data: bytes,
        mimetype: str,
        *,
        declared_size: int | None = None,
        subtype: str | None = None,
    ) -> dict[str, Any]:
        """Store a file; returns its file object (for `dm(..., files=[...])`)."""
        file_id = f"F{next(self._file_ids)}"
        self.files[file_id] = data
        url = f"http://127.0.0.1:{self._port}/files/{file_id}/{name}"
        found = {
            "id": file_id,
            "name": name,
            "mimetype": mimetype,
            "size": len(data) if declared_size is None else declared_size,
            "url_private": url,
            "url_private_download": url + "?download=1",
        }
        if subtype is not None:
            found["subtype"] = subtype
        return found

    async def _download(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.bot_token}":
            return web.Response(text="<html>sign in</html>", content_type="text/html")
        data = self.files.get(request.match_info["fid"])
        if data is None:
            return web.Response(status=404)
        self.downloads.append(request.match_info["fid"])
        return web.Response(body=data, content_type="application/octet-stream")

    async def _upload(self, request: web.Request) -> web.Response:
        pending = self._pending_uploads.get(request.match_info["fid"])
        if pending is None:
            return web.Response(status=404)
        pending["data"] = await request.read()
        return web.Response(text="OK - 1")

    def _get_upload_url(self, params: dict[str, Any]) -> dict[str, Any]:
        file_id = f"F{next(self._file_ids)}"
        self._pending_uploads[file_id] = {"filename": params.get("filename"), "data": None}
        url = f"http://127.0.0.1:{self._port}/upload/{file_id}"
        return {"ok": True, "upload_url": url, "file_id": file_id}

    def _complete_upload(self, params: dict[str, Any]) -> dict[str, Any]:
        files = params.get("files")
        if isinstance(files, str):
            files = json.loads(files)
        done = []
        for item in files or []:
            pending = self._pending_uploads.pop(item["id"], None)
            if pending is None or pending["data"] is None:
                return {"ok": False, "error": "file_not_found"}
            self.uploads.append(
                {
                    **pending,
                    "channel": params.get("channel_id"),
                    "comment": params.get("initial_comment"),
                    "thread_ts": params.get("thread_ts"),
                }
            )
            done.append({"id": item["id"], "name": pending["filename"], "title": item.get("title")})
        self._notify()
        return {"ok": True, "files": done}

    # --- Web API -------------------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        params: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json":
            params.update(await request.json())
        elif request.can_read_body:
            params.update(await request.post())
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token if scheme == "Bearer" else str(params.pop("token", ""))
        params.pop("token", None)
        self.requests.append({"method": method, "params": params, "at": time.monotonic()})
        queue = self._faults.get(method)
        fault = queue.popleft() if queue else _Fault()
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.error is not None:
            headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after else None
            return web.json_response(
                {"ok": False, "error": fault.error}, status=fault.status, headers=headers
            )
        expected = self.app_token if method == "apps.connections.open" else self.bot_token
        if token != expected:
            return web.json_response({"ok": False, "error": "invalid_auth"})
        if method == "auth.test":
            return web.json_response(
                {
                    "ok": True,
                    "url": "https://fake.slack.com/",
                    "team": "Fake",
                    "user": BOT_NAME,
                    "team_id": TEAM_ID,
                    "user_id": BOT_USER_ID,
                    "bot_id": BOT_ID,
                    "is_enterprise_install": False,
                }
            )
        if method == "apps.connections.open":
            url = f"ws://127.0.0.1:{self._port}/socket?ticket={self.connections + 1}"
            return web.json_response({"ok": True, "url": url})
        if method == "chat.postMessage":
            return web.json_response(self._post_message(params))
        if method in ("chat.update", "chat.delete"):
            return web.json_response(self._change_message(method, params))
        if method == "files.getUploadURLExternal":
            return web.json_response(self._get_upload_url(params))
        if method == "files.completeUploadExternal":
            return web.json_response(self._complete_upload(params))
        return web.json_response({"ok": False, "error": "unknown_method"})

    def _post_message(self, params: dict[str, Any]) -> dict[str, Any]:
        channel, text = params.get("channel"), params.get("text")
        if not channel:
            return {"ok": False, "error": "channel_not_found"}
        if not text:
            return {"ok": False, "error": "no_text"}
        ts = next_ts()
        self.posted.append(
            {"channel": channel, "text": text, "thread_ts": params.get("thread_ts"), "ts": ts}
        )
        self._notify()
        return {"ok": True, "channel": channel, "ts": ts, "message": {"text": text, "ts": ts}}

    def _change_message(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        channel, ts = params.get("channel"), params.get("ts")
        posted = next((p for p in self.posted if p["channel"] == channel and p["ts"] == ts), None)
        if posted is None or posted.get("deleted"):
            return {"ok": False, "error": "message_not_found"}
        if method == "chat.delete":
            posted["deleted"] = True
            self._notify()
            return {"ok": True, "channel": channel, "ts": ts}
        text = params.get("text")
        if not text:
            return {"ok": False, "error": "no_text"}
        posted["text"] = text
        self.updates.append({"channel": channel, "ts": ts, "text": text, "at": time.monotonic()})
        self._notify()
        return {"ok": True, "channel": channel, "ts": ts, "text": text}

    def chat_view(self, channel: str) -> list[str]:
        """The bot's messages in a channel as they read now (updates applied)."""
        return [p["text"] for p in self.posted if p["channel"] == channel and not p.get("deleted")]

    # --- Socket Mode ---------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self._socket, self._socket_request = ws, request
        await ws.send_json(
            {
                "type": "hello",
                "num_connections": 1,
                "debug_info": {"host": "fake-slack", "approximate_connection_time": 3600},
                "connection_info": {"app_id": APP_ID},
            }
        )
        self._notify()
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(message.data)
                if isinstance(data, dict) and "envelope_id" in data:
                    self.acks.append(data["envelope_id"])
                    self._notify()
        finally:
            if self._socket is ws:
                self._socket, self._socket_request = None, None
                self._notify()
        return ws

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until `predicate()` holds, re-checked after each post, ack or (dis)connect;
        TimeoutError after `within` seconds."""
        async with asyncio.timeout(within):
            while not predicate():
                await self._changed.wait()

    async def deliver(self, payload: dict[str, Any], *, retry_attempt: int = 0) -> str:
        """Send an `events_api` envelope over the current connection (waiting up to 5 s
        for one); returns its envelope_id."""
        await self.wait_until(lambda: self._socket is not None)
        assert self._socket is not None
        envelope_id = f"env-{next(self._envelopes)}"
        await self._socket.send_json(
            {
                "envelope_id": envelope_id,
                "payload": payload,
                "type": "events_api",
                "accepts_response_payload": False,
                "retry_attempt": retry_attempt,
                "retry_reason": "timeout" if retry_attempt else "",
            }
        )
        return envelope_id

    async def wait_for_ack(self, envelope_id: str) -> None:
        await self.wait_until(lambda: envelope_id in self.acks)

    async def send_disconnect(self, reason: str = "refresh_requested") -> None:
        """Ask the client to reconnect, as Slack does before it recycles a connection."""
        assert self._socket is not None
        await self._socket.send_json(
            {"type": "disconnect", "reason": reason, "debug_info": {"host": "fake-slack"}}
        )

    async def drop_connection(self) -> None:
        """Cut the current connection without a close frame (a network failure)."""
        request = self._socket_request
        if request is not None and request.transport is not None:
            request.transport.abort()
