"""Properties of build_session_key over generated sources (docs/design.md, "Session keys").

The rules, restated here as the oracle `lane()`: a key is
`agent:{agent_id}:{platform}:{chat_type}` followed by the lane's ids, each with ':' and
'%' escaped. A DM's lane is its chat id (else `user_id_alt or user_id`) and its thread; a
group's is its chat id, its thread, and the participant (`user_id_alt or user_id`) only
when `group_sessions_per_user` and (no thread, or `thread_sessions_per_user`). WhatsApp
chat and user ids are canonicalised first, so spellings of one number share a key.
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gateway.session import (
    CHAT_TYPES,
    Platform,
    SessionSource,
    build_session_key,
    canonical_whatsapp_identifier,
)

# --- strategies ----------------------------------------------------------------------------

# Telegram "-100123", Slack "C0123"/"1700000000.000100", Matrix "!room:host", e-mail-ish
# bridge ids "a+b@x.org"; '%' and ready-made escapes as well, since keys escape ':' as
# '%3A' and '%' as '%25' (an id "a%3Ab" must not meet an id "a:b").
ID_ALPHABET = string.ascii_letters + string.digits + "-_.@:+%"
ids = (
    st.lists(st.sampled_from([*ID_ALPHABET, "%3A", "%25"]), min_size=1, max_size=10)
    .map("".join)
    .filter(lambda s: ".." not in s)
)
agent_ids = st.just("main") | ids.filter(lambda s: ":" not in s)

phone_numbers = st.from_regex(r"[1-9][0-9]{6,14}", fullmatch=True)


@st.composite
def spellings(draw: st.DrawFn, number: str) -> str:
    """One way the WhatsApp bridge may write `number`: '+', spaces, dashes, dots,
    parentheses, a device suffix, a JID domain."""
    cuts = sorted(draw(st.sets(st.integers(1, len(number) - 1), max_size=3)))
    groups = [number[i:j] for i, j in zip([0, *cuts], [*cuts, len(number)], strict=True)]
    if len(groups) > 1 and draw(st.booleans()):
        groups[0] = f"({groups[0]})"
    text = groups[0]
    for group in groups[1:]:
        text += draw(st.sampled_from(("", " ", "-", "."))) + group
    if draw(st.booleans()):
        text = "+" + text
    suffix = draw(st.sampled_from(("", "@s.whatsapp.net", ":{}@s.whatsapp.net", "@c.us")))
    return text + suffix.format(draw(st.integers(0, 99)))


whatsapp_ids = st.one_of(
    phone_numbers.flatmap(spellings),
    phone_numbers.map(lambda n: f"{n}@g.us"),  # group JIDs
    st.just("status@broadcast"),
)

optional = st.none() | st.just("")


@st.composite
def sources(draw: st.DrawFn, platforms: st.SearchStrategy[Platform] | None = None) -> Any:
    platform = draw(platforms or st.sampled_from(Platform))
    user_ids = whatsapp_ids if platform == Platform.WHATSAPP else ids
    return SessionSource(
        platform=platform,
        chat_id=draw(st.just("") | user_ids),
        chat_type=draw(st.sampled_from(CHAT_TYPES)),
        user_id=draw(optional | user_ids),
        user_id_alt=draw(optional | user_ids),
        thread_id=draw(optional | ids),
        # Outside the key:
        chat_name=draw(st.none() | st.text(max_size=5)),
        user_name=draw(st.none() | st.text(max_size=5)),
        chat_topic=draw(st.none() | st.text(max_size=5)),
        chat_id_alt=draw(st.none() | ids),
        guild_id=draw(st.none() | ids),
        parent_chat_id=draw(st.none() | ids),
        message_id=draw(st.none() | ids),
        is_bot=draw(st.booleans()),
        role_authorized=draw(st.booleans()),
    )


flags = st.fixed_dictionaries(
    {
        "group_sessions_per_user": st.booleans(),
        "thread_sessions_per_user": st.booleans(),
        "agent_id": agent_ids,
    }
)


# --- the oracle ----------------------------------------------------------------------------


def lane(source: SessionSource, options: dict[str, Any]) -> tuple[Any, ...]:
    """Everything the key must encode: the header and the (role, id) segments present."""

    def norm(value: str | None) -> str | None:
        if source.platform == Platform.WHATSAPP:
            value = canonical_whatsapp_identifier(value)
        return value or None

    chat, participant = norm(source.chat_id), norm(source.user_id_alt) or norm(source.user_id)
    thread = source.thread_id or None
    if source.chat_type == "dm":
        # A DM's own id is its lane; the user ids count only when there is no chat id.
        segments = [("lane", chat or participant), ("thread", thread)]
    else:
        threaded = thread is not None or source.chat_type == "thread"
        per_user = options["group_sessions_per_user"] and (
            not threaded or options["thread_sessions_per_user"]
        )
        segments = [("chat", chat), ("thread", thread), ("participant", per_user and participant)]
    present = tuple((role, value) for role, value in segments if value)
    return (options["agent_id"], source.platform.value, source.chat_type, present)


def decode(key: str) -> tuple[Any, ...]:
    """Split a key at ':' and undo the escaping of each segment."""

    def unescape(part: str) -> str:
        return re.sub(r"%(25|3A)", lambda m: "%" if m[1] == "25" else ":", part)

    literal, agent, platform, chat_type, *segments = key.split(":")
    assert literal == "agent"
    return (agent, platform, chat_type, tuple(unescape(s) for s in segments))


def values(expected_lane: tuple[Any, ...]) -> tuple[Any, ...]:
    *header, segments = expected_lane
    return (*header, tuple(value for _, value in segments))


def key_of(source: SessionSource, options: dict[str, Any]) -> str:
    return build_session_key(source, **options)


# --- properties ----------------------------------------------------------------------------


@settings(max_examples=200)
@given(sources(), flags)
def test_key_encodes_exactly_the_lane(source: SessionSource, options: dict[str, Any]) -> None:
    """Determinism and the segment layout: decoding the key gives the lane's ids back."""
    key = key_of(source, options)
    assert decode(key) == values(lane(source, options))
    assert len(key.split(":")) == 4 + len(lane(source, options)[3])


