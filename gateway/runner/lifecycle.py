"""GatewayRunner: the one owner of per-session state, and the flow of every message.

    handle_message: authorize -> command? -> accept (durable, dedup) -> busy? queue : start
                    (a message to an idle session is accepted and its turn begun in one
                    transaction: `_accept_and_start`); a fast command answers inline,
                    one that calls a model (`LANE_COMMANDS`) is queued like a turn
    session worker: turn -> next from the queue -> turn ... until the queue is empty
                    (the session's lane: its turns and lane commands, one at a time)
    turn:           begin (session, user message, marker) -> agent -> finish (reply,
                    counters, ledger) -> send the recorded chunks (`gateway.delivery`;
                    their "sent" marks ride along with a later commit)

One turn runs per session key at a time; different keys run concurrently, at most
`agent.max_concurrent_turns` agent calls at once. Several agents (`agents:`, `routes:`)
share all of this: a session key names its agent (`agent:{id}:...`, picked by the
store's router), and `Roster.for_key` gives a turn its agent's settings.

Every step that matters after a crash is one transaction in the journal
(`gateway.store.turnlog`); `gateway.recovery` completes whatever a crash interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from adapters.base import PlatformAdapter
from config import GatewayConfig, hermes_home
from gateway import commands
from gateway.agents.cache import AgentCache
from gateway.agents.protocol import (
    AgentError,
    AgentFactory,
    TurnRequest,
    check_attachments,
    check_tool_rounds,
)
from gateway.agents.roster import AgentSpec, Roster
from gateway.context.strategy import too_large_text
from gateway.deadlines import Deadlines
from gateway.delivery import Delivery
from gateway.domain import command_syntax
from gateway.domain.attachments import Attachment
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.domain.policy import reset_notice
from gateway.domain.session import (
    Platform,
    SessionContext,
    SessionEntry,
    SessionSource,
    TokenUsage,
    agent_id_of_key,
    build_session_context,
    build_session_context_prompt,
    is_shared_multi_user_session,
    validate_chat_id,
    validate_id,
)
from gateway.housekeeping import Housekeeper
from gateway.media import MediaIntake
from gateway.memory.recall import Namespace, Recall, notes_prompt
from gateway.memory.summaries import Memory
from gateway.ops.logs import TurnLine
from gateway.ops.metrics import Metrics
from gateway.ops.status import keep_status, write_status
from gateway.pairing import Pairing
from gateway.queue import Job, LaneCommand, QueueFull, SessionQueue
from gateway.recovery import Recovery
from gateway.schedules.book import ScheduleBook, iso
from gateway.schedules.loop import Scheduler
from gateway.session_ops import SessionOps
from gateway.store.outage import StoreUnwritable
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.streaming import Stream, Streams
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.registry import Toolbox, TurnScope, TurnTools, agent_id_of

if TYPE_CHECKING:
    from gateway.replica import Replica

log = structlog.get_logger("gateway.run")

FinalizeHook = Callable[[SessionEntry], Awaitable[None]]

INTERNAL_ERROR_TEXT = (
    "Sorry, something went wrong while answering. The error was logged; /retry asks again."
)


def _in_lane(command: command_syntax.Command | None) -> bool:
    """Does this command run in its session's lane (`command_syntax.LANE_COMMANDS`)?"""
    return command is not None and command.name in command_syntax.LANE_COMMANDS


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """What a turn produced: the agent's reply (None when it failed), the text the user
    gets (the reply, or a short error), the token usage, and how it ended (the log's
    `outcome`: ok, failed, timeout or error)."""

    reply: str | None
    text: str
    usage: TokenUsage | None = None
    status: str = "ok"
    messages: tuple[dict[str, Any], ...] = ()  # the tool rounds before the reply
    attachments: tuple[Attachment, ...] = ()  # files sent after the reply's text

    @classmethod
    def failed(cls, text: str, status: str = "failed") -> TurnOutcome:
        return cls(reply=None, text=text, status=status)


