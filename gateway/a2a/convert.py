"""Our task records as A2A 1.0 protobuf objects, and the text of an incoming message.

A task carries one exchange: its history is the caller's message and, once answered,
the agent's reply; the reply is also the task's one artifact (`reply`, one text part).
"""

from __future__ import annotations

from datetime import datetime

from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import InvalidParamsError
from google.protobuf.struct_pb2 import ListValue
from google.protobuf.timestamp_pb2 import Timestamp

from gateway.a2a import states
from gateway.domain.agent_tasks import TaskRecord, TaskState

__all__ = [
    "REPLY_ARTIFACT_ID",
    "artifact_event",
    "message_text",
    "reply_message",
    "status_event",
    "task_status",
    "to_task",
]

REPLY_ARTIFACT_ID = "reply"
REPLY_ARTIFACT_NAME = "reply"


def message_text(message: pb.Message) -> str:
    """The text parts joined by blank lines. A part that is not text (a file, raw bytes,
    structured data) is refused rather than dropped unseen: the agent would answer a
    message it never got whole."""
    if not message.parts:
        raise InvalidParamsError(message="message.parts is empty: send at least one text part")
    texts: list[str] = []
    for index, part in enumerate(message.parts):
        kind = part.WhichOneof("content")
        if kind != "text":
            raise InvalidParamsError(
                message=f"message.parts[{index}] is a {kind or 'empty'} part; this agent "
                "takes text parts only (text/plain)"
            )
        texts.append(part.text)
    text = "\n\n".join(texts)
    if not text.strip():
        raise InvalidParamsError(message="message text is empty")
    return text


#: the message metadata key the delegation chain travels in between daemons: the agents
#: that led to this message, outermost first, named by their A2A URLs
CHAIN_KEY = "hermes.chain"
MAX_CHAIN_ENTRIES = 16  # above a2a.max_delegation_depth's own bound
MAX_CHAIN_ENTRY_CHARS = 2048


def message_chain(message: pb.Message) -> tuple[str, ...]:
    """The delegation chain a delegating gateway sent along (`CHAIN_KEY` in the message's
    metadata), so a cycle through this gateway is refused here; () from any other
    client. A malformed chain is refused, not ignored: ignoring it would let a cycle
    through."""
    if CHAIN_KEY not in message.metadata:
        return ()
    value = message.metadata[CHAIN_KEY]
    entries = list(value) if isinstance(value, ListValue) else None
    if (
        entries is None
        or len(entries) > MAX_CHAIN_ENTRIES
        or not all(isinstance(e, str) and 0 < len(e) <= MAX_CHAIN_ENTRY_CHARS for e in entries)
    ):
        raise InvalidParamsError(
            message=f"message.metadata[{CHAIN_KEY!r}] must be a list of at most "
            f"{MAX_CHAIN_ENTRIES} agent URLs of 1-{MAX_CHAIN_ENTRY_CHARS} characters"
        )
    return tuple(entries)


def _timestamp(moment: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def user_message(record: TaskRecord) -> pb.Message:
    return pb.Message(
        message_id=record.message_id,
        context_id=record.context_id,
        task_id=record.task_id,
        role=pb.ROLE_USER,
        parts=[pb.Part(text=record.request_text)],
    )


def reply_message(record: TaskRecord) -> pb.Message | None:
    """The agent's message for the task's status: the reply, the question of a task
    waiting for input (a tool approval), the error, or nothing."""
    asks = record.state in (TaskState.COMPLETED, TaskState.INPUT_REQUIRED)
    text = record.result_text if asks else record.error
    if not text:
        return None
    return pb.Message(
        message_id=f"{record.task_id}-reply",
        context_id=record.context_id,
        task_id=record.task_id,
        role=pb.ROLE_AGENT,
        parts=[pb.Part(text=text)],
    )


def task_status(record: TaskRecord) -> pb.TaskStatus:
    status = pb.TaskStatus(
        state=states.to_proto(record.state),  # type: ignore[arg-type]
        timestamp=_timestamp(record.updated_at),
    )
    message = reply_message(record)
    if message is not None:
        status.message.CopyFrom(message)
    return status


def _reply_artifact(text: str) -> pb.Artifact:
    return pb.Artifact(
        artifact_id=REPLY_ARTIFACT_ID, name=REPLY_ARTIFACT_NAME, parts=[pb.Part(text=text)]
    )


def to_task(
    record: TaskRecord, *, history_length: int | None = None, artifacts: bool = True
) -> pb.Task:
    """The task as A2A shows it; `history_length`: at most that many of the latest
    history messages (0: none; None: all)."""
    history = [user_message(record)]
    reply = reply_message(record)
    if reply is not None:
        history.append(reply)
    if history_length is not None:
        history = history[len(history) - history_length :] if history_length else []
    task = pb.Task(
        id=record.task_id,
        context_id=record.context_id,
        status=task_status(record),
        history=history,
    )
    if artifacts and record.state is TaskState.COMPLETED and record.result_text:
        task.artifacts.append(_reply_artifact(record.result_text))
    return task


def status_event(record: TaskRecord) -> pb.TaskStatusUpdateEvent:
    return pb.TaskStatusUpdateEvent(
        task_id=record.task_id, context_id=record.context_id, status=task_status(record)
    )


def artifact_event(
    record: TaskRecord, text: str, *, append: bool, last_chunk: bool
) -> pb.TaskArtifactUpdateEvent:
    return pb.TaskArtifactUpdateEvent(
        task_id=record.task_id,
        context_id=record.context_id,
        artifact=_reply_artifact(text),
        append=append,
        last_chunk=last_chunk,
    )
