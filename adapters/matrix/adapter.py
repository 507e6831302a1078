"""Matrix: matrix-nio's asyncio client against any homeserver.

    sync      /sync long-poll from the stored `next_batch` -> invites (an allowed inviter's
              joined, others' declined) -> each room's new messages, in order ->
              gateway.handle_message (dedup by event id) -> only then next_batch stored
              (gateway.save_cursor): a crash never skips an event, and one read twice
              is dropped by the inbox
    rooms     a room of two members is a DM, others groups (answered when mentioned or
              replied to, by `require_mention`); `m.thread` relations are threads
    replies   m.room.message with a plain `body` and HTML `formatted_body`, in the
              thread or as a reply; the transaction id is the ledger row, so a reply sent
              again after a crash is dropped by the homeserver
    streaming the first part sent, then edited with `m.replace`; M_LIMIT_EXCEEDED's
              `retry_after_ms` is honoured (FloodWait while streaming)
    files     in: m.image/m.file/m.audio/m.video from the content repository (mxc://);
              out: uploaded, then sent as m.image or m.file

End-to-end encrypted rooms are not read: the adapter says so once in the room and in the
log. One sync per account: with replicas, only the leader syncs.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlparse

import aiohttp
import nio

from adapters.base import (
    AcceptStatus,
    Attachment,
    FloodWait,
    InboundMedia,
    MessageEvent,
    PlatformAdapter,
    SendResult,
    read_local_file,
)
from adapters.markdown import markdown_html
from config.platforms import MatrixConfig
from gateway.domain.session import Platform, SessionSource, validate_id
from gateway.util.backoff import Backoff

CURSOR = "next_batch"
SENT_REMEMBERED = 2000  # our event ids kept to see replies to the bot
RATE_RETRIES = 3
STOP_SECONDS = 5.0
# A media download: no limit on the whole (a large file on a slow link is fine), but on
# connecting and on each read, so a homeserver that stops sending cannot hold a turn.
_MEDIA_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30)
_MEDIA = {
    "m.image": "photo",
    "m.audio": "audio",
    "m.file": "document",
    "m.video": "document",
}
ENCRYPTED_TOLD = "encrypted_notice:"  # + a room id: the cursor that says it was told
ENCRYPTED_NOTICE = (
    "This room is end-to-end encrypted, and I cannot read encrypted messages yet. "
    "Talk to me in a room without encryption."
)


class MatrixAdapter(PlatformAdapter):
    platform = Platform.MATRIX
    max_message_length = 16_000  # an event is at most 64 KiB with its HTML twin
    stream_mode = "edit"

    def __init__(self, config: MatrixConfig) -> None:
        super().__init__(config)
        self.config: MatrixConfig = config
        for key, value in (("homeserver", config.homeserver), ("user_id", config.user_id)):
            if not value:
                raise ValueError(f"platforms.matrix.{key}: required when matrix is enabled")
        if not (config.access_token or config.password):
            raise ValueError(
                "platforms.matrix.access_token: required when matrix is enabled (or password)"
            )
        self.log.hide(config.access_token, config.password)
        assert config.user_id is not None
        self.user_id = config.user_id
        self.bot_username = config.user_id
        self.client: nio.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._sent: OrderedDict[str, None] = OrderedDict()
        self._told_encrypted: set[str] = set()

    @property
    def single_connection(self) -> bool:
        return True

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self.set_state("starting")
        assert self.config.homeserver is not None
        client = nio.AsyncClient(
            self.config.homeserver, self.user_id, device_id=self.config.device_id or ""
        )
        if self.config.access_token:
            client.access_token = self.config.access_token
            client.user_id = self.user_id
            client.device_id = self.config.device_id or ""
        self.client = client
        self._task = asyncio.create_task(self._sync_forever(), name="matrix-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=STOP_SECONDS)
            self._task = None
        if self.client is not None:
            await self.client.close()
        self.set_state("stopped")

    async def _sync_forever(self) -> None:
        assert self.client is not None and self.gateway is not None
        client, backoff = self.client, Backoff()
        while True:
            try:
                if not client.access_token:
                    await self._login(client)
                since = await self.gateway.load_cursor(self.platform.value, CURSOR)
                if since is None:  # the first start: what came before is not answered
                    since = await self._first_sync(client)
                self.set_state("running", user_id=self.user_id)
                backoff.reset()
                while True:
                    response = await client.sync(
                        timeout=int(self.config.sync_timeout * 1000), since=since
                    )
                    if isinstance(response, nio.SyncError):
                        raise ConnectionError(f"sync failed: {response.message}")
                    if await self._take(response):
                        if _carries_events(response):  # an idle sync writes nothing
                            await self.gateway.save_cursor(
                                self.platform.value, CURSOR, response.next_batch
                            )
                        since = response.next_batch
                    else:
                        await asyncio.sleep(1.0)  # the store could not take them: again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the homeserver, the network
                error = self.log.redact(f"{type(exc).__name__}: {exc}")
                self.set_state("reconnecting", error=error)
                delay = backoff.delay()
                await self.retry_pause("sync", backoff.attempt, delay, error)

    async def _login(self, client: nio.AsyncClient) -> None:
        response = await client.login(self.config.password, device_name="hermes-gateway")
        if isinstance(response, nio.LoginError):
            raise ConnectionError(f"login failed: {response.message}")
        self.log.hide(client.access_token)

    async def _first_sync(self, client: nio.AsyncClient) -> str:
        response = await client.sync(timeout=0, full_state=True)
        if isinstance(response, nio.SyncError):
            raise ConnectionError(f"sync failed: {response.message}")
        await self._invites(response)
        assert self.gateway is not None
        await self.gateway.save_cursor(self.platform.value, CURSOR, response.next_batch)
        return str(response.next_batch)

    # --- inbound ----------------------------------------------------------------------------

    async def _take(self, response: nio.SyncResponse) -> bool:
        """Hand every new message to the gateway; False when one could not be stored."""
        await self._invites(response)
        for room_id, info in response.rooms.join.items():
            for event in info.timeline.events:
                if not await self._event(room_id, event):
                    return False
        return True

    async def _invites(self, response: nio.SyncResponse) -> None:
        assert self.client is not None
        for room_id, info in response.rooms.invite.items():
            inviter = next(
                (
                    e.sender
                    for e in info.invite_state
                    if isinstance(e, nio.InviteMemberEvent) and e.state_key == self.user_id
                ),
                None,
            )
            if inviter is not None and await self._may_invite(inviter):
                await self.client.join(room_id)
                self.log.info("room_joined", room_id=room_id, inviter=inviter)
            else:
                await self.client.room_leave(room_id)
                self.log.info("invite_declined", room_id=room_id, inviter=inviter)

    async def _may_invite(self, user_id: str) -> bool:
        access = self.config
        if access.allow_all_users or user_id in access.allowed_users:
            return True
        assert self.gateway is not None
        return await self.gateway.is_paired(self.platform.value, user_id)

    async def _event(self, room_id: str, event: Any) -> bool:
        assert self.client is not None and self.gateway is not None
        if getattr(event, "sender", None) == self.user_id:
            return True
        if isinstance(event, nio.MegolmEvent | nio.RoomEncryptedMedia):
            await self._encrypted(room_id)
            return True
        content = event.source.get("content", {}) if hasattr(event, "source") else {}
        msgtype = content.get("msgtype")
        if msgtype not in ("m.text", "m.notice", *_MEDIA) or not isinstance(content, dict):
            return True
        relation = content.get("m.relates_to") or {}
        if relation.get("rel_type") == "m.replace":
            return True  # a user's edit of an earlier message: not a new message
        room = self.client.rooms.get(room_id)
        members = room.member_count if room is not None else 3
        thread = relation.get("event_id") if relation.get("rel_type") == "m.thread" else None
        replied = (relation.get("m.in_reply_to") or {}).get("event_id")
        try:
            for name, value in (("room", room_id), ("user", event.sender), ("thread", thread)):
                validate_id(name, value)
        except ValueError:
            self.log.warning("event_unusable_ids", room_id=room_id)
            return True
        source = SessionSource(
            platform=Platform.MATRIX,
            chat_id=room_id,
            chat_name=room.display_name if room is not None else None,
            chat_type="dm" if members <= 2 else "group",
            user_id=event.sender,
            user_name=room.user_name(event.sender) if room is not None else None,
            thread_id=thread,
            message_id=event.event_id,
        )
        body = str(content.get("body", ""))
        mentioned = self._mentions_me(body, content)
        if not self.addressed_to_bot(
            source, mentioned=mentioned, replied_to_bot=replied in self._sent
        ):
            return True
        media: tuple[InboundMedia, ...] = ()
        text = body
        if msgtype in _MEDIA:
            info = content.get("info") or {}
            media = (
                InboundMedia(
                    kind=_MEDIA[msgtype],  # type: ignore[arg-type]
                    ref=str(content.get("url", "")),
                    name=body[:200] or "file",
                    mime=info.get("mimetype"),
                    size=info.get("size") if isinstance(info.get("size"), int) else None,
                ),
            )
            text = ""
        message = MessageEvent(
            source=source, text=text.strip(), message_id=event.event_id, media=media
        )
        if not await self.authorize(message):
            return True
        accepted = await self.gateway.handle_message(message)
        return accepted.status is not AcceptStatus.UNAVAILABLE

    def _mentions_me(self, body: str, content: dict[str, Any]) -> bool:
        mentions = content.get("m.mentions") or {}
        if self.user_id in (mentions.get("user_ids") or []):
            return True
        local = self.user_id.split(":", 1)[0].lstrip("@")
        return self.user_id in body or local.lower() in body.lower()

    async def _encrypted(self, room_id: str) -> None:
        """A room whose messages arrive encrypted is told once that they are not read: as
        a gateway notice (the delivery ledger sends it, again after a crash if need be),
        remembered as a platform cursor of the room, so a restart or a failover does not
        tell it again. Remembered first: a crash between the two loses the notice rather
        than sending it twice."""
        if room_id in self._told_encrypted:
            return
        assert self.gateway is not None
        try:
            validate_id("room", room_id)
        except ValueError:
            return
        told = f"{ENCRYPTED_TOLD}{room_id}"
        if await self.gateway.load_cursor(self.platform.value, told) is None:
            self.log.warning("encrypted_room_unsupported", room_id=room_id)
            await self.gateway.save_cursor(self.platform.value, told, "told")
            room = SessionSource(platform=Platform.MATRIX, chat_id=room_id, chat_type="group")
            await self.gateway.notify(room, ENCRYPTED_NOTICE)
        self._told_encrypted.add(room_id)

    # --- replies ------------------------------------------------------------------------------

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        content = {**_formatted(text), **_relation(target, reply_to)}
        return await self._send(target.chat_id, content, _tx(delivery_id), wait=True)

    async def send_draft(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> SendResult:
        content = {**_formatted(text), **_relation(target, reply_to)}
        return await self._send(target.chat_id, content, None, wait=False)

    async def edit(self, target: SessionSource, message_id: str, text: str) -> None:
        content = {
            "msgtype": "m.text",
            "body": f"* {text}",
            "m.new_content": _formatted(text),
            "m.relates_to": {"rel_type": "m.replace", "event_id": message_id},
        }
        await self._send(target.chat_id, content, None, wait=False)

    async def delete(self, target: SessionSource, message_id: str) -> None:
        assert self.client is not None
        await self.client.room_redact(target.chat_id, message_id)

    async def _send(
        self, room_id: str, content: dict[str, Any], tx_id: str | None, *, wait: bool
    ) -> SendResult:
        assert self.client is not None
        for _ in range(RATE_RETRIES):
            response = await self.client.room_send(room_id, "m.room.message", content, tx_id=tx_id)
            if isinstance(response, nio.RoomSendResponse):
                self._sent[response.event_id] = None
                while len(self._sent) > SENT_REMEMBERED:
                    self._sent.popitem(last=False)
                return SendResult(message_id=response.event_id)
            if response.status_code != "M_LIMIT_EXCEEDED":
                raise ConnectionError(f"send failed: {response.status_code} {response.message}")
            retry = (response.retry_after_ms or 1000) / 1000
            if not wait:
                raise FloodWait(retry)
            await asyncio.sleep(min(retry, 60.0))
        raise ConnectionError("send failed: the homeserver kept asking to wait")

    # --- files --------------------------------------------------------------------------------

    async def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:  # type: ignore[override]
        """The file streamed from the content repository a piece at a time, so that the
        media intake's size cap stops it as soon as it is passed (nio's `download`
        reads a whole file into memory first, and waits without a time limit). The
        token goes in a header, never in the URL (the spec's authenticated media
        endpoint, which Synapse requires for new files)."""
        assert self.client is not None
        mxc = urlparse(media.ref)
        if mxc.scheme != "mxc" or not mxc.netloc or not mxc.path.strip("/"):
            raise FileNotFoundError(f"not a content repository URI: {media.ref[:100]!r}")
        server, media_id = (quote(part, safe="") for part in (mxc.netloc, mxc.path.strip("/")))
        response = await self.client.send(
            "GET",
            f"/_matrix/client/v1/media/download/{server}/{media_id}?allow_remote=true",
            headers={"Authorization": f"Bearer {self.client.access_token}"},
            timeout=_MEDIA_TIMEOUT,  # type: ignore[arg-type]  # passed on to aiohttp
        )
        try:
            if response.status != 200:
                raise FileNotFoundError(f"download failed: HTTP {response.status}")
            async for piece in response.content.iter_chunked(1 << 16):
                yield piece
        finally:
            response.release()

    async def send_attachment(
        self,
        target: SessionSource,
        attachment: Attachment,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        if attachment.is_url:
            return await super().send_attachment(target, attachment, reply_to)
        assert self.client is not None
        file = await read_local_file(attachment, "application/octet-stream")
        uploaded, _ = await self.client.upload(
            lambda *_: file.data,
            content_type=file.mime,
            filename=file.name,
            filesize=len(file.data),
        )
        if not isinstance(uploaded, nio.UploadResponse):
            raise ConnectionError(f"upload failed: {getattr(uploaded, 'message', uploaded)}")
        content = {
            "msgtype": "m.image" if file.mime.startswith("image/") else "m.file",
            "body": attachment.caption or file.name,
            "filename": file.name,
            "url": uploaded.content_uri,
            "info": {"mimetype": file.mime, "size": len(file.data)},
            **_relation(target, reply_to),
        }
        return await self._send(target.chat_id, content, _tx(delivery_id), wait=True)


def _carries_events(response: nio.SyncResponse) -> bool:
    """Whether a sync brought an invitation or a room event: only then is its position
    stored. A restart from an older position is read again (the inbox drops what it
    accepted), so an idle sync every `sync_timeout` need not touch the disk."""
    return bool(response.rooms.invite) or any(
        info.timeline.events for info in response.rooms.join.values()
    )


def _formatted(text: str) -> dict[str, Any]:
    return {
        "msgtype": "m.text",
        "body": text,
        "format": "org.matrix.custom.html",
        "formatted_body": markdown_html(text),
    }


def _relation(target: SessionSource, reply_to: str | None) -> dict[str, Any]:
    if target.thread_id:
        relation: dict[str, Any] = {"rel_type": "m.thread", "event_id": target.thread_id}
        if reply_to:
            relation["is_falling_back"] = True
            relation["m.in_reply_to"] = {"event_id": reply_to}
        return {"m.relates_to": relation}
    if reply_to and reply_to.startswith("$"):
        return {"m.relates_to": {"m.in_reply_to": {"event_id": reply_to}}}
    return {}


def _tx(delivery_id: int | None) -> str | None:
    """The transaction id of a ledger row's send: the homeserver drops a repeat of it."""
    return f"hermes-{delivery_id}" if delivery_id is not None else None