@given(sources(), flags)
def test_same_source_same_key_across_serialisation(
    source: SessionSource, options: dict[str, Any]
) -> None:
    key = key_of(source, options)
    assert key_of(replace(source), options) == key
    restored = SessionSource.from_dict(source.to_dict())
    assert restored == source
    assert key_of(restored, options) == key
    # As sessions.json stores it: the platform as a plain string.
    from_json = SessionSource.from_dict(json.loads(json.dumps(source.to_dict())))
    assert key_of(from_json, options) == key


KEY_FIELDS = ("platform", "chat_type", "chat_id", "thread_id", "user_id", "user_id_alt")
OTHER_FIELDS = ("chat_name", "user_name", "chat_topic", "guild_id", "message_id", "is_bot")


@st.composite
def changed_pairs(draw: st.DrawFn) -> tuple[SessionSource, SessionSource, dict, dict]:
    """A source and a copy with one field (or the agent id) changed. New ids are often
    borrowed from the source's other id fields, to provoke segment mix-ups."""
    source = draw(sources())
    options = draw(flags)
    other_options = dict(options)
    field = draw(st.sampled_from((*KEY_FIELDS, *OTHER_FIELDS, "agent_id")))
    present = [v for v in (source.chat_id, source.thread_id, source.user_id) if v]
    present += [source.user_id_alt] if source.user_id_alt else []
    borrowed = st.sampled_from(present) if present else st.nothing()
    if field == "agent_id":
        other_options["agent_id"] = draw(agent_ids)
        return source, source, options, other_options
    if field == "platform":
        # Keep ids valid for the new platform: WhatsApp ids are only generated for it.
        new: Any = draw(
            st.sampled_from([p for p in Platform if p != Platform.WHATSAPP])
            if source.platform != Platform.WHATSAPP
            else st.just(Platform.WHATSAPP)
        )
    elif field == "chat_type":
        new = draw(st.sampled_from(CHAT_TYPES))
    elif field in ("chat_id", "user_id", "user_id_alt"):
        fresh = whatsapp_ids if source.platform == Platform.WHATSAPP else ids
        new = draw(borrowed | fresh | (st.just("") if field == "chat_id" else optional))
    elif field == "thread_id":
        new = draw(borrowed | ids | optional)
    elif field == "is_bot":
        new = not source.is_bot
    else:
        new = draw(st.none() | ids)
    return source, replace(source, **{field: new}), options, other_options


