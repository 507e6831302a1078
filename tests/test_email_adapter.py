"""The email adapter against real servers: Debian's Dovecot as the bot's IMAP mailbox and
aiosmtpd receiving its replies, with the gateway as a real daemon (a subprocess, the echo
agent). A message is answered once, in its thread (In-Reply-To, References, `Re:`, text
and HTML); a reply to the reply continues the session; auto-replies, list mail and
bounces are read and left unanswered; a stranger is denied (and offered pairing by
reply), a whole allowed domain is let in; HTML-only mail reaches the agent as text; an
attachment reaches the turn; and a kill -9 at any step between accepting a message and
sending its reply ends in exactly one reply."""

from __future__ import annotations

import time
from collections.abc import Iterator
from email.message import EmailMessage
from pathlib import Path

import pytest

from adapters.mail import message
from adapters.mail.adapter import EmailAdapter
from config import GatewayConfig
from gateway.domain.attachments import InboundMedia
from scripts.harness import Daemon
from tests.mail_support import (
    PASSWORD,
    USER,
    Imap,
    Outbox,
    append,
    dovecot,
    dovecot_missing,
    mail,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(dovecot_missing() is not None, reason=str(dovecot_missing())),
]

BOT = "hermes@example.org"


@pytest.fixture(scope="module")
def imap() -> Iterator[Imap]:
    with dovecot() as server:
        yield server


@pytest.fixture
def outbox() -> Iterator[Outbox]:
    box = Outbox().start()
    yield box
    box.stop()


def settings(imap: Imap, outbox: Outbox, folder: str, poll: float = 0.5) -> str:
    """The daemon's email section (it follows `platforms: http:` in hermes.yaml)."""
    return (
        "  email:\n"
        "    enabled: true\n"
        f"    address: {BOT}\n"
        "    display_name: Hermes\n"
        f"    imap: {{host: 127.0.0.1, port: {imap.port}, username: {USER},"
        f" password: '${{IMAP_PASSWORD}}', tls: false, folder: {folder}}}\n"
        f"    smtp: {{host: 127.0.0.1, port: {outbox.port}, tls: false}}\n"
        '    allowed_users: ["alice@example.org", "@friends.org"]\n'
        f"    poll_interval: {poll}\n"
        "    require_mention: false\n"
    )


def new_folder(imap: Imap, name: str) -> str:
    """A folder of the test's own in the shared mailbox: tests never see each other's mail."""
    import imaplib

    client = imaplib.IMAP4(imap.host, imap.port, timeout=10)
    try:
        client.login(USER, PASSWORD)
        client.create(name)
    finally:
        client.logout()
    return name


@pytest.fixture
def daemon(tmp_path: Path, imap: Imap, outbox: Outbox, request: pytest.FixtureRequest):
    folder = new_folder(imap, f"t{abs(hash(request.node.name)) % 10**8}")
    gateway = Daemon(
        tmp_path / "home",
        settings(imap, outbox, folder),
        env={"IMAP_PASSWORD": PASSWORD},
    )
    gateway.folder = folder  # type: ignore[attr-defined]
    yield gateway
    gateway.ensure_stopped()
    log = gateway.log_path.read_text(errors="replace") if gateway.log_path.exists() else ""
    assert PASSWORD not in log


def body(msg: EmailMessage) -> str:
    part = msg.get_body(preferencelist=("plain",))
    assert part is not None
    return str(part.get_content()).replace("\r\n", "\n").strip()  # as sent: CRLF lines


