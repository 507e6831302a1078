"""The runner's agent-task service: `AgentTasks` (gateway.domain.agent_tasks) over the
turn engine and the store.

    send:      validate -> the task's row (submitted; a resent message id finds its row)
               -> its message to the placement's intake as a turn of its own (FIFO
               behind a running turn, never merged) in the session of its context
    turn:      begins -> working (`turn_began`); ends -> completed with the reply, or
               failed with the error text, in the turn's finish transaction (`settle`),
               so a turn re-run after a crash ends its task once
    cancel:    as /stop on the session while the task's turn runs (the tasks queued
               behind it go too; on another replica: /stop handed to it), a queued task
               alone is dropped, a task not yet begun is skipped when its turn comes
    approval:  a tool call of the task's turn waiting for the user's yes makes it
               input-required (the question in `result_text`); the caller's next
               message to the context, `/approve` or `/deny`, is the answer
    subscribe: the row now, then what this process sees change (states, streamed
               deltas), and a bounded poll of the row for what another replica changes

A task's session: platform `a2a`, the context id as the DM chat, the caller as its user,
and the agent the request names (its key is built here, not by `routes:`). The event's
`message_id` and `source.message_id` are the task id: the inbox deduplicates a resent
message by it, and every later step (the turn's hooks, the channel's deltas) finds its
task without a look-up.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import structlog

from gateway.agents.roster import Roster
from gateway.domain.agent_tasks import TaskRecord, TaskRefused, TaskState, TaskUpdate
from gateway.domain.command_syntax import MessageKind, classify
from gateway.domain.events import AcceptStatus, MessageEvent
from gateway.domain.session import Platform, SessionSource, TokenUsage, build_session_key
from gateway.ops.metrics import Metrics
from gateway.runner.approvals import Approvals
from gateway.runner.engine import TurnEngine
from gateway.runner.placement import Placement
from gateway.runner.task_channel import TaskChannel
from gateway.store import agent_tasks as rows
from gateway.store.outage import StoreUnwritable
from gateway.store.pg import driver_errors
from gateway.store.session_store import SessionStore
from gateway.tools.approval import Verdict

log = structlog.get_logger("gateway.run")

#: task ids are uuid5 of (agent, caller, message id) in this namespace
TASK_NAMESPACE = uuid.UUID("9d7c3f52-5a0e-4b8e-9a51-6b1f0e2d7a43")
CONTEXT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch it
MAX_MESSAGE_ID_CHARS = 256
MAX_CALLER_CHARS = 512
MAX_TEXT_CHARS = 100_000
MAX_LIST = 100
MAX_CHAIN = 16  # past a2a.max_delegation_depth's bound: agent_call refuses before
MAX_CHAIN_ENTRY_CHARS = 2048  # an agent id, or a remote agent's URL
#: streamed deltas a subscriber may have waiting; past them a slow one loses deltas,
#: never a state change
MAX_PENDING_DELTAS = 256
#: how often a subscriber reads the row for changes made on another replica
POLL_SECONDS = 2.0
#: the caller of a native delegation: "session:<the calling session's key>"
NATIVE_CALLER_PREFIX = "session:"
_RETRY_SECONDS = 5.0
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: a message answering a waiting approval
_VERDICTS = {"/approve": Verdict.APPROVED, "/deny": Verdict.DENIED}


def task_id_of(agent_id: str, caller: str, message_id: str) -> str:
    """Deterministic: a message resent after a crash at any point is the same task."""
    return str(uuid.uuid5(TASK_NAMESPACE, "\x1f".join((agent_id, caller, message_id))))


class _Subscriber:
    """One subscriber's waiting updates: state changes always kept (a task has a few),
    deltas up to MAX_PENDING_DELTAS."""

    __slots__ = ("deltas", "items", "ready")

    def __init__(self) -> None:
        self.items: deque[TaskUpdate] = deque()
        self.deltas = 0
        self.ready = asyncio.Event()

    def push(self, update: TaskUpdate) -> None:
        if update.delta is not None:
            if self.deltas >= MAX_PENDING_DELTAS:
                return
            self.deltas += 1
        self.items.append(update)
        self.ready.set()

    def pop(self) -> TaskUpdate:
        update = self.items.popleft()
        if update.delta is not None:
            self.deltas -= 1
        return update


class TaskService:
    """`AgentTasks` for the runner; also the engine's `TaskHooks`. `channel` is the
    platform adapter of `a2a` the runner registers."""

    def __init__(
        self,
        roster: Roster,
        store: SessionStore,
        engine: TurnEngine,
        placement: Placement,
        metrics: Metrics,
        approvals: Approvals,
        accepting: Callable[[], bool],
    ) -> None:
        self.roster = roster
        self.store = store
        self.engine = engine
        self.placement = placement
        self.metrics = metrics
        self.approvals = approvals
        approvals.observer = self
        self._accepting = accepting
        self.channel = TaskChannel(self._on_delta)
        self._subscribers: dict[str, set[_Subscriber]] = {}
        self._live: dict[str, TaskRecord] = {}  # tasks whose turn runs here
        self._ended: dict[str, TaskState] = {}  # settled by a finish not yet told
        self._telling: set[asyncio.Task[None]] = set()

    # --- AgentTasks ---------------------------------------------------------------------------

    async def send(
        self,
        agent_id: str,
        text: str,
        *,
        message_id: str,
        caller: str,
        context_id: str | None = None,
        chain: tuple[str, ...] = (),
    ) -> TaskRecord:
        self._check(agent_id, text, message_id, caller, context_id)
        if len(chain) > MAX_CHAIN or not all(
            isinstance(agent, str) and 0 < len(agent) <= MAX_CHAIN_ENTRY_CHARS for agent in chain
        ):
            raise TaskRefused(
                f"the delegation chain must be at most {MAX_CHAIN} agent ids or URLs"
                f" of at most {MAX_CHAIN_ENTRY_CHARS} characters"
            )
        if not self._accepting():
            raise TaskRefused("the gateway is stopping", retry_after=_RETRY_SECONDS)
        task_id = task_id_of(agent_id, caller, message_id)
        try:
            # The task and its context's owner in one read: one hop to the reader.
            record, owner = await self.store.read(
                lambda conn: (
                    rows.get(conn, task_id),
                    None if context_id is None else rows.context_owner(conn, agent_id, context_id),
                )
            )
            if record is None:
                context = context_id or str(uuid.uuid4())
                if context_id is not None:
                    # A context is its caller's: its session holds their conversation.
                    if owner is not None and owner != caller:
                        raise TaskRefused(f"no context {context_id!r} of this caller")
                    answered = await self._answer_approval(agent_id, context_id, caller, text)
                    if answered is not None:
                        return answered
                key = self._key(self._source(context, caller, task_id, chain), agent_id)
                now = time.time()
                record = await self.store.write(
                    lambda conn: rows.insert(
                        conn,
                        task_id=task_id,
                        agent_id=agent_id,
                        context_id=context,
                        message_id=message_id,
                        caller=caller,
                        request_text=text,
                        chain=tuple(chain),
                        session_key=key,
                        now=now,
                    ),
                    dirty=False,
                )
            if record.state.terminal:
                return record
            # (Again) to its session: the inbox knows a message it accepted before.
            source = self._source(record.context_id, caller, task_id, record.chain)
            key = self._key(source, record.agent_id)
            event = MessageEvent(source, record.request_text, message_id=task_id)
            accepted = await self.placement.intake(key, event, MessageKind.QUEUE, None)
        except (StoreUnwritable, *driver_errors()) as exc:
            reason = exc.reason if isinstance(exc, StoreUnwritable) else "unreachable"
            raise TaskRefused(
                f"the store is unavailable ({reason})", retry_after=_RETRY_SECONDS
            ) from None
        if accepted.status is AcceptStatus.UNAVAILABLE:
            raise TaskRefused(accepted.detail or "unavailable", retry_after=_RETRY_SECONDS)
        if accepted.status in (AcceptStatus.REFUSED, AcceptStatus.IGNORED):
            await self._end(task_id, record.agent_id, TaskState.REJECTED)
            found = await self.store.read(lambda conn: rows.get(conn, task_id))
            return found if found is not None else record
        # Accepted: the task as written (its turn may have begun since; GetTask, wait and
        # subscribe read it as it stands).
        return record

    async def get(self, task_id: str, caller: str) -> TaskRecord | None:
        if not isinstance(task_id, str) or len(task_id) > 64:
            return None
        found = await self.store.read(lambda conn: rows.get(conn, task_id))
        return found if found is not None and found.caller == caller else None

    async def list(
        self,
        caller: str,
        *,
        agent_id: str | None = None,
        context_id: str | None = None,
        state: TaskState | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> list[TaskRecord]:
        limit = max(1, min(int(limit), MAX_LIST))
        return await self.store.read(
            lambda conn: rows.listed(
                conn,
                caller,
                agent_id=agent_id,
                context_id=context_id,
                state=TaskState(state).value if state is not None else None,
                limit=limit,
                after=after,
            )
        )

    async def cancel(self, task_id: str, caller: str) -> TaskRecord | None:
        record = await self.get(task_id, caller)
        if record is None or record.state.terminal:
            return record
        key = await self.store.read(lambda conn: rows.session_key_of(conn, task_id))
        assert key is not None
        running = self.engine.running.get(key)
        now = time.time()
        if running is not None and running.message_id == task_id:
            # As /stop: the turn and the session's queue (the tasks behind it) go.
            await self.engine.cancel_session_work(key)
            ended = await self.store.write(lambda conn: rows.cancel_open(conn, key, now))
        elif (
            not await self.engine.drop_queued(key, task_id)
            and record.state is not TaskState.SUBMITTED
            and self.store.postgres
            and not self.engine.is_busy(key)
        ):
            # Its turn runs on another replica: /stop is handed to it, as a chat's is.
            kind, command = classify("/stop", None)
            stop_id = f"stop-{uuid.uuid4()}"
            source = self._source(record.context_id, caller, stop_id, ())
            await self.placement.intake(
                key, MessageEvent(source, "/stop", message_id=stop_id), kind, command
            )
            ended = await self.store.write(lambda conn: rows.cancel_open(conn, key, now))
        else:
            # Queued here: dropped alone. Not begun yet anywhere: its row says canceled,
            # and its turn is skipped when it comes (`turn_began`).
            changed = await self.store.write(
                lambda conn: rows.set_state(conn, task_id, TaskState.CANCELED, now)
            )
            ended = [task_id] if changed else []
        for ended_id in ended:
            self._live.pop(ended_id, None)
            self.metrics.count_a2a_task(record.agent_id, TaskState.CANCELED.value)
            await self._publish(ended_id)
        return await self.get(task_id, caller)

    async def subscribe(self, task_id: str, caller: str) -> AsyncIterator[TaskUpdate]:
        """No such task of this caller: ends at once, having yielded nothing."""
        subscriber = _Subscriber()
        self._subscribers.setdefault(task_id, set()).add(subscriber)
        try:
            last = await self.get(task_id, caller)
            if last is None:
                return
            yield TaskUpdate(last)
            while not last.state.terminal:
                if not subscriber.items:
                    subscriber.ready.clear()
                    try:
                        async with asyncio.timeout(POLL_SECONDS):
                            await subscriber.ready.wait()
                    except TimeoutError:
                        now = await self.get(task_id, caller)
                        if now is None:
                            return  # deleted meanwhile
                        if now.state is not last.state:
                            last = now
                            yield TaskUpdate(now)
                        continue
                update = subscriber.pop()
                if update.delta is None and update.task.state is last.state:
                    continue  # seen already (the first read raced the change)
                if update.delta is None:
                    last = update.task
                yield update
        finally:
            waiting = self._subscribers.get(task_id)
            if waiting is not None:
                waiting.discard(subscriber)
                if not waiting:
                    del self._subscribers[task_id]

    async def wait(self, task_id: str, caller: str) -> TaskRecord | None:
        last = None
        async for update in self.subscribe(task_id, caller):
            last = update.task
        return last

    async def running_chain(self, session_key: str) -> tuple[str, ...]:
        event = self.engine.running.get(session_key)
        if event is None or event.source.platform is not Platform.A2A:
            return ()
        task_id = event.message_id or ""
        record = self._live.get(task_id) or await self.store.read(
            lambda conn: rows.get(conn, task_id)
        )
        return () if record is None else (*record.chain, record.agent_id)

    # --- TaskHooks (the turn engine's) ----------------------------------------------------------

    async def turn_began(self, key: str, event: MessageEvent) -> bool:
        task_id = event.message_id or ""
        now = time.time()
        try:
            # Marked and read back in the writer's transaction: no hop to the reader.
            began, record = await self.store.write(
                lambda conn: (
                    rows.set_state(conn, task_id, TaskState.WORKING, now),
                    rows.get(conn, task_id),
                ),
                dirty=False,
            )
            self._push(record)
        except Exception as exc:  # the turn runs all the same; its end is what counts
            log.warning("task_update_unwritten", task_id=task_id, error=str(exc))
            return True
        if record is None or (not began and record.state.terminal):
            log.info("task_turn_skipped", task_id=task_id, reason="ended before its turn")
            return False
        self._live[task_id] = record
        return True

    def settle(
        self, event: MessageEvent, reply: str | None, text: str, usage: TokenUsage | None
    ) -> Callable[[Any], object]:
        task_id = event.message_id or ""
        state = TaskState.COMPLETED if reply is not None else TaskState.FAILED
        now = time.time()
        tokens = None if usage is None else (usage.input_tokens, usage.output_tokens)

        def write(conn: Any) -> None:
            if rows.settle(
                conn,
                task_id,
                state,
                now,
                result_text=reply,
                error=None if reply is not None else text,
                tokens=tokens,
            ):
                self._ended[task_id] = state

        return write

    def settled(self, event: MessageEvent) -> None:
        task_id = event.message_id or ""
        self._live.pop(task_id, None)
        self._background(self._after_settle(task_id, self._ended.pop(task_id, None)))

    # --- ApprovalObserver (the approvals') -------------------------------------------------

    def approval_waits(self, source: SessionSource, question: str | None) -> None:
        task_id = source.message_id or ""
        was, state = (
            (TaskState.WORKING, TaskState.INPUT_REQUIRED)
            if question is not None
            else (TaskState.INPUT_REQUIRED, TaskState.WORKING)
        )
        now = time.time()

        async def move() -> None:
            try:
                moved = await self.store.write(
                    lambda conn: rows.move(conn, task_id, was, state, now, result_text=question),
                    dirty=False,
                )
                if moved:
                    await self._publish(task_id)
            except Exception as exc:  # cosmetic: the wait goes on, the turn's end counts
                log.warning("task_update_unwritten", task_id=task_id, error=str(exc))

        self._background(move())

    # --- inside -------------------------------------------------------------------------------

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        running = asyncio.create_task(work)
        self._telling.add(running)
        running.add_done_callback(self._telling.discard)

    async def _answer_approval(
        self, agent_id: str, context_id: str, caller: str, text: str
    ) -> TaskRecord | None:
        """`/approve` or `/deny` to a context whose task waits for an approval: the
        answer, and that task (None: not an answer, or nothing waits)."""
        verdict = _VERDICTS.get(text.strip().lower())
        if verdict is None:
            return None
        key = self._key(self._source(context_id, caller, "", ()), agent_id)
        waiting = self.approvals.waiting(key)
        running = self.engine.running.get(key)
        if waiting is None or running is None or not self.approvals.answer(key, verdict):
            return None
        task_id = running.message_id or ""
        return await self.store.read(lambda conn: rows.get(conn, task_id))

    async def _after_settle(self, task_id: str, state: TaskState | None) -> None:
        try:
            record = await self._publish(task_id)
        except Exception as exc:  # its subscribers read the row on their next poll
            log.warning("task_update_unread", task_id=task_id, error=str(exc))
            return
        if state is not None and record is not None:
            self.metrics.count_a2a_task(record.agent_id, state.value)

    async def _end(self, task_id: str, agent_id: str, state: TaskState) -> None:
        now = time.time()
        if await self.store.write(lambda conn: rows.set_state(conn, task_id, state, now)):
            self.metrics.count_a2a_task(agent_id, state.value)
            await self._publish(task_id)

    async def _publish(self, task_id: str) -> TaskRecord | None:
        """The task as stored now, to this process's subscribers."""
        record = await self.store.read(lambda conn: rows.get(conn, task_id))
        self._push(record)
        return record

    def _push(self, record: TaskRecord | None) -> None:
        if record is not None:
            for subscriber in self._subscribers.get(record.task_id, ()):
                subscriber.push(TaskUpdate(record))

    def _on_delta(self, task_id: str, text: str) -> None:
        record = self._live.get(task_id)
        if record is None:
            return
        for subscriber in self._subscribers.get(task_id, ()):
            subscriber.push(TaskUpdate(record, delta=text))

    def _check(
        self,
        agent_id: str,
        text: str,
        message_id: str,
        caller: str,
        context_id: str | None,
    ) -> None:
        if agent_id not in {spec.agent_id for spec in self.roster}:
            raise TaskRefused(f"no agent {agent_id!r} here")
        if not isinstance(text, str) or not text.strip():
            raise TaskRefused("the message has no text")
        if len(text) > MAX_TEXT_CHARS:
            raise TaskRefused(f"the message is longer than {MAX_TEXT_CHARS} characters")
        for name, value, bound in (
            ("message id", message_id, MAX_MESSAGE_ID_CHARS),
            ("caller", caller, MAX_CALLER_CHARS),
        ):
            if not isinstance(value, str) or not value or len(value) > bound:
                raise TaskRefused(f"the {name} must be 1 to {bound} characters")
            if _CONTROL.search(value):
                raise TaskRefused(f"the {name} must not contain control characters")
        if context_id is not None and (
            not isinstance(context_id, str)
            or not CONTEXT_ID.fullmatch(context_id)
            or ".." in context_id
        ):
            raise TaskRefused(
                "the context id must be 1 to 128 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit"
            )

    @staticmethod
    def _source(
        context_id: str, caller: str, task_id: str, chain: tuple[str, ...]
    ) -> SessionSource:
        # `is_bot`: a native delegation runs outside the agent slots, one of which its
        # caller's turn in this process holds while it waits. Only a native one: an A2A
        # caller (another gateway's delegation included) takes a slot like any chat, so
        # no request from outside can run turns past `agent.max_concurrent_turns`.
        return SessionSource(
            platform=Platform.A2A,
            chat_id=context_id,
            chat_type="dm",
            user_id=caller,
            message_id=task_id,
            is_bot=bool(chain) and caller.startswith(NATIVE_CALLER_PREFIX),
        )

    def _key(self, source: SessionSource, agent_id: str) -> str:
        try:
            return build_session_key(source, agent_id=agent_id)
        except ValueError as exc:
            raise TaskRefused(str(exc)) from None
