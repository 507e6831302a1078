"""Titles, transcript search, export and delete, through the real
runner, the real HTTP adapter (aiohttp client), real SQLite files and the command line
as a subprocess. The runner's tests run on both store backends (`store_backend`);
`sqlite_only` ones say why."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from adapters.http import HttpAdapter
from config import GatewayConfig
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.run import GatewayRunner
from gateway.session import TokenUsage
from gateway.store import titles
from gateway.store.fts import SEARCH_DB
from gateway.store.migrations import _MIGRATIONS, _split_sql
from gateway.store.search import fts_query
from tests.commandline import cli
from tests.gateway_client import GatewayClient
from tests.pg_support import StorageBackend
from tests.scanning import pg_tables_holding, tables_holding
from tests.waiting import wait_for

KEY1 = "agent:main:http:dm:c1"
KEY2 = "agent:main:http:dm:c2"
HOSTILE = '"*():^- "pine"apple* OR (x NEAR ^y) -"" :: **'


class GatedAgent:
    """Echoes; a message containing 'hold' waits until the test opens `gate`."""

    gate: asyncio.Event | None = None

    def __init__(self, session_key: str) -> None:
        self.session_key = session_key

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if "hold" in request.text and GatedAgent.gate is not None:
            await GatedAgent.gate.wait()
        return TurnResult(f"echo: {request.text}", TokenUsage(input_tokens=1, output_tokens=1))

    async def close(self) -> None:
        pass


@dataclass
class Gateway:
    runner: GatewayRunner
    client: GatewayClient
    home: Path
    url: str

    async def say(self, chat: str, text: str) -> str:
        """Post and wait for the one reply."""
        await self.client.post(chat, text)
        (reply,) = await self.client.replies(chat, 1)
        return reply

    async def session_id(self, key: str = KEY1) -> str:
        entry = await self.runner.store.get_entry(key)
        assert entry is not None
        return entry.session_id

    async def http(self, method: str, path: str, **params: Any) -> tuple[int, Any]:
        async with self.client.session.request(method, self.url + path, params=params) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def gateway(tmp_path: Path, store_backend: StorageBackend) -> AsyncIterator[Gateway]:
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "platforms": {"http": {"enabled": True, "port": 0}}}
    )
    config = store_backend.apply(config)
    adapter = HttpAdapter(config.platforms.http)
    GatedAgent.gate = asyncio.Event()
    runner = GatewayRunner(config, [adapter], agent_factory=GatedAgent, home=tmp_path)
    await runner.start()
    gw = Gateway(runner, GatewayClient(adapter.url), tmp_path, adapter.url)
    yield gw
    GatedAgent.gate.set()
    await gw.client.close()
    await runner.stop()


# --- titles ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "title"),
    [
        ("hello", "hello"),
        ("  padded  ", "padded"),
        ("x" * 40, "x" * 40),
        ("x" * 41, "x" * 40 + "..."),
        ("first line\nsecond line", "first line second line"),
        ("a\r\nb", "a b"),
        ("line one\n" + "y" * 50, "line one " + "y" * 31 + "..."),
        ("", "New Session"),
        (None, "New Session"),
        ("   \n ", "New Session"),
    ],
)
def test_make_title(text: str | None, title: str) -> None:
    assert titles.make_title(text) == title


def test_the_backfill_migration_titles_old_sessions_by_the_same_rule() -> None:
    texts = ["hello", "x" * 41, "first\nsecond", " a\r\nb ", "y" * 39 + "\nz" * 3, "é" * 45]
    conn = sqlite3.connect(":memory:")
    conn.executescript(
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, title TEXT);"
        "CREATE TABLE messages (id INTEGER PRIMARY KEY, session_id TEXT, role TEXT,"
        " content TEXT, active INTEGER);"
    )
    for n, text in enumerate(texts):
        conn.execute("INSERT INTO sessions VALUES (?, NULL)", (f"s{n}",))
        conn.execute("INSERT INTO messages VALUES (NULL, ?, 'assistant', 'hi', 1)", (f"s{n}",))
        conn.execute("INSERT INTO messages VALUES (NULL, ?, 'user', 'undone', 0)", (f"s{n}",))
        conn.execute("INSERT INTO messages VALUES (NULL, ?, 'user', ?, 1)", (f"s{n}", text))
        conn.execute("INSERT INTO messages VALUES (NULL, ?, 'user', 'later', 1)", (f"s{n}",))
    conn.execute("INSERT INTO sessions VALUES ('titled', 'kept')")
    conn.execute("INSERT INTO sessions VALUES ('empty', NULL)")
    for statement in _split_sql(_MIGRATIONS[8]):
        conn.execute(statement)
    got = dict(conn.execute("SELECT session_id, title FROM sessions"))
    assert got == {
        **{f"s{n}": titles.make_title(text) for n, text in enumerate(texts)},
        "titled": "kept",
        "empty": None,  # shown as "New Session"
    }


# The CLI subprocess reads $HERMES_HOME's config, which names no PostgreSQL store here.
@pytest.mark.sqlite_only
async def test_first_message_titles_the_session_and_title_renames(gateway: Gateway) -> None:
    first = "Plan the trip to Lisbon\nwith the kids in the spring, please"
    await gateway.say("c1", first)
    await gateway.say("c1", "a second message changes nothing")
    status, listed = await gateway.http("GET", "/v1/sessions")
    assert status == 200
    (row,) = listed["sessions"]
    assert row["session_id"] == await gateway.session_id()
    assert row["title"] == "Plan the trip to Lisbon with the kids in..."
    assert "Title: Plan the trip to Lisbon with the kids in..." in await gateway.say(
        "c1", "/status"
    )
    assert "Lisbon trip" in await gateway.say("c1", "/title   Lisbon\ntrip  ")
    status, listed = await gateway.http("GET", "/v1/sessions")
    assert listed["sessions"][0]["title"] == "Lisbon trip"
    assert "Title: Lisbon trip" in await gateway.say("c1", "/title")
    # The CLI lists titles too.
    listing = await asyncio.to_thread(cli, gateway.home, "sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert "Lisbon trip" in listing.stdout


async def test_a_session_without_messages_is_new_session(gateway: Gateway) -> None:
    await gateway.say("c1", "/new")
    status, listed = await gateway.http("GET", "/v1/sessions")
    assert status == 200
    assert [s["title"] for s in listed["sessions"]] == ["New Session"]


async def test_resume_by_title_or_unique_prefix(gateway: Gateway) -> None:
    await gateway.say("c1", "budget for the garden")
    garden = await gateway.session_id()
    await gateway.say("c1", "/new")
    await gateway.say("c1", "budget for the kitchen")
    kitchen = await gateway.session_id()
    await gateway.say("c1", "/new")
    await gateway.say("c1", "something else")
    listing = await gateway.say("c1", "/resume")
    assert "budget for the garden" in listing and "budget for the kitchen" in listing
    ambiguous = await gateway.say("c1", "/resume budget for")
    assert "2 sessions match" in ambiguous and garden in ambiguous and kitchen in ambiguous
    assert await gateway.session_id() not in (garden, kitchen)  # nothing switched
    assert garden in await gateway.say("c1", "/resume BUDGET FOR THE G")
    assert await gateway.session_id() == garden
    assert kitchen in await gateway.say("c1", "/resume budget for the kitchen")
    assert await gateway.session_id() == kitchen
    assert "No earlier session" in await gateway.say("c1", "/resume nothing like this")
    # Another chat's titles are not this chat's.
    await gateway.say("c2", "hello")
    assert "No earlier session" in await gateway.say("c2", "/resume budget")


# --- search ----------------------------------------------------------------------------


def test_fts_query_quotes_everything_but_a_trailing_star() -> None:
    assert fts_query('say "hi" (now)') == '"say" """hi""" "(now)"'
    assert fts_query("deploy*") == '"deploy"*'
    assert fts_query("AND OR NOT") == '"AND" "OR" "NOT"'
    assert fts_query('"*():^-') is None
    assert fts_query("   ") is None
    assert fts_query("pine\x00apple") == '"pine" "apple"'  # a NUL would end FTS5's query


async def test_search_is_scoped_to_the_asking_chat(gateway: Gateway) -> None:
    await gateway.say("c1", "the pineapple recipe from grandma")
    await gateway.say("c1", "/title Recipes")
    await gateway.say("c2", "my pineapple password is secret")
    reply = await gateway.say("c1", "/search pineapple")
    assert "Recipes" in reply and "**pineapple**" in reply and "grandma" in reply
    assert "password" not in reply
    assert "this session" in reply
    await gateway.say("c1", "/new")
    reply = await gateway.say("c1", "/search PINEAPPLE")
    first_id = (await gateway.runner.store.list_session_history(KEY1))[1]["session_id"]
    assert f"/resume {first_id}" in reply
    # The HTTP API: every session, or one HTTP chat's.
    status, found = await gateway.http("GET", "/v1/search", q="pineapple")
    assert status == 200
    assert {(r["session_key"], r["role"]) for r in found["results"]} == {
        (KEY1, "user"),
        (KEY1, "assistant"),
        (KEY2, "user"),
        (KEY2, "assistant"),
    }
    assert set(found["results"][0]) == {
        "session_id",
        "session_key",
        "title",
        "message_id",
        "role",
        "snippet",
        "timestamp",
    }
    status, found = await gateway.http("GET", "/v1/search", q="pineapple", chat_id="c2")
    assert status == 200 and {r["session_key"] for r in found["results"]} == {KEY2}
    status, found = await gateway.http("GET", "/v1/search", q="pineapple", limit="1")
    assert len(found["results"]) == 1


async def test_hostile_queries_answer_normally(gateway: Gateway) -> None:
    await gateway.say("c1", "pineapple (ripe) and x NEAR y")
    reply = await gateway.say("c1", f"/search {HOSTILE}")
    assert reply.startswith("Nothing found") or reply.startswith("Found")
    for query in (HOSTILE, '"', "*", "^", "NEAR(", "-", '"*():^-', "AND", "\u00e9\u00e9"):
        status, found = await gateway.http("GET", "/v1/search", q=query)
        assert status == 200, (query, found)
        assert isinstance(found["results"], list)
    status, found = await gateway.http("GET", "/v1/search", q="(ripe)")
    assert status == 200 and found["results"]


async def test_search_parameters_are_checked(gateway: Gateway) -> None:
    status, body = await gateway.http("GET", "/v1/search")
    assert status == 400 and "q" in body["error"]
    for bad in ("abc", "-1", "0", "101", "1e2", "\u0663"):
        status, body = await gateway.http("GET", "/v1/search", q="x", limit=bad)
        assert status == 400 and "limit" in body["error"], bad
    status, body = await gateway.http("GET", "/v1/search", q="x", chat_id="../etc")
    assert status == 400 and "chat_id" in body["error"]


async def test_undone_messages_are_not_found(gateway: Gateway) -> None:
    await gateway.say("c1", "zebracorn sighting")
    await gateway.say("c1", "/undo")
    assert "Nothing found" in await gateway.say("c1", "/search zebracorn")
    status, found = await gateway.http("GET", "/v1/search", q="zebracorn")
    assert status == 200 and found["results"] == []
    searched = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "zebracorn", "--json"
    )
    assert searched.returncode == 0, searched.stderr
    assert json.loads(searched.stdout) == []


# The CLI subprocess reads $HERMES_HOME's config, which names no PostgreSQL store here.
@pytest.mark.sqlite_only
async def test_cli_search_filters_by_platform_and_user(gateway: Gateway) -> None:
    await gateway.client.post("c1", "walrus one", user_id="alice")
    await gateway.client.post("c2", "walrus two", user_id="bob")
    await gateway.client.replies("c1", 1)
    await gateway.client.replies("c2", 1)
    everything = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "walrus", "--json"
    )
    assert {h["session_key"] for h in json.loads(everything.stdout)} == {KEY1, KEY2}
    bob = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "walrus", "--user", "bob", "--json"
    )
    assert {h["session_key"] for h in json.loads(bob.stdout)} == {KEY2}
    elsewhere = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "walrus", "--platform", "telegram"
    )
    assert elsewhere.returncode == 0 and "nothing found" in elsewhere.stdout
    text = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "walrus", "one", "--limit", "1"
    )
    assert text.stdout.count("(message ") == 1 and "**walrus** **one**" in text.stdout


# --- export and read -------------------------------------------------------------------


async def _session_with_tools(gateway: Gateway) -> str:
    await gateway.say("c1", "what is the weather")
    session_id = await gateway.session_id()
    store = gateway.runner.store
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    await store.append_to_transcript(
        session_id, {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    await store.append_to_transcript(
        session_id, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    )
    await gateway.say("c1", "thanks")
    await gateway.say("c1", "regret this")
    await gateway.say("c1", "/undo")
    return session_id


# The CLI subprocess reads $HERMES_HOME's config, which names no PostgreSQL store here.
@pytest.mark.sqlite_only
async def test_export_json_has_every_message(gateway: Gateway) -> None:
    session_id = await _session_with_tools(gateway)
    out = gateway.home / "export.json"
    result = await asyncio.to_thread(
        cli, gateway.home, "sessions", "export", session_id, "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_mode & 0o777 == 0o600
    doc = json.loads(out.read_text())
    stored = await gateway.runner.store.load_transcript(session_id)
    assert doc["session_id"] == session_id and doc["session_key"] == KEY1
    assert doc["title"] == "what is the weather" and doc["started_at"]
    assert [(m["role"], m["content"]) for m in doc["messages"]] == [
        (m["role"], m["content"]) for m in stored
    ]
    assert [m["role"] for m in doc["messages"]] == [
        "user",
        "assistant",
        "assistant",
        "tool",
        "user",
        "assistant",
    ]
    assert doc["messages"][2]["tool_calls"][0]["function"]["name"] == "weather"
    assert doc["messages"][3]["tool_call_id"] == "call_1"
    assert all(m["timestamp"] for m in doc["messages"])
    assert "regret" not in out.read_text()  # undone
    markdown = await asyncio.to_thread(
        cli, gateway.home, "sessions", "export", session_id, "--format", "markdown"
    )
    assert markdown.returncode == 0
    assert markdown.stdout.startswith("# what is the weather\n")
    assert "## tool" in markdown.stdout and "sunny" in markdown.stdout
    missing = await asyncio.to_thread(
        cli, gateway.home, "sessions", "export", "20200101_000000_0123abcd"
    )
    assert missing.returncode == 1 and "no session" in missing.stderr


async def test_get_session_pages_its_messages(gateway: Gateway) -> None:
    session_id = await _session_with_tools(gateway)
    seen: list[dict[str, Any]] = []
    after = 0
    while True:
        status, page = await gateway.http(
            "GET", f"/v1/sessions/{session_id}", after=str(after), limit="2"
        )
        assert status == 200 and page["session_id"] == session_id
        assert len(page["messages"]) <= 2
        if not page["messages"]:
            assert page["next"] == after
            break
        seen += page["messages"]
        after = page["next"]
    stored = await gateway.runner.store.load_transcript(session_id)
    assert [m["content"] for m in seen] == [m["content"] for m in stored]
    status, body = await gateway.http("GET", "/v1/sessions/20200101_000000_0123abcd")
    assert status == 404
    status, body = await gateway.http("GET", f"/v1/sessions/{session_id}", limit="501")
    assert status == 400 and "limit" in body["error"]


# --- delete ----------------------------------------------------------------------------


# About state.db's and search.db's files (every table scanned, FTS5 queried).
@pytest.mark.sqlite_only
async def test_delete_cascades_everywhere(gateway: Gateway) -> None:
    await gateway.say("c1", "the quokka plan")
    await gateway.say("c1", "/status")  # a reply that names the session id
    await gateway.say("c2", "quokka elsewhere")
    session_id = await gateway.session_id()
    await gateway.say("c1", "more quokka")
    status, found = await gateway.http("GET", "/v1/search", q="quokka")
    assert {r["session_id"] for r in found["results"]} >= {session_id}
    state = gateway.home / "sessions" / "state.db"
    assert tables_holding(state, session_id)  # the check can see it ...
    assert tables_holding(state, "the quokka plan")

    status, body = await gateway.http("DELETE", f"/v1/sessions/{session_id}")
    assert status == 200, body
    assert body["session_id"] == session_id and body["messages"] == 4
    assert body["was_current"] is True
    assert await gateway.runner.store.get_entry(KEY1) is None  # no session until c1 speaks

    assert tables_holding(state, session_id) == []  # ... and finds it nowhere now
    assert tables_holding(state, "quokka plan") == []
    status, found = await gateway.http("GET", "/v1/search", q="quokka")
    assert [r["session_key"] for r in found["results"]] == [KEY2, KEY2]
    await gateway.runner.store.search_index.catch_up()
    index = sqlite3.connect(gateway.home / "sessions" / SEARCH_DB)
    try:
        assert index.execute(
            "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH 'quokka'"
        ).fetchone() == (2,)  # c2's two messages only
    finally:
        index.close()
    status, _ = await gateway.http("GET", f"/v1/sessions/{session_id}")
    assert status == 404
    status, _ = await gateway.http("DELETE", f"/v1/sessions/{session_id}")
    assert status == 404
    # The chat goes on in a new session.
    assert await gateway.say("c1", "hello again") == "echo: hello again"
    assert await gateway.session_id() != session_id


async def test_deleting_an_earlier_session_keeps_the_current_one(gateway: Gateway) -> None:
    await gateway.say("c1", "old talk")
    old = await gateway.session_id()
    await gateway.say("c1", "/new")
    await gateway.say("c1", "new talk")
    current = await gateway.session_id()
    status, body = await gateway.http("DELETE", f"/v1/sessions/{old}")
    assert status == 200 and body["was_current"] is False
    assert await gateway.session_id() == current
    assert [m["content"] for m in await gateway.runner.store.load_transcript(current)] == [
        "new talk",
        "echo: new talk",
    ]


# The CLI subprocess reads $HERMES_HOME's config, which names no PostgreSQL store here.
@pytest.mark.sqlite_only
async def test_delete_is_refused_while_a_turn_runs(gateway: Gateway) -> None:
    await gateway.say("c1", "first")
    session_id = await gateway.session_id()
    assert GatedAgent.gate is not None
    await gateway.client.post("c1", "hold on")
    await wait_for(lambda: gateway.runner.is_busy(KEY1))
    status, body = await gateway.http("DELETE", f"/v1/sessions/{session_id}")
    assert status == 409, body
    refused = await asyncio.to_thread(cli, gateway.home, "sessions", "delete", session_id, "--yes")
    assert refused.returncode == 1 and "turn running" in refused.stderr
    assert "/stop it first" in await gateway.say("c1", "/forget yes")
    GatedAgent.gate.set()
    assert await gateway.client.replies("c1", 1) == ["echo: hold on"]
    await wait_for(lambda: not gateway.runner.is_busy(KEY1))
    assert len(await gateway.runner.store.load_transcript(session_id)) == 4


# The CLI subprocess reads $HERMES_HOME's config, which names no PostgreSQL store here.
@pytest.mark.sqlite_only
async def test_cli_delete(gateway: Gateway) -> None:
    await gateway.say("c1", "numbat notes")
    session_id = await gateway.session_id()
    unasked = await asyncio.to_thread(cli, gateway.home, "sessions", "delete", session_id)
    assert unasked.returncode == 1 and "--yes" in unasked.stderr
    assert await gateway.runner.store.count_messages(session_id) == 2
    deleted = await asyncio.to_thread(cli, gateway.home, "sessions", "delete", session_id, "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert f"deleted session {session_id} (2 messages)" in deleted.stdout
    assert f"{KEY1} has no session now" in deleted.stdout
    assert tables_holding(gateway.home / "sessions" / "state.db", session_id) == []
    assert await gateway.runner.store.get_entry(KEY1) is None
    status, found = await gateway.http("GET", "/v1/search", q="numbat")
    assert status == 200 and found["results"] == []
    again = await asyncio.to_thread(cli, gateway.home, "sessions", "delete", session_id, "--yes")
    assert again.returncode == 1 and "no session" in again.stderr
    # The daemon routes the chat's next message to a new session, under its feet.
    assert await gateway.say("c1", "numbat again") == "echo: numbat again"
    assert await gateway.session_id() != session_id


async def test_forget_asks_then_deletes_the_current_session(gateway: Gateway) -> None:
    await gateway.say("c1", "axolotl diary")
    session_id = await gateway.session_id()
    asked = await gateway.say("c1", "/forget")
    assert "/forget yes" in asked and "axolotl diary" in asked and "2 messages" in asked
    assert await gateway.session_id() == session_id  # asking deletes nothing
    done = await gateway.say("c1", "/forget yes")
    assert done.startswith("Forgot this session (2 messages)")
    assert await gateway.runner.store.get_entry(KEY1) is None
    assert "Nothing found" in await gateway.say("c1", "/search axolotl")
    assert tables_holding(gateway.home / "sessions" / "state.db", session_id) == []
    assert await gateway.say("c1", "fresh start") == "echo: fresh start"
    assert await gateway.session_id() != session_id


async def test_after_forget_an_earlier_session_is_still_resumed(gateway: Gateway) -> None:
    """/forget leaves the chat without a session, not without its earlier ones."""
    await gateway.say("c1", "the old tapir talk")
    old = await gateway.session_id()
    await gateway.say("c1", "/new")
    await gateway.say("c1", "tapir news")
    assert (await gateway.say("c1", "/forget yes")).startswith("Forgot this session")
    assert old in await gateway.say("c1", "/resume")
    resumed = await gateway.say("c1", f"/resume {old}")
    assert resumed == f"Resumed session {old} (2 messages)."
    assert await gateway.session_id() == old
    assert await gateway.say("c1", "tapir again") == "echo: tapir again"
    assert len(await gateway.runner.store.load_transcript(old)) == 4


async def test_deleting_the_current_session_leaves_nothing_naming_its_user(
    gateway: Gateway, store_backend: StorageBackend
) -> None:
    """The HTTP API and /forget delete a chat's current session without starting another
    (which would carry who wrote there): no row names the user or the session after
    either, and the chat's next message gets a new session and an answer."""
    sessions = gateway.home / "sessions"

    async def holding(needle: str) -> list[str]:
        if store_backend.postgres:
            return pg_tables_holding(store_backend.dsn or "", needle)
        await gateway.runner.store.flush_mirror()
        mirror = (sessions / "sessions.json").read_text()
        found = tables_holding(sessions / "state.db", needle)
        return found + (["sessions.json"] if needle in mirror else [])

    async def say(text: str) -> str:
        await gateway.client.post("c1", text, user_id="zed-9", user_name="Zed Okapi")
        (reply,) = await gateway.client.replies("c1", 1)
        return reply

    for forget in ("/forget", "http"):
        await say("the okapi plan")
        await say("/status")
        session_id = await gateway.session_id()
        assert {"sessions", "session_entry_docs"} <= {
            found.split(".")[0] for found in await holding("zed-9")
        }
        if forget == "http":
            status, body = await gateway.http("DELETE", f"/v1/sessions/{session_id}")
            assert status == 200 and body["was_current"] is True, body
        else:
            assert (await say("/forget yes")).startswith("Forgot this session")
        assert await gateway.runner.store.get_entry(KEY1) is None
        # What the user spent stays with them (counts per day, no text, no session): a
        # deleted session does not reset a budget. Deleting the user's data takes it
        # (tests/test_usage.py).
        assert [t.split(".")[0] for t in await holding("zed-9")] == ["usage_days"], forget
        assert await holding("Zed Okapi") == [], forget
        assert await holding(session_id) == [], forget
        status, listed = await gateway.http("GET", "/v1/sessions")
        assert KEY1 not in [s["session_key"] for s in listed["sessions"]]
        assert await say("okapi again") == "echo: okapi again"
        assert await gateway.session_id() != session_id


async def test_http_token_guards_the_new_endpoints(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate(
        {"platforms": {"http": {"enabled": True, "port": 0, "token": "tkn"}}}
    )
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], agent_factory=GatedAgent, home=tmp_path)
    await runner.start()
    try:
        async with aiohttp.ClientSession() as http:
            for method, path in (
                ("GET", "/v1/search?q=x"),
                ("GET", "/v1/sessions/20200101_000000_0123abcd"),
                ("DELETE", "/v1/sessions/20200101_000000_0123abcd"),
            ):
                async with http.request(method, adapter.url + path) as resp:
                    assert resp.status == 401, (method, path)
    finally:
        await runner.stop()
