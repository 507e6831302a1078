"""The HTTP API adapter against a fake gateway: validation, limits, auth, the reply outbox."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from adapters.base import Accepted, AcceptStatus, MessageEvent, SendResult
from adapters.http import HttpAdapter
from config import HttpConfig
from gateway.session import Platform, SessionSource

TOKEN = "s3cret-token"


class FakeGateway:
    """Records every event and answers with `accepted`, as `GatewayRunner` would."""

    def __init__(self) -> None:
        self.events: list[MessageEvent] = []
        self.accepted = Accepted(AcceptStatus.STARTED, session_key="agent:main:http:dm:c1")

    async def handle_message(self, event: MessageEvent) -> Accepted:
        self.events.append(event)
        return self.accepted

    async def list_sessions(self) -> list[dict[str, Any]]:
        return [{"session_key": "agent:main:http:dm:c1", "session_id": "s1"}]

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "accepting": True}

    def metrics_text(self) -> str:
        return "# TYPE hermes_messages_received_total counter\nhermes_messages_received_total 3\n"


def http_config(**settings: Any) -> HttpConfig:
    # The schema rejects port 0 (a config file must name a port); tests want a free one.
    return HttpConfig(**settings).model_copy(update={"port": 0})


AdapterFactory = Callable[..., Awaitable[tuple[HttpAdapter, FakeGateway]]]


@pytest.fixture
async def make_adapter() -> AsyncIterator[AdapterFactory]:
    started: list[HttpAdapter] = []

    async def make(**settings: Any) -> tuple[HttpAdapter, FakeGateway]:
        adapter = HttpAdapter(http_config(**settings))
        gateway = FakeGateway()
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
        (json.dumps(message(chat_type="supergroup")).encode(), "chat_type"),
        (json.dumps(message(colour="red")).encode(), "colour"),
        (json.dumps(message(chat_id="../etc")).encode(), "chat_id"),
        (json.dumps(message(chat_id="a/b")).encode(), "chat_id"),
        (json.dumps(message(user_id="u\n1")).encode(), "user_id"),
        (json.dumps(message(thread_id=7)).encode(), "thread_id"),
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
    adapter, _ = api
    async with client.get(f"{adapter.url}/v1/sessions") as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "sessions": [{"session_key": "agent:main:http:dm:c1", "session_id": "s1"}]
        }


async def test_metrics_are_prometheus_text(api, client):
    adapter, _ = api
    async with client.get(f"{adapter.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert "hermes_messages_received_total 3" in await resp.text()


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
    assert adapter.health() == {"state": "running", "listen": adapter.url}
    await adapter.stop()
    assert adapter.health()["state"] == "stopped"


# --- replies: the outbox and long polling --------------------------------------------------


async def test_send_numbers_replies_and_keeps_thread_and_reply_to(api, client):
    adapter, _ = api
    assert await adapter.send(source(thread_id="t1"), "one", reply_to="m9") == SendResult("1")
    assert await adapter.send(source(), "two") == SendResult("2")
    assert await get_replies(client, adapter) == {
        "messages": [
            {"seq": 1, "text": "one", "thread_id": "t1", "in_reply_to": "m9"},
            {"seq": 2, "text": "two", "thread_id": None, "in_reply_to": None},
        ],
        "next": 2,
    }


async def test_after_returns_only_newer_replies_and_next_stays_put_when_none(api, client):
    adapter, _ = api
    for text in ("a", "b", "c"):
        await adapter.send(source(), text)
    data = await get_replies(client, adapter, after=1)
    assert [m["text"] for m in data["messages"]] == ["b", "c"]
    assert data["next"] == 3
    assert await get_replies(client, adapter, after=3) == {"messages": [], "next": 3}


async def test_replies_to_other_chats_are_not_returned(api, client):
    adapter, _ = api
    await adapter.send(source("c2"), "for c2")
    await adapter.send(source("c1"), "for c1")
    assert [m["text"] for m in (await get_replies(client, adapter))["messages"]] == ["for c1"]


async def test_wait_zero_returns_at_once_with_nothing(api, client):
    adapter, _ = api
    started = time.monotonic()
    assert await get_replies(client, adapter, after=0, wait=0) == {"messages": [], "next": 0}
    assert time.monotonic() - started < 0.5


async def test_long_poll_returns_as_soon_as_a_reply_is_sent(api, client):
    adapter, _ = api

    async def reply_later() -> None:
        await asyncio.sleep(0.2)
        await adapter.send(source("c2"), "not for c1")  # must not end c1's poll empty
        await adapter.send(source(), "here you are")

    started = time.monotonic()
    sender = asyncio.create_task(reply_later())
    data = await get_replies(client, adapter, after=0, wait=5)
    await sender
    assert time.monotonic() - started < 2
    assert [m["text"] for m in data["messages"]] == ["here you are"]
    assert data["next"] == 2


async def test_long_poll_times_out_empty(api, client):
    adapter, _ = api
    started = time.monotonic()
    assert await get_replies(client, adapter, wait=0.3) == {"messages": [], "next": 0}
    assert 0.25 < time.monotonic() - started < 2


async def test_stop_wakes_a_pending_long_poll(api, client):
    adapter, _ = api
    poll = asyncio.create_task(get_replies(client, adapter, wait=30))
    await asyncio.sleep(0.2)
    started = time.monotonic()
    await adapter.stop()
    assert await asyncio.wait_for(poll, 2) == {"messages": [], "next": 0}
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "params", [{"wait": "soon"}, {"wait": "-1"}, {"wait": "nan"}, {"after": "x"}, {"after": "-3"}]
)
async def test_bad_poll_parameters_are_400(api, client, params):
    adapter, _ = api
    async with client.get(f"{adapter.url}/v1/chats/c1/messages", params=params) as resp:
        assert resp.status == 400
        assert next(iter(params)) in (await resp.json())["error"]


async def test_a_cursor_from_before_a_restart_reads_from_the_start(api, client):
    adapter, _ = api  # a fresh adapter numbers from 1 again
    await adapter.send(source(), "after the restart")
    data = await get_replies(client, adapter, after=500)
    assert [m["text"] for m in data["messages"]] == ["after the restart"]
    assert data["next"] == 1


async def test_outbox_keeps_the_last_replies_of_each_chat(api, client):
    adapter, _ = api
    for n in range(adapter.max_replies_per_chat + 5):
        await adapter.send(source(), f"reply {n}")
    messages = (await get_replies(client, adapter))["messages"]
    assert len(messages) == adapter.max_replies_per_chat == 1000
    assert messages[0]["seq"] == 6


async def test_outbox_drops_the_least_recently_used_chat(api, client):
    adapter, _ = api
    adapter.max_chats = 3
    for chat_id in ("c1", "c2", "c3"):
        await adapter.send(source(chat_id), f"for {chat_id}")
    await get_replies(client, adapter, "c1")  # reading is a use: c2 is now the oldest
    await adapter.send(source("c4"), "for c4")
    for chat_id, expected in (("c1", 1), ("c2", 0), ("c3", 1), ("c4", 1)):
        assert len((await get_replies(client, adapter, chat_id))["messages"]) == expected
