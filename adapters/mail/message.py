"""Mail as the gateway reads and writes it: an inbound message parsed into what a turn
needs (who, which thread, the text, the files, or why it is not for us), and a reply
built with its threading headers. Pure functions over the standard library's `email`
package: no I/O, so they run off the event loop (`asyncio.to_thread`) for large mail.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, field
from email import policy
from email.headerregistry import Address
from email.message import EmailMessage
from email.parser import BytesParser
from email.utils import formatdate, parseaddr
from html.parser import HTMLParser

from adapters.markdown import markdown_html
from gateway.domain.session import validate_id

MAX_TEXT_CHARS = 100_000  # of one message's text, after quotes are cut
MAX_ID_CHARS = 200  # a Message-ID longer than this is named by its hash
MAX_ATTACHMENTS = 10

# Who never gets an answer: mail systems, not people.
_SYSTEM_SENDERS = re.compile(r"^(mailer-daemon|postmaster|no-?reply|do-?not-?reply)@", re.I)
_BULK_PRECEDENCE = {"bulk", "junk", "list", "auto_reply"}
_QUOTE_INTRO = re.compile(r"^(On .+ wrote:|-+ ?Original Message ?-+)\s*$", re.I)
_MSG_ID = re.compile(r"<([^<>\s]{1,998})>")
_RE_PREFIX = re.compile(r"^\s*((re|aw|sv|fwd?)\s*:\s*)+", re.I)


@dataclass(frozen=True, slots=True)
class MailPart:
    """A file the message carries."""

    name: str
    mime: str
    data: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class InboundMail:
    message_id: str  # without <>; a hash of the bytes when the mail has none
    sender: str  # the From address, lower case
    sender_name: str | None
    subject: str  # without Re:/Fwd: prefixes
    text: str
    thread: str  # the thread's root Message-ID (an id key: hashed when unfit)
    files: tuple[MailPart, ...] = ()
    skip: str | None = None  # why no turn answers it (auto-reply, list mail, ...)


def parse(raw: bytes, own_address: str) -> InboundMail:
    """Read one message as received (RFC 5322 bytes)."""
    msg = BytesParser(policy=policy.default).parsebytes(raw)
    message_id = _first_id(str(msg.get("Message-ID", ""))) or _hash(raw)
    name, sender = parseaddr(str(msg.get("From", "")))
    sender = sender.strip().lower()
    references = _ids(str(msg.get("References", "")))
    parent = _first_id(str(msg.get("In-Reply-To", "")))
    root = references[0] if references else parent
    subject = _RE_PREFIX.sub("", str(msg.get("Subject", "")).strip())[:300]
    skip = _why_not_for_us(msg, sender, own_address)
    text, files = "", ()
    if skip is None:
        body = _body_text(msg)
        # A new thread's subject leads its first message: the session's title.
        text = f"{subject}\n\n{body}" if root is None and subject else body
        text, files = text.strip()[:MAX_TEXT_CHARS], _files(msg)
    return InboundMail(
        message_id=_id_key(message_id),
        sender=sender,
        sender_name=name.strip() or None,
        subject=subject,
        text=text,
        thread=_id_key(root or message_id),
        files=files,
        skip=skip,
    )


def _why_not_for_us(msg: EmailMessage, sender: str, own_address: str) -> str | None:
    if not sender or "@" not in sender:
        return "no sender address"
    if sender == own_address.lower():
        return "sent by this bot"
    auto = str(msg.get("Auto-Submitted", "no")).strip().lower()
    if auto and auto != "no":
        return f"automatic mail (Auto-Submitted: {auto[:40]})"
    if str(msg.get("Precedence", "")).strip().lower() in _BULK_PRECEDENCE:
        return "bulk or list mail (Precedence)"
    if msg.get("List-Id") is not None or msg.get("List-Unsubscribe") is not None:
        return "mailing-list mail"
    if msg.get("X-Autoreply") is not None or msg.get("X-Autorespond") is not None:
        return "an auto-reply"
    if msg.get_content_type() == "multipart/report" or _SYSTEM_SENDERS.match(sender):
        return "a delivery report"
    try:
        validate_id("sender", sender)
    except ValueError:
        return "an address that cannot name a chat"
    return None


def _body_text(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain", "html"))
    if part is None:
        return ""
    try:
        content = part.get_content()
    except (LookupError, ValueError):  # an unknown charset or a broken encoding
        payload = part.get_payload(decode=True)
        content = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else ""
    if not isinstance(content, str):
        return ""
    if part.get_content_type() == "text/html":
        content = html_to_text(content)
    return _without_quote(content)


def _without_quote(text: str) -> str:
    """The new part of a reply: the quoted earlier mail at its end is cut."""
    lines = text.replace("\r\n", "\n").split("\n")
    end = len(lines)
    while end > 0 and (lines[end - 1].startswith(">") or not lines[end - 1].strip()):
        end -= 1
    if end < len(lines) and end > 0 and _QUOTE_INTRO.match(lines[end - 1].strip()):
        end -= 1
    return "\n".join(lines[:end]).strip() if end > 0 else text.strip()


def _files(msg: EmailMessage) -> tuple[MailPart, ...]:
    files = []
    for part in msg.iter_attachments():
        if len(files) >= MAX_ATTACHMENTS:
            break
        data = part.get_payload(decode=True)
        if not isinstance(data, bytes):
            continue
        name = part.get_filename() or f"attachment-{len(files) + 1}"
        files.append(MailPart(name=name[:200], mime=part.get_content_type(), data=data))
    return tuple(files)


class _TextOfHtml(HTMLParser):
    _BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style", "head"):
            self._hidden += 1
        elif tag in self._BLOCKS:
            self.out.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head"):
            self._hidden = max(0, self._hidden - 1)
        elif tag in self._BLOCKS:
            self.out.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.out.append(data)


def html_to_text(markup: str) -> str:
    """The readable text of an HTML mail (scripts, styles and tags dropped)."""
    parser = _TextOfHtml()
    parser.feed(markup[: 4 * MAX_TEXT_CHARS])
    parser.close()
    text = "".join(parser.out)
    return re.sub(r"\n{3,}", "\n\n", re.sub(r"[ \t]+", " ", text)).strip()


# --- replies ----------------------------------------------------------------------------


def reply(
    *,
    own: Address,
    to: str,
    to_name: str | None,
    subject: str,
    text: str,
    message_id: str,
    in_reply_to: str | None,
    root_id: str | None,
    files: tuple[MailPart, ...] = (),
) -> EmailMessage:
    """A reply in its thread: `Re:` subject, In-Reply-To and References, plain text with
    an HTML part made from the Markdown, and the files attached."""
    msg = EmailMessage()
    msg["From"] = own
    msg["To"] = Address(display_name=to_name or "", addr_spec=to)
    msg["Subject"] = f"Re: {subject}" if subject else "Re: your message"
    msg["Date"] = formatdate(localtime=False)
    msg["Message-ID"] = f"<{message_id}>"
    msg["Auto-Submitted"] = "auto-replied"  # mail systems never answer it in turn
    if in_reply_to:
        msg["In-Reply-To"] = f"<{in_reply_to}>"
        chain = [i for i in (root_id, in_reply_to) if i]
        msg["References"] = " ".join(f"<{i}>" for i in dict.fromkeys(chain))
    msg.set_content(text)
    msg.add_alternative(
        f"<!DOCTYPE html><html><body>{markdown_html(text)}</body></html>", subtype="html"
    )
    for item in files:
        maintype, _, subtype = item.mime.partition("/")
        msg.add_attachment(
            item.data,
            maintype=maintype or "application",
            subtype=subtype or "octet-stream",
            filename=item.name,
        )
    return msg


def reply_id(delivery_id: int | None, thread: str, domain: str) -> str:
    """The reply's Message-ID, fixed by its ledger row: a chunk sent again after a crash
    carries the same id, which mail clients show once."""
    tag = hashlib.sha256(thread.encode()).hexdigest()[:12]
    serial = delivery_id if delivery_id is not None else uuid.uuid4().hex  # not in the ledger
    return f"hermes.{serial}.{tag}@{domain}"


# --- ids ----------------------------------------------------------------------------------


def _ids(header: str) -> list[str]:
    return _MSG_ID.findall(header)


def _first_id(header: str) -> str | None:
    found = _MSG_ID.findall(header)
    return found[0] if found else (header.strip() or None)


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _id_key(message_id: str) -> str:
    """A Message-ID as the gateway keeps ids (no '/', no '..', bounded): itself when fit,
    else its hash."""
    try:
        validate_id("message_id", message_id)
    except ValueError:
        return _hash(message_id.encode())
    return message_id if len(message_id) <= MAX_ID_CHARS else _hash(message_id.encode())
