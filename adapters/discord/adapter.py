"""Discord through discord.py 2: the gateway websocket in, the REST API out.

    MESSAGE_CREATE -> MessageEvent -> gateway.handle_message      (on_message)
    runner -> send(target, chunk) -> POST /channels/{id}/messages  (one chunk <= 2000)
    attachments in: each becomes an InboundMedia (its CDN URL and declared size), fetched
    by the turn; attachments out: a file upload (multipart) with the caption as content

Sessions: a DM is chat type "dm" keyed by its DM channel; a guild channel is "group"
(agent:main:discord:group:<channel>:<user> with group_sessions_per_user); a thread is
"group" with `thread_id`, keyed agent:main:discord:group:<parent channel>:<thread>.

Bots (this one included), webhooks and system messages are ignored. In guild channels the
bot answers only when mentioned or replied to, unless `require_mention` is off or the
channel is in `free_response_channels`; its mention is stripped from the text. With
`auto_thread`, a channel message it answers gets a new thread and the answer goes there;
in a thread the bot started every message is addressed to it.

Discord itself deduplicates re-sends: each chunk carries its delivery id as the nonce with
`enforce_nonce`, so a chunk re-sent after a restart within Discord's window (a few
minutes) returns the message already posted. discord.py waits out 429s (`retry_after`)
and reconnects the gateway with its own backoff, resuming the session when it can.

Process-wide: discord.py keeps the REST base URL (`discord.http.Route.BASE`) and the
gateway URL it connects to (`DiscordWebSocket.DEFAULT_GATEWAY`) in class attributes.
`start()` sets both from the config, so one process talks to one Discord.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import discord
from discord.gateway import DiscordWebSocket
from discord.http import Route

from adapters.base import (
    MAX_RETRY_AFTER_SECONDS,
    AcceptStatus,
    Attachment,
    Backoff,
    DiscordConfig,
    FloodWait,
    InboundMedia,
    MessageEvent,
    Platform,
    PlatformAdapter,
    SendResult,
    SessionSource,
)
from adapters.discord.connection import FATAL_CLOSE, describe_ending, guard_parsers, refusal

__all__ = ["DiscordAdapter"]

READY_TIMEOUT_SECONDS = 30.0
THREAD_NAME_LENGTH = 80
#: Discord's error code for "a thread has already been created for this message"
THREAD_ALREADY_CREATED = 160004
#: replies may ping the people they name, never @everyone, @here or a role
ALLOWED_MENTIONS = discord.AllowedMentions(
    everyone=False, roles=False, users=True, replied_user=False
)
_ANSWERED_TYPES = (discord.MessageType.default, discord.MessageType.reply)


class _Client(discord.Client):
    """discord.py's client with the events the adapter needs routed to it."""

    def __init__(self, adapter: DiscordAdapter, **options: Any) -> None:
        super().__init__(**options)
        self.adapter = adapter

    async def on_ready(self) -> None:
        self.adapter._connected()

    async def on_resumed(self) -> None:
        self.adapter._connected()

    async def on_disconnect(self) -> None:
        self.adapter._disconnected()

    async def on_message(self, message: discord.Message) -> None:
        await self.adapter._on_message(message)

    async def on_error(self, event_method: str, /, *args: Any, **kwargs: Any) -> None:
        self.adapter.log.exception("discord_handler_failed", handler=event_method)


