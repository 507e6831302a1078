"""`TaskHandler`: the a2a-sdk's `RequestHandler` over our `AgentTasks`, for one agent.

Every transport of the SDK's shape (our JSON-RPC dispatcher, the SDK's 0.3 adapter
`RequestHandler03`) calls these methods with protobuf requests; they answer with
protobuf tasks and events, or raise the SDK's `A2AError`s, which the dispatcher turns
into JSON-RPC errors.

The caller (`context.state["caller"]`, set by the dispatcher) scopes every read: a task
of another caller is "not found", never "forbidden".
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator
from datetime import UTC

from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InternalError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from gateway.a2a import convert, states
from gateway.domain.agent_tasks import (
    AgentTasks,
    TaskRecord,
    TaskRefused,
    TaskState,
    TaskUpdate,
)

__all__ = ["CALLER_KEY", "MAX_PAGE_SIZE", "TaskHandler"]

CALLER_KEY = "caller"
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 50, 100  # ListTasks, as the spec bounds it
COUNT_LIMIT = 100  # ListTasks' totalSize is exact up to this many tasks
MAX_ID_LENGTH = 256  # ids a caller sends: message, context, task, page token


def caller_of(context: ServerCallContext) -> str:
    caller = context.state.get(CALLER_KEY)
    if not isinstance(caller, str):  # a transport that forgot it must not see every task
        raise InternalError(message="the request's caller is unknown")
    return caller


def _check_id(name: str, value: str) -> None:
    if len(value) > MAX_ID_LENGTH:
        raise InvalidParamsError(message=f"{name} is longer than {MAX_ID_LENGTH} characters")


def _refused(exc: TaskRefused) -> InternalError | InvalidParamsError:
    """A refusal that may pass (`retry_after`) is the server's; any other the request's."""
    if exc.retry_after is not None:
        seconds = f"{exc.retry_after:g}"
        return InternalError(message=f"{exc}; retry in {seconds} s", data={"retryAfter": seconds})
    return InvalidParamsError(message=str(exc))


def _history_length(params: pb.GetTaskRequest | pb.ListTasksRequest) -> int | None:
    if not params.HasField("history_length"):
        return None
    if params.history_length < 0:
        raise InvalidParamsError(message="historyLength must be 0 or more")
    return params.history_length


class TaskHandler(RequestHandler):
    """One agent's A2A methods. `wait_seconds` bounds a blocking SendMessage: past it the
    task is returned as it stands (working), and the caller polls GetTask."""

    def __init__(self, tasks: AgentTasks, agent_id: str, *, wait_seconds: float) -> None:
        self.tasks = tasks
        self.agent_id = agent_id
        self.wait_seconds = wait_seconds
        self._closing = asyncio.Event()

    def close(self) -> None:
        """The server stops: blocking sends answer with their task as it stands."""
        self._closing.set()

    # --- messages --------------------------------------------------------------------

    async def _accept(self, params: pb.SendMessageRequest, caller: str) -> TaskRecord:
        message = params.message
        if not message.message_id:
            raise InvalidParamsError(message="message.messageId is required")
        _check_id("message.messageId", message.message_id)
        _check_id("message.contextId", message.context_id)
        if message.role == pb.ROLE_AGENT:
            raise InvalidParamsError(message="message.role must be ROLE_USER")
        text = convert.message_text(message)
        chain = convert.message_chain(message)
        context_id = message.context_id or None
        if message.task_id:
            context_id = await self._answered_context(message, caller)
        try:
            return await self.tasks.send(
                self.agent_id,
                text,
                message_id=message.message_id,
                caller=caller,
                context_id=context_id,
                chain=chain,
            )
        except TaskRefused as exc:
            raise _refused(exc) from None

    async def _answered_context(self, message: pb.Message, caller: str) -> str:
        """A message naming a task answers it: only a task waiting for input (a tool
        approval: `/approve` or `/deny`) takes one, in its own context. Any other
        task is one exchange; a conversation goes on through its contextId."""
        _check_id("message.taskId", message.task_id)
        known = await self.tasks.get(message.task_id, caller)
        if known is None or known.agent_id != self.agent_id:
            raise TaskNotFoundError(message=f"no task {message.task_id}")
        if message.context_id and message.context_id != known.context_id:
            raise InvalidParamsError(
                message=f"message.contextId is not the context of task {message.task_id}"
            )
        if known.state is not TaskState.INPUT_REQUIRED:
            raise UnsupportedOperationError(
                message=f"task {message.task_id} is {known.state.value} and takes no "
                "further messages; send the next message with its contextId and no taskId"
            )
        return known.context_id

    async def on_message_send(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> pb.Task:
        caller = caller_of(context)
        config = params.configuration
        history = config.history_length if config.HasField("history_length") else None
        if history is not None and history < 0:
            raise InvalidParamsError(message="configuration.historyLength must be 0 or more")
        record = await self._accept(params, caller)
        if not record.state.terminal and not config.return_immediately:
            settled = asyncio.ensure_future(self._settled(record, caller))
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                await asyncio.wait(
                    {settled, closing}, timeout=self.wait_seconds, return_when="FIRST_COMPLETED"
                )
            finally:
                for waiter in (settled, closing):
                    waiter.cancel()
            if settled.done() and not settled.cancelled():
                record = settled.result()
            else:  # past the bound, or the server stops: the task as it stands
                record = await self.tasks.get(record.task_id, caller) or record
        return convert.to_task(record, history_length=history)

    async def _settled(self, record: TaskRecord, caller: str) -> TaskRecord:
        """The task once terminal, or waiting for input (a tool approval): where a
        blocking send returns, as the spec has it."""
        updates = self.tasks.subscribe(record.task_id, caller)
        try:
            async for update in updates:
                record = update.task
                if record.state.terminal or record.state is TaskState.INPUT_REQUIRED:
                    break
        finally:
            await _close(updates)
        return record

    async def on_message_send_stream(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        caller = caller_of(context)
        record = await self._accept(params, caller)
        async for event in self._follow(record.task_id, caller):
            yield event

    async def on_subscribe_to_task(
        self, params: pb.SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        caller = caller_of(context)
        _check_id("id", params.id)
        record = await self.tasks.get(params.id, caller)
        if record is None or record.agent_id != self.agent_id:
            raise TaskNotFoundError(message=f"no task {params.id}")
        if record.state.terminal:
            raise UnsupportedOperationError(
                message=f"task {params.id} is in terminal state {record.state.value}; "
                "read it with GetTask"
            )
        async for event in self._follow(record.task_id, caller):
            yield event

    async def _follow(self, task_id: str, caller: str) -> AsyncGenerator[Event]:
        """The task first, then a status event per change of state, an artifact event per
        streamed piece of the reply, and the final status. A subscriber that joins late
        (or again after a reconnect) gets the reply whole in the last artifact event."""
        updates = self.tasks.subscribe(task_id, caller)
        first = True
        streamed = ""  # the reply's text sent as artifact chunks so far
        last_state = None
        try:
            async for update in updates:
                record = update.task
                if first:
                    first = False
                    last_state = record.state
                    yield convert.to_task(record, artifacts=False)
                    if record.state is TaskState.WORKING:
                        # The turn began before the stream did: its status event still
                        # comes, as a client following states expects it.
                        yield convert.status_event(record)
                    if not record.state.terminal:
                        continue
                if update.delta:
                    yield convert.artifact_event(
                        record, update.delta, append=bool(streamed), last_chunk=False
                    )
                    streamed += update.delta
                if record.state.terminal:
                    completed = record.state is TaskState.COMPLETED
                    reply = (record.result_text or "") if completed else ""
                    if reply:
                        if streamed and reply.startswith(streamed):
                            rest, append = reply[len(streamed) :], True
                        else:  # nothing streamed, or the final text differs: send it whole
                            rest, append = reply, False
                        yield convert.artifact_event(record, rest, append=append, last_chunk=True)
                    yield convert.status_event(record)
                    return
                if record.state is not last_state:
                    last_state = record.state
                    yield convert.status_event(record)
        finally:
            await _close(updates)

    # --- tasks ---------------------------------------------------------------------------

    async def on_get_task(
        self, params: pb.GetTaskRequest, context: ServerCallContext
    ) -> pb.Task | None:
        _check_id("id", params.id)
        history = _history_length(params)
        record = await self.tasks.get(params.id, caller_of(context))
        if record is None or record.agent_id != self.agent_id:
            raise TaskNotFoundError(message=f"no task {params.id}")
        return convert.to_task(record, history_length=history)

    async def on_list_tasks(
        self, params: pb.ListTasksRequest, context: ServerCallContext
    ) -> pb.ListTasksResponse:
        history = _history_length(params)
        size = params.page_size if params.HasField("page_size") else DEFAULT_PAGE_SIZE
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise InvalidParamsError(message=f"pageSize must be 1 to {MAX_PAGE_SIZE}")
        _check_id("contextId", params.context_id)
        _check_id("pageToken", params.page_token)
        caller = caller_of(context)
        if params.page_token:
            # A token is the last task of the page before: one of this caller's, here.
            mark = await self.tasks.get(params.page_token, caller)
            if mark is None or mark.agent_id != self.agent_id:
                raise InvalidParamsError(message="pageToken is not a nextPageToken of ListTasks")
        state = None
        if params.status != pb.TASK_STATE_UNSPECIFIED:
            state = states.from_proto(params.status)
            if state is None:
                return pb.ListTasksResponse()  # a state no task of ours is ever in
        listed = functools.partial(
            self.tasks.list,
            caller,
            agent_id=self.agent_id,
            context_id=params.context_id or None,
            state=state,
        )
        page = await listed(limit=size, after=params.page_token or None)
        # A full page has a next one when a task follows its last.
        more = len(page) == size and bool(await listed(limit=1, after=page[-1].task_id))
        total = len(page)
        if params.page_token or more:  # counted from the first task, up to COUNT_LIMIT
            total = len(await listed(limit=COUNT_LIMIT))
        next_token = page[-1].task_id if more else ""
        if params.HasField("status_timestamp_after"):
            # Filtered within the page: a page may hold fewer tasks, its token stays valid.
            since = params.status_timestamp_after.ToDatetime(tzinfo=UTC)
            page = [r for r in page if r.updated_at > since]
        tasks = [
            convert.to_task(r, history_length=history, artifacts=params.include_artifacts)
            for r in page
        ]
        return pb.ListTasksResponse(
            tasks=tasks,
            next_page_token=next_token,
            page_size=len(tasks),
            total_size=total,
        )

    async def on_cancel_task(
        self, params: pb.CancelTaskRequest, context: ServerCallContext
    ) -> pb.Task | None:
        _check_id("id", params.id)
        caller = caller_of(context)
        record = await self.tasks.get(params.id, caller)
        if record is None or record.agent_id != self.agent_id:
            raise TaskNotFoundError(message=f"no task {params.id}")
        if record.state.terminal:
            raise TaskNotCancelableError(
                message=f"task {params.id} is already {record.state.value}"
            )
        record = await self.tasks.cancel(params.id, caller)
        if record is None:
            raise TaskNotFoundError(message=f"no task {params.id}")
        return convert.to_task(record)

    # --- what this server does not offer ----------------------------------------------------

    async def on_create_task_push_notification_config(
        self, params: pb.TaskPushNotificationConfig, context: ServerCallContext
    ) -> pb.TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(
        self, params: pb.GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> pb.TaskPushNotificationConfig:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(
        self, params: pb.ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> pb.ListTaskPushNotificationConfigsResponse:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(
        self, params: pb.DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(
        self, params: pb.GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> pb.AgentCard:
        raise UnsupportedOperationError(message="this agent has no extended card")


async def _close(updates: AsyncIterator[TaskUpdate]) -> None:
    """End a subscription now, not when it is collected."""
    close = getattr(updates, "aclose", None)
    if close is not None:
        await close()
