"""The turn engine: sessions' lanes and the turns that run in them.

    accept:  a message to an idle session is accepted and its turn begun in one
             transaction (`accept_and_start`); to a busy one it waits in the session's
             queue (`submit`); a fast command answers inline, one that calls a model
             (`LANE_COMMANDS`) is queued like a turn (`dispatch`)
    lane:    the session's worker: turn -> next from the queue -> turn ... until the
             queue is empty (its turns and lane commands, one at a time)
    turn:    begin (session, user message, marker) -> agent (`AgentCall`) -> finish
             (reply, counters, ledger; the next waiting turn begun in the same
             transaction, `finish_turn`) -> send the recorded chunks (`TurnRunner`)

One turn runs per session key at a time; different keys run concurrently, at most
`agent.max_concurrent_turns` agent calls at once. Every step that matters after a crash
is one transaction in the journal (`gateway.store.turnlog`); `recovery` completes
whatever a crash interrupted. Where a session runs (this process, or one replica of
several) is the placement's (`placement`); the engine tells it through `LaneHooks`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import structlog

from adapters.base import PlatformAdapter
from config import GatewayConfig
from gateway.domain.command_syntax import LANE_COMMANDS, Command, MessageKind, classify
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.domain.session import Platform, agent_id_of_key, is_shared_multi_user_session
from gateway.memory.summaries import Memory
from gateway.ops.metrics import Metrics
from gateway.runner import commands
from gateway.runner.agent_call import AgentCall, TurnOutcome
from gateway.runner.delivery import Delivery
from gateway.runner.ports import CommandContext, LaneHooks, TaskHooks
from gateway.runner.queue import Job, LaneCommand, QueueFull, SessionQueue
from gateway.runner.turn import TurnRunner
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.tools.registry import TurnTools

log = structlog.get_logger("gateway.run")

# Read on every turn: a module constant costs a fraction of an enum member's look-up.
_A2A = Platform.A2A


def in_lane(command: Command | None) -> bool:
    """Does this command run in its session's lane (`command_syntax.LANE_COMMANDS`)?"""
    return command is not None and command.name in LANE_COMMANDS


class _Unplaced:
    """Lane hooks before the runner names its placement: nothing to tell."""

    def took(self, key: str, inbox_ids: Iterable[int]) -> None:
        pass

    def lane_ended(self, key: str) -> None:
        pass


