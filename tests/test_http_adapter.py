"""The HTTP API adapter against a fake gateway: validation, limits, auth, reading replies
from the gateway's delivery ledger and long polling."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import yarl

from adapters.base import Accepted, AcceptStatus, MessageEvent, SendResult
from adapters.http import MAX_REPLIES_PER_POLL, HttpAdapter
from config import HttpConfig
from gateway.session import Platform, SessionSource
from tests.fakes.ledger import FakeLedger
from tests.waiting import wait_for

TOKEN = "s3cret-token"


class FakeGateway:
    """Records every event and answers with `accepted`, as `GatewayRunner` would, and keeps
    a delivery ledger that `replies_after` reads like the real one."""

    def __init__(self) -> None:
        self.events: list[MessageEvent] = []
        self.accepted = Accepted(AcceptStatus.STARTED, session_key="agent:main:http:dm:c1")
        self.ledger = FakeLedger()
        self.reads: list[tuple[str, str, int, int]] = []  # replies_after's arguments
        # When set, the next read takes its snapshot, sets `reading` and then waits for
        # this event before answering: a test can record a reply while a read is in flight.
        self.read_gate: asyncio.Event | None = None
        self.reading = asyncio.Event()
        self.busy = 0  # what busy_sessions() answers
        self.sessions = [  # what list_sessions_page pages through, in key order
            {"session_key": "agent:main:http:dm:c1", "session_id": "s1", "agent": "main"}
        ]
        self.listings: list[tuple[str | None, str | None, int]] = []  # its arguments

    async def handle_message(self, event: MessageEvent) -> Accepted:
        self.events.append(event)
        return self.accepted

    async def list_sessions_page(
        self, agent: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[dict[str, Any]], str | None]:
        self.listings.append((agent, after, limit))
        listed = [
            s
            for s in self.sessions
            if (agent is None or s["agent"] == agent)
            and (after is None or s["session_key"] > after)
        ]
        page = listed[:limit]
        return page, page[-1]["session_key"] if len(listed) > limit else None

    async def replies_after(
        self, platform: str, chat_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        self.reads.append((platform, chat_id, after, limit))
        rows = self.ledger.after(platform, chat_id, after, limit)
        gate, self.read_gate = self.read_gate, None
        if gate is not None:
            self.reading.set()
            await gate.wait()
        return rows

    async def reply(
        self, adapter: HttpAdapter, target: SessionSource, text: str, reply_to: str | None = None
    ) -> int:
        """Record a reply in the ledger, then deliver it, as the runner does."""
        seq = self.ledger.record(target, text, reply_to)
        assert await adapter.send(target, text, reply_to, delivery_id=seq) == SendResult(str(seq))
        return seq

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "accepting": True}

    def busy_sessions(self) -> int:
        return self.busy

    def metrics_text(self) -> str:
        return "# TYPE hermes_messages_received_total counter\nhermes_messages_received_total 3\n"


def http_config(**settings: Any) -> HttpConfig:
    # The schema rejects port 0 (a config file must name a port); tests want a free one.
    return HttpConfig(**settings).model_copy(update={"port": 0})


AdapterFactory = Callable[..., Awaitable[tuple[HttpAdapter, FakeGateway]]]


@pytest.fixture
async def make_adapter() -> AsyncIterator[AdapterFactory]:
    started: list[HttpAdapter] = []

    async def make(
        gateway: FakeGateway | None = None, **settings: Any
    ) -> tuple[HttpAdapter, FakeGateway]:
        adapter = HttpAdapter(http_config(**settings))
        gateway = gateway or FakeGateway()
        adapter.bind(gateway)
        await adapter.start()
        started.append(adapter)
        return adapter, gateway

    yield make
    for adapter in started:
        await adapter.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def api(make_adapter: AdapterFactory) -> tuple[HttpAdapter, FakeGateway]:
    return await make_adapter()


def message(**overrides: Any) -> dict[str, Any]:
    return {"chat_id": "c1", "user_id": "u1", "text": "hello", **overrides}


def source(chat_id: str = "c1", thread_id: str | None = None) -> SessionSource:
    return SessionSource(Platform.HTTP, chat_id, user_id="u1", thread_id=thread_id)


async def get_replies(
    client: aiohttp.ClientSession, adapter: HttpAdapter, chat_id: str = "c1", **params: Any
) -> dict[str, Any]:
    url = f"{adapter.url}/v1/chats/{chat_id}/messages"
    async with client.get(url, params=params) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


# --- POST /v1/messages ---------------------------------------------------------------------


async def test_post_hands_the_gateway_the_event_as_built(api, client):
    adapter, gateway = api
    body = message(chat_type="group", thread_id="t7", message_id=42, user_name="Ann")
    async with client.post(f"{adapter.url}/v1/messages", json=body) as resp:
        assert resp.status == 202
        assert await resp.json() == {"session_key": "agent:main:http:dm:c1", "status": "started"}
    [event] = gateway.events
    assert event.text == "hello"
    assert event.message_id == "42"
    assert event.source == SessionSource(
        platform=Platform.HTTP,
        chat_id="c1",
        chat_type="group",
        user_id="u1",
        user_name="Ann",
        thread_id="t7",
        message_id="42",
    )


async def test_numeric_ids_in_the_body_are_taken_as_their_digits(api, client):
    adapter, gateway = api
    body = message(chat_id=-1001234567890, user_id=42, thread_id=7, message_id=2**70)
    async with client.post(f"{adapter.url}/v1/messages", json=body) as resp:
        assert resp.status == 202, await resp.text()
    [event] = gateway.events
    assert event.message_id == str(2**70)
    source = event.source
    assert (source.chat_id, source.user_id, source.thread_id, source.message_id) == (
        "-1001234567890",
        "42",
        "7",
        str(2**70),
    )


async def test_post_defaults_to_a_dm_without_optional_fields(api, client):
    adapter, gateway = api
    async with client.post(f"{adapter.url}/v1/messages", json=message()) as resp:
        assert resp.status == 202
    [event] = gateway.events
    assert event.source.chat_type == "dm"
    assert event.source.thread_id is None
    assert event.message_id is None


async def test_post_passes_on_the_gateways_status_and_detail(api, client):
    adapter, gateway = api
    gateway.accepted = Accepted(AcceptStatus.REFUSED, "agent:main:http:dm:c1", "queue is full")
    async with client.post(f"{adapter.url}/v1/messages", json=message()) as resp:
        assert resp.status == 202
        assert await resp.json() == {
            "session_key": "agent:main:http:dm:c1",
            "status": "refused",
            "detail": "queue is full",
        }


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b"this is not json", "not valid JSON"),
        (b'{"chat_id": "c1",', "not valid JSON"),
        (b"\xff\xfe{}", "UTF-8"),
        (json.dumps([message()]).encode(), "JSON object"),
        (json.dumps({"chat_id": "c1", "user_id": "u1"}).encode(), "text"),
        (json.dumps(message(text=5)).encode(), "text"),
        (json.dumps(message(chat_id="")).encode(), "chat_id"),
        (json.dumps(message(user_id="")).encode(), "user_id"),
        (json.dumps(message(chat_id=" \t")).encode(), "chat_id must not be empty or blank"),
        (json.dumps(message(user_id=" ")).encode(), "user_id must not be empty or blank"),
        (json.dumps(message(chat_type="supergroup")).encode(), "chat_type"),
        (json.dumps(message(colour="red")).encode(), "colour"),
        (json.dumps(message(chat_id="../etc")).encode(), "chat_id"),
        (json.dumps(message(chat_id="a/b")).encode(), "chat_id"),
        (json.dumps(message(user_id="u\n1")).encode(), "user_id"),
        (json.dumps(message(thread_id=7.5)).encode(), "thread_id must be a string or a whole"),
        (json.dumps(message(chat_id=1.0)).encode(), "chat_id must be a string or a whole"),
        (json.dumps(message(user_id=False)).encode(), "user_id must be a string or a whole"),
        (json.dumps(message(chat_id=None)).encode(), "chat_id must be a string, got null"),
        (json.dumps(message(thread_id=["t"])).encode(), "thread_id"),
        (json.dumps(message(message_id=True)).encode(), "message_id"),
        (json.dumps(message(user_name=["Ann"])).encode(), "user_name"),
        (b'{"chat_id": "c1", "user_id": "u1", "text": "\\ud800"}', "text"),
    ],
)
async def test_invalid_post_is_400_naming_the_problem_and_never_reaches_the_gateway(
    api, client, body, names
):
    adapter, gateway = api
    headers = {"Content-Type": "application/json"}
    async with client.post(f"{adapter.url}/v1/messages", data=body, headers=headers) as resp:
        assert resp.status == 400
        assert names in (await resp.json())["error"]
    assert gateway.events == []


async def test_a_busy_gateway_gets_no_post_until_it_has_room(make_adapter, client):
    adapter, gateway = await make_adapter(max_busy_sessions=3)
    url = f"{adapter.url}/v1/messages"
    gateway.busy = 3
    for _ in range(2):
        async with client.post(url, json=message()) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            error = (await resp.json())["error"]
            assert "busy (3 sessions" in error and "nothing was accepted" in error
    # What would start a turn waits too; what stops, inspects or switches a session does
    # not: /stop is how a user frees what they hold.
    for text in ("/queue later", "/q later", "/retry", "/RETRY@bot", "/unknown words"):
        async with client.post(url, json=message(text=text)) as resp:
            assert resp.status == 503, text
    assert gateway.events == []
    for text in ("/stop", " /new", "/status", "/help", "/undo 2", "/resume"):
        async with client.post(url, json=message(text=text)) as resp:
            assert resp.status == 202, text
    assert [event.text for event in gateway.events] == [
        "/stop",
        " /new",
        "/status",
        "/help",
        "/undo 2",
        "/resume",
    ]
    gateway.events.clear()
    assert adapter.health()["shed_total"] == 7
    # Bad input is still a 400: retrying it later would not help.
    async with client.post(url, data=b"{not json") as resp:
        assert resp.status == 400
    gateway.busy = 2
    async with client.post(url, json=message(text="now")) as resp:
        assert resp.status == 202
    assert [event.text for event in gateway.events] == ["now"]
    assert adapter.health()["shed_total"] == 7


def body_of_size(size: int) -> bytes:
    body = json.dumps(message(text="")).encode()
    return json.dumps(message(text="x" * (size - len(body)))).encode()


async def test_body_at_the_limit_is_accepted_and_one_byte_more_is_413(make_adapter, client):
    adapter, gateway = await make_adapter(max_body_bytes=1024)
    url = f"{adapter.url}/v1/messages"
    async with client.post(url, data=body_of_size(1024)) as resp:
        assert resp.status == 202
    async with client.post(url, data=body_of_size(1025)) as resp:
        assert resp.status == 413
        assert "1024 bytes" in (await resp.json())["error"]
    assert len(gateway.events) == 1


async def test_chunked_body_over_the_limit_is_413(make_adapter, client):
    adapter, gateway = await make_adapter(max_body_bytes=1024)
    body = body_of_size(1025)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: sent chunked
        for start in range(0, len(body), 100):
            yield body[start : start + 100]

    async with client.post(f"{adapter.url}/v1/messages", data=chunks()) as resp:
        assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
        assert resp.status == 413
    assert gateway.events == []


# --- auth ----------------------------------------------------------------------------------

PROTECTED = [
    ("POST", "/v1/messages"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/chats/c1/messages"),
    ("GET", "/metrics"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer"])
async def test_protected_routes_refuse_a_missing_or_wrong_token(
    make_adapter, client, method, path, authorization
):
    adapter, gateway = await make_adapter(token=TOKEN)
    headers = {"Authorization": authorization} if authorization else {}
    async with client.request(method, adapter.url + path, json=message(), headers=headers) as resp:
        assert resp.status == 401
        text = await resp.text()
    assert json.loads(text) == {"error": "missing or wrong bearer token"}
    assert TOKEN not in text
    assert gateway.events == []


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_protected_routes_accept_the_right_token(make_adapter, client, method, path):
    adapter, _ = await make_adapter(token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with client.request(method, adapter.url + path, json=message(), headers=headers) as r:
        assert r.status in (200, 202)


async def test_healthz_needs_no_token(make_adapter, client):
    adapter, _ = await make_adapter(token=TOKEN)
    async with client.get(f"{adapter.url}/healthz") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ok", "accepting": True}


async def test_a_non_ascii_authorization_header_is_a_401_not_a_crash(make_adapter, client):
    adapter, _ = await make_adapter(token=TOKEN)
    headers = {"Authorization": "Bearer s3crét".encode().decode("latin-1")}
    async with client.get(f"{adapter.url}/v1/sessions", headers=headers) as resp:
        assert resp.status == 401


# --- other routes --------------------------------------------------------------------------


async def test_sessions_lists_the_gateways_sessions(api, client):
    adapter, gateway = api
    async with client.get(f"{adapter.url}/v1/sessions") as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "sessions": [
                {"session_key": "agent:main:http:dm:c1", "session_id": "s1", "agent": "main"}
            ],
            "next": None,
        }
    # ?agent= is handed to the gateway, which filters by it.
    async with client.get(f"{adapter.url}/v1/sessions", params={"agent": "coder"}) as resp:
        assert resp.status == 200 and await resp.json() == {"sessions": [], "next": None}
    assert gateway.listings == [(None, None, 100), ("coder", None, 100)]  # 100 by default


async def test_sessions_page_with_an_opaque_cursor(api, client):
    adapter, gateway = api
    gateway.sessions = [
        {"session_key": f"agent:main:http:dm:c{n:02}", "session_id": f"s{n}", "agent": "main"}
        for n in range(7)
    ]
    seen: list[str] = []
    params: dict[str, str] = {"limit": "3"}
    cursors: list[str] = []
    while True:
        async with client.get(f"{adapter.url}/v1/sessions", params=params) as resp:
            assert resp.status == 200
            body = await resp.json()
        seen += [s["session_key"] for s in body["sessions"]]
        if body["next"] is None:
            break
        assert "agent:" not in body["next"]  # opaque: not the key itself
        cursors.append(body["next"])
        params["after"] = body["next"]
    assert seen == [s["session_key"] for s in gateway.sessions]
    assert len(cursors) == 2
    # The gateway is asked for the page after the key the cursor stands for.
    assert [after for _, after, _ in gateway.listings] == [
        None,
        "agent:main:http:dm:c02",
        "agent:main:http:dm:c05",
    ]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"limit": "0"}, "limit must be between 1 and 1000"),
        ({"limit": "1001"}, "limit must be between 1 and 1000"),
        ({"limit": "-1"}, "limit must be a whole number"),
        ({"after": "agent:main:http:dm:c1"}, "after must be a `next` cursor"),
        ({"after": "k1.!!"}, "after must be a `next` cursor"),
        ({"after": "k1.YQ=="}, "after must be a `next` cursor"),  # padded: not ours
        ({"after": "k1.//8"}, "after must be a `next` cursor"),
        ({"after": "k1.YR"}, "after must be a `next` cursor"),  # "a" spelled another way
        ({"after": "k1." + "QUFB" * 2000}, "after must be a `next` cursor"),
        ({"after": ""}, "after must be a `next` cursor"),
    ],
)
async def test_bad_listing_parameters_are_400_naming_the_parameter(api, client, params, named):
    adapter, gateway = api
    async with client.get(f"{adapter.url}/v1/sessions", params=params) as resp:
        assert resp.status == 400
        assert named in (await resp.json())["error"]
    assert gateway.listings == []


async def test_a_listing_of_the_largest_page_is_asked_for_as_such(api, client):
    adapter, gateway = api
    async with client.get(f"{adapter.url}/v1/sessions", params={"limit": "1000"}) as resp:
        assert resp.status == 200
    assert gateway.listings == [(None, None, 1000)]


async def test_metrics_are_prometheus_text(api, client):
    adapter, _ = api
    async with client.get(f"{adapter.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    assert "hermes_messages_received_total 3" in text  # the gateway's, then the adapter's
    assert "\nhermes_http_shed_total 0.0\n" in text


async def test_unknown_route_is_404_json_and_wrong_method_405(api, client):
    adapter, _ = api
    async with client.get(f"{adapter.url}/v2/nothing") as resp:
        assert resp.status == 404
        assert "error" in await resp.json()
    async with client.delete(f"{adapter.url}/v1/messages") as resp:
        assert resp.status == 405


async def test_port_url_and_health_follow_the_lifecycle(make_adapter):
    adapter, _ = await make_adapter()
    assert adapter.port > 0
    assert adapter.url == f"http://127.0.0.1:{adapter.port}"
    assert adapter.health() == {"state": "running", "listen": adapter.url, "shed_total": 0}
    await adapter.stop()
    assert adapter.health()["state"] == "stopped"


# --- replies: the delivery ledger and long polling ----------------------------------------


async def test_replies_come_from_the_ledger_with_thread_and_reply_to(api, client):
    adapter, gateway = api
    assert await gateway.reply(adapter, source(thread_id="t1"), "one", reply_to="m9") == 1
    assert await gateway.reply(adapter, source(), "two") == 2
    assert await get_replies(client, adapter) == {
        "messages": [
            {"seq": 1, "text": "one", "thread_id": "t1", "in_reply_to": "m9"},
            {"seq": 2, "text": "two", "thread_id": None, "in_reply_to": None},
        ],
        "next": 2,
    }
    assert gateway.reads[-1][:3] == ("http", "c1", 0)


async def test_send_acknowledges_with_the_delivery_id_and_stores_nothing_itself(api, client):
    adapter, _ = api
    assert await adapter.send(source(), "not in the ledger", delivery_id=41) == SendResult("41")
    assert await adapter.send(source(), "no id") == SendResult(None)
    # The ledger is the outbox: a chunk never recorded there is never served.
    assert await get_replies(client, adapter) == {"messages": [], "next": 0}


async def test_after_returns_only_newer_replies_and_next_stays_put_when_none(api, client):
    adapter, gateway = api
    for text in ("a", "b", "c"):
        await gateway.reply(adapter, source(), text)
    data = await get_replies(client, adapter, after=1)
    assert [m["text"] for m in data["messages"]] == ["b", "c"]
    assert data["next"] == 3
    assert await get_replies(client, adapter, after=3) == {"messages": [], "next": 3}


async def test_replies_to_other_chats_are_not_returned(api, client):
    adapter, gateway = api
    await gateway.reply(adapter, source("c2"), "for c2")
    await gateway.reply(adapter, source("c1"), "for c1")
    data = await get_replies(client, adapter)
    assert [m["text"] for m in data["messages"]] == ["for c1"]
    assert data["next"] == 2  # ledger ids are global, so a chat's seqs can skip


async def test_a_poll_asks_the_ledger_for_a_bounded_page(api, client):
    adapter, gateway = api
    assert 0 < MAX_REPLIES_PER_POLL <= 1000
    for n in range(MAX_REPLIES_PER_POLL + 3):
        await gateway.reply(adapter, source(), f"reply {n}")
    first = await get_replies(client, adapter, after=0)
    assert gateway.reads[-1] == ("http", "c1", 0, MAX_REPLIES_PER_POLL)
    assert len(first["messages"]) == MAX_REPLIES_PER_POLL
    assert first["next"] == MAX_REPLIES_PER_POLL
    rest = await get_replies(client, adapter, after=first["next"])
    assert gateway.reads[-1] == ("http", "c1", MAX_REPLIES_PER_POLL, MAX_REPLIES_PER_POLL)
    assert [m["seq"] for m in rest["messages"]] == [MAX_REPLIES_PER_POLL + n for n in (1, 2, 3)]


async def test_replies_and_cursors_survive_an_adapter_restart(make_adapter, client):
    adapter, gateway = await make_adapter()
    await gateway.reply(adapter, source(), "before", reply_to="m1")
    await gateway.reply(adapter, source(thread_id="t2"), "also before")
    await adapter.stop()

    restarted, _ = await make_adapter(gateway=gateway)
    assert await get_replies(client, restarted, after=0) == {
        "messages": [
            {"seq": 1, "text": "before", "thread_id": None, "in_reply_to": "m1"},
            {"seq": 2, "text": "also before", "thread_id": "t2", "in_reply_to": None},
        ],
        "next": 2,
    }
    # A client's cursor from before the restart still means "after reply 2".
    await gateway.reply(restarted, source(), "after")
    assert await get_replies(client, restarted, after=2) == {
        "messages": [{"seq": 3, "text": "after", "thread_id": None, "in_reply_to": None}],
        "next": 3,
    }


async def test_wait_zero_returns_at_once_with_nothing(api, client):
    adapter, _ = api
    started = time.monotonic()
    assert await get_replies(client, adapter, after=0, wait=0) == {"messages": [], "next": 0}
    assert time.monotonic() - started < 0.5


async def test_long_poll_returns_as_soon_as_a_reply_is_recorded_and_sent(api, client):
    adapter, gateway = api

    async def reply_later() -> None:
        await wait_for(lambda: "c1" in adapter._waiters)  # the poll waits
        await gateway.reply(adapter, source("c2"), "not for c1")  # must not end c1's poll
        await gateway.reply(adapter, source(), "here you are")

    started = time.monotonic()
    sender = asyncio.create_task(reply_later())
    data = await get_replies(client, adapter, after=0, wait=5)
    await sender
    assert time.monotonic() - started < 2
    assert [m["text"] for m in data["messages"]] == ["here you are"]
    assert data["next"] == 2


async def test_a_reply_recorded_during_the_ledger_read_still_wakes_the_poll(api, client):
    adapter, gateway = api
    gate = gateway.read_gate = asyncio.Event()
    started = time.monotonic()
    poll = asyncio.create_task(get_replies(client, adapter, after=0, wait=10))
    await asyncio.wait_for(gateway.reading.wait(), 2)  # the read has its (empty) snapshot
    await gateway.reply(adapter, source(), "raced the read")
    gate.set()  # the read now answers "nothing yet"
    data = await asyncio.wait_for(poll, 2)
    assert time.monotonic() - started < 2
    assert [m["text"] for m in data["messages"]] == ["raced the read"]
    assert data["next"] == 1


async def test_long_poll_times_out_empty(api, client):
    adapter, _ = api
    started = time.monotonic()
    assert await get_replies(client, adapter, wait=0.3) == {"messages": [], "next": 0}
    assert 0.25 < time.monotonic() - started < 2


async def test_stop_wakes_a_pending_long_poll(api, client):
    adapter, _ = api
    poll = asyncio.create_task(get_replies(client, adapter, wait=30))
    await wait_for(lambda: "c1" in adapter._waiters)  # the poll waits
    started = time.monotonic()
    await adapter.stop()
    assert await asyncio.wait_for(poll, 2) == {"messages": [], "next": 0}
    assert time.monotonic() - started < 2


# Every spelling int() or float() would take but that is not plain ASCII digits, and
# every value out of range. 2**63 must not reach SQLite (it would come back as a 500).
MALFORMED = [
    "",
    " 1",
    "1 ",
    "+1",
    "-1",
    "-0",
    "1e3",
    "0x10",
    "0o7",
    "1_000",
    "١٢",
    "\uff13",
    "nan",
    "inf",
]
BAD_POLL_PARAMETERS = [
    *[[("after", raw)] for raw in [*MALFORMED, "1.5", "x", str(2**63), "9" * 5000]],
    *[[("limit", raw)] for raw in [*MALFORMED, "1.5", "0", "501", "9" * 5000]],
    *[[("wait", raw)] for raw in [*MALFORMED, "soon", "1.", ".5", "1,5", "60.01", "61", "1e400"]],
    [("after", "1"), ("after", "2")],
    [("wait", "0"), ("wait", "0")],
]


def _param_id(params: list[tuple[str, str]]) -> str:
    return "&".join(f"{name}={raw[:12]!r}" for name, raw in params)


@pytest.mark.parametrize("params", BAD_POLL_PARAMETERS, ids=_param_id)
async def test_bad_poll_parameters_are_400_naming_the_parameter(api, client, params):
    adapter, gateway = api
    async with client.get(f"{adapter.url}/v1/chats/c1/messages", params=params) as resp:
        assert resp.status == 400
        assert f"query parameter {params[0][0]} " in (await resp.json())["error"]
    assert gateway.reads == []


@pytest.mark.parametrize(
    ("params", "read"),
    [
        ({}, (0, MAX_REPLIES_PER_POLL)),
        ({"after": "007", "limit": "1"}, (7, 1)),
        ({"after": str(2**63 - 1), "limit": str(MAX_REPLIES_PER_POLL)}, (2**63 - 1, 500)),
        ({"after": "0" * 100 + "5", "wait": "0.05"}, (5, MAX_REPLIES_PER_POLL)),
    ],
)
async def test_poll_parameters_in_range_reach_the_ledger(api, client, params, read):
    adapter, gateway = api
    assert await get_replies(client, adapter, **params) == {"messages": [], "next": read[0]}
    assert gateway.reads[-1] == ("http", "c1", *read)


async def test_limit_bounds_the_page(api, client):
    adapter, gateway = api
    for n in range(3):
        await gateway.reply(adapter, source(), f"reply {n}")
    first = await get_replies(client, adapter, limit=2)
    assert [m["text"] for m in first["messages"]] == ["reply 0", "reply 1"]
    rest = await get_replies(client, adapter, after=first["next"], limit=2)
    assert [m["text"] for m in rest["messages"]] == ["reply 2"]


@pytest.mark.parametrize("chat_id", ["%20", "%09", "a%2Fb", ".."])
async def test_a_bad_chat_id_in_the_poll_path_is_400(api, client, chat_id):
    adapter, gateway = api
    url = yarl.URL(f"{adapter.url}/v1/chats/{chat_id}/messages", encoded=True)
    async with client.get(url) as resp:
        assert resp.status == 400
        assert "chat_id" in (await resp.json())["error"]
    assert gateway.reads == []
