"""SessionQueue: merge in the slot, FIFO overflow, depth cap."""

from __future__ import annotations

import pytest

from adapters.base import MessageEvent
from gateway.runner.queue import QueueFull, SessionQueue
from gateway.session import Platform, SessionSource

SOURCE = SessionSource(platform=Platform.HTTP, chat_id="c1", user_id="u1")


def ev(text: str, message_id: str | None = None) -> MessageEvent:
    return MessageEvent(source=SOURCE, text=text, message_id=message_id)


def drain(queue: SessionQueue) -> list[str]:
    out = []
    while (event := queue.pop_next()) is not None:
        out.append(event.text)
    return out


def test_plain_messages_merge_into_the_slot_with_newlines() -> None:
    queue = SessionQueue(max_depth=5)
    for text in ("a", "b", "c"):
        queue.enqueue_pending(ev(text))
    assert queue.depth == 1
    assert drain(queue) == ["a\nb\nc"]


def test_merged_slot_keeps_the_latest_message_id() -> None:
    queue = SessionQueue(max_depth=5)
    queue.enqueue_pending(ev("a", "m1"))
    queue.enqueue_pending(ev("b", "m2"))
    event = queue.pop_next()
    assert event is not None and event.message_id == "m2"


def test_slot_runs_before_fifo_entries_which_keep_their_order() -> None:
    queue = SessionQueue(max_depth=5)
    queue.enqueue_fifo(ev("q1"))
    queue.enqueue_pending(ev("plain"))
    queue.enqueue_fifo(ev("q2"))
    assert queue.depth == 3
    assert drain(queue) == ["plain", "q1", "q2"]
    assert not queue


def test_cap_counts_slot_plus_overflow() -> None:
    queue = SessionQueue(max_depth=2)
    queue.enqueue_fifo(ev("q1"))
    queue.enqueue_pending(ev("p1"))
    with pytest.raises(QueueFull):
        queue.enqueue_fifo(ev("q2"))
    queue.enqueue_pending(ev("p2"))  # merging adds no depth, so it is never refused
    assert drain(queue) == ["p1\np2", "q1"]


def test_full_overflow_refuses_a_new_slot() -> None:
    queue = SessionQueue(max_depth=1)
    queue.enqueue_fifo(ev("q1"))
    with pytest.raises(QueueFull):
        queue.enqueue_pending(ev("p1"))


def test_clear_drops_everything() -> None:
    queue = SessionQueue(max_depth=5)
    queue.enqueue_pending(ev("p"))
    queue.enqueue_fifo(ev("q"))
    assert queue.clear() == 2
    assert queue.pop_next() is None


def test_a_popped_event_put_back_goes_first_even_past_a_newer_slot() -> None:
    queue = SessionQueue(max_depth=5)
    queue.enqueue_fifo(ev("queued"))
    popped = MessageEvent(source=SOURCE, text="older", inbox_ids=(1,))
    queue.put_back(popped)
    assert drain(queue) == ["older", "queued"]

    queue.enqueue_fifo(ev("queued"))
    queue.enqueue_pending(MessageEvent(source=SOURCE, text="newer", inbox_ids=(2,)))
    queue.put_back(popped)
    slot = queue.pop_next()
    assert slot is not None and slot.text == "older\nnewer" and slot.inbox_ids == (1, 2)
    assert drain(queue) == ["queued"]
