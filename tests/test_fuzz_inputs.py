"""Hypothesis fuzzing of every inbound parser, through the real stack.

Each chat platform runs with NO allowed users, `unauthorized_dm_behavior: ignore` and
`require_mention: true`: whatever a fuzzed payload is (malformed, or a perfectly valid
message) the adapter parses it, and nobody is ever authorized, so the store must stay
empty, the bot must send nothing, the adapter must stay `running` and keep answering. At
the end of each platform test the operator pairs the fuzzed user and one valid message
must then be stored: proof that the harness waits long enough to see a stored message
(so the "nothing stored" checks are not vacuous).

The HTTP API has no per-user access control: every request must get 202, 400 or 413, a
refusal writes nothing, and a 202 carries {session_key, status[, detail]}.

Each test owns an event loop (Hypothesis cannot drive pytest-asyncio's per-test loop):
the fake platform and the GatewayRunner start once, every example runs on that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gzip
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode

import aiohttp
from discord.gateway import DiscordWebSocket
from discord.http import Route
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.base import AcceptStatus
from adapters.discord import DiscordAdapter
from adapters.http import HttpAdapter
from adapters.slack import SlackAdapter
from adapters.telegram import SECRET_HEADER, WEBHOOK_MAX_BODY_BYTES, TelegramAdapter
from config import GatewayConfig
from gateway.run import GatewayRunner
from gateway.session import CHAT_TYPES
from tests.fakes.discord_api import FakeDiscord
from tests.fakes.slack_api import (
    BOT_USER_ID,
    FakeSlack,
    app_mention,
    channel_message,
    dm,
    next_ts,
    signature,
    url_verification,
)
from tests.fakes.telegram_api import BOT_USER, FakeTelegram

T = TypeVar("T")
R = TypeVar("R")

FUZZ_SETTINGS: dict[str, Any] = {
    "deadline": None,  # a real network round trip per example
    "suppress_health_check": [HealthCheck.function_scoped_fixture],
    # The same examples on every run, so CI on a clean clone judges the code, not luck.
    # Explore further by hand: HYPOTHESIS_FUZZ_RANDOM=1 .venv/bin/python -m pytest ...
    "derandomize": not os.environ.get("HYPOTHESIS_FUZZ_RANDOM"),
}
#: how long to wait for a platform's background processing of one example
SETTLE_SECONDS = 5.0

# --- strategies --------------------------------------------------------------------------

ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\x1b[31mred\x1b[0m",
    "line\nbreak\r\n",
    "\u2028\u2029",
    "\u202eevil\u202c",
    "\u2066isolate\u2069",
    "\ufeffbom",
    "\u200b\u200d\u2060",
    "e\u0301\u0301\u0301",
    "\U0001f600\U0001f469\u200d\U0001f4bb",
    "\U0010ffff",
    "\x7f\x85\x9f",
    "../../etc/passwd",
    "a/b\\c",
    "..",
    "%3A:%25",
    "agent:main:http:dm:x",
    "@hermes_test_bot",
    f"<@{BOT_USER_ID}>",
    "<@1100000000000000001>",
    "<@&1100000000000000014>",
    "/new",
    "/stop@hermes_test_bot",
    "/queue do it",
    "NaN",
    "null",
    "0",
    "-1",
    "1e309",
    "true",
]
INT_EDGES = [0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40]

odd_text = st.sampled_from(ODD_STRINGS) | st.text(max_size=24)
ints = st.integers() | st.sampled_from(INT_EDGES)
floats = st.floats(allow_nan=False, allow_infinity=False)
leaves = st.none() | st.booleans() | ints | floats | odd_text
#: (a) arbitrary JSON
json_values = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(odd_text, kids, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(odd_text, json_values, max_size=6)
#: 10-100 KB, built from a short piece so Hypothesis does not have to draw every character
huge_text = st.builds(
    lambda piece, size: (piece * (size // len(piece) + 1))[:size],
    st.text(min_size=1, max_size=4) | st.sampled_from([s for s in ODD_STRINGS if s]),
    st.integers(10_000, 100_000),
)
#: a lone surrogate: valid JSON (an escape like \\ud800) that Python cannot encode to UTF-8
lone_surrogate = st.builds(
    lambda before, code, after: before + chr(code) + after,
    st.text(max_size=4),
    st.integers(0xD800, 0xDFFF),
    st.text(max_size=4),
)


@dataclass(frozen=True)
class Deep:
    """A value nested `depth` levels deep, written as raw JSON text by `encode` (json.dumps
    itself would hit the recursion limit)."""

    depth: int
    kind: str  # "list" or "dict"

    def text(self) -> str:
        if self.kind == "list":
            return "[" * self.depth + "]" * self.depth
        return '{"a":' * self.depth + "null" + "}" * self.depth


#: Either parseable or far too deep for any recursion limit (Hypothesis raises the limit
#: while a test runs, so a depth near it would fail one run and pass the next).
deep_values = st.builds(
    Deep, st.integers(50, 400) | st.integers(20_000, 30_000), st.sampled_from(["list", "dict"])
)


def encode(value: Any) -> bytes:
    """JSON bytes (ASCII escapes, so lone surrogates survive) with Deep values expanded."""
    deep: list[Deep] = []

    def swap(node: Any) -> Any:
        if isinstance(node, Deep):
            deep.append(node)
            return f"@@DEEP{len(deep) - 1}@@"
        if isinstance(node, dict):
            return {k: swap(v) for k, v in node.items()}
        if isinstance(node, list):
            return [swap(v) for v in node]
        return node

    text = json.dumps(swap(value))
    for index, node in enumerate(deep):
        text = text.replace(f'"@@DEEP{index}@@"', node.text(), 1)
    return text.encode("ascii")


def _slots(node: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) of a payload, at any depth."""
    if isinstance(node, dict):
        for key in list(node):
            yield node, key
            yield from _slots(node[key])
    elif isinstance(node, list):
        for index in range(len(node)):
            yield node, index
            yield from _slots(node[index])


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def _wrong_types(current: Any) -> list[Any]:
    candidates: list[Any] = [None, True, 0, -1, 2**64, 1.5, "", "x", [], {}, [current]]
    candidates += [{"v": current}, str(current)]
    return [c for c in candidates if type(c) is not type(current)] or [None]


