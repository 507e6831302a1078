"""One turn, top to bottom: begin -> session context, recalled notes, tools, files ->
the context fitted to the model's window -> the agent (`AgentCall`) -> the scheduled
run's outcome -> finish (one transaction, `TurnLane.finish_turn`) -> send the recorded
chunks, files and stream edits -> a summary in the background. One log line per turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import structlog

from adapters.base import PlatformAdapter
from config import GatewayConfig
from gateway.agents.protocol import TurnRequest
from gateway.agents.roster import Roster
from gateway.context.strategy import too_large_text
from gateway.domain.events import MessageEvent
from gateway.domain.policy import reset_notice
from gateway.domain.session import Platform, SessionEntry, build_session_context
from gateway.memory import notice
from gateway.memory.recall import Namespace, Recall, notes_prompt
from gateway.memory.summaries import Memory
from gateway.ops.logs import TurnLine
from gateway.ops.metrics import Metrics
from gateway.runner.agent_call import AgentCall, TurnOutcome
from gateway.runner.budgets import Budgets
from gateway.runner.delivery import Delivery
from gateway.runner.media import MediaIntake
from gateway.runner.model_commands import load_choice
from gateway.runner.recovery import Recovery
from gateway.runner.streaming import Stream, Streams
from gateway.schedules.loop import Scheduler
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.tools.registry import TurnTools, agent_id_of

log = structlog.get_logger("gateway.run")

INTERNAL_ERROR_TEXT = (
    "Sorry, something went wrong while answering. The error was logged; /retry asks again."
)


class TurnLane(Protocol):
    """The session lane a turn runs in (`TurnEngine`): the stored text of a message, and
    the turn's finish, which begins the lane's next waiting turn in its transaction."""

    def turn_text(self, event: MessageEvent) -> str: ...

    async def finish_turn(
        self,
        key: str,
        begun: TurnStart,
        event: MessageEvent,
        outcome: TurnOutcome,
        chunks: list[str],
        tools: TurnTools | None = None,
        settles: Sequence[Callable[[Any], object]] = (),
        edits: Sequence[str] | None = None,
        *,
        token_factor: float | None = None,
    ) -> list[int]: ...


class TurnRunner:
    """Runs one turn of a session; `lane` is set by the engine that runs it."""

    lane: TurnLane

    def __init__(
        self,
        config: GatewayConfig,
        adapters: Mapping[Platform, PlatformAdapter],
        store: SessionStore,
        turnlog: TurnLog,
        roster: Roster,
        memory: Memory,
        recall: Recall,
        scheduler: Scheduler,
        metrics: Metrics,
        streams: Streams,
        delivery: Delivery,
        media: MediaIntake,
        recovery: Recovery,
        asking: AgentCall,
        budgets: Budgets,
    ) -> None:
        self.config = config
        self.adapters = adapters
        self.store = store
        self.turnlog = turnlog
        self.roster = roster
        self.memory = memory
        self.recall = recall
        self.scheduler = scheduler
        self.metrics = metrics
        self.streams = streams
        self.delivery = delivery
        self.media = media
        self.recovery = recovery
        self.asking = asking
        self.budgets = budgets
        # What every turn's session context says of the config (it does not change).
        self._platforms = tuple(config.connected_platforms())
        self._homes = config.home_channels()

    async def run(self, key: str, event: MessageEvent, begun: TurnStart | None) -> None:
        """One turn, begun here unless its lane began it already (`begun`)."""
        structlog.contextvars.bind_contextvars(session_key=key)
        started = time.monotonic()
        source = event.source
        turn = TurnLine(source.platform.value, started)  # the log's one line for this turn
        stream: Stream | None = None
        finished = False  # the turn's end is recorded (its message answered)
        asking = self.asking
        try:
            # The chat's /model choice, as stored (another replica or a restart may have
            # set it): the key's spec, plan and cache signature follow it.
            if self.roster.offers_choice(key):  # no coroutine on the path of the rest
                await load_choice(self.store, self.roster, key)
            if begun is None:
                begun = await self.turnlog.begin(
                    event, key, self.lane.turn_text(event), running=asking.slot_free()
                )
            entry = begun.entry
            turn.session_id = entry.session_id
            if begun.refusal is not None:  # a budget: the model is not called
                await self._refuse(key, event, begun, turn)
                finished = True
                return
            if begun.resumed:
                log.info("turn_resumed", session_id=entry.session_id)
            elif begun.fresh and entry.was_auto_reset:
                await self._log_reset(key, entry)
            agent = self.roster.for_key(key)  # the key's agent: its prompt, plan, timeout
            session_context = build_session_context(
                source, self.config, entry, platforms=self._platforms, homes=self._homes
            )
            system_prompt = asking.system_prompt(session_context, agent)
            if source.user_id and not session_context.shared_multi_user_session:
                # auto_recall: the user's best notes for this message, counted in the
                # context budget with the rest of the prompt. Not in a shared session:
                # one of its turns may carry several users' messages, and a user's
                # notes are theirs, not the group's.
                notes = await self.recall.for_turn(
                    Namespace.of(agent_id_of(key), source), begun.text
                )
                if notes:
                    system_prompt = f"{system_prompt}\n\n{notes_prompt(notes)}"
            tools = asking.turn_tools(
                key, entry.session_id, source, begun.user_row, resumed=begun.resumed
            )
            intake = None
            if event.media:  # files: downloaded and read before the agent is asked
                intake = await self.media.for_turn(
                    self.adapters.get(source.platform),
                    event,
                    entry.session_id,
                    begun.text,
                    vision=agent.config.vision,
                    deliver=self.delivery.deliver,
                )
            text = begun.text if intake is None else intake.text
            # Everything the request carries is fitted to the model's window; rows that
            # do not fit are condensed into the summary first (never silently left out).
            loaded, context = await self.memory.prepare(
                entry.session_id,
                begun.context,
                system_prompt,
                text,
                agent.plan,
                tools.spec_tokens if tools is not None else 0,
            )
            request = TurnRequest(
                session_key=key,
                session_id=entry.session_id,
                text=text,
                history=context.history,
                system_prompt=system_prompt,
                source=source,
                tools=tools,
                images=() if intake is None else tuple(intake.images),
            )
            # A turn re-run after a crash finishes the messages its first run streamed.
            shown = await self.turnlog.stream_of(key) if event.resume else []
            stream = self.streams.open(key, source, event.reply_to, shown)
            typing = self.delivery.start_typing(source)
            asked = False  # the model was called: its usage is charged
            try:
                if intake is not None and intake.only_refusals:
                    outcome = TurnOutcome.failed(intake.notices[0], "too_large")
                elif context.too_large:  # the model would refuse it: it is not asked
                    outcome = TurnOutcome.failed(too_large_text(agent.plan, context), "too_large")
                else:
                    asked = True
                    outcome = await asking.call(key, request, agent, stream, begun)
                edits = await stream.finish() if stream is not None else shown
            finally:
                if typing is not None:
                    typing.cancel()

            # What the model reported (learnt from below); what is charged: those counts,
            # or estimates when it reported none, priced at the model's price.
            reported, charged = outcome.usage, outcome
            settles: tuple[Callable[[Any], object], ...] = ()
            if asked and (reported is not None or outcome.reply is not None):
                spent = self.budgets.priced(
                    agent.model, reported, context.sent_tokens, outcome.reply or ""
                )
                charged = replace(outcome, usage=spent)
                settles = (self.budgets.charge(key, source, agent.agent_id, agent.model, spent),)
            turn.usage = charged.usage
            if self.config.logging.include_text:
                turn.texts = (begun.text, outcome.text)
            text, run_status = outcome.text, None
            schedule_id = self.scheduler.schedule_of(key)
            if schedule_id is not None:  # a scheduled run: its outcome ends with the turn
                text, settle, run_status = await self.scheduler.settle_turn(
                    schedule_id, outcome.reply, outcome.text, charged.usage
                )
                settles = (*settles, settle)
            # A summary condensed messages the user was not told about: the reply says so
            # (unless agent.context.notify is off), and its finish marks them told either
            # way, so turning the notice on later does not tell of summaries long past.
            if condensed := notice.owed(loaded):
                if agent.config.context.notify:
                    text = f"{notice.condense_notice(condensed)}\n\n{text}"
                settles = (*settles, notice.told_tx(entry.session_id, loaded))
            chunks = self.delivery.split(source, self._with_reset_notice(entry, text))
            turn.chunks = len(chunks)
            if intake is not None and begun.user_row is not None:
                settles = (*settles, intake.transcript_tx(begun.user_row, event.message_id))
            # The token factor is learnt from one request's prompt (a turn with tool rounds
            # reports the sum of several), and stored by the finish when it moved.
            factor = self.memory.learn(
                entry.session_id,
                loaded,
                context,
                reported if not outcome.messages else None,
            )
            ids = await self.lane.finish_turn(
                key,
                begun,
                event,
                charged,
                chunks,
                tools,
                settles,
                edits if edits else None,
                token_factor=factor,
            )
            finished = True
            if charged.usage is not None and charged is not outcome:
                self.budgets.counted(agent.agent_id, agent.model, charged.usage)
            if run_status is not None:
                self.metrics.count_schedule_run(run_status)
            if outcome.reply is not None:
                self.metrics.turns_total += 1
                self.recovery.turn_succeeded(key)
            self.metrics.observe_turn(time.monotonic() - started)
            turn.sent = await self.delivery.send_recorded(
                source, list(zip(ids, chunks, strict=False)), event.reply_to, edits
            )
            if len(edits) > len(chunks):
                await self.delivery.delete_extra(source, edits[len(chunks) :])
            if outcome.attachments:
                files = list(zip(ids[len(chunks) :], outcome.attachments, strict=True))
                await self.delivery.send_attachments(source, files, event.reply_to)
            turn.outcome = outcome.status
            self.memory.after_turn(  # may start a summary, in the background
                key, entry.session_id, loaded, context, outcome.reply
            )
        except asyncio.CancelledError:
            turn.outcome = "cancelled"  # /stop, or a shutdown that could not wait
            raise
        except Exception:
            if not finished:
                turn.outcome = "error"
                await self._answer_internal_error(key, event, begun)
            raise  # logged by the worker
        finally:
            if stream is not None:
                stream.close()  # after the final's delivery: the chat's slot is free again
                self.metrics.stream_edits_total += stream.edits
                self.metrics.stream_flood_waits_total += stream.floods
            turn.log(log)

    async def _refuse(
        self, key: str, event: MessageEvent, begun: TurnStart, turn: TurnLine
    ) -> None:
        """A turn its owner's budget refused: answered with the refusal, in its finish
        (a scheduled run's outcome, an agent task's state and the next queued turn go
        with it as with any turn); its model is never called."""
        assert begun.refusal is not None
        source = event.source
        outcome = TurnOutcome.failed(begun.refusal.text, "refused")
        text, settles, run_status = outcome.text, (), None
        schedule_id = self.scheduler.schedule_of(key)
        if schedule_id is not None:
            text, settle, run_status = await self.scheduler.settle_turn(
                schedule_id, None, outcome.text, None
            )
            settles = (settle,)
        chunks = self.delivery.split(source, text)
        ids = await self.lane.finish_turn(key, begun, event, outcome, chunks, None, settles)
        self.metrics.count_budget_refusal(begun.refusal.reason)  # once: the finish committed
        if run_status is not None:
            self.metrics.count_schedule_run(run_status)
        turn.outcome, turn.chunks = outcome.status, len(chunks)
        turn.sent = await self.delivery.send_recorded(
            source, list(zip(ids, chunks, strict=False)), event.reply_to
        )

    async def _answer_internal_error(
        self, key: str, event: MessageEvent, begun: TurnStart | None
    ) -> None:
        """An unexpected error (a bug, the store) before the turn recorded its end: answer
        its messages with a short error all the same, as a failed agent call is answered,
        instead of leaving them waiting for a restart. If even that cannot be recorded,
        the turn's marker and messages stay, and the next start runs them again."""
        source = event.source
        chunks = self.delivery.split(source, INTERNAL_ERROR_TEXT)
        try:
            if begun is not None:
                failed = TurnOutcome.failed(INTERNAL_ERROR_TEXT, "error")
                ids = await self.lane.finish_turn(key, begun, event, failed, chunks, edits=[])
            else:
                ids = await self.turnlog.answer_unbegun(key, event, chunks)
        except Exception as exc:
            log.warning("turn_error_unanswered", error=str(exc), error_type=type(exc).__name__)
            return
        await self.delivery.send_recorded(
            source, list(zip(ids, chunks, strict=False)), event.reply_to
        )

    async def _log_reset(self, key: str, entry: SessionEntry) -> None:
        """One line per automatic reset: why, and which session it ended."""
        log.info(
            "session_reset",
            reason=entry.auto_reset_reason,
            old_session_id=await self.store.session_replaced_by(key, entry.session_id),
            new_session_id=entry.session_id,
            had_activity=entry.reset_had_activity,
        )

    def _with_reset_notice(self, entry: SessionEntry, reply: str) -> str:
        if not entry.was_auto_reset:
            return reply
        policy = self.config.get_reset_policy(entry.platform or Platform.LOCAL, entry.chat_type)
        if not policy.notify:
            return reply
        return f"{reset_notice(entry.auto_reset_reason)}\n\n{reply}"
