"""GatewayRunner: the runner's lifecycle (start, stop, drain), the intake of every
message, and the parts it composes.

    handle_message: validate ids -> authorize (the platform's adapter) -> classify
                    (`MessageKind`) -> the placement's intake (`placement`): accepted
                    and run by the turn engine (`engine`), here or on another replica
    start:          open the store -> the placement starts adapters, recovery or the
                    replica's sweeper, the scheduler and the housekeeper
    stop:           refuse new messages -> drain running turns -> stop the adapters and
                    background parts -> close the store -> `.clean_shutdown`

Several agents (`agents:`, `routes:`) share all of this: a session key names its agent
(`agent:{id}:...`, picked by the store's router), and `Roster.for_key` gives a turn its
agent's settings. The parts receive the runner typed as the narrow port of what they
call (`ports`); none touches another's private state.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from adapters.base import PlatformAdapter
from config import GatewayConfig, hermes_home
from gateway.agents.cache import AgentCache
from gateway.agents.protocol import AgentFactory
from gateway.agents.roster import Roster
from gateway.domain.command_syntax import MessageKind, classify
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.domain.session import Platform, SessionSource, validate_chat_id, validate_id
from gateway.mcp import McpHub
from gateway.memory.recall import Recall
from gateway.memory.summaries import Memory
from gateway.ops.metrics import Metrics
from gateway.ops.status import keep_status, write_status
from gateway.runner.agent_call import AgentCall
from gateway.runner.agent_tasks import TaskService
from gateway.runner.approvals import Approvals
from gateway.runner.budgets import Budgets
from gateway.runner.deadlines import Deadlines
from gateway.runner.delivery import Delivery
from gateway.runner.engine import TurnEngine
from gateway.runner.housekeeping import Housekeeper
from gateway.runner.media import MediaIntake
from gateway.runner.pairing import Pairing
from gateway.runner.placement import LocalPlacement, Placement, ReplicaPlacement
from gateway.runner.ports import FinalizeHook
from gateway.runner.queue import Job
from gateway.runner.recovery import Recovery
from gateway.runner.sessions import SEARCH_DEFAULT_LIMIT, SessionArchive
from gateway.runner.streaming import Streams
from gateway.runner.turn import TurnRunner
from gateway.runner.usage_commands import usage_report
from gateway.schedules.book import ScheduleBook, iso
from gateway.schedules.loop import Scheduler
from gateway.store import archive, cursors
from gateway.store.outage import StoreUnwritable
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog
from gateway.tools.registry import Toolbox

log = structlog.get_logger("gateway.run")


class GatewayRunner:
    """The gateway's runner: `await start()`, `await handle_message(event)`, `await
    stop()`. Implements `adapters.base.GatewayHandle` and the parts' ports."""

    engine: TurnEngine  # built after the parts whose callbacks reach it

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
        plan_for = self.roster.plan_for if self.roster.per_key else None
        self.turnlog = TurnLog(
            self.store, history_limit=main.config.history_limit, plan=main.plan, plan_for=plan_for
        )
        self.recovery = Recovery(self)
        self.pairing = Pairing(self.store)
        # One cache for all agents: its keys are session keys, which name their agent.
        self.agents = AgentCache(
            self.roster.build,
            max_size=config.agent.cache_max_size,
            idle_ttl=config.agent.cache_idle_ttl_seconds,
        )
        # Background summaries yield to turns: of their own session always, of their
        # agent's other sessions for a bounded time (`gateway.memory.summaries`).
        self.memory = Memory(
            self.store,
            main.plan,
            lambda key: self.agents.lease(key, self.roster.for_key(key).signature),
            plan_for=plan_for,
            session_busy=self.is_busy,
            agent_busy=lambda key: self.engine.agent_busy(key),
        )
        # Long-term memory: notes and hybrid recall (the memory tools, `hermes-gateway memory`).
        self.recall = Recall(self.store, config)
        # Scheduled jobs: the book (commands, tools) and the loop that fires them.
        self.schedule_book = ScheduleBook(
            self.store, config, platforms=lambda: [p.value for p in self.adapters]
        )
        self.scheduler = Scheduler(self, self.schedule_book)
        # Its own registry; gauges and the tool servers' health are read at scrape time.
        self.metrics = Metrics(gauges=self._metric_gauges, tool_servers=self._tool_server_health)
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
        self.sessions = SessionArchive(
            self.home, self.store, self.agents, self.recall, self.is_busy
        )
        self.finalize_hooks: list[FinalizeHook] = []
        self.restart_requested = asyncio.Event()
        self.housekeeper = Housekeeper(self)
        # The turns' deadlines, shared with the approvals: a turn waiting for the user's
        # /approve stops its clock meanwhile.
        deadlines = Deadlines(min(a.config.gateway_timeout for a in self.roster))
        self.approvals = Approvals(self, deadlines, config.mcp.approval_timeout_seconds)
        # The MCP tool servers (none configured: the hub holds nothing and starts nothing).
        self.mcp = McpHub(config.mcp, self.home)
        asking = AgentCall(
            config,
            self.roster,
            self.agents,
            agent_factory,
            self.turnlog,
            self.metrics,
            self.store,
            self.recall,
            self.schedule_book,
            deadlines=deadlines,
            approvals=self.approvals,
            mcp=self.mcp,
        )
        # `agent_call` (None: no agent delegates); its remote agents are probed in the
        # background for /healthz, never on a request's path.
        self.delegation = asking.delegation
        self._probe_task: asyncio.Task[None] | None = None
        # Usage per user and day, charged in each turn's finish; with `budgets:` set,
        # checked in each new turn's begin.
        self.budgets = Budgets(config, self.metrics)
        self.budgets.seed_counters(
            (spec.agent_id, spec.model) for spec in self.roster.every_model()
        )
        if self.budgets.enabled:
            self.turnlog.gate = self.budgets.gate
        turns = TurnRunner(
            config,
            self.adapters,
            self.store,
            self.turnlog,
            self.roster,
            self.memory,
            self.recall,
            self.scheduler,
            self.metrics,
            self.streams,
            self.delivery,
            self.media,
            self.recovery,
            asking,
            self.budgets,
        )
        self.engine = TurnEngine(
            config,
            self.adapters,
            self.turnlog,
            self.memory,
            self.metrics,
            self.delivery,
            asking,
            turns,
            commands=self,
        )
        # Several replicas on one PostgreSQL store: a session runs where its lease is; on
        # SQLite this process is the only one and holds everything.
        self.placement: Placement = (
            ReplicaPlacement(
                self, self.engine, self.turnlog, self.metrics, self.scheduler, self.housekeeper
            )
            if self.store.postgres
            else LocalPlacement(
                self.engine, self.turnlog, self.recovery, self.scheduler, self.housekeeper
            )
        )
        self.engine.placement = self.placement
        # Agent tasks (A2A, native delegation): their platform is in process, there when
        # the config gives agents tasks, so a task's turn is answered and resumed like any
        # chat's; without, nothing of it shows in health, status or the log.
        self.agent_tasks = TaskService(
            self.roster,
            self.store,
            self.engine,
            self.placement,
            self.metrics,
            self.approvals,
            accepting=lambda: self.accepting,
        )
        if config.takes_agent_tasks():
            self.adapters[Platform.A2A] = self.agent_tasks.channel
        self.engine.tasks = self.agent_tasks
        asking.agent_tasks = self.agent_tasks  # what `agent_call` hands native delegations to
        self.accepting = False
        self._started_at = time.monotonic()
        self._status_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def add_adapters(self, adapters: Sequence[PlatformAdapter]) -> None:
        """Adapters built after the runner (before `start()`): the composition root builds
        them while the store's start-up check runs."""
        self.adapters.update({a.platform: a for a in adapters})

    @property
    def draining(self) -> bool:
        return self.engine.draining

    async def start(self) -> None:
        """Open the store, then the placement starts the adapters and what runs beside the
        turns, recovering interrupted work first when this process runs alone."""
        self.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        await self.store.open()
        await self.recall.start()  # its indexer catches up in the background
        # Tool servers before the first turn: each gets one connect attempt (bounded);
        # one that is slow or down keeps connecting in the background.
        await self.mcp.start()
        for adapter in self.adapters.values():
            adapter.bind(self)
        facts = await self.placement.start(list(self.adapters.values()), self._open_intake)
        self._status_task = asyncio.create_task(keep_status(self.home, self.status_snapshot))
        if self.delegation is not None and self.config.remote_agents:
            self._probe_task = asyncio.create_task(self.delegation.probe_loop())
        # What is alive now (modules, config, clients) lives as long as the process: move
        # it out of the collector's reach. A full collection walks all of it, stalling
        # the event loop (and with it every write to state.db).
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

    def _open_intake(self) -> None:
        self.accepting = True

    async def stop(self, *, restart: bool = False) -> None:
        """Drain: refuse new messages, let running turns finish up to
        `agent.restart_drain_timeout`, then cancel the rest and mark them resume_pending
        (their markers re-run them on the next start). Writes `.clean_shutdown` last,
        unless start-up failed before recovery consumed it."""
        self.accepting = False
        self.engine.draining = True
        await self.placement.stop_leading()
        await self.scheduler.stop()
        reason = "restart_timeout" if restart else "shutdown_timeout"
        for key in await self.engine.drain(self.config.agent.restart_drain_timeout):
            # A full disk refuses the flag; the turn's marker re-runs it all the same.
            with contextlib.suppress(StoreUnwritable):
                await self.store.mark_resume_pending(key, reason)
                # Stopped on purpose: whoever resumes it must not count this stop as a
                # crash while it ran (a replica's takeover).
                await self.turnlog.mark_waiting(key)
            log.warning("turn_interrupted_by_shutdown", session_key=key, reason=reason)
        for adapter in self.adapters.values():
            try:
                await adapter.stop()
            except Exception:
                log.exception("adapter_stop_failed", platform=adapter.platform.value)
        await self.housekeeper.stop()
        await self.memory.close()  # summaries in flight: cancelled, none half written
        # A started runner (a replica too, which runs no start-up recovery) says it stopped.
        reported = self._status_task is not None or self.recovery.marked
        if self._status_task is not None:
            self._status_task.cancel()
            await asyncio.gather(self._status_task, return_exceptions=True)
        await self.agents.close_all()
        await self.mcp.stop()  # the turns are over: no call is in flight
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        if self.delegation is not None:
            await self.delegation.close()
        await self.media.close()
        await self.recall.close()
        await self.placement.stop()
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

    # --- intake --------------------------------------------------------------------------

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
        if not self.accepting:
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

        kind, command = classify(text, adapter.bot_username)
        if kind is MessageKind.QUEUE:
            assert command is not None
            event = replace(event, text=command.args)
        return await self.placement.intake(key, event, kind, command)

    async def requeue(self, key: str, event: MessageEvent, kind: MessageKind) -> None:
        """An accepted message not yet answered (start-up recovery, a replica picking up
        a session): queued as it was on arrival."""
        await self.engine.requeue(key, event, kind)

    async def start_scheduled(
        self, key: str, event: MessageEvent, text: str, claim: Callable[[Any], bool]
    ) -> bool:
        """A scheduled run (`gateway.schedules.loop`): claim it and begin its turn in the
        schedule's session in one transaction. False: the session is busy, the gateway
        stopping, or the claim refused (nothing was written)."""
        if not self.accepting:
            return False
        return await self.placement.start_scheduled(key, event, text, claim)

    # --- sessions' lanes (the turn engine's) ---------------------------------------------

    async def submit(self, key: str, event: Job, *, fifo: bool = False) -> Accepted:
        """Start a turn (or lane command) now, or park it behind the running one."""
        return await self.engine.submit(key, event, fifo=fifo)

    def is_busy(self, key: str) -> bool:
        return self.engine.is_busy(key)

    def busy_sessions(self) -> int:
        return self.engine.busy_sessions()

    def queue_depth(self, key: str) -> int:
        return self.engine.queue_depth(key)

    async def cancel_session_work(self, key: str) -> bool:
        """Cancel the running turn and drop the queue of one session; True if one ran."""
        return await self.engine.cancel_session_work(key)

    async def cancel_all_turns(self) -> None:
        """The database is gone for longer than a lease lives (gateway.runner.replica):
        stop every turn at once, writing nothing; their markers let the next holder
        resume them."""
        await self.engine.cancel_all_turns()

    def is_admin(self, source: SessionSource) -> bool:
        return f"{source.platform.value}:{source.user_id}" in self.config.admins

    def toolbox_for(self, agent_id: str) -> Toolbox | None:
        """The agent's tools (None: its turns carry none)."""
        return self.engine.asking.toolbox_for(agent_id)

    def _tool_server_health(self) -> dict[str, dict[str, Any]]:
        return self.mcp.health() if self.config.mcp.servers else {}

    def tool_servers(self) -> dict[str, dict[str, Any]]:
        """The MCP tool servers' states: {name: {state, tools, last_error}}."""
        return self.mcp.health()

    # --- stored sessions (`sessions`) ----------------------------------------------------

    async def list_sessions(self, agent: str | None = None) -> list[dict[str, Any]]:
        return await self.sessions.list_sessions(agent)

    async def list_sessions_page(
        self, agent: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[dict[str, Any]], str | None]:
        return await self.sessions.list_sessions_page(agent, after, limit)

    async def search_sessions(
        self,
        query: str,
        *,
        session_key: str | None = None,
        platform: str | None = None,
        chat_id: str | None = None,
        agent: str | None = None,
        limit: int = SEARCH_DEFAULT_LIMIT,
    ) -> list[dict[str, Any]]:
        return await self.sessions.search_sessions(
            query,
            session_key=session_key,
            platform=platform,
            chat_id=chat_id,
            agent=agent,
            limit=limit,
        )

    async def get_session(
        self, session_id: str, after: int = 0, limit: int = archive.PAGE_MAX
    ) -> dict[str, Any] | None:
        return await self.sessions.get_session(session_id, after, limit)

    async def delete_session(self, session_id: str) -> dict[str, Any]:
        return await self.sessions.delete_session(session_id)

    async def load_cursor(self, platform: str, name: str) -> str | None:
        return await self.store.read(lambda conn: cursors.load(conn, platform, name))

    async def save_cursor(self, platform: str, name: str, value: str) -> None:
        now = time.time()
        await self.store.write(
            lambda conn: cursors.save(conn, platform, name, value, now), dirty=False
        )

    async def usage_report(self, **query: Any) -> dict[str, Any]:
        return await usage_report(self.store, self.config, **query)

    # --- outbound (`delivery`) -----------------------------------------------------------

    def split_reply(self, target: SessionSource, text: str) -> list[str]:
        return self.delivery.split(target, text)

    async def deliver(self, target: SessionSource, text: str, reply_to: str | None = None) -> int:
        return await self.delivery.deliver(target, text, reply_to)

    async def resend_pending(self, min_age_seconds: float = 0) -> int:
        return await self.delivery.resend_pending(min_age_seconds)

    def send_pending_soon(self) -> None:
        """SIGUSR2: another process recorded a reply (`pairing approve`'s notice)."""
        self.placement.send_pending_soon()

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
        serving = [
            adapters[platform.value]
            for platform, adapter in self.adapters.items()
            if not self.placement.standing_by(adapter)
        ]
        accepting = self.accepting and self.placement.healthy
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
        replica = self.placement.status()
        if replica is not None:
            health["replica"] = replica
        if self.config.mcp.servers:  # a tool server down degrades a tool, not the gateway
            health["mcp"] = self.mcp.health()
        if self.config.remote_agents and self.delegation is not None:
            # a remote agent down fails its delegations, not the gateway
            health["remote_agents"] = self.delegation.health()
        return health

    def status_snapshot(self) -> dict[str, Any]:
        """What `hermes-gateway status` shows (status.json, rewritten when this changes)."""
        state = "running" if self.accepting else "stopping" if self.draining else "starting"
        return {
            "state": state,
            "health": self.health(),
            "agent": self.roster.main.description,
            "agents": self.roster.describe(),
            "active_turns": self.busy_sessions(),
            "queue_depth": self.engine.total_queue_depth(),
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
                self.engine.total_queue_depth(),
            ),
            "agent_cache_size": ("Cached per-session agents", len(self.agents)),
            "store_writable": (
                "1 while the store can write, 0 while the disk refuses (full, read-only)",
                int(self.store.write_health()["state"] == "writable"),
            ),
        }
