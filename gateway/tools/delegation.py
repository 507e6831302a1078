"""`agent_call(agent, task)`: an agent hands a task to another agent and reads its reply
as the tool's result (docs/delegation.md). Offered to an agent whose `delegates` is not
empty; its description lists the delegates and what each does.

- A native delegate (an agent of this gateway) gets the task through the runner's
  `AgentTasks` (the turn's `TurnScope.agent_tasks`) as caller "session:<calling key>",
  in a context derived from (calling key, delegate): a second delegation in the same
  chat continues the delegate's session, another chat's never reaches it.
- A remote delegate (`remote_agents:`) gets it over A2A (`gateway.a2a.client`), in the
  remote context this chat keeps with it (`gateway.store.remote_contexts`).
- The message id is derived from the turn and the tool call's id, so a turn resumed after
  a crash asks the same task again and the delegate's dedup makes it one task: the tool
  is safe to run again (`read_only`).
- Guards: the delegation chain (the agents that led to this turn, outermost first) may
  not grow past `a2a.max_delegation_depth`, and may not name the delegate already (a
  cycle). Agents are compared by their A2A URL, so a cycle through another daemon is
  caught too: a local agent is `<a2a base url>/a2a/<id>`, a remote one its config url.
- /stop (or the turn's deadline) cancels the calling turn; the delegate's task is then
  cancelled too, best effort and bounded.

Every failure is a result the model reads (`{"error": ...}`), never a failed turn.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, create_model

from config import GatewayConfig
from gateway.domain.agent_tasks import AgentTasks, TaskRefused, TaskState
from gateway.store import remote_contexts
from gateway.tools.registry import Tool, ToolText, TurnScope

if TYPE_CHECKING:
    from gateway.a2a.client import RemoteAgents

log = structlog.get_logger("gateway.tools.delegation")

TOOL_NAME = "agent_call"
TASK_MAX_CHARS = 16_000  # one task's text
CANCEL_SECONDS = 5.0  # a delegate's cancel after /stop, at most
NATIVE_MARGIN_SECONDS = 60.0  # a native task's wait past the delegate's own turn deadline
CHAIN_KEY = "hermes.chain"  # gateway.a2a.convert.CHAIN_KEY, without loading the SDK
_NAMESPACE = uuid.UUID("5b0c1f3e-7c1a-4d0e-9a52-2f1d6c9e4a10")  # the ids derived here

Record = Callable[[str, str, str], None]  # (agent, delegate, outcome) -> the metric


def local_base_url(config: GatewayConfig) -> str:
    """The address other agents reach this gateway's A2A server at."""
    if config.a2a.public_url:
        return config.a2a.public_url
    http = config.platforms.http
    return f"http://{http.host}:{http.port}"


def context_id_for(session_key: str, delegate: str) -> str:
    """The native delegate's context for a calling chat: the same for every delegation
    from that chat, another for every other chat."""
    return str(uuid.uuid5(_NAMESPACE, f"context\0{session_key}\0{delegate}"))


def message_id_for(scope: TurnScope) -> str:
    """The delegation's message id: the same when the turn's call runs again."""
    turn = f"{scope.session_key}\0{scope.session_id}\0{scope.user_row}\0{scope.call_id}"
    return str(uuid.uuid5(_NAMESPACE, f"message\0{turn}"))