MUTATIONS = ("drop", "null", "json", "wrong_type", "huge", "odd", "surrogate", "deep", "add")


@st.composite
def mutated(draw: st.DrawFn, bases: list[dict[str, Any]], max_ops: int = 4) -> dict[str, Any]:
    """(b) a valid payload with 1..max_ops structural mutations at any depth."""
    payload = copy.deepcopy(draw(st.sampled_from(bases)))
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 2, max_ops]))):
        op = draw(st.sampled_from(MUTATIONS))
        if op == "add":
            target = draw(st.sampled_from(list(_containers(payload))))
            target[draw(odd_text)] = draw(json_values | huge_text | deep_values)
            continue
        slots = list(_slots(payload))
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        if op == "drop":
            del container[key]
        elif op == "null":
            container[key] = None
        elif op == "json":
            container[key] = draw(json_values)
        elif op == "wrong_type":
            container[key] = draw(st.sampled_from(_wrong_types(container[key])))
        elif op == "huge":
            container[key] = draw(huge_text)
        elif op == "odd":
            container[key] = draw(odd_text)
        elif op == "surrogate":
            container[key] = draw(lone_surrogate)
        else:
            container[key] = draw(deep_values)
    return payload


# --- shared helpers ----------------------------------------------------------------------

STORE_TABLES = ("inbox", "sessions", "session_entries", "messages", "outbound")


async def store_counts(runner: GatewayRunner) -> dict[str, int]:
    """Rows in each table a message could leave behind."""

    def query(conn: Any) -> dict[str, int]:
        return {t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in STORE_TABLES}

    return await runner.store.read(query)


async def assert_store_empty(runner: GatewayRunner) -> None:
    assert await store_counts(runner) == dict.fromkeys(STORE_TABLES, 0)
    assert not await runner.store.has_any_sessions()
    assert await runner.turnlog.open_inbox() == []


async def eventually(
    predicate: Callable[[], bool], what: str, within: float = SETTLE_SECONDS
) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        await asyncio.sleep(0.005)


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    chunked: bool = False,
) -> tuple[int, str, bytes]:
    data: Any = body
    if chunked:

        async def pieces() -> AsyncIterator[bytes]:
            for at in range(0, len(body), 8192):
                yield body[at : at + 8192]

        data = pieces()
    async with session.post(url, data=data, headers=headers) as response:
        return response.status, response.content_type, await response.read()


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    return loop.run_until_complete(coro)


async def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()  # made inside the loop it will run on


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@contextlib.contextmanager
def running(
    start: Coroutine[Any, Any, R], stop: Callable[[R], Coroutine[Any, Any, None]]
) -> Iterator[tuple[asyncio.AbstractEventLoop, R]]:
    """A new event loop with a fake platform and its gateway started on it (once, for
    every example of a test); stopped and closed at the end."""
    loop = asyncio.new_event_loop()
    try:
        rig = run_on(loop, start)
        try:
            yield loop, rig
        finally:
            run_on(loop, stop(rig))
    finally:
        close_loop(loop)


def make_runner(
    platforms: dict[str, Any], adapter_for: Callable[[GatewayConfig], Any], home: Path
) -> tuple[GatewayRunner, Any]:
    config = GatewayConfig.model_validate({"timezone": "UTC", "platforms": platforms})
    adapter = adapter_for(config)
    # agent_factory=None: the built-in echo agent
    return GatewayRunner(config, [adapter], agent_factory=None, home=home), adapter


