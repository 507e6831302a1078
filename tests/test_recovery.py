"""Start-up recovery in-process: held messages, re-queued inbox, resent ledger rows."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

from adapters.base import AcceptStatus, MessageEvent, PlatformAdapter, SendResult
from config import GatewayConfig
from gateway.agents.protocol import TurnRequest, TurnResult
from gateway.run import GatewayRunner
from gateway.runner.recovery import RESTART_COUNTS, stuck_notice
from gateway.session import Platform, SessionSource, schedule_session_key
from gateway.store.session_store import SessionStore
from tests.waiting import wait_for

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="c1", user_id="u1")
CONFIG = GatewayConfig.model_validate({"timezone": "UTC"})
KEY = "agent:main:local:dm:c1"
BLOCKED_NOTICE = stuck_notice([{"text": "block forever"}])


class ProbeAdapter(PlatformAdapter):
    """Delivers `arriving` the moment it starts, i.e. while recovery is still running."""

    platform = Platform.LOCAL

    def __init__(self, arriving: list[MessageEvent] | None = None, fail_sends: int = 0):
        super().__init__()
        self.arriving = arriving or []
        self.statuses: list[AcceptStatus] = []
        self.sent: list[str] = []
        self.fail_sends = fail_sends

    async def start(self) -> None:
        assert self.gateway is not None
        for event in self.arriving:
            self.statuses.append((await self.gateway.handle_message(event)).status)

    async def stop(self) -> None:
        pass

    async def send(self, target, text, reply_to=None, *, delivery_id=None) -> SendResult:
        if self.fail_sends:
            self.fail_sends -= 1
            raise ConnectionError("platform down")
        self.sent.append(text)
        return SendResult(str(delivery_id))


class Echo:
    def __init__(self, session_key: str) -> None:
        pass

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if "block" in request.text:
            await asyncio.Event().wait()
        return TurnResult(f"echo: {request.text}")

    async def close(self) -> None:
        pass


def event(text: str, message_id: str) -> MessageEvent:
    return MessageEvent(source=SOURCE, text=text, message_id=message_id)


async def running_marker(runner: GatewayRunner) -> bool:
    """The turn's marker is committed and says its agent runs (what a kill leaves)."""
    return any(turn["running"] for turn in await runner.turnlog.open_turns())


async def answers_the_marker(runner: GatewayRunner, probe: ProbeAdapter) -> None:
    """Send a marker message to the chat and wait for its answer, the first one sent. The
    session's turns run in order: a resumed turn or a re-queued message would be
    answered before it (a blocking one, never: the marker's answer would never come)."""
    await runner.handle_message(event("marker", "m-marker"))
    await wait_for(lambda: probe.sent)
    (answer,) = probe.sent
    assert answer.endswith("echo: marker"), answer


async def crash(runner: GatewayRunner) -> None:
    """Stop a runner the way kill -9 would leave its files: no drain, no clean marker.
    Its background loops end too, as a killed process's do: none of them may poll the
    closed store, or hold the memory index's files, beside the runner started next."""
    await runner.cancel_all_turns()  # writes nothing: the markers stay, as after kill -9
    await runner.scheduler.stop()
    await runner.housekeeper.stop()
    await runner.recall.close()
    await runner.store.close()


@contextlib.asynccontextmanager
async def restarted(home: Path) -> AsyncIterator[tuple[GatewayRunner, ProbeAdapter]]:
    """A new gateway on `home` (after `crash`) with a fresh probe; stopped on the way out."""
    probe = ProbeAdapter()
    runner = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=home)
    await runner.start()
    try:
        yield runner, probe
    finally:
        await runner.stop()


async def test_messages_arriving_during_recovery_wait_for_the_resumed_turn(
    tmp_path: Path,
) -> None:
    first = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(event("block me", "m1"))
    await wait_for(lambda: bool(first.engine.running))
    await wait_for(lambda: running_marker(first))  # its marker says it runs
    await crash(first)

    class Resumed(Echo):
        async def run_turn(self, request: TurnRequest) -> TurnResult:
            return TurnResult(f"echo: {request.text}")

    probe = ProbeAdapter([event("arrived during recovery", "m2")])
    second = GatewayRunner(CONFIG, [probe], agent_factory=Resumed, home=tmp_path)
    await second.start()
    try:
        assert probe.statuses == [AcceptStatus.PENDING]  # held, not run early
        await wait_for(lambda: len(probe.sent) == 2)
        assert probe.sent == ["echo: block me", "echo: arrived during recovery"]
    finally:
        await second.stop()


