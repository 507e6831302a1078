"""The context strategies: what of a session's transcript one turn sends the model.

    window   the newest messages that fit the token budget, at most
             min(context.max_messages, agent.history_limit)
    summary  the latest rolling summary (one system message), then the newest messages
             after the rows it covers that fit the budget, at most agent.history_limit

The budget is the model's window less the reply's reserve, and everything a request
carries counts against it: the system prompt, the tool specs, the summary, the history
and the new message (`prepare`). Under `summary`, what does not fit is condensed into
the summary before the turn is sent (`gateway.memory.summaries`, by `catch_up_start`).
The store reads (`gateway.store.turn_context`, inside the turn's begin transaction);
this module decides, on what was read, with no I/O. A tool call is never split from
its results: an assistant message with `tool_calls` and the `tool` messages after it
are one unit, sent whole or not at all. What is sent of the transcript opens with a user
message, whatever the cut (the summary's or the budget's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from config import AgentConfig
from gateway.context.condense import clip_at_boundary
from gateway.context.tokens import (
    CHARS_PER_TOKEN,
    MESSAGE_OVERHEAD,
    message_tokens,
    text_tokens,
)

SUMMARY_PREFIX = "Rolling session summary:\n"
MAX_REPLY_RESERVE = 4096


@dataclass(frozen=True, slots=True)
class Plan:
    """The agent's context settings, as the turn path uses them."""

    strategy: str  # "window" | "summary"
    rows: int  # transcript rows a turn reads at most
    window_tokens: int
    min_messages: int
    trigger_ratio: float
    target_ratio: float

    @classmethod
    def from_config(cls, agent: AgentConfig) -> Plan:
        context = agent.context
        rows = agent.history_limit
        if context.strategy == "window":
            rows = min(rows, context.max_messages)
        return cls(
            strategy=context.strategy,
            rows=rows,
            window_tokens=context.window_tokens,
            min_messages=context.min_messages,
            trigger_ratio=context.trigger_ratio,
            target_ratio=context.target_ratio,
        )

    @classmethod
    def newest(cls, rows: int) -> Plan:
        """The newest `rows` messages, with the default window (what a bare TurnLog reads)."""
        return cls.from_config(AgentConfig(history_limit=rows)).with_strategy("window", rows)

    def with_strategy(self, strategy: str, rows: int) -> Plan:
        return replace(self, strategy=strategy, rows=rows)

    @property
    def budget(self) -> int:
        """Tokens a prompt may take: the window less what the reply needs."""
        return self.window_tokens - min(self.window_tokens // 8, MAX_REPLY_RESERVE)


@dataclass(frozen=True, slots=True)
class Loaded:
    """What the begin transaction read for a turn: transcript rows (oldest first, with
    their ids) after the checkpoint it found, and that checkpoint."""

    ids: tuple[int, ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
    summary: str | None = None
    covered_up_to: int = 0  # the summary stands for the active rows with id <= this
    epoch: int = 0
    condensed: int = 0  # messages the summary condenses
    told: int = 0  # of them, those the user was told about (the rest: a notice owed)
    full: bool = False  # the read hit its row limit: older unsummarized rows exist
    token_factor: float | None = None  # the session's stored calibration (None: none yet)


NOTHING_LOADED = Loaded()


@dataclass(frozen=True, slots=True)
class Prepared:
    """A turn's history as sent, and what it weighs (estimated, uncalibrated tokens)."""

    history: tuple[dict[str, Any], ...]
    sent_tokens: int  # everything the request carries: system, tools, summary, history, text
    base_tokens: int  # system prompt + tool specs: what every request of the agent carries
    fixed_tokens: int  # base + summary: what every turn of the session carries
    unsummarized_tokens: int  # every loaded row, sent or not, + the user text
    dropped: int  # loaded rows that did not fit
    asked_tokens: int = 0  # the new message
    # The new message with the base alone outgrows the budget: the model is not asked.
    too_large: bool = False
    factor: float = 1.0  # the session's calibration the fit was made with


def units(messages: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """[start, end) index ranges of the messages that go together, oldest first.

    `tool` messages join the assistant message with tool_calls before them; tool results
    whose call is not in `messages` (cut off by the read) form no unit and are dropped."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(messages)
    while i < n:
        message = messages[i]
        if message.get("role") == "tool":
            i += 1  # an orphan result: its call is older than what was read
            continue
        end = i + 1
        if message.get("role") == "assistant" and message.get("tool_calls"):
            while end < n and messages[end].get("role") == "tool":
                end += 1
        spans.append((i, end))
        i = end
    return spans


def fit_suffix(messages: Sequence[dict[str, Any]], costs: Sequence[int], budget: int) -> int:
    """The index of the first message of the longest run of whole units, ending with the
    newest, whose costs sum to at most `budget` (len(messages) when none fits)."""
    start, used = len(messages), 0
    for first, end in reversed(units(messages)):
        cost = sum(costs[first:end])
        if used + cost > budget:
            break
        used += cost
        start = first
    return start


def user_start(messages: Sequence[dict[str, Any]], start: int) -> int:
    """The first user message at or after `start` (len(messages) when none): what is sent
    after the system prompt and the summary opens with a user message. Several local
    models' chat templates (llama.cpp, vLLM) refuse a conversation that opens with the
    assistant, as one cut between a question and its answer would."""
    n = len(messages)
    while start < n and messages[start].get("role") != "user":
        start += 1
    return start


def summary_message(summary: str) -> dict[str, Any]:
    return {"role": "system", "content": SUMMARY_PREFIX + summary}


def prepare(
    plan: Plan,
    loaded: Loaded,
    *,
    system_prompt: str,
    text: str,
    factor: float = 1.0,
    tools_tokens: int = 0,
) -> Prepared:
    """The history to send: the summary (if any), then the newest whole units of the
    loaded rows that fit what the budget leaves (by the calibrated estimate) after the
    system prompt, the tool specs (`tools_tokens`), the summary and the new message, from
    a user message on (`user_start`). A summary too long for what the rest leaves is cut
    to fit (the rows it covers stay covered); a new message that does not fit even with
    no history and no summary is `too_large`, and nothing is sent."""
    system = message_tokens({"content": system_prompt}) if system_prompt else 0
    base = system + tools_tokens
    asked = message_tokens({"content": text})
    room = int(plan.budget / factor) - base - asked
    if room < 0:
        dropped = len(loaded.messages)
        return Prepared((), base + asked, base, base, asked, dropped, asked, True, factor)
    summary = summary_message(loaded.summary) if loaded.summary else None
    if summary is not None and message_tokens(summary) > room:
        summary = fitted_summary(loaded.summary or "", room)
    fixed = base + (message_tokens(summary) if summary is not None else 0)
    room -= fixed - base
    costs = [message_tokens(m) for m in loaded.messages]
    total = sum(costs)
    messages = loaded.messages
    if total <= room and (not messages or messages[0].get("role") == "user"):
        start = 0  # the usual turn: everything fits (what `fit_suffix` finds, without its walk)
    else:
        start = fit_suffix(messages, costs, room) if room > 0 else len(costs)
        start = user_start(messages, start)
    kept = messages[start:]
    return Prepared(
        history=(summary, *kept) if summary is not None else tuple(kept),
        sent_tokens=fixed + asked + (total if start == 0 else sum(costs[start:])),
        base_tokens=base,
        fixed_tokens=fixed,
        unsummarized_tokens=total + asked,
        dropped=start,
        asked_tokens=asked,
        factor=factor,
    )


def summary_room(plan: Plan, prepared: Prepared) -> int:
    """The `token_chars` of the largest summary that fits beside what the request
    carries besides history (the system prompt, the tool specs, the new message)."""
    room = int(plan.budget / prepared.factor) - prepared.base_tokens - prepared.asked_tokens
    return (room - MESSAGE_OVERHEAD - text_tokens(SUMMARY_PREFIX)) * CHARS_PER_TOKEN


def catch_up_start(plan: Plan, loaded: Loaded, prepared: Prepared, summary_chars: int) -> int:
    """The first of the loaded rows a turn sends once everything older is condensed into
    a summary of up to `summary_chars` (`token_chars`), from a user message on.

    A catch-up condenses in a chunk, well below the limit that called for it: what is
    kept fits `target_ratio` of the room left beside a summary of that size, and, when
    the read hit its row limit, is at most half of it (rounded up). Cutting only to the
    limit would condense a message or two on every turn past it (each turn adds rows),
    and every such turn would pay a store write and tell the user of a summary."""
    summary = MESSAGE_OVERHEAD + text_tokens(SUMMARY_PREFIX) + -(-summary_chars // CHARS_PER_TOKEN)
    room = int(plan.budget / prepared.factor) - prepared.base_tokens - prepared.asked_tokens
    room -= summary
    messages = loaded.messages
    costs = [message_tokens(m) for m in messages]
    start = fit_suffix(messages, costs, int(room * plan.target_ratio)) if room > 0 else len(costs)
    if loaded.full:
        start = max(start, len(messages) - (plan.rows - plan.rows // 2))
    return user_start(messages, max(start, prepared.dropped))


def fitted_summary(summary: str, room: int) -> dict[str, Any] | None:
    """The summary message cut to `room` estimated tokens (None: no room for any)."""
    chars = (room - MESSAGE_OVERHEAD - text_tokens(SUMMARY_PREFIX)) * CHARS_PER_TOKEN
    if chars <= 0:
        return None
    return summary_message(clip_at_boundary(summary, chars))


def too_large_text(plan: Plan, prepared: Prepared) -> str:
    """What the user is told when their message cannot be sent (`Prepared.too_large`):
    the sizes as the model would count them (the calibrated estimate), and what to do."""
    window, reserve = plan.window_tokens, plan.window_tokens - plan.budget
    base = round(prepared.base_tokens * prepared.factor)
    asked = round(prepared.asked_tokens * prepared.factor)
    room = plan.budget / prepared.factor - prepared.base_tokens - MESSAGE_OVERHEAD
    if room <= 0:
        return (
            f"This agent cannot answer: its system prompt and tools alone take about {base:,}"
            f" tokens, more than its model's window of {window:,} tokens leaves once"
            f" {reserve:,} are kept for the reply. The operator can raise"
            " agent.context.window_tokens (if the model allows) or give it fewer tools."
        )
    return (
        f"Your message is too long for this agent's model: it is about {asked:,} tokens,"
        f" and with the system prompt and tools (about {base:,}) it does not fit the model's"
        f" window of {window:,} tokens, {reserve:,} of them kept for the reply. Nothing was"
        f" sent to the model. Send a shorter message, or split it into parts of at most"
        f" about {int(room) * CHARS_PER_TOKEN:,} characters of English text."
    )