#: access settings of every chat platform under fuzz: nobody may talk to the bot
LOCKED = {
    "enabled": True,
    "allowed_users": [],
    "allowed_chats": [],
    "unauthorized_dm_behavior": "ignore",
    "require_mention": True,
}


async def pair(runner: GatewayRunner, platform: str, user_id: str) -> None:
    """Approve a user as the operator does (`hermes-gateway pairing approve`)."""
    code = await runner.pairing.request(platform, user_id, None)
    assert code is not None
    assert await runner.pairing.approve(platform, code) is not None


# --- 1. the HTTP API ---------------------------------------------------------------------

HTTP_VALID = [
    {"chat_id": "c1", "user_id": "u1", "text": "hello"},
    {
        "chat_id": "c2",
        "user_id": "u2",
        "text": "hi there",
        "chat_type": "group",
        "thread_id": "t1",
        "message_id": "m1",
        "user_name": "Ada",
    },
    {"chat_id": "c3", "user_id": "u3", "text": "/status", "chat_type": "dm", "message_id": 7},
]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zzz",
    "application/octet-stream",
    "",
    "image/png",
]
#: "gzip+" sends a really gzipped body; "gzip" and "br" claim an encoding the body lacks.
#: (A false "deflate" is refused by aiohttp's HTTP parser before any handler runs, at
#: times by dropping the connection: not the adapter's to answer, so not fuzzed.)
CONTENT_ENCODINGS = [None, None, None, None, "identity", "gzip+", "gzip", "br", "x-bogus"]


@dataclass(frozen=True)
class HttpRequest:
    body: bytes
    content_type: str | None
    content_encoding: str | None
    chunked: bool

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        if self.content_encoding is not None:
            headers["Content-Encoding"] = self.content_encoding.rstrip("+")
        return headers

    def wire_body(self) -> bytes:
        return gzip.compress(self.body) if self.content_encoding == "gzip+" else self.body


ids = st.text(st.characters(codec="ascii", categories=["L", "Nd"]), min_size=1, max_size=12)
#: well-formed messages with fuzzed text and optional fields: they get through to the gateway
http_messages = st.fixed_dictionaries(
    {"chat_id": ids, "user_id": ids, "text": odd_text | huge_text},
    optional={
        "chat_type": st.sampled_from(CHAT_TYPES),
        "thread_id": ids | st.none(),
        "message_id": ids | ints | st.none(),
        "user_name": odd_text | st.none(),
    },
)
http_bodies = st.one_of(
    json_values.map(encode),
    json_objects.map(encode),
    http_messages.map(encode),
    http_messages.map(encode),
    mutated(HTTP_VALID).map(encode),
    st.binary(max_size=300),
    st.sampled_from(
        [b"", b"{", b"[" * 30_000, b"\xff\xfe", b'{"chat_id": NaN}', b"\xef\xbb\xbf{}"]
    ),
)
http_requests = st.builds(
    HttpRequest,
    http_bodies,
    st.sampled_from(CONTENT_TYPES),
    st.sampled_from(CONTENT_ENCODINGS),
    st.booleans(),
)
ACCEPT_STATUSES = {s.value for s in AcceptStatus}
REPLY_KEYS = {"session_key", "status"}


