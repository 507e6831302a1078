"""The narrow ports of the runner's parts: each part is handed the runner typed as one of
these Protocols, which name exactly what that part calls, and nothing else of it.

    CommandContext  the chat commands (`commands`, `schedule_commands`)
    RecoveryHost    start-up recovery (`recovery`)
    HousekeeperHost the background housekeeper (`housekeeping`)
    ReplicaHost     one replica of several (`replica`)
    LaneHooks       what the turn engine tells its placement (`placement`) of a lane
    ApprovalSender  how approvals (`approvals`) put their question to a chat
    ApprovalDesk    what the /approve and /deny commands see of the waiting approvals
    TaskHooks       what the turn engine tells the agent-task service of an A2A turn
    ApprovalObserver what approvals tell the agent-task service (input-required)

The scheduler's port is `gateway.schedules.loop.SchedulerHost` (the scheduler sits below
the runner). `GatewayRunner` (`lifecycle`) implements them all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from adapters.base import PlatformAdapter
from config import GatewayConfig
from gateway.agents.cache import AgentCache
from gateway.agents.roster import Roster
from gateway.domain.command_syntax import MessageKind
from gateway.domain.events import Accepted, MessageEvent
from gateway.domain.session import Platform, SessionEntry, SessionSource, TokenUsage
from gateway.memory.summaries import Memory
from gateway.schedules.book import ScheduleBook
from gateway.schedules.loop import RecordedSender, Scheduler
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog
from gateway.tools.approval import ApprovalRequest, Verdict
from gateway.tools.registry import Toolbox

FinalizeHook = Callable[[SessionEntry], Awaitable[None]]


class Turns(Protocol):
    """Sessions' lanes as the parts see them: who is busy, and new work for a lane."""

    def is_busy(self, key: str) -> bool: ...

    async def submit(self, key: str, event: MessageEvent, *, fifo: bool = False) -> Accepted:
        """Start a turn now, or park it behind the session's running one."""
        ...


class Outbox(Protocol):
    """Replies split for a platform, and recorded replies sent."""

    def split_reply(self, target: SessionSource, text: str) -> list[str]: ...

    async def resend_pending(self, min_age_seconds: float = 0) -> int: ...


class ApprovalSender(Protocol):
    """The runner's send path for a message that answers no turn (recorded, then sent)."""

    async def deliver(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> int: ...


class ApprovalDesk(Protocol):
    """The tool calls waiting for a yes, one per session at most."""

    def waiting(self, key: str) -> ApprovalRequest | None:
        """The call `key`'s turn waits to run (None: nothing waits)."""
        ...

    def answer(self, key: str, verdict: Verdict) -> bool:
        """Settle `key`'s waiting call; False when nothing waited (any more)."""
        ...


class CommandContext(Turns, Protocol):
    """What a chat command may use: the stores, the session's lane, and the reply path."""

    config: GatewayConfig
    store: SessionStore
    agents: AgentCache
    roster: Roster
    memory: Memory
    turnlog: TurnLog
    schedule_book: ScheduleBook
    scheduler: Scheduler
    approvals: ApprovalDesk

    def queue_depth(self, key: str) -> int: ...

    def is_admin(self, source: SessionSource) -> bool: ...

    def request_restart(self) -> None: ...

    async def cancel_session_work(self, key: str) -> bool: ...

    async def search_sessions(
        self, query: str, *, session_key: str | None = None, limit: int = 5
    ) -> list[dict[str, Any]]: ...

    async def delete_session(self, session_id: str) -> dict[str, Any]: ...

    async def deliver(
        self, target: SessionSource, text: str, reply_to: str | None = None
    ) -> int: ...

    def toolbox_for(self, agent_id: str) -> Toolbox | None:
        """The agent's tools (None: its turns carry none)."""
        ...

    def tool_servers(self) -> dict[str, dict[str, Any]]:
        """Each configured tool server by name: {"state": up|down|starting, "tools": N,
        "last_error": text or None}; empty without servers."""
        ...


class RecoveryHost(Turns, Outbox, Protocol):
    """What start-up recovery reads, writes and re-queues through."""

    home: Path
    store: SessionStore
    turnlog: TurnLog

    async def requeue(self, key: str, event: MessageEvent, kind: MessageKind) -> None: ...


class HousekeeperHost(Outbox, Protocol):
    """What the housekeeper's passes touch."""

    config: GatewayConfig
    store: SessionStore
    turnlog: TurnLog
    agents: AgentCache
    finalize_hooks: list[FinalizeHook]

    def is_busy(self, key: str) -> bool: ...


class ReplicaHost(Turns, Outbox, Protocol):
    """What one replica of several reaches in its runner."""

    config: GatewayConfig
    store: SessionStore
    turnlog: TurnLog
    scheduler: Scheduler

    @property
    def delivery(self) -> RecordedSender: ...

    @property
    def adapters(self) -> Mapping[Platform, PlatformAdapter]: ...

    @property
    def accepting(self) -> bool:
        """Messages are taken (started, not stopping)."""
        ...

    @property
    def draining(self) -> bool:
        """A shutdown is under way."""
        ...

    def busy_sessions(self) -> int: ...

    async def requeue(self, key: str, event: MessageEvent, kind: MessageKind) -> None: ...

    async def cancel_all_turns(self) -> None: ...


class LaneHooks(Protocol):
    """What the turn engine tells its placement: which inbox messages a lane of this
    process took, and that a lane ran out of work."""

    def took(self, key: str, inbox_ids: Iterable[int]) -> None: ...

    def lane_ended(self, key: str) -> None: ...


class TaskHooks(Protocol):
    """What the turn engine tells the agent-task service (`agent_tasks`) of a turn of
    an A2A session (platform `a2a`; asked of no other platform's turns): it begins, the
    write its finish transaction carries, and it was recorded."""

    async def turn_began(self, key: str, event: MessageEvent) -> bool:
        """False: the task ended before its turn could begin (canceled, deleted): the
        turn is not run."""
        ...

    def settle(
        self, event: MessageEvent, reply: str | None, text: str, usage: TokenUsage | None
    ) -> Callable[[Any], object]: ...

    def settled(self, event: MessageEvent) -> None: ...


class ApprovalObserver(Protocol):
    """Told when a turn of an A2A session waits for a tool call's approval (`question`)
    and when it waits no more (None): the agent-task service's input-required."""

    def approval_waits(self, source: SessionSource, question: str | None) -> None: ...
