"""Several agents side by side (`agents:`, `routes:`).

The config rules (ids, `agent:` vs `agents.main`, gateway-wide keys, route targets) and
the router in isolation; then the real runner, the real HTTP adapter and real SQLite
files, with agents built from their config (`tests.fakes.agents:named`): two agents
routed to different chats, and two agents in one chat routed by user, keep separate
keys, sessions, transcripts and search results.
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from adapters.http import HttpAdapter
from config import EXIT_CONFIG, ConfigError, GatewayConfig, RouteMatch, load_config
from gateway.agents.protocol import AgentError
from gateway.agents.roster import Roster
from gateway.cli import check_runnable
from gateway.domain.routing import Router
from gateway.run import GatewayRunner
from gateway.session import Platform, SessionSource, agent_id_of_key
from tests.commandline import cli
from tests.fakes.agents import NamedAgent
from tests.gateway_client import GatewayClient

NAMED = "tests.fakes.agents:named"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hermes.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(tmp_path, text))
    return caught.value.problems


# --- config ------------------------------------------------------------------------------


def test_agents_and_routes_load(tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path,
            """
agent: {backend: echo, system_prompt: main prompt}
agents:
  coder: {backend: openai, model: gpt-4o, context: {strategy: window}}
  helper: {}
routes:
  - {match: {platform: discord, chat_id: "42"}, agent: coder}
  - {match: {user_id: alice}, agent: helper}
""",
        )
    )
    agents = config.agent_configs()
    assert list(agents) == ["main", "coder", "helper"]
    assert agents["main"].system_prompt == "main prompt"
    # Nothing is inherited from agent: (a key left out is the schema default).
    assert agents["coder"].system_prompt is None and agents["helper"].backend == "echo"
    assert agents["coder"].context.strategy == "window"
    assert config.routes[1].match == RouteMatch(user_id="alice")


def test_agents_main_is_the_main_agent(tmp_path: Path) -> None:
    config = load_config(
        write_config(tmp_path, "agents:\n  main: {model: m1, max_concurrent_turns: 3}\n")
    )
    assert config.agent.model == "m1" and config.agent.max_concurrent_turns == 3
    assert list(config.agent_configs()) == ["main"]


def test_agent_and_agents_main_both_given_is_an_error(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, "agent: {model: a}\nagents:\n  main: {model: b}\n")
    assert len(problems) == 1
    assert problems[0].startswith("agents.main:") and "agent:" in problems[0]


@pytest.mark.parametrize("bad", ["Coder", "a.b", "-x", "a" * 33, "ü", "a b", "x:y"])
def test_agent_ids_are_checked(tmp_path: Path, bad: str) -> None:
    problems = problems_of(tmp_path, f"agents:\n  {json.dumps(bad)}: {{}}\n")
    assert problems == [
        f"agents.{bad}: not a valid agent id: use 1-32 of a-z, 0-9, '-' and '_', "
        "starting with a letter or digit (ids go into session keys)"
    ]


def test_good_agent_ids(tmp_path: Path) -> None:
    ids = ["a", "0", "code-review_2", "x" * 32]
    text = "agents:\n" + "".join(f"  {json.dumps(i)}: {{}}\n" for i in ids)
    config = load_config(write_config(tmp_path, text))
    assert list(config.agent_configs()) == ["main", *ids]


def test_gateway_wide_keys_belong_to_the_main_agent(tmp_path: Path) -> None:
    problems = problems_of(
        tmp_path, "agents:\n  coder: {max_concurrent_turns: 4, cache_max_size: 9, model: x}\n"
    )
    assert [p.split(":")[0] for p in problems] == [
        "agents.coder.max_concurrent_turns",
        "agents.coder.cache_max_size",
    ]
    assert all("set it under agent:" in p for p in problems)
    # The main agent's own value is no conflict (a YAML merge of `agent:` copies it).
    same = "agent: {cache_max_size: 9}\nagents:\n  coder: {cache_max_size: 9}\n"
    assert load_config(write_config(tmp_path, same)).agents["coder"].cache_max_size == 9


def test_a_route_to_an_unknown_agent_names_its_key_path(tmp_path: Path) -> None:
    problems = problems_of(
        tmp_path,
        """
