"""GatewayRunner: the one owner of per-session state, and the flow of every message.

    handle_message: authorize -> command? -> busy? queue : start the session worker
    session worker: turn -> next from the queue -> turn ... until the queue is empty
    turn:           session (reset policy) -> agent -> transcript -> reply, split and sent

One turn runs per session key at a time; different keys run concurrently, at most
`agent.max_concurrent_turns` agent calls at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from adapters.base import Accepted, AcceptStatus, MessageEvent, PlatformAdapter
from config import GatewayConfig, hermes_home
from gateway import commands
from gateway.agents import (
    AgentCache,
    AgentError,
    AgentFactory,
    TurnRequest,
    agent_signature,
    build_agent_factory,
    describe_backend,
)
from gateway.metrics import Metrics
from gateway.queue import QueueFull, SessionQueue
from gateway.session import (
    Platform,
    SessionEntry,
    SessionSource,
    build_session_context,
    build_session_context_prompt,
)
from gateway.store import SessionStore
from gateway.watcher import Housekeeper

log = structlog.get_logger("gateway.run")

TYPING_REFRESH_SECONDS = 4.0
FinalizeHook = Callable[[SessionEntry], Awaitable[None]]

RESET_NOTICES = {
    "idle": "Your previous session ended after inactivity, so this is a fresh start.",
    "daily": "Your previous session ended at the daily reset, so this is a fresh start.",
    "suspended": "Your previous session was stopped, so this is a fresh start.",
}


class GatewayRunner:
    def __init__(
        self,
        config: GatewayConfig,
        adapters: Sequence[PlatformAdapter] | None = None,
        agent_factory: AgentFactory | None = None,
        *,
        home: Path | None = None,
    ) -> None:
        self.config = config
        self.home = Path(home) if home is not None else hermes_home()
        self.adapters: dict[Platform, PlatformAdapter] = {a.platform: a for a in adapters or ()}
        # Not `is_busy`: the turn that asks for its session is itself the busy worker, and
        # that must not block the reset policy. The watcher skips busy keys on its own.
        self.store = SessionStore(self.home / "sessions", config)
        self.agents = AgentCache(
            agent_factory or build_agent_factory(config.agent),
            max_size=config.agent.cache_max_size,
            idle_ttl=config.agent.cache_idle_ttl_seconds,
        )
        self.metrics = Metrics()
        self.finalize_hooks: list[FinalizeHook] = []
        self._signature = agent_signature(config.agent)
        self._custom_agents = agent_factory is not None
        self._queues: dict[str, SessionQueue] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._turn_slots = asyncio.Semaphore(config.agent.max_concurrent_turns)
        self._housekeeper = Housekeeper(self)
        self._accepting = False
        self._started_at = time.monotonic()

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.open()
        for adapter in self.adapters.values():
            adapter.bind(self)
            await adapter.start()
        self._housekeeper.start()
        self._accepting = True
        backend = "custom agent factory" if self._custom_agents else None
        log.info(
            "gateway_started",
            agent=backend or describe_backend(self.config.agent),
            adapters=[p.value for p in self.adapters],
            home=str(self.home),
        )

    async def stop(self) -> None:
        self._accepting = False
        for adapter in self.adapters.values():
            try:
                await adapter.stop()
            except Exception:
                log.exception("adapter_stop_failed", platform=adapter.platform.value)
        await self._housekeeper.stop()
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await self.agents.close_all()
        await self.store.close()
        log.info("gateway_stopped")

    def on_session_finalize(self, hook: FinalizeHook) -> None:
        """Register a coroutine run for each session the expiry watcher finalizes."""
        self.finalize_hooks.append(hook)

    # --- inbound -------------------------------------------------------------------------

    async def handle_message(self, event: MessageEvent) -> Accepted:
        """Accept one inbound message; returns at once, the turn runs in the background."""
        self.metrics.messages_received_total += 1
        if not self._accepting:
            self.metrics.messages_refused_total += 1
            return Accepted(AcceptStatus.REFUSED, detail="the gateway is not accepting messages")
        adapter = self.adapters.get(event.source.platform)
        if adapter is not None and not await adapter.authorize(event):
            return Accepted(AcceptStatus.IGNORED, detail="not authorized")
        text = event.text.strip()
        if not text:
            return Accepted(AcceptStatus.IGNORED, detail="empty message")
        try:
            key = self.store.session_key_for(event.source)
        except ValueError as exc:
            return Accepted(AcceptStatus.IGNORED, detail=str(exc))

        if event.message_id and not event.synthetic:
            fresh = await self.store.accept_inbound(
                event.source.platform.value, event.source.chat_id, event.message_id
            )
            if not fresh:
                return Accepted(AcceptStatus.DUPLICATE, session_key=key)

        command = commands.parse_command(text, adapter.bot_username if adapter else None)
        if command is not None:
            self.metrics.commands_total += 1
            return await commands.dispatch(self, event, key, command)
        return await self.submit(key, event)

    async def submit(self, key: str, event: MessageEvent, *, fifo: bool = False) -> Accepted:
        """Start a turn now, or park the message behind the running one."""
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(
                self._session_worker(key, event), name=f"session:{key}"
            )
            return Accepted(AcceptStatus.STARTED, session_key=key)
        queue = self._queues.setdefault(key, SessionQueue(self.config.queue.max_depth))
        try:
            if fifo:
                queue.enqueue_fifo(event)
            else:
                queue.enqueue_pending(event)
        except QueueFull:
            self.metrics.messages_refused_total += 1
            await self.deliver(
                event.source,
                f"Too many messages are waiting ({queue.depth}); this one was not queued. "
                "Wait for the current reply or /stop it.",
            )
            return Accepted(AcceptStatus.REFUSED, session_key=key, detail="queue full")
        return Accepted(AcceptStatus.QUEUED if fifo else AcceptStatus.PENDING, session_key=key)

    # --- per-session state (used by commands and the watcher) ----------------------------

    def is_busy(self, key: str) -> bool:
        return key in self._workers

    def queue_depth(self, key: str) -> int:
        queue = self._queues.get(key)
        return queue.depth if queue else 0

    async def cancel_session_work(self, key: str) -> bool:
        """Cancel the running turn and drop the queue of one session; True if one ran."""
        queue = self._queues.pop(key, None)
        if queue:
            queue.clear()
        task = self._workers.get(key)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.metrics.turns_cancelled_total += 1
        return True

    # --- turns ---------------------------------------------------------------------------

    async def _session_worker(self, key: str, event: MessageEvent | None) -> None:
        try:
            while event is not None:
                await self._run_turn(key, event)
                queue = self._queues.get(key)
                event = queue.pop_next() if queue else None
        finally:
            self._workers.pop(key, None)
            queue = self._queues.get(key)
            if queue is not None and not queue:
                del self._queues[key]

    async def _run_turn(self, key: str, event: MessageEvent) -> None:
        structlog.contextvars.bind_contextvars(session_key=key)
        started = time.monotonic()
        source = event.source
        entry = await self.store.get_or_create_session(source)
        context = build_session_context(source, self.config, entry)
        text = event.text.strip()
        if context.shared_multi_user_session:
            text = f"[{source.user_name or source.user_id or 'someone'}] {text}"
        history = await self.store.load_transcript(entry.session_id)
        user_message: dict[str, Any] = {"role": "user", "content": text}
        if event.message_id:
            user_message["message_id"] = event.message_id
        await self.store.append_to_transcript(entry.session_id, user_message)

        request = TurnRequest(
            session_key=key,
            session_id=entry.session_id,
            text=text,
            history=tuple(history),
            system_prompt=self._system_prompt(context),
            source=source,
        )
        typing = asyncio.create_task(self._keep_typing(source))
        try:
            reply = await self._call_agent(key, entry, request)
        finally:
            typing.cancel()
        self.metrics.observe_turn(time.monotonic() - started)
        await self.deliver(source, self._with_reset_notice(entry, reply))

    async def _call_agent(self, key: str, entry: SessionEntry, request: TurnRequest) -> str:
        """Run the agent; a failure becomes a short reply instead of an exception."""
        timeout = self.config.agent.gateway_timeout
        try:
            async with self._turn_slots, self.agents.lease(key, self._signature) as agent:
                async with asyncio.timeout(timeout):
                    result = await agent.run_turn(request)
        except TimeoutError:
            self.metrics.turn_timeouts_total += 1
            log.warning("turn_timeout", timeout_seconds=timeout)
            return f"The agent did not answer within {timeout:g} seconds. Try again, or /new."
        except AgentError as exc:
            self.metrics.turn_errors_total += 1
            log.warning("turn_failed", error=str(exc))
            return f"Sorry, the agent failed: {exc}"
        except Exception as exc:
            self.metrics.turn_errors_total += 1
            log.exception("turn_crashed", error_type=type(exc).__name__)
            return "Sorry, something went wrong while answering. The error was logged."

        await self.store.append_to_transcript(
            entry.session_id, {"role": "assistant", "content": result.text}
        )
        await self.store.update_session(
            key, last_prompt_tokens=result.usage.input_tokens, usage=result.usage
        )
        if entry.resume_pending:
            await self.store.clear_resume_pending(key)
        if entry.was_auto_reset or entry.is_fresh_reset:
            await self.store.acknowledge_reset(key)
        self.metrics.turns_total += 1
        return result.text

    def _system_prompt(self, context: Any) -> str:
        block = build_session_context_prompt(context, redact_pii=self.config.agent.redact_pii)
        custom = self.config.agent.system_prompt
        return f"{custom}\n\n{block}" if custom else block

    def _with_reset_notice(self, entry: SessionEntry, reply: str) -> str:
        if not entry.was_auto_reset:
            return reply
        policy = self.config.get_reset_policy(entry.platform or Platform.LOCAL, entry.chat_type)
        if not policy.notify:
            return reply
        why = RESET_NOTICES.get(entry.auto_reset_reason or "", RESET_NOTICES["idle"])
        return f"({why} /resume to go back.)\n\n{reply}"

    async def _keep_typing(self, source: SessionSource) -> None:
        adapter = self.adapters.get(source.platform)
        if adapter is None:
            return
        with contextlib.suppress(Exception):  # typing is cosmetic; never fail a turn on it
            while True:
                await adapter.send_typing(source)
                await asyncio.sleep(TYPING_REFRESH_SECONDS)

    # --- outbound ------------------------------------------------------------------------

    async def deliver(self, target: SessionSource, text: str) -> int:
        """Split `text` to the platform limit and send the chunks in order; returns sent."""
        adapter = self.adapters.get(target.platform)
        if adapter is None:
            log.warning("no_adapter_for_reply", platform=target.platform.value)
            return 0
        sent = 0
        for chunk in adapter.split(text):
            try:
                await adapter.send(target, chunk)
            except Exception as exc:
                self.metrics.send_errors_total += 1
                log.error("send_failed", platform=target.platform.value, error=str(exc))
                break
            sent += 1
            self.metrics.replies_sent_total += 1
        return sent

    # --- GatewayHandle (what adapters may ask) --------------------------------------------

    async def list_sessions(self) -> list[dict[str, Any]]:
        return [entry.to_dict() for entry in await self.store.list_sessions()]

    def health(self) -> dict[str, Any]:
        adapters = {p.value: a.health() for p, a in self.adapters.items()}
        ok = self._accepting and all(h.get("state") == "running" for h in adapters.values())
        return {
            "status": "ok" if ok else "degraded",
            "accepting": self._accepting,
            "uptime_seconds": round(time.monotonic() - self._started_at, 1),
            "adapters": adapters,
        }

    def metrics_text(self) -> str:
        return self.metrics.render(
            {
                "active_turns": ("Sessions with a turn running", len(self._workers)),
                "queue_depth": (
                    "Messages waiting behind running turns",
                    sum(q.depth for q in self._queues.values()),
                ),
                "agent_cache_size": ("Cached per-session agents", len(self.agents)),
            }
        )