def test_a_message_is_answered_once_in_its_thread_and_a_reply_continues_it(
    daemon: Daemon, imap: Imap, outbox: Outbox
) -> None:
    daemon.start()
    folder = daemon.folder  # type: ignore[attr-defined]
    first = mail("Alice <alice@example.org>", "What is up?", subject="Plans", message_id="a1@ex")
    append(imap, first, folder)
    (answer,) = outbox.wait(1)
    assert answer["Subject"] == "Re: Plans"
    assert answer["In-Reply-To"] == "<a1@ex>" and "<a1@ex>" in answer["References"]
    assert answer["To"].addresses[0].addr_spec == "alice@example.org"
    assert answer["From"].addresses[0].addr_spec == BOT
    assert body(answer) == "echo: Plans\n\nWhat is up?"
    html = answer.get_body(preferencelist=("html",))
    assert html is not None and "What is up?" in html.get_content()

    # Her reply to the reply: quoted text cut, the same session (the echo agent's answer
    # carries no history, so the session is read from the store).
    again = mail(
        "alice@example.org",
        "Second thought.\n\nOn Fri, Hermes wrote:\n> echo: Plans",
        subject="Re: Plans",
        message_id="a2@ex",
        in_reply_to=str(answer["Message-ID"]).strip("<>"),
        references=["a1@ex", str(answer["Message-ID"]).strip("<>")],
    )
    append(imap, again, folder)
    replies = outbox.wait(2)
    assert body(replies[1]) == "echo: Second thought."
    assert replies[1]["References"].split()[0] == "<a1@ex>"
    all_seen(imap, folder)
    assert daemon.stop() == 0
    conn = daemon.db()
    try:
        keys = [k for (k,) in conn.execute("SELECT session_key FROM session_entries")]
        turns = conn.execute("SELECT count(*) FROM messages WHERE role = 'user'").fetchone()[0]
    finally:
        conn.close()
    assert keys == ["agent:main:email:dm:alice@example.org:a1@ex"], keys  # the thread's one
    assert turns == 2
    assert len(outbox.messages) == 2  # nothing more after the restart-free stop


def all_seen(imap: Imap, folder: str, within: float = 20.0) -> dict[str, bool]:
    """The folder's \\Seen flags once every message has it (the adapter marks a message
    one IMAP round trip after the gateway accepted it, which may come after the reply
    went out by SMTP); an AssertionError with the flags if that does not happen."""
    deadline = time.monotonic() + within
    while True:
        flags = seen_flags_of(imap, folder)
        if all(flags.values()) or time.monotonic() > deadline:
            assert all(flags.values()), flags
            return flags
        time.sleep(0.1)


def seen_flags_of(imap: Imap, folder: str) -> dict[str, bool]:
    import imaplib

    client = imaplib.IMAP4(imap.host, imap.port, timeout=10)
    try:
        client.login(USER, PASSWORD)
        client.select(folder, readonly=True)
        _, data = client.fetch("1:*", "(FLAGS BODY.PEEK[HEADER.FIELDS (MESSAGE-ID)])")
    finally:
        client.logout()
    return {
        item[1].decode().split(":", 1)[-1].strip(): b"\\Seen" in item[0]
        for item in data
        if isinstance(item, tuple)
    }


def test_automatic_and_list_mail_is_read_and_left_unanswered(
    daemon: Daemon, imap: Imap, outbox: Outbox
) -> None:
    daemon.start()
    folder = daemon.folder  # type: ignore[attr-defined]
    for n, headers in enumerate(
        (
            {"Auto-Submitted": "auto-replied"},
            {"Precedence": "bulk"},
            {"List-Id": "<team.lists.example.org>"},
        )
    ):
        append(
            imap,
            mail("alice@example.org", "away", message_id=f"auto{n}@ex", headers=headers),
            folder,
        )
    append(imap, mail("MAILER-DAEMON@example.org", "bounce", message_id="b1@ex"), folder)
    append(imap, mail("alice@example.org", "a real one", message_id="real@ex"), folder)
    (only,) = outbox.wait(1)
    assert body(only) == "echo: Hello\n\na real one"
    flags = all_seen(imap, folder)
    assert len(flags) == 5, flags  # all read, one answered
    assert daemon.stop() == 0
    assert len(outbox.messages) == 1


