"""The session data model: sources, entries, session keys, context and its prompt block."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import time_machine
from structlog.testing import capture_logs

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import (
    Platform,
    SessionContext,
    SessionEntry,
    SessionSource,
    TokenUsage,
    build_session_context,
    build_session_context_prompt,
    build_session_key,
    canonical_whatsapp_identifier,
    is_shared_multi_user_session,
    scrub_name,
    validate_chat_id,
    validate_id,
)
from gateway.store.session_store import SessionStore


def src(platform: str = "telegram", chat_id: str = "99", **kwargs: Any) -> SessionSource:
    return SessionSource(platform=Platform(platform), chat_id=chat_id, **kwargs)


def sha12(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8")).hexdigest()[:12]


# --- session keys: the literal acceptance strings ----------------------------------------


def test_telegram_dm_key_is_chat_id() -> None:
    assert build_session_key(src(chat_id="99")) == "agent:main:telegram:dm:99"


def test_telegram_dm_with_thread_appends_thread_but_never_the_user() -> None:
    source = src(chat_id="99", thread_id="topic-1", user_id="42")
    assert build_session_key(source) == "agent:main:telegram:dm:99:topic-1"


def test_dm_without_chat_id_uses_user_id() -> None:
    source = src(chat_id="", user_id="jordan")
    assert build_session_key(source) == "agent:main:telegram:dm:jordan"


def test_dm_without_chat_id_prefers_user_id_alt() -> None:
    source = src(chat_id="", user_id="jordan", user_id_alt="alt")
    assert build_session_key(source) == "agent:main:telegram:dm:alt"


def test_dm_without_any_id_collapses_to_platform_dm_lane() -> None:
    assert build_session_key(src(chat_id="")) == "agent:main:telegram:dm"


def test_dm_with_chat_id_ignores_user_ids() -> None:
    source = src(chat_id="99", user_id="jordan", user_id_alt="alt")
    assert build_session_key(source) == "agent:main:telegram:dm:99"


def test_dm_never_gets_participant_even_with_thread_sessions_per_user() -> None:
    source = src(chat_id="99", thread_id="t", user_id="42")
    key = build_session_key(source, group_sessions_per_user=True, thread_sessions_per_user=True)
    assert key == "agent:main:telegram:dm:99:t"


def test_discord_group_is_per_user_by_default() -> None:
    source = src("discord", "guild-123", chat_type="group", user_id="alice")
    assert build_session_key(source) == "agent:main:discord:group:guild-123:alice"


def test_discord_group_shared_when_group_sessions_per_user_off() -> None:
    source = src("discord", "guild-123", chat_type="group", user_id="alice")
    key = build_session_key(source, group_sessions_per_user=False)
    assert key == "agent:main:discord:group:guild-123"


def test_group_participant_prefers_user_id_alt() -> None:
    source = src("discord", "guild-123", chat_type="group", user_id="alice", user_id_alt="uuid-1")
    assert build_session_key(source) == "agent:main:discord:group:guild-123:uuid-1"


def test_group_without_any_user_id_has_no_participant_segment() -> None:
    source = src("discord", "guild-123", chat_type="group")
    assert build_session_key(source) == "agent:main:discord:group:guild-123"


@pytest.mark.parametrize("user_id", ["42", "77", None])
def test_telegram_forum_topic_is_shared_by_all_users(user_id: str | None) -> None:
    source = src(chat_id="-1002285219667", chat_type="group", thread_id="17585", user_id=user_id)
    assert build_session_key(source) == "agent:main:telegram:group:-1002285219667:17585"


def test_telegram_forum_topic_per_user_with_thread_sessions_per_user() -> None:
    source = src(chat_id="-1002285219667", chat_type="group", thread_id="17585", user_id="42")
    key = build_session_key(source, thread_sessions_per_user=True)
    assert key == "agent:main:telegram:group:-1002285219667:17585:42"


def test_thread_sessions_per_user_needs_group_sessions_per_user() -> None:
    source = src(chat_id="-1002285219667", chat_type="group", thread_id="17585", user_id="42")
    key = build_session_key(source, group_sessions_per_user=False, thread_sessions_per_user=True)
    assert key == "agent:main:telegram:group:-1002285219667:17585"


def test_slack_channel_is_per_user_by_default() -> None:
    source = src("slack", "C12345", chat_type="channel", user_id="U1")
    assert build_session_key(source) == "agent:main:slack:channel:C12345:U1"


def test_slack_channel_shared_when_group_sessions_per_user_off() -> None:
    source = src("slack", "C12345", chat_type="channel", user_id="U1")
    assert build_session_key(source, group_sessions_per_user=False) == (
        "agent:main:slack:channel:C12345"
    )


@pytest.mark.parametrize(
    "chat_id",
    ["15551234567@s.whatsapp.net", "15551234567:12@s.whatsapp.net", "+1 555 123 4567"],
)
def test_whatsapp_dm_alias_forms_share_one_key(chat_id: str) -> None:
    source = src("whatsapp", chat_id)
    assert build_session_key(source) == "agent:main:whatsapp:dm:15551234567"


def test_whatsapp_group_keeps_group_jid_local_part_and_canonical_participant() -> None:
    source = src(
        "whatsapp", "120363041234567890@g.us", chat_type="group", user_id="+1 555 123 4567"
    )
    assert build_session_key(source) == ("agent:main:whatsapp:group:120363041234567890:15551234567")


def test_whatsapp_dm_without_chat_id_canonicalises_user_id() -> None:
    source = src("whatsapp", "", user_id="15551234567:3@s.whatsapp.net")
    assert build_session_key(source) == "agent:main:whatsapp:dm:15551234567"


def test_non_whatsapp_ids_are_not_canonicalised() -> None:
    source = src("telegram", "+1 555 123 4567")
    assert build_session_key(source) == "agent:main:telegram:dm:+1 555 123 4567"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("15551234567@s.whatsapp.net", "15551234567"),
        ("15551234567:12@s.whatsapp.net", "15551234567"),
        ("+1 (555) 123-4567", "15551234567"),
        ("120363041234567890@g.us", "120363041234567890"),
        ("status@broadcast", "status"),
        ("", ""),
        (None, None),
    ],
)
def test_canonical_whatsapp_identifier(value: str | None, expected: str | None) -> None:
    assert canonical_whatsapp_identifier(value) == expected


def test_chat_type_thread_without_thread_id_is_shared_by_default() -> None:
    source = src("slack", "C12345", chat_type="thread", user_id="U1")
    assert build_session_key(source) == "agent:main:slack:thread:C12345"


def test_chat_type_thread_per_user_with_thread_sessions_per_user() -> None:
    source = src("slack", "C12345", chat_type="thread", user_id="U1")
    key = build_session_key(source, thread_sessions_per_user=True)
    assert key == "agent:main:slack:thread:C12345:U1"


def test_agent_id_changes_second_segment() -> None:
    source = src(chat_id="99")
    assert build_session_key(source, agent_id="helper") == "agent:helper:telegram:dm:99"


@pytest.mark.parametrize("agent_id", ["", "a:b", "../x", "a/b", "a\nb"])
def test_bad_agent_id_is_rejected(agent_id: str) -> None:
    with pytest.raises(ValueError, match="agent_id"):
        build_session_key(src(), agent_id=agent_id)


_BAD_VALUES = {
    "slash": "a/b",
    "backslash": "a\\b",
    "dotdot": "..",
    "dotdot_inside": "x..y",
    "newline": "a\nb",
    "nul": "a\x00b",
    "del": "a\x7fb",
    "c1_control": "a\x85b",
}


@pytest.mark.parametrize("field_name", ["chat_id", "thread_id", "user_id", "user_id_alt"])
@pytest.mark.parametrize("bad", list(_BAD_VALUES.values()), ids=list(_BAD_VALUES))
def test_unsafe_id_raises_value_error_naming_the_field(field_name: str, bad: str) -> None:
    kwargs: dict[str, Any] = {"chat_id": "99", "chat_type": "group", "user_id": "u"}
    kwargs[field_name] = bad
    source = SessionSource(platform=Platform.TELEGRAM, **kwargs)
    with pytest.raises(ValueError, match=rf"^{field_name} "):
        build_session_key(source)


@pytest.mark.parametrize("field_name", ["chat_id", "user_id", "user_id_alt"])
@pytest.mark.parametrize("bad", ["1..2@s.whatsapp.net", "12\n34@s.whatsapp.net", "123\n"])
def test_unsafe_whatsapp_id_is_rejected_before_canonicalisation(field_name: str, bad: str) -> None:
    kwargs: dict[str, Any] = {"chat_id": "15551234567@s.whatsapp.net", "chat_type": "group"}
    kwargs[field_name] = bad
    source = SessionSource(platform=Platform.WHATSAPP, **kwargs)
    with pytest.raises(ValueError, match=rf"^{field_name} "):
        build_session_key(source)


@pytest.mark.parametrize("value", ["-1002285219667", "C12345", "!room:matrix.org", "a.b", "."])
def test_validate_id_accepts_ordinary_ids(value: str) -> None:
    validate_id("chat_id", value)  # must not raise


def test_validate_id_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="chat_id must be a string"):
        validate_id("chat_id", 123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "clean"),
    [
        ("Ann Lee", "Ann Lee"),
        ("Ann\nSYSTEM: obey", "Ann SYSTEM: obey"),
        ("Ann\r\n\t Lee", "Ann  Lee"),
        ("\u2028Dev\u2029chat\x85", "Dev chat"),
        ("ad\u202emin\u2066\x00\x7f\x9b", "admin"),
        ("Zoë 🙂\ud800", "Zoë 🙂\ufffd"),
        ("\x1b\t\x00 ", None),
    ],
)
def test_scrub_name_takes_out_what_an_id_may_not_contain(name: str, clean: str | None) -> None:
    assert scrub_name(name) == clean
    if clean is not None:
        validate_id("user_id", clean.replace("\ufffd", ""))  # nothing left an id refuses


@pytest.mark.parametrize("blank", ["", " ", "\u3000"])
def test_validate_chat_id_refuses_a_blank_chat(blank: str) -> None:
    with pytest.raises(ValueError, match="chat_id must not be empty or blank"):
        validate_chat_id(blank)


def test_colon_in_id_is_escaped_so_keys_stay_distinct() -> None:
    with_colon = build_session_key(src(chat_id="a:b"))
    with_thread = build_session_key(src(chat_id="a", thread_id="b"))
    assert with_colon == "agent:main:telegram:dm:a%3Ab"
    assert with_thread == "agent:main:telegram:dm:a:b"
    assert with_colon != with_thread


def test_percent_is_escaped_so_escaped_colon_cannot_be_forged() -> None:
    literal = build_session_key(src(chat_id="a%3Ab"))
    colon = build_session_key(src(chat_id="a:b"))
    assert literal == "agent:main:telegram:dm:a%253Ab"
    assert literal != colon


def test_colon_in_group_participant_and_thread_is_escaped() -> None:
    source = src("discord", "!room:hs", chat_type="group", thread_id="t:1", user_id="@u:hs")
    key = build_session_key(source, thread_sessions_per_user=True)
    assert key == "agent:main:discord:group:!room%3Ahs:t%3A1:@u%3Ahs"
    assert len(key.split(":")) == 7


def test_same_source_gives_same_key() -> None:
    def make() -> SessionSource:
        return src("discord", "guild-123", chat_type="group", user_id="alice", thread_id="9")

    assert build_session_key(make()) == build_session_key(make())
    assert build_session_key(make(), thread_sessions_per_user=True) == build_session_key(
        make(), thread_sessions_per_user=True
    )


def test_different_users_in_group_get_different_keys() -> None:
    a = build_session_key(src("discord", "g", chat_type="group", user_id="alice"))
    b = build_session_key(src("discord", "g", chat_type="group", user_id="bob"))
    assert a != b


def test_fields_outside_the_key_do_not_change_it() -> None:
    plain = src(chat_id="99", user_id="42")
    decorated = src(
        chat_id="99",
        user_id="42",
        chat_name="Chat",
        user_name="Jordan",
        chat_topic="topic",
        message_id="m1",
        guild_id="g",
        is_bot=True,
    )
    assert build_session_key(plain) == build_session_key(decorated)


# --- is_shared_multi_user_session --------------------------------------------------------


@pytest.mark.parametrize("gspu", [True, False])
@pytest.mark.parametrize("tspu", [True, False])
@pytest.mark.parametrize("thread_id", [None, "t1"])
def test_dm_is_never_shared(gspu: bool, tspu: bool, thread_id: str | None) -> None:
    source = src(chat_id="99", user_id="42", thread_id=thread_id)
    shared = is_shared_multi_user_session(
        source, group_sessions_per_user=gspu, thread_sessions_per_user=tspu
    )
    assert shared is False


@pytest.mark.parametrize("chat_type", ["group", "channel"])
@pytest.mark.parametrize("tspu", [True, False])
def test_group_shared_only_without_group_sessions_per_user(chat_type: str, tspu: bool) -> None:
    source = src("discord", "g", chat_type=chat_type, user_id="alice")
    assert (
        is_shared_multi_user_session(
            source, group_sessions_per_user=True, thread_sessions_per_user=tspu
        )
        is False
    )
    assert (
        is_shared_multi_user_session(
            source, group_sessions_per_user=False, thread_sessions_per_user=tspu
        )
        is True
    )


@pytest.mark.parametrize(
    "source",
    [
        src("telegram", "-100", chat_type="group", thread_id="17585", user_id="42"),
        src("slack", "C1", chat_type="thread", user_id="U1"),
    ],
    ids=["thread_id", "chat_type_thread"],
)
def test_thread_shared_unless_thread_sessions_per_user(source: SessionSource) -> None:
    assert is_shared_multi_user_session(
        source, group_sessions_per_user=True, thread_sessions_per_user=False
    )
    assert not is_shared_multi_user_session(
        source, group_sessions_per_user=True, thread_sessions_per_user=True
    )


@pytest.mark.parametrize("gspu", [True, False])
@pytest.mark.parametrize("tspu", [True, False])
@pytest.mark.parametrize(
    "source",
    [
        src("discord", "g", chat_type="group", user_id="alice"),
        src("slack", "C1", chat_type="channel", user_id="U1"),
        src("telegram", "-100", chat_type="group", thread_id="17585", user_id="42"),
        src("slack", "C1", chat_type="thread", user_id="U1"),
    ],
    ids=["group", "channel", "group_thread", "chat_type_thread"],
)
def test_shared_flag_agrees_with_key_having_no_participant(
    source: SessionSource, gspu: bool, tspu: bool
) -> None:
    key = build_session_key(source, group_sessions_per_user=gspu, thread_sessions_per_user=tspu)
    participant_in_key = key.endswith(":" + str(source.user_id))
    shared = is_shared_multi_user_session(
        source, group_sessions_per_user=gspu, thread_sessions_per_user=tspu
    )
    assert shared is (not participant_in_key)


# --- SessionSource -----------------------------------------------------------------------


def test_session_source_is_frozen() -> None:
    source = src(chat_id="99")
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.chat_id = "100"  # type: ignore[misc]
    assert source.chat_id == "99"


def test_session_source_coerces_str_platform() -> None:
    source = SessionSource(platform="discord", chat_id="1")  # type: ignore[arg-type]
    assert source.platform is Platform.DISCORD


def test_session_source_rejects_unknown_platform() -> None:
    with pytest.raises(ValueError):
        SessionSource(platform="myspace", chat_id="1")  # type: ignore[arg-type]


@pytest.mark.parametrize("chat_type", ["private", "DM", "", "supergroup"])
def test_session_source_rejects_bad_chat_type(chat_type: str) -> None:
    with pytest.raises(ValueError, match="chat_type"):
        src(chat_type=chat_type)


def test_session_source_defaults() -> None:
    source = SessionSource(platform=Platform.TELEGRAM, chat_id="1")
    assert source.chat_type == "dm"
    assert source.is_bot is False
    assert source.role_authorized is False
    assert source.user_id is None and source.thread_id is None


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (src(user_id="42", user_name="Alice"), "DM with Alice"),
        (src(user_id="42"), "DM with 42"),
        (src(), "DM with unknown user"),
        (src(user_name="Alice", thread_id="t9"), "DM with Alice, thread: t9"),
        (src(chat_id="-100", chat_type="group", chat_name="My Group"), "group: My Group"),
        (src(chat_id="-100", chat_type="group"), "group: -100"),
        (src(chat_id="", chat_type="group"), "group: unknown"),
        (
            src(chat_id="-100", chat_type="group", chat_name="My Group", thread_id="12345"),
            "group: My Group, thread: 12345",
        ),
        (src("slack", "C1", chat_type="channel", chat_name="general"), "channel: general"),
        (src("slack", "C1", chat_type="thread", chat_name="general"), "thread: general"),
    ],
)
def test_session_source_description(source: SessionSource, expected: str) -> None:
    assert source.description == expected


def _full_source() -> SessionSource:
    return SessionSource(
        platform=Platform.SLACK,
        chat_id="C12345",
        chat_name="general",
        chat_type="thread",
        user_id="U1",
        user_name="Alice",
        thread_id="1700000000.000100",
        chat_topic="release planning",
        user_id_alt="alt-U1",
        chat_id_alt="alt-C12345",
        is_bot=True,
        guild_id="T999",
        parent_chat_id="C00001",
        message_id="m-77",
        role_authorized=True,
    )


def test_full_source_sets_every_field_off_default() -> None:
    # Guard for the round-trip tests: a field left at its default would not be tested.
    source = _full_source()
    defaults = SessionSource(platform=Platform.TELEGRAM, chat_id="")
    for f in dataclasses.fields(SessionSource):
        assert getattr(source, f.name) != getattr(defaults, f.name), f.name


def test_session_source_dict_round_trip() -> None:
    source = _full_source()
    data = source.to_dict()
    assert data["platform"] == "slack"
    assert type(data["platform"]) is str
    assert set(data) == {f.name for f in dataclasses.fields(SessionSource)}
    assert SessionSource.from_dict(data) == source
    assert SessionSource.from_dict(json.loads(json.dumps(data))) == source


def test_session_source_from_dict_ignores_unknown_keys() -> None:
    data = _full_source().to_dict()
    data["added_in_a_later_version"] = 1
    data["another"] = {"x": 1}
    assert SessionSource.from_dict(data) == _full_source()


def test_session_source_from_dict_fills_defaults() -> None:
    source = SessionSource.from_dict({"platform": "telegram", "chat_id": "5"})
    assert source == SessionSource(platform=Platform.TELEGRAM, chat_id="5")


def test_session_source_from_dict_rejects_bad_chat_type() -> None:
    with pytest.raises(ValueError, match="chat_type"):
        SessionSource.from_dict({"platform": "telegram", "chat_id": "5", "chat_type": "room"})


_ID_FIELDS = [
    "chat_id",
    "user_id",
    "thread_id",
    "user_id_alt",
    "chat_id_alt",
    "guild_id",
    "parent_chat_id",
    "message_id",
]


@pytest.mark.parametrize("field_name", _ID_FIELDS)
@pytest.mark.parametrize("number", [0, 12345, -1001234567890, 2**64])
def test_session_source_from_dict_takes_a_numeric_id_as_its_digits(
    field_name: str, number: int
) -> None:
    data = {"platform": "telegram", "chat_id": "5", "chat_type": "group", "user_id": "u"}
    source = SessionSource.from_dict(json.loads(json.dumps({**data, field_name: number})))
    assert getattr(source, field_name) == str(number)
    as_text = SessionSource.from_dict({**data, field_name: str(number)})
    assert source == as_text
    assert build_session_key(source) == build_session_key(as_text)


@pytest.mark.parametrize("field_name", _ID_FIELDS)
@pytest.mark.parametrize("bad", [True, False, 1.0, 7.5, ["5"], {"id": 5}])
def test_session_source_from_dict_refuses_a_bool_float_or_container_id(
    field_name: str, bad: Any
) -> None:
    data = {"platform": "telegram", "chat_id": "5", field_name: bad}
    with pytest.raises(ValueError, match=rf"^{field_name} must be a string or a whole number"):
        SessionSource.from_dict(data)


def test_message_event_from_dict_takes_a_numeric_message_id_as_its_digits() -> None:
    data = {
        "source": {"platform": "telegram", "chat_id": 42, "user_id": 42},
        "text": "hi",
        "message_id": 9001,
        "received_at": "2026-01-01T00:00:00+00:00",
    }
    event = MessageEvent.from_dict(data)
    assert (event.message_id, event.source.chat_id, event.source.user_id) == ("9001", "42", "42")


@pytest.mark.parametrize("empty", ["", " ", "\t"])
def test_an_empty_message_id_is_no_id_however_the_event_is_built(empty: str) -> None:
    source = SessionSource(Platform.SLACK, "C1", user_id="U1")
    assert MessageEvent(source, "hi", message_id=empty).message_id is None
    assert dataclasses.replace(MessageEvent(source, "hi"), message_id=empty).message_id is None
    data = {**MessageEvent(source, "hi").to_dict(), "message_id": empty}
    assert MessageEvent.from_dict(data).message_id is None
    assert MessageEvent(source, "hi", message_id="0").message_id == "0"


async def test_an_older_sessions_json_with_numeric_ids_is_imported_and_routes(
    tmp_path: Path,
) -> None:
    """An index written by a tool that kept Telegram's numbers as numbers: the entry is
    imported (not skipped), and the next message of that chat continues its session."""
    key = "agent:main:telegram:group:-100200:7"
    origin = {"platform": "telegram", "chat_id": -100200, "chat_type": "group", "user_id": 7}
    legacy = {
        key: {
            "session_key": key,
            "session_id": "20260101_000000_0123abcd",
            "created_at": "2026-01-01T00:00:00+00:00",
            "updated_at": "2026-01-01T00:00:00+00:00",
            "origin": origin,
            "platform": "telegram",
            "chat_type": "group",
        },
        "agent:main:telegram:dm:x": {
            "session_key": "agent:main:telegram:dm:x",
            "origin": {"platform": "telegram", "chat_id": True},
        },
    }
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "sessions.json").write_text(json.dumps(legacy))
    config = GatewayConfig.model_validate({"timezone": "UTC", "session_reset": {"mode": "none"}})
    async with SessionStore(sessions, config) as store:
        [entry] = await store.list_sessions()
        assert entry.origin is not None and entry.origin.chat_id == "-100200"
        assert store.session_key_for(entry.origin) == key
        source = SessionSource(Platform.TELEGRAM, "-100200", chat_type="group", user_id="7")
        routed = await store.get_or_create_session(source)
        assert (routed.session_key, routed.session_id) == (key, "20260101_000000_0123abcd")


async def test_a_raising_has_active_processes_fn_counts_as_active_and_is_logged_once(
    tmp_path: Path,
) -> None:
    failure: Exception | None = RuntimeError("process table unavailable")

    def has_active_processes(session_key: str) -> bool:
        if failure is not None:
            raise failure
        return False

    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "session_reset": {"mode": "idle", "idle_minutes": 5}}
    )
    source = SessionSource(Platform.TELEGRAM, "42", user_id="42")
    start = datetime(2026, 3, 1, 12, tzinfo=UTC)
    with time_machine.travel(start, tick=False) as clock, capture_logs() as logs:
        async with SessionStore(tmp_path / "sessions", config, has_active_processes) as store:
            first = await store.get_or_create_session(source)
            clock.shift(timedelta(days=3))  # idle long past the policy and the prune age
            for _ in range(5):
                entry = await store.get_or_create_session(source)
                assert (entry.session_id, entry.was_auto_reset) == (first.session_id, False)
            assert await store.expired_entries() == []
            assert await store.prune_old_entries(1) == 0
            failure = KeyError("pid")  # failing differently is worth a line again
            await store.get_or_create_session(source)
            await store.get_or_create_session(source)
            failure = None
            clock.shift(timedelta(hours=1))
            after = await store.get_or_create_session(source)
            await store.get_or_create_session(source)
            assert (after.was_auto_reset, after.auto_reset_reason) == (True, "idle")
            assert after.session_id != first.session_id
    lines = [(e["event"], e.get("error_type")) for e in logs if "has_active" in e["event"]]
    assert lines == [
        ("has_active_processes_failed", "RuntimeError"),
        ("has_active_processes_failed", "KeyError"),
        ("has_active_processes_recovered", None),
    ]


# --- SessionEntry ------------------------------------------------------------------------

_PLUS5 = timezone(timedelta(hours=5))


def _full_entry() -> SessionEntry:
    return SessionEntry(
        session_key="agent:main:slack:thread:C12345",
        session_id="20240102_030405_deadbeef",
        created_at=datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
        updated_at=datetime(2024, 1, 2, 9, 0, 0, tzinfo=_PLUS5),
        origin=_full_source(),
        display_name="general",
        platform=Platform.SLACK,
        chat_type="thread",
        input_tokens=11,
        output_tokens=22,
        cache_read_tokens=33,
        cache_write_tokens=44,
        total_tokens=55,
        estimated_cost_usd=0.125,
        cost_status="estimated",
        last_prompt_tokens=66,
        was_auto_reset=True,
        auto_reset_reason="idle",
        reset_had_activity=True,
        is_fresh_reset=True,
        expiry_finalized=True,
        suspended=True,
        resume_pending=True,
        resume_reason="restart_timeout",
        last_resume_marked_at=datetime(2024, 1, 3, 0, 0, 1, tzinfo=timezone(timedelta(hours=-7))),
    )


def test_full_entry_sets_every_field_off_default() -> None:
    entry = _full_entry()
    for f in dataclasses.fields(SessionEntry):
        if f.default is not dataclasses.MISSING:
            assert getattr(entry, f.name) != f.default, f.name


def test_session_entry_dict_round_trip() -> None:
    entry = _full_entry()
    data = entry.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(SessionEntry)}
    back = SessionEntry.from_dict(data)
    assert back == entry
    assert back.origin == _full_source()
    assert back.platform is Platform.SLACK
    for name in ("created_at", "updated_at", "last_resume_marked_at"):
        assert getattr(back, name).utcoffset() is not None, name


def test_session_entry_dict_is_json_serialisable_and_survives_json() -> None:
    entry = _full_entry()
    text = json.dumps(entry.to_dict())
    assert SessionEntry.from_dict(json.loads(text)) == entry


def test_session_entry_datetimes_are_written_in_utc() -> None:
    data = _full_entry().to_dict()
    # 09:00 at +05:00 is 04:00 UTC; 00:00:01 at -07:00 is 07:00:01 UTC.
    assert data["updated_at"] == "2024-01-02T04:00:00+00:00"
    assert data["last_resume_marked_at"] == "2024-01-03T07:00:01+00:00"
    assert data["created_at"] == "2024-01-02T03:04:05.123456+00:00"
    assert data["platform"] == "slack"
    assert data["origin"]["platform"] == "slack"


def test_session_entry_minimal_round_trip_keeps_nones() -> None:
    entry = SessionEntry(
        session_key="agent:main:telegram:dm:1",
        session_id="s",
        created_at=datetime(2024, 5, 1, tzinfo=UTC),
        updated_at=datetime(2024, 5, 2, tzinfo=UTC),
    )
    data = entry.to_dict()
    assert data["origin"] is None and data["platform"] is None
    assert data["last_resume_marked_at"] is None
    assert SessionEntry.from_dict(json.loads(json.dumps(data))) == entry


def test_session_entry_naive_datetime_strings_are_read_as_utc() -> None:
    entry = SessionEntry.from_dict(
        {
            "session_key": "k",
            "session_id": "s",
            "created_at": "2024-01-02T03:04:05",
            "updated_at": "2024-01-02T03:04:06",
            "last_resume_marked_at": "2024-01-02T03:04:07",
        }
    )
    assert entry.created_at == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert entry.created_at.utcoffset() == timedelta(0)
    assert entry.updated_at == datetime(2024, 1, 2, 3, 4, 6, tzinfo=UTC)
    assert entry.last_resume_marked_at == datetime(2024, 1, 2, 3, 4, 7, tzinfo=UTC)


def test_session_entry_offset_datetime_strings_keep_their_instant() -> None:
    entry = SessionEntry.from_dict(
        {
            "session_key": "k",
            "session_id": "s",
            "created_at": "2024-01-02T03:04:05+02:00",
            "updated_at": "2024-01-02T03:04:05Z",
        }
    )
    assert entry.created_at == datetime(2024, 1, 2, 1, 4, 5, tzinfo=UTC)
    assert entry.updated_at == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_session_entry_from_dict_ignores_unknown_keys() -> None:
    data = _full_entry().to_dict()
    data["legacy_field"] = "x"
    assert SessionEntry.from_dict(data) == _full_entry()


def test_add_usage_accumulates_counters() -> None:
    entry = SessionEntry(
        session_key="k",
        session_id="s",
        created_at=datetime(2024, 1, 1, tzinfo=UTC),
        updated_at=datetime(2024, 1, 1, tzinfo=UTC),
    )
    entry.add_usage(TokenUsage(input_tokens=100, output_tokens=20, cache_read_tokens=5))
    entry.add_usage(
        TokenUsage(input_tokens=7, output_tokens=3, cache_write_tokens=9, estimated_cost_usd=0.25)
    )
    assert entry.input_tokens == 107
    assert entry.output_tokens == 23
    assert entry.cache_read_tokens == 5
    assert entry.cache_write_tokens == 9
    assert entry.total_tokens == 130
    assert entry.estimated_cost_usd == pytest.approx(0.25)
    assert entry.cost_status == "estimated"


def test_add_usage_without_cost_keeps_cost_status() -> None:
    entry = SessionEntry(
        session_key="k",
        session_id="s",
        created_at=datetime(2024, 1, 1, tzinfo=UTC),
        updated_at=datetime(2024, 1, 1, tzinfo=UTC),
    )
    entry.add_usage(TokenUsage(input_tokens=1, output_tokens=1))
    assert entry.cost_status == "unknown"
    assert entry.total_tokens == 2


def test_token_usage_total_is_input_plus_output() -> None:
    usage = TokenUsage(input_tokens=3, output_tokens=4, cache_read_tokens=100)
    assert usage.total_tokens == 7


def test_session_entry_copy_is_independent() -> None:
    entry = _full_entry()
    snapshot = entry.copy()
    entry.add_usage(TokenUsage(input_tokens=1000))
    entry.suspended = False
    assert snapshot.input_tokens == 11
    assert snapshot.suspended is True
    assert snapshot == _full_entry()


# --- build_session_context ---------------------------------------------------------------

HOME_CHAT = "-1009876543210"


@pytest.fixture
def config() -> GatewayConfig:
    return GatewayConfig.model_validate(
        {
            "platforms": {
                "telegram": {"enabled": True, "home_channel": HOME_CHAT},
                "http": {"enabled": True},
            }
        }
    )


def test_build_session_context_without_entry(config: GatewayConfig) -> None:
    source = src(chat_id="5550001111", user_id="5550001111", user_name="Jordan")
    ctx = build_session_context(source, config)
    assert isinstance(ctx, SessionContext)
    assert ctx.source is source
    assert ctx.connected_platforms == ("telegram", "http")
    assert ctx.home_channels == {"telegram": HOME_CHAT}
    assert ctx.shared_multi_user_session is False
    assert ctx.session_key is None
    assert ctx.session_id is None
    assert ctx.created_at is None and ctx.updated_at is None


def test_build_session_context_with_entry(config: GatewayConfig) -> None:
    source = src(chat_id="5550001111", user_id="5550001111")
    created = datetime(2024, 3, 4, 5, 6, 7, tzinfo=UTC)
    updated = created + timedelta(minutes=9)
    entry = SessionEntry(
        session_key=build_session_key(source),
        session_id="20240304_050607_abcdef01",
        created_at=created,
        updated_at=updated,
    )
    ctx = build_session_context(source, config, entry)
    assert ctx.session_key == "agent:main:telegram:dm:5550001111"
    assert ctx.session_id == "20240304_050607_abcdef01"
    assert ctx.created_at == datetime(2024, 3, 4, 5, 6, 7, tzinfo=UTC)
    assert ctx.updated_at == datetime(2024, 3, 4, 5, 15, 7, tzinfo=UTC)


def test_build_session_context_default_config_has_nothing_connected() -> None:
    ctx = build_session_context(src(), GatewayConfig())
    assert ctx.connected_platforms == ()
    assert ctx.home_channels == {}


def test_build_session_context_shared_follows_config_flags(config: GatewayConfig) -> None:
    topic = src(chat_id="-100", chat_type="group", thread_id="17585", user_id="42")
    group = src(chat_id="-100", chat_type="group", user_id="42")
    assert build_session_context(topic, config).shared_multi_user_session is True
    assert build_session_context(group, config).shared_multi_user_session is False

    per_user_threads = GatewayConfig.model_validate({"thread_sessions_per_user": True})
    shared_groups = GatewayConfig.model_validate({"group_sessions_per_user": False})
    assert build_session_context(topic, per_user_threads).shared_multi_user_session is False
    assert build_session_context(group, shared_groups).shared_multi_user_session is True


def test_build_session_context_home_channels_is_a_copy(config: GatewayConfig) -> None:
    ctx = build_session_context(src(), config)
    ctx.home_channels["telegram"] = "changed"
    assert config.home_channels() == {"telegram": HOME_CHAT}


# --- build_session_context_prompt --------------------------------------------------------

USER = "8675309001"
CHAT = "-1002285219667"


def _context(
    config: GatewayConfig, platform: str = "telegram", chat_type: str = "group", **kw: Any
) -> SessionContext:
    source = src(platform, CHAT, chat_type=chat_type, user_id=USER, **kw)
    return build_session_context(source, config)


def test_prompt_has_header_and_raw_ids_without_redaction(config: GatewayConfig) -> None:
    text = build_session_context_prompt(_context(config, user_name="Jordan", chat_name="Dev"))
    assert text.startswith("## Current Session Context")
    assert "- Platform: telegram" in text
    assert "- Chat: group: Dev" in text
    assert f"- Chat ID: {CHAT}" in text
    assert "- User: Jordan" in text
    assert f"- User ID: {USER}" in text
    assert "- Connected platforms: telegram, http" in text
    assert f"telegram -> {HOME_CHAT}" in text


def test_prompt_redacts_ids_on_telegram(config: GatewayConfig) -> None:
    text = build_session_context_prompt(_context(config), redact_pii=True)
    user_hash = "user_" + hashlib.sha256(USER.encode()).hexdigest()[:12]
    chat_hash = "telegram:" + hashlib.sha256(CHAT.encode()).hexdigest()[:12]
    home_hash = "telegram:" + sha12(HOME_CHAT)
    assert f"- User ID: {user_hash}" in text
    assert f"- Chat ID: {chat_hash}" in text
    assert f"- Chat: group: {chat_hash}" in text
    assert f"telegram -> {home_hash}" in text
    assert USER not in text
    assert CHAT not in text
    assert HOME_CHAT not in text


def test_prompt_redacts_dm_user_in_chat_line(config: GatewayConfig) -> None:
    ctx = build_session_context(src(chat_id=USER, user_id=USER), config)
    text = build_session_context_prompt(ctx, redact_pii=True)
    assert f"- Chat: DM with user_{sha12(USER)}" in text
    assert f"- Chat ID: telegram:{sha12(USER)}" in text
    assert USER not in text


def test_prompt_redaction_is_deterministic(config: GatewayConfig) -> None:
    a = build_session_context_prompt(_context(config), redact_pii=True)
    b = build_session_context_prompt(_context(config), redact_pii=True)
    assert a == b


def test_prompt_on_discord_keeps_raw_ids_even_with_redaction(config: GatewayConfig) -> None:
    text = build_session_context_prompt(_context(config, platform="discord"), redact_pii=True)
    assert f"- User ID: {USER}" in text
    assert f"- Chat ID: {CHAT}" in text
    assert "user_" + sha12(USER) not in text
    # The telegram home channel is still a telegram id, so it is still redacted.
    assert f"telegram -> telegram:{sha12(HOME_CHAT)}" in text
    assert HOME_CHAT not in text


def test_prompt_shared_session_mentions_sender_and_omits_user(config: GatewayConfig) -> None:
    ctx = _context(config, thread_id="17585", user_name="Jordan")
    assert ctx.shared_multi_user_session is True
    text = build_session_context_prompt(ctx)
    assert "[sender name]" in text
    assert "Multi-user thread" in text
    assert "- User:" not in text
    assert "- User ID:" not in text
    assert "Jordan" not in text
    assert USER not in text
    assert "- Thread: 17585" in text


def test_prompt_shared_group_without_thread_says_session() -> None:
    cfg = GatewayConfig.model_validate({"group_sessions_per_user": False})
    text = build_session_context_prompt(_context(cfg))
    assert "Multi-user session" in text
    assert "[sender name]" in text
    assert "- User ID:" not in text


def test_prompt_private_session_has_no_multi_user_note(config: GatewayConfig) -> None:
    text = build_session_context_prompt(_context(config))
    assert "[sender name]" not in text
    assert "Multi-user" not in text


def test_prompt_includes_session_id_and_start_time(config: GatewayConfig) -> None:
    source = src(chat_id="5", user_id="5")
    entry = SessionEntry(
        session_key=build_session_key(source),
        session_id="20240304_050607_abcdef01",
        created_at=datetime(2024, 3, 4, 7, 6, 7, tzinfo=timezone(timedelta(hours=2))),
        updated_at=datetime(2024, 3, 4, 5, 6, 7, tzinfo=UTC),
    )
    text = build_session_context_prompt(build_session_context(source, config, entry))
    assert "- Session ID: 20240304_050607_abcdef01" in text
    assert "- Session started: 2024-03-04T05:06:07+00:00" in text


def test_prompt_without_platforms_or_session_omits_those_lines() -> None:
    text = build_session_context_prompt(build_session_context(src(), GatewayConfig()))
    assert "Connected platforms" not in text
    assert "Home channels" not in text
    assert "Session ID" not in text
    assert "Session started" not in text


def test_prompt_includes_channel_topic(config: GatewayConfig) -> None:
    text = build_session_context_prompt(_context(config, chat_topic="release planning"))
    assert "- Channel topic: release planning" in text


# --- SessionStore re-export --------------------------------------------------------------


def test_session_store_is_re_exported() -> None:
    from gateway.session import SessionStore
    from gateway.store.session_store import SessionStore as StoreSessionStore

    assert SessionStore is StoreSessionStore


def test_unknown_module_attribute_raises_attribute_error() -> None:
    import gateway.session as session_module

    with pytest.raises(AttributeError, match="NoSuchThing"):
        session_module.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("bad", ["a\u2028b", "a\u2029b", "a\u202eb", "a\u2066b"])
def test_unicode_line_separators_and_bidi_overrides_are_refused(bad: str) -> None:
    source = SessionSource(platform=Platform.TELEGRAM, chat_id=bad)
    with pytest.raises(ValueError, match="chat_id"):
        build_session_key(source)
