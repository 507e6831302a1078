"""Slack: slack-bolt (async) over Socket Mode or the HTTP Events API.

    start        auth.test (the bot's user id, for mentions) -> Socket Mode or HTTP server
    Socket Mode  apps.connections.open -> websocket; slack_sdk's aiohttp client reconnects
                 by itself, a small watcher mirrors its connection into `health()`
    HTTP mode    aiohttp server on listen:port/path; bolt checks X-Slack-Signature and
                 the timestamp (else 401) and answers url_verification
    inbound      `message` (im -> dm; channel, group, mpim -> channel) and `app_mention`
                 -> MessageEvent(message_id=event_id) -> gateway.handle_message
    outbound     chat.postMessage, in the thread the message came from; 429s are waited
                 out (Retry-After) by the web client's retry handler
    files        in: a message's `files` (url_private, fetched by the turn with the bot
                 token in the Authorization header, never in a URL); out: files_upload_v2
                 (getUploadURLExternal, upload, completeUploadExternal) into the thread

Bolt acknowledges an event once our listener returned (`process_before_response`), and
`handle_message` only records and queues, so Slack gets its ack within milliseconds; a
listener still busy after ACK_WAIT_SECONDS (a command's reply being sent) acks anyway.
An event the gateway cannot store (disk full) is not acknowledged (HTTP mode: 503), so
Slack sends it again: it retries three times over about five minutes. A retried event
keeps its event_id, which the gateway's durable inbox drops. A channel message that
mentions the bot arrives twice, as `message` and as `app_mention` with different
event_ids: the first one seen is handled, the other is dropped by its (channel, ts).
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.aiohttp import AsyncSocketModeHandler
from slack_bolt.app.async_app import AsyncApp
from slack_bolt.response import BoltResponse
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.async_handler import AsyncRetryHandler
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
)
from slack_sdk.http_retry.request import HttpRequest
from slack_sdk.http_retry.response import HttpResponse
from slack_sdk.http_retry.state import RetryState
from slack_sdk.socket_mode.aiohttp import SocketModeClient
from slack_sdk.web.async_client import AsyncWebClient

from adapters.base import (
    MAX_RETRY_AFTER_SECONDS,
    AcceptStatus,
    Attachment,
    FloodWait,
    InboundMedia,
    MessageEvent,
    Platform,
    PlatformAdapter,
    SendResult,
    SessionSource,
    SlackConfig,
    validate_id,
)
from adapters.markdown import to_mrkdwn
from adapters.slack.events import (
    malformed_events_body,
    media_of,
    signed_by_slack,
    unescape,
    user_name,
)

__all__ = ["SlackAdapter", "slack_len"]

API_TIMEOUT_SECONDS = 30.0  # one Web API request, connect to last byte
CONNECT_TIMEOUT_SECONDS = 30.0  # start(): the first Socket Mode connection
STATE_CHECK_SECONDS = 0.5  # how often the watcher reads the Socket Mode connection
RATE_LIMIT_RETRIES = 5
ACK_WAIT_SECONDS = 2.0  # Slack wants its ack within 3 s
#: plain messages and the two subtypes that still carry a user's words
_HANDLED_SUBTYPES = frozenset({None, "thread_broadcast", "file_share"})
#: (channel, ts) of recently handled messages: a mention's `message`/`app_mention` pair
#: arrives within seconds, so a short memory is enough
_RECENT_MESSAGES = 2048


def slack_len(text: str) -> int:
    """Length of `text` as sent: `&`, `<` and `>` go out as `&amp;`, `&lt;`, `&gt;`."""
    return len(text) + 4 * text.count("&") + 3 * (text.count("<") + text.count(">"))


def _escape(text: str) -> str:
    # Slack reads <...> as links and mentions (<!channel> pings everyone); a reply's
    # text is shown as written instead.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class _RateLimitRetry(AsyncRateLimitErrorRetryHandler):
    """slack_sdk's 429 handler (sleeps Retry-After plus up to 1 s of jitter, then
    retries), except that a Retry-After beyond MAX_RETRY_AFTER_SECONDS, or one that is
    not a whole number, gives up at once: the send fails, the chunk stays pending in the
    gateway's delivery ledger and is re-sent by a later pass."""

    async def _can_retry_async(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> bool:
        if response is None or response.status_code != 429:
            return False
        headers = {name.lower(): values for name, values in response.headers.items()}
        try:
            seconds = int(headers.get("retry-after", ["1"])[0])
        except ValueError:
            return False
        return seconds <= MAX_RETRY_AFTER_SECONDS


class SlackAdapter(PlatformAdapter):
    """One Slack workspace through a bot token, in Socket Mode or HTTP (Events API) mode.

    `bot_user_id` is known after `start()`; in HTTP mode `port` is the bound port (config
    port 0 picks a free one). `ping_interval` (seconds) paces Socket Mode's keep-alive
    pings and how soon a dead connection is noticed and replaced.
    """

    @property
    def single_connection(self) -> bool:
        return self.config.mode == "socket"  # one Socket Mode connection per app

    platform = Platform.SLACK
    stream_mode = "edit"  # chat.postMessage, then chat.update
    max_message_length = 40000  # chat.postMessage truncates text beyond this
    length_fn = staticmethod(slack_len)

    def __init__(self, config: SlackConfig, *, ping_interval: float = 10.0) -> None:
        super().__init__(config)
        self.config = config
        _check_config(config)
        self.log.hide(config.bot_token, config.app_token, config.signing_secret)
        self.ping_interval = ping_interval
        self.bot_user_id: str | None = None
        self.port = config.port
        self._mention: re.Pattern[str] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._client: AsyncWebClient | None = None
        self._stream_client: AsyncWebClient | None = None  # streamed replies: no 429 sleeps
        self._socket: AsyncSocketModeHandler | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._server: web.AppRunner | None = None
        self._recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._handling: set[asyncio.Task[Any]] = set()  # acked before they finished

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Learn who the bot is, then connect (Socket Mode) or listen (HTTP mode).

        Raises ConnectionError (an OSError) when Slack rejects a token or cannot be
        reached within CONNECT_TIMEOUT_SECONDS; the message names the config key."""
        self.set_state("starting")
        try:
            await self._connect_web_api()
            app = self._build_app()
            if self.config.mode == "socket":
                await self._start_socket_mode(app)
            else:
                await self._start_http_server(app)
        except Exception as exc:
            await self._close()
            self.set_state("failed", error=str(exc))
            raise
        where = {"listen": f"{self.config.listen}:{self.port}{self.config.path}"}
        self.set_state(
            "running",
            mode=self.config.mode,
            bot_user_id=self.bot_user_id,
            **(where if self.config.mode == "http" else {}),
        )

    async def stop(self) -> None:
        await self._close()
        self.set_state("stopped")

    def health(self) -> dict[str, Any]:
        health = super().health()
        health.update(mode=self.config.mode, bot_user_id=self.bot_user_id)
        if self.config.mode == "http":
            health["listen"] = f"{self.config.listen}:{self.port}{self.config.path}"
        return health

    async def _connect_web_api(self) -> None:
        # One session for every Web API call (and the Socket Mode URL requests), closed
        # by stop(); without it slack_sdk opens a new connection per call.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=API_TIMEOUT_SECONDS)
        )
        retry_handlers: list[AsyncRetryHandler] = [
            AsyncConnectionErrorRetryHandler(),
            _RateLimitRetry(max_retry_count=RATE_LIMIT_RETRIES),
        ]
        self._client = AsyncWebClient(
            token=self.config.bot_token,
            base_url=self.config.api_base_url,
            session=self._session,
            retry_handlers=retry_handlers,
        )
        try:
            auth = await self._client.auth_test()
        except SlackApiError as exc:
            raise ConnectionError(
                f"Slack rejected platforms.slack.bot_token ({exc.response.get('error')}); "
                "use the Bot User OAuth Token (xoxb-...) of an app installed in the workspace"
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ConnectionError(
                f"cannot reach the Slack Web API at {self.config.api_base_url} "
                f"({type(exc).__name__}: {exc}); check the network or platforms.slack.api_base_url"
            ) from exc
        self.bot_user_id = str(auth["user_id"])
        self.bot_username = auth.get("user")
        self._mention = re.compile(rf"\s*<@{re.escape(self.bot_user_id)}(?:\|[^>]*)?>\s*")

    def _build_app(self) -> AsyncApp:
        # No token argument: bolt takes it from the client. (It still reads SLACK_BOT_TOKEN
        # from the environment and, if set, warns "`token` will be unused": harmless.)
        # process_before_response: the ack waits for the gateway's answer, so an event it
        # could not store is left unacknowledged (and Slack sends it again).
        app = AsyncApp(
            client=self._client,
            signing_secret=self.config.signing_secret or "",
            process_before_response=True,
        )
        app.event("message")(self._on_event)
        app.event("app_mention")(self._on_event)
        return app

    async def _start_socket_mode(self, app: AsyncApp) -> None:
        handler = AsyncSocketModeHandler(
            app, self.config.app_token, ping_interval=self.ping_interval
        )
        self._socket = handler
        client: SocketModeClient = handler.client
        # Ask for the websocket URL ourselves first: the client's connect() retries a
        # rejected app token forever, while a URL already set is simply used.
        try:
            client.wss_uri = await client.issue_new_wss_url()
        except SlackApiError as exc:
            raise ConnectionError(
                f"Slack rejected platforms.slack.app_token ({exc.response.get('error')}); "
                "use an app-level token (xapp-...) with the connections:write scope and "
                "enable Socket Mode for the app"
            ) from exc
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS):
                await handler.connect_async()
        except TimeoutError:
            raise ConnectionError(
                f"Slack Socket Mode did not connect within {CONNECT_TIMEOUT_SECONDS:g} s; "
                "check the network (outbound wss to Slack)"
            ) from None
        self._watcher = asyncio.create_task(self._watch_socket(client), name="slack-socket")

    async def _start_http_server(self, app: AsyncApp) -> None:
        secret = str(self.config.signing_secret).encode()

        async def events(request: web.Request) -> web.Response:
            # The signature is checked before anything parses the body, and bodies bolt
            # cannot handle get a 400: nobody can provoke a 500 (or a Slack retry loop).
            try:
                body = await request.read()
            except RequestPayloadError:
                return web.Response(status=400, text="unreadable body")
            if not signed_by_slack(secret, body, request.headers):
                return web.Response(status=401, text="invalid signature")
            problem = malformed_events_body(body, request.content_type)
            if problem is not None:
                return web.Response(status=400, text=problem)
            # Bolt answers url_verification, acks events and runs our listener in a task
            # of its own, so this returns at once.
            try:
                response = await app.async_dispatch(await to_bolt_request(request))
            except Exception as exc:  # a signed body of a shape bolt cannot read
                self.log.warning("slack_event_unprocessable", error=repr(exc))
                return web.Response(status=400, text="unprocessable event body")
            if response.status == 503:  # our listener: the gateway could not store it
                return await to_aiohttp_response(response)
            if response.status >= 500:  # bolt's own "could not process": a retry cannot help
                self.log.warning("slack_event_unprocessable", status=response.status)
                return web.Response(status=400, text="unprocessable event body")
            return await to_aiohttp_response(response)

        server = web.Application()
        server.router.add_post(self.config.path, events)
        runner = web.AppRunner(server, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        self._server = runner
        listen, port = self.config.listen, self.config.port
        try:
            await web.TCPSite(runner, listen, port).start()
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"Slack events server cannot listen on {listen}:{port} ({exc.strerror}); "
                "change platforms.slack.port or platforms.slack.listen",
            ) from exc
        self.port = runner.addresses[0][1]

    async def _watch_socket(self, client: SocketModeClient) -> None:
        """Mirror the Socket Mode connection into the health state. The client replaces
        its connection by itself (after a close, a `disconnect` message or failed pings);
        a new session object means it did, even when quicker than one check."""
        session = client.current_session
        while True:
            await asyncio.sleep(STATE_CHECK_SECONDS)
            connected = await client.is_connected()
            if client.current_session is not session:
                session = client.current_session
                self.set_state("reconnecting")  # counts the reconnect
            if connected and self.state != "running":
                self.set_state("running")
            elif not connected and self.state == "running":
                self.set_state("reconnecting", error="Socket Mode connection lost")

    async def _close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._socket is not None:
            client = self._socket.client
            await self._socket.close_async()
            # close() cancels the client's tasks without waiting for them.
            tasks = [
                t
                for t in (
                    client.message_processor,
                    client.current_session_monitor,
                    client.message_receiver,
                )
                if t is not None
            ]
            await asyncio.gather(*tasks, return_exceptions=True)
            self._socket = None
        if self._server is not None:
            await self._server.cleanup()
            self._server = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- inbound -------------------------------------------------------------------------

    async def _on_event(self, body: dict[str, Any], event: dict[str, Any]) -> BoltResponse | None:
        """Bolt listener for `message` and `app_mention`. Returning acks the event, except
        with a 503: the gateway could not store it, and Slack is to send it again."""
        message = self._to_message_event(body, event)
        if message is None or self.gateway is None:
            return None
        handling = asyncio.ensure_future(self.gateway.handle_message(message))
        self._handling.add(handling)
        handling.add_done_callback(lambda task: self._handled(task, message.message_id))
        done, _ = await asyncio.wait([handling], timeout=ACK_WAIT_SECONDS)
        if not done or handling.exception() is not None:
            return None  # acked; a failure is logged by _handled
        accepted = handling.result()
        if accepted.status is not AcceptStatus.UNAVAILABLE:
            return None
        # Not seen after all: the redelivery must not be taken for a duplicate.
        assert message.source.message_id is not None
        self._recent.pop((message.source.chat_id, message.source.message_id), None)
        return BoltResponse(status=503, body=accepted.detail or "not accepted; retry")

    def _handled(self, handling: asyncio.Task[Any], event_id: str | None) -> None:
        self._handling.discard(handling)
        if not handling.cancelled() and (exc := handling.exception()) is not None:
            self.log.exception("slack_event_failed", exc, event_id=event_id)

    def _to_message_event(self, body: dict[str, Any], event: dict[str, Any]) -> MessageEvent | None:
        """The gateway's event for one Slack event, or None when it is not for us: bot
        messages (ours included), edits and other subtypes, channel messages that do not
        mention the bot, and the second event of a mention's message/app_mention pair."""
        assert self._mention is not None
        user, channel, ts = event.get("user"), event.get("channel"), event.get("ts")
        if (
            event.get("subtype") not in _HANDLED_SUBTYPES
            or event.get("bot_id")
            or not user
            or user == self.bot_user_id
            or not channel
            or not ts
        ):
            return None
        thread_ts = event.get("thread_ts")
        source = SessionSource(
            platform=Platform.SLACK,
            chat_id=channel,
            chat_type="dm" if event.get("channel_type") == "im" else "channel",
            user_id=user,
            user_name=user_name(event) or user,
            thread_id=thread_ts if thread_ts and thread_ts != ts else None,
            guild_id=event.get("team") or body.get("team_id"),
            message_id=ts,
        )
        try:
            for name in ("chat_id", "user_id", "thread_id", "message_id"):
                validate_id(name, getattr(source, name))
        except ValueError as exc:
            self.log.warning("slack_event_dropped", reason=str(exc))
            return None
        text = event.get("text") or ""
        mentioned = event.get("type") == "app_mention" or bool(self._mention.search(text))
        if not self.addressed_to_bot(source, mentioned=mentioned, replied_to_bot=False):
            return None
        media = tuple(media_of(f) for f in event.get("files") or () if f.get("url_private"))
        if not text.strip() and not media:
            return None
        if self._already_handled(channel, ts):
            return None
        return MessageEvent(
            source=source,
            text=unescape(self._mention.sub(" ", text)).strip(),
            message_id=body.get("event_id"),
            media=media,
        )

    def _already_handled(self, channel: str, ts: str) -> bool:
        """Remember (channel, ts); True if it was seen already."""
        key = (channel, ts)
        if key in self._recent:
            return True
        self._recent[key] = None
        if len(self._recent) > _RECENT_MESSAGES:
            self._recent.popitem(last=False)
        return False

    # --- outbound ------------------------------------------------------------------------

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """Post one chunk to the target's channel, in its thread if it came from one.

        `reply_to` is unused: Slack has no reply-to, only threads. A 429 is retried after
        Retry-After (up to RATE_LIMIT_RETRIES times); other errors raise SlackApiError and
        the gateway re-sends the chunk later."""
        if self._client is None:
            raise ConnectionError("the Slack adapter is not started")
        response = await self._client.chat_postMessage(
            channel=target.chat_id,
            text=to_mrkdwn(text),
            thread_ts=target.thread_id,
            unfurl_links=False,
        )
        return SendResult(message_id=response.get("ts"))

    # --- streamed replies -------------------------------------------------------------------

    async def send_draft(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        response = await self._streaming_call(
            "chat_postMessage",
            channel=target.chat_id,
            text=to_mrkdwn(text),
            thread_ts=target.thread_id,
            unfurl_links=False,
        )
        return SendResult(message_id=response.get("ts"))

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        await self._streaming_call(
            "chat_update", channel=target.chat_id, ts=message_id, text=to_mrkdwn(text)
        )

    async def delete(self, target: SessionSource, message_id: str) -> None:
        await self._streaming_call("chat_delete", channel=target.chat_id, ts=message_id)

    async def _streaming_call(self, method: str, **params: Any) -> Any:
        """A Web API call that raises `FloodWait` on a 429 instead of sleeping it out (a
        client of its own, without the rate-limit retry handler of `send`'s)."""
        if self._client is None:
            raise ConnectionError("the Slack adapter is not started")
        if self._stream_client is None or self._stream_client.session is not self._session:
            self._stream_client = AsyncWebClient(
                token=self.config.bot_token,
                base_url=self.config.api_base_url,
                session=self._session,
                retry_handlers=[AsyncConnectionErrorRetryHandler()],
            )
        try:
            return await getattr(self._stream_client, method)(**params)
        except SlackApiError as exc:
            if exc.response.status_code == 429:
                try:
                    seconds = float(exc.response.headers.get("Retry-After", "1"))
                except (TypeError, ValueError):
                    seconds = 1.0
                raise FloodWait(seconds) from exc
            raise

    async def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:
        """A file's url_private, streamed; the bot token goes in the Authorization header
        (Slack answers an HTML login page without it)."""
        if self._session is None:
            raise ConnectionError("the Slack adapter is not started")
        headers = {"Authorization": f"Bearer {self.config.bot_token}"}
        async with self._session.get(media.ref, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"Slack file download failed: HTTP {response.status}")
            async for piece in response.content.iter_chunked(1 << 16):
                yield piece

    async def send_attachment(
        self,
        target: SessionSource,
        attachment: Attachment,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """A local file through files_upload_v2 with the caption as its comment; a URL as
        a message (Slack shows its preview)."""
        if self._client is None:
            raise ConnectionError("the Slack adapter is not started")
        caption = _escape(attachment.caption) if attachment.caption else None
        if attachment.is_url:
            text = f"{caption}\n{attachment.source}" if caption else attachment.source
            response = await self._client.chat_postMessage(
                channel=target.chat_id, text=text, thread_ts=target.thread_id
            )
            return SendResult(message_id=response.get("ts"))
        data = await asyncio.to_thread(Path(attachment.source).read_bytes)
        response = await self._client.files_upload_v2(
            channel=target.chat_id,
            content=data,
            filename=attachment.name,
            title=attachment.name,
            initial_comment=caption,
            thread_ts=target.thread_id,
        )
        file = response.get("file") or {}
        return SendResult(message_id=file.get("id"))

    async def send_typing(self, target: SessionSource) -> None:
        """Slack has no typing indicator for bots (only the legacy RTM API had one)."""


def _check_config(config: SlackConfig) -> None:
    if not config.bot_token:
        raise ValueError(
            "platforms.slack.bot_token is required: the app's Bot User OAuth Token (xoxb-...)"
        )
    if config.mode == "socket" and not config.app_token:
        raise ValueError(
            "platforms.slack.app_token is required in Socket Mode: an app-level token "
            "(xapp-...) with connections:write; or set platforms.slack.mode: http"
        )
    if config.mode == "http" and not config.signing_secret:
        raise ValueError(
            "platforms.slack.signing_secret is required in HTTP mode: the app's Signing "
            "Secret (Basic Information page), used to verify Slack's requests"
        )
