"""The operator's web console against a live daemon (`hermes-gateway run` in a
subprocess): the login and its cookie, CSRF refusals that change nothing, each page,
the `q` filter, delete and export; the loopback rule and pairing and notes in process."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.commandline import cli
from tests.console_support import SEEDED, TOKEN, Daemon, start_daemon, stop_daemon

PAGES = ("/console/", "/console/sessions", "/console/search?q=zebra", "/console/schedules",
         "/console/notes?user=http:alice", "/console/pairing")  # fmt: skip


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    procs: list[subprocess.Popen[str]] = []
    running = start_daemon(tmp_path_factory.mktemp("console") / "home", procs)
    try:
        yield running
        out = stop_daemon(running)
        assert TOKEN not in out  # the token never reaches the log
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@dataclass
class Browser:
    """An HTTP client holding the console cookie by hand (no redirects followed)."""

    url: str
    http: aiohttp.ClientSession
    cookie: str | None = None

    async def get(self, path: str, **headers: str) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.get(
            self.url + path, headers=self._headers(headers), allow_redirects=False
        ) as r:
            return r.status, await r.text(), r

    async def post(
        self, path: str, form: dict[str, str], **headers: str
    ) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.post(
            self.url + path, data=form, headers=self._headers(headers), allow_redirects=False
        ) as r:
            return r.status, await r.text(), r

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        return {**({"Cookie": f"hermes-console={self.cookie}"} if self.cookie else {}), **extra}

    async def login(self) -> None:
        status, _, response = await self.post("/console/login", {"token": TOKEN})
        assert status == 303, status
        self.cookie = response.cookies["hermes-console"].value

    async def csrf(self) -> str:
        _, page, _ = await self.get("/console/sessions")
        return re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)  # type: ignore[union-attr]


@pytest.fixture
async def browser(daemon: Daemon) -> AsyncIterator[Browser]:
    async with aiohttp.ClientSession() as http:
        yield Browser(daemon.url, http)


async def test_pages_need_the_console_login_not_the_bearer_token(browser: Browser) -> None:
    status, _, response = await browser.get("/console/sessions")
    assert (status, response.headers["Location"]) == (303, "/console/login")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, _, _ = await browser.get("/console/sessions", **bearer)
    assert status == 303
    status, body, _ = await browser.get("/console/events")
    assert status == 401 and "log in" in json.loads(body)["error"]
    status, _, _ = await browser.post("/console/sessions/x/delete", {"csrf": "0" * 64})
    assert status == 403


async def test_a_wrong_token_opens_nothing_and_the_right_one_sets_a_strict_cookie(
    browser: Browser,
) -> None:
    status, page, response = await browser.get("/console/login")
    assert status == 200 and 'name="token"' in page
    status, page, response = await browser.post("/console/login", {"token": "wrong"})
    assert status == 403 and "not the token" in page
    assert "Set-Cookie" not in response.headers

    status, _, response = await browser.post("/console/login", {"token": TOKEN})
    assert (status, response.headers["Location"]) == (303, "/console/")
    cookie = response.headers["Set-Cookie"]
    sid = response.cookies["hermes-console"].value
    assert re.fullmatch(r"[0-9a-f]{64}", sid) and TOKEN not in cookie
    flags = {part.strip().split("=")[0].lower(): part for part in cookie.split(";")}
    assert "httponly" in flags
    assert flags["samesite"].strip() == "SameSite=Strict"
    assert flags["path"].strip() == "Path=/console"


async def test_a_login_posted_from_another_site_is_refused(browser: Browser) -> None:
    status, _, response = await browser.post(
        "/console/login", {"token": TOKEN}, Origin="http://evil.example"
    )
    assert status == 403 and "Set-Cookie" not in response.headers


async def test_every_page_renders_with_the_security_headers(browser: Browser) -> None:
    await browser.login()
    for path in PAGES:
        status, page, response = await browser.get(path)
        assert status == 200, (path, page)
        assert response.content_type == "text/html"
        assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")
        assert response.headers["X-Frame-Options"] == "DENY"
        assert "no-store" in response.headers["Cache-Control"]
        assert 'name="viewport"' in page
        assert "http://" not in page.replace(browser.url, "") and "https://" not in page
    for name, kind in (("console.css", "text/css"), ("console.js", "text/javascript")):
        status, _, response = await browser.get(f"/console/static/{name}")
        assert (status, response.content_type) == (200, kind)


async def test_the_overview_shows_the_adapters_and_the_next_run(
    browser: Browser, daemon: Daemon
) -> None:
    await browser.login()
    _, page, _ = await browser.get("/console/")
    assert "Adapters" in page and ">http<" in page and "running" in page
    assert daemon.schedule_ids()[0] in page


async def test_the_overview_stream_sends_the_live_part(browser: Browser) -> None:
    await browser.login()
    async with browser.http.get(
        browser.url + "/console/events", headers=browser._headers({})
    ) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert await response.content.readline() == b"event: overview\n"
        data = (await response.content.readline()).decode()
    html = json.loads(data.removeprefix("data: "))["html"]
    assert "Queue depth" in html and "Busy sessions" in html


async def test_q_lists_the_sessions_whose_title_matches_each_linked_to_its_transcript(
    browser: Browser, daemon: Daemon
) -> None:
    await browser.login()
    _, page, _ = await browser.get("/console/sessions?q=ZEBRA")
    links = re.findall(r'<a class="title" href="([^"]+)">([^<]+)</a>', page)
    assert links == [(f"/console/sessions/{daemon.session_id('c-zebra')}", SEEDED["c-zebra"])]
    _, page, _ = await browser.get("/console/sessions?q=c-lisbon")  # the key matches too
    assert [t for _, t in re.findall(r'class="title" href="([^"]+)">([^<]+)<', page)] == [
        SEEDED["c-lisbon"]
    ]
    status, transcript, _ = await browser.get(links[0][0])
    assert status == 200
    assert SEEDED["c-zebra"] in transcript and "echo: Quarterly zebra report" in transcript
    assert "Tokens in / out" in transcript and "Estimated cost" in transcript


async def test_the_listing_filters_by_platform_and_user_and_pages(browser: Browser) -> None:
    await browser.login()
    _, page, _ = await browser.get("/console/sessions?platform=telegram")
    assert 'class="title"' not in page
    _, page, _ = await browser.get("/console/sessions?user=ALI&platform=http")
    assert page.count('class="title"') == len(SEEDED)
    _, page, _ = await browser.get("/console/sessions?user=bob")
    assert 'class="title"' not in page
    _, page, _ = await browser.get("/console/sessions?agent=main&q=lisbon")
    assert page.count('class="title"') == 1


async def test_bad_input_is_a_4xx_json_error(browser: Browser) -> None:
    await browser.login()
    for path, status_wanted, words in (
        ("/console/sessions?agent=nobody", 400, "no agent"),
        ("/console/sessions?after=garbage", 400, "cursor"),
        ("/console/sessions?q=" + "x" * 201, 400, "longer than"),
        ("/console/sessions/20990101_000000_deadbeef", 404, "no session"),
        ("/console/sessions/a%20b", 400, "not a session id"),
        ("/console/notes?user=nocolon", 400, "PLATFORM:USER_ID"),
        ("/console/static/secret.txt", 404, "no file"),
    ):
        status, body, _ = await browser.get(path)
        assert status == status_wanted, (path, body)
        assert words in json.loads(body)["error"], (path, body)
    csrf = await browser.csrf()
    for path, form, status_wanted, words in (
        ("/console/notes/delete", {"user": "tg:1"}, 400, "form field note_id is required"),
        ("/console/notes/delete", {"user": "tg", "note_id": "n"}, 400, "PLATFORM:USER_ID"),
        ("/console/pairing/deny", {"platform": " ", "code": "1"}, 400, "platform is required"),
        ("/console/pairing/maybe", {"platform": "tg", "code": "1"}, 404, "no pairing decision"),
        ("/console/schedules/s1/explode", {}, 404, "no schedule action"),
        ("/console/sessions/a%20b/delete", {}, 400, "not a session id"),
    ):
        status, body, _ = await browser.post(path, {"csrf": csrf, **form})
        assert status == status_wanted, (path, body)
        assert words in json.loads(body)["error"], (path, body)


async def test_a_post_without_the_right_csrf_token_changes_nothing(
    browser: Browser, daemon: Daemon
) -> None:
    await browser.login()
    session_id = daemon.session_id("c-grocery")
    (schedule_id,) = daemon.schedule_ids()
    csrf = await browser.csrf()
    for form, headers in (
        ({}, {}),
        ({"csrf": "0" * 64}, {}),
        ({"csrf": csrf[:-1]}, {}),
        ({"csrf": csrf}, {"Origin": "http://evil.example"}),
    ):
        status, body, _ = await browser.post(
            f"/console/sessions/{session_id}/delete", form, **headers
        )
        assert status == 403 and "CSRF" in json.loads(body)["error"]
        status, _, _ = await browser.post(
            f"/console/schedules/{schedule_id}/pause", form, **headers
        )
        assert status == 403
    assert daemon.api("GET", f"/v1/sessions/{session_id}")[0] == 200
    _, page, _ = await browser.get("/console/schedules")
    assert 'data-status="active"' in page


async def test_pause_and_resume_a_schedule(browser: Browser, daemon: Daemon) -> None:
    await browser.login()
    (schedule_id,) = daemon.schedule_ids()
    csrf = await browser.csrf()
    status, _, response = await browser.post(
        f"/console/schedules/{schedule_id}/pause", {"csrf": csrf}
    )
    assert (status, response.headers["Location"]) == (303, "/console/schedules")
    _, page, _ = await browser.get("/console/schedules")
    assert f"Paused {schedule_id}." in page and 'data-status="paused"' in page
    await browser.post(f"/console/schedules/{schedule_id}/resume", {"csrf": csrf})
    _, page, _ = await browser.get("/console/schedules")
    assert f"Resumed {schedule_id}" in page and 'data-status="active"' in page
    status, page, _ = await browser.get(f"/console/schedules/{schedule_id}")
    assert status == 200 and "No runs yet." in page


async def test_export_is_a_json_download_of_the_whole_session(
    browser: Browser, daemon: Daemon
) -> None:
    await browser.login()
    session_id = daemon.session_id("c-lisbon")
    status, body, response = await browser.get(f"/console/sessions/{session_id}/export")
    assert status == 200 and "attachment" in response.headers["Content-Disposition"]
    doc = json.loads(body)
    assert doc["session_id"] == session_id and doc["title"] == SEEDED["c-lisbon"]
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"]


async def test_delete_removes_the_session(browser: Browser, daemon: Daemon) -> None:
    await browser.login()
    session_id = daemon.session_id("c-grocery")
    csrf = await browser.csrf()
    status, _, response = await browser.post(
        f"/console/sessions/{session_id}/delete", {"csrf": csrf}, Origin=browser.url
    )
    assert (status, response.headers["Location"]) == (303, "/console/sessions")
    assert daemon.api("GET", f"/v1/sessions/{session_id}")[0] == 404
    _, page, _ = await browser.get("/console/sessions")
    assert f"Deleted session {session_id}" in page and SEEDED["c-grocery"] not in page
    daemon.say("c-grocery", SEEDED["c-grocery"])  # as it was, for the other tests


async def test_logout_ends_the_console_session(browser: Browser) -> None:
    await browser.login()
    csrf = await browser.csrf()
    status, _, response = await browser.post("/console/logout", {"csrf": csrf})
    assert (status, response.headers["Location"]) == (303, "/console/login")
    status, _, _ = await browser.get("/console/sessions")
    assert status == 303


def test_check_config_says_the_console_needs_no_login_without_a_token(tmp_path: Path) -> None:
    result = cli(tmp_path, "check-config")
    assert result.returncode == 0, result.stderr
    assert "console at /console/" in result.stdout and "loopback" in result.stdout
    (tmp_path / "hermes.yaml").write_text("platforms:\n  http:\n    host: 0.0.0.0\n")
    result = cli(tmp_path, "check-config")
    assert "the console is not served" in result.stdout
    (tmp_path / "hermes.yaml").write_text("platforms:\n  http:\n    token: abc\n")
    assert "console" not in cli(tmp_path, "check-config").stdout


@asynccontextmanager
async def in_process(home: Path, http: dict[str, object]) -> AsyncIterator[tuple[Any, str]]:
    """A runner in this test's loop with the console mounted as `run` mounts it: (the
    runner, the console's base URL). The HTTP API listens on 127.0.0.1 whatever `host`
    says; the console's loopback rule reads the configured host."""
    from adapters.http import HttpAdapter
    from config import GatewayConfig
    from gateway.cli import mount_console
    from gateway.run import GatewayRunner

    config = GatewayConfig.model_validate({"platforms": {"http": {"enabled": True, **http}}})
    adapter = HttpAdapter(config.platforms.http)
    adapter.host = "127.0.0.1"
    runner = GatewayRunner(config, [adapter], home=home)
    mount_console(config, runner, [adapter])
    await runner.start()
    try:
        yield runner, adapter.url
    finally:
        await runner.stop()