class DiscordAdapter(PlatformAdapter):
    """A Discord bot. Bind it to a gateway, then `start()` (returns once READY arrived).

    `guild_ready_timeout` is how long discord.py waits after the last GUILD_CREATE before
    it calls the connection ready (seconds; discord.py's default is 2). `reconnect_delay`
    is the first wait before a fresh connect() after one ended with an error (seconds,
    doubling to 60).
    """

    @property
    def single_connection(self) -> bool:
        return True  # one gateway session per bot (more would get every event twice)

    platform = Platform.DISCORD
    stream_mode = "edit"  # a message, then message edits
    max_message_length = 2000  # Discord counts Unicode code points, as len() does

    def __init__(
        self,
        config: DiscordConfig,
        *,
        guild_ready_timeout: float = 2.0,
        ready_timeout: float = READY_TIMEOUT_SECONDS,
        reconnect_delay: float = 1.0,
    ) -> None:
        if not config.token:
            raise ValueError(
                "platforms.discord.token is required: the bot token from the Discord "
                "Developer Portal (your application -> Bot -> Reset Token)"
            )
        super().__init__(config)
        self.config = config
        self.log.hide(config.token)
        self.guild_ready_timeout = guild_ready_timeout
        self.ready_timeout = ready_timeout
        self.client: _Client | None = None
        self._connection: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._backoff = Backoff(initial=reconnect_delay, maximum=60.0)
        self._ready = asyncio.Event()
        self._stopping = False
        self.lost_total = 0  # messages the gateway could not store (Discord never resends)
        self._lost_unlogged = 0
        self._lost_logged_at: float | None = None

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Log in over REST, open the gateway in the background, wait for READY.

        Raises ValueError when Discord refuses the settings (token, intents: fix the
        config or the Developer Portal) and ConnectionError when Discord cannot be
        reached or READY does not arrive within `ready_timeout` (worth a retry)."""
        self._stopping = False
        self._ready.clear()
        self.set_state("starting")
        Route.BASE = self.config.api_base_url.rstrip("/")
        intents = discord.Intents.default()
        intents.guilds = intents.guild_messages = intents.dm_messages = True
        intents.message_content = True  # privileged: switched on in the Developer Portal
        self.client = _Client(
            self,
            intents=intents,
            allowed_mentions=ALLOWED_MENTIONS,
            max_ratelimit_timeout=MAX_RETRY_AFTER_SECONDS,
            guild_ready_timeout=self.guild_ready_timeout,
        )
        guard_parsers(self.client, self.log)
        try:
            await self._connect()
        except BaseException as exc:
            await self._close_client()
            self.set_state("failed", error=str(exc))
            raise

    async def _connect(self) -> None:
        assert self.client is not None and self.config.token is not None
        try:
            await self.client.login(self.config.token)
            # discord.py's Client connects to DiscordWebSocket.DEFAULT_GATEWAY, and goes
            # back to it whenever a session cannot be resumed: that is what must point at
            # the gateway (Discord's /gateway/bot answer unless the config names one).
            url = self.config.gateway_url or (await self.client.http.get_bot_gateway())[1]
        except discord.LoginFailure:
            raise ValueError(FATAL_CLOSE[4004]) from None
        except (discord.HTTPException, discord.GatewayNotFound) as exc:
            raise ConnectionError(f"the Discord API at {Route.BASE} failed: {exc}") from None
        DiscordWebSocket.DEFAULT_GATEWAY = type(DiscordWebSocket.DEFAULT_GATEWAY)(url)
        self._connection = asyncio.create_task(
            self.client.connect(reconnect=True), name="discord-gateway"
        )
        ready = asyncio.create_task(self._ready.wait())
        done, _ = await asyncio.wait(
            {self._connection, ready},
            timeout=self.ready_timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
        ready.cancel()
        if self._connection in done:
            refused = refusal(self._connection.exception())
            if refused is not None:
                raise ValueError(refused)
            why = describe_ending(self._connection)
            raise ConnectionError(f"the Discord gateway {url} closed before READY: {why}")
        if not done:
            raise ConnectionError(
                f"no READY from the Discord gateway {url} within {self.ready_timeout:g} s; "
                "check the network and platforms.discord.gateway_url"
            )
        self._connection.add_done_callback(self._connection_ended)

    async def stop(self) -> None:
        self._stopping = True
        await self._close_client()
        self.set_state("stopped")

    async def _close_client(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        client, task = self.client, self._connection
        if client is not None:
            await client.close()
            await self._close_socket()  # what close() passed over: see _close_socket
        if task is not None:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._connection = None

    def health(self) -> dict[str, Any]:
        health = super().health()
        user = self.client.user if self.client is not None else None
        latency = self.client.latency if self.client is not None else math.nan
        health["user"] = str(user) if user is not None else None
        health["latency_ms"] = round(latency * 1000) if math.isfinite(latency) else None
        if self.lost_total:
            health["lost_total"] = self.lost_total
        return health

    # --- connection state (discord.py events) --------------------------------------------

    def _connected(self) -> None:
        assert self.client is not None and self.client.user is not None
        self.bot_username = self.client.user.name
        self._ready.set()
        self._backoff.reset()
        self.set_state("running", user=f"{self.client.user} ({self.client.user.id})")

    def _disconnected(self) -> None:
        # Only a live connection that drops counts; discord.py retries on its own.
        if not self._stopping and self.state == "running":
            self.set_state("reconnecting", error="gateway disconnected; discord.py reconnects")

    def _connection_ended(self, task: asyncio.Task[None]) -> None:
        if self._stopping or task.cancelled():
            return
        error = describe_ending(task)
        exc = task.exception()
        if refusal(exc) is not None:  # a bad token or missing intent: retrying cannot help
            self.set_state("failed", error=error, action="fix the config and restart")
            return
        # Anything else (a payload discord.py could not parse ends its connect() loop) is
        # retried: a fresh connect() after a capped backoff.
        self.set_state("reconnecting", error=error)
        self._supervisor = asyncio.create_task(self._reconnect(), name="discord-reconnect")

    async def _reconnect(self) -> None:
        assert self.client is not None
        await self._close_socket()
        delay = self._backoff.delay()
        await self.retry_pause("connect", self._backoff.attempt, delay, self.last_error or "")
        if self._stopping:
            return
        self._connection = asyncio.create_task(
            self.client.connect(reconnect=True), name="discord-gateway"
        )
        self._connection.add_done_callback(self._connection_ended)

    async def _close_socket(self) -> None:
        """Close the websocket of a connect() that ended with an error, and its heartbeat
        thread with it. discord.py stops that thread only when it closes the socket
        itself, and `Client.close()` passes over a socket that is no longer open: each
        such ending would otherwise leave a thread (and maybe a socket) behind."""
        ws = self.client.ws if self.client is not None else None
        if ws is not None:
            try:
                await ws.close(code=1000)
            except Exception as exc:  # already gone: nothing left to release
                self.log.debug("discord_socket_close_failed", error=str(exc))

    # --- inbound -------------------------------------------------------------------------

    async def _on_message(self, message: discord.Message) -> None:
        if (
            message.author.bot
            or message.webhook_id is not None
            or message.type not in _ANSWERED_TYPES
            or self.gateway is None
        ):
            return
        source = await self._source_for(message)
        if source is None:
            return
        text = message.content
        if source.chat_type != "dm":
            addressed = self.addressed_to_bot(
                source,
                mentioned=self._mentions_me(message) or self._in_my_thread(message),
                replied_to_bot=self._replies_to_me(message),
            )
            if not addressed:
                return
            text = self._strip_my_mentions(message)
        media = tuple(_media_of(a) for a in message.attachments)
        if not text.strip() and not media:
            return
        event = MessageEvent(source=source, text=text, message_id=str(message.id), media=media)
        if self._wants_thread(message, source, text):
            if not await self.authorize(event):
                return  # no thread for someone the bot will not answer
            thread_id = await self._start_thread(message, text)
            if thread_id is not None:
                event.source = replace(source, thread_id=thread_id, parent_chat_id=source.chat_id)
        accepted = await self.gateway.handle_message(event)
        if accepted.status is AcceptStatus.UNAVAILABLE:
            self._lost(accepted.detail)

    def _lost(self, why: str | None) -> None:
        """Discord does not deliver a message twice, so one the gateway could not store
        is lost: counted, and logged at most once a minute."""
        self.lost_total += 1
        self._lost_unlogged += 1
        now = time.monotonic()
        if self._lost_logged_at is None or now - self._lost_logged_at >= 60:
            # Discord never resends: these messages are gone (`lost_total` in /healthz).
            self.log.error(
                "discord_messages_lost",
                count=self._lost_unlogged,
                lost_total=self.lost_total,
                reason=why,
            )
            self._lost_logged_at, self._lost_unlogged = now, 0

    async def _source_for(self, message: discord.Message) -> SessionSource | None:
        channel: Any = message.channel
        if isinstance(channel, discord.PartialMessageable):  # not in discord.py's cache
            assert self.client is not None
            try:
                channel = await self.client.fetch_channel(channel.id)
            except discord.HTTPException as exc:
                self.log.warning(
                    "discord_channel_lookup_failed", channel_id=channel.id, error=str(exc)
                )
                return None
        author = message.author
        common: dict[str, Any] = {
            "platform": Platform.DISCORD,
            "user_id": str(author.id),
            "user_name": author.display_name,
            "is_bot": author.bot,
            "message_id": str(message.id),
        }
        if isinstance(channel, discord.DMChannel):
            return SessionSource(chat_id=str(channel.id), chat_type="dm", **common)
        if isinstance(channel, discord.Thread):
            parent = channel.parent
            return SessionSource(
                chat_id=str(channel.parent_id),
                chat_type="group",
                chat_name=getattr(parent, "name", None),
                chat_topic=getattr(parent, "topic", None),
                thread_id=str(channel.id),
                parent_chat_id=str(channel.parent_id),
                guild_id=str(channel.guild.id),
                **common,
            )
        if isinstance(channel, discord.abc.GuildChannel):
            return SessionSource(
                chat_id=str(channel.id),
                chat_type="group",
                chat_name=channel.name,
                chat_topic=getattr(channel, "topic", None),
                guild_id=str(channel.guild.id),
                **common,
            )
        return None  # group DMs and other channels bots are not in

    def _my_role(self, message: discord.Message) -> discord.Role | None:
        """The role Discord made for this bot in the guild: typing @botname in the client
        sometimes picks the role rather than the user."""
        return message.guild.self_role if message.guild is not None else None

    def _mentions_me(self, message: discord.Message) -> bool:
        assert self.client is not None and self.client.user is not None
        me = self.client.user.id
        role = self._my_role(message)
        return any(user.id == me for user in message.mentions) or (
            role is not None and role in message.role_mentions
        )

    def _in_my_thread(self, message: discord.Message) -> bool:
        """A thread the bot started (auto_thread) is a conversation with it: every message
        there is addressed to it, as in a DM."""
        assert self.client is not None and self.client.user is not None
        channel = message.channel
        return isinstance(channel, discord.Thread) and channel.owner_id == self.client.user.id

    def _replies_to_me(self, message: discord.Message) -> bool:
        assert self.client is not None and self.client.user is not None
        reference = message.reference
        if reference is None:
            return False
        target = reference.resolved
        if not isinstance(target, discord.Message):
            target = reference.cached_message
        return target is not None and target.author.id == self.client.user.id

    def _strip_my_mentions(self, message: discord.Message) -> str:
        assert self.client is not None and self.client.user is not None
        tokens = [f"<@!?{self.client.user.id}>"]
        role = self._my_role(message)
        if role is not None:
            tokens.append(f"<@&{role.id}>")
        pattern = r"\s*(?:" + "|".join(tokens) + r")\s*"
        return re.sub(pattern, " ", message.content).strip()

    def _wants_thread(self, message: discord.Message, source: SessionSource, text: str) -> bool:
        return (
            self.config.auto_thread
            and source.thread_id is None
            and isinstance(message.channel, discord.TextChannel)
            and bool(text.strip())
        )

    async def _start_thread(self, message: discord.Message, text: str) -> str | None:
        """A public thread on `message` for the answer; None leaves it in the channel."""
        name = " ".join(text.split())[:THREAD_NAME_LENGTH]
        try:
            thread = await message.create_thread(name=name)
        except discord.HTTPException as exc:
            if exc.code == THREAD_ALREADY_CREATED:  # a redelivery: the thread exists, and
                return str(message.id)  # a thread started on a message takes its id
            self.log.warning("discord_thread_not_started", message_id=message.id, error=str(exc))
            return None
        return str(thread.id)

    # --- outbound ------------------------------------------------------------------------

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """Post one chunk into the target's thread (else its channel), as a reply to
        `reply_to` when that message is in the same channel."""
        client = self._live_client()
        if not text.strip():
            return SendResult()  # Discord refuses empty messages; there is nothing to say
        channel_id = int(target.thread_id or target.chat_id)
        reference = None
        # A thread started on the user's message has that message's id, and the message
        # itself sits in the parent channel: answer in the thread without a reference.
        if reply_to is not None and reply_to.isdigit() and reply_to != target.thread_id:
            reference = discord.MessageReference(
                message_id=int(reply_to), channel_id=channel_id, fail_if_not_exists=False
            )
        message = await client.get_partial_messageable(channel_id).send(
            text,
            allowed_mentions=ALLOWED_MENTIONS,
            reference=reference,
            nonce=str(delivery_id) if delivery_id is not None else None,
        )
        return SendResult(message_id=str(message.id))

    # --- streamed replies -------------------------------------------------------------------

    async def send_draft(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        try:
            return await self.send(target, text, reply_to)
        except discord.RateLimited as exc:
            raise FloodWait(exc.retry_after) from exc

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        """A message edit (PATCH). discord.py waits out short rate limits itself, inside
        the call; the stream's other edits are skipped meanwhile."""
        if not text.strip():
            return
        try:
            await self._partial(target, message_id).edit(content=text)
        except discord.RateLimited as exc:
            raise FloodWait(exc.retry_after) from exc

    async def delete(self, target: SessionSource, message_id: str) -> None:
        await self._partial(target, message_id).delete()

    def _partial(self, target: SessionSource, message_id: str) -> discord.PartialMessage:
        channel = self._live_client().get_partial_messageable(
            int(target.thread_id or target.chat_id)
        )
        return channel.get_partial_message(int(message_id))

    async def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:
        """The attachment streamed from its CDN URL (no token needed or sent)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(media.ref) as response,
        ):
            if response.status != 200:
                raise RuntimeError(f"attachment download failed: HTTP {response.status}")
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
        """A local file as an upload with the caption as the message text; a URL as text
        (Discord shows its preview). The delivery id is the nonce, as for text."""
        client = self._live_client()
        channel = client.get_partial_messageable(int(target.thread_id or target.chat_id))
        nonce = str(delivery_id) if delivery_id is not None else None
        caption = (attachment.caption or "")[: self.max_message_length]
        if attachment.is_url:
            text = f"{caption}\n{attachment.source}" if caption else attachment.source
            message = await channel.send(text, allowed_mentions=ALLOWED_MENTIONS, nonce=nonce)
        else:
            message = await channel.send(
                caption or None,
                file=discord.File(attachment.source, filename=attachment.name),
                allowed_mentions=ALLOWED_MENTIONS,
                nonce=nonce,
            )
        return SendResult(message_id=str(message.id))

    async def send_typing(self, target: SessionSource) -> None:
        client = self.client
        if client is None or client.is_closed():
            return
        channel = client.get_partial_messageable(int(target.thread_id or target.chat_id))
        with contextlib.suppress(Exception):  # cosmetic: never fail a turn on it
            await channel.typing()

    def _live_client(self) -> _Client:
        if self.client is None or self.client.is_closed():
            raise ConnectionError("the Discord adapter is not started")
        return self.client


def _media_of(attachment: discord.Attachment) -> InboundMedia:
    """An attachment as the turn fetches it: a photo, a voice message, audio or a file."""
    mime = attachment.content_type
    kind = "document"
    if mime is not None and mime.startswith("image/"):
        kind = "photo"
    elif attachment.is_voice_message():
        kind = "voice"
    elif mime is not None and mime.startswith("audio/"):
        kind = "audio"
    return InboundMedia(kind, attachment.url, attachment.filename, mime, attachment.size)
