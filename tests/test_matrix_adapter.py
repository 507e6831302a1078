"""The Matrix adapter against a real Synapse (tests/matrix_support.py), with the gateway
as a real daemon (a subprocess) and a second Matrix user driven by matrix-nio in the
test: a DM answered; an invitation from an allowed user joined and a stranger's
declined; in a group, only a message that mentions the bot answered; a thread answered
in its thread; a streamed reply arriving as one event edited with m.replace; an image
reaching the turn, and one the agent sends arriving from the content repository; a
file downloaded a piece at a time (so the media size cap stops it early); a
kill -9 between two events, each answered once; and an encrypted room told once that it
is not read, also across a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nio
import pytest

from adapters.matrix.adapter import MatrixAdapter
from config.platforms import MatrixConfig
from gateway.domain.attachments import InboundMedia
from scripts.harness import Daemon
from tests.fakes.openai_server import serve_in_a_thread
from tests.matrix_support import Homeserver, synapse, synapse_missing

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(synapse_missing() is not None, reason=str(synapse_missing())),
]


# A 1x1 PNG.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201a5dd6b7a0000000049454e44ae426082"
)


@pytest.fixture(scope="module")
def homeserver() -> Iterator[Homeserver]:
    with synapse() as server:
        yield server


class Person:
    """A Matrix user in the test, reading what arrives in their rooms."""

    def __init__(self, homeserver: Homeserver, account: dict[str, str]) -> None:
        self.client = nio.AsyncClient(homeserver.url, account["user_id"])
        self.client.access_token = account["access_token"]
        self.client.user_id = account["user_id"]
        self.client.device_id = account["device_id"]
        self.user_id = account["user_id"]
        self.events: list[
            dict[str, Any]
        ] = []  # every room event seen: {room, sender, content, ...}
        self._since: str | None = None

    async def sync(self) -> None:
        response = await self.client.sync(timeout=500, since=self._since)
        assert isinstance(response, nio.SyncResponse), response
        self._since = response.next_batch
        for room_id, info in response.rooms.join.items():
            for event in info.timeline.events:
                self.events.append({"room": room_id, **event.source})

    async def wait(self, predicate: Any, within: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [e for e in self.events if predicate(e)]
            if found:
                return found
            await self.sync()
        raise AssertionError(f"no such event in {within}s; saw {self.events[-5:]}")

    async def say(self, room: str, text: str, **content: Any) -> str:
        response = await self.client.room_send(
            room, "m.room.message", {"msgtype": "m.text", "body": text, **content}
        )
        assert isinstance(response, nio.RoomSendResponse), response
        return response.event_id

    async def room(self, invite: list[str], **options: Any) -> str:
        response = await self.client.room_create(invite=invite, **options)
        assert isinstance(response, nio.RoomCreateResponse), response
        return response.room_id


def replies(events: list[dict[str, Any]], bot: str, room: str) -> list[dict[str, Any]]:
    """The bot's messages in a room (edits not counted)."""
    return [
        e
        for e in events
        if e["room"] == room
        and e.get("sender") == bot
        and e.get("type") == "m.room.message"
        and (e["content"].get("m.relates_to") or {}).get("rel_type") != "m.replace"
    ]


@pytest.fixture
async def accounts(homeserver: Homeserver, request: pytest.FixtureRequest) -> dict[str, Any]:
    tag = f"{abs(hash(request.node.name)) % 10**6}"
    return {name: homeserver.register(f"{name}{tag}") for name in ("bot", "alice", "mallory")}


@pytest.fixture
async def alice(homeserver: Homeserver, accounts: dict[str, Any]) -> AsyncIterator[Person]:
    person = Person(homeserver, accounts["alice"])
    yield person
    await person.client.close()


