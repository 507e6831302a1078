"""`Memory`: what a turn sends the model, and the rolling summaries behind it.

On the turn's path (`prepare`, `learn`, `after_turn`) it computes: the strategy fits
what the begin transaction read (`gateway.store.turn_context`), with the system prompt,
the tool specs and the new message, to the token budget, and after the reply the
estimate is calibrated by the prompt size the model reported (the factor is stored with
the session by the turn's finish). It writes only when, under the summary strategy,
rows no summary covers would not be sent: they are condensed into the summary first,
extractively and in one transaction, before the model is asked (`_catch_up`). When
the summary strategy's unsummarized history passes `trigger_ratio` of the budget (and
has `min_messages`), a background task condenses its oldest messages until it is at
most `target_ratio`, one chunk and one checkpoint per round:

- never on the reply's path: a task, started after the reply is sent;
- yielding to turns: a round asks the model only when no turn of its session waits or
  runs (a turn that arrives meanwhile cancels the round at the model; the turn's end
  asks again), and, across sessions, when its agent has no turn waiting or running, or
  has waited `YIELD_SECONDS` for that (so a busy agent still gets its summaries);
- bounded: `MAX_CONCURRENT` summaries at the model at once gateway-wide, `MAX_ROUNDS`
  rounds each, at most `MAX_SCHEDULED` sessions waiting (more are asked again at their
  next turn);
- one at a time per session (`/compress`, which runs in the session's lane, cancels a
  background one of its session and goes ahead of the others waiting);
- cancelled at shutdown (`close`), before the store closes;
- race-safe: each checkpoint is written by epoch compare-and-swap
  (`gateway.store.summary_checkpoints.write`); a round that lost the race stops.

The text comes from the agent's own model when it offers `summarize` (the `openai`
backend), else, or when the model fails, from the extractive condensed-turns list.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any

import structlog

from gateway.agents.protocol import SummaryRequest
from gateway.context import condense
from gateway.context.strategy import (
    Loaded,
    Plan,
    Prepared,
    catch_up_start,
    prepare,
    summary_room,
    units,
)
from gateway.context.tokens import (
    CHARS_PER_TOKEN,
    MESSAGE_OVERHEAD,
    Calibration,
    message_tokens,
    size_tokens,
    text_tokens,
)
from gateway.domain.session import TokenUsage
from gateway.store import summary_checkpoints
from gateway.store.session_store import SessionStore

log = structlog.get_logger("gateway.memory")

MAX_CONCURRENT = 2
MAX_ROUNDS = 8
MAX_SCHEDULED = 256
CHUNK_ROWS = 400  # oldest unsummarized rows a round looks at
CATCH_UP_ROUNDS = 3  # turn-path condensations per turn (each summary is bounded)
SUMMARY_TIMEOUT = 300.0  # seconds for the model's summary before the extractive one
#: seconds a background round waits for its agent's other sessions' turns before it
#: asks the model anyway (it never goes ahead of its own session's turns)
YIELD_SECONDS = 30.0

Lease = Callable[[str], AbstractAsyncContextManager[Any]]
PlanFor = Callable[[str], Plan]  # session key -> its agent's plan (several agents)
Busy = Callable[[str], bool]  # session key -> does a turn of it (or of its agent) wait or run


def _never_busy(key: str) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Condensed:
    """What a summary run did: messages condensed, the summary's length at the end, and
    whether it stopped because a newer epoch (another summary, an /undo) won."""

    messages: int
    chars: int
    stale: bool = False


class Memory:
    """`plan`: what turns load (`agent.context`); with several agents, `plan_for` gives
    each session key its own agent's plan, and `plan` is the main agent's.

    `session_busy(key)`: a turn (or a lane command) of the session waits or runs;
    `agent_busy(key)`: one of the key's agent's sessions has one. The runner calls
    `turn_arrived` when a session's lane opens and `turns_changed` when one closes."""

    def __init__(
        self,
        store: SessionStore,
        plan: Plan,
        lease: Lease | None = None,
        plan_for: PlanFor | None = None,
        *,
        session_busy: Busy = _never_busy,
        agent_busy: Busy = _never_busy,
    ) -> None:
        self.store = store
        self.plan = plan
        self.plan_for: PlanFor = plan_for or (lambda key: plan)
        self.lease = lease  # the session's agent, for its model's summaries
        self.calibration = Calibration()
        self.session_busy = session_busy
        self.agent_busy = agent_busy
        self._tasks: dict[str, asyncio.Task[Condensed]] = {}
        # Background summaries by session key (a turn's arrival cancels its session's
        # round at the model), and the sessions whose round is at the model now.
        self._background: dict[str, str] = {}
        self._at_model: set[str] = set()
        self._turns_changed = asyncio.Event()
        self._yielding = 0  # background rounds waiting on `_turns_changed`
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self._closed = False

    # --- the turn's path -----------------------------------------------------------------

    async def prepare(
        self,
        session_id: str,
        loaded: Loaded,
        system_prompt: str,
        text: str,
        plan: Plan | None = None,
        tools_tokens: int = 0,
    ) -> tuple[Loaded, Prepared]:
        """The turn's history (the summary first, if any), fitted with the system prompt,
        the tool specs (`tools_tokens`) and `text` to the budget of `plan` (the turn's
        agent's; default `self.plan`). Under the summary strategy no row is left out
        unless a summary covers it: rows that do not fit, and older ones the read did not
        reach, are condensed into the summary first (`_catch_up`). Returns what the turn
        then has loaded (the summary it sends, the rows after it) and what it sends."""
        self.calibration.restore(session_id, loaded.token_factor)
        factor = self.calibration.factor(session_id)
        plan = self.plan if plan is None else plan

        def fit(loaded: Loaded) -> Prepared:
            return prepare(
                plan,
                loaded,
                system_prompt=system_prompt,
                text=text,
                factor=factor,
                tools_tokens=tools_tokens,
            )

        prepared = fit(loaded)
        for _ in range(CATCH_UP_ROUNDS):  # a round's longer summary may push out more rows
            if plan.strategy != "summary" or prepared.too_large or not loaded.ids:
                break
            if not (prepared.dropped or loaded.full):
                break
            caught = await self._catch_up(plan, session_id, loaded, prepared, factor)
            if caught is None:
                break
            loaded = caught
            prepared = fit(loaded)
        return loaded, prepared

    async def _catch_up(
        self, plan: Plan, session_id: str, loaded: Loaded, prepared: Prepared, factor: float
    ) -> Loaded | None:
        """Condense every unsummarized row older than the first row the turn sends into
        the summary, in the turn's own time: extractively (no model call on the turn's
        path; a background summary may rewrite it later), in one transaction, by epoch
        compare-and-swap. The cut falls before a user message (what the turn sends opens
        with one) or after the newest row read (the turn's own message follows). None
        when nothing was left to condense."""
        # The summary stored is bounded as every summary is. A turn whose own message
        # leaves it less room sends it cut (`prepare`): cutting the stored one would
        # lose for good what one large message crowds out of one request.
        limit = self.max_summary_chars(plan, prepared.base_tokens, factor)
        room = max(0, min(limit, summary_room(plan, prepared)))
        # Cut where the rest fits beside a summary of the largest size it may grow to:
        # one condensation, not one per row its growth pushes out.
        kept = catch_up_start(plan, loaded, prepared, room)
        bound = loaded.ids[kept] if kept < len(loaded.ids) else loaded.ids[-1] + 1

        def catch_up(conn: Any) -> tuple[summary_checkpoints.Checkpoint | None, int]:
            checkpoint = summary_checkpoints.read(conn, session_id)
            epoch = covered = condensed = 0
            text, before = None, 0
            told = 0
            if checkpoint is not None:
                epoch, covered = checkpoint.epoch, checkpoint.covered_up_to
                text = checkpoint.summary
                before = checkpoint.messages if text else 0
                told = checkpoint.told
            while rows := summary_checkpoints.rows_between(
                conn, session_id, covered, bound, CHUNK_ROWS
            ):
                text = condense.extractive(text, [message for _, message in rows], limit)
                covered, condensed = rows[-1][0], condensed + len(rows)
            if not condensed or text is None:
                return checkpoint, 0
            written = summary_checkpoints.write(
                conn,
                session_id,
                expected_epoch=epoch,
                covered_up_to=covered,
                summary=text,
                messages=before + condensed,
                now=time.time(),
            )
            if not written:  # another replica's summary committed first: read it again
                return None, 0
            total = before + condensed
            written_checkpoint = summary_checkpoints.Checkpoint(
                epoch + 1, covered, text, total, told
            )
            return written_checkpoint, condensed

        for _ in range(CATCH_UP_ROUNDS):
            checkpoint, condensed = await self.store.write(catch_up, dirty=False)
            if checkpoint is not None:
                break
        if checkpoint is None or (not condensed and checkpoint.epoch == loaded.epoch):
            return None  # nothing older to condense, and no newer summary to send
        log.info(
            "summary_caught_up",
            session_id=session_id,
            condensed=condensed,
            covered_up_to=checkpoint.covered_up_to,
            chars=len(checkpoint.summary or ""),
            epoch=checkpoint.epoch,
        )
        start = bisect.bisect_right(loaded.ids, checkpoint.covered_up_to)
        return replace(
            loaded,
            ids=loaded.ids[start:],
            messages=loaded.messages[start:],
            summary=checkpoint.summary,
            covered_up_to=checkpoint.covered_up_to,
            epoch=checkpoint.epoch,
            condensed=checkpoint.messages,
            told=checkpoint.told,
            full=False,
        )

    def learn(
        self, session_id: str, loaded: Loaded, prepared: Prepared, usage: TokenUsage | None
    ) -> float | None:
        """Learn the session's token factor from the prompt size the model reported for
        one request (`usage`: None when the turn made several). Returns the factor to
        store with the turn's finish, None when the stored one is still right."""
        if usage is not None and usage.input_tokens > 0:
            self.calibration.observe(session_id, prepared.sent_tokens, usage.input_tokens)
        return self.calibration.to_store(session_id, loaded.token_factor)

    def after_turn(
        self,
        key: str,
        session_id: str,
        loaded: Loaded,
        prepared: Prepared,
        reply: str | None,
    ) -> None:
        """Start a summary if the history grew past the trigger (after `learn`).
        Computes only: whatever it starts runs in the background."""
        plan = self.plan_for(key)
        if plan.strategy != "summary" or reply is None:
            return
        if len(loaded.messages) + 2 < plan.min_messages:
            return
        tokens = prepared.fixed_tokens + prepared.unsummarized_tokens
        tokens += message_tokens({"content": reply})
        factor = self.calibration.factor(session_id)
        if tokens * factor > plan.trigger_ratio * plan.budget:
            self.schedule(key, session_id, prepared.base_tokens)

    # --- summaries -----------------------------------------------------------------------

    def schedule(self, key: str, session_id: str, system_tokens: int = 0) -> bool:
        """Start a background summary of the session unless one runs (or too many wait)."""
        if self._closed or session_id in self._tasks or len(self._tasks) >= MAX_SCHEDULED:
            return False
        self._background[key] = session_id
        self._spawn(session_id, self._summarize(key, session_id, system_tokens, background=True))
        return True

    async def compress(self, key: str, session_id: str, focus: str | None) -> Condensed | None:
        """/compress: condense every unsummarized message now. It runs in the session's
        lane, so a background summary of the session is only waiting for the lane to
        free: it is cancelled (this condenses everything it would). None when the
        gateway stopped it; cancelling the caller (/stop) cancels the summary too."""
        while (running := self._tasks.get(session_id)) is not None:
            if self._background.get(key) == session_id:
                running.cancel()
            await asyncio.wait([running])
        if self._closed:
            return None
        task = self._spawn(session_id, self._summarize(key, session_id, 0, focus, everything=True))
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            raise
        return None if task.cancelled() else task.result()

    def running(self, session_id: str) -> bool:
        return session_id in self._tasks

    def turn_arrived(self, key: str) -> None:
        """A turn (or lane command) of the session waits now: its background summary's
        round at the model, if any, is cancelled (its checkpoints so far stay; the
        turn's end asks for a summary again). A round still waiting keeps waiting."""
        session_id = self._background.get(key)
        if session_id is not None and session_id in self._at_model:
            task = self._tasks.get(session_id)
            if task is not None:
                log.info("summary_yielded", session_id=session_id)
                task.cancel()

    def turns_changed(self) -> None:
        """A session's lane closed: waiting summaries look again. (Every turn's end calls
        this: with no summary waiting it changes nothing.)"""
        if self._yielding:
            self._turns_changed.set()
            self._turns_changed = asyncio.Event()

    async def close(self) -> None:
        """Cancel the summaries in flight (a checkpoint is all or nothing: none is half
        written) and wait for them."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, session_id: str, work: Any) -> asyncio.Task[Condensed]:
        task = asyncio.create_task(work, name=f"summary:{session_id}")
        self._tasks[session_id] = task
        task.add_done_callback(lambda done: self._finished(session_id, done))
        return task

    def _finished(self, session_id: str, task: asyncio.Task[Condensed]) -> None:
        if self._tasks.get(session_id) is task:
            del self._tasks[session_id]
            self._at_model.discard(session_id)
            for key in [k for k, s in self._background.items() if s == session_id]:
                del self._background[key]
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("summary_failed", session_id=session_id, error=repr(exc))

    async def _slot(self, key: str, session_id: str, background: bool) -> None:
        """Take a summary slot for one round. A background round first waits until no
        turn of its session waits or runs, and none of its agent's either (at most
        `YIELD_SECONDS` for those), and looks again once it holds the slot."""
        if not background:
            await self._slots.acquire()
            return
        deadline = time.monotonic() + YIELD_SECONDS
        while True:
            while (left := self._yields(key, deadline)) is not False:
                changed = self._turns_changed
                self._yielding += 1
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left):
                            await changed.wait()
                finally:
                    self._yielding -= 1
            await self._slots.acquire()
            if self._yields(key, deadline) is False:
                self._at_model.add(session_id)
                return
            self._slots.release()

    def _yields(self, key: str, deadline: float) -> float | bool | None:
        """Does a background round still yield: False (it may go), the seconds left of
        its wait for other sessions' turns, or None (until its own session's are done)."""
        if self.session_busy(key):
            return None
        if not self.agent_busy(key):
            return False
        left = deadline - time.monotonic()
        return left if left > 0 else False

    async def _summarize(
        self,
        key: str,
        session_id: str,
        system_tokens: int,
        focus: str | None = None,
        *,
        everything: bool = False,
        background: bool = False,
    ) -> Condensed:
        condensed = chars = 0
        plan = self.plan_for(key)
        for round_ in range(MAX_ROUNDS):
            await self._slot(key, session_id, background)
            try:
                work = await self.store.read(
                    lambda conn: summary_checkpoints.unsummarized(conn, session_id, CHUNK_ROWS)
                )
                count = self._pick(plan, session_id, work, system_tokens, everything, round_ == 0)
                if count == 0:
                    break
                checkpoint = work.checkpoint
                previous = checkpoint.summary if checkpoint is not None else None
                text = await self._condense(
                    plan, key, session_id, previous, work.messages[:count], focus, system_tokens
                )
                # Past the model: a turn arriving now does not cancel the round's write.
                self._at_model.discard(session_id)
                epoch = checkpoint.epoch if checkpoint is not None else 0
                before = checkpoint.messages if checkpoint is not None and previous else 0
                covered = work.ids[count - 1]
                written = await self.store.write(
                    lambda conn, text=text, covered=covered, epoch=epoch, total=before + count: (
                        summary_checkpoints.write(
                            conn,
                            session_id,
                            expected_epoch=epoch,
                            covered_up_to=covered,
                            summary=text,
                            messages=total,
                            now=time.time(),
                            told=everything,  # /compress answers with what it condensed
                        )
                    ),
                    dirty=False,
                )
            finally:
                self._at_model.discard(session_id)
                self._slots.release()
            if not written:
                log.info("summary_discarded", session_id=session_id, reason="epoch moved")
                return Condensed(condensed, chars, stale=True)
            condensed += count
            chars = len(text)
            log.info(
                "summary_written",
                session_id=session_id,
                condensed=count,
                covered_up_to=covered,
                chars=chars,
                epoch=epoch + 1,
            )
        return Condensed(condensed, chars)

    def _pick(
        self,
        plan: Plan,
        session_id: str,
        work: summary_checkpoints.Unsummarized,
        system_tokens: int,
        everything: bool,
        first: bool,
    ) -> int:
        """How many of the oldest unsummarized messages this round condenses (whole
        units only, and up to a user message: what follows a summary opens with one):
        all of them for /compress, else enough to bring the history down to
        `target_ratio`, at most half a budget of them (one model request's worth), and
        never the newest unit."""
        messages = work.messages
        complete = len(messages) == work.total_messages
        spans = units(messages)
        if spans and not complete:
            spans = spans[:-1]  # the read may have cut the last unit's tool results

        def cut(end: int) -> bool:  # a summary may end before messages[end]
            if end < len(messages):
                return messages[end].get("role") == "user"
            return complete  # after the last: the next to come is a turn's user message

        if not spans:
            return 0
        if everything:
            return next((end for _, end in reversed(spans) if cut(end)), 0)
        factor = self.calibration.factor(session_id)
        summary = work.checkpoint.summary if work.checkpoint is not None else None
        fixed = system_tokens + (text_tokens(summary) if summary else 0)
        total = fixed + size_tokens(work.total_chars, work.total_bytes)
        total += MESSAGE_OVERHEAD * work.total_messages
        ratio = plan.trigger_ratio if first else plan.target_ratio
        if total * factor <= ratio * plan.budget:
            return 0
        if first and work.total_messages < plan.min_messages:
            return 0
        excess = total - plan.target_ratio * plan.budget / factor
        chunk = plan.budget / 2 / factor
        take = removed = 0
        for start, end in spans[:-1]:
            cost = sum(message_tokens(m) for m in messages[start:end])
            if take and removed + cost > chunk:
                break
            removed += cost
            if cut(end):
                take = end
                if removed >= excess:
                    break
        return take

    def max_summary_chars(
        self, plan: Plan | None = None, base_tokens: int = 0, factor: float = 1.0
    ) -> int:
        """A summary takes at most half of what the target leaves the history once every
        request's system prompt and tool specs (`base_tokens`) are counted (in ASCII
        characters; text of other scripts is held to as many estimated tokens)."""
        plan = self.plan if plan is None else plan
        room = plan.budget / factor - base_tokens
        return max(0, int(room * plan.target_ratio / 2)) * CHARS_PER_TOKEN

    async def _condense(
        self,
        plan: Plan,
        key: str,
        session_id: str,
        previous: str | None,
        messages: Sequence[dict[str, Any]],
        focus: str | None,
        base_tokens: int = 0,
    ) -> str:
        limit = self.max_summary_chars(plan, base_tokens, self.calibration.factor(session_id))
        if self.lease is not None:
            request = SummaryRequest(key, session_id, previous, tuple(messages), limit, focus)
            try:
                async with self.lease(key) as agent:
                    summarize = getattr(agent, "summarize", None)
                    if callable(summarize):
                        async with asyncio.timeout(SUMMARY_TIMEOUT):
                            text = await summarize(request)
                        if isinstance(text, str) and text.strip():
                            # As many estimated tokens as `limit` ASCII characters,
                            # ending at a sentence or a word.
                            return condense.clip_at_boundary(text.strip(), limit)
            except Exception as exc:  # the model failing: the extractive summary instead
                log.warning("summary_model_failed", session_id=session_id, error=str(exc))
        return condense.extractive(previous, messages, limit, focus)