class Delegation:
    """Every agent's `agent_call`: the delegates, the remote client, the guards."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        record: Record | None = None,
        remote: RemoteAgents | None = None,
    ) -> None:
        self._config = config
        self._record = record or (lambda agent, delegate, outcome: None)
        self._base = local_base_url(config)
        self._native = config.agent_configs()
        if remote is None and config.remote_agents:
            from gateway.a2a.client import RemoteAgents  # the SDK loads only when needed

            remote = RemoteAgents(config.remote_agents)
        self.remote = remote
        self._version = 0
        self._described: tuple[str | None, ...] = ()
        self._background: set[asyncio.Task[Any]] = set()

    # --- what the agents are offered ---------------------------------------------------------

    @property
    def version(self) -> int:
        """Changes when a remote delegate's description does (its card was read)."""
        if self.remote is not None:
            seen = tuple(self.remote.description(name) for name in self.remote.names)
            if seen != self._described:
                self._described, self._version = seen, self._version + 1
        return self._version

    def describe(self, name: str) -> str:
        if name in self._native:
            return self._native[name].description or f"the agent {name!r} of this gateway"
        described = self.remote.description(name) if self.remote is not None else None
        return described or f"the remote agent {name!r}"

    def tool_for(self, agent_id: str) -> Tool | None:
        """The agent's `agent_call` (None: it has no delegates)."""
        delegates = tuple(self._native[agent_id].delegates)
        if not delegates:
            return None
        lines = "\n".join(f"- {name}: {_one_line(self.describe(name))}" for name in delegates)
        description = (
            "Hand a task to another agent and get its reply. The agent works on its own,"
            " without this conversation: say everything it needs in the task. It"
            " remembers earlier tasks from this chat. The agents:\n" + lines
        )
        arguments = create_model(
            "AgentCallArgs",
            __config__=ConfigDict(extra="forbid", frozen=True),
            agent=(Literal[delegates], Field(description="The agent to ask")),  # type: ignore[valid-type]
            task=(
                str,
                Field(
                    min_length=1,
                    max_length=TASK_MAX_CHARS,
                    description="What the agent should do, with all it needs to know",
                ),
            ),
        )

        async def run(scope: TurnScope, args: BaseModel) -> ToolText:
            return ToolText(await self.call(scope, args.agent, args.task))  # type: ignore[attr-defined]

        return Tool(TOOL_NAME, description, arguments, run, read_only=True)

    def source_for(self, agent_id: str) -> DelegateSource | None:
        return DelegateSource(self, agent_id) if self._native[agent_id].delegates else None

    # --- a call ------------------------------------------------------------------------------

    async def call(self, scope: TurnScope, delegate: str, task: str) -> str:
        """The delegate's reply, or `{"error": ...}` for the model."""
        caller = scope.agent_id
        outcome, text = "failed", ""
        try:
            chain = await self._chain(scope)
            refusal = self._guard(chain, delegate)
            if refusal is not None:
                outcome, text = "refused", _error(refusal)
            elif delegate in self._native:
                outcome, text = await self._native_call(scope, delegate, task, chain)
            else:
                outcome, text = await self._remote_call(scope, delegate, task, chain)
        except asyncio.CancelledError:
            outcome = "canceled"
            raise
        finally:
            self._record(caller, delegate, outcome)
            log.info("agent_call", agent=caller, delegate=delegate, outcome=outcome)
        return self._cut(text)

    async def _chain(self, scope: TurnScope) -> tuple[str, ...]:
        tasks: AgentTasks | None = scope.agent_tasks
        chain = await tasks.running_chain(scope.session_key) if tasks is not None else ()
        return tuple(chain) or (scope.agent_id,)

    def url_of(self, agent: str) -> str:
        """An agent as the chain names it across daemons: a URL."""
        if "://" in agent:
            return agent.rstrip("/")
        if self.remote is not None and agent in self._config.remote_agents:
            return self.remote.url(agent)
        return f"{self._base}/a2a/{agent}"

    def _guard(self, chain: tuple[str, ...], delegate: str) -> str | None:
        """Why the delegation may not run (a cycle, then the depth), or None."""
        target = self.url_of(delegate)
        if target in {self.url_of(agent) for agent in chain}:
            return (
                f"refused: {delegate!r} is already working on this chain"
                f" ({' -> '.join(chain)}); delegating to it again would be a cycle"
            )
        limit = self._config.a2a.max_delegation_depth
        if len(chain) > limit:
            return (
                f"refused: delegating to {delegate!r} would make the chain"
                f" {' -> '.join([*chain, delegate])} deeper than a2a.max_delegation_depth"
                f" ({limit}); answer with what you have"
            )
        return None

    async def _native_call(
        self, scope: TurnScope, delegate: str, task: str, chain: tuple[str, ...]
    ) -> tuple[str, str]:
        tasks: AgentTasks | None = scope.agent_tasks
        if tasks is None:
            return "failed", _error(f"{delegate!r} cannot be reached: no task service runs")
        caller = f"session:{scope.session_key}"
        try:
            record = await tasks.send(
                delegate,
                task,
                message_id=message_id_for(scope),
                caller=caller,
                context_id=context_id_for(scope.session_key, delegate),
                chain=chain,
            )
        except TaskRefused as exc:
            return "refused", _error(f"{delegate!r} refused the task: {exc}")
        bound = self._native[delegate].gateway_timeout + NATIVE_MARGIN_SECONDS
        try:
            async with asyncio.timeout(bound):
                done = await tasks.wait(record.task_id, caller)
        except TimeoutError:
            self._cancel_later(tasks.cancel(record.task_id, caller))
            return "timeout", _error(f"{delegate!r} did not answer within {bound:g} seconds")
        except asyncio.CancelledError:  # /stop or the calling turn's deadline
            self._cancel_later(tasks.cancel(record.task_id, caller))
            raise
        if done is None:
            return "failed", _error(f"{delegate!r}: the task is gone")
        if done.state is TaskState.COMPLETED:
            return "ok", done.result_text or ""
        reason = done.error or done.result_text or "no reason given"
        outcome = {
            TaskState.CANCELED: "canceled",
            TaskState.REJECTED: "refused",
        }.get(done.state, "failed")
        return outcome, _error(f"{delegate!r}: the task ended {done.state.value}: {reason}")

    async def _remote_call(
        self, scope: TurnScope, delegate: str, task: str, chain: tuple[str, ...]
    ) -> tuple[str, str]:
        from gateway.a2a.client import RemoteError

        assert self.remote is not None
        store, key = scope.store, scope.session_key
        kept = await store.read(lambda conn: remote_contexts.load(conn, key, delegate))
        context_id = kept[0] if kept is not None else None
        metadata = {CHAIN_KEY: [self.url_of(agent) for agent in chain]}
        try:
            reply = await self.remote.send(
                delegate,
                task,
                message_id=message_id_for(scope),
                context_id=context_id,
                metadata=metadata,
            )
        except RemoteError as exc:
            outcome = {"input-required": "failed", "unreachable": "failed"}.get(exc.kind, exc.kind)
            return outcome, _error(str(exc))
        session_id = scope.session_id
        if reply.context_id and (reply.context_id, session_id) != kept:
            # a new context, or a later session of the chat now using it
            now = time.time()
            await store.write(
                lambda conn: remote_contexts.save(
                    conn, key, delegate, session_id, reply.context_id, now
                ),
                dirty=False,
            )
        return "ok", reply.text

    def _cut(self, text: str) -> str:
        limit = self._config.mcp.max_result_chars
        if len(text) <= limit:
            return text
        return text[:limit] + f"\n[cut: the reply had {len(text):,} characters]"

    def _cancel_later(self, cancel: Any) -> None:
        """Run a delegate's cancel past the calling turn's own cancellation, bounded."""

        async def bounded() -> None:
            try:
                async with asyncio.timeout(CANCEL_SECONDS):
                    await cancel
            except Exception as exc:
                log.info("delegate_cancel_failed", error=type(exc).__name__)

        task = asyncio.get_running_loop().create_task(bounded())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- the remote agents' health ----------------------------------------------------------

    def health(self) -> dict[str, dict[str, Any]]:
        """Each remote agent's reachability at the last probe (`RemoteAgents.health`)."""
        return self.remote.health() if self.remote is not None else {}

    async def probe_loop(self) -> None:
        if self.remote is not None:
            await self.remote.probe_loop()

    async def close(self) -> None:
        for task in list(self._background):
            try:
                async with asyncio.timeout(CANCEL_SECONDS):
                    await task
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
        if self.remote is not None:
            await self.remote.close()


class DelegateSource:
    """An agent's `agent_call` as a `ToolSource`: its description follows the remote
    cards as they are read."""

    def __init__(self, delegation: Delegation, agent_id: str) -> None:
        self._delegation, self._agent_id = delegation, agent_id
        self._made: tuple[int, list[Tool]] | None = None

    @property
    def version(self) -> int:
        return self._delegation.version

    def tools(self) -> list[Tool]:
        version = self._delegation.version
        if self._made is None or self._made[0] != version:
            tool = self._delegation.tool_for(self._agent_id)
            self._made = (version, [tool] if tool is not None else [])
        return self._made[1]


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)
