"""SessionStore against a plain in-memory model: a Hypothesis state machine.

Every rule runs one store operation and checks the store's answer against what the
model predicts (seed sections 2, 3 and 6: the flag state machine, counters, transcripts,
idle/daily resets in America/New_York across DST, switching back to earlier sessions,
restarts). After every step the whole routing index is compared with the model.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import pytest
import time_machine
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from config import GatewayConfig
from gateway.session import Platform, SessionEntry, SessionSource, TokenUsage
from gateway.store.session_store import SessionStore

T = TypeVar("T")

# A pass takes seconds; the margin is for shrinking a failure on a busy machine.
pytestmark = pytest.mark.timeout(600)

SESSION_ID = re.compile(r"^\d{8}_\d{6}_[0-9a-f]{8}$")
NEW_YORK = ZoneInfo("America/New_York")
AT_HOUR = 4
IDLE = timedelta(minutes=90)
EVERY_FEW_STEPS = 5  # sessions.json and lookups; both are also checked at close_and_reopen

CONFIG = GatewayConfig.model_validate(
    {
        "timezone": "America/New_York",
        "session_reset": {"mode": "both", "at_hour": AT_HOUR, "idle_minutes": 90},
        "platforms": {"discord": {"session_reset": {"mode": "none"}}},
    }
)

# Runs start near 4:00 New York time on days around the 2026 DST changes (8 March: 2:00
# EST -> 3:00 EDT; 1 November: 2:00 EDT -> 1:00 EST), so the daily boundary is 23 or 25
# hours from the previous one and often within reach of short clock steps.
START_DAYS = tuple(datetime(2026, 3, d) for d in (6, 7, 8, 9)) + tuple(
    datetime(2026, m, d) for m, d in ((10, 31), (11, 1), (11, 2))
)

# Expected keys are written out, not computed, so key building is checked too.
TG_ALICE = "agent:main:telegram:dm:111"
TG_BOB = "agent:main:telegram:dm:222"
DISCORD_ALICE = "agent:main:discord:group:G1:u1"
DISCORD_BOB = "agent:main:discord:group:G1:u2"
SLACK_THREAD = "agent:main:slack:channel:C1:1700000000.000100"
KEYS = (TG_ALICE, TG_BOB, DISCORD_ALICE, DISCORD_BOB, SLACK_THREAD)
UNKNOWN_KEY = "agent:main:telegram:dm:404"


def _source(platform: Platform, chat_id: str, chat_type: str, **extra: Any) -> SessionSource:
    return SessionSource(platform=platform, chat_id=chat_id, chat_type=chat_type, **extra)


# Several sources per key (fields outside the key differ), so rules collide on keys.
SOURCES: tuple[tuple[SessionSource, str], ...] = (
    (_source(Platform.TELEGRAM, "111", "dm", user_id="111", chat_name="Alice"), TG_ALICE),
    (
        _source(
            Platform.TELEGRAM, "111", "dm", user_id="111", chat_name="Alice B.", message_id="9"
        ),
        TG_ALICE,
    ),
    (_source(Platform.TELEGRAM, "222", "dm", user_id="222", chat_name="Bob"), TG_BOB),
    (_source(Platform.DISCORD, "G1", "group", user_id="u1", chat_name="guild"), DISCORD_ALICE),
    (_source(Platform.DISCORD, "G1", "group", user_id="u2", chat_name="guild"), DISCORD_BOB),
    (
        _source(
            Platform.SLACK,
            "C1",
            "channel",
            thread_id="1700000000.000100",
            user_id="U1",
            chat_name="general",
        ),
        SLACK_THREAD,
    ),
    (
        _source(
            Platform.SLACK,
            "C1",
            "channel",
            thread_id="1700000000.000100",
            user_id="U2",
            chat_name="#general",
        ),
        SLACK_THREAD,
    ),
)

CLOCK_STEPS = (1, 30, 89, 90, 91, 300, 1440)  # minutes: idle is 90, a day 1440
ROLES = ("user", "assistant", "system", "tool")
RESUME_REASONS = ("restart_timeout", "shutdown_timeout", "restart_interrupted")

texts = st.text(st.characters(codec="utf-8"), max_size=8)
contents = st.one_of(
    texts,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2),
)
messages = st.builds(
    lambda role, content: {"role": role, "content": content}, st.sampled_from(ROLES), contents
)
usages = st.builds(
    TokenUsage,
    input_tokens=st.integers(0, 5000),
    output_tokens=st.integers(0, 5000),
    cache_read_tokens=st.integers(0, 100),
    cache_write_tokens=st.integers(0, 100),
    # Dyadic fractions add up exactly, so costs can be compared with ==.
    estimated_cost_usd=st.sampled_from((0.0, 0.0, 0.25, 0.125, 1.5)),
)

COUNTERS = (
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "total_tokens",
    "estimated_cost_usd",
)


@dataclass
class ModelSession:
    """One session id: its key, start, counters and active transcript."""

    session_key: str
    created_at: datetime
    counters: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ModelEntry:
    """What the model expects `store.get_entry(key)` to hold."""

    session_id: str
    updated_at: datetime
    origin: SessionSource
    display_name: str | None
    was_auto_reset: bool = False
    auto_reset_reason: str | None = None
    reset_had_activity: bool = False
    is_fresh_reset: bool = False
    suspended: bool = False
    resume_pending: bool = False
    resume_reason: str | None = None
    last_resume_marked_at: datetime | None = None
    # None: not predicted. switch_session keeps these two from the session switched away
    # from instead of restoring the target's (reported separately), so after a switch the
    # model stops checking them until the next fresh session.
    cost_status: str | None = "unknown"
    last_prompt_tokens: int | None = 0


def crossed_daily_boundary(updated_at: datetime, now: datetime) -> bool:
    """Whether a 4:00 New York wall-clock time lies in (updated_at, now]."""
    local = updated_at.astimezone(NEW_YORK)
    boundary = local.replace(hour=AT_HOUR, minute=0, second=0, microsecond=0)
    if boundary <= local:  # same tzinfo: compared as wall times, as intended
        boundary = (boundary.replace(tzinfo=None) + timedelta(days=1)).replace(tzinfo=NEW_YORK)
    return boundary <= now  # different tzinfo: compared as instants


def predicted_reset(key: str, updated_at: datetime, now: datetime) -> str | None:
    if key in (DISCORD_ALICE, DISCORD_BOB):  # platforms.discord.session_reset: none
        return None
    if now > updated_at + IDLE:
        return "idle"
    if crossed_daily_boundary(updated_at, now):
        return "daily"
    return None


def rewind_model(messages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        return {"rewound_count": 0, "turns_undone": 0, "target_text": None}
    undone = users[-n:]
    first = undone[0]
    content = messages[first]["content"]
    # Structured content comes back as its compact JSON text (what the store keeps in the
    # content column), None as "".
    if isinstance(content, str):
        target = content
    elif content is None:
        target = ""
    else:
        target = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    result = {"rewound_count": len(messages) - first, "turns_undone": len(undone)}
    del messages[first:]
    return {**result, "target_text": target}


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = Path(tempfile.mkdtemp(prefix="store-model-"))
        self.now = datetime(2026, 3, 6, tzinfo=UTC)  # until start_clock picks the start
        self.traveller = time_machine.travel(self.now, tick=False)
        self.clock = self.traveller.start()
        self.store = self.run(SessionStore(self.directory, CONFIG).open())
        self.pool: list[tuple[SessionSource, str]] = list(SOURCES)  # start() narrows it
        self.entries: dict[str, ModelEntry] = {}
        self.sessions: dict[str, ModelSession] = {}
        self.steps = 0

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        try:
            self.run(self.store.close())
            self.run(self.loop.shutdown_default_executor())
        finally:
            self.loop.close()
            self.traveller.stop()
            shutil.rmtree(self.directory, ignore_errors=True)

    # --- model helpers -----------------------------------------------------------------

    def draw_source(self, data: st.DataObject) -> tuple[SessionSource, str]:
        return data.draw(st.sampled_from(self.pool), label="source")

    def draw_key(self, data: st.DataObject) -> str:
        """Mostly (3 in 4) a key the model knows, so that operations pile up on it."""
        if self.entries and data.draw(st.integers(0, 3), label="known key") > 0:
            return data.draw(st.sampled_from(sorted(self.entries)), label="key")
        return data.draw(st.sampled_from((*KEYS, UNKNOWN_KEY)), label="key")

    def maybe_message_on(self, data: st.DataObject, key: str) -> None:
        """Often the next thing to happen to a key just flagged is a message on it."""
        matching = [pick for pick in SOURCES if pick[1] == key]
        if matching and data.draw(st.booleans(), label="then a message"):
            self.route(*data.draw(st.sampled_from(matching), label="source"))

    def ids_of(self, key: str) -> list[str]:
        # Creation order, not sorted: ids end in random hex, and draws must pick the same
        # session when Hypothesis replays a failing example.
        return [sid for sid, s in self.sessions.items() if s.session_key == key]

    def start_session(
        self, key: str, returned: SessionEntry, origin: SessionSource, display_name: str | None
    ) -> ModelEntry:
        """Record the new session id the store chose (checking it is new and well formed)."""
        sid = returned.session_id
        assert SESSION_ID.match(sid), sid
        assert sid.startswith(self.now.strftime("%Y%m%d_%H%M%S_")), (sid, self.now)
        assert sid not in self.sessions, "a session id was reused"
        self.sessions[sid] = ModelSession(key, created_at=self.now)
        entry = ModelEntry(
            session_id=sid, updated_at=self.now, origin=origin, display_name=display_name
        )
        self.entries[key] = entry
        return entry

    def check_entry(self, key: str, actual: SessionEntry | None) -> None:
        expected = self.entries[key]
        assert actual is not None, key
        session = self.sessions[expected.session_id]
        assert actual.session_key == key
        assert actual.session_id == expected.session_id
        assert actual.created_at == session.created_at
        assert actual.updated_at == expected.updated_at
        assert actual.origin == expected.origin
        assert actual.display_name == expected.display_name
        assert actual.platform == expected.origin.platform
        assert actual.chat_type == expected.origin.chat_type
        flags = (
            "was_auto_reset",
            "auto_reset_reason",
            "reset_had_activity",
            "is_fresh_reset",
            "suspended",
            "resume_pending",
            "resume_reason",
            "last_resume_marked_at",
        )
        assert {f: getattr(actual, f) for f in flags} == {f: getattr(expected, f) for f in flags}
        assert not actual.expiry_finalized
        assert {c: getattr(actual, c) for c in COUNTERS} == session.counters
        if expected.cost_status is not None:
            assert actual.cost_status == expected.cost_status
        if expected.last_prompt_tokens is not None:
            assert actual.last_prompt_tokens == expected.last_prompt_tokens

    def check_transcripts(self, session_ids: list[str]) -> None:
        for sid in session_ids:
            assert self.run(self.store.load_transcript(sid)) == self.sessions[sid].messages, sid

    def check_mirror(self) -> None:
        data = json.loads((self.directory / "sessions.json").read_bytes())
        assert set(data) == set(self.entries)
        for key, raw in data.items():
            assert raw["session_id"] == self.entries[key].session_id
            assert SessionEntry.from_dict(raw).updated_at == self.entries[key].updated_at

    # --- rules ---------------------------------------------------------------------------

    def route(self, source: SessionSource, key: str) -> SessionEntry:
        """get_or_create_session, checked against the model's prediction."""
        entry = self.run(self.store.get_or_create_session(source))
        old = self.entries.get(key)
        if old is None:
            outcome = "created"
            self.start_session(key, entry, source, source.chat_name)
        elif old.suspended:
            outcome = "suspended"
        elif old.resume_pending:
            outcome = "resume_pending"
            old.updated_at = self.now  # same id; the flag stays until clear_resume_pending
        else:
            outcome = predicted_reset(key, old.updated_at, self.now) or "touched"
            if outcome == "touched":
                old.updated_at = self.now
        if old is not None and outcome in ("suspended", "idle", "daily"):
            had_activity = self.sessions[old.session_id].counters["total_tokens"] > 0
            new = self.start_session(key, entry, source, source.chat_name)
            new.was_auto_reset, new.auto_reset_reason = True, outcome
            new.reset_had_activity = had_activity
        event(f"get_or_create: {outcome}")
        self.check_entry(key, entry)
        return entry

    def append_message(self, session_id: str, message: dict[str, Any]) -> None:
        self.run(self.store.append_to_transcript(session_id, message))
        self.sessions[session_id].messages.append(message)

    def add_usage(self, key: str, usage: TokenUsage, last_prompt: int | None) -> None:
        """update_session, checked against the model's prediction."""
        entry = self.run(self.store.update_session(key, last_prompt, usage=usage))
        expected = self.entries.get(key)
        if expected is None:
            assert entry is None
            return
        counters = self.sessions[expected.session_id].counters
        for name in COUNTERS[:4]:
            counters[name] += getattr(usage, name)
        counters["total_tokens"] += usage.input_tokens + usage.output_tokens
        counters["estimated_cost_usd"] += usage.estimated_cost_usd
        if usage.estimated_cost_usd:
            expected.cost_status = "estimated"
        if last_prompt is not None:
            expected.last_prompt_tokens = last_prompt
        expected.updated_at = self.now
        self.check_entry(key, entry)

    # --- rules ---------------------------------------------------------------------------

    @initialize(
        day=st.sampled_from(START_DAYS),
        # Minutes from 4:00: often just before it, so short steps cross the boundary.
        minutes=st.integers(-90, 0) | st.integers(-180, 180) | st.integers(-1440, 1440),
        # A few sources per run, so that operations pile up on the same keys.
        pool=st.lists(st.sampled_from(SOURCES), min_size=1, max_size=3, unique=True),
    )
    def start(self, day: datetime, minutes: int, pool: list[tuple[SessionSource, str]]) -> None:
        local_boundary = day.replace(hour=AT_HOUR, tzinfo=NEW_YORK)
        self.now = (local_boundary + timedelta(minutes=minutes)).astimezone(UTC)
        self.clock.move_to(self.now)
        self.pool = pool
        self.route(*pool[0])  # so every rule has a key to work on from the first step

    @rule(data=st.data(), minutes=st.sampled_from(CLOCK_STEPS), then_message=st.booleans())
    def advance_clock(self, data: st.DataObject, minutes: int, then_message: bool) -> None:
        """Time passes (in absolute time: a wall-clock hour may be skipped or repeated),
        then perhaps a message arrives, so routing often sees fresh clock changes."""
        self.now += timedelta(minutes=minutes)
        self.clock.shift(timedelta(minutes=minutes))
        assert datetime.now(UTC) == self.now
        if then_message:
            self.route(*self.draw_source(data))

    @rule(data=st.data())
    def get_or_create(self, data: st.DataObject) -> None:
        self.route(*self.draw_source(data))

    @rule(data=st.data(), text=texts, reply=contents, usage=usages)
    def turn(self, data: st.DataObject, text: str, reply: Any, usage: TokenUsage) -> None:
        """What the runner does for one message: route, record both sides, count tokens."""
        source, key = self.draw_source(data)
        entry = self.route(source, key)
        self.append_message(entry.session_id, {"role": "user", "content": text})
        self.append_message(entry.session_id, {"role": "assistant", "content": reply})
        self.add_usage(key, usage, usage.input_tokens)
        self.check_transcripts([entry.session_id])

    @rule(data=st.data(), op=st.sampled_from(("append", "rewind", "rewrite")))
    def edit_transcript(self, data: st.DataObject, op: str) -> None:
        """One transcript operation on a key's current session (one rule, not three, so
        that Hypothesis' per-example rule selection leaves more room for the others)."""
        key = data.draw(st.sampled_from(sorted(self.entries)), label="key")
        sid = self.entries[key].session_id
        if op == "append":
            self.append_message(sid, data.draw(messages, label="message"))
        elif op == "rewind":
            n = data.draw(st.integers(1, 3), label="n")
            result = self.run(self.store.rewind_session(sid, n))
            assert result == rewind_model(self.sessions[sid].messages, n)
        else:
            new_messages = data.draw(st.lists(messages, max_size=4), label="messages")
            assert self.run(self.store.rewrite_transcript(sid, new_messages)) == len(new_messages)
            self.sessions[sid].messages = list(new_messages)
        self.check_transcripts([sid])

    @rule(data=st.data(), usage=usages, last_prompt=st.none() | st.integers(0, 10_000))
    def update_session(
        self, data: st.DataObject, usage: TokenUsage, last_prompt: int | None
    ) -> None:
        self.add_usage(self.draw_key(data), usage, last_prompt)

    @rule(data=st.data())
    def suspend(self, data: st.DataObject) -> None:
        key = self.draw_key(data)
        assert self.run(self.store.suspend_session(key)) == (key in self.entries)
        if key in self.entries:
            self.entries[key].suspended = True
        self.maybe_message_on(data, key)

    @rule(data=st.data(), reason=st.sampled_from(RESUME_REASONS))
    def mark_resume_pending(self, data: st.DataObject, reason: str) -> None:
        key = self.draw_key(data)
        expected = self.entries.get(key)
        accepted = expected is not None and not expected.suspended
        assert self.run(self.store.mark_resume_pending(key, reason)) == accepted
        if accepted:
            expected.resume_pending, expected.resume_reason = True, reason
            expected.last_resume_marked_at = self.now
        self.maybe_message_on(data, key)

    @rule(data=st.data())
    def clear_resume_pending(self, data: st.DataObject) -> None:
        key = self.draw_key(data)
        expected = self.entries.get(key)
        pending = expected is not None and expected.resume_pending
        assert self.run(self.store.clear_resume_pending(key)) == pending
        if pending:
            expected.resume_pending, expected.resume_reason = False, None

    @rule(data=st.data(), display_name=st.none() | st.sampled_from(("Renamed", "Other")))
    def reset_session(self, data: st.DataObject, display_name: str | None) -> None:
        key = self.draw_key(data)
        entry = self.run(self.store.reset_session(key, display_name))
        old = self.entries.get(key)
        if old is None:
            assert entry is None
            return
        assert entry is not None
        new = self.start_session(key, entry, old.origin, display_name or old.display_name)
        new.is_fresh_reset = True
        self.check_entry(key, entry)

    @rule(data=st.data())
    def switch_session(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.entries)), label="key")
        # Mostly an earlier id of this key; else any id ever created (this key's current
        # one, another key's) or one that never existed.
        current = self.entries[key].session_id
        earlier = [sid for sid in self.ids_of(key) if sid != current]
        target = data.draw(
            (st.sampled_from(earlier) if earlier else st.nothing())
            | (st.sampled_from(earlier) if earlier else st.nothing())
            | st.just(current)
            | st.sampled_from(list(self.sessions))
            | st.just("20260101_000000_deadbeef"),
            label="target",
        )
        entry = self.run(self.store.switch_session(key, target))
        expected = self.entries[key]
        if target not in self.ids_of(key):
            assert entry is None
            return
        if target != expected.session_id:  # switching to the current one changes nothing
            expected.session_id = target
            expected.updated_at = self.now
            expected.suspended = expected.resume_pending = False
            expected.was_auto_reset = expected.is_fresh_reset = False
            expected.resume_reason = None
            expected.cost_status = expected.last_prompt_tokens = None
        self.check_entry(key, entry)
        self.check_transcripts([target])

    @rule()
    def close_and_reopen(self) -> None:
        self.run(self.store.close())
        self.check_mirror()  # close writes the final copy
        self.store = self.run(SessionStore(self.directory, CONFIG).open())
        self.check_transcripts(list(self.sessions))
        self.check_lookups()

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def index_matches_model(self) -> None:
        listed = self.run(self.store.list_sessions())
        assert sorted(e.session_key for e in listed) == sorted(self.entries)
        times = [e.updated_at for e in listed]
        assert times == sorted(times, reverse=True)
        for entry in listed:
            self.check_entry(entry.session_key, entry)

    def check_lookups(self) -> None:
        for sid, session in self.sessions.items():
            found = self.run(self.store.lookup_by_session_id(sid))
            if self.entries[session.session_key].session_id == sid:
                assert found is not None and found.session_key == session.session_key
            else:  # earlier sessions of a key are not routed to
                assert found is None

    @invariant()
    def expired_entries_match_policy(self) -> None:
        # The expiry watcher's query: the reset policy checked for every key at every step,
        # whether or not a message arrives (no entry is ever expiry-finalized here).
        expected = {}
        for key, entry in self.entries.items():
            reason = predicted_reset(key, entry.updated_at, self.now)
            if reason is not None:
                expected[key] = reason
                event(f"expired: {reason}")
        expired = self.run(self.store.expired_entries())
        assert sorted(e.session_key for e in expired) == sorted(expected)

    @invariant()
    def mirror_and_lookups_match_model(self) -> None:
        # Every few steps only, to keep each example (and shrinking a failure) quick.
        self.steps += 1
        if self.steps % EVERY_FEW_STEPS == 0:
            self.run(self.store.flush_mirror())
            self.check_mirror()
            self.check_lookups()


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    # Shrink only the first failure found: each distinct one costs minutes to shrink.
    report_multiple_bugs=False,
)
TestStoreModel = StoreMachine.TestCase