agents: {coder: {}}
routes:
  - {match: {platform: telegram}, agent: coder}
  - {match: {platform: slack}, agent: main}
  - {match: {chat_id: "7"}, agent: codr}
""",
    )
    assert problems == ["routes.2.agent: unknown agent 'codr' (agents: coder, main)"]


def test_route_fields_are_checked(tmp_path: Path) -> None:
    problems = problems_of(
        tmp_path,
        "routes:\n  - {match: {platform: icq, chat_id: 5, room: x}, agent: main}\n"
        "  - {match: {}}\n",
    )
    assert {p.split(":")[0] for p in problems} == {
        "routes.0.match.platform",
        "routes.0.match.chat_id",  # ids are strings, as in allowed_users
        "routes.0.match.room",
        "routes.1.agent",
    }


def test_route_platforms_are_the_session_platforms() -> None:
    field = RouteMatch.model_fields["platform"].annotation
    (literal, _none) = typing.get_args(field)
    assert set(typing.get_args(literal)) == {p.value for p in Platform}


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_check_config_and_run_refuse_an_unknown_route_target_alike(
    tmp_path: Path, command: str
) -> None:
    path = write_config(tmp_path, "routes:\n  - {match: {platform: http}, agent: nobody}\n")
    done = cli(tmp_path / "home", command, "--config", str(path))
    assert done.returncode == EXIT_CONFIG
    assert f"{path}: routes.0.agent: unknown agent 'nobody' (agents: main)" in done.stderr


def test_a_bad_backend_of_another_agent_names_its_key(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate(
        {"agents": {"coder": {"backend": "no_such_module_xyz:make"}}}
    )
    with pytest.raises(ConfigError) as caught:
        check_runnable(config)
    assert str(caught.value).startswith("agents.coder.backend: cannot import module")


# --- routing -----------------------------------------------------------------------------


def source(**fields: Any) -> SessionSource:
    fields.setdefault("platform", Platform.TELEGRAM)
    fields.setdefault("chat_type", "dm")
    fields.setdefault("chat_id", None)
    return SessionSource(**fields)


def router(*routes: dict[str, Any]) -> Router:
    agents = {r["agent"]: {} for r in routes if r["agent"] != "main"}
    return Router(GatewayConfig.model_validate({"agents": agents, "routes": list(routes)}).routes)


def test_first_matching_route_wins_and_every_given_field_must_match() -> None:
    r = router(
        {"match": {"platform": "telegram", "chat_id": "1", "user_id": "bob"}, "agent": "a"},
        {"match": {"platform": "telegram", "chat_id": "1"}, "agent": "b"},
        {"match": {"chat_type": "group"}, "agent": "c"},
        {"match": {"user_id": "bob"}, "agent": "d"},
    )
    assert r.agent_for(source(chat_id="1", user_id="bob")) == "a"
    assert r.agent_for(source(chat_id="1", user_id="ann")) == "b"
    assert r.agent_for(source(chat_id="2", user_id="bob", chat_type="group")) == "c"
    assert r.agent_for(source(chat_id="2", user_id="bob")) == "d"
    assert r.agent_for(source(platform=Platform.DISCORD, chat_id="1", user_id="ann")) == "main"
    assert r.agent_for(source(platform=Platform.DISCORD, chat_id="1", user_id="bob")) == "d"


def test_routes_that_cannot_change_the_answer_are_dropped() -> None:
    assert router().routes == 0
    assert router({"match": {"chat_id": "1"}, "agent": "main"}).routes == 0
    catch_all = router(
        {"match": {"chat_id": "1"}, "agent": "a"},
        {"match": {}, "agent": "b"},
        {"match": {"chat_id": "2"}, "agent": "c"},  # never reached
    )
    assert catch_all.routes == 2
    assert catch_all.agent_for(source(chat_id="2")) == "b"
    assert catch_all.agent_for(source(chat_id="1")) == "a"
    # A route to main before another agent's still counts.
    kept = router({"match": {"user_id": "x"}, "agent": "main"}, {"match": {}, "agent": "b"})
    assert kept.agent_for(source(user_id="x")) == "main"
    assert kept.agent_for(source(user_id="y")) == "b"


def test_agent_id_of_key() -> None:
    assert agent_id_of_key("agent:main:telegram:dm:1") == "main"
    assert agent_id_of_key("agent:code-2:http:group:c:u") == "code-2"
    for bad in ("main:telegram", "agent::http:dm", "agent:main", "x:main:http:dm"):
        with pytest.raises(ValueError):
            agent_id_of_key(bad)


# --- the roster --------------------------------------------------------------------------


def test_each_agent_has_its_own_signature() -> None:
    def roster(b_model: str) -> Roster:
        return Roster(
            GatewayConfig.model_validate({"agents": {"a": {"model": "m"}, "b": {"model": b_model}}})
        )

    before, after = roster("m1"), roster("m2")
    assert before["a"].signature == after["a"].signature
    assert before["main"].signature == after["main"].signature
    assert before["b"].signature != after["b"].signature


async def test_a_session_of_an_agent_no_longer_configured_is_not_handed_to_another() -> None:
    roster = Roster(GatewayConfig.model_validate({"agents": {"a": {}}}))
    assert roster.for_key("agent:a:http:dm:c").agent_id == "a"
    gone = roster.for_key("agent:gone:http:dm:c")
    assert gone.agent_id == "gone"
    with pytest.raises(AgentError, match="'gone', which is no longer configured"):
        gone.factory("agent:gone:http:dm:c")
    # The main agent still builds its own.
    assert roster.build("agent:main:http:dm:c") is not None


# --- the real gateway --------------------------------------------------------------------


@dataclass
class Gateway:
    runner: GatewayRunner
    client: GatewayClient
    home: Path
    url: str

    async def say(self, chat: str, text: str, user: str = "u1") -> str:
        await self.client.post(chat, text, user_id=user)
        (reply,) = await self.client.replies(chat, 1)
        return reply

    async def http(self, path: str, **params: Any) -> tuple[int, Any]:
        async with self.client.session.get(self.url + path, params=params) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    config = GatewayConfig.model_validate(
        {
            "timezone": "UTC",
            "platforms": {"http": {"enabled": True, "port": 0}},
            "agent": {"backend": NAMED, "options": {"name": "main"}},
            "agents": {
                "alpha": {
                    "backend": NAMED,
                    "options": {"name": "alpha"},
                    "system_prompt": "You are alpha.",
                },
                "beta": {
                    "backend": NAMED,
                    "options": {"name": "beta"},
                    "system_prompt": "You are beta.",
                    # beta's turns see at most its 2 newest messages (its own plan)
                    "context": {"strategy": "window", "max_messages": 2},
                    "gateway_timeout": 0.5,
                },
            },
            "routes": [
                {"match": {"platform": "http", "chat_id": "ca"}, "agent": "alpha"},
                {"match": {"chat_id": "cb"}, "agent": "beta"},
                {"match": {"chat_id": "shared", "user_id": "bob"}, "agent": "beta"},
            ],
        }
    )
    NamedAgent.requests.clear()
    adapter = HttpAdapter(config.platforms.http)
    runner = GatewayRunner(config, [adapter], home=tmp_path)
    await runner.start()
    gw = Gateway(runner, GatewayClient(adapter.url), tmp_path, adapter.url)
    yield gw
    await gw.client.close()
    await runner.stop()


def requests_of(key: str) -> list[Any]:
    return [r for r in NamedAgent.requests if r.session_key == key]


async def test_two_agents_in_two_chats_keep_keys_sessions_and_transcripts_apart(
    gateway: Gateway,
) -> None:
    assert await gateway.say("ca", "alpha pineapple one") == "alpha: alpha pineapple one"
    assert await gateway.say("cb", "beta mango one") == "beta: beta mango one"
    assert await gateway.say("cc", "main kiwi one") == "main: main kiwi one"
    store = gateway.runner.store
    entries = {e.session_key: e for e in await store.list_sessions()}
    assert set(entries) == {
        "agent:alpha:http:dm:ca",
        "agent:beta:http:dm:cb",
        "agent:main:http:dm:cc",
    }
    assert len({e.session_id for e in entries.values()}) == 3
    alpha = await store.load_transcript(entries["agent:alpha:http:dm:ca"].session_id)
    assert [m["content"] for m in alpha] == ["alpha pineapple one", "alpha: alpha pineapple one"]
    # Each agent got its own system prompt, and its agent object was built by its factory.
    (asked,) = requests_of("agent:alpha:http:dm:ca")
    assert asked.system_prompt.startswith("You are alpha.")
    (asked,) = requests_of("agent:main:http:dm:cc")
    assert not asked.system_prompt.startswith("You are")
    status = await gateway.say("cb", "/status")
    assert "\nAgent: beta\n" in status and "Key: agent:beta:http:dm:cb" in status


async def test_search_and_listing_never_cross_agents(gateway: Gateway) -> None:
    await gateway.say("ca", "the pineapple recipe")
    await gateway.say("cb", "my pineapple password")
    reply = await gateway.say("cb", "/search pineapple")
    assert "password" in reply and "recipe" not in reply
    reply = await gateway.say("ca", "/search password")
    assert reply.startswith("Nothing found")
    # HTTP: everything for the operator, one agent with ?agent=.
    status, found = await gateway.http("/v1/search", q="pineapple")
    assert status == 200
    assert {agent_id_of_key(r["session_key"]) for r in found["results"]} == {"alpha", "beta"}
    status, found = await gateway.http("/v1/search", q="pineapple", agent="beta")
    assert status == 200 and found["results"]
    assert {r["session_key"] for r in found["results"]} == {"agent:beta:http:dm:cb"}
    status, found = await gateway.http("/v1/search", q="pineapple", agent="main")
    assert status == 200 and found["results"] == []
    status, body = await gateway.http("/v1/search", q="x", agent="../main")
    assert status == 400 and "agent" in body["error"]
    status, listed = await gateway.http("/v1/sessions")
    assert {(s["agent"], s["session_key"]) for s in listed["sessions"]} == {
        ("alpha", "agent:alpha:http:dm:ca"),
        ("beta", "agent:beta:http:dm:cb"),
    }
    status, listed = await gateway.http("/v1/sessions", agent="alpha")
    assert [s["session_key"] for s in listed["sessions"]] == ["agent:alpha:http:dm:ca"]
    status, body = await gateway.http("/v1/sessions", agent="Alpha")
    assert status == 400
    # The command line: --agent on sessions search and sessions list.
    searched = await asyncio.to_thread(
        cli, gateway.home, "sessions", "search", "pineapple", "--agent", "alpha", "--json"
    )
    assert searched.returncode == 0, searched.stderr
    assert {h["session_key"] for h in json.loads(searched.stdout)} == {"agent:alpha:http:dm:ca"}
    listed_cli = await asyncio.to_thread(
        cli, gateway.home, "sessions", "list", "--agent", "beta", "--json"
    )
    assert listed_cli.returncode == 0, listed_cli.stderr
    assert [(s["agent"], s["session_key"]) for s in json.loads(listed_cli.stdout)["sessions"]] == [
        ("beta", "agent:beta:http:dm:cb")
    ]
    bad = await asyncio.to_thread(cli, gateway.home, "sessions", "list", "--agent", "a/b")
    assert bad.returncode == 2 and "agent id" in bad.stderr


async def test_two_agents_in_one_chat_routed_by_user_never_see_each_other(
    gateway: Gateway,
) -> None:
    assert await gateway.say("shared", "ann's secret walrus", user="ann") == (
        "main: ann's secret walrus"
    )
    assert await gateway.say("shared", "bob asks about walrus", user="bob") == (
        "beta: bob asks about walrus"
    )
    assert await gateway.say("shared", "ann again", user="ann") == "main: ann again"
    ann_key, bob_key = "agent:main:http:dm:shared", "agent:beta:http:dm:shared"
    # Each agent was given only its own session's history.
    last_ann = requests_of(ann_key)[-1]
    assert [m["content"] for m in last_ann.history] == [
        "ann's secret walrus",
        "main: ann's secret walrus",
    ]
    (bob_asked,) = requests_of(bob_key)
    assert bob_asked.history == ()
    reply = await gateway.say("shared", "/search walrus", user="bob")
    assert "bob asks" in reply and "secret" not in reply
    reply = await gateway.say("shared", "/search secret", user="bob")
    assert reply.startswith("Nothing found")
    # /resume lists only the asking agent's earlier sessions of the chat, and switches
    # only to them.
    ann_entry = await gateway.runner.store.get_entry(ann_key)
    assert ann_entry is not None
    ann_first = ann_entry.session_id
    await gateway.say("shared", "/new", user="ann")
    reply = await gateway.say("shared", "/resume", user="bob")
    assert reply == "No earlier sessions to resume."
    reply = await gateway.say("shared", f"/resume {ann_first}", user="bob")
    assert reply.startswith(f"No earlier session {ann_first} in this chat")
    reply = await gateway.say("shared", "/resume", user="ann")
    assert "ann's secret walrus" in reply and ann_first in reply


async def test_each_agent_loads_its_context_by_its_own_plan(gateway: Gateway) -> None:
    for n in range(3):
        await gateway.say("cb", f"beta {n}")
        await gateway.say("ca", f"alpha {n}")
    beta = requests_of("agent:beta:http:dm:cb")[-1]
    alpha = requests_of("agent:alpha:http:dm:ca")[-1]
    assert [m["content"] for m in beta.history] == ["beta 1", "beta: beta 1"]
    assert len(alpha.history) == 4  # the default summary strategy: everything fits
    assert "needs the summary strategy" in await gateway.say("cb", "/compress")
    assert (await gateway.say("ca", "/compress")).startswith("Condensed 6 messages")


async def test_each_agent_has_its_own_turn_deadline(gateway: Gateway) -> None:
    # beta: gateway_timeout 0.5 s; main keeps the default 1800 s.
    reply = await gateway.say("cb", "hang on")
    assert reply.startswith("The agent did not answer within 0.5 seconds")
    assert await gateway.say("cc", "fine") == "main: fine"


async def test_the_status_file_and_start_up_name_every_agent(gateway: Gateway) -> None:
    snapshot = gateway.runner.status_snapshot()
    assert list(snapshot["agents"]) == ["main", "alpha", "beta"]
    assert snapshot["agents"]["beta"].startswith("custom factory tests.fakes.agents:named")


def test_a_yaml_merge_of_agent_shares_settings_explicitly(tmp_path: Path) -> None:
    config = load_config(
        write_config(
            tmp_path,
            """