async def http_idle(runner: GatewayRunner) -> None:
    """Wait until no accepted message is unanswered and no turn runs."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while await runner.turnlog.open_inbox() or await runner.turnlog.open_turns():
        if time.monotonic() > deadline:
            raise AssertionError("the gateway did not become idle")
        await asyncio.sleep(0.01)


@dataclass
class HttpRig:
    runner: GatewayRunner
    adapter: HttpAdapter
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"{self.adapter.url}/v1/messages"


async def start_http(tmp_path: Path) -> HttpRig:
    runner, adapter = make_runner(
        {"http": {"enabled": True, "port": 0}},
        lambda config: HttpAdapter(config.platforms.http),
        tmp_path / "home",
    )
    try:
        await runner.start()
    except BaseException:
        await runner.stop()
        raise
    return HttpRig(runner, adapter, await client_session())


async def stop_http(rig: HttpRig) -> None:
    await rig.session.close()
    await rig.runner.stop()


def test_http_api_answers_every_fuzzed_post_with_202_400_or_413(tmp_path: Path) -> None:
    with running(start_http(tmp_path), stop_http) as (loop, rig):
        runner = rig.runner

        async def send_one(request: HttpRequest) -> None:
            await http_idle(runner)
            before = await store_counts(runner)
            status, content_type, raw = await post(
                rig.session,
                rig.url,
                request.wire_body(),
                request.headers(),
                chunked=request.chunked,
            )
            assert status in {202, 400, 413}, (status, raw[:500])
            if status == 202:
                reply = json.loads(raw)
                assert REPLY_KEYS <= reply.keys() <= REPLY_KEYS | {"detail"}, reply
                assert reply["status"] in ACCEPT_STATUSES, reply
                if reply["status"] == AcceptStatus.IGNORED:
                    await http_idle(runner)
                    assert await store_counts(runner) == before, reply
                else:
                    assert isinstance(reply["session_key"], str), reply
            else:
                # The adapter's own refusals are JSON; aiohttp's HTTP parser answers some
                # (an undecodable Content-Encoding) in plain text before any handler runs.
                if content_type == "application/json":
                    reply = json.loads(raw)
                    assert reply.keys() == {"error"} and isinstance(reply["error"], str), reply
                assert await store_counts(runner) == before, (status, raw[:500])
            assert rig.adapter.health()["state"] == "running"

        @given(http_requests)
        @settings(max_examples=200, **FUZZ_SETTINGS)
        def fuzz(request: HttpRequest) -> None:
            run_on(loop, send_one(request))

        fuzz()

        async def still_answers() -> None:
            await http_idle(runner)
            body = encode({"chat_id": "final", "user_id": "u", "text": "hi"})
            status, _, raw = await post(rig.session, rig.url, body, {})
            assert status == 202, raw
            assert json.loads(raw) == {
                "session_key": "agent:main:http:dm:final",
                "status": "started",
            }
            await http_idle(runner)
            keys = [e.session_key for e in await runner.store.list_sessions()]
            assert "agent:main:http:dm:final" in keys

        run_on(loop, still_answers())


POLL_RANGES = {"after": (0, 2**63 - 1), "limit": (1, 500)}
poll_values = st.one_of(
    st.text(max_size=30),
    st.integers(0, 2**70).map(str),
    st.tuples(st.text("0", max_size=25), st.integers(0, 2**64)).map(lambda t: f"{t[0]}{t[1]}"),
    st.integers(-(2**64), 2**64).map(lambda n: f"{n:+}"),
    st.sampled_from(["١٢", "\uff13", "1e3", "0x1f", "1_0", " 7", "7\n", "½", "²"]),
)


def test_http_poll_parameters_are_400_unless_plain_digits_in_range(tmp_path: Path) -> None:
    with running(start_http(tmp_path), stop_http) as (loop, rig):
        url = f"{rig.adapter.url}/v1/chats/c1/messages"

        async def poll_once(name: str, raw: str) -> None:
            async with rig.session.get(url, params={name: raw}) as response:
                status, body = response.status, await response.json()
            low, high = POLL_RANGES[name]
            # The rule, said another way than the adapter says it: ASCII 0-9, in range.
            valid = raw.isascii() and raw.isdigit() and low <= int(raw) <= high
            if valid:
                assert status == 200, (name, raw, body)
                assert body["messages"] == [], body
            else:
                assert status == 400, (name, raw, status, body)
                assert f"query parameter {name} " in body["error"], body

        @given(st.sampled_from(sorted(POLL_RANGES)), poll_values)
        @settings(max_examples=300, **FUZZ_SETTINGS)
        def fuzz(name: str, raw: str) -> None:
            run_on(loop, poll_once(name, raw))

        fuzz()


# --- 2. Telegram (webhook mode) ----------------------------------------------------------

TG_TOKEN = "123456:AAH-fuzz-TOKEN_abcdefghijklmnopqrst"
TG_WEBHOOK_URL = "https://hermes.example/telegram/hook"
TG_SECRET = "fuzz-Secret_42"
TG_STRANGER = FakeTelegram.user(99, "Bob", "bob")
TG_GROUP = FakeTelegram.group_chat(-1001234567890, "Dev chat")
TG_FORUM = FakeTelegram.group_chat(-1002285219667, "Forum", forum=True)


def telegram_bases(tg: FakeTelegram) -> list[dict[str, Any]]:
    """Valid updates from a stranger: a DM, a captioned photo, a group mention, a reply
    to the bot, a forum topic message and a command."""
    chat = tg.private_chat(TG_STRANGER)
    bot_message = {
        "message_id": 7,
        "from": BOT_USER,
        "chat": TG_GROUP,
        "date": int(time.time()),
        "text": "earlier answer",
    }
    photo = tg.make_message_update(chat, TG_STRANGER, "")
    del photo["message"]["text"]
    photo["message"]["caption"] = "look at this"
    photo["message"]["photo"] = [{"file_id": "p", "file_unique_id": "q", "width": 1, "height": 1}]
    return [
        tg.make_message_update(chat, TG_STRANGER, "hello there"),
        photo,
        tg.make_message_update(TG_GROUP, TG_STRANGER, "@hermes_test_bot what's up?"),
        tg.make_message_update(TG_GROUP, TG_STRANGER, "and you?", reply_to=bot_message),
        tg.make_message_update(
            TG_FORUM, TG_STRANGER, "@hermes_test_bot in a topic", message_thread_id=5, is_topic=True
        ),
        tg.make_message_update(chat, TG_STRANGER, "/new"),
    ]


@dataclass
class TelegramRig:
    tg: FakeTelegram
    runner: GatewayRunner
    adapter: TelegramAdapter
    session: aiohttp.ClientSession
    bases: list[dict[str, Any]]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.adapter.webhook_port}/telegram/hook"

    async def post(
        self, body: bytes, secret: str | None = TG_SECRET, encoding: str | None = None
    ) -> tuple[int, str]:
        """POST as Telegram does; `encoding` as in HttpRequest ("gzip+" really gzips)."""
        headers = {"Content-Type": "application/json"}
        if secret is not None:
            headers[SECRET_HEADER] = secret
        if encoding is not None:
            headers["Content-Encoding"] = encoding.rstrip("+")
        wire = gzip.compress(body) if encoding == "gzip+" else body
        status, _, raw = await post(self.session, self.url, wire, headers)
        return status, raw.decode("utf-8", "replace")

    def assert_healthy(self) -> None:
        assert self.adapter.health()["state"] == "running", self.adapter.health()
        assert self.tg.sent == [], self.tg.sent  # nobody is authorized: no reply, no code


async def start_telegram(tmp_path: Path) -> TelegramRig:
    tg = await FakeTelegram(token=TG_TOKEN).start()
    settings_ = {
        **LOCKED,
        "token": TG_TOKEN,
        "base_url": tg.base_url,
        "mode": "webhook",
        "webhook_url": TG_WEBHOOK_URL,
        "webhook_secret": TG_SECRET,
        "port": 0,
    }
    runner, adapter = make_runner(
        {"telegram": settings_},
        lambda config: TelegramAdapter(config.platforms.telegram),
        tmp_path / "home",
    )
    try:
        await runner.start()
    except BaseException:
        await runner.stop()
        await tg.close()
        raise
    return TelegramRig(tg, runner, adapter, await client_session(), telegram_bases(tg))


async def stop_telegram(rig: TelegramRig) -> None:
    await rig.session.close()
    await rig.runner.stop()
    await rig.tg.close()


def telegram_bodies(bases: list[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    update_ids = st.integers(1, 2**31) | ints
    return st.one_of(
        json_values.map(encode),
        st.builds(lambda d, uid: encode({**d, "update_id": uid}), json_objects, update_ids),
        st.builds(lambda m, uid: encode({"update_id": uid, "message": m}), json_values, ints),
        st.sampled_from(bases).map(encode),
        mutated(bases).map(encode),
        mutated(bases).map(encode),
        st.binary(max_size=300),
    )


def test_telegram_webhook_survives_fuzzed_updates_and_stores_nothing(tmp_path: Path) -> None:
    with running(start_telegram(tmp_path), stop_telegram) as (loop, rig):

        async def send_one(body: bytes, encoding: str | None) -> None:
            before = await store_counts(rig.runner)
            status, text = await rig.post(body, encoding=encoding)
            # 400 malformed; 200 ok or skipped (unreadable). 500/503 ask Telegram to retry:
            # never right for an update that will look the same on every retry.
            allowed = {200, 400} | ({413} if len(body) > WEBHOOK_MAX_BODY_BYTES else set())
            assert status in allowed, (status, text[:500])
            if status == 200:
                assert text in {"ok", "skipped"}, text
            assert await store_counts(rig.runner) == before
            rig.assert_healthy()

        @given(telegram_bodies(rig.bases), st.sampled_from(CONTENT_ENCODINGS))
        @settings(max_examples=100, **FUZZ_SETTINGS)
        def fuzz(body: bytes, encoding: str | None) -> None:
            run_on(loop, send_one(body, encoding))

        fuzz()

        async def afterwards() -> None:
            await assert_store_empty(rig.runner)
            # A well-formed update still gets its 200 (ignored: nobody is allowed) ...
            update = rig.tg.make_message_update(
                rig.tg.private_chat(TG_STRANGER), TG_STRANGER, "still there?"
            )
            assert await rig.post(encode(update)) == (200, "ok")
            await assert_store_empty(rig.runner)
            rig.assert_healthy()
            # ... and once the operator pairs the user the same kind of update is stored,
            # synchronously: the per-example checks above would have seen it.
            await pair(rig.runner, "telegram", str(TG_STRANGER["id"]))
            update = rig.tg.make_message_update(
                rig.tg.private_chat(TG_STRANGER), TG_STRANGER, "paired now"
            )
            assert await rig.post(encode(update)) == (200, "ok")
            assert (await store_counts(rig.runner))["inbox"] == 1
            await eventually(lambda: len(rig.tg.sent) == 1, "the echo reply")

        run_on(loop, afterwards())


wrong_secrets = st.one_of(
    st.none(),
    st.text(
        st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_categories=["Cc"]),
        max_size=40,
    ),  # what an HTTP client can send in a header
    st.sampled_from(
        [TG_SECRET[:-1], TG_SECRET + "x", TG_SECRET.upper(), TG_SECRET.lower(), "x" + TG_SECRET]
    ),
).filter(lambda s: s is None or s.strip(" ") != TG_SECRET)  # HTTP trims header values


def test_telegram_webhook_refuses_a_wrong_or_missing_secret(tmp_path: Path) -> None:
    with running(start_telegram(tmp_path), stop_telegram) as (loop, rig):
        run_on(loop, pair(rig.runner, "telegram", str(TG_STRANGER["id"])))

        async def send_one(secret: str | None, body: bytes) -> None:
            status, text = await rig.post(body, secret=secret)
            assert status == 403, (status, text)
            await assert_store_empty(rig.runner)  # even the paired user's update is dropped
            rig.assert_healthy()

        bodies = st.sampled_from(rig.bases).map(encode) | mutated(rig.bases).map(encode)

        @given(wrong_secrets, bodies | st.binary(max_size=50))
        @settings(max_examples=30, **FUZZ_SETTINGS)
        def fuzz(secret: str | None, body: bytes) -> None:
            run_on(loop, send_one(secret, body))

        fuzz()


# --- 3. Slack (HTTP mode) ----------------------------------------------------------------

SLACK_BOT_TOKEN = "xoxb-fuzz-bot-token"
SLACK_SECRET = "fuzz-signing-secret"
SLACK_STRANGER = "U77"
SLACK_MAX_BODY_BYTES = 1024**2  # aiohttp's default client_max_size


def slack_bases() -> list[dict[str, Any]]:
    """Valid Events API payloads from a stranger: a DM, a channel mention (and its
    app_mention twin), a threaded mention, a file share and a url_verification."""
    mention = channel_message("C1", SLACK_STRANGER, f"<@{BOT_USER_ID}> hi there")
    return [
        dm(SLACK_STRANGER, "hello &amp; welcome"),
        mention,
        app_mention(mention),
        channel_message("C1", SLACK_STRANGER, f"<@{BOT_USER_ID}> in a thread", next_ts()),
        dm(SLACK_STRANGER, "a file", subtype="file_share", files=[{"id": "F1"}]),
        url_verification("challenge-abc"),
    ]


@dataclass(frozen=True)
class SlackRequest:
    body: bytes
    form: bool  # as `payload=<json>` (how Slack posts interactivity payloads)


def slack_signed_headers(body: bytes, *, secret: str = SLACK_SECRET) -> dict[str, str]:
    stamp = str(int(time.time()))
    return {
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": signature(secret, stamp, body),
    }


def _slack_body(request: SlackRequest) -> tuple[bytes, str]:
    if request.form:
        return urlencode({"payload": request.body.decode()}).encode(), (
            "application/x-www-form-urlencoded"
        )
    return request.body, "application/json"


def slack_requests(bases: list[dict[str, Any]]) -> st.SearchStrategy[SlackRequest]:
    json_bodies = st.one_of(
        json_values.map(encode),
        json_objects.map(lambda d: encode({**d, "type": "event_callback"})),
        st.builds(
            lambda e, extra: encode({"type": "event_callback", "event": e, **extra}),
            json_values | json_objects.map(lambda d: {**d, "type": "message"}),
            json_objects,
        ),
        st.builds(
            lambda c, t: encode({"type": "url_verification", "challenge": c, "token": t}),
            json_values | huge_text,
            json_values,
        ),
        st.sampled_from(bases).map(encode),
        mutated(bases).map(encode),
        mutated(bases).map(encode),
    )
    return st.one_of(
        st.builds(SlackRequest, json_bodies, st.booleans()),
        st.builds(SlackRequest, st.binary(max_size=300), st.just(False)),
    )


@dataclass
class SlackRig:
    slack: FakeSlack
    runner: GatewayRunner
    adapter: SlackAdapter
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.adapter.port}/slack/events"

    async def post(self, request: SlackRequest, *, secret: str = SLACK_SECRET) -> tuple[int, str]:
        body, content_type = _slack_body(request)
        headers = {"Content-Type": content_type, **slack_signed_headers(body, secret=secret)}
        status, _, raw = await post(self.session, self.url, body, headers)
        await self.listeners_done()
        if status == 413:  # aiohttp's client_max_size, before any handler
            assert len(body) > SLACK_MAX_BODY_BYTES, len(body)
        return status, raw.decode("utf-8", "replace")

    async def listeners_done(self) -> None:
        """Bolt acks first and runs our listener in a task of its own
        (`run_ack_function_asynchronously`); wait for every such task to end."""

        def running() -> bool:
            return any(
                not task.done()
                and getattr(task.get_coro(), "__name__", "") == "run_ack_function_asynchronously"
                for task in asyncio.all_tasks()
            )

        await eventually(lambda: not running(), "bolt's listener tasks")

    def assert_healthy(self) -> None:
        assert self.adapter.health()["state"] == "running", self.adapter.health()
        assert self.slack.posted == [], self.slack.posted


async def start_slack(tmp_path: Path) -> SlackRig:
    slack = FakeSlack(bot_token=SLACK_BOT_TOKEN)
    await slack.start()
    settings_ = {
        **LOCKED,
        "bot_token": SLACK_BOT_TOKEN,
        "signing_secret": SLACK_SECRET,
        "mode": "http",
        "api_base_url": slack.api_base_url,
        "port": 0,
    }
    runner, adapter = make_runner(
        {"slack": settings_}, lambda config: SlackAdapter(config.platforms.slack), tmp_path / "h"
    )
    try:
        await runner.start()
    except BaseException:
        await runner.stop()
        await slack.stop()
        raise
    return SlackRig(slack, runner, adapter, await client_session())


async def stop_slack(rig: SlackRig) -> None:
    await rig.session.close()
    await rig.runner.stop()
    await rig.slack.stop()


def test_slack_events_survive_fuzzed_signed_payloads_and_store_nothing(tmp_path: Path) -> None:
    with running(start_slack(tmp_path), stop_slack) as (loop, rig):

        async def send_one(request: SlackRequest) -> None:
            before = await store_counts(rig.runner)
            status, text = await rig.post(request)
            # 200 acked (or url_verification answered), 404 no listener, 400 malformed,
            # 413 over 1 MiB; a 5xx makes Slack retry the same payload for nothing.
            assert status in {200, 400, 404, 413}, (status, text[:500])
            assert await store_counts(rig.runner) == before
            rig.assert_healthy()

        @given(slack_requests(slack_bases()))
        @settings(max_examples=100, **FUZZ_SETTINGS)
        def fuzz(request: SlackRequest) -> None:
            run_on(loop, send_one(request))

        fuzz()

        async def afterwards() -> None:
            await assert_store_empty(rig.runner)
            status, text = await rig.post(SlackRequest(encode(dm(SLACK_STRANGER, "hi")), False))
            assert status == 200, text
            challenge = SlackRequest(encode(url_verification("c-123")), False)
            assert await rig.post(challenge) == (200, '{"challenge": "c-123"}')
            await assert_store_empty(rig.runner)
            rig.assert_healthy()
            # Paired, the same kind of event is stored by the time listeners_done returns.
            await pair(rig.runner, "slack", SLACK_STRANGER)
            status, text = await rig.post(SlackRequest(encode(dm(SLACK_STRANGER, "hi!")), False))
            assert status == 200, text
            assert (await store_counts(rig.runner))["inbox"] == 1
            await eventually(lambda: len(rig.slack.posted) == 1, "the echo reply")

        run_on(loop, afterwards())


def test_slack_events_refuse_unsigned_payloads_with_401(tmp_path: Path) -> None:
    with running(start_slack(tmp_path), stop_slack) as (loop, rig):
        run_on(loop, pair(rig.runner, "slack", SLACK_STRANGER))

        async def send_one(request: SlackRequest) -> None:
            status, text = await rig.post(request, secret="not-the-signing-secret")
            assert status in {401, 413}, (status, text[:500])
            await assert_store_empty(rig.runner)  # even the paired user's events
            rig.assert_healthy()

        @given(slack_requests(slack_bases()))
        @settings(max_examples=30, **FUZZ_SETTINGS)
        def fuzz(request: SlackRequest) -> None:
            run_on(loop, send_one(request))

        fuzz()


# --- 4. Discord (gateway websocket) ------------------------------------------------------

DC_TOKEN = "MTEwMA.fuzz-bot-token.Zq7Xk9"
DC_STRANGER = "77"


@dataclass
class DiscordRig:
    dc: FakeDiscord
    runner: GatewayRunner
    adapter: DiscordAdapter
    sentinels: int = 0

    def bases(self) -> list[dict[str, Any]]:
        """Valid MESSAGE_CREATEs from a stranger: a DM, a guild mention, a thread
        message, a reply to the bot."""
        dc = self.dc
        stranger = dc.users[DC_STRANGER]
        earlier = dc._message(dc.channel, dc.users[dc.bot_id], "earlier answer")
        return [
            dc._message(dc.dm_channel(DC_STRANGER), stranger, "hello there"),
            dc._message(dc.channel, stranger, f"<@{dc.bot_id}> hi", mentions=[dc.bot_id]),
            dc._message(dc.thread, stranger, f"<@{dc.bot_id}> in the thread", mentions=[dc.bot_id]),
            dc._message(dc.channel, stranger, "and you?", reference=earlier["id"]),
        ]

    async def settle(self) -> None:
        """Wait until the client has read every frame sent so far (a bot-authored sentinel
        message comes back as a `message` event) and every on_message handler finished."""
        client = self.adapter.client
        assert client is not None
        self.sentinels += 1
        content = f"sentinel-{self.sentinels}"
        seen = asyncio.ensure_future(
            client.wait_for("message", check=lambda m: m.content == content)
        )
        await asyncio.sleep(0)  # let wait_for register its listener
        try:
            sentinel = self.dc._message(self.dc.channel, self.dc.users[self.dc.bot_id], content)
            await self.dc.dispatch("MESSAGE_CREATE", sentinel)
            await eventually(
                lambda: seen.done() or self.adapter.state != "running",
                "the sentinel message",
            )
            if self.adapter.state != "running":
                # A frame too deep to decode ended the connection: the adapter must come
                # back by itself (the frames of the dead connection are gone with it).
                await eventually(
                    lambda: self.adapter.state == "running", "the reconnect", within=15
                )
                return
        finally:
            seen.cancel()

        def handlers_running() -> bool:
            return any(
                not t.done() and t.get_name() == "discord.py: on_message"
                for t in asyncio.all_tasks()
            )

        await eventually(lambda: not handlers_running(), "on_message handlers")

    async def ensure_running(self) -> None:
        """A previous example may have killed the connection (that example failed); start
        afresh so each example is judged on its own."""
        if self.adapter.state != "running":
            await self.adapter.stop()
            await self.adapter.start()

    def assert_healthy(self) -> None:
        assert self.adapter.health()["state"] == "running", self.adapter.health()
        assert self.dc.sent == [], self.dc.sent


async def start_discord(tmp_path: Path) -> DiscordRig:
    dc = FakeDiscord(token=DC_TOKEN)
    await dc.start()
    dc.add_user(DC_STRANGER, "Stranger")
    settings_ = {**LOCKED, "token": DC_TOKEN, "api_base_url": dc.api_base_url}
    runner, adapter = make_runner(
        {"discord": settings_},
        # A frame too deep to decode ends the connection (about one example in six): the
        # reconnect is what is judged, not the production backoff's first second.
        lambda config: DiscordAdapter(
            config.platforms.discord,
            guild_ready_timeout=0.05,
            ready_timeout=5.0,
            reconnect_delay=0.02,
        ),
        tmp_path / "home",
    )
    try:
        await runner.start()
    except BaseException:
        await runner.stop()
        await dc.stop()
        raise
    return DiscordRig(dc, runner, adapter)


def discord_payloads(bases: list[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        json_values.map(encode),
        st.sampled_from(bases).map(encode),
        mutated(bases).map(encode),
        mutated(bases).map(encode),
        mutated(bases).map(encode),
    )


async def stop_discord(rig: DiscordRig) -> None:
    await rig.runner.stop()
    await rig.dc.stop()


def test_discord_gateway_survives_fuzzed_message_creates_and_stores_nothing(
    tmp_path: Path,
) -> None:
    saved = Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY  # process-wide, set by start()
    try:
        with running(start_discord(tmp_path), stop_discord) as (loop, rig):

            async def send_one(data: bytes) -> None:
                await rig.ensure_running()
                before = await store_counts(rig.runner)
                await rig.dc.dispatch_raw("MESSAGE_CREATE", data)
                await rig.settle()
                assert await store_counts(rig.runner) == before
                # A payload discord.py cannot parse is skipped; a frame too deep to even
                # decode ends that connection, and the adapter must reconnect by itself.
                await eventually(
                    lambda: rig.adapter.state == "running", "the adapter back up", within=15
                )
                rig.assert_healthy()

            @given(discord_payloads(rig.bases()))
            @settings(max_examples=100, **FUZZ_SETTINGS)
            def fuzz(data: bytes) -> None:
                run_on(loop, send_one(data))

            fuzz()

            async def afterwards() -> None:
                await rig.ensure_running()
                await assert_store_empty(rig.runner)
                await rig.dc.dm(DC_STRANGER, "still there?")
                await rig.settle()
                await assert_store_empty(rig.runner)
                rig.assert_healthy()
                # Paired, the same DM is stored by the time settle() returns.
                await pair(rig.runner, "discord", DC_STRANGER)
                await rig.dc.dm(DC_STRANGER, "paired now")
                await rig.settle()
                assert (await store_counts(rig.runner))["inbox"] == 1
                await eventually(lambda: len(rig.dc.sent) == 1, "the echo reply")

            run_on(loop, afterwards())
    finally:
        Route.BASE, DiscordWebSocket.DEFAULT_GATEWAY = saved
