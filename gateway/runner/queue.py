"""Per-session busy queue: the next-up slot and the /queue FIFO overflow (seed section 8).

One owner: the runner. While a turn runs, plain messages go to the slot and merge there
(joined with a newline, nothing dropped); each `/queue` entry goes to the overflow and
later gets a full turn of its own, and so does each command that runs in the session's
lane (`LaneCommand`, e.g. /compress). The slot runs first, then the overflow in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.domain.command_syntax import Command
from gateway.domain.events import MessageEvent


@dataclass(frozen=True, slots=True)
class LaneCommand:
    """A command that runs in its session's lane like a turn (it waits for the turn
    before it, and the next waits for it): one that calls a model or is otherwise slow."""

    event: MessageEvent
    command: Command

    @property
    def inbox_ids(self) -> tuple[int, ...]:
        return self.event.inbox_ids


Job = MessageEvent | LaneCommand


class QueueFull(Exception):
    """The session already holds `max_depth` waiting turns."""


class SessionQueue:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._slot: MessageEvent | None = None
        self._overflow: deque[Job] = deque()

    @property
    def depth(self) -> int:
        return (1 if self._slot is not None else 0) + len(self._overflow)

    def __bool__(self) -> bool:
        return self.depth > 0

    def enqueue_pending(self, event: MessageEvent) -> None:
        """Put a plain message in the slot, merging into what is already there."""
        if self._slot is None:
            if self.depth >= self.max_depth:
                raise QueueFull
            self._slot = event
            return
        # The merged turn answers the latest message (its id, source, time) and settles
        # the inbox rows of all of them.
        self._slot = replace(
            event,
            text=f"{self._slot.text}\n{event.text}",
            inbox_ids=self._slot.inbox_ids + event.inbox_ids,
            media=self._slot.media + event.media,  # files merge too, in order
        )

    def enqueue_fifo(self, event: Job) -> None:
        """Append a /queue entry or a lane command; it runs on its own after the slot."""
        if self.depth >= self.max_depth:
            raise QueueFull
        self._overflow.append(event)

    def pop_next(self) -> Job | None:
        if self._slot is not None:
            event, self._slot = self._slot, None
            return event
        return self._overflow.popleft() if self._overflow else None

    def pop_next_turn(self) -> MessageEvent | None:
        """`pop_next` when what is next is a turn; None when it is a lane command (the
        worker runs that itself) or nothing waits."""
        if self._slot is None and self._overflow and isinstance(self._overflow[0], LaneCommand):
            return None
        job = self.pop_next()
        assert not isinstance(job, LaneCommand)
        return job

    def put_back(self, event: MessageEvent) -> None:
        """Return a popped event to the front (its turn could not begin): it goes first,
        merged ahead of a message that reached the slot meanwhile."""
        if event in self._overflow or event is self._slot:
            return
        if self._slot is None:
            self._slot = event
            return
        self._slot = replace(
            self._slot,
            text=f"{event.text}\n{self._slot.text}",
            inbox_ids=event.inbox_ids + self._slot.inbox_ids,
            media=event.media + self._slot.media,
        )

    def remove_fifo(self, matches: Callable[[Job], bool]) -> Job | None:
        """Take the first overflow entry that `matches` out of the queue (a canceled
        agent task: its own turn, never merged)."""
        for job in self._overflow:
            if matches(job):
                self._overflow.remove(job)
                return job
        return None

    def inbox_ids(self) -> list[int]:
        """The inbox rows of everything waiting (to drop them with the queue)."""
        waiting = ([self._slot] if self._slot else []) + list(self._overflow)
        return [i for event in waiting for i in event.inbox_ids]

    def clear(self) -> int:
        dropped = self.depth
        self._slot = None
        self._overflow.clear()
        return dropped