async def test_without_a_token_the_console_is_served_on_a_loopback_host_only(
    tmp_path: Path,
) -> None:
    async with aiohttp.ClientSession() as http:
        async with in_process(tmp_path / "a", {"host": "0.0.0.0", "port": 0}) as (_, url):
            async with http.get(url + "/console/sessions", allow_redirects=False) as response:
                assert response.status == 403
                assert "not a loopback address" in await response.text()
                assert "Set-Cookie" not in response.headers
        async with in_process(tmp_path / "b", {"port": 0}) as (_, url):
            async with http.get(url + "/console/sessions", allow_redirects=False) as response:
                assert response.status == 200  # no login: the cookie comes with the page
                assert "HttpOnly" in response.headers["Set-Cookie"]


async def test_pairing_requests_are_approved_and_denied(tmp_path: Path) -> None:
    async with in_process(tmp_path, {"port": 0, "token": TOKEN}) as (runner, url):
        approve = await runner.pairing.request("telegram", "41", "Ann")
        deny = await runner.pairing.request("telegram", "42", "Bob")
        async with aiohttp.ClientSession() as http:
            browser = Browser(url, http)
            await browser.login()
            _, page, _ = await browser.get("/console/pairing")
            assert approve in page and deny in page and "Ann" in page
            csrf = await browser.csrf()
            form = {"csrf": csrf, "platform": "telegram"}
            await browser.post("/console/pairing/approve", {**form, "code": approve})
            await browser.post("/console/pairing/deny", {**form, "code": deny})
            _, page, _ = await browser.get("/console/pairing")
            assert "No pending requests." in page and f"Denied telegram code {deny}" in page
            status, _, _ = await browser.post("/console/pairing/approve", {"platform": "x"})
            assert status == 403  # no CSRF token
        assert await runner.pairing.is_paired("telegram", "41")
        assert not await runner.pairing.is_paired("telegram", "42")


