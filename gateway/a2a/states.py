"""Our task states as the A2A 1.0 types name them, both ways."""

from __future__ import annotations

from a2a.types import a2a_pb2 as pb

from gateway.domain.agent_tasks import TaskState

__all__ = ["from_proto", "to_proto"]

_TO_PROTO = {
    TaskState.SUBMITTED: pb.TASK_STATE_SUBMITTED,
    TaskState.WORKING: pb.TASK_STATE_WORKING,
    TaskState.INPUT_REQUIRED: pb.TASK_STATE_INPUT_REQUIRED,
    TaskState.COMPLETED: pb.TASK_STATE_COMPLETED,
    TaskState.CANCELED: pb.TASK_STATE_CANCELED,
    TaskState.FAILED: pb.TASK_STATE_FAILED,
    TaskState.REJECTED: pb.TASK_STATE_REJECTED,
}
_FROM_PROTO = {value: key for key, value in _TO_PROTO.items()}


def to_proto(state: TaskState) -> int:
    return _TO_PROTO[state]


def from_proto(state: int) -> TaskState | None:
    """None for a state we do not keep (unspecified, auth-required)."""
    return _FROM_PROTO.get(state)
