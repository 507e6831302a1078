"""What a turn reuses from the turns before it instead of building again: the system
prompt (`gateway.runner.prompts`), the reply target's encoding
(`journal.encoded_target`) and the last daily reset boundary. Each reused value must be
exactly what building it afresh gives."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from gateway.domain.policy import _boundary_on, last_daily_boundary
from gateway.domain.session import (
    Platform,
    SessionContext,
    SessionSource,
    build_session_context_prompt,
)
from gateway.runner.prompts import SystemPrompts
from gateway.store import journal

FULL_SOURCE = SessionSource(
    platform=Platform.DISCORD,
    chat_id="c1",
    chat_name="Dev",
    chat_type="thread",
    user_id="u1",
    user_name="Jordan",
    thread_id="t1",
    chat_topic="releases",
    user_id_alt="ua",
    chat_id_alt="ca",
    is_bot=False,
    guild_id="g1",
    parent_chat_id="p1",
    message_id="m1",
    role_authorized=True,
)

#: a different value for each field of a source (the platform and chat type are enums
#: of sorts, the rest free text)
CHANGED: dict[str, object] = {
    "platform": Platform.TELEGRAM,
    "chat_type": "group",
    "is_bot": True,
    "role_authorized": False,
}


def _changed(value: object, name: str) -> object:
    return CHANGED.get(name, f"{value}-other" if value is not None else "set")


def _context(source: SessionSource = FULL_SOURCE, **changes: object) -> SessionContext:
    context = SessionContext(
        source=source,
        connected_platforms=("discord", "telegram"),
        home_channels={"discord": "h1"},
        shared_multi_user_session=False,
        session_key="k1",
        session_id="s1",
        created_at=datetime(2026, 11, 1, 12, 0, tzinfo=UTC),
        updated_at=datetime(2026, 11, 2, 12, 0, tzinfo=UTC),
    )
    return dataclasses.replace(context, **changes)


def _fresh(context: SessionContext, custom: str, redact: bool) -> str:
    block = build_session_context_prompt(context, redact_pii=redact)
    return f"{custom}\n\n{block}" if custom else block


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SessionSource)])
def test_a_kept_prompt_is_rebuilt_when_any_source_field_it_shows_changes(field: str) -> None:
    prompts = SystemPrompts()
    first = _context()
    assert prompts.prompt(first, "You help.", True) == _fresh(first, "You help.", True)
    source = dataclasses.replace(
        FULL_SOURCE, **{field: _changed(getattr(FULL_SOURCE, field), field)}
    )
    second = _context(source)
    assert prompts.prompt(second, "You help.", True) == _fresh(second, "You help.", True)


@pytest.mark.parametrize(
    "changes",
    [
        {"connected_platforms": ("discord",)},
        {"home_channels": {"discord": "h2"}},
        {"shared_multi_user_session": True},
        {"created_at": datetime(2026, 11, 3, tzinfo=UTC)},
        {"updated_at": datetime(2026, 11, 4, tzinfo=UTC)},
        {"session_key": "k2"},
    ],
)
def test_a_kept_prompt_is_rebuilt_when_the_context_changes(changes: dict[str, object]) -> None:
    prompts = SystemPrompts()
    prompts.prompt(_context(), "", False)
    second = _context(**changes)
    assert prompts.prompt(second, "", False) == _fresh(second, "", False)


def test_a_kept_prompt_follows_the_agent_text_and_the_redaction_setting() -> None:
    prompts = SystemPrompts()
    context = _context(source=dataclasses.replace(FULL_SOURCE, platform=Platform.TELEGRAM))
    assert prompts.prompt(context, "A", False) == _fresh(context, "A", False)
    assert prompts.prompt(context, "B", False) == _fresh(context, "B", False)
    redacted = prompts.prompt(context, "B", True)
    assert redacted == _fresh(context, "B", True)
    assert "u1" not in redacted.replace("Jordan", "")


def test_the_same_session_gets_the_same_prompt_object_and_other_sessions_their_own() -> None:
    prompts = SystemPrompts(size=2)
    first = prompts.prompt(_context(), "A", False)
    assert prompts.prompt(_context(), "A", False) is first  # reused, not rebuilt
    for session_id in ("s2", "s3"):  # the oldest session makes room
        other = _context(session_id=session_id)
        assert prompts.prompt(other, "A", False) == _fresh(other, "A", False)
    again = prompts.prompt(_context(), "A", False)
    assert again == first and again is not first


def test_a_context_without_a_session_is_built_every_time() -> None:
    prompts = SystemPrompts()
    context = _context(session_id=None)
    assert prompts.prompt(context, "A", False) == _fresh(context, "A", False)
    assert prompts.prompt(context, "A", False) is not prompts.prompt(context, "A", False)


@pytest.mark.parametrize(
    "source",
    [
        FULL_SOURCE,
        SessionSource(platform=Platform.TELEGRAM, chat_id="42"),
        SessionSource(platform=Platform.SLACK, chat_id="C1", chat_type="group", thread_id="1.2"),
        SessionSource(platform=Platform.LOCAL, chat_id=""),
    ],
)
def test_the_encoded_target_is_the_ledger_encoding_of_the_source(source: SessionSource) -> None:
    expected = journal.delivery_target(source.to_dict())
    assert journal.encoded_target(source) == expected
    # Who wrote is not part of it: another sender in the chat shares the encoding.
    other = dataclasses.replace(source, user_id="someone", user_name="X", message_id="m9")
    assert journal.encoded_target(other) == expected


@pytest.mark.parametrize("zone", [UTC, ZoneInfo("America/New_York"), ZoneInfo("Asia/Kolkata")])
@pytest.mark.parametrize("at_hour", [0, 2, 4])
def test_the_kept_daily_boundary_is_the_computed_one_across_days_and_dst(
    zone: object, at_hour: int
) -> None:
    def computed(now: datetime) -> datetime:
        local_day = now.astimezone(zone).date()  # type: ignore[arg-type]
        boundary = _boundary_on(local_day, at_hour, zone)  # type: ignore[arg-type]
        if boundary > now:
            boundary = _boundary_on(local_day - timedelta(days=1), at_hour, zone)  # type: ignore[arg-type]
        return boundary

    # Across both of 2026's DST changes in New York, every 37 minutes, forward then back.
    start = datetime(2026, 3, 6, tzinfo=UTC)
    steps = [start + timedelta(minutes=37 * i) for i in range(600)]
    steps += [datetime(2026, 10, 30, tzinfo=UTC) + timedelta(minutes=37 * i) for i in range(600)]
    for now in steps + steps[::-1]:
        assert last_daily_boundary(now, at_hour, zone) == computed(now)  # type: ignore[arg-type]