@settings(max_examples=400)
@given(changed_pairs())
def test_keys_differ_exactly_when_lanes_differ(
    pair: tuple[SessionSource, SessionSource, dict, dict],
) -> None:
    a, b, options_a, options_b = pair
    lane_a, lane_b = lane(a, options_a), lane(b, options_b)
    key_a, key_b = key_of(a, options_a), key_of(b, options_b)
    if lane_a == lane_b:
        assert key_a == key_b  # a change outside the lane never moves the session
        return
    if key_a == key_b:
        # The format has no role markers ("ids inserted as they are, no prefixes"), so a
        # lane whose ids are equal but play other roles gets the same key: e.g. a per-user
        # group lane `<chat>:<user>` and a shared thread `<chat>:<thread>` with
        # thread_id == user_id. That is the only collision allowed here.
        assert values(lane_a) == values(lane_b)
        event("same ids in different roles share a key")
        return
    assert values(lane_a) != values(lane_b)


@given(phone_numbers.flatmap(lambda n: st.tuples(st.just(n), spellings(n), spellings(n))))
def test_whatsapp_spellings_of_one_number_share_a_key(numbers: tuple[str, str, str]) -> None:
    number, first, second = numbers
    assert canonical_whatsapp_identifier(first) == number
    expected_dm = f"agent:main:whatsapp:dm:{number}"
    for spelling in (first, second):
        assert build_session_key(SessionSource(Platform.WHATSAPP, spelling)) == expected_dm
        in_group = SessionSource(
            Platform.WHATSAPP, "120363041234567890@g.us", chat_type="group", user_id=spelling
        )
        assert build_session_key(in_group) == (
            f"agent:main:whatsapp:group:120363041234567890:{number}"
        )
        no_chat_id = SessionSource(Platform.WHATSAPP, "", user_id_alt=spelling, user_id="x")
        assert build_session_key(no_chat_id) == expected_dm


@given(phone_numbers.flatmap(spellings), phone_numbers.flatmap(spellings))
def test_whatsapp_numbers_that_differ_get_different_keys(first: str, second: str) -> None:
    same = canonical_whatsapp_identifier(first) == canonical_whatsapp_identifier(second)
    key_first = build_session_key(SessionSource(Platform.WHATSAPP, first))
    key_second = build_session_key(SessionSource(Platform.WHATSAPP, second))
    assert (key_first == key_second) == same


def _is_forbidden(char: str) -> bool:
    return char.isspace() or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp")


@settings(max_examples=200)
@given(sources(), flags)
def test_keys_hold_no_path_or_control_characters(
    source: SessionSource, options: dict[str, Any]
) -> None:
    key = key_of(source, options)
    assert "/" not in key and "\\" not in key and ".." not in key
    assert not any(_is_forbidden(c) for c in key), key


# --- unsafe ids ----------------------------------------------------------------------------

CONTROL_CHARACTERS = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))] + list(
    "\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
unsafe_pieces = st.sampled_from(("/", "\\", "..")) | st.sampled_from(CONTROL_CHARACTERS)
unsafe_ids = st.builds(
    lambda before, piece, after: before + piece + after,
    st.text(ID_ALPHABET, max_size=4),
    unsafe_pieces,
    st.text(ID_ALPHABET, max_size=4),
)
# An agent id is one key segment: a ':' in it, or an empty one, is refused too.
unsafe_agent_ids = unsafe_ids | st.just("") | st.builds("{}:{}".format, agent_ids, agent_ids)


@given(
    sources(),
    flags,
    st.sampled_from(("chat_id", "thread_id", "user_id", "user_id_alt")),
    unsafe_ids,
)
def test_unsafe_ids_are_rejected_naming_the_field(
    source: SessionSource, options: dict[str, Any], field: str, bad: str
) -> None:
    # Every id field is checked, even one the key would not use (a DM's user id), and
    # WhatsApp ids before canonicalisation could strip the offending characters.
    with pytest.raises(ValueError, match=rf"^{field} "):
        key_of(replace(source, **{field: bad}), options)


@given(sources(), flags, unsafe_agent_ids)
def test_unsafe_agent_ids_are_rejected(
    source: SessionSource, options: dict[str, Any], agent_id: str
) -> None:
    with pytest.raises(ValueError, match=r"^agent_id "):
        key_of(source, {**options, "agent_id": agent_id})