class TurnEngine:
    """The one owner of per-session turn state: lanes, queues, running turns."""

    def __init__(
        self,
        config: GatewayConfig,
        adapters: Mapping[Platform, PlatformAdapter],
        turnlog: TurnLog,
        memory: Memory,
        metrics: Metrics,
        delivery: Delivery,
        asking: AgentCall,
        turns: TurnRunner,
        commands: CommandContext,
    ) -> None:
        self.config = config
        self.adapters = adapters
        self.turnlog = turnlog
        self.memory = memory
        self.metrics = metrics
        self.delivery = delivery
        self.asking = asking
        self.turns = turns
        turns.lane = self
        self.commands = commands
        self.placement: LaneHooks = _Unplaced()
        #: the agent-task service, told of the turns of A2A sessions (platform `a2a`)
        self.tasks: TaskHooks | None = None
        self.draining = False  # set by a shutdown: no next turn begins
        self.running: dict[str, MessageEvent] = {}  # key -> the event its lane runs now
        self._queues: dict[str, SessionQueue] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        # The next turn of a key, begun in its previous turn's last transaction.
        self._next_begun: dict[str, tuple[MessageEvent, TurnStart]] = {}
        # Background summaries yield to turns: of their own session always, of their
        # agent's other sessions for a bounded time (`gateway.memory.summaries`).
        self._lanes_per_agent: dict[str, int] = {}

    # --- per-session state ------------------------------------------------------------------

    def is_busy(self, key: str) -> bool:
        return key in self._workers

    def busy_sessions(self) -> int:
        return len(self._workers)

    def agent_busy(self, key: str) -> bool:
        """Does a lane of `key`'s agent run (its summaries wait for a bounded time)?"""
        return self._lanes_per_agent.get(agent_id_of_key(key), 0) > 0

    def queue_depth(self, key: str) -> int:
        queue = self._queues.get(key)
        return queue.depth if queue else 0

    def total_queue_depth(self) -> int:
        return sum(q.depth for q in self._queues.values())

    async def wait_lane(self, key: str) -> None:
        """Until `key`'s lane (if any) has ended."""
        await asyncio.gather(*filter(None, [self._workers.get(key)]))

    # --- accepting work ---------------------------------------------------------------------

    async def dispatch(
        self, key: str, event: MessageEvent, kind: MessageKind, command: Command | None
    ) -> Accepted:
        """An accepted message: a command answered inline or queued in its lane, or a
        turn started or queued."""
        if kind is MessageKind.COMMAND and command is not None:
            self.metrics.commands_total += 1
            if in_lane(command):
                accepted = await self.submit(key, LaneCommand(event, command), fifo=True)
                return replace(accepted, detail=accepted.detail or command.name)
            return await commands.dispatch(self.commands, event, key, command)
        return await self.submit(key, event, fifo=kind is MessageKind.QUEUE)

    async def requeue(self, key: str, event: MessageEvent, kind: MessageKind) -> None:
        """An accepted message not yet answered (start-up recovery, a replica picking up
        a session): queued as it was on arrival. A command left open is a lane command
        (inline ones are answered as they are accepted; another replica journals both)."""
        if kind is not MessageKind.COMMAND:
            await self.submit(key, event, fifo=kind is MessageKind.QUEUE)
            return
        adapter = self.adapters.get(event.source.platform)
        _, command = classify(event.text.strip(), adapter.bot_username if adapter else None)
        if not in_lane(command):  # answered inline: settled first, as on arrival
            await self.turnlog.close_inbox(list(event.inbox_ids))
        if command is not None:
            await self.dispatch(key, event, MessageKind.COMMAND, command)

    async def accept_and_start(
        self,
        key: str,
        event: MessageEvent,
        kind: MessageKind,
        text: str | None = None,
        claim: Callable[[Any], bool] | None = None,
        *,
        claim_fences: bool = False,
    ) -> Accepted:
        """A message to an idle session: accept it and begin its turn in one transaction.

        The worker is registered first, so messages arriving meanwhile queue behind it."""
        begun: asyncio.Future[tuple[int, TurnStart] | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._open_lane(key, self._session_worker(key, event, begun))
        if text is None:
            text = self.turn_text(event)
        try:
            result = await self.turnlog.accept_and_begin(
                event,
                key,
                kind,
                text,
                claim,
                claim_fences=claim_fences,
                running=self.asking.slot_free(),
            )
        except BaseException:
            if not begun.done():
                begun.set_result(None)  # nothing was accepted: the worker moves on
            raise
        if result is None:
            if not begun.done():
                begun.set_result(None)
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        self.placement.took(key, (result[0],))
        if not begun.done():  # done: /stop cancelled the worker meanwhile
            begun.set_result(result)
        return Accepted(AcceptStatus.STARTED, session_key=key)

    async def submit(self, key: str, event: Job, *, fifo: bool = False) -> Accepted:
        """Start a turn (or lane command) now, or park it behind the running one."""
        if key not in self._workers:
            self._open_lane(key, self._session_worker(key, event))
            return Accepted(AcceptStatus.STARTED, session_key=key)
        queue = self._queues.setdefault(key, SessionQueue(self.config.queue.max_depth))
        try:
            if fifo or isinstance(event, LaneCommand):
                queue.enqueue_fifo(event)
            else:
                queue.enqueue_pending(event)
        except QueueFull:
            self.metrics.messages_refused_total += 1
            await self.turnlog.abandon_inbox(list(event.inbox_ids))
            await self.delivery.deliver(
                event.source,
                f"Too many messages are waiting ({queue.depth}); this one was not queued. "
                "Wait for the current reply or /stop it.",
                event.reply_to,
            )
            return Accepted(AcceptStatus.REFUSED, session_key=key, detail="queue full")
        return Accepted(AcceptStatus.QUEUED if fifo else AcceptStatus.PENDING, session_key=key)

    # --- stopping work ----------------------------------------------------------------------

    async def cancel_session_work(self, key: str) -> bool:
        """Cancel the running turn and drop the queue of one session; True if one ran.

        The dropped messages are settled in the journal, so a restart does not revive them.
        """
        dropped: list[int] = []
        queue = self._queues.pop(key, None)
        if queue:
            dropped += queue.inbox_ids()
            queue.clear()
        task = self._workers.get(key)
        running = self.running.get(key)
        if running is not None:
            dropped += list(running.inbox_ids)
        begun_next = self._next_begun.pop(key, None)
        if begun_next is not None:
            dropped += list(begun_next[0].inbox_ids)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.metrics.turns_cancelled_total += 1
        if task is not None or dropped:
            await self.turnlog.abandon(key, dropped)
        return task is not None

    async def drop_queued(self, key: str, message_id: str) -> bool:
        """Take one waiting message (by its id) out of the session's queue, settled in
        the journal; False when it does not wait there."""
        queue = self._queues.get(key)
        if queue is None:
            return False
        job = queue.remove_fifo(
            lambda job: isinstance(job, MessageEvent) and job.message_id == message_id
        )
        if job is None:
            return False
        await self.turnlog.abandon_inbox(list(job.inbox_ids))
        return True

    async def cancel_all_turns(self) -> None:
        """Stop every turn at once, writing nothing; their markers let whoever runs the
        session next resume them."""
        self._queues.clear()
        self._next_begun.clear()
        tasks = list(self._workers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self, wait_seconds: float) -> list[str]:
        """Begin no next turn; let running turns finish up to `wait_seconds`, then cancel the
        rest. Returns the keys of the cancelled ones."""
        self.draining = True
        workers = dict(self._workers)
        if not workers:
            return []
        log.info("draining", running_turns=len(workers))
        _, late = await asyncio.wait(workers.values(), timeout=wait_seconds)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return [key for key, task in workers.items() if task in late]

    # --- the lane -----------------------------------------------------------------------------

    def _open_lane(self, key: str, work: Coroutine[Any, Any, None]) -> None:
        """The session's worker: its turns run one at a time from here until its queue is
        empty. Its agent counts it as busy (background summaries yield to it)."""
        self._workers[key] = asyncio.create_task(work, name=f"session:{key}")
        agent_id = agent_id_of_key(key)
        self._lanes_per_agent[agent_id] = self._lanes_per_agent.get(agent_id, 0) + 1
        self.memory.turn_arrived(key)

    def _close_lane(self, key: str) -> None:
        if self._workers.pop(key, None) is None:
            return
        agent_id = agent_id_of_key(key)
        left = self._lanes_per_agent.get(agent_id, 1) - 1
        if left > 0:
            self._lanes_per_agent[agent_id] = left
        else:
            self._lanes_per_agent.pop(agent_id, None)
        self.memory.turns_changed()

    async def _session_worker(
        self,
        key: str,
        event: Job | None,
        begun: asyncio.Future[tuple[int, TurnStart] | None] | None = None,
    ) -> None:
        try:
            start = None
            if begun is not None:  # accepted and begun by `accept_and_start`
                accepted = await begun
                if accepted is not None and isinstance(event, MessageEvent):
                    inbox_id, start = accepted
                    event = event.with_inbox_ids((inbox_id,))
                else:
                    queue = self._queues.get(key)
                    event = queue.pop_next() if queue else None
            while event is not None:
                self.running[key] = event.event if isinstance(event, LaneCommand) else event
                try:
                    if isinstance(event, LaneCommand):
                        await self._run_command(key, event)
                    elif (
                        event.source.platform is _A2A
                        and self.tasks is not None
                        and not await self.tasks.turn_began(key, event)
                    ):
                        # Its task was canceled meanwhile (on another replica, or while
                        # begun by the previous turn's finish): settled, not run.
                        await self.turnlog.abandon(key, list(event.inbox_ids))
                    else:
                        await self.turns.run(key, event, start)
                except Exception:
                    # An internal failure (the store, a bug): keep the session usable. The
                    # turn answered its messages with an error notice, or, when even that
                    # could not be recorded, its marker stays for the next start.
                    self.metrics.turn_errors_total += 1
                    log.exception("turn_internal_error", session_key=key)
                start = None
                if self.draining:
                    # What is still queued stays accepted in the inbox, and a turn begun
                    # already keeps its marker: the next start runs both.
                    break
                begun_next = self._next_begun.pop(key, None)
                if begun_next is not None:
                    event, start = begun_next
                    continue
                queue = self._queues.get(key)
                event = queue.pop_next() if queue else None
        finally:
            self._next_begun.pop(key, None)
            self.running.pop(key, None)
            self._close_lane(key)
            queue = self._queues.get(key)
            if queue is not None and not queue:
                del self._queues[key]
            self.placement.lane_ended(key)

    async def _run_command(self, key: str, job: LaneCommand) -> None:
        """A lane command: run it, then record its answer and settle its message in one
        transaction, and send the answer. A crash before that transaction leaves the
        message open in the inbox, and the next start runs the command again (a
        /compress then condenses what is left): answered once, never lost."""
        event, command = job.event, job.command
        typing = self.delivery.start_typing(event.source)
        try:
            reply = await commands.reply_of(self.commands, event, key, command)
        finally:
            if typing is not None:
                typing.cancel()
        text = reply if isinstance(reply, str) else f"/{command.name} done."
        chunks = self.delivery.split(event.source, text)
        ids = await self.turnlog.answer_unbegun(key, event, chunks)
        await self.delivery.send_recorded(
            event.source, list(zip(ids, chunks, strict=False)), event.reply_to
        )

    def turn_text(self, event: MessageEvent) -> str:
        """The user message as stored: prefixed with its sender in a shared session."""
        source = event.source
        text = event.text.strip()
        if is_shared_multi_user_session(
            source,
            group_sessions_per_user=self.config.group_sessions_per_user,
            thread_sessions_per_user=self.config.thread_sessions_per_user,
        ):
            text = f"[{source.user_name or source.user_id or 'someone'}] {text}"
        return text

    async def finish_turn(
        self,
        key: str,
        begun: TurnStart,
        event: MessageEvent,
        outcome: TurnOutcome,
        chunks: list[str],
        tools: TurnTools | None = None,
        settles: Sequence[Callable[[Any], object]] = (),
        edits: Sequence[str] | None = None,
        *,
        token_factor: float | None = None,
    ) -> list[int]:
        """Record the turn's end (its tool rounds and what its tools wrote included), and
        begin the key's next waiting turn in the same transaction (it then runs without
        a begin of its own)."""
        queue = self._queues.get(key)
        waiting = queue.pop_next_turn() if queue and not self.draining else None
        then = (waiting, self.turn_text(waiting)) if waiting is not None else None
        task = self.tasks if event.source.platform is _A2A else None
        if task is not None:  # an agent task ends with its turn, in the same transaction
            settles = (*settles, task.settle(event, outcome.reply, outcome.text, outcome.usage))
        try:
            ids, next_start = await self.turnlog.finish(
                key,
                begun,
                event,
                reply=outcome.reply,
                usage=outcome.usage,
                chunks=chunks,
                then=then,
                messages=outcome.messages,
                writes=tools.writes() if tools is not None else (),
                # The tool-call journal goes whatever the outcome.
                settles=(*settles, *tools.settles()) if tools is not None else settles,
                edits=edits,
                attachments=[a.to_dict() for a in outcome.attachments],
                token_factor=token_factor,
            )
        except BaseException:
            if waiting is not None and queue is not None:
                # Not begun (or begun and committed while this waited: its marker then
                # runs it once, and the inbox row's state keeps it from running twice).
                queue.put_back(waiting)
            raise
        if task is not None:
            task.settled(event)
        if waiting is not None and next_start is not None:
            self._next_begun[key] = (waiting, next_start)
        return ids