def test_strangers_are_denied_and_offered_pairing_and_allowed_domains_get_in(
    daemon: Daemon, imap: Imap, outbox: Outbox
) -> None:
    daemon.start()
    folder = daemon.folder  # type: ignore[attr-defined]
    append(imap, mail("mallory@evil.example", "let me in", message_id="s1@ex"), folder)
    (pairing,) = outbox.wait(1)
    assert pairing["To"].addresses[0].addr_spec == "mallory@evil.example"
    assert "pairing code" in body(pairing) and "let me in" not in body(pairing)
    append(imap, mail("bob@friends.org", "hi from a friend", message_id="f1@ex"), folder)
    replies = outbox.wait(2)
    assert body(replies[1]) == "echo: Hello\n\nhi from a friend"
    assert daemon.stop() == 0


def test_html_only_mail_is_read_as_text_and_an_attachment_reaches_the_turn(
    daemon: Daemon, imap: Imap, outbox: Outbox
) -> None:
    daemon.start()
    folder = daemon.folder  # type: ignore[attr-defined]
    html = "<html><head><style>p{}</style></head><body><p>Hello <b>there</b></p></body></html>"
    append(imap, mail("alice@example.org", "", html=html, message_id="h1@ex"), folder)
    (answer,) = outbox.wait(1)
    assert body(answer) == "echo: Hello\n\nHello there"
    with_file = mail("alice@example.org", "see the notes", subject="Notes", message_id="f2@ex")
    with_file.add_attachment(
        b"line one\nline two\n", maintype="text", subtype="plain", filename="notes.txt"
    )
    append(imap, with_file, folder)
    replies = outbox.wait(2)
    # The turn read the file: the echo agent's answer names what it was given.
    assert "notes.txt" in body(replies[1]), body(replies[1])
    assert daemon.stop() == 0


def test_idle_wakes_the_adapter_without_waiting_for_a_poll(
    tmp_path: Path, imap: Imap, outbox: Outbox
) -> None:
    """Polling once an hour, a message is still answered within seconds: the server's
    IDLE announcement wakes the adapter."""
    folder = new_folder(imap, "idle")
    gateway = Daemon(
        tmp_path / "home",
        settings(imap, outbox, folder, poll=3600),
        env={"IMAP_PASSWORD": PASSWORD},
    )
    try:
        gateway.start()
        append(imap, mail("alice@example.org", "anyone?", message_id="idle1@ex"), folder)
        (answer,) = outbox.wait(1, within=15)
        assert body(answer) == "echo: Hello\n\nanyone?"
        assert gateway.stop() == 0
    finally:
        gateway.ensure_stopped()


@pytest.mark.parametrize("point", ["after_turn_begin", "after_transcript_write"])
def test_a_kill9_between_accepting_and_sending_ends_in_exactly_one_reply(
    daemon: Daemon, imap: Imap, outbox: Outbox, point: str
) -> None:
    folder = daemon.folder  # type: ignore[attr-defined]
    append(imap, mail("alice@example.org", "once please", message_id=f"k-{point}@ex"), folder)
    daemon.start(env={"HERMES_CRASH_AT": f"{point}:1"})
    daemon.wait_exit(30)  # it killed itself at the point
    assert not outbox.messages
    daemon.start()
    (answer,) = outbox.wait(1)
    assert body(answer) == "echo: Hello\n\nonce please"
    # The restart answers from the journal while the adapter connects; its pass over
    # the unseen mail then finds the message accepted already, and marks it read.
    all_seen(imap, folder)
    assert daemon.stop() == 0
    assert len(outbox.messages) == 1


def test_a_reply_sent_again_after_a_crash_is_the_same_message(
    daemon: Daemon, imap: Imap, outbox: Outbox
) -> None:
    """Killed after the SMTP server took the reply and before the ledger marked it sent,
    the restart sends it again: with the same Message-ID, which clients show once."""
    folder = daemon.folder  # type: ignore[attr-defined]
    append(imap, mail("alice@example.org", "twice?", message_id="t1@ex"), folder)
    daemon.start(env={"HERMES_CRASH_AT": "before_ledger_mark:1"})
    daemon.wait_exit(30)
    daemon.start()
    sent = outbox.wait(2)
    assert sent[0]["Message-ID"] == sent[1]["Message-ID"]
    assert daemon.stop() == 0


