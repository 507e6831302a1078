"""A real IMAP server (Debian's Dovecot, a maildir in a temporary directory, plain text
on a free loopback port) and a real SMTP server (aiosmtpd) that keeps what it receives,
for the email adapter's tests. Each starts and stops with its test module; a missing
Dovecot skips the tests, saying how to install it (`.ci/run` does)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

from scripts.harness import free_port

DOVECOT = shutil.which("dovecot") or "/usr/sbin/dovecot"
USER, PASSWORD = "hermes", "imap-pass-7"
START_SECONDS = 20.0


def dovecot_missing() -> str | None:
    """Why Dovecot cannot run here (None: it can)."""
    if not Path(DOVECOT).exists():
        return "Dovecot is not installed (apt-get install dovecot-imapd; .ci/run does)"
    if os.geteuid() != 0:
        return "Dovecot's test server runs its mail processes as the dovecot user: needs root"
    return None


@dataclass
class Imap:
    host: str
    port: int
    root: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def inbox(self) -> Path:
        return self.root / "mail" / USER


@contextmanager
def dovecot() -> Iterator[Imap]:
    """A Dovecot IMAP server for user `USER`/`PASSWORD` on 127.0.0.1 (no TLS)."""
    root = Path(tempfile.mkdtemp(prefix="hermes-dovecot-"))
    os.chmod(root, 0o755)  # the mail processes run as the dovecot user
    port = free_port()
    (root / "mail").mkdir()
    shutil.chown(root / "mail", "dovecot", "dovecot")
    (root / "passwd").write_text(f"{USER}:{{PLAIN}}{PASSWORD}\n")
    (root / "dovecot.conf").write_text(
        f"""
protocols = imap
listen = 127.0.0.1
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
info_log_path = {root}/dovecot.log
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
default_login_user = dovenull
default_internal_user = dovecot
mail_location = maildir:{root}/mail/%u
first_valid_uid = 1
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service anvil {{
  chroot =
}}
service imap-login {{
  chroot =
}}
passdb {{
  driver = passwd-file
  args = {root}/passwd
}}
userdb {{
  driver = static
  args = uid=dovecot gid=dovecot home={root}/mail/%u
}}
"""
    )
    process = subprocess.Popen(
        [DOVECOT, "-F", "-c", str(root / "dovecot.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_greeting(port, process, root)
        yield Imap("127.0.0.1", port, root, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        shutil.rmtree(root, ignore_errors=True)


def _wait_greeting(port: int, process: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            log = (root / "dovecot.log").read_text() if (root / "dovecot.log").exists() else ""
            raise RuntimeError(f"dovecot exited {process.returncode}: {err}{log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                if conn.recv(200).startswith(b"* OK"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("dovecot did not greet within its start time")


# --- IMAP from the test's side (a person's mail client) -------------------------------------


def append(imap: Imap, message: EmailMessage | bytes, folder: str = "INBOX") -> None:
    """Deliver a message into the bot's folder, as a mail server would."""
    import imaplib

    raw = message if isinstance(message, bytes) else message.as_bytes()
    client = imaplib.IMAP4(imap.host, imap.port, timeout=10)
    try:
        client.login(USER, PASSWORD)
        client.append(folder, "", None, raw)
    finally:
        client.logout()


def seen_flags(imap: Imap) -> dict[str, bool]:
    """Message-ID -> whether the message is marked \\Seen, for every message in INBOX."""
    import imaplib

    client = imaplib.IMAP4(imap.host, imap.port, timeout=10)
    try:
        client.login(USER, PASSWORD)
        client.select("INBOX", readonly=True)
        _, data = client.fetch("1:*", "(FLAGS BODY.PEEK[HEADER.FIELDS (MESSAGE-ID)])")
    finally:
        client.logout()
    flags: dict[str, bool] = {}
    for item in data:
        if isinstance(item, tuple):
            header = item[1].decode(errors="replace")
            flags[header.split(":", 1)[-1].strip()] = b"\\Seen" in item[0]
    return flags


# --- SMTP: where the bot's replies arrive --------------------------------------------------


class Outbox:
    """A real SMTP server (aiosmtpd) on a free loopback port, keeping each message."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.messages: list[EmailMessage] = []
        self.envelopes: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._controller = Controller(self, hostname="127.0.0.1", port=self.port)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        message = BytesParser(policy=policy.default).parsebytes(envelope.content)
        with self._lock:
            self.messages.append(message)  # type: ignore[arg-type]
            self.envelopes.append({"from": envelope.mail_from, "to": envelope.rcpt_tos})
        return "250 OK"

    def start(self) -> Outbox:
        self._controller.start()
        return self

    def stop(self) -> None:
        self._controller.stop()

    def wait(self, count: int, within: float = 20.0) -> list[EmailMessage]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.messages) >= count:
                    return list(self.messages)
            time.sleep(0.02)
        with self._lock:
            got = [str(m["Subject"]) for m in self.messages]
        raise AssertionError(f"expected {count} mails, got {len(got)}: {got}")


def mail(
    sender: str,
    text: str,
    *,
    subject: str = "Hello",
    message_id: str,
    in_reply_to: str | None = None,
    references: list[str] | None = None,
    headers: dict[str, str] | None = None,
    html: str | None = None,
) -> EmailMessage:
    """A message a person (or a mail system) sends to the bot."""
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = "hermes@example.org"
    msg["Subject"] = subject
    msg["Message-ID"] = f"<{message_id}>"
    if in_reply_to:
        msg["In-Reply-To"] = f"<{in_reply_to}>"
    if references:
        msg["References"] = " ".join(f"<{r}>" for r in references)
    for name, value in (headers or {}).items():
        msg[name] = value
    if html is not None:
        msg.set_content(html, subtype="html")
    else:
        msg.set_content(text)
    return msg
