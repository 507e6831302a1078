"""The Telegram adapter: python-telegram-bot's `Bot` with our own update loop (polling or
the webhook), replies in MarkdownV2, files in and out. The flow: `adapters.telegram`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import telegram
from telegram.constants import ChatAction, ParseMode
from telegram.error import (
    BadRequest,
    ChatMigrated,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
)
from telegram.request import HTTPXRequest
from telegram.warnings import PTBUserWarning

from adapters.base import (
    MAX_RETRY_AFTER_SECONDS,
    AcceptStatus,
    Attachment,
    Backoff,
    FloodWait,
    InboundMedia,
    MessageEvent,
    Platform,
    PlatformAdapter,
    RedactSecret,
    SendResult,
    SessionSource,
    TelegramConfig,
    split_message,
    utf16_len,
)
from adapters.markdown import markdown_v2_len, to_markdown_v2
from adapters.telegram.botapi import (
    COMMANDS,
    is_transient,
    retry_after_seconds,
    send_options,
)
from adapters.telegram.inbound import (
    CHAT_TYPES,
    is_reply_to_bot,
    media_of,
    mentions_bot,
    strip_mention,
)
from adapters.telegram.webhook import WebhookServer

__all__ = ["TelegramAdapter"]

_ALLOWED_UPDATES = ("message",)
_SECRET_CHARS = re.compile(r"[A-Za-z0-9_-]{1,256}")  # what setWebhook accepts

#: sendMessage tries per chunk (429 waits included); of them, at most this many network errors
MAX_SEND_ATTEMPTS = 5
MAX_NETWORK_ATTEMPTS = 3
#: extra read time for getUpdates beyond the long-poll itself (PTB adds poll_timeout to it)
POLL_READ_GRACE_SECONDS = 10.0
# Loggers that print URLs with the bot token in them (filtered: see RedactSecret).
_TOKEN_LOGGERS = ("httpx", "telegram.Bot")


class TelegramAdapter(PlatformAdapter):
    """A Telegram bot over the Bot API (python-telegram-bot 22), polling or webhook.

    After `start()`: `bot_username` is the bot's @name (without the @) and, in webhook
    mode, `webhook_port` is the bound port (config port 0 picks a free one).
    """

    platform = Platform.TELEGRAM
    max_message_length = 4096
    length_fn = staticmethod(utf16_len)  # Telegram counts UTF-16 code units
    stream_mode = "edit"  # sendMessage, then editMessageText

    def __init__(self, config: TelegramConfig) -> None:
        super().__init__(config)
        self.config: TelegramConfig = config
        # Checked when built, before the gateway touches its home: a missing token exits
        # 78 with nothing written. start() runs the same check to read the token.
        self.log.hide(self._check_config())
        self.webhook_port: int | None = None
        self._bot: telegram.Bot | None = None
        self._bot_id: int | None = None
        self._offset: int | None = None  # next getUpdates offset: all below are accepted
        self._connected = False
        self._task: asyncio.Task[None] | None = None
        self._webhook: WebhookServer | None = None
        self._log_filter: RedactSecret | None = None

    @property
    def single_connection(self) -> bool:
        return self.config.mode == "polling"  # getUpdates: one poller per bot token

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Check the token (getMe), register the command menu, then poll or serve.

        A wrong token or webhook setting raises; Telegram being unreachable does not
        (the adapter keeps trying in the background and reports `reconnecting`)."""
        token = self._check_config()
        self._install_log_filter(token)
        self.set_state("starting")
        self._bot = telegram.Bot(
            token,
            base_url=self.config.base_url,
            base_file_url=self._file_base_url(),
            request=HTTPXRequest(
                connection_pool_size=8,
                connect_timeout=10.0,
                read_timeout=20.0,
                write_timeout=20.0,
                pool_timeout=5.0,
            ),
            # Its own single connection, so a long poll never holds up a reply.
            get_updates_request=HTTPXRequest(
                connection_pool_size=1,
                connect_timeout=10.0,
                read_timeout=POLL_READ_GRACE_SECONDS,
                write_timeout=10.0,
                pool_timeout=5.0,
            ),
        )
        try:
            if self.config.mode == "webhook":
                self._webhook = WebhookServer(
                    self.config, self._require_bot, self._accept_update, self.log
                )
                await self._webhook.start()
                self.webhook_port = self._webhook.port
            await self._connect()
        except TelegramError as exc:
            if not is_transient(exc):
                await self._close()
                raise RuntimeError(self._refusal(exc)) from None
            self._connection_lost(exc)
        except BaseException:
            await self._close()
            raise
        if self.config.mode == "polling" or not self._connected:
            self._task = asyncio.create_task(self._run(), name="telegram-updates")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._close()
        self.set_state("stopped")

    def health(self) -> dict[str, Any]:
        return {**super().health(), "mode": self.config.mode, "bot": self.bot_username}

    def _refusal(self, exc: TelegramError) -> str:
        if isinstance(exc, InvalidToken):
            return (
                "Telegram rejected the bot token (platforms.telegram.token); "
                "check it with @BotFather (/token)"
            )
        return f"Telegram refused to set the bot up: {self.log.redact(str(exc))}"

    def _check_config(self) -> str:
        if not self.config.token:
            raise ValueError("platforms.telegram.token is not set; get one from @BotFather")
        if self.config.mode == "webhook":
            if not self.config.webhook_url:
                raise ValueError("platforms.telegram.webhook_url is required in webhook mode")
            secret = self.config.webhook_secret
            if not secret or not _SECRET_CHARS.fullmatch(secret):
                # Without it anyone who finds the URL could post updates as any user.
                raise ValueError(
                    "platforms.telegram.webhook_secret is required in webhook mode: "
                    "1-256 characters of A-Z, a-z, 0-9, _ and -"
                )
        return self.config.token

    async def _connect(self) -> None:
        """getMe, the command menu, and the delivery mode (one call each)."""
        bot = self._require_bot()
        await bot.initialize()  # getMe; raises InvalidToken for a wrong token
        self.bot_username, self._bot_id = bot.username, bot.id
        try:
            await bot.set_my_commands([telegram.BotCommand(n, d) for n, d in COMMANDS])
        except TelegramError as exc:  # the menu is a convenience; never fail on it
            self.log.warning("telegram_command_menu_failed", error=self._describe(exc))
        if self.config.mode == "polling":
            await bot.delete_webhook(drop_pending_updates=False)
        else:
            await bot.set_webhook(
                url=str(self.config.webhook_url),
                secret_token=self.config.webhook_secret,
                allowed_updates=list(_ALLOWED_UPDATES),
                max_connections=1,  # one at a time: updates reach the gateway in order
            )
        self._connected = True
        self.set_state("running", bot=self.bot_username, mode=self.config.mode)

    async def _run(self) -> None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        while not self._connected:
            delay = backoff.delay()
            await self.retry_pause("connect", backoff.attempt, delay, self.last_error or "")
            try:
                await self._connect()
            except Exception as exc:
                if isinstance(exc, TelegramError) and not is_transient(exc):
                    self._failed(exc)
                    return
                self._connection_lost(exc)
        if self.config.mode == "polling":
            await self._poll_forever()

    async def _close(self) -> None:
        webhook, self._webhook = self._webhook, None
        if webhook is not None:
            await webhook.stop()
        bot, self._bot = self._bot, None
        if bot is not None:
            if self.config.mode == "polling" and self._connected and self._offset is not None:
                # Tell Telegram what we accepted, so a restart is not sent it again.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(3):
                        await bot.get_updates(offset=self._offset, limit=1, timeout=0)
            await bot.shutdown()
        self._connected = False
        self._remove_log_filter()

    # --- polling -------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        failures = 0  # in a row, for the retry lines
        while True:
            try:
                batch = await self._fetch_updates()
            except RetryAfter as exc:
                failures += 1
                delay = min(retry_after_seconds(exc), MAX_RETRY_AFTER_SECONDS)
                await self.retry_pause("poll", failures, delay, self._connection_lost(exc))
                continue
            except InvalidToken as exc:  # revoked while running: retrying cannot help
                self._failed(exc)
                return
            except Exception as exc:  # network, timeout, 409 Conflict
                failures += 1
                error = self._connection_lost(exc)
                await self.retry_pause("poll", failures, backoff.delay(), error)
                continue
            if self.state != "running":
                self.set_state("running")
            backoff.reset()
            failures = 0
            try:
                accepted_all = await self._accept_updates(batch)
            except Exception:
                # The gateway could not take an update; the offset did not move, so the
                # next getUpdates brings it again.
                self.log.exception("telegram_update_not_accepted", retrying=True)
                await backoff.sleep()
                continue
            if not accepted_all:
                # The gateway is shutting down or cannot store them: leave them queued.
                await asyncio.sleep(1.0)
            elif not batch and self.config.poll_timeout == 0:
                await asyncio.sleep(1.0)  # short polling: do not spin on an empty queue

    async def _fetch_updates(self) -> list[tuple[int, telegram.Update | None]]:
        """The next batch as (update_id, update); None for an update python-telegram-bot
        cannot read, so that one is skipped instead of blocking every later one."""
        bot = self._require_bot()
        try:
            updates = await bot.get_updates(
                offset=self._offset,
                timeout=self.config.poll_timeout,
                allowed_updates=list(_ALLOWED_UPDATES),
            )
            return [(update.update_id, update) for update in updates]
        except TelegramError:
            raise
        except Exception as exc:
            # Read again one by one below; each unreadable update gets its own line there.
            self.log.warning("telegram_update_batch_unreadable", error=self._describe(exc))
        # Fetch the same batch as raw JSON (no long poll) and read the updates one by one.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PTBUserWarning)  # "use Bot.get_updates"
            raw = await bot.do_api_request(
                "getUpdates",
                api_kwargs={"offset": self._offset, "allowed_updates": list(_ALLOWED_UPDATES)},
            )
        batch: list[tuple[int, telegram.Update | None]] = []
        for data in raw:
            try:
                batch.append((data["update_id"], telegram.Update.de_json(data, bot)))
            except Exception:
                self.log.exception("telegram_update_skipped", update_id=data.get("update_id"))
                batch.append((data["update_id"], None))
        return batch

    async def _accept_updates(self, batch: list[tuple[int, telegram.Update | None]]) -> bool:
        """Hand updates to the gateway in order, moving the offset past each accepted one.

        False when the gateway did not take one because it is stopping or its store cannot
        write (it stays unconfirmed, and so do the ones after it)."""
        for update_id, update in batch:
            if update is not None and not await self._accept_update(update):
                return False
            # max(): a redelivered old update must not move the offset back.
            self._offset = max(self._offset or 0, update_id + 1)
        return True

    async def _accept_update(self, update: telegram.Update) -> bool:
        try:
            event = self._to_event(update)
        except Exception:
            # The same update would fail the same way on every redelivery: skip it.
            self.log.exception("telegram_update_skipped", update_id=update.update_id)
            return True
        if event is None:
            return True
        assert self.gateway is not None, "bind() the adapter to the gateway before start()"
        accepted = await self.gateway.handle_message(event)
        stopping = accepted.status is AcceptStatus.REFUSED and accepted.session_key is None
        return not stopping and accepted.status is not AcceptStatus.UNAVAILABLE

    def _connection_lost(self, exc: BaseException) -> str:
        """Reconnecting (logged once, then one retry line per attempt); the error text."""
        error = self._describe(exc)
        self.set_state("reconnecting", error)
        return error

    def _failed(self, exc: BaseException) -> None:
        self.set_state("failed", self._describe(exc), action="fix the config and restart")

    def _describe(self, exc: BaseException) -> str:
        return self.log.redact(f"{type(exc).__name__}: {exc}")

    # --- inbound -------------------------------------------------------------------------

    def _to_event(self, update: telegram.Update) -> MessageEvent | None:
        """The gateway's event for a new text message, or None when it is not for us:
        edits, service messages and media without caption, bots, unaddressed group chat."""
        message = update.message
        if message is None or message.from_user is None or message.from_user.is_bot:
            return None
        text = message.text if message.text is not None else message.caption
        chat_type = CHAT_TYPES.get(message.chat.type)
        media = media_of(message)
        if not (text or media) or chat_type is None:
            return None
        text = text or ""
        user = message.from_user
        # message_thread_id is also set on replies in ordinary supergroups; only a forum
        # topic is a thread of its own (its General topic has no id and is the chat).
        topic = message.message_thread_id if message.is_topic_message else None
        source = SessionSource(
            platform=Platform.TELEGRAM,
            chat_id=str(message.chat.id),
            chat_name=message.chat.effective_name,
            chat_type=chat_type,
            user_id=str(user.id),
            user_name=user.full_name or user.username,
            thread_id=str(topic) if topic else None,
            message_id=str(message.message_id),
            is_bot=user.is_bot,
        )
        if not self.addressed_to_bot(
            source,
            mentioned=mentions_bot(message, text, self.bot_username, self._bot_id),
            replied_to_bot=is_reply_to_bot(message, self._bot_id),
        ):
            return None
        return MessageEvent(
            source=source,
            text=strip_mention(text, self.bot_username),
            message_id=str(update.update_id),
            media=media,
        )

    # --- outbound ------------------------------------------------------------------------

    def split(self, text: str) -> list[str]:
        """Split by UTF-16 length, then split again any chunk whose MarkdownV2 escaping
        would not fit, so chunks keep their formatting instead of going out plain."""
        limit = self.max_message_length
        chunks: list[str] = []
        for chunk in super().split(text):
            if markdown_v2_len(chunk) <= limit:
                chunks.append(chunk)
            else:
                chunks.extend(split_message(chunk, limit, markdown_v2_len))
        return chunks

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """Send one chunk; raises when Telegram refuses it or stays unreachable (the
        runner keeps the chunk in its ledger and sends it later)."""
        bot = self._require_bot()
        chat_id: int | str = target.chat_id
        formatted = to_markdown_v2(text)
        markdown = utf16_len(formatted) <= self.max_message_length
        options = send_options(target, reply_to)
        backoff = Backoff(initial=0.5, maximum=5.0)
        attempts = network_errors = 0
        while True:
            attempts += 1
            try:
                message = await bot.send_message(
                    chat_id=chat_id,
                    text=formatted if markdown else text,
                    parse_mode=ParseMode.MARKDOWN_V2 if markdown else None,
                    **options,
                )
                return SendResult(message_id=str(message.message_id))
            except BadRequest as exc:
                if not markdown:
                    raise
                # Most likely our escaping and Telegram's parser disagree: plain text works.
                self.log.info("telegram_markdown_refused", error=str(exc), fallback="plain")
                markdown = False
            except RetryAfter as exc:
                if attempts >= MAX_SEND_ATTEMPTS:
                    raise
                delay = min(retry_after_seconds(exc), MAX_RETRY_AFTER_SECONDS)
                await self.retry_pause("send", attempts, delay, self._describe(exc))
            except ChatMigrated as exc:  # a group became a supergroup: same chat, new id
                if attempts >= MAX_SEND_ATTEMPTS:
                    raise
                chat_id = exc.new_chat_id
            except NetworkError as exc:
                network_errors += 1
                if network_errors >= MAX_NETWORK_ATTEMPTS or attempts >= MAX_SEND_ATTEMPTS:
                    raise
                await self.retry_pause("send", attempts, backoff.delay(), self._describe(exc))

    # --- streamed replies -------------------------------------------------------------------

    async def send_draft(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        """The first message of a streamed reply: one try, a flood wait raised."""
        options = send_options(target, reply_to)
        bot = self._require_bot()
        message = await self._formatted(
            lambda text, mode: bot.send_message(
                chat_id=target.chat_id, text=text, parse_mode=mode, **options
            ),
            text,
        )
        assert isinstance(message, telegram.Message)
        return SendResult(message_id=str(message.message_id))

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        """editMessageText; "message is not modified" is success (the text is there)."""
        bot = self._require_bot()
        try:
            await self._formatted(
                lambda text, mode: bot.edit_message_text(
                    text, chat_id=target.chat_id, message_id=int(message_id), parse_mode=mode
                ),
                text,
            )
        except BadRequest as exc:
            if "not modified" not in str(exc).lower():
                raise

    async def delete(self, target: SessionSource, message_id: str) -> None:
        await self._require_bot().delete_message(chat_id=target.chat_id, message_id=int(message_id))

    async def _formatted(self, call: Any, text: str) -> Any:
        """`call(text, parse_mode)` in MarkdownV2, else (too long escaped, or refused) as
        plain text: a parse error never loses the text. A 429 is `FloodWait`."""
        formatted = to_markdown_v2(text)
        try:
            if utf16_len(formatted) <= self.max_message_length:
                try:
                    return await call(formatted, ParseMode.MARKDOWN_V2)
                except BadRequest as exc:
                    if "parse" not in str(exc).lower() and "entit" not in str(exc).lower():
                        raise
                    self.log.info("telegram_markdown_refused", error=str(exc), fallback="plain")
            return await call(text, None)
        except RetryAfter as exc:
            raise FloodWait(retry_after_seconds(exc)) from exc

    async def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:
        """getFile, then the file streamed from its URL (which holds the token: errors
        are told without it)."""
        bot = self._require_bot()
        try:
            file = await bot.get_file(media.ref)
            if not file.file_path:
                raise RuntimeError("Telegram gave no file path (the file may be over 20 MB)")
            url = file.file_path
            if not url.startswith(("http://", "https://")):
                url = f"{self._file_base_url()}{self.config.token}/{url}"
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client,
                client.stream("GET", url) as response,
            ):
                if response.status_code != 200:
                    raise RuntimeError(f"file download failed: HTTP {response.status_code}")
                async for piece in response.aiter_bytes(1 << 16):
                    yield piece
        except (TelegramError, httpx.HTTPError) as exc:
            raise RuntimeError(self._describe(exc)) from None

    def _file_base_url(self) -> str:
        """`.../bot` -> `.../file/bot`, as the Bot API serves files."""
        base = str(self.config.base_url)
        return base[: -len("bot")] + "file/bot" if base.endswith("/bot") else base + "/file/bot"

    async def send_attachment(
        self,
        target: SessionSource,
        attachment: Attachment,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        """sendPhoto, sendDocument or sendVoice (a URL is passed for Telegram to fetch,
        a path uploaded); the caption as plain text. 429 retry_after is waited out."""
        bot = self._require_bot()
        options: dict[str, Any] = {"chat_id": target.chat_id, **send_options(target, reply_to)}
        if attachment.caption:
            options["caption"] = attachment.caption[:1024]  # Telegram's caption limit
        method = {
            "photo": bot.send_photo,
            "voice": bot.send_voice,
            "document": bot.send_document,
        }[attachment.kind]
        attempts = 0
        while True:
            attempts += 1
            payload: Any = attachment.source if attachment.is_url else Path(attachment.source)
            try:
                message = await method(**{attachment.kind: payload}, **options)
                return SendResult(message_id=str(message.message_id))
            except RetryAfter as exc:
                if attempts >= MAX_SEND_ATTEMPTS:
                    raise
                delay = min(retry_after_seconds(exc), MAX_RETRY_AFTER_SECONDS)
                await self.retry_pause("send_file", attempts, delay, self._describe(exc))

    async def send_typing(self, target: SessionSource) -> None:
        if self._bot is None:
            return
        thread = int(target.thread_id) if target.thread_id else None
        with contextlib.suppress(TelegramError):  # cosmetic: never worth a failure
            await self._bot.send_chat_action(
                chat_id=target.chat_id, action=ChatAction.TYPING, message_thread_id=thread
            )

    # --- helpers -------------------------------------------------------------------------

    def _require_bot(self) -> telegram.Bot:
        if self._bot is None:
            raise RuntimeError("the Telegram adapter is not started")
        return self._bot

    def _install_log_filter(self, token: str) -> None:
        # httpx logs every request URL at INFO and PTB its base URL at DEBUG; the Bot API
        # puts the token in both.
        httpx_log = logging.getLogger("httpx")
        if httpx_log.level == logging.NOTSET:
            httpx_log.setLevel(logging.WARNING)  # one line per long poll is noise anyway
        self._log_filter = RedactSecret(token, _TOKEN_LOGGERS)
        self._log_filter.install()

    def _remove_log_filter(self) -> None:
        if self._log_filter is not None:
            self._log_filter.remove()
            self._log_filter = None
