"""The config package: where hermes.yaml is found, how it is validated, what errors say."""

from __future__ import annotations

import datetime as dt
import re
import textwrap
import traceback
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from config import (
    EXIT_CONFIG,
    ConfigError,
    GatewayConfig,
    SessionResetPolicy,
    hermes_home,
    load_config,
    resolve_timezone,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "hermes.yaml.example"


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Point HERMES_HOME at an empty directory and forget any cached host zone."""
    home = tmp_path / "hermes-home"
    home.mkdir()
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.delenv("HERMES_CONFIG", raising=False)
    resolve_timezone.cache_clear()
    yield home
    resolve_timezone.cache_clear()


def write_config(directory: Path, text: str, name: str = "hermes.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def config_error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as excinfo:
        load_config(write_config(tmp_path, text))
    return excinfo.value


def error_chain_text(error: BaseException) -> str:
    """What a traceback would print about the error and everything chained to it."""
    parts = []
    current: BaseException | None = error
    while current is not None:
        parts.extend(traceback.format_exception_only(current))
        current = current.__cause__ or current.__context__
    return "".join(parts)


def without_source(config: GatewayConfig) -> GatewayConfig:
    return config.model_copy(update={"source_path": None})


# --- which file ---------------------------------------------------------------------


def test_no_file_at_default_location_gives_zero_config_defaults() -> None:
    config = load_config()
    assert config == GatewayConfig()
    assert config.source_path is None
    assert config.agent.backend == "echo"
    assert config.session_reset == SessionResetPolicy(
        mode="both", at_hour=4, idle_minutes=1440, notify=True
    )


def test_hermes_home_defaults_to_dot_hermes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERMES_HOME")
    assert hermes_home() == Path.home() / ".hermes"


def test_hermes_home_yaml_is_found(isolated_env: Path) -> None:
    path = write_config(isolated_env, "queue:\n  max_depth: 5\n")
    config = load_config()
    assert config.queue.max_depth == 5
    assert config.source_path == path


def test_hermes_config_env_selects_the_file(
    tmp_path: Path, isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(isolated_env, "queue:\n  max_depth: 5\n")
    chosen = write_config(tmp_path, "queue:\n  max_depth: 7\n", name="other.yaml")
    monkeypatch.setenv("HERMES_CONFIG", str(chosen))
    assert load_config().queue.max_depth == 7


def test_path_argument_beats_hermes_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_CONFIG", str(write_config(tmp_path, "queue: {max_depth: 7}\n")))
    argument = write_config(tmp_path, "queue: {max_depth: 9}\n", name="arg.yaml")
    assert load_config(argument).queue.max_depth == 9


def test_explicit_missing_path_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(missing)


def test_missing_file_named_by_hermes_config_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_CONFIG", str(tmp_path / "gone.yaml"))
    with pytest.raises(ConfigError, match=r"config file not found: .*gone\.yaml"):
        load_config()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "# nothing set yet\n"))
    assert without_source(config) == GatewayConfig()


def test_loads_a_full_file(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        """
        timezone: Europe/Berlin
        group_sessions_per_user: false
        thread_sessions_per_user: true
        session_store_max_age_days: 30
        session_reset: {mode: idle, at_hour: 6, idle_minutes: 90, notify: false}
        reset_by_type:
          group: {mode: daily, at_hour: 3}
        agent:
          backend: my_pkg.agents:build
          gateway_timeout: 600
          max_concurrent_turns: 4
          options: {temperature: 0.2, tools: [search]}
        queue: {max_depth: 8}
        platforms:
          telegram: {enabled: true, token: "123:abc", home_channel: "-100"}
          http: {port: 9000, max_body_bytes: 2048}
        storage: {mirror_interval_seconds: 1, inbound_dedup_days: 2}
        """,
    )
    config = load_config(path)
    assert config.source_path == path
    assert config.timezone == "Europe/Berlin"
    assert (config.group_sessions_per_user, config.thread_sessions_per_user) == (False, True)
    assert config.session_store_max_age_days == 30
    assert config.session_reset == SessionResetPolicy(
        mode="idle", at_hour=6, idle_minutes=90, notify=False
    )
    assert config.reset_by_type.group == SessionResetPolicy(mode="daily", at_hour=3)
    assert config.reset_by_type.dm is None
    assert config.agent.backend == "my_pkg.agents:build"
    assert config.agent.gateway_timeout == 600.0
    assert isinstance(config.agent.gateway_timeout, float)  # an int is fine for a float
    assert config.agent.options == {"temperature": 0.2, "tools": ["search"]}
    assert config.queue.max_depth == 8
    assert config.platforms.telegram.token == "123:abc"
    assert config.platforms.http.port == 9000
    assert config.storage.mirror_interval_seconds == 1.0


def test_config_is_frozen() -> None:
    config = GatewayConfig()
    with pytest.raises(pydantic.ValidationError):
        config.queue.max_depth = 1  # type: ignore[misc]


def test_repr_hides_secrets() -> None:
    config = GatewayConfig.model_validate(
        {
            "agent": {"api_key": "sk-SECRET1"},
            "platforms": {
                "telegram": {"token": "SECRET2"},
                "slack": {"bot_token": "SECRET3", "app_token": "SECRET4", "signing_secret": "S5"},
                "http": {"token": "SECRET6"},
            },
        }
    )
    text = repr(config)
    for secret in ("SECRET1", "SECRET2", "SECRET3", "SECRET4", "S5", "SECRET6"):
        assert secret not in text


# --- ${ENV} expansion ---------------------------------------------------------------


def test_env_references_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_TOKEN", "123:from-env")
    monkeypatch.setenv("EMPTY_VAR", "")
    monkeypatch.delenv("UNSET_MODEL", raising=False)
    path = write_config(
        tmp_path,
        """
        agent:
          model: ${UNSET_MODEL:-llama3}
          base_url: ${EMPTY_VAR:-http://localhost:11434/v1}
          system_prompt: "token is ${TG_TOKEN}, cost $$5"
          options:
            headers: ["X-Token: ${TG_TOKEN}"]
        platforms:
          telegram:
            token: ${TG_TOKEN}
        """,
    )
    config = load_config(path)
    assert config.platforms.telegram.token == "123:from-env"
    assert config.agent.model == "llama3"
    assert config.agent.base_url == "http://localhost:11434/v1"  # ":-" also covers empty
    assert config.agent.system_prompt == "token is 123:from-env, cost $$5"
    assert config.agent.options == {"headers": ["X-Token: 123:from-env"]}


def test_unset_env_var_without_default_names_the_key_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TG_TOKEN", raising=False)
    error = config_error(tmp_path, "platforms:\n  telegram:\n    token: ${TG_TOKEN}\n")
    assert error.problems == ["platforms.telegram.token: environment variable TG_TOKEN is not set"]
    assert "hermes.yaml" in str(error)


def test_env_value_for_a_number_key_explains_why_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PORT", "9000")
    error = config_error(tmp_path, "platforms:\n  http:\n    port: ${HTTP_PORT}\n")
    [problem] = error.problems
    assert problem.startswith("platforms.http.port: Input should be a valid integer")
    assert "always gives text" in problem


# --- validation errors --------------------------------------------------------------


def test_error_message_starts_with_the_file_path(tmp_path: Path) -> None:
    error = config_error(tmp_path, "queue: {max_depth: 0}\n")
    assert str(error).startswith(str(tmp_path / "hermes.yaml"))
    assert "queue.max_depth: Input should be greater than or equal to 1" in str(error)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("colour: blue\n", "colour: unknown key"),
        ("session_reset:\n  foo: 1\n", "session_reset.foo: unknown key"),
        ("platforms:\n  telegram:\n    tokn: x\n", "platforms.telegram.tokn: unknown key"),
        ("platforms:\n  whatsapp: {}\n", "platforms.whatsapp: unknown key"),
        ("source_path: /etc/hermes.yaml\n", "source_path: unknown key"),
    ],
)
def test_unknown_keys_are_reported_by_dotted_path(tmp_path: Path, text: str, expected: str) -> None:
    assert config_error(tmp_path, text).problems == [expected]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'group_sessions_per_user: "yes"\n',
            "group_sessions_per_user: Input should be a valid boolean",
        ),
        ('queue:\n  max_depth: "4"\n', "queue.max_depth: Input should be a valid integer"),
        (
            "agent:\n  gateway_timeout: soon\n",
            "agent.gateway_timeout: Input should be a valid number",
        ),
        ("platforms: []\n", "platforms: Input should be a valid dictionary"),
    ],
)
def test_wrong_types_are_not_coerced(tmp_path: Path, text: str, expected: str) -> None:
    [problem] = config_error(tmp_path, text).problems
    assert problem.startswith(expected)


def test_bad_mode_lists_the_allowed_values(tmp_path: Path) -> None:
    [problem] = config_error(tmp_path, "session_reset:\n  mode: weekly\n").problems
    assert problem.startswith("session_reset.mode: ")
    for mode in ("none", "idle", "daily", "both"):
        assert f"'{mode}'" in problem


def test_at_hour_25_is_out_of_range(tmp_path: Path) -> None:
    assert config_error(tmp_path, "session_reset:\n  at_hour: 25\n").problems == [
        "session_reset.at_hour: Input should be less than or equal to 23"
    ]


def test_idle_minutes_zero_is_out_of_range(tmp_path: Path) -> None:
    text = "platforms:\n  discord:\n    session_reset: {idle_minutes: 0}\n"
    assert config_error(tmp_path, text).problems == [
        "platforms.discord.session_reset.idle_minutes: Input should be greater than or equal to 1"
    ]


def test_unknown_timezone(tmp_path: Path) -> None:
    assert config_error(tmp_path, "timezone: Mars/Base\n").problems == [
        "timezone: unknown IANA time zone 'Mars/Base'"
    ]


@pytest.mark.parametrize("backend", ["echo", "openai", "my_pkg.agents:build", "mod:Factory"])
def test_valid_backends(backend: str) -> None:
    assert GatewayConfig.model_validate({"agent": {"backend": backend}}).agent.backend == backend


@pytest.mark.parametrize("backend", ["anthropic", "my pkg:build", "pkg:", ":factory", "a:b.c"])
def test_invalid_backend_says_what_is_allowed(tmp_path: Path, backend: str) -> None:
    [problem] = config_error(tmp_path, f"agent:\n  backend: {backend!r}\n").problems
    assert problem.startswith("agent.backend: must be 'echo', 'openai' or 'module.path:factory'")


def test_a_single_problem_is_one_line_naming_file_and_key(tmp_path: Path) -> None:
    error = config_error(tmp_path, "queue: {max_depth: 0}\n")
    assert "\n" not in str(error)
    assert str(error) == (
        f"{tmp_path / 'hermes.yaml'}: queue.max_depth: Input should be greater than or equal to 1"
    )


@pytest.mark.parametrize(
    ("value", "env"),
    [("''", None), ("'  '", None), ("${HTTP_TOKEN:-}", None), ("${HTTP_TOKEN}", "")],
    ids=["empty", "blank", "unset-with-empty-default", "set-but-empty"],
)
def test_an_empty_http_token_is_an_error_not_no_auth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, env: str | None
) -> None:
    if env is None:
        monkeypatch.delenv("HTTP_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HTTP_TOKEN", env)
    [problem] = config_error(tmp_path, f"platforms:\n  http:\n    token: {value}\n").problems
    assert problem.startswith("platforms.http.token: is empty")
    assert "remove the key" in problem


def test_an_absent_http_token_still_means_no_auth(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, "platforms:\n  http:\n    enabled: true\n"))
    assert config.platforms.http.token is None


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    error = config_error(
        tmp_path,
        """
        session_reset: {at_hour: 25, idle_minutes: 0}
        queue: {max_depth: 0, extra: 1}
        """,
    )
    assert len(error.problems) == 4
    assert str(error).count("\n") == 4  # header line plus one line per problem


def test_a_secret_never_reaches_the_error_text(tmp_path: Path) -> None:
    secret = "123456:AAH-very-secret-token"
    with pytest.raises(ConfigError) as excinfo:
        load_config(
            write_config(
                tmp_path,
                f"""
                session_reset: {{at_hour: 99}}
                agent: {{api_key: 7130592846}}
                platforms:
                  telegram:
                    token: "{secret}"
                    tokne: "{secret}"
                  slack:
                    bot_token: ["{secret}"]
                """,
            )
        )
    # The file's path is in the header and may hold any digits (pytest-442/...), so
    # only what the loader itself wrote is searched for the values.
    rendered = error_chain_text(excinfo.value).replace(str(tmp_path), "<dir>")
    assert "platforms.telegram.tokne: unknown key" in rendered
    assert "platforms.slack.bot_token" in rendered
    assert "agent.api_key" in rendered
    assert secret not in rendered
    assert "7130592846" not in rendered


def test_a_secret_on_a_yaml_syntax_error_line_is_not_quoted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as excinfo:
        load_config(write_config(tmp_path, 'platforms:\n  telegram:\n    token: "s3cr3t\n'))
    rendered = error_chain_text(excinfo.value)
    assert "YAML syntax error" in rendered
    assert "s3cr3t" not in rendered


# --- malformed files ----------------------------------------------------------------


def test_yaml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    error = config_error(tmp_path, "queue:\n  max_depth: 3\n  - oops\n")
    assert re.match(r".*hermes\.yaml: YAML syntax error at line 3, column 3: ", str(error))


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    error = config_error(tmp_path, "- just\n- a list\n")
    assert "hermes.yaml" in str(error)
    assert "top level must be a mapping" in str(error)


def test_config_error_and_exit_code() -> None:
    error = ConfigError("bad", ["a.b: c"])
    assert str(error) == "bad"
    assert error.problems == ["a.b: c"]
    assert ConfigError("alone").problems == ["alone"]
    assert EXIT_CONFIG == 78


# --- reset policy precedence --------------------------------------------------------

GLOBAL = SessionResetPolicy(mode="both")
BY_TYPE = SessionResetPolicy(mode="idle", idle_minutes=60)
BY_PLATFORM = SessionResetPolicy(mode="daily", at_hour=2)


class FakePlatform(StrEnum):
    TELEGRAM = "telegram"
    WHATSAPP = "whatsapp"


@pytest.fixture
def layered() -> GatewayConfig:
    """Global policy, a group override and a Telegram override."""
    return GatewayConfig.model_validate(
        {
            "session_reset": GLOBAL.model_dump(),
            "reset_by_type": {"group": BY_TYPE.model_dump()},
            "platforms": {"telegram": {"session_reset": BY_PLATFORM.model_dump()}},
        }
    )


@pytest.mark.parametrize(
    ("platform", "chat_type", "expected"),
    [
        ("telegram", "group", BY_PLATFORM),  # platform beats type
        ("telegram", "dm", BY_PLATFORM),
        ("discord", "group", BY_TYPE),  # type beats global
        ("discord", "dm", GLOBAL),
        ("whatsapp", "group", BY_TYPE),  # no platforms.whatsapp: falls through
        ("whatsapp", "dm", GLOBAL),
        ("discord", "voice", GLOBAL),  # unknown chat type: falls through
        (FakePlatform.TELEGRAM, "dm", BY_PLATFORM),  # str enums are accepted
        (FakePlatform.WHATSAPP, "group", BY_TYPE),
    ],
)
def test_reset_policy_precedence(
    layered: GatewayConfig, platform: str, chat_type: str, expected: SessionResetPolicy
) -> None:
    assert layered.get_reset_policy(platform, chat_type) == expected


def test_reset_policy_defaults_to_global() -> None:
    assert GatewayConfig().get_reset_policy("telegram", "group") == SessionResetPolicy()


# --- time zones ---------------------------------------------------------------------


def test_resolve_timezone_by_name() -> None:
    zone = resolve_timezone("America/New_York")
    winter = dt.datetime(2024, 1, 15, 12, tzinfo=zone).utcoffset()
    summer = dt.datetime(2024, 7, 15, 12, tzinfo=zone).utcoffset()
    assert (winter, summer) == (dt.timedelta(hours=-5), dt.timedelta(hours=-4))


@pytest.mark.parametrize(
    "tz_value", ["Asia/Kolkata", ":Asia/Kolkata", "/usr/share/zoneinfo/Asia/Kolkata"]
)
def test_host_zone_comes_from_tz_env(monkeypatch: pytest.MonkeyPatch, tz_value: str) -> None:
    monkeypatch.setenv("TZ", tz_value)
    resolve_timezone.cache_clear()
    assert getattr(resolve_timezone(None), "key", None) == "Asia/Kolkata"
    assert GatewayConfig().tzinfo() is resolve_timezone(None)


def test_unusable_tz_env_still_gives_a_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Not/AZone")
    resolve_timezone.cache_clear()
    zone = resolve_timezone(None)
    assert getattr(zone, "key", None) != "Not/AZone"
    assert dt.datetime(2024, 1, 1, tzinfo=zone).utcoffset() is not None


def test_configured_timezone_is_used() -> None:
    config = GatewayConfig.model_validate({"timezone": "Europe/Berlin"})
    assert getattr(config.tzinfo(), "key", None) == "Europe/Berlin"


# --- platforms ----------------------------------------------------------------------


def test_connected_platforms_and_home_channels() -> None:
    config = GatewayConfig.model_validate(
        {
            "platforms": {
                "http": {"enabled": True, "home_channel": "local"},
                "slack": {"enabled": False, "home_channel": "C0123"},
                "telegram": {"enabled": True},
            }
        }
    )
    assert config.connected_platforms() == ["telegram", "http"]  # schema order
    assert config.home_channels() == {"slack": "C0123", "http": "local"}
    assert GatewayConfig().connected_platforms() == []
    assert GatewayConfig().home_channels() == {}


# --- hermes.yaml.example ------------------------------------------------------------

# A commented-out setting is "# " followed by a YAML key line; prose never starts so.
_COMMENTED_SETTING = re.compile(r"^(\s*)# (\s*[a-z_]+:.*)$", re.MULTILINE)


def example_with_optional_settings_enabled() -> str:
    return _COMMENTED_SETTING.sub(r"\1\2", EXAMPLE.read_text(encoding="utf-8"))


def schema_key_paths(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[str]:
    """Dotted path of every field; optional sub-models (``X | None``) are not descended."""
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        yield prefix + name
        if isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel):
            yield from schema_key_paths(field.annotation, f"{prefix}{name}.")


def yaml_key_paths(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from yaml_key_paths(value, f"{prefix}{key}.")


def test_example_loads_and_equals_the_defaults() -> None:
    assert without_source(load_config(EXAMPLE)) == GatewayConfig()


def test_example_optional_settings_are_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = example_with_optional_settings_enabled()
    for name in re.findall(r"\$\{(\w+)", text):
        monkeypatch.setenv(name, "from-env")
    config = load_config(write_config(tmp_path, text))
    assert config.platforms.telegram.token == "from-env"
    assert config.reset_by_type.group is not None
    assert config.platforms.slack.session_reset is not None


def test_example_shows_every_field() -> None:
    shown = set(yaml_key_paths(yaml.safe_load(example_with_optional_settings_enabled())))
    missing = set(schema_key_paths(GatewayConfig)) - shown
    assert not missing, f"hermes.yaml.example does not show: {sorted(missing)}"


# --- storage backend ------------------------------------------------------------------


def test_storage_defaults_to_sqlite_without_a_dsn() -> None:
    assert GatewayConfig().storage.backend == "sqlite"
    assert GatewayConfig().storage.dsn is None


def test_postgres_without_a_dsn_names_storage_dsn(tmp_path: Path) -> None:
    error = config_error(tmp_path, "storage:\n  backend: postgres\n")
    assert error.problems == [
        "storage.dsn: is required when storage.backend is postgres"
        " (postgresql://USER:${HERMES_PG_PASSWORD}@HOST:PORT/DB)"
    ]


def test_postgres_dsn_expands_its_password_and_hides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERMES_PG_PASSWORD", "pg-SECRET7")
    path = write_config(
        tmp_path,
        """
        storage:
          backend: postgres
          dsn: postgresql://hermes:${HERMES_PG_PASSWORD}@db:5432/hermes
        """,
    )
    config = load_config(path)
    assert config.storage.dsn == "postgresql://hermes:pg-SECRET7@db:5432/hermes"
    assert "pg-SECRET7" not in repr(config)


def test_an_unknown_storage_backend_is_refused(tmp_path: Path) -> None:
    error = config_error(tmp_path, "storage:\n  backend: mysql\n")
    assert error.problems == ["storage.backend: Input should be 'sqlite' or 'postgres'"]


# --- memory.auto_recall ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "21", "three"])
def test_auto_recall_out_of_range_names_its_key(tmp_path: Path, value: str) -> None:
    error = str(config_error(tmp_path, f"memory:\n  auto_recall: {value}\n"))
    assert "memory.auto_recall: " in error and "unknown key" not in error