agent: &main {backend: openai, model: m, api_key: k, max_concurrent_turns: 4}
agents:
  coder: {<<: *main, model: gpt-4o}
""",
        )
    )
    coder = config.agent_configs()["coder"]
    assert (coder.backend, coder.model, coder.api_key) == ("openai", "gpt-4o", "k")
    assert config.agent.max_concurrent_turns == 4


# --- a chat platform ---------------------------------------------------------------------


async def test_telegram_group_and_dm_routed_to_different_agents(tmp_path: Path) -> None:
    from adapters.telegram import TelegramAdapter
    from tests.fakes.telegram_api import FakeTelegram
    from tests.waiting import wait_for

    token = "123456:AAH-test-TOKEN_abcdefghijklmnopqrst"
    ada = FakeTelegram.user(42, "Ada", "ada")
    group = FakeTelegram.group_chat(-1001234567890, "Dev chat")
    async with FakeTelegram(token=token) as tg:
        config = GatewayConfig.model_validate(
            {
                "timezone": "UTC",
                "platforms": {
                    "telegram": {
                        "enabled": True,
                        "token": token,
                        "base_url": tg.base_url,
                        "poll_timeout": 1,
                        "allowed_users": ["42"],
                        "require_mention": False,
                    }
                },
                "agent": {"backend": NAMED, "options": {"name": "main"}},
                "agents": {"team": {"backend": NAMED, "options": {"name": "team"}}},
                "routes": [
                    {"match": {"platform": "telegram", "chat_type": "group"}, "agent": "team"}
                ],
            }
        )
        runner = GatewayRunner(config, [TelegramAdapter(config.platforms.telegram)], home=tmp_path)
        await runner.start()
        try:
            tg.push_message(tg.private_chat(ada), ada, "in private")
            await wait_for(lambda: len(tg.sent) == 1)
            tg.push_message(group, ada, "in the group")
            await wait_for(lambda: len(tg.sent) == 2)
            assert sorted(m["text"] for m in tg.sent_messages) == [
                "main: in private",
                "team: in the group",
            ]
            keys = {e.session_key for e in await runner.store.list_sessions()}
            assert keys == {
                "agent:main:telegram:dm:42",
                f"agent:team:telegram:group:{group['id']}:42",
            }
        finally:
            await runner.stop()
