"""Chat commands: /new /reset /stop /queue /status /resume /retry /undo /help, the
session memory commands /title /search /forget /compress, the tool commands /tools
/approve /deny (`tool_commands`), /model (`model_commands`) and /usage (`usage_commands`).

Each handler gets the command context (`ports.CommandContext`: the runner, seen through
what commands use) and the event and returns the text to send back (or None
when the command answers through a turn of its own, like /retry). Which `/words` are
commands, and how a message is taken, is `gateway.domain.command_syntax`. Most answer inline
(`dispatch`, on the intake path: reads or one transaction each); one that calls a model
(`command_syntax.LANE_COMMANDS`) is queued in its session's lane and run by the
session's worker (`reply_of`), as a turn is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from gateway.domain.command_syntax import NAMES, Command
from gateway.domain.events import Accepted, AcceptStatus, MessageEvent
from gateway.domain.policy import next_reset_at
from gateway.domain.session import agent_id_of_key
from gateway.runner.model_commands import cmd_model, load_choice
from gateway.runner.ports import CommandContext
from gateway.runner.schedule_commands import cmd_schedule, cmd_sethome, next_run_line
from gateway.runner.tool_commands import cmd_approve, cmd_deny, cmd_tools
from gateway.runner.usage_commands import cmd_usage
from gateway.store import titles
from gateway.store.session_store import MAX_REWIND

log = structlog.get_logger("gateway.commands")


def _age(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600}h"


# --- handlers ---------------------------------------------------------------------------

Reply = str | Accepted | None


async def cmd_new(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    await ctx.cancel_session_work(key)
    entry = await ctx.store.get_entry(key)
    if entry is None:
        entry = await ctx.store.get_or_create_session(event.source)
    else:
        entry = await ctx.store.reset_session(key)
    assert entry is not None
    await ctx.agents.evict(key)
    return f"Started a new session ({entry.session_id}). /resume lists earlier ones."


async def cmd_stop(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    was_running = await ctx.cancel_session_work(key)
    await ctx.store.suspend_session(key)
    if was_running:
        return "Stopped. Your next message starts a fresh session."
    return "Nothing was running. Your next message starts a fresh session."


async def cmd_queue(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    # With TEXT the runner queues it directly (it is recorded as a queued turn on arrival).
    return "Usage: /queue TEXT (runs TEXT as its own turn after the current one)"


async def cmd_restart(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    if not ctx.is_admin(event.source):
        return "Only an admin can restart the gateway (see `admins` in hermes.yaml)."
    ctx.request_restart()
    return "Restarting: running replies finish first, then I am back."


async def cmd_status(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return (
            f"No session yet for {key} (agent {agent_id_of_key(key)}). Say something to start one."
        )
    now = datetime.now(UTC)
    messages = await ctx.store.count_messages(entry.session_id)
    policy = ctx.config.get_reset_policy(event.source.platform, event.source.chat_type)
    reset_at = next_reset_at(entry.updated_at, policy, ctx.config.tzinfo())
    if reset_at is None:
        reset_text = "never (reset mode none)"
    else:
        local = reset_at.astimezone(ctx.config.tzinfo())
        reset_text = f"{local:%Y-%m-%d %H:%M %Z} (in {_age(max(reset_at - now, timedelta()))})"
    flags = [n for n in ("suspended", "resume_pending") if getattr(entry, n)]
    title = await ctx.store.read(lambda conn: titles.title_of(conn, entry.session_id))
    await load_choice(ctx.store, ctx.roster, key)
    model = ctx.roster.for_key(key).model
    lines = [
        f"Session: {entry.session_id}",
        f"Agent: {agent_id_of_key(key)}",
        f"Model: {model.name or model.model}" + (f" ({model.model})" if model.name else ""),
        f"Title: {titles.shown(title)}",
        f"Key: {key}",
        f"Age: {_age(now - entry.created_at)} (last active {_age(now - entry.updated_at)} ago)",
        f"Messages: {messages}",
        f"Tokens: {entry.total_tokens} (in {entry.input_tokens}, out {entry.output_tokens})"
        + (f", ${entry.estimated_cost_usd:.4f}" if entry.estimated_cost_usd else ""),
        f"Running: {'yes' if ctx.is_busy(key) else 'no'}; queued: {ctx.queue_depth(key)}",
        f"Next reset: {reset_text}",
    ]
    if flags:
        lines.append(f"Flags: {', '.join(flags)}")
    scheduled = await next_run_line(ctx, event, key)
    if scheduled is not None:
        lines.append(scheduled)
    return "\n".join(lines)


async def cmd_resume(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    # A chat whose current session was deleted (/forget) has no entry, but may have
    # earlier sessions to go back to.
    entry = await ctx.store.get_entry(key)
    current = entry.session_id if entry is not None else None
    if not cmd.args:
        history = [
            h
            for h in await ctx.store.list_session_history(key, limit=10)
            if h["session_id"] != current
        ]
        if not history:
            return "No earlier sessions to resume."
        lines = ["Earlier sessions (newest first); /resume SESSION_ID or TITLE to switch:"]
        for h in history:
            lines.append(
                f"{h['session_id']}  {h['started_at']:%Y-%m-%d %H:%M} UTC"
                f"  {h['message_count']} messages — {titles.shown(h['title'])}"
            )
        return "\n".join(lines)
    if ctx.is_busy(key):
        return "A turn is running; /stop it first, then /resume."
    target = cmd.args.split()[0]
    if not await ctx.store.read(lambda conn: titles.is_session_of(conn, key, target)):
        # Not a session id of this chat: a title, or the unique start of one.
        found = await ctx.store.read(lambda conn: titles.find(conn, key, cmd.args))
        if len(found) != 1:
            return _title_matches(cmd.args, found)
        target = found[0][0]
    switched = await ctx.store.switch_session(key, target, event.source)
    if switched is None:
        return f"No earlier session {target} in this chat. /resume lists them."
    await ctx.agents.evict(key)
    count = await ctx.store.count_messages(switched.session_id)
    return f"Resumed session {switched.session_id} ({count} messages)."


def _title_matches(asked: str, found: list[tuple[str, str]]) -> str:
    if not found:
        return f"No earlier session {asked} in this chat (by id or title). /resume lists them."
    lines = [f"{len(found)} sessions match {asked!r}; /resume one of these ids:"]
    lines += [f"{session_id}  {title}" for session_id, title in found]
    return "\n".join(lines)


async def cmd_title(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return "No session yet. Say something to start one."
    if not cmd.args:
        title = await ctx.store.read(lambda conn: titles.title_of(conn, entry.session_id))
        return f"Title: {titles.shown(title)}. /title TEXT renames this session."
    title = titles.clean_title(cmd.args)
    if not title:
        return "Usage: /title TEXT (a name for this session)"
    await ctx.store.write(lambda conn: titles.rename(conn, entry.session_id, title))
    return f"Renamed this session to {title!r}."


async def cmd_search(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    if not cmd.args:
        return "Usage: /search WORDS (searches this chat's sessions; WORD* finds by prefix)"
    # This chat's sessions only: the key scopes the search, never another chat or user.
    hits = await ctx.search_sessions(cmd.args, session_key=key, limit=5)
    if not hits:
        return f"Nothing found for {cmd.args!r} in this chat's sessions."
    entry = await ctx.store.get_entry(key)
    current = entry.session_id if entry else None
    lines = [f"Found in this chat ({len(hits)} newest):"]
    for n, hit in enumerate(hits, 1):
        where = "this session" if hit["session_id"] == current else f"/resume {hit['session_id']}"
        lines += [
            f"{n}. {hit['title']} — {hit['timestamp'][:10]} ({hit['role']}) · {where}",
            f"   {hit['snippet']}",
        ]
    return "\n".join(lines)


async def cmd_forget(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return "No session yet, nothing to forget."
    if ctx.is_busy(key):
        return "A turn is running; /stop it first, then /forget."
    if cmd.args.lower() != "yes":
        count = await ctx.store.count_messages(entry.session_id)
        title = await ctx.store.read(lambda conn: titles.title_of(conn, entry.session_id))
        return (
            f"This deletes the current session ({titles.shown(title)!r}, {count} messages) "
            "for good: its messages, search entries and everything else kept of it. "
            "Send /forget yes to do it."
        )
    done = await ctx.delete_session(entry.session_id)
    if done["status"] == "busy":
        return "A turn is running; /stop it first, then /forget."
    if done["status"] != "deleted":
        return "That session is gone already."
    # The reply names no id or title: it is kept in the delivery ledger afterwards.
    return (
        f"Forgot this session ({done['messages']} messages). Nothing of it is kept;"
        " your next message starts a new session."
    )


async def cmd_retry(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    if ctx.is_busy(key):
        return "A turn is running; wait for it or /stop it first."
    aside = await ctx.turnlog.set_aside_messages(key)
    if aside:
        # Messages the stuck-loop guard set aside: run again as one turn, whose end
        # settles them (a second /retry then finds none).
        return await ctx.submit(key, _rerun_of(aside))
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return "Nothing to retry."
    undone = await ctx.store.rewind_session(entry.session_id, 1)
    if not undone["turns_undone"]:
        return "Nothing to retry."
    await ctx.agents.evict(key)  # the agent's own context still holds the old answer
    return await ctx.submit(key, replace(event, text=undone["target_text"], synthetic=True))


def _rerun_of(aside: list[tuple[int, dict[str, Any]]]) -> MessageEvent:
    """One turn of set-aside messages: merged as messages waiting behind a turn are
    (`SessionQueue`), answering the latest of them."""
    events = [MessageEvent.from_dict(data) for _, data in aside]
    return replace(
        events[-1],
        text="\n".join(e.text for e in events if e.text),
        media=tuple(m for e in events for m in e.media),
        inbox_ids=tuple(inbox_id for inbox_id, _ in aside),
        synthetic=True,
    )


async def cmd_undo(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    try:
        n = int(cmd.args) if cmd.args else 1
    except ValueError:
        return "Usage: /undo [N] (N = how many of your last messages to take back)"
    if not 1 <= n <= MAX_REWIND:
        return f"N is out of range: /undo [N] takes N from 1 to {MAX_REWIND:,}."
    if ctx.is_busy(key):
        return "A turn is running; wait for it or /stop it first."
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return "Nothing to undo."
    undone = await ctx.store.rewind_session(entry.session_id, n)
    if not undone["turns_undone"]:
        return "Nothing to undo."
    await ctx.agents.evict(key)
    return (
        f"Undid {undone['turns_undone']} turn(s) ({undone['rewound_count']} messages). "
        f"Last undone message: {undone['target_text']!r}"
    )


async def cmd_compress(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    """Condense the session's unsummarized messages into its rolling summary now. It runs
    in the session's lane (`LANE_COMMANDS`): no turn of this session runs meanwhile."""
    entry = await ctx.store.get_entry(key)
    if entry is None:
        return "No session yet, nothing to compress."
    if ctx.roster.for_key(key).plan.strategy != "summary":  # this chat's agent's
        return (
            "This agent sends the newest messages that fit (agent.context.strategy: window);"
            " /compress needs the summary strategy."
        )
    done = await ctx.memory.compress(key, entry.session_id, cmd.args or None)
    if done is None:
        return "The gateway is stopping; nothing was condensed."
    if done.stale:
        return "The conversation changed while it was condensed (/undo?); try /compress again."
    if not done.messages:
        return "Nothing to condense: every message is in the summary already."
    return f"Condensed {done.messages:,} messages into {done.chars:,} characters."