# --- parsing, without servers --------------------------------------------------------------


def test_tls_false_is_refused_for_a_remote_host() -> None:
    with pytest.raises(ValueError, match="loopback"):
        GatewayConfig.model_validate(
            {"platforms": {"email": {"smtp": {"host": "smtp.example.org", "tls": False}}}}
        )
    with pytest.raises(ValueError, match="STARTTLS is not supported"):
        GatewayConfig.model_validate({"platforms": {"email": {"imap": {"tls": "starttls"}}}})


def test_a_message_id_unfit_for_a_key_is_named_by_its_hash() -> None:
    raw = mail("a@b.org", "x", message_id="../../etc@evil").as_bytes()
    parsed = message.parse(raw, BOT)
    assert "/" not in parsed.message_id and ".." not in parsed.message_id
    assert parsed.thread == parsed.message_id


def test_a_file_the_agent_sends_is_attached_to_its_reply(
    tmp_path: Path, imap: Imap, outbox: Outbox
) -> None:
    chart = tmp_path / "chart.png"
    chart.write_bytes(b"\x89PNG\r\n\x1a\nchart")
    folder = new_folder(imap, "files")
    agent = f"agent:\n  backend: tests.fakes.agents:attaching\n  options: {{path: '{chart}'}}\n"
    gateway = Daemon(
        tmp_path / "home", settings(imap, outbox, folder) + agent, env={"IMAP_PASSWORD": PASSWORD}
    )
    try:
        gateway.start()
        append(imap, mail("alice@example.org", "a chart please", message_id="c1@ex"), folder)
        text, with_file = outbox.wait(2)
        assert body(text) == "here it is"
        (part,) = list(with_file.iter_attachments())
        assert part.get_filename() == "chart.png" and part.get_content_type() == "image/png"
        assert part.get_payload(decode=True) == chart.read_bytes()
        assert body(with_file) == "a chart"
        assert with_file["In-Reply-To"] == "<c1@ex>"
        assert gateway.stop() == 0
    finally:
        gateway.ensure_stopped()


async def test_a_file_fetched_again_after_a_restart_is_bounded_like_any_mail(
    imap: Imap,
) -> None:
    """A file of a mail read before a restart is fetched again by the mail's Message-ID,
    which anyone can reuse: a mail over `max_message_bytes` is refused by the size the
    server gives, before its body is read; one within the bound gives its file."""
    folder = new_folder(imap, "again")
    email = {
        "enabled": True,
        "address": BOT,
        "imap": {
            "host": "127.0.0.1",
            "port": imap.port,
            "username": USER,
            "password": PASSWORD,
            "tls": False,
            "folder": folder,
        },
        "smtp": {"host": "127.0.0.1", "port": 2525, "tls": False},
        "max_message_bytes": 4096,
    }
    config = GatewayConfig.model_validate({"platforms": {"email": email}}).platforms.email
    adapter = EmailAdapter(config)
    for message_id, data in (("small@ex", b"tiny"), ("big@ex", b"x" * 20_000)):
        sent = mail("alice@example.org", "a file", message_id=message_id)
        sent.add_attachment(data, maintype="text", subtype="plain", filename="f.txt")
        append(imap, sent, folder)

    async def fetched(message_id: str) -> bytes:
        item = InboundMedia(kind="document", ref=f"{message_id}\n0", name="f.txt")
        return b"".join([piece async for piece in adapter.open_media(item)])

    assert await fetched("small@ex") == b"tiny"
    with pytest.raises(ValueError, match=r"over platforms\.email\.max_message_bytes"):
        await fetched("big@ex")