class GatewayRunner(SessionOps):
    """(`SessionOps`: list, search, read and delete stored sessions.)"""

    def __init__(
        self,
        config: GatewayConfig,
        adapters: Sequence[PlatformAdapter] | None = None,
        agent_factory: AgentFactory | Mapping[str, AgentFactory] | None = None,
        *,
        home: Path | None = None,
    ) -> None:
        self.config = config
        self.home = Path(home) if home is not None else hermes_home()
        self.adapters: dict[Platform, PlatformAdapter] = {a.platform: a for a in adapters or ()}
        # Not `is_busy`: the turn that asks for its session is itself the busy worker, and
        # that must not block the reset policy. The watcher skips busy keys on its own.
        self.store = SessionStore(self.home / "sessions", config)
        # Every agent (`agent:` is `main`, plus `agents:`) with its factory, signature and
        # context plan (what its turns load). One agent: nothing per key to look up.
        self.roster = Roster(config, agent_factory)
        main = self.roster.main
        plan_for = self.roster.plan_for if len(self.roster) > 1 else None
        self.turnlog = TurnLog(
            self.store, history_limit=main.config.history_limit, plan=main.plan, plan_for=plan_for
        )
        self.recovery = Recovery(self)
        # Several replicas on one PostgreSQL store: a session runs where its
        # lease is; on SQLite this process is the only one and holds everything.
        self.cluster: Replica | None = None
        if self.store.postgres:
            # Imported here: a gateway on SQLite never loads psycopg (22 MiB).
            from gateway.replica import Replica

            self.cluster = Replica(self)
        self.pairing = Pairing(self.store)
        # One cache for all agents: its keys are session keys, which name their agent.
        self.agents = AgentCache(
            self.roster.build,
            max_size=config.agent.cache_max_size,
            idle_ttl=config.agent.cache_idle_ttl_seconds,
        )
        # Background summaries yield to turns: of their own session always, of their
        # agent's other sessions for a bounded time (`gateway.memory.summaries`).
        self._lanes_per_agent: dict[str, int] = {}
        self._default_prompts: dict[str, str] = {}  # agent id -> its default system prompt
        self.memory = Memory(
            self.store,
            main.plan,
            lambda key: self.agents.lease(key, self.roster.for_key(key).signature),
            plan_for=plan_for,
            session_busy=self.is_busy,
            agent_busy=lambda key: self._lanes_per_agent.get(agent_id_of_key(key), 0) > 0,
        )
        # Long-term memory: notes and hybrid recall (the memory tools, `hermes-gateway memory`).
        self.recall = Recall(self.store, config)
        # Scheduled jobs: the book (commands, tools) and the loop that fires them.
        self.schedule_book = ScheduleBook(
            self.store, config, platforms=lambda: [p.value for p in self.adapters]
        )
        self.scheduler = Scheduler(self, self.schedule_book)
        self.metrics = Metrics(gauges=self._metric_gauges)  # its own registry
        # Streamed replies: a turn's Stream takes its chat's slot only once
        # the agent streams text, so other turns spend nothing on them.
        self.streams = Streams(self.adapters, config, self.turnlog.save_stream)
        self.delivery = Delivery(
            self.adapters,
            self.turnlog,
            self.metrics,
            self.streams.slots,
            config.streaming.max_flood_wait,
        )
        self.media = MediaIntake(self.home, config.media)  # files users send
        self.finalize_hooks: list[FinalizeHook] = []
        self.restart_requested = asyncio.Event()
        # Each agent's tools; None for the echo backend (no model calls tools) and for
        # `tools: []`: such turns build no tool machinery at all.
        self._toolboxes: dict[str, Toolbox | None] = {}
        for spec in self.roster:
            custom = agent_factory is not None and (
                not isinstance(agent_factory, Mapping) or spec.agent_id in agent_factory
            )
            uses_tools = spec.config.backend != "echo" or custom
            self._toolboxes[spec.agent_id] = (
                Toolbox(BUILTIN_TOOLS, spec.config.tools)
                if uses_tools and spec.config.tools
                else None
            )
        self._queues: dict[str, SessionQueue] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._running: dict[str, MessageEvent] = {}
        # The next turn of a key, begun in its previous turn's last transaction.
        self._next_begun: dict[str, tuple[MessageEvent, TurnStart]] = {}
        self._turn_slots = asyncio.Semaphore(config.agent.max_concurrent_turns)
        self._deadlines = Deadlines(min(a.config.gateway_timeout for a in self.roster))
        # What every turn's session context says of the config (it does not change).
        self._platforms = tuple(config.connected_platforms())
        self._homes = config.home_channels()
        self._housekeeper = Housekeeper(self)
        self._accepting = False
        self._draining = False
        self._held: list[tuple[str, MessageEvent, str, command_syntax.Command | None]] | None = None
        self._started_at = time.monotonic()
        self._status_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def add_adapters(self, adapters: Sequence[PlatformAdapter]) -> None:
        """Adapters built after the runner (before `start()`): the composition root builds
        them while the store's start-up check runs."""
        self.adapters.update({a.platform: a for a in adapters})

    async def start(self) -> None:
        """Open the store, decide what to recover, start the adapters, then mark and
        resume interrupted work.

        Messages that arrive while recovery re-queues old work are accepted (durably) and
        held, then run after it, so nothing jumps ahead of an interrupted turn.
        """
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        await self.store.open()
        await self.recall.start()  # its indexer catches up in the background
        if self.cluster is not None:
            await self._start_replica()
            return
        await self.recovery.prepare()
        self._held = []
        self._accepting = True
        for adapter in self.adapters.values():
            adapter.bind(self)
            await adapter.start()
        # Only now, with every adapter up, does recovery write anything: a start that
        # failed above (a port taken) leaves the sessions and markers for the next one.
        await self.recovery.mark()
        await self.recovery.resume()
        held, self._held = self._held, None
        for key, event, kind, command in held:
            await self._dispatch(key, event, kind, command)
        await self.scheduler.start()  # after recovery: a resumed run is not interrupted
        self._housekeeper.start()
        self._started(clean_start=self.recovery.was_clean)

    def _started(self, **facts: Any) -> None:
        """The end of a start: the status file's writer, the heap frozen, one log line."""
        self._status_task = asyncio.create_task(keep_status(self.home, self.status_snapshot))
        # What is alive now (modules, config, clients) lives as long as the process: move
        # it out of the collector's reach. A full collection walked all of it, stalling
        # the event loop (and with it every write to state.db) ~15 ms a second.
        gc.collect()
        gc.freeze()
        log.info(
            "gateway_started",
            agent=self.roster.main.description,
            agents=self.roster.describe(),
            routes=self.store.router.routes,
            adapters=[p.value for p in self.adapters],
            home=str(self.home),
            **facts,
        )

    async def _start_replica(self) -> None:
        """`start` for one replica of several (gateway.replica): no start-up recovery (the
        sweeper resumes, key by key, what no live replica holds); the single-connection
        platforms, the scheduler and housekeeping only on the leader."""
        assert self.cluster is not None
        self._accepting = True
        single: list[PlatformAdapter] = []
        for adapter in self.adapters.values():
            adapter.bind(self)
            if adapter.single_connection:
                single.append(adapter)  # started by the leader role
            else:
                await adapter.start()
            if hasattr(adapter, "publish"):  # the HTTP API: long-polls on every replica
                adapter.publish = self.cluster.publish_reply

        async def gain() -> None:
            for adapter in single:
                await adapter.start()
            await self.scheduler.start()
            self._housekeeper.start()
            self.cluster.send_pending_later()  # what the last leader (or the CLI) left

        async def lose() -> None:
            await self.scheduler.stop()
            await self._housekeeper.stop()
            for adapter in single:
                try:
                    await adapter.stop()
                except Exception:
                    log.exception("adapter_stop_failed", platform=adapter.platform.value)

        self.cluster.lead(
            self.cluster.LEADER, gain, lose, platforms={a.platform.value for a in single}
        )
        await self.cluster.start()
        self._started(replica=self.cluster.owner)

    async def stop(self, *, restart: bool = False) -> None:
        """Drain: refuse new messages, let running turns finish up to
        `agent.restart_drain_timeout`, then cancel the rest and mark them resume_pending
        (their markers re-run them on the next start). Writes `.clean_shutdown` last,
        unless start-up failed before recovery consumed it."""
        self._accepting = False
        self._draining = True
        if self.cluster is not None:
            await self.cluster.stop_leading()  # another replica leads from now on
        await self.scheduler.stop()
        workers = dict(self._workers)
        if workers:
            log.info("draining", running_turns=len(workers))
            _, late = await asyncio.wait(
                workers.values(), timeout=self.config.agent.restart_drain_timeout
            )
            reason = "restart_timeout" if restart else "shutdown_timeout"
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            for key, task in workers.items():
                if task in late:
                    # A full disk refuses the flag; the turn's marker re-runs it all the same.
                    with contextlib.suppress(StoreUnwritable):
                        await self.store.mark_resume_pending(key, reason)
                        # Stopped on purpose: whoever resumes it must not count this
                        # stop as a crash while it ran (a replica's takeover).
                        await self.turnlog.mark_waiting(key)
                    log.warning("turn_interrupted_by_shutdown", session_key=key, reason=reason)
        for adapter in self.adapters.values():
            try:
                await adapter.stop()
            except Exception:
                log.exception("adapter_stop_failed", platform=adapter.platform.value)
        await self._housekeeper.stop()
        await self.memory.close()  # summaries in flight: cancelled, none half written
        # A started runner (a replica too, which runs no start-up recovery) says it stopped.
        reported = self._status_task is not None or self.recovery.marked
        if self._status_task is not None:
            self._status_task.cancel()
            await asyncio.gather(self._status_task, return_exceptions=True)
        await self.agents.close_all()
        await self.media.close()
        await self.recall.close()
        if self.cluster is not None:
            await self.cluster.stop()  # the sessions' leases, for the others to resume
        await self.store.close()
        if reported:
            write_status(self.home, {**self.status_snapshot(), "state": "stopped"})
        if self.recovery.marked:
            self.recovery.write_clean_shutdown()
        log.info("gateway_stopped", restart=restart)

    def request_restart(self) -> None:
        """Ask the process to drain and exit 75 (the service manager restarts it)."""
        self.restart_requested.set()

    def on_session_finalize(self, hook: FinalizeHook) -> None:
        """Register a coroutine run for each session the expiry watcher finalizes."""
        self.finalize_hooks.append(hook)

    # --- inbound -------------------------------------------------------------------------

    async def handle_message(self, event: MessageEvent) -> Accepted:
        """Accept one inbound message; returns at once, the turn runs in the background.

        While the store cannot write (disk full, read-only) nothing is accepted: the
        answer is UNAVAILABLE, and the platform or client sends the message again."""
        try:
            return await self._handle_message(event)
        except StoreUnwritable as exc:
            self.metrics.messages_unavailable_total += 1
            return Accepted(
                AcceptStatus.UNAVAILABLE,
                detail=f"the store cannot write ({exc.reason}); nothing was accepted",
            )

    async def _handle_message(self, event: MessageEvent) -> Accepted:
        self.metrics.messages_received_total += 1
        if not self._accepting:
            self.metrics.messages_refused_total += 1
            return Accepted(AcceptStatus.REFUSED, detail="the gateway is shutting down")
        # Ids first: they reach SQL, file paths and logs, so a bad one stops here.
        try:
            validate_chat_id(event.source.chat_id)
            key = self.store.session_key_for(event.source)
            validate_id("message_id", event.message_id)
        except ValueError as exc:
            return Accepted(AcceptStatus.IGNORED, detail=str(exc))
        event = event.scrubbed()
        adapter = self.adapters.get(event.source.platform)
        if adapter is None:
            # Authorization is the platform adapter's (its allow-lists, pairing): with no
            # adapter for the platform nobody can say who may talk, so nobody may.
            log.warning(
                "message_denied_no_adapter",
                platform=event.source.platform.value,
                chat_id=event.source.chat_id,
            )
            return Accepted(AcceptStatus.IGNORED, detail="not authorized")
        if not await adapter.authorize(event):
            return Accepted(AcceptStatus.IGNORED, detail="not authorized")
        text = event.text.strip()
        if not text and not event.media:
            return Accepted(AcceptStatus.IGNORED, detail="empty message")

        kind, command = command_syntax.classify(text, adapter.bot_username)
        if kind == "queue":
            assert command is not None
            event = replace(event, text=command.args)
        if self.cluster is not None:
            return await self._handle_on_replica(key, event, kind, command)
        if kind != "command" and self._held is None and key not in self._workers:
            return await self._accept_and_start(key, event, kind)
        # A lane command is answered by its own transaction (`_run_command`), so it stays
        # open in the inbox until then: a crash before it re-runs it at the next start.
        inline = kind == "command" and not _in_lane(command)
        inbox_id = await self.turnlog.accept(event, key, kind, done=inline)
        if inbox_id is None:
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        event = event.with_inbox_ids((inbox_id,))
        if self._held is not None:
            self._held.append((key, event, kind, command))
            return Accepted(AcceptStatus.PENDING, session_key=key, detail="gateway is starting")
        return await self._dispatch(key, event, kind, command)

    async def _handle_on_replica(
        self, key: str, event: MessageEvent, kind: str, command: command_syntax.Command | None
    ) -> Accepted:
        """`_handle_message` on one replica of several: run the message here when this
        replica holds (or takes) its session's lease, else journal it for the holder."""
        cluster = self.cluster
        assert cluster is not None
        if not cluster.healthy:
            self.metrics.messages_unavailable_total += 1
            return Accepted(AcceptStatus.UNAVAILABLE, detail="the database is unreachable")
        async with cluster.key_lock(key):
            if key not in self._workers:
                if kind != "command":
                    # The lease is taken in the transaction that accepts and begins the
                    # turn: one transaction for a message to an idle session, as on SQLite.
                    lease = cluster.lease_claim(key)
                    with contextlib.suppress(*cluster.LEASE_BUSY):
                        accepted = await self._accept_and_start(
                            key, event, kind, claim=lease, claim_fences=True
                        )
                    if lease.won:
                        return accepted
                    # Nothing was written; the worker made for it ends on its own.
                    await asyncio.gather(*filter(None, [self._workers.get(key)]))
                    return await self._forward(key, event, kind)
                if not await cluster.claim(key):
                    return await self._forward(key, event, kind)
            try:
                inline = kind == "command" and not _in_lane(command)
                inbox_id = await self.turnlog.accept(event, key, kind, done=inline)
                if inbox_id is not None:
                    cluster.took(key, (inbox_id,))
                    event = event.with_inbox_ids((inbox_id,))
                    if not inline:  # queued behind the running turn, under the lock
                        return await self._dispatch(key, event, kind, command)
            except BaseException:
                if key not in self._workers:
                    cluster.worker_ended(key)  # nothing runs here: the lease goes back
                raise
        if inbox_id is None:
            if key not in self._workers:
                cluster.worker_ended(key)
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        # A command runs under the lease but outside the lock: /stop waits for the worker,
        # whose end takes the lock. The lease goes back after it, unless a turn runs.
        try:
            return await self._dispatch(key, event, kind, command)
        finally:
            if key not in self._workers:
                cluster.worker_ended(key)

    async def _forward(self, key: str, event: MessageEvent, kind: str) -> Accepted:
        """Another replica runs `key`: the message is journaled for it (gateway.replica)."""
        assert self.cluster is not None
        if await self.cluster.forward(key, event, kind) is None:
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        return Accepted(AcceptStatus.PENDING, session_key=key, detail="run by another replica")

    async def requeue(self, key: str, event: MessageEvent, kind: str) -> None:
        """An accepted message not yet answered (start-up recovery, a replica picking up
        a session): queued as it was on arrival. A command left open is a lane command
        (inline ones are answered as they are accepted; another replica journals both)."""
        if kind != "command":
            await self.submit(key, event, fifo=kind == "queue")
            return
        adapter = self.adapters.get(event.source.platform)
        _, command = command_syntax.classify(
            event.text.strip(), adapter.bot_username if adapter else None
        )
        if not _in_lane(command):  # answered inline: settled first, as on arrival
            await self.turnlog.close_inbox(list(event.inbox_ids))
        if command is not None:
            await self._dispatch(key, event, "command", command)

    async def cancel_all_turns(self) -> None:
        """The database is gone for longer than a lease lives (gateway.replica): stop every
        turn at once, writing nothing; their markers let the next holder resume them."""
        self._queues.clear()
        self._next_begun.clear()
        tasks = list(self._workers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _dispatch(
        self, key: str, event: MessageEvent, kind: str, command: command_syntax.Command | None
    ) -> Accepted:
        if kind == "command" and command is not None:
            self.metrics.commands_total += 1
            if _in_lane(command):
                accepted = await self.submit(key, LaneCommand(event, command), fifo=True)
                return replace(accepted, detail=accepted.detail or command.name)
            return await commands.dispatch(self, event, key, command)
        return await self.submit(key, event, fifo=kind == "queue")

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool:
        """A scheduled run (`gateway.schedules.loop`): claim it and begin its turn in the
        schedule's session in one transaction. False: the session is busy, the gateway
        stopping, or the claim refused (nothing was written)."""
        if not self._accepting or key in self._workers:
            return False
        if self.cluster is not None:
            async with self.cluster.key_lock(key):
                if key in self._workers or not await self.cluster.claim(key):
                    return False
                accepted = await self._accept_and_start(key, event, "turn", text, claim)
        else:
            accepted = await self._accept_and_start(key, event, "turn", text, claim)
        return accepted.status == AcceptStatus.STARTED

    async def _accept_and_start(
        self,
        key: str,
        event: MessageEvent,
        kind: str,
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
            text = self._turn_text(event)
        try:
            result = await self.turnlog.accept_and_begin(
                event, key, kind, text, claim, claim_fences=claim_fences, running=self._slot_free()
            )
        except BaseException:
            if not begun.done():
                begun.set_result(None)  # nothing was accepted: the worker moves on
            raise
        if result is None:
            if not begun.done():
                begun.set_result(None)
            return Accepted(AcceptStatus.DUPLICATE, session_key=key)
        if self.cluster is not None:
            self.cluster.took(key, (result[0],))
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
            await self.deliver(
                event.source,
                f"Too many messages are waiting ({queue.depth}); this one was not queued. "
                "Wait for the current reply or /stop it.",
                reply_to=event.reply_to,
            )
            return Accepted(AcceptStatus.REFUSED, session_key=key, detail="queue full")
        return Accepted(AcceptStatus.QUEUED if fifo else AcceptStatus.PENDING, session_key=key)

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

    # --- per-session state (used by commands and the watcher) ----------------------------

    def is_busy(self, key: str) -> bool:
        return key in self._workers

    def busy_sessions(self) -> int:
        return len(self._workers)

    def queue_depth(self, key: str) -> int:
        queue = self._queues.get(key)
        return queue.depth if queue else 0

    def is_admin(self, source: SessionSource) -> bool:
        return f"{source.platform.value}:{source.user_id}" in self.config.admins

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
        running = self._running.get(key)
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

    # --- turns ---------------------------------------------------------------------------

    async def _session_worker(
        self,
        key: str,
        event: Job | None,
        begun: asyncio.Future[tuple[int, TurnStart] | None] | None = None,
    ) -> None:
        try:
            start = None
            if begun is not None:  # accepted and begun by `_accept_and_start`
                accepted = await begun
                if accepted is not None and isinstance(event, MessageEvent):
                    inbox_id, start = accepted
                    event = event.with_inbox_ids((inbox_id,))
                else:
                    queue = self._queues.get(key)
                    event = queue.pop_next() if queue else None
            while event is not None:
                self._running[key] = event.event if isinstance(event, LaneCommand) else event
                try:
                    if isinstance(event, LaneCommand):
                        await self._run_command(key, event)
                    else:
                        await self._run_turn(key, event, start)
                except Exception:
                    # An internal failure (the store, a bug): keep the session usable. The
                    # turn answered its messages with an error notice, or, when even that
                    # could not be recorded, its marker stays for the next start.
                    self.metrics.turn_errors_total += 1
                    log.exception("turn_internal_error", session_key=key)
                start = None
                if self._draining:
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
            self._running.pop(key, None)
            self._close_lane(key)
            queue = self._queues.get(key)
            if queue is not None and not queue:
                del self._queues[key]
            if self.cluster is not None:
                self.cluster.worker_ended(key)

    async def _run_command(self, key: str, job: LaneCommand) -> None:
        """A lane command: run it, then record its answer and settle its message in one
        transaction, and send the answer. A crash before that transaction leaves the
        message open in the inbox, and the next start runs the command again (a
        /compress then condenses what is left): answered once, never lost."""
        event, command = job.event, job.command
        typing = self.delivery.start_typing(event.source)
        try:
            reply = await commands.reply_of(self, event, key, command)
        finally:
            if typing is not None:
                typing.cancel()
        text = reply if isinstance(reply, str) else f"/{command.name} done."
        chunks = self.delivery.split(event.source, text)
        ids = await self.turnlog.answer_unbegun(key, event, chunks)
        await self.delivery.send_recorded(
            event.source, list(zip(ids, chunks, strict=False)), event.reply_to
        )

    def _turn_text(self, event: MessageEvent) -> str:
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

    async def _run_turn(self, key: str, event: MessageEvent, begun: TurnStart | None) -> None:
        structlog.contextvars.bind_contextvars(session_key=key)
        started = time.monotonic()
        source = event.source
        turn = TurnLine(source.platform.value, started)  # the log's one line for this turn
        stream: Stream | None = None
        finished = False  # the turn's end is recorded (its message answered)
        try:
            if begun is None:
                begun = await self.turnlog.begin(
                    event, key, self._turn_text(event), running=self._slot_free()
                )
            entry = begun.entry
            turn.session_id = entry.session_id
            if begun.resumed:
                log.info("turn_resumed", session_id=entry.session_id)
            elif begun.fresh and entry.was_auto_reset:
                await self._log_reset(key, entry)
            agent = self.roster.for_key(key)  # the key's agent: its prompt, plan, timeout
            session_context = build_session_context(
                source, self.config, entry, platforms=self._platforms, homes=self._homes
            )
            system_prompt = self._system_prompt(session_context, agent)
            if source.user_id and not session_context.shared_multi_user_session:
                # auto_recall: the user's best notes for this message, counted in the
                # context budget with the rest of the prompt. Not in a shared session:
                # one of its turns may carry several users' messages, and a user's
                # notes are theirs, not the group's.
                notes = await self.recall.for_turn(
                    Namespace.of(agent_id_of(key), source), begun.text
                )
                if notes:
                    system_prompt = f"{system_prompt}\n\n{notes_prompt(notes)}"
            tools = self._turn_tools(key, entry.session_id, source, begun.user_row)
            intake = None
            if event.media:  # files: downloaded and read before the agent is asked
                intake = await self.media.for_turn(
                    self.adapters.get(source.platform),
                    event,
                    entry.session_id,
                    begun.text,
                    vision=agent.config.vision,
                    deliver=self.deliver,
                )
            text = begun.text if intake is None else intake.text
            # Everything the request carries is fitted to the model's window; rows that
            # do not fit are condensed into the summary first (never silently left out).
            loaded, context = await self.memory.prepare(
                entry.session_id,
                begun.context,
                system_prompt,
                text,
                agent.plan,
                tools.spec_tokens if tools is not None else 0,
            )
            request = TurnRequest(
                session_key=key,
                session_id=entry.session_id,
                text=text,
                history=context.history,
                system_prompt=system_prompt,
                source=source,
                tools=tools,
                images=() if intake is None else tuple(intake.images),
            )
            # A turn re-run after a crash finishes the messages its first run streamed.
            shown = await self.turnlog.stream_of(key) if event.resume else []
            stream = self.streams.open(key, source, event.reply_to, shown)
            typing = self.delivery.start_typing(source)
            try:
                if intake is not None and intake.only_refusals:
                    outcome = TurnOutcome.failed(intake.notices[0], "too_large")
                elif context.too_large:  # the model would refuse it: it is not asked
                    outcome = TurnOutcome.failed(too_large_text(agent.plan, context), "too_large")
                else:
                    outcome = await self._call_agent(key, request, agent, stream, begun)
                edits = await stream.finish() if stream is not None else shown
            finally:
                if typing is not None:
                    typing.cancel()

            turn.usage = outcome.usage
            if self.config.logging.include_text:
                turn.texts = (begun.text, outcome.text)
            text, settles, run_status = outcome.text, (), None
            schedule_id = self.scheduler.schedule_of(key)
            if schedule_id is not None:  # a scheduled run: its outcome ends with the turn
                text, settle, run_status = await self.scheduler.settle_turn(
                    schedule_id, outcome.reply, outcome.text, outcome.usage
                )
                settles = (settle,)
            chunks = self.delivery.split(source, self._with_reset_notice(entry, text))
            turn.chunks = len(chunks)
            if intake is not None and begun.user_row is not None:
                settles = (*settles, intake.transcript_tx(begun.user_row, event.message_id))
            # The token factor is learnt from one request's prompt (a turn with tool rounds
            # reports the sum of several), and stored by the finish when it moved.
            factor = self.memory.learn(
                entry.session_id,
                loaded,
                context,
                outcome.usage if not outcome.messages else None,
            )
            ids = await self._finish(
                key,
                begun,
                event,
                outcome,
                chunks,
                tools,
                settles,
                edits if edits else None,
                token_factor=factor,
            )
            finished = True
            if run_status is not None:
                self.metrics.count_schedule_run(run_status)
            if outcome.reply is not None:
                self.metrics.turns_total += 1
                self.recovery.turn_succeeded(key)
            self.metrics.observe_turn(time.monotonic() - started)
            turn.sent = await self.delivery.send_recorded(
                source, list(zip(ids, chunks, strict=False)), event.reply_to, edits
            )
            if len(edits) > len(chunks):
                await self.delivery.delete_extra(source, edits[len(chunks) :])
            if outcome.attachments:
                files = list(zip(ids[len(chunks) :], outcome.attachments, strict=True))
                await self.delivery.send_attachments(source, files, event.reply_to)
            turn.outcome = outcome.status
            self.memory.after_turn(  # may start a summary, in the background
                key, entry.session_id, loaded, context, outcome.reply
            )
        except asyncio.CancelledError:
            turn.outcome = "cancelled"  # /stop, or a shutdown that could not wait
            raise
        except Exception:
            if not finished:
                turn.outcome = "error"
                await self._answer_internal_error(key, event, begun)
            raise  # logged by the worker
        finally:
            if stream is not None:
                stream.close()  # after the final's delivery: the chat's slot is free again
                self.metrics.stream_edits_total += stream.edits
                self.metrics.stream_flood_waits_total += stream.floods
            turn.log(log)

    async def _answer_internal_error(
        self, key: str, event: MessageEvent, begun: TurnStart | None
    ) -> None:
        """An unexpected error (a bug, the store) before the turn recorded its end: answer
        its messages with a short error all the same, as a failed agent call is answered,
        instead of leaving them waiting for a restart. If even that cannot be recorded,
        the turn's marker and messages stay, and the next start runs them again."""
        source = event.source
        chunks = self.delivery.split(source, INTERNAL_ERROR_TEXT)
        try:
            if begun is not None:
                failed = TurnOutcome.failed(INTERNAL_ERROR_TEXT, "error")
                ids = await self._finish(key, begun, event, failed, chunks, edits=[])
            else:
                ids = await self.turnlog.answer_unbegun(key, event, chunks)
        except Exception as exc:
            log.warning("turn_error_unanswered", error=str(exc), error_type=type(exc).__name__)
            return
        await self.delivery.send_recorded(
            source, list(zip(ids, chunks, strict=False)), event.reply_to
        )

    async def _finish(
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
        waiting = queue.pop_next_turn() if queue and not self._draining else None
        then = (waiting, self._turn_text(waiting)) if waiting is not None else None
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
                settles=settles,
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
        if waiting is not None and next_start is not None:
            self._next_begun[key] = (waiting, next_start)
        return ids

    async def _log_reset(self, key: str, entry: SessionEntry) -> None:
        """One line per automatic reset: why, and which session it ended."""
        log.info(
            "session_reset",
            reason=entry.auto_reset_reason,
            old_session_id=await self.store.session_replaced_by(key, entry.session_id),
            new_session_id=entry.session_id,
            had_activity=entry.reset_had_activity,
        )

    def _slot_free(self) -> bool:
        """Would a turn begun now take an agent slot at once (its marker then says it
        runs, in its begin transaction: no write of its own)?"""
        return not self._turn_slots.locked()

    async def _take_slot(self, key: str, begun: TurnStart) -> None:
        """The turn's agent slot. From here on the turn runs, and its marker says so (a
        crash then counts against it in the stuck-loop guard): said at begin already
        when a slot was free then; otherwise, or when the slot went meanwhile, said now,
        in the next group commit, unawaited."""
        row, marked = begun.user_row, begun.running
        if self._turn_slots.locked():
            if marked and row is not None:
                self.turnlog.mark_running(key, row, False)  # it waits after all
            marked = False
        await self._turn_slots.acquire()
        if not marked and row is not None:
            self.turnlog.mark_running(key, row, True)

    async def _call_agent(
        self,
        key: str,
        request: TurnRequest,
        spec: AgentSpec,
        stream: Stream | None,
        begun: TurnStart,
    ) -> TurnOutcome:
        """Run the agent; a failure becomes a short text for the user, never an exception.
        With a `stream`, an agent that can stream (`stream_turn`) shows its reply as it
        writes it; one that cannot answers as before."""
        timeout = spec.config.gateway_timeout
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._take_slot(key, begun)
            try:
                async with self.agents.lease(key, spec.signature) as agent:
                    self._deadlines.arm(task, timeout)
                    try:
                        streaming = getattr(agent, "stream_turn", None) if stream else None
                        if streaming is not None and stream is not None:
                            result = await streaming(request, stream.update)
                        else:
                            result = await agent.run_turn(request)
                        check_tool_rounds(result.messages)
                        check_attachments(result.attachments)
                    except asyncio.CancelledError:
                        # Ours (the deadline) unless someone else cancelled too (/stop).
                        if self._deadlines.disarm(task) and task.uncancel() == 0:
                            raise TimeoutError from None
                        raise
                    finally:
                        self._deadlines.disarm(task)
            finally:
                self._turn_slots.release()
        except TimeoutError:
            self.metrics.turn_timeouts_total += 1
            log.warning("turn_timeout", timeout_seconds=timeout)
            return TurnOutcome.failed(
                f"The agent did not answer within {timeout:g} seconds. Try again, or /new.",
                "timeout",
            )
        except AgentError as exc:
            self.metrics.turn_errors_total += 1
            log.warning("turn_failed", error=str(exc))
            return TurnOutcome.failed(f"Sorry, the agent failed: {exc}")
        except Exception as exc:
            self.metrics.turn_errors_total += 1
            log.exception("turn_crashed", error_type=type(exc).__name__)
            return TurnOutcome.failed(
                "Sorry, something went wrong while answering. The error was logged.", "error"
            )
        return TurnOutcome(
            reply=result.text,
            text=result.text,
            usage=result.usage,
            messages=result.messages,
            attachments=tuple(result.attachments),
        )

    def toolbox_for(self, agent_id: str) -> Toolbox | None:
        """The agent's tools (None: its turns carry none)."""
        return self._toolboxes.get(agent_id)

    def _turn_tools(
        self, key: str, session_id: str, source: SessionSource, user_row: int | None = None
    ) -> TurnTools | None:
        """This turn's tools, bound to its session, chat and user, and its own first
        transcript row (`user_row`) (None: no tools)."""
        toolbox = self.toolbox_for(self.roster.for_key(key).agent_id)
        if toolbox is None:
            return None
        scope = TurnScope(
            store=self.store,
            recall=self.recall,
            schedules=self.schedule_book,
            session_key=key,
            session_id=session_id,
            source=source,
            agent_id=agent_id_of(key),
            user_row=user_row,
        )
        return toolbox.bind(scope)

    def _system_prompt(self, context: SessionContext, agent: AgentSpec) -> str:
        """The agent's configured prompt, or two lines saying what it is and which tools
        it has; then the session's context."""
        block = build_session_context_prompt(context, redact_pii=agent.config.redact_pii)
        custom = agent.config.system_prompt
        if custom is None:
            custom = self._default_prompts.get(agent.agent_id)
        if custom is None:  # an agent's tools are fixed at start: built once per agent
            toolbox = self.toolbox_for(agent.agent_id)
            names = ", ".join(toolbox.tools) if toolbox is not None else ""
            custom = self._default_prompts[agent.agent_id] = (
                f"Agent {agent.agent_id!r} of hermes-gateway: an AI assistant answering"
                " people in chats.\n"
                + (f"Tools you may call: {names}." if names else "You have no tools.")
            )
        return f"{custom}\n\n{block}" if custom else block

    def _with_reset_notice(self, entry: SessionEntry, reply: str) -> str:
        if not entry.was_auto_reset:
            return reply
        policy = self.config.get_reset_policy(entry.platform or Platform.LOCAL, entry.chat_type)
        if not policy.notify:
            return reply
        return f"{reset_notice(entry.auto_reset_reason)}\n\n{reply}"

    # --- outbound (`gateway.delivery`) -----------------------------------------------------

    def split_reply(self, target: SessionSource, text: str) -> list[str]:
        return self.delivery.split(target, text)

    async def deliver(self, target: SessionSource, text: str, reply_to: str | None = None) -> int:
        return await self.delivery.deliver(target, text, reply_to)

    async def resend_pending(self, min_age_seconds: float = 0) -> int:
        return await self.delivery.resend_pending(min_age_seconds)

    def send_pending_soon(self) -> None:
        """SIGUSR2: another process recorded a reply (`pairing approve`'s notice). On a
        replica, the housekeeping leader sends it (gateway.replica)."""
        if self.cluster is not None:
            self.cluster.send_pending_soon()
        else:
            self._housekeeper.send_pending_soon()

    # --- GatewayHandle (what adapters may ask) --------------------------------------------

    async def replies_after(
        self, platform: str, chat_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        return await self.turnlog.replies_after(platform, chat_id, after, limit)

    async def last_reply_seq(self, platform: str, chat_id: str) -> int:
        return await self.turnlog.last_reply_seq(platform, chat_id)

    async def is_paired(self, platform: str, user_id: str) -> bool:
        return await self.pairing.is_paired(platform, user_id)

    async def request_pairing(self, source: SessionSource) -> str | None:
        assert source.user_id is not None
        return await self.pairing.request(
            source.platform.value, source.user_id, source.user_name, target=source
        )

    async def notify(self, target: SessionSource, text: str) -> None:
        await self.deliver(target, text)

    def health(self) -> dict[str, Any]:
        adapters = {p.value: a.health() for p, a in self.adapters.items()}
        store = self.store.write_health()
        # On a replica, a single-connection platform runs on its leader only: elsewhere it
        # is on standby, not down.
        serving = [
            health
            for platform, health in adapters.items()
            if self.cluster is None or not self.adapters[Platform(platform)].single_connection
        ]
        accepting = self._accepting and (self.cluster is None or self.cluster.healthy)
        ok = (
            accepting
            and store["state"] == "writable"
            and all(h.get("state") == "running" for h in serving)
        )
        health = {
            "status": "ok" if ok else "degraded",
            "accepting": accepting,
            "uptime_seconds": round(time.monotonic() - self._started_at, 1),
            "store": store,
            "adapters": adapters,
        }
        if self.cluster is not None:
            health["replica"] = self.cluster.status()
        return health

    def status_snapshot(self) -> dict[str, Any]:
        """What `hermes-gateway status` shows (status.json, rewritten when this changes)."""
        state = "running" if self._accepting else "stopping" if self._draining else "starting"
        return {
            "state": state,
            "health": self.health(),
            "agent": self.roster.main.description,
            "agents": self.roster.describe(),
            "active_turns": self.busy_sessions(),
            "queue_depth": sum(q.depth for q in self._queues.values()),
            "next_schedule": self._next_schedule(),
        }

    def _next_schedule(self) -> dict[str, Any] | None:
        """The scheduler's earliest fire time, as it last read it."""
        upcoming = self.scheduler.next_fire
        if upcoming is None:
            return None
        return {"schedule_id": upcoming[0], "fire_at": iso(upcoming[1])}

    def metrics_text(self) -> str:
        return self.metrics.render()

    def _metric_gauges(self) -> dict[str, tuple[str, float]]:
        """The gauges of /metrics, read at scrape time."""
        return {
            "active_turns": ("Sessions with a turn running", self.busy_sessions()),
            "queue_depth": (
                "Messages waiting behind running turns",
                sum(q.depth for q in self._queues.values()),
            ),
            "agent_cache_size": ("Cached per-session agents", len(self.agents)),
            "store_writable": (
                "1 while the store can write, 0 while the disk refuses (full, read-only)",
                int(self.store.write_health()["state"] == "writable"),
            ),
        }