async def cmd_help(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    return HELP_TEXT


Handler = Callable[[CommandContext, MessageEvent, str, Command], Awaitable[Reply]]

HANDLERS: dict[str, Handler] = {
    "new": cmd_new,
    "reset": cmd_new,
    "stop": cmd_stop,
    "queue": cmd_queue,
    "q": cmd_queue,
    "status": cmd_status,
    "resume": cmd_resume,
    "retry": cmd_retry,
    "undo": cmd_undo,
    "compress": cmd_compress,
    "help": cmd_help,
    "restart": cmd_restart,
    "title": cmd_title,
    "search": cmd_search,
    "forget": cmd_forget,
    "schedule": cmd_schedule,
    "sethome": cmd_sethome,
    "tools": cmd_tools,
    "approve": cmd_approve,
    "deny": cmd_deny,
    "model": cmd_model,
    "usage": cmd_usage,
}
assert HANDLERS.keys() == NAMES, "every command word has exactly one handler"
HELP_TEXT = """Commands:
/new, /reset — start a new session (the old one stays available to /resume)
/stop — cancel the running reply, clear the queue; the next message starts fresh
/queue TEXT (/q) — run TEXT as its own turn after the current one
/status — agent, session id, age, messages, tokens, queue, next automatic reset
/resume [SESSION_ID or TITLE] — list earlier sessions of this chat, or switch back to one
/title [TEXT] — show or rename this session's title
/search WORDS — find messages in this chat's sessions (WORD* by prefix)
/forget — delete this session for good (asks first: /forget yes)
/retry — ask again: re-run your last message (or the ones set aside after restarts)
/undo [N] — take back your last N messages and their replies
/compress [FOCUS] — condense this session's history into its summary now
/schedule add WHEN PROMPT — run PROMPT later or repeatedly (in 30m, at 09:00, every 2h,
  "0 9 * * 1-5"); /schedule list | remove ID | pause ID | resume ID | run ID | runs ID
/sethome — make this chat the platform's home channel (for scheduled tasks)
/tools — the agent's tools (and which ask first) and the tool servers' states
/approve, /deny — answer a tool call waiting for your yes
/model [NAME] — list this chat's models, or switch to one (/model default: the agent's)
/usage — your tokens and cost today and this month, and your budget (/usage all: admins)
/restart — restart the gateway (admins only)
/help — this list
Messages sent while a reply is running are combined into the next turn."""


async def dispatch(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Accepted:
    """Run an inline command and send its text reply; returns what the HTTP API reports.

    The command's message is recorded (its id taken) before it runs, so a command that
    fails unexpectedly is still answered: with a short error, the cause in the log."""
    reply = await reply_of(ctx, event, key, cmd)
    if isinstance(reply, Accepted):
        return reply
    if reply is not None:
        await ctx.deliver(event.source, reply, reply_to=event.reply_to)
    return Accepted(AcceptStatus.COMMAND, session_key=key, detail=cmd.name)


async def reply_of(ctx: CommandContext, event: MessageEvent, key: str, cmd: Command) -> Reply:
    """What the command answers (a lane command's too: the runner records and sends it);
    an unexpected failure is a short error, its cause logged."""
    try:
        return await HANDLERS[cmd.name](ctx, event, key, cmd)
    except Exception as exc:
        log.exception("command_failed", command=cmd.name, error_type=type(exc).__name__)
        return f"Sorry, /{cmd.name} failed. The error was logged."
