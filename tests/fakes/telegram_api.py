"""A fake Telegram Bot API on 127.0.0.1, for adapter tests.

Speaks the real wire protocol: ``/bot<TOKEN>/<method>`` over GET or POST (query, form or
JSON parameters), ``{"ok": true, "result": ...}`` answers and Telegram's error bodies
(401 for a wrong token, 429 with ``parameters.retry_after``, 400 for bad MarkdownV2).
getUpdates long-polls and honours ``offset`` exactly like Telegram: updates below it are
confirmed and gone. editMessageText (with "message is not modified") and deleteMessage
act on the sent messages (`chat_view` shows what the chat shows). sendMessage parses
MarkdownV2 (escapes, `code`, ```pre```, bold /
italic / underline / strikethrough / spoiler; it is stricter than Telegram about links and
quotes, which it rejects) and returns the rendered Message. Files: `add_file` stores
bytes under a file_id, getFile answers its file_path (and file_size), and
``/file/bot<TOKEN>/<file_path>`` serves them; sendPhoto / sendDocument / sendVoice take
an uploaded file (multipart) or a URL and are recorded in ``sent_files``.

    async with FakeTelegram(token="123:TEST") as tg:
        bot = telegram.Bot("123:TEST", base_url=tg.base_url)
        update_id = tg.push_message(tg.private_chat(ADA), ADA, "hi")
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

BOT_USER = {
    "id": 7000001,
    "is_bot": True,
    "first_name": "Hermes",
    "username": "hermes_test_bot",
    "can_join_groups": True,
    "can_read_all_group_messages": False,
    "supports_inline_queries": False,
}
# Parameters that are strings on the wire even when they look like JSON (form bodies).
_STRING_PARAMS = frozenset(
    {"text", "caption", "parse_mode", "url", "secret_token", "action", "language_code"}
)


# A photo/document/voice given as a URL or file_id string stays a string.
_FILE_PARAMS = frozenset({"photo", "document", "voice"})


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


class MarkdownError(ValueError):
    """What Telegram answers as 'Bad Request: can't parse entities: ...'."""


@dataclass(slots=True)
class _Fault:
    status: int
    retry_after: int | None = None
    description: str | None = None


