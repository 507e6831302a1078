"""Which memory a session's transcript is indexed into: the DM shortcut
(`plain_dm_user`) names the same namespace as a full SessionSource parse, for any
origin, well-formed or not."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

from hypothesis import given
from hypothesis import strategies as st

from gateway.memory import index
from gateway.memory.index import IndexSettings, transcript_namespace

KEY = "agent:main:x:dm:c1"
ABSENT = object()
PLAIN_DM = {"platform": "telegram", "chat_id": "c1", "chat_type": "dm", "user_id": "u1"}
# What a field may be instead: absent, another valid value, or one the parse refuses.
OTHERS = {
    "platform": ["discord", "http", "no-such-platform", 3, None],
    "chat_id": [5, True, 1.5, None],
    "chat_type": ["group", "channel", "thread", "bogus", None],
    "user_id": ["", 7, False, 2.0, None],
    "thread_id": ["t1", 3, None],
    "guild_id": ["g1", 1.5, None],
    "user_id_alt": ["a1", True],
    "is_bot": [True, False],
}


@st.composite
def origins(draw: st.DrawFn) -> dict[str, Any]:
    """A plain DM's origin with up to three fields taken away or changed: one change is
    enough to leave the shortcut, so each is tried on its own too."""
    origin: dict[str, Any] = dict(PLAIN_DM)
    for name in draw(st.lists(st.sampled_from(sorted(OTHERS)), max_size=3, unique=True)):
        value = draw(st.sampled_from([ABSENT, *OTHERS[name]]))
        if value is ABSENT:
            origin.pop(name, None)
        else:
            origin[name] = value
    return origin


def parsed(origin: dict[str, Any], settings: IndexSettings) -> str | None:
    """The definition: the same function with the shortcut taken away (the full
    SessionSource parse for every origin)."""
    with patch.object(index, "plain_dm_user", lambda data: None):
        return transcript_namespace(KEY, origin, settings)


@given(origins(), st.booleans(), st.booleans())
def test_the_dm_shortcut_names_the_namespace_the_full_parse_does(
    origin: dict[str, Any], per_user: bool, thread_per_user: bool
) -> None:
    settings = IndexSettings(
        group_sessions_per_user=per_user, thread_sessions_per_user=thread_per_user
    )
    assert transcript_namespace(KEY, origin, settings) == parsed(origin, settings)


def test_a_plain_dm_is_named_by_the_shortcut() -> None:
    origin = {"platform": "telegram", "chat_id": "42", "chat_type": "dm", "user_id": "42"}
    name = transcript_namespace("agent:coder:telegram:dm:42", origin, IndexSettings())
    assert name == "memory:coder:telegram:42"
