"""Chat commands as text: which `/words` are commands, and how a message is taken.

Pure parsing, no I/O: the runner (`gateway.runner.commands` runs the handlers) and an adapter
that must judge a message before it reaches the runner (the HTTP API sheds load by it)
read a message the same way. Unknown `/words` are not commands: they go to the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

#: every command word the gateway answers (`gateway.runner.commands.HANDLERS` has one each)
NAMES = frozenset(
    {
        *("new", "reset", "stop", "queue", "q", "status", "resume", "retry", "undo", "help"),
        *("restart", "title", "search", "forget", "compress", "schedule", "sethome"),
        *("tools", "approve", "deny", "model", "usage"),
    }
)
QUEUE_COMMANDS = frozenset({"queue", "q"})
#: The commands that answer through a turn of their own; the others stop, inspect or
#: switch a session, which a busy gateway still takes (/stop frees what a user holds).
TURN_COMMANDS = frozenset({"retry"})
#: The commands that run in their session's lane like a turn (they call the agent's
#: model): accepted at once and answered when done, never on the intake path. The
#: docs/commands.md's command table says why each other command stays inline.
LANE_COMMANDS = frozenset({"compress"})


class MessageKind(StrEnum):
    """How the runner takes a message (the inbox's `kind` column stores the value)."""

    TURN = "turn"  # plain text: a turn, merged with others waiting behind a busy one
    QUEUE = "queue"  # `/queue TEXT`: a turn of its own, in order, after the current one
    COMMAND = "command"  # a chat command


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    args: str


def parse_command(text: str, bot_username: str | None = None) -> Command | None:
    """`/Name@bot args` -> Command('name', 'args'); None if not a known command for us."""
    if not text.startswith("/"):
        return None
    word, _, args = text[1:].partition(" ")
    word, _, addressee = word.partition("@")
    name = word.lower()
    if name not in NAMES:
        return None
    if addressee and bot_username and addressee.lower() != bot_username.lower():
        return None  # addressed to another bot in the same group
    return Command(name=name, args=args.strip())


def classify(text: str, bot_username: str | None = None) -> tuple[MessageKind, Command | None]:
    """How the runner takes a (stripped) message, with the parsed command."""
    command = parse_command(text, bot_username)
    if command is None:
        return MessageKind.TURN, None
    if command.name in QUEUE_COMMANDS and command.args:
        return MessageKind.QUEUE, command
    return MessageKind.COMMAND, command


def starts_work(text: str, bot_username: str | None = None) -> bool:
    """Would this message start or queue an agent turn, or work like one (plain text,
    /queue TEXT, /retry, a lane command)?"""
    kind, command = classify(text.strip(), bot_username)
    return kind != MessageKind.COMMAND or (
        command is not None and command.name in TURN_COMMANDS | LANE_COMMANDS
    )
