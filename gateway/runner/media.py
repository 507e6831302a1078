"""Media in: the files of one inbound message, downloaded, stored and made into what the
model reads.

    for each file: declared size > media.max_bytes? -> refused (nothing fetched)
                   download through its adapter into media/<session_id>/ (0600), stopping
                   past the cap (-> refused, the partial file removed)
                   photo    -> an image part (agent.vision) or a one-line note
                   voice    -> its transcript (media.transcription) or a one-line note,
                               and the user is told transcription is off
                   document -> its text inline (txt, md, csv, json, code; cut at
                               media.max_text_chars) or a one-line note

The turn stores the result in the user's transcript message: the text the model read,
plus a `media` list of references (kind, name, path relative to HERMES_HOME, bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
import structlog

from adapters.base import PlatformAdapter
from config import MediaConfig, TranscriptionConfig
from gateway.agents.protocol import ImageInput
from gateway.domain.attachments import InboundMedia, MediaTooLarge
from gateway.domain.events import MessageEvent
from gateway.domain.session import SessionSource
from gateway.store import transcript
from gateway.store.media_files import session_media_dir

log = structlog.get_logger("gateway.media")

#: documents given to the model as text (by extension; `text/*` and JSON by type too)
TEXT_EXTENSIONS = frozenset(
    ".txt .md .markdown .csv .tsv .json .jsonl .yaml .yml .toml .ini .cfg .log .xml .html"
    " .css .py .js .ts .tsx .jsx .go .rs .java .kt .c .h .cc .cpp .hpp .cs .rb .php .sh"
    " .sql .swift .scala .lua .r .pl .ex .exs .hs .ml .el .clj .dart .vue .svelte".split()
)
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
TRANSCRIPTION_OFF = (
    "Voice messages are not transcribed here (transcription is off), so I could not "
    "listen to yours. Please type it."
)


def too_large_notice(limit: int) -> str:
    return f"That file is too large: the limit is {_mib(limit)}. Nothing was kept."


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.0f} MB" if size >= 1024 * 1024 else f"{size} bytes"


@dataclass(slots=True)
class Intake:
    """What a message's files gave: the user text for the model (and the transcript),
    the images for a vision model, the transcript's references, and notices for the user."""

    text: str
    images: list[ImageInput] = field(default_factory=list)
    refs: list[dict[str, Any]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    refused: int = 0  # files over the size cap

    @property
    def only_refusals(self) -> bool:
        return self.refused > 0 and not self.refs and not self.text.strip()

    def transcript_tx(
        self, row: int, message_id: str | None
    ) -> Callable[[sqlite3.Connection], None]:
        """The user's transcript message (row `row`) rewritten to what the model read,
        with the files' references (paths under HERMES_HOME, never their bytes)."""
        message: dict[str, Any] = {"role": "user", "content": self.text, "media": self.refs}
        if message_id:
            message["message_id"] = message_id
        return lambda conn: transcript.update_message(conn, row, message)


class MediaIntake:
    """Downloads, stores and reads the files users send (see the module's doc)."""

    def __init__(self, home: Path, config: MediaConfig) -> None:
        self.home = home
        self.config = config
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def for_turn(
        self,
        adapter: PlatformAdapter | None,
        event: MessageEvent,
        session_id: str,
        text: str,
        *,
        vision: bool,
        deliver: Callable[..., Awaitable[object]],
    ) -> Intake | None:
        """A turn's files, taken; the notices (a file over the cap, transcription off)
        are `deliver`ed at once, unless over-size files were all the message had (that
        notice is then the turn's reply). None when the platform has no adapter."""
        if adapter is None:
            return None
        intake = await self.take(adapter, session_id, text, event.media, vision=vision)
        if not intake.only_refusals:
            target: SessionSource = event.source
            for notice in intake.notices:
                await deliver(target, notice, reply_to=event.reply_to)
        return intake

    async def take(
        self,
        adapter: PlatformAdapter,
        session_id: str,
        text: str,
        media: tuple[InboundMedia, ...],
        *,
        vision: bool,
    ) -> Intake:
        intake = Intake(text)
        lines: list[str] = []
        for item in media:
            try:
                path, size = await self._download(adapter, session_id, item)
            except MediaTooLarge as exc:
                intake.refused += 1
                log.info("media_too_large", kind=item.kind, size=exc.size, limit=exc.limit)
                continue
            except Exception as exc:  # the platform refused or the network failed
                log.warning("media_download_failed", kind=item.kind, error=str(exc)[:200])
                lines.append(f"[{item.kind} {item.name}: could not be downloaded]")
                continue
            relative = str(path.relative_to(self.home))
            ref: dict[str, Any] = {
                "kind": item.kind,
                "name": item.name,
                "mime": item.mime,
                "path": relative,
                "bytes": size,
            }
            intake.refs.append(ref)
            lines.append(await self._read(item, path, size, vision, intake))
        if intake.refused:
            intake.notices.insert(0, too_large_notice(self.config.max_bytes))
        parts = [p for p in (text.strip(), *lines) if p]
        intake.text = "\n\n".join(parts)
        return intake

    async def _read(
        self, item: InboundMedia, path: Path, size: int, vision: bool, intake: Intake
    ) -> str:
        """The line the model reads for one stored file."""
        if item.kind == "photo" or (item.kind == "document" and _is_image(item)):
            if vision:
                intake.images.append(ImageInput(str(path), item.mime or "image/jpeg"))
                return f"[photo: {item.name}]"
            return f"[photo: {item.name} (this model cannot see images)]"
        if item.kind in ("voice", "audio"):
            transcription = self.config.transcription
            if transcription is None:
                if TRANSCRIPTION_OFF not in intake.notices:
                    intake.notices.append(TRANSCRIPTION_OFF)
                return f"[{item.kind} message: not transcribed (transcription is off)]"
            try:
                heard = await self._transcribe(transcription, item, path)
            except Exception as exc:
                log.warning("transcription_failed", error=str(exc)[:200])
                return f"[{item.kind} message: transcription failed]"
            return f"[{item.kind} message, transcribed]: {heard}"
        if _is_text(item):
            limit = self.config.max_text_chars
            with path.open("r", encoding="utf-8", errors="replace") as file:
                body = file.read(limit + 1)
            cut = len(body) > limit
            body = body[:limit]
            note = f"\n[cut at {limit} characters]" if cut else ""
            return f"[file {item.name}]:\n{body}{note}"
        return f"[file: {item.name}, {item.mime or 'unknown type'}, {size} bytes]"

    async def _download(
        self, adapter: PlatformAdapter, session_id: str, item: InboundMedia
    ) -> tuple[Path, int]:
        """Stream the file into the session's directory; refused past `max_bytes`, before
        fetching when the platform declared the size, else as soon as it is passed."""
        limit = self.config.max_bytes
        if item.size is not None and item.size > limit:
            raise MediaTooLarge(item.size, limit)
        directory = session_media_dir(self.home, session_id)
        directory.parent.mkdir(mode=0o700, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        name = f"{secrets.token_hex(4)}-{_safe_name(item.name)}"
        path = directory / name
        size = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as file:
                stream = adapter.open_media(item)
                try:
                    async for piece in stream:
                        size += len(piece)
                        if size > limit:
                            raise MediaTooLarge(None, limit)
                        file.write(piece)
                finally:
                    with contextlib.suppress(Exception):
                        await stream.aclose()  # type: ignore[attr-defined]
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path, size

    async def _transcribe(self, config: TranscriptionConfig, item: InboundMedia, path: Path) -> str:
        """`POST {base_url}/audio/transcriptions` (multipart: file, model) -> its text."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        form = aiohttp.FormData()
        form.add_field("model", config.model)
        form.add_field(
            "file",
            await asyncio.to_thread(path.read_bytes),
            filename=item.name,
            content_type=item.mime or "application/octet-stream",
        )
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        url = config.base_url.rstrip("/") + "/audio/transcriptions"
        timeout = aiohttp.ClientTimeout(total=config.timeout_seconds)
        async with self._http.post(url, data=form, headers=headers, timeout=timeout) as response:
            if response.status >= 400:
                raise RuntimeError(f"transcription server returned HTTP {response.status}")
            data = await response.json(content_type=None)
        text = data.get("text") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise RuntimeError("transcription server sent no text")
        return text.strip()


def _safe_name(name: str) -> str:
    cleaned = _UNSAFE_NAME.sub("_", PurePosixPath(name.replace("\\", "/")).name).strip("._")
    return cleaned[:80] or "file"


def _suffix(item: InboundMedia) -> str:
    return PurePosixPath(item.name).suffix.lower()


def _is_image(item: InboundMedia) -> bool:
    return (item.mime or "").startswith("image/")


def _is_text(item: InboundMedia) -> bool:
    mime = item.mime or ""
    return (
        _suffix(item) in TEXT_EXTENSIONS
        or mime.startswith("text/")
        or mime in ("application/json", "application/xml", "application/x-yaml")
    )
