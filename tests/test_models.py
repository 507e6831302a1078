"""The model catalogue and `/model` per chat: the resolver, the config's checks (key paths,
exit 78), and the whole gateway over the HTTP API with two fake OpenAI-compatible servers
as two catalogue models, on SQLite and PostgreSQL: `/model smart` sends the next turn to
the second server (its model name and key), a model not offered is refused with the
list, `/new` keeps the choice, a restart keeps it, `/model default` returns to the
agent's own, and the context plan follows the chosen model's window. Last, the real
daemon (a subprocess) keeps a choice across kill -9 and never logs a catalogue key."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from config import (
    ConfigError,
    GatewayConfig,
    effective_agent,
    load_config,
    model_choices,
    resolve_model,
)
from scripts.harness import Daemon
from tests.commandline import cli
from tests.fakes.openai_server import FakeOpenAI, last_user_content, serve_in_a_thread
from tests.gateway_client import RunningGateway
from tests.pg_support import StorageBackend

pytestmark = pytest.mark.timeout(90)

FAST_KEY, SMART_KEY = "sk-fast-0123", "sk-smart-4567"
KEY = "agent:main:http:dm:c1"  # the session key of chat c1's DM with user u1


def catalogue(fast_url: str = "http://127.0.0.1:9/v1", smart_url: str = "http://127.0.0.1:8/v1"):
    return {
        "fast": {
            "base_url": fast_url,
            "model": "fast-model",
            "api_key": FAST_KEY,
            "context_window": 32768,
        },
        "smart": {
            "base_url": smart_url,
            "model": "smart-model",
            "api_key": SMART_KEY,
            "context_window": 65536,
            "price": {"input_per_mtok": 1.25, "output_per_mtok": 10},
        },
        "other": {"base_url": smart_url, "model": "other-model"},
    }


def config_of(**agent: Any) -> GatewayConfig:
    return GatewayConfig.model_validate(
        {"models": catalogue(), "agent": {"backend": "openai", **agent}}
    )


# --- the resolver ---------------------------------------------------------------------------


def test_the_agents_own_catalogue_model_and_a_chosen_one_resolve_with_window_and_price() -> None:
    config = config_of(model="fast", models=["fast", "smart"])
    assert model_choices(config, "main") == ("fast", "smart")
    own = resolve_model(config, "main", None)
    assert (own.name, own.model, own.api_key, own.context_window) == (
        "fast",
        "fast-model",
        FAST_KEY,
        32768,
    )
    assert own.price.input_per_mtok == 0
    smart = resolve_model(config, "main", "smart")
    assert (smart.base_url, smart.model, smart.context_window) == (
        "http://127.0.0.1:8/v1",
        "smart-model",
        65536,
    )
    assert (smart.price.input_per_mtok, smart.price.output_per_mtok) == (1.25, 10)
    assert SMART_KEY not in repr(smart)
    # A name the agent does not offer (the config changed since it was chosen): its own.
    assert resolve_model(config, "main", "other").name == "fast"
    # The agent's section with the model in place: what the backend and the plan read.
    agent = effective_agent(config.agent, smart)
    assert (agent.model, agent.context.window_tokens, agent.api_key) == (
        "smart-model",
        65536,
        SMART_KEY,
    )


def test_a_plain_model_name_keeps_todays_meaning_and_offers_no_choice() -> None:
    config = GatewayConfig.model_validate(
        {
            "models": catalogue(),
            "agent": {
                "backend": "openai",
                "model": "gpt-4o-mini",
                "base_url": "http://127.0.0.1:7/v1",
                "context": {"window_tokens": 9000},
            },
        }
    )
    assert model_choices(config, "main") == ()
    own = resolve_model(config, "main", "smart")  # not offered: the agent's own
    assert (own.name, own.model, own.base_url, own.context_window) == (
        None,
        "gpt-4o-mini",
        "http://127.0.0.1:7/v1",
        9000,
    )
    # A catalogue entry without context_window takes the agent's window.
    other = resolve_model(config_of(model="other", context={"window_tokens": 12000}), "main", None)
    assert other.context_window == 12000


def test_a_plain_agent_may_offer_catalogue_models() -> None:
    config = config_of(model="gpt-4o-mini", models=["smart"])
    assert model_choices(config, "main") == ("smart",)
    assert resolve_model(config, "main", None).name is None
    assert resolve_model(config, "main", "smart").model == "smart-model"


# --- config errors ----------------------------------------------------------------------------


def problems_of(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hermes.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


CATALOGUE_YAML = """models:
  fast: {base_url: "http://127.0.0.1:9/v1", model: q, api_key: "${FAST_KEY}"}
  smart: {base_url: "http://127.0.0.1:8/v1", model: g}
