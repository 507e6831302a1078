"""What a turn asks its agent, and the asking: the system prompt, the turn's tools, the
agent slots (`agent.max_concurrent_turns`) and the turn's deadline. A failed call becomes
a short text for the user (`TurnOutcome.failed`), never an exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from config import GatewayConfig
from gateway.agents.cache import AgentCache
from gateway.agents.protocol import (
    AgentError,
    AgentFactory,
    TurnRequest,
    check_attachments,
    check_tool_rounds,
)
from gateway.agents.roster import AgentSpec, Roster
from gateway.domain.attachments import Attachment
from gateway.domain.session import (
    Platform,
    SessionContext,
    SessionSource,
    TokenUsage,
)
from gateway.mcp import McpHub
from gateway.memory.recall import Recall
from gateway.ops.metrics import Metrics
from gateway.runner.deadlines import Deadlines
from gateway.runner.prompts import SystemPrompts
from gateway.runner.streaming import Stream
from gateway.schedules.book import ScheduleBook
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.tools import BUILTIN_TOOLS
from gateway.tools.approval import ApprovalGate
from gateway.tools.delegation import Delegation
from gateway.tools.mcp_tools import McpToolSource
from gateway.tools.registry import Sources, Toolbox, TurnScope, TurnTools, agent_id_of

log = structlog.get_logger("gateway.run")

_A2A = Platform.A2A  # a module constant: read on every turn


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


class AgentCall:
    """Asks a session's agent for a turn's reply, within the turn slots and deadline."""

    def __init__(
        self,
        config: GatewayConfig,
        roster: Roster,
        agents: AgentCache,
        agent_factory: AgentFactory | Mapping[str, AgentFactory] | None,
        turnlog: TurnLog,
        metrics: Metrics,
        store: SessionStore,
        recall: Recall,
        schedule_book: ScheduleBook,
        *,
        deadlines: Deadlines | None = None,
        approvals: ApprovalGate | None = None,
        mcp: McpHub | None = None,
    ) -> None:
        self.roster = roster
        self.agents = agents
        self.turnlog = turnlog
        self.metrics = metrics
        self._store, self._recall, self._schedule_book = store, recall, schedule_book
        self._turn_slots = asyncio.Semaphore(config.agent.max_concurrent_turns)
        if deadlines is None:
            deadlines = Deadlines(min(a.config.gateway_timeout for a in roster))
        self._deadlines = deadlines
        self._approvals = approvals  # asked by a tool with `approve` (None: such calls fail)
        # agent id -> (its tool list's version, its default system prompt)
        self._default_prompts: dict[str, tuple[int, str]] = {}
        self._prompts = SystemPrompts()
        # Each agent's tools: the built-ins it is given, then the MCP tools its selection
        # takes; None for the echo backend (no model calls tools) and for `tools: []`:
        # such turns build no tool machinery at all.
        self._toolboxes: dict[str, Toolbox | None] = {}
        # `agent_call` for the agents with delegates (None: no agent delegates), and the
        # runner's task service it hands native delegations to (set by the runner).
        self.delegation = (
            Delegation(config, record=metrics.count_delegation)
            if any(spec.config.delegates for spec in roster)
            else None
        )
        self.agent_tasks: Any = None
        for spec in roster:
            custom = agent_factory is not None and (
                not isinstance(agent_factory, Mapping) or spec.agent_id in agent_factory
            )
            uses_tools = spec.config.backend != "echo" or custom
            selection = spec.config.mcp_selection
            sources: list[Any] = []
            if mcp is not None and mcp.config.servers and not selection.empty:
                sources.append(McpToolSource(mcp, selection))
            if self.delegation is not None and spec.config.delegates:
                sources.append(self.delegation.source_for(spec.agent_id))
            source = sources[0] if len(sources) == 1 else Sources(sources) if sources else None
            self._toolboxes[spec.agent_id] = (
                Toolbox(BUILTIN_TOOLS, spec.config.builtin_tools, source)
                if uses_tools and (spec.config.builtin_tools or source is not None)
                else None
            )

    def slot_free(self) -> bool:
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

    async def call(
        self,
        key: str,
        request: TurnRequest,
        spec: AgentSpec,
        stream: Stream | None,
        begun: TurnStart,
    ) -> TurnOutcome:
        """Run the agent; a failure becomes a short text for the user, never an exception.
        With a `stream`, an agent that can stream (`stream_turn`) shows its reply as it
        writes it; one that cannot answers in one piece."""
        timeout = spec.config.gateway_timeout
        task = asyncio.current_task()
        assert task is not None
        # A delegated agent task (gateway.runner.agent_tasks) takes no slot: its caller's
        # turn holds one while it waits for this, and with every slot so held a
        # delegation would wait forever. The delegation depth bounds them.
        slotless = request.source.is_bot and request.source.platform is _A2A
        try:
            if slotless:
                if not begun.running and begun.user_row is not None:
                    self.turnlog.mark_running(key, begun.user_row, True)
            else:
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
                if not slotless:
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

    def turn_tools(
        self,
        key: str,
        session_id: str,
        source: SessionSource,
        user_row: int | None = None,
        *,
        resumed: bool = False,
    ) -> TurnTools | None:
        """This turn's tools, bound to its session, chat and user, and its own first
        transcript row (`user_row`: the turn, as its tool-call journal knows it) (None:
        no tools). `resumed`: an earlier run of the turn may have recorded calls."""
        toolbox = self.toolbox_for(self.roster.for_key(key).agent_id)
        if toolbox is None:
            return None
        scope = TurnScope(
            store=self._store,
            recall=self._recall,
            schedules=self._schedule_book,
            session_key=key,
            session_id=session_id,
            source=source,
            agent_id=agent_id_of(key),
            user_row=user_row,
            resumed=resumed,
            fence=self.turnlog.fence,
            approvals=self._approvals,
            agent_tasks=self.agent_tasks,
        )
        return toolbox.bind(scope)

    def system_prompt(self, context: SessionContext, agent: AgentSpec) -> str:
        """The agent's configured prompt, or two lines saying what it is and which tools
        it has; then the session's context."""
        custom = agent.config.system_prompt
        if custom is None:  # built once per agent and tool list (MCP lists may change)
            toolbox = self.toolbox_for(agent.agent_id)
            version = toolbox.version if toolbox is not None else 0
            made = self._default_prompts.get(agent.agent_id)
            if made is None or made[0] != version:
                names = ", ".join(toolbox.tools) if toolbox is not None else ""
                made = self._default_prompts[agent.agent_id] = (
                    version,
                    f"Agent {agent.agent_id!r} of hermes-gateway: an AI assistant answering"
                    " people in chats.\n"
                    + (f"Tools you may call: {names}." if names else "You have no tools."),
                )
            custom = made[1]
        return self._prompts.prompt(context, custom, agent.config.redact_pii)