def daemon_for(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], extra: str = ""
) -> Daemon:
    bot, alice = accounts["bot"], accounts["alice"]
    settings = (
        "  matrix:\n"
        "    enabled: true\n"
        f"    homeserver: {homeserver.url}\n"
        f"    user_id: '{bot['user_id']}'\n"
        "    access_token: '${MATRIX_ACCESS_TOKEN}'\n"
        f"    device_id: {bot['device_id']}\n"
        f"    allowed_users: ['{alice['user_id']}']\n"
        "    sync_timeout: 1\n"
        "    edit_interval: 0.2\n"
        f"{extra}"
    )
    return Daemon(tmp_path / "home", settings, env={"MATRIX_ACCESS_TOKEN": bot["access_token"]})


# A room's encryption, and a Megolm event as a client sends it: the bot cannot read one.
ENCRYPTION = {
    "type": "m.room.encryption",
    "state_key": "",
    "content": {"algorithm": "m.megolm.v1.aes-sha2"},
}


def sealed_by(account: dict[str, Any]) -> dict[str, Any]:
    return {
        "algorithm": "m.megolm.v1.aes-sha2",
        "ciphertext": "AwgAEnAC",
        "sender_key": "c2VuZGVy",
        "session_id": "c2Vzc2lvbg",
        "device_id": account["device_id"],
    }


async def joined(person: Person, room: str, user: str, within: float = 30.0) -> None:
    await person.wait(
        lambda e: (
            e["room"] == room
            and e.get("type") == "m.room.member"
            and e.get("state_key") == user
            and e["content"].get("membership") == "join"
        ),
        within,
    )


async def test_a_dm_is_answered_and_a_strangers_invitation_is_declined(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    daemon = daemon_for(tmp_path, homeserver, accounts)
    mallory = Person(homeserver, accounts["mallory"])
    try:
        daemon.start()
        room = await alice.room([bot], is_direct=True)
        await joined(alice, room, bot)
        await alice.say(room, "hello there")
        (answer,) = await alice.wait(lambda e: replies([e], bot, room))
        assert answer["content"]["body"] == "echo: hello there"
        assert "formatted_body" in answer["content"]

        stranger_room = await mallory.room([bot], is_direct=True)
        await mallory.wait(
            lambda e: (
                e["room"] == stranger_room
                and e.get("state_key") == bot
                and e["content"].get("membership") == "leave"
            )
        )
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()
        await mallory.client.close()
    log = daemon.log_path.read_text(errors="replace")
    assert accounts["bot"]["access_token"] not in log


async def test_in_a_group_only_a_mention_is_answered_and_a_thread_stays_a_thread(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    carol = homeserver.register(f"carol{abs(hash(str(tmp_path))) % 10**6}")
    daemon = daemon_for(tmp_path, homeserver, accounts)
    try:
        daemon.start()
        room = await alice.room([bot, carol["user_id"]], name="team")
        await joined(alice, room, bot)
        other = Person(homeserver, carol)
        assert isinstance(await other.client.join(room), nio.JoinResponse)
        await other.client.close()
        await joined(alice, room, carol["user_id"])
        await alice.say(room, "just chatting")
        root = await alice.say(room, f"{bot} what now?")
        (answer,) = await alice.wait(lambda e: replies([e], bot, room))
        assert answer["content"]["body"] == f"echo: {bot} what now?"
        # In a thread of that message: the answer is in the thread.
        await alice.say(
            room,
            f"{bot} in the thread",
            **{"m.relates_to": {"rel_type": "m.thread", "event_id": root}},
        )
        threaded = await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 2)
        assert threaded
        last = replies(alice.events, bot, room)[-1]
        # A thread is shared by its members: the agent is told who wrote.
        assert last["content"]["body"].endswith(f"{bot} in the thread"), last["content"]
        assert last["content"]["m.relates_to"]["rel_type"] == "m.thread"
        assert last["content"]["m.relates_to"]["event_id"] == root
        assert daemon.stop() == 0
        # Nothing answered the message without a mention.
        bodies = [r["content"]["body"] for r in replies(alice.events, bot, room)]
        assert len(bodies) == 2 and not any("just chatting" in b for b in bodies), bodies
    finally:
        daemon.ensure_stopped()


async def test_a_kill9_between_two_events_answers_each_once(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    daemon = daemon_for(tmp_path, homeserver, accounts)
    try:
        daemon.start()
        room = await alice.room([bot], is_direct=True)
        await joined(alice, room, bot)
        await alice.say(room, "first")
        await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 1)
        daemon.stop()
        # The second message's turn begins, and the daemon dies right there.
        daemon.start(env={"HERMES_CRASH_AT": "after_turn_begin:1"})
        await alice.say(room, "second")
        await asyncio.to_thread(daemon.wait_exit, 30)
        daemon.start()
        await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 2)
        await alice.say(room, "third")
        await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 3)
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()
    bodies = [r["content"]["body"] for r in replies(alice.events, bot, room)]
    assert bodies == ["echo: first", "echo: second", "echo: third"], bodies


