"""The memory a session's transcript belongs to: the direct-chat shortcut agrees with
the full rules for every origin it takes, and leaves the rest to them."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.domain.session import Platform, SessionSource
from gateway.memory import index
from gateway.memory.index import IndexSettings, transcript_namespace

DM = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1").to_dict()
KEY = "agent:main:local:dm:c1"


def full_rules(origin: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str | None:
    with monkeypatch.context() as patch:
        patch.setattr(index, "_direct_message_namespace", lambda key, origin: None)
        return transcript_namespace(KEY, origin, IndexSettings())


@pytest.mark.parametrize(
    "origin",
    [
        DM,
        {key: value for key, value in DM.items() if key != "chat_type"},  # dm by default
        {**DM, "user_id": 42},  # coerced to "42" by the full rules
        {**DM, "user_id": True},  # refused by the full rules
        {**DM, "user_id": ""},
        {**DM, "platform": "no-such-platform"},
        {key: value for key, value in DM.items() if key != "chat_id"},
        {**DM, "thread_id": 1.5},
        {**DM, "chat_type": "group"},
        {**DM, "chat_type": "thread", "thread_id": "t1"},
    ],
)
def test_shortcut_and_full_rules_agree(origin: dict[str, Any], monkeypatch) -> None:
    assert transcript_namespace(KEY, origin, IndexSettings()) == full_rules(origin, monkeypatch)


def test_a_plain_direct_chat_takes_the_shortcut() -> None:
    assert index._direct_message_namespace(KEY, DM) == "memory:main:local:u1"
    assert index._direct_message_namespace(KEY, {**DM, "chat_type": "group"}) is None
