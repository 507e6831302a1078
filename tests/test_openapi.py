"""GET /openapi.json (adapters/http/openapi.py): generated from the route models, valid
OpenAPI 3.1, every served route in it (the A2A server's and the console's too, mounted
as `hermes-gateway run` mounts them), the bearer requirement on all but the public
routes and the console's (its cookie instead), and the models' rules in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from aiohttp import web
from pydantic import BaseModel

from adapters.http import HttpAdapter
from adapters.http import adapter as adapter_module
from adapters.http.openapi import build_spec
from adapters.http.schemas import API_ROUTES, ErrorBody, MessageIn
from gateway.console.auth import COOKIE
from gateway.console.route_docs import console_route_docs
from gateway.util.route_doc import RouteDoc
from tests.a2a_support import A2aGateway
from tests.test_http_adapter import TOKEN, FakeGateway, http_config

PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/openapi.json"),
    ("GET", "/.well-known/agent-card.json"),
    ("GET", "/a2a/{agent}/.well-known/agent-card.json"),
    ("GET", "/console"),
    ("GET", "/console/login"),
    ("POST", "/console/login"),
    ("GET", "/console/static/{name}"),
}


@pytest.fixture
async def a2a_gateway(tmp_path: Path) -> AsyncIterator[A2aGateway]:
    running = await A2aGateway.started(tmp_path, token=TOKEN, console=True)
    yield running
    await running.stop()


async def fetch_spec(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client, client.get(f"{url}/openapi.json") as resp:
        assert resp.status == 200  # no token: the description is public
        assert resp.headers["Content-Type"].startswith("application/json")
        return await resp.json()


def operations(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): operation
        for path, methods in spec["paths"].items()
        for method, operation in methods.items()
    }


async def test_every_served_route_is_described_and_valid_openapi_3_1(a2a_gateway):
    spec = await fetch_spec(a2a_gateway.url)
    assert spec["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(spec).validate()  # against the OpenAPI 3.1 meta-schema
    app = a2a_gateway.http._runner.app  # type: ignore[union-attr]
    served = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    assert set(operations(spec)) == served
    assert {
        ("POST", "/a2a/{agent}"),
        ("GET", "/v1/chats/{chat_id}/stream"),
        ("POST", "/console/pairing/{decision}"),
        ("GET", "/console/events"),
    } <= served


async def test_bearer_on_every_route_but_the_public_ones_and_the_consoles_cookie(a2a_gateway):
    spec = await fetch_spec(a2a_gateway.url)
    assert spec["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        COOKIE: {"type": "apiKey", "in": "cookie", "name": COOKIE},
    }
    for key, operation in operations(spec).items():
        if key in PUBLIC:
            assert operation["security"] == [], key
        elif key[1].startswith("/console/"):
            # the console checks its own login: a redirect to it, or 401/403 (events, POSTs)
            assert operation["security"] == [{COOKIE: []}], key
            assert {"303", "401", "403"} & set(operation["responses"]), key
        else:
            assert operation["security"] == [{"bearer": []}], key
            assert "401" in operation["responses"], key


async def test_the_models_rules_are_in_the_spec(a2a_gateway):
    spec = await fetch_spec(a2a_gateway.url)
    ops = operations(spec)
    poll = {p["name"]: p for p in ops["GET", "/v1/chats/{chat_id}/messages"]["parameters"]}
    assert poll["chat_id"]["in"] == "path" and poll["chat_id"]["required"]
    assert poll["limit"]["schema"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 500,
        "default": 500,
    }
    assert poll["wait"]["schema"]["maximum"] == 60
    assert poll["after"]["schema"]["maximum"] == 2**63 - 1
    search = {p["name"]: p for p in ops["GET", "/v1/search"]["parameters"]}
    assert search["q"]["required"] and not search["limit"]["required"]
    body = ops["POST", "/v1/messages"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/MessageIn"}
    message = spec["components"]["schemas"]["MessageIn"]
    assert message["required"] == ["chat_id", "user_id", "text"]
    assert message["additionalProperties"] is False
    assert set(message["properties"]) == set(MessageIn.model_fields)
    stream = ops["GET", "/v1/chats/{chat_id}/stream"]["responses"]["200"]["content"]
    assert list(stream) == ["text/event-stream"]
    metrics = ops["GET", "/metrics"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    a2a = ops["POST", "/a2a/{agent}"]["responses"]["200"]["content"]
    assert set(a2a) == {"application/json", "text/event-stream"}
    # the API's, /openapi.json, A2A's three, the OpenAI-compatible two, the console's
    assert len(ops) == len(API_ROUTES) + 1 + 3 + 2 + len(console_route_docs())


async def test_the_consoles_inputs_are_in_the_spec(a2a_gateway):
    spec = await fetch_spec(a2a_gateway.url)
    ops = operations(spec)
    body = ops["POST", "/console/notes/delete"]["requestBody"]["content"]
    assert list(body) == ["application/x-www-form-urlencoded"]
    form = spec["components"]["schemas"][
        body["application/x-www-form-urlencoded"]["schema"]["$ref"].rsplit("/", 1)[1]
    ]
    assert set(form["required"]) == {"user", "note_id"} and "csrf" in form["properties"]
    static = {p["name"]: p for p in ops["GET", "/console/static/{name}"]["parameters"]}
    assert static["name"]["schema"]["enum"] == ["console.css", "console.js"]
    action = {
        p["name"]: p for p in ops["POST", "/console/schedules/{schedule_id}/{action}"]["parameters"]
    }
    assert action["action"]["schema"]["enum"] == ["pause", "resume", "run", "remove"]
    assert action["schedule_id"]["schema"]["pattern"] == "^[A-Za-z0-9_-]{1,64}$"
    listing = {p["name"]: p for p in ops["GET", "/console/sessions"]["parameters"]}
    assert set(listing) == {"q", "agent", "platform", "user", "after"}
    assert listing["q"]["schema"] == {"type": "string", "maxLength": 200, "default": ""}
    transcript = {p["name"]: p for p in ops["GET", "/console/sessions/{session_id}"]["parameters"]}
    assert transcript["after"]["schema"]["type"] == "integer"
    assert list(ops["GET", "/console/"]["responses"]["200"]["content"]) == ["text/html"]
    assert "content" not in ops["GET", "/console/"]["responses"]["303"]


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/console/sessions", 303, None),  # well-formed: log in first
        ("/console/sessions/a%20b", 400, "not a session id"),
        ("/console/sessions/s1?after=1e3", 400, "after must be a whole number"),
        ("/console/sessions?q=x&q=y", 400, "given more than once"),
        ("/console/notes?user=nocolon", 400, "PLATFORM:USER_ID"),
        ("/console/static/secret.txt", 404, "no file"),
    ],
)
async def test_a_console_page_reads_its_input_before_asking_for_the_login(
    a2a_gateway, path: str, status: int, words: str | None
):
    async with (
        aiohttp.ClientSession() as client,
        client.get(f"{a2a_gateway.url}{path}", allow_redirects=False) as resp,
    ):
        assert resp.status == status, await resp.text()
        if words is None:
            assert resp.headers["Location"] == "/console/login"
        else:
            assert words in (await resp.json())["error"]


class Said(BaseModel):
    said: str


async def test_a_mounted_route_contributes_its_description_and_the_spec_is_built_once(
    monkeypatch: pytest.MonkeyPatch,
):
    builds: list[int] = []

    def counting_build(*args: Any, **kwargs: Any) -> dict[str, Any]:
        builds.append(1)
        return build_spec(*args, **kwargs)

    monkeypatch.setattr(adapter_module, "build_spec", counting_build)

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"said": "hi"})

    adapter = HttpAdapter(http_config(token=TOKEN))
    adapter.bind(FakeGateway())
    doc = RouteDoc("GET", "/echo/{word}", "Say it back", {200: Said, 401: ErrorBody})
    adapter.mount([web.get("/echo/{word}", echo)], docs=[doc])
    await adapter.start()
    try:
        first = await fetch_spec(adapter.url)
        assert await fetch_spec(adapter.url) == first
    finally:
        await adapter.stop()
    operation = operations(first)["GET", "/echo/{word}"]
    assert operation["summary"] == "Say it back"
    assert operation["security"] == [{"bearer": []}]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Said"
    }
    assert first["components"]["schemas"]["Said"]["required"] == ["said"]
    assert builds == [1]


@pytest.mark.parametrize(
    "path", ["/v1/chats/c1/messages", "/v1/sessions", "/v1/search?q=x", "/v1/sessions/s1"]
)
async def test_a_query_parameter_the_spec_does_not_name_is_400_naming_it(path: str):
    adapter = HttpAdapter(http_config())
    gateway = FakeGateway()
    adapter.bind(gateway)
    await adapter.start()
    try:
        separator = "&" if "?" in path else "?"
        async with (
            aiohttp.ClientSession() as client,
            client.get(f"{adapter.url}{path}{separator}limt=5") as resp,
        ):
            assert resp.status == 400
            error = (await resp.json())["error"]
    finally:
        await adapter.stop()
    assert error.startswith("unknown query parameter(s) 'limt'; allowed: "), error
    assert "limit" in error
    assert gateway.reads == [] and gateway.listings == []