async def test_a_streamed_reply_is_one_event_edited_in_place(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    words = " ".join(f"word{n}" for n in range(12))
    with serve_in_a_thread(reply=lambda body: words) as (model, _):
        model.stream_delay = 0.1
        extra = ""
        agent = f"agent: {{backend: openai, base_url: '{model.base_url}', model: m}}\n"
        daemon = daemon_for(tmp_path, homeserver, accounts, extra)
        (daemon.home / "hermes.yaml").write_text((daemon.home / "hermes.yaml").read_text() + agent)
        try:
            daemon.start()
            room = await alice.room([bot], is_direct=True)
            await joined(alice, room, bot)
            await alice.say(room, "stream please")
            first = (await alice.wait(lambda e: replies([e], bot, room)))[0]
            final = await alice.wait(
                lambda e: (
                    e.get("sender") == bot
                    and (e["content"].get("m.new_content") or {}).get("body") == words
                )
            )
            assert final[-1]["content"]["m.relates_to"] == {
                "rel_type": "m.replace",
                "event_id": first["event_id"],
            }
            assert daemon.stop() == 0
        finally:
            daemon.ensure_stopped()
    assert len(replies(alice.events, bot, room)) == 1  # one message, edited


async def test_an_image_reaches_the_turn_and_an_encrypted_room_is_told_once(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    daemon = daemon_for(tmp_path, homeserver, accounts)
    png = PNG
    try:
        daemon.start()
        room = await alice.room([bot], is_direct=True)
        await joined(alice, room, bot)
        uploaded, _ = await alice.client.upload(
            lambda *_: png, content_type="image/png", filename="dot.png", filesize=len(png)
        )
        assert isinstance(uploaded, nio.UploadResponse)
        await alice.client.room_send(
            room,
            "m.room.message",
            {
                "msgtype": "m.image",
                "body": "dot.png",
                "url": uploaded.content_uri,
                "info": {"mimetype": "image/png", "size": len(png)},
            },
        )
        (answer,) = await alice.wait(lambda e: replies([e], bot, room))
        assert "dot.png" in answer["content"]["body"], answer["content"]["body"]

        secret = await alice.room(
            [bot],
            is_direct=True,
            initial_state=[ENCRYPTION],
        )
        await joined(alice, secret, bot)
        sealed = sealed_by(accounts["alice"])
        for _ in range(2):
            await alice.client.room_send(secret, "m.room.encrypted", sealed)
        (notice,) = await alice.wait(lambda e: replies([e], bot, secret))
        assert "encrypted" in notice["content"]["body"]
        await alice.say(room, "and here?")  # the plain room still works afterwards
        await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 2)
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()
    assert len(replies(alice.events, bot, secret)) == 1  # told once, not per message


async def test_a_file_the_agent_sends_arrives_as_an_image_from_the_content_repository(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    bot = accounts["bot"]["user_id"]
    chart = tmp_path / "chart.png"
    chart.write_bytes(PNG)
    agent = f"agent:\n  backend: tests.fakes.agents:attaching\n  options: {{path: '{chart}'}}\n"
    daemon = daemon_for(tmp_path, homeserver, accounts)
    (daemon.home / "hermes.yaml").write_text((daemon.home / "hermes.yaml").read_text() + agent)
    try:
        daemon.start()
        room = await alice.room([bot], is_direct=True)
        await joined(alice, room, bot)
        await alice.say(room, "a chart please")
        sent = await alice.wait(lambda e: len(replies(alice.events, bot, room)) >= 2)
        assert sent
        text, image = replies(alice.events, bot, room)[:2]
        assert text["content"]["body"] == "here it is"
        assert image["content"]["msgtype"] == "m.image" and image["content"]["body"] == "a chart"
        downloaded = await alice.client.download(mxc=image["content"]["url"])
        assert isinstance(downloaded, nio.MemoryDownloadResponse)
        assert downloaded.body == PNG
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()


async def test_a_file_is_downloaded_a_piece_at_a_time_so_the_size_cap_stops_it_early(
    homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    """The adapter's download against the real content repository: a 1 MiB upload
    arrives in pieces of at most 64 KiB (the media intake counts them and gives up past
    `media.max_bytes`, so a large file is never held whole), all of it when read to the
    end; a missing file and a URI that is not `mxc://` are a FileNotFoundError."""
    blob = bytes(range(256)) * 4096  # 1 MiB
    uploaded, _ = await alice.client.upload(
        lambda *_: blob, content_type="application/octet-stream", filesize=len(blob)
    )
    assert isinstance(uploaded, nio.UploadResponse), uploaded
    bot = accounts["bot"]
    adapter = MatrixAdapter(
        MatrixConfig(
            enabled=True,
            homeserver=homeserver.url,
            user_id=bot["user_id"],
            access_token=bot["access_token"],
        )
    )
    adapter.client = nio.AsyncClient(homeserver.url, bot["user_id"])
    adapter.client.access_token = bot["access_token"]
    try:
        media = InboundMedia(kind="document", ref=uploaded.content_uri, name="blob.bin")
        stream = adapter.open_media(media)
        first = await anext(stream)
        assert 0 < len(first) <= 1 << 16
        await stream.aclose()  # what the intake does past its cap: the rest is not read
        pieces = [piece async for piece in adapter.open_media(media)]
        assert len(pieces) > 1 and b"".join(pieces) == blob
        gone = InboundMedia(kind="document", ref=uploaded.content_uri + "x", name="gone")
        with pytest.raises(FileNotFoundError, match="HTTP 404"):
            [piece async for piece in adapter.open_media(gone)]
        with pytest.raises(FileNotFoundError, match="not a content repository URI"):
            [piece async for piece in adapter.open_media(InboundMedia("photo", "https://x/y", "y"))]
    finally:
        await adapter.client.close()


async def test_an_encrypted_room_is_not_told_again_after_a_restart(
    tmp_path: Path, homeserver: Homeserver, accounts: dict[str, Any], alice: Person
) -> None:
    """The notice goes through the delivery ledger and is remembered durably: after a
    restart, another encrypted message in the room gets no second notice. A plain
    message sent after it in the same room is answered, which shows the encrypted one
    before it was read by then."""
    bot = accounts["bot"]["user_id"]
    daemon = daemon_for(tmp_path, homeserver, accounts)
    sealed = sealed_by(accounts["alice"])

    def notices() -> list[dict[str, Any]]:
        told = replies(alice.events, bot, secret)
        return [e for e in told if "encrypted" in e["content"]["body"]]

    try:
        daemon.start()
        secret = await alice.room([bot], is_direct=True, initial_state=[ENCRYPTION])
        await joined(alice, secret, bot)
        await alice.client.room_send(secret, "m.room.encrypted", sealed)
        await alice.wait(lambda e: bool(notices()))
        assert daemon.stop() == 0
        daemon.start()
        await alice.client.room_send(secret, "m.room.encrypted", sealed)
        await alice.say(secret, "plain after it")
        answered = "echo: plain after it"
        await alice.wait(
            lambda e: any(r["content"]["body"] == answered for r in replies([e], bot, secret))
        )
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()
    assert len(notices()) == 1