async def test_a_users_notes_are_listed_and_deleted(tmp_path: Path) -> None:
    from gateway.memory.recall import Namespace

    async with in_process(tmp_path, {"port": 0, "token": TOKEN}) as (runner, url):
        kept = await runner.recall.save(Namespace("main", "http", "alice"), "likes <b>tea</b>", ())
        await runner.recall.save(Namespace("main", "http", "bob"), "likes coffee", ())
        async with aiohttp.ClientSession() as http:
            browser = Browser(url, http)
            await browser.login()
            _, page, _ = await browser.get("/console/notes?user=http:alice")
            assert "likes &lt;b&gt;tea&lt;/b&gt;" in page and "coffee" not in page
            csrf = await browser.csrf()
            await browser.post(
                "/console/notes/delete", {"csrf": csrf, "user": "http:alice", "note_id": kept}
            )
            _, page, _ = await browser.get("/console/notes?user=http:alice")
            assert "Deleted the note." in page and "No notes for this user." in page
        assert [n["text"] for n in await runner.recall.export("http", "bob")] == ["likes coffee"]


async def test_wrong_tokens_are_slowed_to_ten_a_minute(tmp_path: Path) -> None:
    async with in_process(tmp_path, {"port": 0, "token": TOKEN}) as (_, url):
        async with aiohttp.ClientSession() as http:
            browser = Browser(url, http)
            for _ in range(10):
                status, _, _ = await browser.post("/console/login", {"token": "guess"})
                assert status == 403
            status, body, _ = await browser.post("/console/login", {"token": TOKEN})
            assert status == 429 and "wait a minute" in json.loads(body)["error"]