"""


def test_unknown_names_in_models_lists_name_their_key_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAST_KEY", FAST_KEY)
    text = problems_of(
        tmp_path,
        CATALOGUE_YAML + "agent: {backend: openai, model: fast, models: [fast, smartt]}\n"
        "agents:\n  coder: {backend: openai, models: [nope]}\n",
    )
    assert "agent.models.1: unknown model 'smartt' (models: fast, smart)" in text
    assert "agents.coder.models.0: unknown model 'nope'" in text
    assert FAST_KEY not in text


def test_a_catalogue_model_needs_the_openai_backend(tmp_path: Path) -> None:
    text = problems_of(
        tmp_path,
        CATALOGUE_YAML.replace('"${FAST_KEY}"', "x")
        + "agent: {backend: echo, model: fast}\n"
        + "agents:\n  coder: {backend: echo, models: [smart]}\n",
    )
    assert "agent.model: 'fast' is an entry of models:" in text
    assert "agents.coder.models: catalogue models need backend: openai" in text


def test_a_reserved_or_bad_catalogue_name_is_refused(tmp_path: Path) -> None:
    text = problems_of(
        tmp_path,
        "models:\n  default: {base_url: u, model: m}\n  'has space': {base_url: u, model: m}\n",
    )
    assert "models.default: a reserved name" in text
    assert "models.has space: not a valid model name" in text


def test_check_config_exits_78_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text(
        CATALOGUE_YAML.replace('"${FAST_KEY}"', f"{FAST_KEY}")
        + "agent: {backend: openai, models: [fast, huge]}\n"
    )
    result = cli(tmp_path, "check-config")
    assert result.returncode == 78, result.stdout + result.stderr
    assert "agent.models.1: unknown model 'huge'" in result.stderr
    assert FAST_KEY not in result.stdout + result.stderr


def test_a_pickable_model_whose_window_leaves_no_room_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text(
        CATALOGUE_YAML.replace('"${FAST_KEY}"', "x").replace(
            "model: g}", "model: g, context_window: 1024}"
        )
        + "agent: {backend: openai, model: fast, models: [fast, smart]}\n"
    )
    result = cli(tmp_path, "check-config")
    assert result.returncode == 78, result.stdout + result.stderr
    assert "models.smart.context_window: 1024 leaves no room for a message" in result.stderr


# --- the whole gateway over the HTTP API ------------------------------------------------------


@pytest.fixture
async def servers() -> AsyncIterator[tuple[FakeOpenAI, FakeOpenAI]]:
    async with (
        FakeOpenAI(expected_key=FAST_KEY, reply=answering("fast")) as fast,
        FakeOpenAI(expected_key=SMART_KEY, reply=answering("smart")) as smart,
    ):
        yield fast, smart


def answering(name: str) -> Any:
    """A reply that names its server and quotes the question."""
    return lambda body: f"{name}: {last_user_content(body)}"


def turn_models(server: FakeOpenAI, text: str) -> list[str]:
    """The model names of the requests that asked `text` (not titles or summaries)."""
    return [
        r["json"]["model"]
        for r in server.requests
        if isinstance(r["json"], dict) and last_user_content(r["json"]) == text
    ]


async def test_model_switches_a_chat_keeps_it_across_new_and_restart_and_refuses_others(
    tmp_path: Path, servers: tuple[FakeOpenAI, FakeOpenAI], store_backend: StorageBackend
) -> None:
    fast, smart = servers
    settings = {
        "timezone": "UTC",
        "storage": store_backend.storage(),
        "models": catalogue(fast.base_url, smart.base_url),
        "agent": {"backend": "openai", "model": "fast", "models": ["fast", "smart"]},
    }
    home = tmp_path / "home"
    gw = await RunningGateway.started(settings, home)
    try:
        listing = await gw.say("/model")
        assert "* fast" in listing and "  smart" in listing, listing
        assert await gw.say("one") == "fast: one"
        assert turn_models(fast, "one") == ["fast-model"] and turn_models(smart, "one") == []
        assert gw.runner.roster.for_key(KEY).plan.window_tokens == 32768

        switched = await gw.say("/model smart")
        assert "smart" in switched and "65,536" in switched, switched
        assert await gw.say("two") == "smart: two"  # the second server, with its key
        assert turn_models(smart, "two") == ["smart-model"] and turn_models(fast, "two") == []
        assert gw.runner.roster.for_key(KEY).plan.window_tokens == 65536
        assert "* smart" in await gw.say("/model")
        assert "Model: smart (smart-model)" in await gw.say("/status")

        refused = await gw.say("/model other")  # in the catalogue, not offered here
        assert "No model 'other'" in refused and "* smart" in refused, refused
        assert "smart" in (await gw.say("/model nonsense"))

        assert "new session" in await gw.say("/new")
        assert await gw.say("three") == "smart: three"  # /new keeps the chat's choice
        # Another chat is not affected.
        assert await gw.say("four", chat="c2") == "fast: four"
    finally:
        await gw.stop()

    gw = await RunningGateway.started(settings, home)  # a restart on the same store
    try:
        await gw.client.poll("c1")  # past the first run's replies
        assert await gw.say("five") == "smart: five"
        assert turn_models(smart, "five") == ["smart-model"]
        back = await gw.say("/model default")
        assert "own model: fast" in back, back
        assert await gw.say("six") == "fast: six"
        assert gw.runner.roster.for_key(KEY).plan.window_tokens == 32768
        rows = await gw.runner.store.read(
            lambda conn: conn.execute("SELECT count(*) FROM chat_models").fetchone()[0]
        )
        assert rows == 0  # default is no row
    finally:
        await gw.stop()


async def test_a_stored_choice_the_config_no_longer_offers_is_the_agents_own(
    tmp_path: Path, servers: tuple[FakeOpenAI, FakeOpenAI]
) -> None:
    fast, smart = servers
    settings: dict[str, Any] = {
        "timezone": "UTC",
        "models": catalogue(fast.base_url, smart.base_url),
        "agent": {"backend": "openai", "model": "fast", "models": ["fast", "smart"]},
    }
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        assert "smart" in await gw.say("/model smart")
    finally:
        await gw.stop()
    settings["agent"] = {"backend": "openai", "model": "fast", "models": ["fast"]}
    gw = await RunningGateway.started(settings, tmp_path / "home")
    try:
        await gw.client.poll("c1")  # past the first run's replies
        assert await gw.say("seven") == "fast: seven"
        assert "* fast" in await gw.say("/model")
    finally:
        await gw.stop()


# --- the real daemon --------------------------------------------------------------------------


@pytest.fixture
def model_servers() -> Iterator[tuple[FakeOpenAI, FakeOpenAI]]:
    with (
        serve_in_a_thread(expected_key=FAST_KEY, reply=answering("fast")) as (fast, _),
        serve_in_a_thread(expected_key=SMART_KEY, reply=answering("smart")) as (smart, _),
    ):
        yield fast, smart


def test_the_daemon_keeps_a_chats_model_across_kill9_and_logs_no_key(
    tmp_path: Path, model_servers: tuple[FakeOpenAI, FakeOpenAI]
) -> None:
    fast, smart = model_servers
    settings = (
        "timezone: UTC\n"
        "models:\n"
        f"  fast: {{base_url: '{fast.base_url}', model: fast-model, api_key: '${{FAST_KEY}}'}}\n"
        f"  smart: {{base_url: '{smart.base_url}', model: smart-model,"
        " api_key: '${SMART_KEY}', context_window: 65536}\n"
        "agent: {backend: openai, model: fast, models: [fast, smart]}\n"
    )
    daemon = Daemon(tmp_path / "home", settings, env={"FAST_KEY": FAST_KEY, "SMART_KEY": SMART_KEY})
    try:
        daemon.start()
        daemon.post("d1", "/model smart")
        daemon.post("d1", "hello")
        texts = [m["text"] for m in daemon.wait_replies("d1", 2)]
        assert texts[-1] == "smart: hello", texts
        daemon.kill9()
        daemon.start()
        daemon.post("d1", "again")
        texts = [m["text"] for m in daemon.wait_replies("d1", 3)]
        assert texts[-1] == "smart: again", texts
        assert turn_models(smart, "again") == ["smart-model"]
        assert turn_models(fast, "again") == []
        assert daemon.stop() == 0
    finally:
        daemon.ensure_stopped()
    log = daemon.log_path.read_text(errors="replace")
    assert FAST_KEY not in log and SMART_KEY not in log