async def test_unsent_chunks_are_sent_once_after_a_restart(tmp_path: Path) -> None:
    failing = ProbeAdapter(fail_sends=10)
    first = GatewayRunner(CONFIG, [failing], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(event("hello", "m1"))
    await wait_for(lambda: failing.fail_sends < 10)  # the send was tried and failed
    await wait_for(lambda: first.turnlog.pending_outbound())  # recorded, not acknowledged
    await crash(first)

    async with restarted(tmp_path) as (second, probe):
        assert probe.sent == ["echo: hello"]
        assert await second.resend_pending() == 0  # acknowledged now: never again
        assert probe.sent == ["echo: hello"]


async def test_stop_drops_queued_messages_for_good(tmp_path: Path) -> None:
    probe = ProbeAdapter()
    first = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(event("block", "m1"))
    await wait_for(lambda: bool(first.engine.running))
    assert (await first.handle_message(event("/queue later", "m2"))).status == AcceptStatus.QUEUED
    await first.handle_message(event("/stop", "m3"))
    await crash(first)

    async with restarted(tmp_path) as (second, probe):
        assert await second.turnlog.open_inbox() == []
        assert await second.turnlog.open_turns() == []
        await answers_the_marker(second, probe)  # neither the stopped turn nor its queue


async def test_stop_while_a_first_message_is_accepted_drops_it(tmp_path: Path) -> None:
    """A message to an idle session is accepted and begun in one transaction; a /stop
    that lands while that transaction is in flight still drops it for good."""
    probe = ProbeAdapter()
    first = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await first.start()
    handling = asyncio.create_task(first.handle_message(event("block", "m1")))
    await asyncio.sleep(0)  # its worker is registered, its transaction queued for commit
    assert first.is_busy(KEY) and not first.engine.running
    assert await first.cancel_session_work(KEY)  # what /stop does, inside that window
    assert (await handling).status == AcceptStatus.STARTED
    assert await first.turnlog.open_inbox() == []
    assert await first.turnlog.open_turns() == []
    await crash(first)

    async with restarted(tmp_path) as (second, probe):
        await answers_the_marker(second, probe)  # the dropped message does not come back


async def test_a_redelivered_first_message_is_a_duplicate_and_the_queue_still_runs(
    tmp_path: Path,
) -> None:
    probe = ProbeAdapter()
    runner = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await runner.start()
    try:
        assert (await runner.handle_message(event("one", "m1"))).status == AcceptStatus.STARTED
        await wait_for(lambda: probe.sent == ["echo: one"] and not runner.busy_sessions())
        # The same platform id again, to the now idle session, with a new message right
        # behind it: the redelivery is refused, the new one still gets its turn.
        again, after = await asyncio.gather(
            runner.handle_message(event("one", "m1")), runner.handle_message(event("two", "m2"))
        )
        assert again.status == AcceptStatus.DUPLICATE
        assert after.status in (AcceptStatus.PENDING, AcceptStatus.STARTED)
        await wait_for(lambda: probe.sent == ["echo: one", "echo: two"])
    finally:
        await runner.stop()


async def test_a_crash_right_after_the_stuck_loop_guard_still_tells_the_user(
    tmp_path: Path,
) -> None:
    """The guard drops a turn and records its notice in one transaction: a kill before
    the notice went out (during the rest of start-up) sends it at the next start."""
    first = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(event("block forever", "m1"))
    await wait_for(lambda: bool(first.engine.running))
    [marker] = await first.turnlog.open_turns()
    await crash(first)
    # Two unclean starts already found this same turn in flight: the next one is the third.
    counts = {KEY: {"turn": marker["user_message_id"], "count": 2}}
    (tmp_path / RESTART_COUNTS).write_text(json.dumps(counts))

    second = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await second.store.open()
    await second.recovery.prepare()
    await second.recovery.mark()  # the guard fires here ...
    await second.store.close()  # ... and the process dies before resume() sent anything

    probe = ProbeAdapter()
    third = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await third.start()
    try:
        assert probe.sent == [BLOCKED_NOTICE]
        assert await third.turnlog.open_inbox() == []
        assert await third.turnlog.open_turns() == []
    finally:
        await third.stop()


async def test_a_resumed_shared_group_turn_asks_the_stored_message(tmp_path: Path) -> None:
    config = GatewayConfig.model_validate({"timezone": "UTC", "group_sessions_per_user": False})
    source = SessionSource(
        platform=Platform.LOCAL, chat_id="g1", chat_type="group", user_id="u1", user_name="Ann"
    )
    first = GatewayRunner(config, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(MessageEvent(source=source, text="block me", message_id="m1"))
    await wait_for(lambda: bool(first.engine.running))
    await wait_for(lambda: running_marker(first))
    await crash(first)

    asked: list[str] = []

    class Recorder(Echo):
        async def run_turn(self, request: TurnRequest) -> TurnResult:
            asked.append(request.text)
            return TurnResult(f"echo: {request.text}")

    probe = ProbeAdapter()
    second = GatewayRunner(config, [probe], agent_factory=Recorder, home=tmp_path)
    await second.start()
    try:
        await wait_for(lambda: len(probe.sent) == 1)
        assert asked == ["[Ann] block me"]
        key = "agent:main:local:group:g1"
        entry = await second.store.get_entry(key)
        transcript = await second.store.load_transcript(entry.session_id)
        assert [m["content"] for m in transcript] == ["[Ann] block me", "echo: [Ann] block me"]
    finally:
        await second.stop()


async def test_a_first_start_is_clean_and_a_crash_is_not(tmp_path: Path) -> None:
    first = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await first.start()
    assert first.recovery.was_clean  # nothing existed yet: not a crash
    await crash(first)
    second = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await second.start()
    try:
        assert not second.recovery.was_clean
    finally:
        await second.stop()
    third = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await third.start()
    try:
        assert third.recovery.was_clean  # the stop above was clean
    finally:
        await third.stop()


class UnreachableAdapter(ProbeAdapter):
    """A platform that cannot start (its port taken, its server down)."""

    async def start(self) -> None:
        raise OSError("address already in use")


def _files(home: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(home.iterdir()) if p.is_file()}


async def test_a_start_that_fails_marks_nothing(tmp_path: Path) -> None:
    """Recovery decides before the adapters start but writes only once they are up: a
    start that fails in between leaves entries, markers, restart counts and the missing
    clean marker (the evidence of the crash) as they were, and does not count."""
    first = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Echo, home=tmp_path)
    await first.start()
    await first.handle_message(event("block forever", "m1"))
    await wait_for(lambda: bool(first.engine.running))
    [marker] = await first.turnlog.open_turns()
    await crash(first)
    counts = {KEY: {"turn": marker["user_message_id"], "count": 2}}
    (tmp_path / RESTART_COUNTS).write_text(json.dumps(counts))

    async def state() -> tuple[object, ...]:
        async with SessionStore(tmp_path / "sessions", CONFIG) as store:
            entry = await store.get_entry(KEY)
            turns = await store.read(lambda c: c.execute("SELECT * FROM turns").fetchall())
            inbox = await store.read(lambda c: c.execute("SELECT * FROM inbox").fetchall())
        return entry.to_dict(), turns, inbox, _files(tmp_path)

    before = await state()
    failing = GatewayRunner(CONFIG, [UnreachableAdapter()], agent_factory=Echo, home=tmp_path)
    try:
        await failing.start()
    except OSError:
        await failing.stop()
    else:
        raise AssertionError("the start should have failed")
    assert await state() == before  # no resume_pending, .clean_shutdown, status.json, counts

    # The failed start did not count: this one is the third unclean start, and the guard
    # fires exactly now.
    async with restarted(tmp_path) as (_, probe):
        await wait_for(lambda: probe.sent == [BLOCKED_NOTICE])


async def test_a_turn_that_fails_inside_the_gateway_still_answers(
    tmp_path: Path, monkeypatch
) -> None:
    """An unexpected error in the turn path (not the agent's: a bug, the store) answers
    the message with an error notice at once and settles it, instead of leaving it
    unanswered until some later restart; the session goes on working."""
    from gateway.runner.turn import INTERNAL_ERROR_TEXT

    probe = ProbeAdapter()
    runner = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await runner.start()
    try:
        prepare = runner.memory.prepare
        calls = 0

        def failing_once(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in the turn path")
            return prepare(*args, **kwargs)

        monkeypatch.setattr(runner.memory, "prepare", failing_once)
        await runner.handle_message(event("hello", "m1"))
        await wait_for(lambda: probe.sent == [INTERNAL_ERROR_TEXT])
        await wait_for(lambda: not runner.is_busy(KEY))
        assert await runner.turnlog.open_inbox() == []
        assert await runner.turnlog.open_turns() == []
        await runner.handle_message(event("again", "m2"))
        await wait_for(lambda: probe.sent == [INTERNAL_ERROR_TEXT, "echo: again"])
    finally:
        await runner.stop()


class Gated(Echo):
    """`first` waits for `RELEASE`; anything else never ends (the turn that kills)."""

    release: asyncio.Event

    async def run_turn(self, request: TurnRequest) -> TurnResult:
        if request.text == "first":
            await Gated.release.wait()
            return TurnResult("echo: first")
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


LONG = "please compare these two contracts clause by clause and list every difference"


async def test_the_stuck_loop_notice_names_each_set_aside_message_and_retry_runs_them_once(
    tmp_path: Path,
) -> None:
    """A stuck turn that merged several messages: the notice says how many were set
    aside and quotes the start of each; /retry runs them again as one turn, once."""
    Gated.release = asyncio.Event()
    first = GatewayRunner(CONFIG, [ProbeAdapter()], agent_factory=Gated, home=tmp_path)
    await first.start()
    await first.handle_message(event("first", "m1"))
    await wait_for(lambda: bool(first.engine.running))
    for text, message_id in (("summarise the report", "m2"), (LONG, "m3")):
        assert (await first.handle_message(event(text, message_id))).status == (
            AcceptStatus.PENDING
        )
    Gated.release.set()  # the merged turn of m2 and m3 begins, and never ends

    async def merged_turn_running() -> bool:
        turns = await first.turnlog.open_turns()
        return len(turns) == 1 and len(turns[0]["inbox_ids"]) == 2 and turns[0]["running"]

    await wait_for(merged_turn_running)
    [marker] = await first.turnlog.open_turns()
    await crash(first)
    counts = {KEY: {"turn": marker["user_message_id"], "count": 2}}
    (tmp_path / RESTART_COUNTS).write_text(json.dumps(counts))

    probe = ProbeAdapter()
    second = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await second.start()
    try:
        await wait_for(lambda: len(probe.sent) == 1)
        notice = probe.sent[0]
        assert notice == (
            "I was restarted several times while answering your 2 messages, so I stopped"
            " trying, set them aside and started a fresh session. Set aside:\n"
            '- "summarise the report"\n'
            f'- "{LONG[:60].rstrip()}…"\n'
            "Send /retry to run them again (once, as one message)."
        )
        assert len(await second.turnlog.set_aside_messages(KEY)) == 2

        await second.handle_message(event("/retry", "m4"))
        await wait_for(lambda: len(probe.sent) == 2)
        # In a fresh session (the stuck one was suspended), which the reply says first.
        fresh, reply = probe.sent[1].split("\n\n")
        assert "fresh start" in fresh and reply == f"echo: summarise the report\n{LONG}"
        await wait_for(lambda: not second.is_busy(KEY))
        assert await second.turnlog.set_aside_messages(KEY) == []  # once
        assert await second.turnlog.open_inbox() == []
        states = await second.store.read(
            lambda c: c.execute(
                "SELECT message_id, state FROM inbox WHERE message_id IN ('m2', 'm3')"
            ).fetchall()
        )
        assert sorted(states) == [("m2", "done"), ("m3", "done")]
    finally:
        await second.stop()


async def test_a_turn_that_only_waited_at_each_crash_is_not_counted(tmp_path: Path) -> None:
    """One agent slot, two chats whose turns both block: at each crash one turn runs
    (and kills the gateway) and the other waits for the slot. Only the running one
    counts. Which of the two takes the slot after a restart is not promised (both are
    resumed, and their reads may finish in either order), so the test follows whichever
    did: the waiting turn's count never moves, the running one's grows by one, and the
    one that ran at three crashes in a row is set aside while the other is resumed."""
    # A short drain: the last runner stops with the other turn blocked for good.
    agent = {"max_concurrent_turns": 1, "restart_drain_timeout": 0.5}
    config = GatewayConfig.model_validate({"timezone": "UTC", "agent": agent})
    other = SessionSource(platform=Platform.LOCAL, chat_id="c2", user_id="u2")
    other_key = "agent:main:local:dm:c2"
    texts = {KEY: "block forever", other_key: "block too"}
    probe = ProbeAdapter()
    runner = GatewayRunner(config, [probe], agent_factory=Echo, home=tmp_path)
    await runner.start()
    await runner.handle_message(event(texts[KEY], "m1"))
    await wait_for(lambda: bool(runner.engine.running))
    await runner.handle_message(MessageEvent(source=other, text=texts[other_key], message_id="n1"))

    async def one_runs_one_waits() -> str | None:
        """The key whose turn runs, once the other's waits for the slot."""
        turns = {t["session_key"]: t["running"] for t in await runner.turnlog.open_turns()}
        running = [key for key, runs in turns.items() if runs]
        return running[0] if set(turns) == set(texts) and len(running) == 1 else None

    counts: dict[str, dict[str, int]] = {}
    set_aside = waited = None
    live = True  # `runner` is started, not crashed: stopped on the way out
    try:
        for _ in range(8):  # three when one turn takes the slot at every start
            try:
                await wait_for(one_runs_one_waits)
                ran = await one_runs_one_waits()
            finally:
                await crash(runner)
                live = False
            assert ran is not None
            waited = other_key if ran == KEY else KEY
            probe = ProbeAdapter()
            runner = GatewayRunner(config, [probe], agent_factory=Echo, home=tmp_path)
            await runner.start()
            live = True
            after = json.loads((tmp_path / RESTART_COUNTS).read_text())
            assert after.get(waited) == counts.get(waited)  # it only waited: not counted
            if counts.get(ran, {}).get("count", 0) + 1 == 3:
                set_aside = ran
                assert ran not in after
                break
            assert after[ran]["count"] == counts.get(ran, {}).get("count", 0) + 1
            counts = after
        assert set_aside is not None and waited is not None, f"never three in a row: {counts}"
        assert probe.sent == [stuck_notice([{"text": texts[set_aside]}])]  # none for the other
        resumed = waited
        await wait_for(lambda: runner.is_busy(resumed) and bool(runner.engine.running))
        [turn] = await runner.turnlog.open_turns()
        assert turn["session_key"] == resumed
        await wait_for(lambda: _running_marker(runner, resumed))
    finally:
        if live:
            await runner.stop()


async def _running_marker(runner: GatewayRunner, key: str) -> bool:
    return any(t["session_key"] == key and t["running"] for t in await runner.turnlog.open_turns())


async def test_a_stuck_scheduled_run_is_named_with_schedule_run_not_retry(
    tmp_path: Path,
) -> None:
    """A scheduled job's run that kills the gateway three times is set aside like a
    chat's turn, but its session is the job's own, not the chat's: the notice in the
    chat names the task and `/schedule run`, never a /retry the chat could not use."""
    probe = ProbeAdapter()
    runner = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
    await runner.start()
    await runner.handle_message(event("/schedule add every 1h block forever", "s1"))
    await wait_for(lambda: any(text.startswith("Scheduled ") for text in probe.sent))
    schedule_id = probe.sent[-1].split()[1]
    await runner.handle_message(event(f"/schedule run {schedule_id}", "s2"))
    job_key = schedule_session_key("main", schedule_id)
    for _ in range(3):
        try:
            await wait_for(lambda runner=runner: _running_marker(runner, job_key))
        finally:
            await crash(runner)
        probe = ProbeAdapter()
        runner = GatewayRunner(CONFIG, [probe], agent_factory=Echo, home=tmp_path)
        await runner.start()
    try:
        await wait_for(lambda: any(t.startswith("I was restarted") for t in probe.sent))
        (notice,) = [t for t in probe.sent if t.startswith("I was restarted")]
        assert f"scheduled task {schedule_id}" in notice
        assert f"/schedule run {schedule_id}" in notice
        assert "/retry" not in notice
    finally:
        await runner.stop()