def test_console_sessions_expire_and_are_bounded_in_count() -> None:
    from gateway.console import auth

    now = [1000.0]
    sessions = auth.ConsoleSessions(clock=lambda: now[0])
    first, session = sessions.open()
    assert sessions.find(first) is session and auth.csrf_ok(session, session.csrf)
    assert not auth.csrf_ok(session, "0" * 64) and not auth.csrf_ok(session, None)
    now[0] += auth.SESSION_SECONDS
    assert sessions.find(first) is None
    opened = [sessions.open()[0] for _ in range(auth.MAX_SESSIONS + 1)]
    assert sessions.find(opened[0]) is None and sessions.find(opened[-1]) is not None


async def test_a_transcript_folds_tool_calls_and_escapes_every_text(tmp_path: Path) -> None:
    from gateway.domain.session import Platform, SessionSource

    async with in_process(tmp_path, {"port": 0, "token": TOKEN}) as (runner, url):
        source = SessionSource(platform=Platform.HTTP, chat_id="tools", user_id="alice")
        entry = await runner.store.get_or_create_session(source)
        saved = {"name": "memory_save", "arguments": '{"content": "<tea>"}'}
        call = {"id": "call_1", "type": "function", "function": saved}
        for message in (
            {"role": "user", "content": "remember <script>alert(1)</script>"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "name": "memory_save", "content": "ok"},
            {"role": "assistant", "content": "Saved."},
        ):
            await runner.store.append_to_transcript(entry.session_id, message)
        async with aiohttp.ClientSession() as http:
            browser = Browser(url, http)
            await browser.login()
            status, page, _ = await browser.get(f"/console/sessions/{entry.session_id}")
    assert status == 200
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<details><summary>Tool call: memory_save</summary>" in page
    assert "<details><summary>Tool result: memory_save" in page
    assert "&lt;tea&gt;" in page and "Saved." in page
