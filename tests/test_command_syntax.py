"""How a message is taken (gateway.domain.command_syntax): its `MessageKind`, which the
inbox stores, and the command parsed from it."""

from __future__ import annotations

from gateway.domain.command_syntax import Command, MessageKind, classify, starts_work


def test_plain_text_is_a_turn() -> None:
    assert classify("hello there") == (MessageKind.TURN, None)
    assert classify("/unknown words go to the agent") == (MessageKind.TURN, None)


def test_queue_with_text_is_a_turn_of_its_own_and_without_is_a_command() -> None:
    assert classify("/queue do this later") == (
        MessageKind.QUEUE,
        Command("queue", "do this later"),
    )
    assert classify("/q") == (MessageKind.COMMAND, Command("q", ""))


def test_a_command_addressed_to_another_bot_is_left_to_the_agent() -> None:
    assert classify("/new@otherbot", "hermesbot") == (MessageKind.TURN, None)
    assert classify("/new@HermesBot", "hermesbot") == (MessageKind.COMMAND, Command("new", ""))


def test_the_kinds_are_the_strings_the_inbox_stores() -> None:
    # Messages accepted by an earlier run are read back from the inbox's `kind` column:
    # the values must stay what it holds.
    assert {kind.value for kind in MessageKind} == {"turn", "queue", "command"}
    assert MessageKind("queue") is MessageKind.QUEUE
    assert MessageKind.COMMAND == "command"


def test_starts_work_for_turns_retry_and_lane_commands_only() -> None:
    assert starts_work("hi")
    assert starts_work("/queue later")
    assert starts_work("/retry")
    assert starts_work("/compress")
    assert not starts_work("/status")
    assert not starts_work("/stop")
