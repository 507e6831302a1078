"""Email: IMAP in (IDLE, polling as the fallback), SMTP out.

    watch     login -> select the folder -> every UNSEEN message, oldest first:
              size check -> BODY.PEEK[] (read without marking) -> parse (off the loop)
              -> ignored (auto-reply, list, bounce, ours) or denied, or handed to the
              gateway (dedup by Message-ID, durable) -> only then \\Seen
              -> IDLE until the server announces mail (or `poll_interval` passes)
    reply     SMTP (implicit TLS, STARTTLS, or plain on loopback) with In-Reply-To,
              References and a `Re:` subject; the Message-ID is fixed by the ledger row,
              so a reply sent again after a crash is the same message
    files     in: a message's attachments (kept while its turn may read them; fetched
              again by Message-ID after a restart); out: attached to a reply

A sender's address is the user and the chat (a DM); a thread (the root of References /
In-Reply-To) is the session's thread. A crash after the gateway accepted a message but
before \\Seen makes the next start read it again, and the gateway's inbox drops it by
its Message-ID. One connection per mailbox: with replicas, only the leader watches.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from email.headerregistry import Address
from typing import Any

import aioimaplib
import aiosmtplib

from adapters.base import (
    AcceptStatus,
    Attachment,
    InboundMedia,
    MessageEvent,
    PlatformAdapter,
    SendResult,
    read_local_file,
)
from adapters.mail import message
from adapters.mail.message import InboundMail, MailPart
from config.platforms import EmailConfig
from gateway.domain.session import Platform, SessionSource
from gateway.util.backoff import Backoff

IMAP_TIMEOUT = 30.0  # seconds for one IMAP command
SMTP_TIMEOUT = 60.0
STOP_SECONDS = 5.0
IDLE_SECONDS = 25 * 60  # servers drop IDLE after 30 minutes (RFC 2177)
BATCH = 50  # messages read per pass; the rest the next pass
KEPT_FILE_BYTES = 64 * 1024 * 1024  # inbound files kept in memory for their turns
_FETCHED = re.compile(rb"RFC822\.SIZE (\d+)")


class EmailAdapter(PlatformAdapter):
    platform = Platform.EMAIL
    max_message_length = 100_000  # a mail is not split into chunks below this

    def __init__(self, config: EmailConfig) -> None:
        super().__init__(config)
        self.config: EmailConfig = config
        for key, value in (
            ("address", config.address),
            ("imap.host", config.imap.host),
            ("imap.username", config.imap.username),
            ("imap.password", config.imap.password),
            ("smtp.host", config.smtp.host),
        ):
            if not value:
                raise ValueError(f"platforms.email.{key}: required when email is enabled")
        assert config.address is not None
        self.log.hide(config.imap.password, config.smtp.password)
        self.own = Address(display_name=config.display_name or "", addr_spec=config.address)
        self.domain = config.address.rsplit("@", 1)[-1]
        self._task: asyncio.Task[None] | None = None
        # Inbound files by "Message-ID\nindex", for their turns (bounded by bytes).
        self._files: OrderedDict[str, MailPart] = OrderedDict()
        self._file_bytes = 0

    @property
    def single_connection(self) -> bool:
        return True

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self.set_state("starting")
        self._task = asyncio.create_task(self._watch(), name="email-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # Bounded: a library call that ignores its cancellation must not hold the stop.
            await asyncio.wait([self._task], timeout=STOP_SECONDS)
            self._task = None
        self.set_state("stopped")

    async def _watch(self) -> None:
        backoff = Backoff()
        while True:
            try:
                imap = await self._connect()
                self.set_state("running", folder=self.config.imap.folder)
                backoff.reset()
                try:
                    await self._serve(imap)
                finally:
                    _close(imap)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server, the network, a protocol surprise
                error = self.log.redact(f"{type(exc).__name__}: {exc}")
                self.set_state("reconnecting", error=error)
                delay = backoff.delay()
                await self.retry_pause("imap", backoff.attempt, delay, error)

    async def _connect(self) -> aioimaplib.IMAP4:
        imap_config = self.config.imap
        if imap_config.tls:
            port = imap_config.port or 993
            imap: aioimaplib.IMAP4 = aioimaplib.IMAP4_SSL(
                host=imap_config.host, port=port, timeout=IMAP_TIMEOUT
            )
        else:
            port = imap_config.port or 143
            imap = aioimaplib.IMAP4(host=imap_config.host, port=port, timeout=IMAP_TIMEOUT)
        await asyncio.wait_for(imap.wait_hello_from_server(), IMAP_TIMEOUT)
        _ok(await imap.login(imap_config.username, imap_config.password), "login")
        _ok(await imap.select(imap_config.folder), f"select {imap_config.folder}")
        return imap

    async def _serve(self, imap: aioimaplib.IMAP4) -> None:
        """Read what is unseen, then wait for more: IDLE when the server has it."""
        idle = imap.has_capability("IDLE")
        while True:
            while await self._drain(imap):
                pass
            if not idle:
                await asyncio.sleep(self.config.poll_interval)
                _ok(await imap.noop(), "noop")
                continue
            waiting = await imap.idle_start(timeout=IDLE_SECONDS)
            try:
                await imap.wait_server_push(timeout=min(self.config.poll_interval, IDLE_SECONDS))
            except TimeoutError:
                pass  # nothing announced: look anyway (a server may not say)
            finally:
                imap.idle_done()
            await asyncio.wait_for(waiting, IMAP_TIMEOUT)

    async def _drain(self, imap: aioimaplib.IMAP4) -> bool:
        """One pass over the unseen messages (up to BATCH); True when more may wait."""
        found = _ok(await imap.uid_search("UNSEEN"), "search")
        uids = [u for line in found.lines[:-1] for u in bytes(line).split() if u.isdigit()]
        for uid in uids[:BATCH]:
            await self._read(imap, uid.decode())
        return len(uids) > BATCH

    async def _too_large(self, imap: aioimaplib.IMAP4, uid: str) -> int | None:
        """The message's size when it is over `max_message_bytes` (logged), else None:
        asked of the server before the body is fetched, so a large one is never read."""
        sized = _ok(await imap.uid("fetch", uid, "(RFC822.SIZE)"), "fetch size")
        size = _size(sized.lines)
        if size is not None and size > self.config.max_message_bytes:
            self.log.warning("mail_too_large", uid=uid, size=size)
            return size
        return None

    async def _read(self, imap: aioimaplib.IMAP4, uid: str) -> None:
        if await self._too_large(imap, uid) is not None:
            await self._seen(imap, uid)
            return
        fetched = _ok(await imap.uid("fetch", uid, "(BODY.PEEK[])"), "fetch")
        raw = next((bytes(line) for line in fetched.lines if isinstance(line, bytearray)), None)
        if raw is None:
            return  # expunged meanwhile
        assert self.config.address is not None
        mail = await asyncio.to_thread(message.parse, raw, self.config.address)
        if mail.skip is not None:
            self.log.info("mail_ignored", reason=mail.skip, message_id=mail.message_id)
            await self._seen(imap, uid)
            return
        if await self._hand_over(mail):
            await self._seen(imap, uid)

    async def _hand_over(self, mail: InboundMail) -> bool:
        """Give one message to the gateway; False when it could not take it (read again
        on the next pass: the store could not write)."""
        assert self.gateway is not None
        source = SessionSource(
            platform=Platform.EMAIL,
            chat_id=mail.sender,
            chat_type="dm",
            user_id=mail.sender,
            user_name=mail.sender_name,
            thread_id=mail.thread,
            chat_topic=mail.subject or None,
            message_id=mail.message_id,
        )
        media = []
        for index, part in enumerate(mail.files):
            ref = f"{mail.message_id}\n{index}"
            self._keep(ref, part)
            media.append(
                InboundMedia(
                    kind="photo" if part.mime.startswith("image/") else "document",
                    ref=ref,
                    name=part.name,
                    mime=part.mime,
                    size=len(part.data),
                )
            )
        event = MessageEvent(
            source=source, text=mail.text, message_id=mail.message_id, media=tuple(media)
        )
        if not await self.authorize(event):
            return True  # denied (and told how to pair): read, not to be read again
        accepted = await self.gateway.handle_message(event)
        return accepted.status is not AcceptStatus.UNAVAILABLE

    async def _seen(self, imap: aioimaplib.IMAP4, uid: str) -> None:
        _ok(await imap.uid("store", uid, "+FLAGS.SILENT (\\Seen)"), "store")

    # --- access -----------------------------------------------------------------------------

    async def authorize(self, event: MessageEvent) -> bool:
        """`allowed_users` takes addresses and whole domains (`@example.org`)."""
        sender = event.source.user_id or ""
        domain = "@" + sender.rsplit("@", 1)[-1]
        if any(entry.lower() in (sender, domain) for entry in self.config.allowed_users):
            return True
        return await super().authorize(event)

    # --- replies --------------------------------------------------------------------------

    async def send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None = None,
        *,
        delivery_id: int | None = None,
    ) -> SendResult:
        return await self._send(target, text, reply_to, delivery_id, ())

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
        kind_mime = {"photo": "image/png", "voice": "audio/ogg"}.get(attachment.kind)
        file = await read_local_file(attachment, kind_mime or "application/octet-stream")
        part = MailPart(name=file.name, mime=file.mime, data=file.data)
        text = attachment.caption or f"({file.name} attached)"
        return await self._send(target, text, reply_to, delivery_id, (part,))

    async def _send(
        self,
        target: SessionSource,
        text: str,
        reply_to: str | None,
        delivery_id: int | None,
        files: tuple[MailPart, ...],
    ) -> SendResult:
        thread = target.thread_id or target.chat_id
        message_id = message.reply_id(delivery_id, thread, self.domain)
        root = target.thread_id if target.thread_id and "@" in target.thread_id else None
        msg = message.reply(
            own=self.own,
            to=target.chat_id,
            to_name=target.user_name,
            subject=target.chat_topic or "",
            text=text,
            message_id=message_id,
            in_reply_to=reply_to,
            root_id=root,
            files=files,
        )
        smtp = self.config.smtp
        tls = smtp.tls
        await aiosmtplib.send(
            msg,
            hostname=smtp.host,
            port=smtp.port or (465 if tls is True else 587 if tls == "starttls" else 25),
            username=smtp.username,
            password=smtp.password,
            use_tls=tls is True,
            start_tls=tls == "starttls",
            timeout=SMTP_TIMEOUT,
        )
        return SendResult(message_id=message_id)

    # --- files in ---------------------------------------------------------------------------

    def _keep(self, ref: str, part: MailPart) -> None:
        self._files[ref] = part
        self._file_bytes += len(part.data)
        while self._file_bytes > KEPT_FILE_BYTES and len(self._files) > 1:
            _, old = self._files.popitem(last=False)
            self._file_bytes -= len(old.data)

    async def open_media(self, media: InboundMedia) -> AsyncIterator[bytes]:  # type: ignore[override]
        part = self._files.get(media.ref) or await self._fetch_again(media.ref)
        if part is None:
            raise FileNotFoundError("the mail that carried this file is gone from the folder")
        yield part.data

    async def _fetch_again(self, ref: str) -> MailPart | None:
        """A file of a message read before a restart: the message, found again by its
        Message-ID on a connection of its own."""
        message_id, _, index = ref.rpartition("\n")
        imap = await self._connect()
        try:
            found = _ok(
                await imap.uid_search("HEADER", "Message-ID", f'"<{message_id}>"'), "search"
            )
            uids = [u for line in found.lines[:-1] for u in bytes(line).split() if u.isdigit()]
            if not uids:
                return None
            uid = uids[0].decode()
            # Found by its Message-ID, which anyone can reuse: bounded like any mail read.
            size = await self._too_large(imap, uid)
            if size is not None:
                raise ValueError(
                    f"the mail that carried this file is {size} bytes, over"
                    f" platforms.email.max_message_bytes ({self.config.max_message_bytes})"
                )
            fetched = _ok(await imap.uid("fetch", uid, "(BODY.PEEK[])"), "fetch")
            raw = next((bytes(x) for x in fetched.lines if isinstance(x, bytearray)), None)
        finally:
            _close(imap)
        if raw is None:
            return None
        assert self.config.address is not None
        mail = await asyncio.to_thread(message.parse, raw, self.config.address)
        position = int(index) if index.isdigit() else -1
        return mail.files[position] if 0 <= position < len(mail.files) else None


def _ok(response: Any, what: str) -> Any:
    if response.result != "OK":
        detail = bytes(response.lines[-1]).decode(errors="replace")[:200] if response.lines else ""
        raise ConnectionError(f"IMAP {what} failed: {response.result} {detail}")
    return response


def _size(lines: list[Any]) -> int | None:
    for line in lines:
        found = _FETCHED.search(bytes(line))
        if found:
            return int(found.group(1))
    return None


def _close(imap: aioimaplib.IMAP4) -> None:
    """Drop the connection at once (no LOGOUT: a server forgets a closed session, and a
    stop or a broken link is no time to wait for an answer)."""
    transport = getattr(getattr(imap, "protocol", None), "transport", None)
    if transport is not None:
        transport.close()
