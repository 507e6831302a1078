"""A fake Discord on 127.0.0.1: REST API v10 and the gateway websocket, for adapter tests.

REST, under ``/api/v10`` (``Authorization: Bot <token>`` required, 401 otherwise):

    GET  /users/@me, /oauth2/applications/@me, /applications/@me    login
    GET  /gateway, /gateway/bot                                     the websocket URL
    GET  /channels/{id}                                             one channel
    POST /channels/{id}/messages                                    send (JSON, or multipart
                                                                    with files); nonce dedup
    GET  /attachments/{id}/{name}                                   the CDN, no auth
    POST /channels/{id}/typing                                      typing indicator
    POST /channels/{id}/messages/{mid}/threads                      thread from a message

Gateway, at ``/gateway`` (v10, JSON; ``compress=zlib-stream`` honoured as Discord does,
one zlib stream per connection flushed with Z_SYNC_FLUSH, other values get plain text
frames): HELLO, heartbeat ACKs, IDENTIFY -> READY (the guild unavailable) + GUILD_CREATE,
RESUME (missed events replayed, then RESUMED), INVALID_SESSION for an unknown session,
close 4004 for a wrong token and 4014 for a privileged intent the portal did not enable.

Like Discord, a 429 carries ``retry_after`` in the body, ``X-RateLimit-*`` headers and a
``Via`` header (discord.py takes a 429 without ``Via`` for a Cloudflare ban and gives up),
and every message the bot sends comes back to it as a MESSAGE_CREATE.

The world: one guild with text channels ``channel`` and ``other_channel`` and a public
thread ``thread`` in ``channel`` started by a user; DM channels are made per user on
their first ``dm()``.

    async with FakeDiscord(token="t") as dc:
        adapter = DiscordAdapter(DiscordConfig(token="t", api_base_url=dc.api_base_url))
        ...
        await dc.dm("42", "hello")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import WSMsgType, web

DISCORD_EPOCH_MS = 1420070400000
HEARTBEAT_INTERVAL_MS = 41250
MESSAGE_CONTENT_INTENT = 1 << 15
REPLAY_BUFFER = 1000  # dispatches kept per session for RESUME
UNKNOWN_CHANNEL = {"message": "Unknown Channel", "code": 10003}
THREAD_EXISTS = {"message": "A thread has already been created for this message", "code": 160004}


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass(slots=True)
class _Fault:
    status: int = 200
    retry_after: float = 0.0
    delay: float = 0.0


class _Connection:
    """One gateway websocket; frames are sent in order (and compressed in order)."""

    def __init__(self, ws: web.WebSocketResponse, request: web.Request, compress: bool) -> None:
        self.ws = ws
        self.request = request
        self.compressor = zlib.compressobj() if compress else None
        self.lock = asyncio.Lock()

    async def send(self, frame: dict[str, Any]) -> None:
        await self.send_text(json.dumps(frame).encode())

    async def send_text(self, data: bytes) -> None:
        """A frame as JSON text, compressed in order when the client asked for it."""
        async with self.lock:
            if self.compressor is None:
                await self.ws.send_str(data.decode())
            else:
                chunk = self.compressor.compress(data) + self.compressor.flush(zlib.Z_SYNC_FLUSH)
                await self.ws.send_bytes(chunk)

    def abort(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()


@dataclass
class _Session:
    id: str
    seq: int = 0
    frames: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=REPLAY_BUFFER))
    conn: _Connection | None = None


class FakeDiscord:
    """The server. Records ``sent`` (accepted message bodies plus ``id`` and
    ``channel_id``), ``send_attempts``, ``typing`` (channel ids), ``threads_created``,
    ``identifies`` (IDENTIFY payloads minus the token), ``resumes`` and ``requests``."""

    bot_id = "1100000000000000001"
    application_id = "1100000000000000002"
    guild_id = "1100000000000000010"
    channel = "1100000000000000011"
    other_channel = "1100000000000000012"
    thread = "1100000000000000013"
    bot_role = "1100000000000000014"
    thread_owner = "1100000000000000015"  # a user, not the bot

    def __init__(
        self, *, token: str = "TEST", bot_name: str = "hermes", message_content_allowed: bool = True
    ) -> None:
        self.token = token
        #: False: the portal's MESSAGE CONTENT switch is off, so asking for it closes 4014
        self.message_content_allowed = message_content_allowed
        self.bot_name = bot_name
        self.api_base_url = ""
        self.gateway_url = ""
        self.sent: list[dict[str, Any]] = []
        self.send_attempts: list[float] = []  # time.monotonic() of each message POST
        self.edit_attempts: list[float] = []  # time.monotonic() of each message PATCH
        self.edits: list[dict[str, Any]] = []  # applied PATCH bodies (+ id, at)
        self.deleted: list[str] = []
        self._edit_faults: deque[_Fault] = deque()
        self.typing: list[str] = []
        self.threads_created: list[dict[str, Any]] = []
        self.identifies: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.connections: list[dict[str, str]] = []  # the query of each gateway connection
        self.messages: dict[str, dict[str, Any]] = {}
        self.uploads: list[dict[str, Any]] = []  # {filename, data, content, channel_id}
        self.cdn: dict[str, bytes] = {}  # attachment id -> bytes
        self.cdn_downloads: list[str] = []
        self._base = ""
        self.users: dict[str, dict[str, Any]] = {}
        self._channels: dict[str, dict[str, Any]] = {}
        self._dm_channels: dict[str, str] = {}  # user id -> DM channel id
        self._nonces: dict[str, dict[str, Any]] = {}
        self._faults: deque[_Fault] = deque()
        self._session: _Session | None = None
        self._last_snowflake = 0
        self._runner: web.AppRunner | None = None
        self._bot_user = {
            "id": self.bot_id,
            "username": bot_name,
            "global_name": None,
            "discriminator": "0",
            "avatar": None,
            "bot": True,
            "verified": True,
            "flags": 0,
            "mfa_enabled": False,
        }
        self.users[self.bot_id] = self._bot_user
        self._channels[self.channel] = self._text_channel(self.channel, "general", "Chat here")
        self._channels[self.other_channel] = self._text_channel(self.other_channel, "random", None)
        self._channels[self.thread] = self._thread_channel(
            self.thread, self.channel, "planning", owner=self.thread_owner
        )

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application(middlewares=[self._auth])
        api = "/api/v10"
        app.router.add_get(f"{api}/users/@me", self._get_me)
        app.router.add_get(f"{api}/oauth2/applications/@me", self._get_application)
        app.router.add_get(f"{api}/applications/@me", self._get_application)
        app.router.add_get(f"{api}/gateway", self._get_gateway)
        app.router.add_get(f"{api}/gateway/bot", self._get_gateway)
        app.router.add_get(f"{api}/channels/{{cid}}", self._get_channel)
        app.router.add_post(f"{api}/channels/{{cid}}/messages", self._post_message)
        app.router.add_post(f"{api}/channels/{{cid}}/typing", self._post_typing)
        app.router.add_patch(f"{api}/channels/{{cid}}/messages/{{mid}}", self._patch_message)
        app.router.add_delete(f"{api}/channels/{{cid}}/messages/{{mid}}", self._delete_message)
        app.router.add_post(f"{api}/channels/{{cid}}/messages/{{mid}}/threads", self._post_thread)
        app.router.add_get("/gateway", self._gateway)
        app.router.add_get("/attachments/{aid}/{name}", self._cdn)
        app.router.add_route("*", "/{tail:.*}", self._unhandled)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self._base = f"http://{host}:{port}"
        self.api_base_url = f"http://{host}:{port}{api}"
        self.gateway_url = f"ws://{host}:{port}/gateway"

    async def stop(self) -> None:
        if self._session is not None and self._session.conn is not None:
            with contextlib.suppress(Exception):
                await self._session.conn.ws.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeDiscord:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # --- the world -----------------------------------------------------------------------

    def snowflake(self) -> str:
        """A fresh, increasing id with a real timestamp (discord.py reads some of them)."""
        value = (int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22
        self._last_snowflake = max(value, self._last_snowflake + 1)
        return str(self._last_snowflake)

    def add_user(self, user_id: str, name: str) -> dict[str, Any]:
        self.users[user_id] = {
            "id": user_id,
            "username": name.lower(),
            "global_name": name,
            "discriminator": "0",
            "avatar": None,
        }
        return self.users[user_id]

    def _user(self, user_id: str) -> dict[str, Any]:
        return self.users.get(user_id) or self.add_user(user_id, f"user{user_id}")

    def dm_channel(self, user_id: str) -> str:
        """The DM channel between the bot and this user (made on first use)."""
        if user_id not in self._dm_channels:
            channel_id = self.snowflake()
            self._dm_channels[user_id] = channel_id
            self._channels[channel_id] = {
                "id": channel_id,
                "type": 1,
                "last_message_id": None,
                "recipients": [self._user(user_id)],
            }
        return self._dm_channels[user_id]

    async def add_thread(self, parent: str, name: str, owner: str) -> str:
        """A public thread user `owner` starts after the bot connected (THREAD_CREATE)."""
        thread_id = self.snowflake()
        self._channels[thread_id] = thread = self._thread_channel(thread_id, parent, name, owner)
        await self.dispatch("THREAD_CREATE", thread | {"newly_created": True})
        return thread_id

    def _text_channel(self, channel_id: str, name: str, topic: str | None) -> dict[str, Any]:
        return {
            "id": channel_id,
            "type": 0,
            "guild_id": self.guild_id,
            "name": name,
            "topic": topic,
            "position": len(self._channels),
            "nsfw": False,
            "parent_id": None,
            "permission_overwrites": [],
            "rate_limit_per_user": 0,
            "last_message_id": None,
        }

    def _thread_channel(self, thread_id: str, parent: str, name: str, owner: str) -> dict[str, Any]:
        return {
            "id": thread_id,
            "type": 11,
            "guild_id": self.guild_id,
            "parent_id": parent,
            "owner_id": owner,
            "name": name,
            "last_message_id": None,
            "message_count": 0,
            "member_count": 1,
            "rate_limit_per_user": 0,
            "flags": 0,
            "thread_metadata": {
                "archived": False,
                "auto_archive_duration": 1440,
                "archive_timestamp": _now_iso(),
                "locked": False,
            },
        }

    def _member(self, roles: list[str] | None = None) -> dict[str, Any]:
        return {
            "roles": roles or [],
            "joined_at": _now_iso(),
            "nick": None,
            "deaf": False,
            "mute": False,
            "flags": 0,
        }

    def _guild(self) -> dict[str, Any]:
        role = {
            "color": 0,
            "hoist": False,
            "mentionable": False,
            "flags": 0,
        }
        guild_channels = [c for c in self._channels.values() if c.get("type") == 0]
        threads = [c for c in self._channels.values() if c.get("type") == 11]
        return {
            "id": self.guild_id,
            "name": "Test Guild",
            "owner_id": "1",
            "unavailable": False,
            "member_count": 3,
            "large": False,
            "features": [],
            "roles": [
                role
                | {"id": self.guild_id, "name": "@everyone", "permissions": "1024", "position": 0},
                role
                | {
                    "id": self.bot_role,
                    "name": self.bot_name,
                    "permissions": "309237713920",
                    "position": 1,
                    "managed": True,
                    "tags": {"bot_id": self.bot_id},
                },
            ],
            "emojis": [],
            "stickers": [],
            "channels": guild_channels,
            "threads": threads,
            "members": [self._member([self.bot_role]) | {"user": self._bot_user}],
            "voice_states": [],
            "presences": [],
            "stage_instances": [],
            "guild_scheduled_events": [],
            "soundboard_sounds": [],
        }

    def _message(
        self,
        channel_id: str,
        author: dict[str, Any],
        content: str,
        *,
        mentions: Sequence[str] = (),
        reference: str | None = None,
        nonce: str | None = None,
    ) -> dict[str, Any]:
        channel = self._channels[channel_id]
        message: dict[str, Any] = {
            "id": self.snowflake(),
            "channel_id": channel_id,
            "author": author,
            "content": content,
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [self._user(u) for u in mentions],
            "mention_roles": [],
            "attachments": [],
            "embeds": [],
            "pinned": False,
            "type": 0,
            "flags": 0,
        }
        if nonce is not None:
            message["nonce"] = nonce
        if "guild_id" in channel:
            message["guild_id"] = self.guild_id
            message["member"] = self._member()
        if reference is not None:
            message["type"] = 19
            message["message_reference"] = {
                "type": 0,
                "message_id": reference,
                "channel_id": channel_id,
                **({"guild_id": self.guild_id} if "guild_id" in channel else {}),
            }
            message["referenced_message"] = self.messages.get(reference)
        self.messages[message["id"]] = message
        return message

    # --- driving the bot: user messages --------------------------------------------------

    def attachment(
        self,
        filename: str,
        data: bytes,
        content_type: str | None,
        *,
        declared_size: int | None = None,
        voice: bool = False,
    ) -> dict[str, Any]:
        """An attachment object (served by the fake CDN) for `dm(..., attachments=)`."""
        attachment_id = self.snowflake()
        self.cdn[attachment_id] = data
        found: dict[str, Any] = {
            "id": attachment_id,
            "filename": filename,
            "size": len(data) if declared_size is None else declared_size,
            "url": f"{self._base}/attachments/{attachment_id}/{filename}",
            "proxy_url": f"{self._base}/attachments/{attachment_id}/{filename}",
        }
        if content_type is not None:
            found["content_type"] = content_type
        if voice:
            found["flags"] = 1 << 13  # IS_VOICE_MESSAGE
            found["duration_secs"] = 3.0
            found["waveform"] = ""
        return found

    async def dm(
        self, user_id: str, text: str, *, attachments: Sequence[dict[str, Any]] = ()
    ) -> str:
        """A user writes the bot a DM (with `attachments`); returns the message id."""
        message = self._message(self.dm_channel(user_id), self._user(user_id), text)
        message["attachments"] = list(attachments)
        await self.dispatch("MESSAGE_CREATE", message)
        return str(message["id"])

    async def guild_message(
        self,
        channel: str,
        user_id: str,
        text: str,
        *,
        mentions: Sequence[str] = (),
        thread: str | None = None,
        reference: str | None = None,
    ) -> str:
        """A user writes in a guild channel (or in `thread`); returns the message id.
        `mentions` are user ids (put ``<@id>`` in `text` yourself, as the client does);
        `reference` makes it a reply to that message."""
        where = thread or channel
        message = self._message(
            where, self._user(user_id), text, mentions=mentions, reference=reference
        )
        await self.dispatch("MESSAGE_CREATE", message)
        return str(message["id"])

    async def redeliver(self, message_id: str) -> None:
        """Dispatch the same MESSAGE_CREATE again (at-least-once delivery)."""
        await self.dispatch("MESSAGE_CREATE", self.messages[message_id])

    # --- faults --------------------------------------------------------------------------

    def fail_next_send(self, status: int = 429, retry_after: float = 0.5) -> None:
        """Refuse the next message POST (429: rate limited for `retry_after` seconds)."""
        self._faults.append(_Fault(status=status, retry_after=retry_after))

    def fail_next_edit(self, retry_after: float = 0.5, times: int = 1) -> None:
        """Answer the next message PATCHes 429 (rate limited for `retry_after` seconds)."""
        self._edit_faults.extend(_Fault(status=429, retry_after=retry_after) for _ in range(times))

    def chat_view(self, channel_id: str) -> list[str]:
        """The bot's messages in a channel as they read now (edits applied, deletions
        gone), oldest first."""
        return [
            m["content"]
            for m in self.messages.values()
            if m["channel_id"] == channel_id
            and m["author"]["id"] == self._bot_user["id"]
            and not m.get("deleted")
        ]

    def delay_next(self, seconds: float) -> None:
        """Sleep before answering the next message POST (normally)."""
        self._faults.append(_Fault(delay=seconds))

    async def drop_connection(self, code: int | None = None, *, resumable: bool = True) -> None:
        """Cut the gateway connection: abruptly (no close frame) or with a close `code`.
        A resumable session gets the events dispatched meanwhile replayed on RESUME; an
        unresumable one answers RESUME with INVALID_SESSION, so the bot must IDENTIFY."""
        session = self._session
        if session is None or session.conn is None:
            raise RuntimeError("no gateway connection to drop")
        conn, session.conn = session.conn, None
        if not resumable:
            self._session = None
        if code is None:
            conn.abort()
        else:
            await conn.ws.close(code=code)

    def sent_to(self, channel_id: str) -> list[str]:
        return [m["content"] for m in self.sent if m["channel_id"] == channel_id]

    # --- gateway -------------------------------------------------------------------------

    async def dispatch(self, event: str, data: dict[str, Any]) -> None:
        """Send a DISPATCH (op 0) to the current session, or buffer it for its RESUME."""
        session = self._session
        if session is None:
            raise RuntimeError("the bot never identified; nothing to dispatch to")
        session.seq += 1
        frame = {"op": 0, "t": event, "s": session.seq, "d": data}
        session.frames.append(frame)
        if session.conn is not None:
            try:
                await session.conn.send(frame)
            except (ConnectionError, RuntimeError):
                session.conn = None  # the RESUME replays it

    async def dispatch_raw(self, event: str, data: bytes) -> None:
        """A DISPATCH whose `d` is raw JSON text (perhaps invalid, or too deep for any
        JSON encoder), to the live connection; it is not replayed on RESUME."""
        session = self._session
        if session is None or session.conn is None:
            raise RuntimeError("no gateway connection to dispatch to")
        session.seq += 1
        frame = f'{{"op": 0, "t": "{event}", "s": {session.seq}, "d": '.encode() + data + b"}"
        await session.conn.send_text(frame)

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        self.connections.append(dict(request.query))
        conn = _Connection(ws, request, compress=request.query.get("compress") == "zlib-stream")
        if request.query.get("v") != "10" or request.query.get("encoding", "json") != "json":
            await ws.close(code=4012, message=b"Invalid API version or encoding")
            return ws
        await conn.send(
            {"op": 10, "s": None, "t": None, "d": {"heartbeat_interval": HEARTBEAT_INTERVAL_MS}}
        )
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    continue
                payload = json.loads(msg.data)
                op, data = payload.get("op"), payload.get("d")
                if op == 1:
                    await conn.send({"op": 11, "s": None, "t": None, "d": None})
                elif op == 2:
                    await self._identify(conn, data)
                elif op == 6:
                    await self._resume(conn, data)
        finally:
            session = self._session
            if session is not None and session.conn is conn:
                session.conn = None
        return ws

    async def _identify(self, conn: _Connection, data: dict[str, Any]) -> None:
        if data.get("token") != self.token:
            await conn.ws.close(code=4004, message=b"Authentication failed.")
            return
        self.identifies.append({k: v for k, v in data.items() if k != "token"})
        if not self.message_content_allowed and data.get("intents", 0) & MESSAGE_CONTENT_INTENT:
            await conn.ws.close(code=4014, message=b"Disallowed intent(s).")
            return
        self._session = session = _Session(id=secrets.token_hex(16), conn=conn)
        ready = {
            "v": 10,
            "user": self._bot_user,
            "guilds": [{"id": self.guild_id, "unavailable": True}],
            "session_id": session.id,
            "resume_gateway_url": self.gateway_url,
            "application": {"id": self.application_id, "flags": 0},
            "private_channels": [],
            "relationships": [],
            "presences": [],
        }
        await self.dispatch("READY", ready)
        await self.dispatch("GUILD_CREATE", self._guild())

    async def _resume(self, conn: _Connection, data: dict[str, Any]) -> None:
        if data.get("token") != self.token:
            await conn.ws.close(code=4004, message=b"Authentication failed.")
            return
        self.resumes.append({k: v for k, v in data.items() if k != "token"})
        session = self._session
        if session is None or data.get("session_id") != session.id:
            await conn.send({"op": 9, "s": None, "t": None, "d": False})
            return
        last = data.get("seq") or 0
        while missed := [f for f in session.frames if f["s"] > last]:  # some may arrive meanwhile
            for frame in missed:
                await conn.send(frame)
                last = frame["s"]
        session.conn = conn
        await self.dispatch("RESUMED", {})

    # --- REST ----------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.path.startswith("/api/"):
            return await handler(request)
        self.requests.append((request.method, request.path))
        if request.headers.get("Authorization") != f"Bot {self.token}":
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        return await handler(request)

    async def _unhandled(self, request: web.Request) -> web.Response:
        self.unhandled.append((request.method, request.path))
        return _json({"message": "404: Not Found", "code": 0}, status=404)

    async def _get_me(self, request: web.Request) -> web.Response:
        return _json(self._bot_user)

    async def _get_application(self, request: web.Request) -> web.Response:
        owner = self._user("1")
        return _json(
            {
                "id": self.application_id,
                "name": self.bot_name,
                "icon": None,
                "description": "",
                "bot_public": False,
                "bot_require_code_grant": False,
                "verify_key": "0" * 64,
                "flags": 0,
                "owner": owner,
                "team": None,
                "bot": self._bot_user,
            }
        )

    async def _get_gateway(self, request: web.Request) -> web.Response:
        return _json(
            {
                "url": self.gateway_url,
                "shards": 1,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": 999,
                    "reset_after": 14400000,
                    "max_concurrency": 1,
                },
            }
        )

    async def _get_channel(self, request: web.Request) -> web.Response:
        channel = self._channels.get(request.match_info["cid"])
        if channel is None:
            return _json(UNKNOWN_CHANNEL, status=404)
        return _json(channel)

    async def _cdn(self, request: web.Request) -> web.Response:
        data = self.cdn.get(request.match_info["aid"])
        if data is None:
            return web.Response(status=404)
        self.cdn_downloads.append(request.match_info["aid"])
        return web.Response(body=data, content_type="application/octet-stream")

    async def _post_message(self, request: web.Request) -> web.Response:
        channel_id = request.match_info["cid"]
        files: list[tuple[str, bytes]] = []
        if request.content_type == "multipart/form-data":  # an upload: payload_json + files
            form = await request.post()
            payload = form.get("payload_json")
            body = json.loads(payload) if isinstance(payload, str) else {}
            files = [
                (v.filename, v.file.read()) for v in form.values() if isinstance(v, web.FileField)
            ]
        else:
            body = await request.json()
        self.send_attempts.append(time.monotonic())
        fault = self._faults.popleft() if self._faults else _Fault()
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.status == 429:
            return _rate_limited(fault.retry_after)
        if fault.status >= 400:
            return _json({"message": "fault", "code": 0}, status=fault.status)
        if channel_id not in self._channels:
            return _json(UNKNOWN_CHANNEL, status=404)
        nonce = body.get("nonce")
        if body.get("enforce_nonce") and nonce is not None and nonce in self._nonces:
            return _json(self._nonces[nonce], headers=_bucket_headers(4))
        if not body.get("content") and not files:
            return _json({"message": "Cannot send an empty message", "code": 50006}, 400)
        ref = body.get("message_reference") or {}
        reference = str(ref["message_id"]) if ref.get("message_id") is not None else None
        if reference is not None and reference not in self.messages:
            if ref.get("fail_if_not_exists", True):
                return _json({"message": "Unknown message", "code": 10008}, 400)
            reference = None
        message = self._message(
            channel_id, self._bot_user, body.get("content") or "", reference=reference, nonce=nonce
        )
        for filename, data in files:
            self.uploads.append(
                {
                    "filename": filename,
                    "data": data,
                    "content": body.get("content"),
                    "channel_id": channel_id,
                }
            )
            message["attachments"].append(
                {
                    "id": self.snowflake(),
                    "filename": filename,
                    "size": len(data),
                    "url": f"{self._base}/attachments/x/{filename}",
                    "proxy_url": "",
                }
            )
        if nonce is not None:
            self._nonces[nonce] = message
        self.sent.append(body | {"id": message["id"], "channel_id": channel_id})
        if self._session is not None:
            await self.dispatch("MESSAGE_CREATE", message)  # Discord echoes the bot's own
        return _json(message, headers=_bucket_headers(4))

    async def _patch_message(self, request: web.Request) -> web.Response:
        message_id = request.match_info["mid"]
        body = await request.json()
        self.edit_attempts.append(time.monotonic())
        if self._edit_faults:
            fault = self._edit_faults.popleft()
            return _rate_limited(fault.retry_after)
        message = self.messages.get(message_id)
        if message is None or message.get("deleted"):
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        if "content" in body:
            if not body["content"]:
                return _json({"message": "Cannot send an empty message", "code": 50006}, 400)
            message["content"] = body["content"]
            message["edited_timestamp"] = _now_iso()
        self.edits.append(body | {"id": message_id, "at": time.monotonic()})
        return _json(message, headers=_bucket_headers(4))

    async def _delete_message(self, request: web.Request) -> web.Response:
        message = self.messages.get(request.match_info["mid"])
        if message is None or message.get("deleted"):
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        message["deleted"] = True
        self.deleted.append(message["id"])
        return web.Response(status=204)

    async def _post_typing(self, request: web.Request) -> web.Response:
        channel_id = request.match_info["cid"]
        if channel_id not in self._channels:
            return _json(UNKNOWN_CHANNEL, status=404)
        self.typing.append(channel_id)
        return web.Response(status=204)

    async def _post_thread(self, request: web.Request) -> web.Response:
        channel_id, message_id = request.match_info["cid"], request.match_info["mid"]
        body = await request.json()
        if channel_id not in self._channels or message_id not in self.messages:
            return _json(UNKNOWN_CHANNEL, status=404)
        if message_id in self._channels:  # a thread's id is its starter message's id
            return _json(THREAD_EXISTS, status=400)
        thread = self._thread_channel(message_id, channel_id, body["name"], self.bot_id)
        self._channels[message_id] = thread
        self.threads_created.append(body | {"id": message_id, "parent_id": channel_id})
        await self.dispatch("THREAD_CREATE", thread | {"newly_created": True})
        return _json(thread, status=201)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # Exactly "application/json", as Discord sends it: discord.py parses only that (with
    # "; charset=utf-8" appended, as aiohttp's json_response does, it sees a string).
    body = json.dumps(data).encode()
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def _bucket_headers(remaining: int, reset_after: float = 1.0) -> dict[str, str]:
    return {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": str(remaining),
        "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
        "X-RateLimit-Reset-After": f"{reset_after:.3f}",
        "X-RateLimit-Bucket": "fake-channel-messages",
    }


def _rate_limited(retry_after: float) -> web.Response:
    headers = _bucket_headers(0, retry_after) | {
        "Retry-After": str(max(1, round(retry_after))),
        "X-RateLimit-Scope": "user",
        "Via": "1.1 google",
    }
    body = {"message": "You are being rate limited.", "retry_after": retry_after, "global": False}
    return _json(body, status=429, headers=headers)