class FakeTelegram:
    """The server plus helpers to feed it updates and inspect what the bot sent.

    ``requests``: every (method, params) received; ``sent`` / ``sent_messages``: the
    params of each *delivered* sendMessage and the Message returned for it, in order;
    ``chat_actions``: sendChatAction params; ``commands``: the bot's command list;
    ``webhook``: the setWebhook params in force (None after deleteWebhook).
    """

    def __init__(self, token: str = "123:TEST", bot_user: dict[str, Any] | None = None) -> None:
        self.token = token
        self.bot_user = dict(bot_user or BOT_USER)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.request_times: list[tuple[str, float]] = []  # (method, time.monotonic())
        self.sent: list[dict[str, Any]] = []
        self.sent_messages: list[dict[str, Any]] = []
        self.edits: list[dict[str, Any]] = []  # params of each applied editMessageText
        #: ("send" | "edit" | "delete", time.monotonic(), message_id, text), in order
        self.timeline: list[tuple[str, float, Any, str]] = []
        self.chat_actions: list[dict[str, Any]] = []
        self.commands: list[dict[str, Any]] = []
        self.webhook: dict[str, Any] | None = None
        self.sent_files: list[dict[str, Any]] = []  # {method, params, filename, data}
        self.files: dict[str, bytes] = {}  # file_id -> content
        self.file_sizes: dict[str, int] = {}  # file_id -> the size getFile declares
        self.downloads: list[str] = []  # file paths fetched
        self.deliveries: dict[int, int] = defaultdict(int)  # update_id -> times returned
        self.port = 0
        self._updates: list[dict[str, Any]] = []  # unconfirmed, in update_id order
        self._forced: deque[dict[str, Any]] = deque()  # redeliveries, regardless of offset
        self._known: dict[int, dict[str, Any]] = {}
        self._messages: dict[tuple[int, int], dict[str, Any]] = {}
        self._update_ids = itertools.count(500001)
        self._message_ids = itertools.count(100)
        self._faults: dict[str, deque[_Fault]] = defaultdict(deque)
        self._parse_faults = 0
        self._delays: dict[str, deque[float]] = defaultdict(deque)
        self._drops = 0
        self._changed = asyncio.Event()
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/bot"

    async def start(self) -> FakeTelegram:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        app.router.add_get("/file/bot{token}/{path:.+}", self._download)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        self._closing = True
        self._wake()
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> FakeTelegram:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- building updates ----------------------------------------------------------------

    @staticmethod
    def user(user_id: int, first_name: str, username: str | None = None) -> dict[str, Any]:
        user: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": first_name}
        if username:
            user["username"] = username
        return user

    @staticmethod
    def private_chat(user: dict[str, Any]) -> dict[str, Any]:
        chat = {"id": user["id"], "type": "private", "first_name": user["first_name"]}
        if "username" in user:
            chat["username"] = user["username"]
        return chat

    @staticmethod
    def group_chat(chat_id: int, title: str, *, forum: bool = False) -> dict[str, Any]:
        chat: dict[str, Any] = {"id": chat_id, "type": "supergroup", "title": title}
        if forum:
            chat["is_forum"] = True
        return chat

    def make_message_update(
        self,
        chat: dict[str, Any],
        from_user: dict[str, Any],
        text: str,
        *,
        message_thread_id: int | None = None,
        is_topic: bool = False,
        reply_to: int | dict[str, Any] | None = None,
        entities: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A new-message Update as Telegram builds it (not queued: see push_message).

        ``reply_to`` is a Message object or the id of a message this fake knows in that
        chat. Mentions and commands get their entities unless ``entities`` is given; a
        forum topic message without ``reply_to`` replies to the topic's creation notice,
        as in Telegram."""
        message: dict[str, Any] = {
            "message_id": next(self._message_ids),
            "from": from_user,
            "chat": chat,
            "date": int(time.time()),
            "text": text,
        }
        found = entities if entities is not None else _auto_entities(text)
        if found:
            message["entities"] = found
        if message_thread_id is not None:
            message["message_thread_id"] = message_thread_id
            if is_topic:
                message["is_topic_message"] = True
        if isinstance(reply_to, int):
            message["reply_to_message"] = self._messages[(chat["id"], reply_to)]
        elif reply_to is not None:
            message["reply_to_message"] = reply_to
        elif is_topic and message_thread_id is not None:
            message["reply_to_message"] = {
                "message_id": message_thread_id,
                "from": from_user,
                "chat": chat,
                "date": int(time.time()) - 3600,
                "message_thread_id": message_thread_id,
                "is_topic_message": True,
                "forum_topic_created": {"name": "Topic", "icon_color": 7322096},
            }
        self._messages[(chat["id"], message["message_id"])] = message
        return {"update_id": next(self._update_ids), "message": message}

    def push_message(
        self, chat: dict[str, Any], from_user: dict[str, Any], text: str, **options: Any
    ) -> int:
        """Queue a new message for getUpdates; returns its update_id."""
        return self.push_raw(self.make_message_update(chat, from_user, text, **options))

    def add_file(self, data: bytes, *, declared_size: int | None = None) -> str:
        """Store a file; returns its file_id. `declared_size`: what getFile and the
        message say (default: the real size)."""
        file_id = f"file-{len(self.files) + 1}"
        self.files[file_id] = data
        self.file_sizes[file_id] = len(data) if declared_size is None else declared_size
        return file_id

    def push_media(
        self,
        chat: dict[str, Any],
        from_user: dict[str, Any],
        kind: str,
        file_id: str,
        *,
        caption: str | None = None,
        file_name: str | None = None,
        mime_type: str | None = None,
    ) -> int:
        """Queue a photo / voice / audio / document message for the file `file_id`."""
        update = self.make_message_update(chat, from_user, "")
        message = update["message"]
        del message["text"]
        message.pop("entities", None)
        size = self.file_sizes[file_id]
        meta: dict[str, Any] = {
            "file_id": file_id,
            "file_unique_id": f"u{file_id}",
            "file_size": size,
        }
        if kind == "photo":
            small = {**meta, "file_id": file_id + "-small", "width": 90, "height": 90}
            message["photo"] = [small, {**meta, "width": 1280, "height": 960}]
        elif kind in ("voice", "audio"):
            message[kind] = {**meta, "duration": 3, "mime_type": mime_type or "audio/ogg"}
            if file_name:
                message[kind]["file_name"] = file_name
        else:
            message["document"] = {
                **meta,
                "file_name": file_name or "file.bin",
                "mime_type": mime_type or "application/octet-stream",
            }
        if caption is not None:
            message["caption"] = caption
        return self.push_raw(update)

    def push_raw(self, update: dict[str, Any]) -> int:
        """Queue any Update object (its update_id must be new and increasing)."""
        update_id = int(update["update_id"])
        self._known[update_id] = update
        self._updates.append(update)
        self._wake()
        return update_id

    def redeliver(self, update_id: int) -> None:
        """Deliver an update once more even though it was confirmed: Telegram's
        at-least-once delivery, e.g. after a confirmation lost in a crash."""
        self._forced.append(self._known[update_id])
        self._wake()

    # --- faults --------------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        status: int = 429,
        retry_after: int = 1,
        times: int = 1,
        description: str | None = None,
    ) -> None:
        for _ in range(times):
            self._faults[method].append(
                _Fault(status, retry_after if status == 429 else None, description)
            )

    def fail_parse_next(self, times: int = 1) -> None:
        """The next sendMessage (or editMessageText) with a parse_mode fails as if its
        markup were invalid."""
        self._parse_faults += times

    def drop_connections(self, times: int = 1) -> None:
        """Close the next `times` getUpdates connections without an answer; long polls
        waiting now return first, so the very next poll is the one dropped."""
        self._drops += times
        self._wake()

    def delay_next(self, method: str, seconds: float) -> None:
        self._delays[method].append(seconds)

    # --- webhook side --------------------------------------------------------------------

    async def post_webhook(
        self, url: str, update: dict[str, Any] | bytes, secret: str | None = None
    ) -> int:
        """POST an update to a webhook as Telegram does; returns the HTTP status."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"Content-Type": "application/json"}
        if secret is not None:
            headers["X-Telegram-Bot-Api-Secret-Token"] = secret
        body = update if isinstance(update, bytes) else json.dumps(update).encode()
        async with self._session.post(url, data=body, headers=headers) as response:
            await response.read()
            return response.status

    def methods(self) -> list[str]:
        return [method for method, _ in self.requests]

    # --- server --------------------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        method = request.match_info["method"]
        params = await _read_params(request)
        self.requests.append((method, params))
        self.request_times.append((method, time.monotonic()))
        if self._delays[method]:
            await asyncio.sleep(self._delays[method].popleft())
        if self._faults[method]:
            fault = self._faults[method].popleft()
            return _fault_response(fault)
        handler = getattr(self, f"_api_{method}", None)
        if handler is None:
            return _error(404, "Not Found")
        try:
            result = await handler(request, params)
        except _ApiError as exc:
            return _error(exc.status, exc.description)
        if isinstance(result, web.StreamResponse):
            return result
        return web.json_response({"ok": True, "result": result})

    async def _download(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return web.Response(status=401, text="Unauthorized")
        path = request.match_info["path"]
        file_id = path.rsplit("/", 1)[-1]
        if file_id not in self.files:
            return web.Response(status=404, text="Not Found")
        self.downloads.append(path)
        return web.Response(body=self.files[file_id])

    async def _api_getFile(self, request: web.Request, params: dict[str, Any]) -> Any:
        file_id = str(params.get("file_id"))
        if file_id not in self.files:
            raise _ApiError(400, "Bad Request: invalid file_id")
        if self.file_sizes[file_id] > 20 * 1024 * 1024:
            raise _ApiError(400, "Bad Request: file is too big")
        return {
            "file_id": file_id,
            "file_unique_id": f"u{file_id}",
            "file_size": self.file_sizes[file_id],
            "file_path": f"documents/{file_id}",
        }

    async def _send_file(self, request: web.Request, params: dict[str, Any], kind: str) -> Any:
        chat_id = params.get("chat_id")
        upload = params.get("_files", {}).get(kind)
        given = params.get(kind)
        if chat_id in (None, "") or (upload is None and not isinstance(given, str)):
            raise _ApiError(400, f"Bad Request: chat_id and {kind} are required")
        filename, data = upload if upload is not None else (None, None)
        message: dict[str, Any] = {
            "message_id": next(self._message_ids),
            "from": self.bot_user,
            "chat": {"id": chat_id, "type": "private"},
            "date": int(time.time()),
            kind: {"file_id": f"sent-{len(self.sent_files) + 1}", "file_unique_id": "x"},
        }
        if kind == "photo":
            message["photo"] = [{**message["photo"], "width": 1, "height": 1}]
        elif kind == "voice":
            message["voice"]["duration"] = 1
        if params.get("caption"):
            message["caption"] = params["caption"]
        self.sent_files.append(
            {
                "method": request.match_info["method"],
                "params": params,
                "filename": filename,
                "data": data,
                "url": given if upload is None else None,
            }
        )
        self.sent_messages.append(message)
        return message

    async def _api_sendPhoto(self, request: web.Request, params: dict[str, Any]) -> Any:
        return await self._send_file(request, params, "photo")

    async def _api_sendDocument(self, request: web.Request, params: dict[str, Any]) -> Any:
        return await self._send_file(request, params, "document")

    async def _api_sendVoice(self, request: web.Request, params: dict[str, Any]) -> Any:
        return await self._send_file(request, params, "voice")

    async def _api_getMe(self, request: web.Request, params: dict[str, Any]) -> Any:
        return self.bot_user

    async def _api_setMyCommands(self, request: web.Request, params: dict[str, Any]) -> Any:
        self.commands = list(params.get("commands", []))
        return True

    async def _api_getMyCommands(self, request: web.Request, params: dict[str, Any]) -> Any:
        return self.commands

    async def _api_setWebhook(self, request: web.Request, params: dict[str, Any]) -> Any:
        if not str(params.get("url", "")).startswith("https://"):
            raise _ApiError(400, "Bad Request: bad webhook: An HTTPS URL must be provided")
        self.webhook = params
        return True

    async def _api_deleteWebhook(self, request: web.Request, params: dict[str, Any]) -> Any:
        self.webhook = None
        return True

    async def _api_sendChatAction(self, request: web.Request, params: dict[str, Any]) -> Any:
        self.chat_actions.append(params)
        return True

    async def _api_getUpdates(self, request: web.Request, params: dict[str, Any]) -> Any:
        if self.webhook is not None:
            raise _ApiError(
                409,
                "Conflict: can't use getUpdates method while webhook is active; "
                "use deleteWebhook to delete the webhook first",
            )
        if self._drops:
            self._drops -= 1
            assert request.transport is not None
            request.transport.close()  # the client sees the connection die mid-request
            return web.Response()
        offset = params.get("offset")
        if isinstance(offset, int):  # confirm everything below it, as Telegram does
            self._updates = [u for u in self._updates if u["update_id"] >= offset]
        limit = int(params.get("limit") or 100)
        deadline = time.monotonic() + float(params.get("timeout") or 0)
        while not (self._updates or self._forced or self._closing or self._drops):
            changed = self._changed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                break
        batch = list(self._forced)[:limit]
        for _ in batch:
            self._forced.popleft()
        batch += self._updates[: limit - len(batch)]
        for update in batch:
            self.deliveries[update["update_id"]] += 1
        return batch

    async def _api_sendMessage(self, request: web.Request, params: dict[str, Any]) -> Any:
        chat_id = params.get("chat_id")
        text = params.get("text")
        if chat_id in (None, "") or not isinstance(text, str):
            raise _ApiError(400, "Bad Request: chat_id and text are required")
        parse_mode = params.get("parse_mode")
        entities: list[dict[str, Any]] = []
        rendered = text
        if parse_mode:
            if self._parse_faults:
                self._parse_faults -= 1
                raise _ApiError(
                    400,
                    "Bad Request: can't parse entities: Can't find end of the entity "
                    "starting at byte offset 5",
                )
            if parse_mode != "MarkdownV2":
                raise _ApiError(400, f"Bad Request: unsupported parse_mode {parse_mode}")
            try:
                rendered, entities = parse_markdown_v2(text)
            except MarkdownError as exc:
                raise _ApiError(400, f"Bad Request: can't parse entities: {exc}") from None
        if not rendered.strip():
            raise _ApiError(400, "Bad Request: message text is empty")
        if utf16_len(rendered) > 4096:
            raise _ApiError(400, "Bad Request: message is too long")
        private = isinstance(chat_id, int) and chat_id > 0
        chat = {"id": chat_id, "type": "private" if private else "supergroup"}
        message: dict[str, Any] = {
            "message_id": next(self._message_ids),
            "from": self.bot_user,
            "chat": chat,
            "date": int(time.time()),
            "text": rendered,
        }
        if entities:
            message["entities"] = entities
        thread = params.get("message_thread_id")
        if thread is not None:
            message["message_thread_id"] = thread
            message["is_topic_message"] = True
        reply = params.get("reply_parameters") or {}
        replied = self._messages.get((chat_id, reply.get("message_id")))
        if replied is not None:
            message["reply_to_message"] = replied
        self._messages[(chat_id, message["message_id"])] = message
        self.sent.append(params)
        self.sent_messages.append(message)
        self.timeline.append(("send", time.monotonic(), message["message_id"], rendered))
        return message

    async def _api_editMessageText(self, request: web.Request, params: dict[str, Any]) -> Any:
        chat_id, message_id = params.get("chat_id"), params.get("message_id")
        message = self._messages.get((chat_id, message_id))
        if message is None or message.get("deleted"):
            raise _ApiError(400, "Bad Request: message to edit not found")
        rendered, entities = self._render(params)
        if rendered == message["text"] and entities == message.get("entities", []):
            raise _ApiError(
                400,
                "Bad Request: message is not modified: specified new message content and "
                "reply markup are exactly the same as a current content and reply markup "
                "of the message",
            )
        message["text"] = rendered
        message["entities"] = entities
        message["edit_date"] = int(time.time())
        self.edits.append(params)
        self.timeline.append(("edit", time.monotonic(), message_id, rendered))
        return message

    async def _api_deleteMessage(self, request: web.Request, params: dict[str, Any]) -> Any:
        message = self._messages.get((params.get("chat_id"), params.get("message_id")))
        if message is None or message.get("deleted"):
            raise _ApiError(400, "Bad Request: message to delete not found")
        message["deleted"] = True
        self.timeline.append(("delete", time.monotonic(), params.get("message_id"), ""))
        return True

    def _render(self, params: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        text = params.get("text")
        if not isinstance(text, str):
            raise _ApiError(400, "Bad Request: text is required")
        if not params.get("parse_mode"):
            return text, []
        if self._parse_faults:
            self._parse_faults -= 1
            raise _ApiError(400, "Bad Request: can't parse entities: Can't find end of entity")
        try:
            return parse_markdown_v2(text)
        except MarkdownError as exc:
            raise _ApiError(400, f"Bad Request: can't parse entities: {exc}") from None

    def chat_view(self, chat_id: int | str) -> list[str]:
        """What the chat shows now: the bot's messages not deleted, oldest first."""
        return [
            m["text"]
            for (chat, _), m in self._messages.items()
            if chat == chat_id and not m.get("deleted") and m.get("from") == self.bot_user
        ]


class _ApiError(Exception):
    def __init__(self, status: int, description: str) -> None:
        super().__init__(description)
        self.status, self.description = status, description


def _error(status: int, description: str, **extra: Any) -> web.Response:
    body = {"ok": False, "error_code": status, "description": description, **extra}
    return web.json_response(body, status=status)


def _fault_response(fault: _Fault) -> web.Response:
    if fault.status == 429:
        description = fault.description or f"Too Many Requests: retry after {fault.retry_after}"
        return _error(429, description, parameters={"retry_after": fault.retry_after})
    return _error(fault.status, fault.description or "Internal Server Error")


async def _read_params(request: web.Request) -> dict[str, Any]:
    raw: dict[str, Any] = dict(request.query)
    if request.method == "POST" and request.can_read_body:
        if request.content_type == "application/json":
            body = await request.json()
            if isinstance(body, dict):
                raw.update(body)
        else:
            form = await request.post()
            raw.update({k: v for k, v in form.items() if isinstance(v, str)})
            files = {k: v for k, v in form.items() if isinstance(v, web.FileField)}
            if files:  # multipart uploads (sendPhoto ...): kept as (filename, bytes)
                raw["_files"] = {k: (f.filename, f.file.read()) for k, f in files.items()}
    params: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, str) and key not in _STRING_PARAMS and key not in _FILE_PARAMS:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        params[key] = value
    return params


def _auto_entities(text: str) -> list[dict[str, Any]]:
    """The mention and bot_command entities Telegram adds to a plain message."""
    entities = []
    for match in re.finditer(r"(?<![\w@])(@\w{5,32})|^(/\w+(?:@\w+)?)", text):
        start = utf16_len(text[: match.start()])
        kind = "mention" if match.group(1) else "bot_command"
        entities.append({"type": kind, "offset": start, "length": utf16_len(match.group(0))})
    return entities


# --- MarkdownV2 as Telegram parses it ------------------------------------------------------

_RESERVED = set("_*[]()~`>#+-=|{}.!")
_TOGGLES = {"*": "bold", "_": "italic", "__": "underline", "~": "strikethrough", "||": "spoiler"}


def parse_markdown_v2(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(rendered text, entities) of a MarkdownV2 text; MarkdownError as Telegram words it."""
    out: list[str] = []
    entities: list[dict[str, Any]] = []
    open_at: dict[str, tuple[int, int]] = {}  # marker -> (utf16 offset, byte offset)
    links: list[tuple[int, int]] = []  # open link texts: (utf16 offset, byte offset)
    i = 0

    def offset() -> int:
        return utf16_len("".join(out))

    def byte_offset(index: int) -> int:
        return len(text[:index].encode())

    while i < len(text):
        char = text[i]
        if char == "\\":
            if i + 1 >= len(text):
                raise MarkdownError("Character '\\' is reserved and must be escaped")
            out.append(text[i + 1])
            i += 2
        elif text.startswith("```", i):
            body, end = _code_body(text, i + 3, "```")
            if end < 0:
                raise MarkdownError(f"Can't find end of Pre entity at byte offset {byte_offset(i)}")
            language, newline, rest = body.partition("\n")
            if not newline:
                language, rest = "", body
            start = offset()
            out.append(rest)
            entity: dict[str, Any] = {"type": "pre", "offset": start, "length": utf16_len(rest)}
            if language:
                entity["language"] = language
            entities.append(entity)
            i = end + 3
        elif char == "`":
            body, end = _code_body(text, i + 1, "`")
            if end < 0:
                raise MarkdownError(
                    f"Can't find end of Code entity at byte offset {byte_offset(i)}"
                )
            entities.append({"type": "code", "offset": offset(), "length": utf16_len(body)})
            out.append(body)
            i = end + 1
        elif text.startswith(("__", "||"), i) or char in "*_~":
            marker = text[i : i + 2] if text.startswith(("__", "||"), i) else char
            if marker in open_at:
                start, _ = open_at.pop(marker)
                length = offset() - start
                entities.append({"type": _TOGGLES[marker], "offset": start, "length": length})
            else:
                open_at[marker] = (offset(), byte_offset(i))
            i += len(marker)
        elif char == "[":  # an inline link's text: [text](url)
            links.append((offset(), byte_offset(i)))
            i += 1
        elif char == "]" and links and text.startswith("(", i + 1):
            url, end = _link_url(text, i + 2)
            if end < 0:
                raise MarkdownError(f"Can't find end of a URL at byte offset {byte_offset(i)}")
            start, _ = links.pop()
            entities.append(
                {"type": "text_link", "offset": start, "length": offset() - start, "url": url}
            )
            i = end + 1
        elif char in _RESERVED:
            raise MarkdownError(
                f"Character '{char}' is reserved and must be escaped with the preceding '\\'"
            )
        else:
            out.append(char)
            i += 1
    if links:
        raise MarkdownError(f"Can't find end of TextUrl entity at byte offset {links[0][1]}")
    if open_at:
        marker, (_, at) = next(iter(open_at.items()))
        name = _TOGGLES[marker].capitalize()
        raise MarkdownError(f"Can't find end of {name} entity at byte offset {at}")
    entities.sort(key=lambda e: e["offset"])
    return "".join(out), entities


def _link_url(text: str, start: int) -> tuple[str, int]:
    """The unescaped URL of an inline link from `start`, and where its `)` is (-1: none)."""
    url: list[str] = []
    i = start
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            url.append(text[i + 1])
            i += 2
        elif text[i] == ")":
            return "".join(url), i
        else:
            url.append(text[i])
            i += 1
    return "".join(url), -1


def _code_body(text: str, start: int, closing: str) -> tuple[str, int]:
    """The unescaped body of a code entity from `start`, and where `closing` begins."""
    body: list[str] = []
    i = start
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            body.append(text[i + 1])
            i += 2
        elif text.startswith(closing, i):
            return "".join(body), i
        elif text[i] == "`":
            return "".join(body), -1  # an unescaped backtick inside code
        else:
            body.append(text[i])
            i += 1
    return "".join(body), -1


@contextmanager
def serve_in_a_thread(
    token: str = "123:TEST",
) -> Iterator[tuple[FakeTelegram, asyncio.AbstractEventLoop]]:
    """The fake on a loop of its own: for tests and benchmarks whose gateway is a
    subprocess, driven by blocking calls (`loop.call_soon_threadsafe(fake.push_message,
    ...)`)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fake = FakeTelegram(token=token)
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake, loop
    finally:
        asyncio.run_coroutine_threadsafe(fake.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
