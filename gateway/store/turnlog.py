"""TurnLog: the durable steps of a message's life, each one transaction on the store.

    accept  inbox row (dedup by platform message id)            -> inbox id / duplicate
    begin   session (reset policy) + user message + turn marker  -> entry, history
    finish  reply + counters + inbox done + marker gone + ledger -> delivery ids
    sent    ledger row acknowledged by the platform

A crash between any two steps leaves a state that start-up recovery completes: accepted
rows are re-queued, a marker re-runs its turn (without storing the user message twice),
pending ledger rows are sent. Nothing is answered twice and nothing accepted is lost.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from gateway.context.strategy import NOTHING_LOADED, Loaded, Plan
from gateway.domain.events import MessageEvent
from gateway.domain.session import SessionEntry, SessionSource, TokenUsage
from gateway.store import entries, journal, titles, tool_calls, transcript, turn_context
from gateway.store.session_store import SessionStore
from gateway.util.faults import crash_point

log = structlog.get_logger("gateway.store.turnlog")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a turn may not call its model (`TurnLog.gate`): which limit (`reason`, what
    the metrics count once the refused turn is finished: the begin transaction may run
    again) and what its sender is told."""

    reason: str
    text: str


@dataclass(frozen=True, slots=True)
class TurnStart:
    """What `begin` found and did. `entry` carries the hot fields only (see
    `entries.load_hot`): `origin` and `display_name` are None, `platform` and `chat_type`
    are the message's source's; a turn needs no more, and reading no more keeps its
    routing one look-up without JSON. The whole entry is `SessionStore.get_entry`."""

    entry: SessionEntry
    resumed: bool  # a re-run after a restart: the user message was stored before
    text: str  # the user message as stored (what the agent is asked)
    fresh: bool = False  # begin wrote the entry: a new session (new key or reset)
    active_minute: int | None = None  # the hot row's active_minute as begin read it
    context: Loaded = NOTHING_LOADED  # what the context strategy read (rows, summary checkpoint)
    user_row: int | None = None  # the user message's transcript row (media rewrite it)
    running: bool = True  # its marker says it runs (else `mark_running` once it does)
    # Why the turn may not call its model (a budget, `TurnLog.gate`): it is answered
    # with this, and its message is not stored in the transcript.
    refusal: Refusal | None = None


class TurnLog:
    def __init__(
        self,
        store: SessionStore,
        history_limit: int = 100,
        plan: Plan | None = None,
        plan_for: Callable[[str], Plan] | None = None,
    ) -> None:
        self.store = store
        self.history_limit = history_limit
        # What `begin` reads of the transcript (gateway.context.strategy); by default the
        # newest `history_limit` messages. With several agents, `plan_for` gives each
        # session key its agent's plan (None: every key reads `plan`).
        self.plan = plan or Plan.newest(history_limit)
        self.plan_for = plan_for
        # Several replicas (gateway.runner.replica): run first in a turn's begin and finish
        # transactions, it fails them when this replica no longer holds the session.
        self.fence: Callable[[Any, str], None] | None = None
        # Budgets (gateway.runner.budgets): run in a new turn's begin transaction, it
        # returns why the turn may not start (None: it may).
        self.gate: Callable[[Any, str, MessageEvent], Refusal | None] | None = None

    async def accept(
        self, event: MessageEvent, session_key: str, kind: str, *, done: bool = False
    ) -> int | None:
        """Record an accepted message; None when this platform id was accepted before.

        `kind` is `turn` (plain message), `queue` (its own turn, FIFO) or `command`.
        Commands are recorded `done` at once: only their message id matters (dedup).
        """
        state = journal.DONE if done else journal.ACCEPTED
        return await self.store.write(
            self._accept_tx(event, session_key, kind, state, _encoded(event)), dirty=False
        )

    async def begin(
        self, event: MessageEvent, session_key: str, text: str, *, running: bool = True
    ) -> TurnStart:
        """Route to the session, store the user message and the turn marker, all at once.
        `running`: the turn's work starts now (False: it waits for an agent slot first)."""
        begin = self._begin_tx(event, session_key, text, _encoded(event), running=running)
        # The message was accepted already: a full disk delays its turn, never drops it.
        start = await self.store.write(
            lambda conn: begin(conn, list(event.inbox_ids)), persist=True
        )
        crash_point("after_turn_begin")
        return start

    async def accept_and_begin(
        self,
        event: MessageEvent,
        session_key: str,
        kind: str,
        text: str,
        claim: Callable[[sqlite3.Connection], bool] | None = None,
        *,
        claim_fences: bool = False,
        running: bool = True,
    ) -> tuple[int, TurnStart] | None:
        """`accept` and `begin` in one transaction, for a message to an idle session: one
        commit (and one wait) fewer per turn. None when the message is a redelivery.

        `claim` (a scheduled run's claim) runs first in the same transaction;
        False from it (the run was not claimed) writes nothing and returns None: a run
        claimed is a turn begun, or neither. `claim_fences`: the claim is what takes the
        session's lease on a replica, so the turn's own fence would only repeat it."""
        record = _encoded(event)
        accept = self._accept_tx(event, session_key, kind, journal.ACCEPTED, record)
        begin = self._begin_tx(
            event, session_key, text, record, fenced=claim_fences, running=running
        )

        def tx(conn: sqlite3.Connection) -> tuple[int, TurnStart] | None:
            # The claim first: on a replica it may be what takes the session's lease
            # (begin's fence, when it has one, comes after it).
            if claim is not None and not claim(conn):
                return None
            inbox_id = accept(conn)
            return None if inbox_id is None else (inbox_id, begin(conn, [inbox_id]))

        result = await self.store.write(tx)
        if result is not None:
            crash_point("after_turn_begin")
        return result

    @staticmethod
    def _accept_tx(
        event: MessageEvent, session_key: str, kind: str, state: str, record: str
    ) -> Callable[[sqlite3.Connection], int | None]:
        now = time.time()
        return lambda conn: journal.accept(
            conn,
            source=event.source,
            message_id=event.message_id,
            session_key=session_key,
            kind=kind,
            event=record,
            now=now,
            state=state,
        )

    def _begin_tx(
        self,
        event: MessageEvent,
        session_key: str,
        text: str,
        record: str,
        *,
        fenced: bool = False,
        running: bool = True,
    ) -> Callable[[sqlite3.Connection, list[int]], TurnStart]:
        """`fenced`: the transaction checked the session's lease already (a replica).
        `running`: what the marker says (`journal.start_turn`)."""
        route = self.store.route_for_turn_tx(event.source, session_key)
        user_message: dict[str, Any] = {"role": "user", "content": text}
        if event.message_id:
            user_message["message_id"] = event.message_id
        now = time.time()
        plan = self.plan if self.plan_for is None else self.plan_for(session_key)
        fence = None if fenced else self.fence
        gate = self.gate

        def tx(conn: sqlite3.Connection, inbox_ids: list[int]) -> TurnStart:
            if fence is not None:
                fence(conn, session_key)
            entry, fresh, minute, factor = route(conn)
            marker = journal.get_turn(conn, session_key) if event.resume else None
            if (
                marker is not None
                and marker["session_id"] == entry.session_id
                and marker["user_message_id"] is not None
            ):
                loaded = turn_context.load(
                    conn, entry.session_id, plan, factor, before=marker["user_message_id"]
                )
                asked = transcript.load_row(conn, marker["user_message_id"])
                content = asked.get("content") if asked else None
                resumed_text = content if isinstance(content, str) else text
                if marker["running"] != running:  # a resumed turn: waiting, as a rule
                    journal.mark_running(conn, session_key, marker["user_message_id"], running)
                return TurnStart(
                    entry,
                    True,
                    resumed_text,
                    fresh,
                    minute,
                    loaded,
                    marker["user_message_id"],
                    running,
                )
            # A budget's refusal: the model is not called, the message not stored.
            refusal = gate(conn, session_key, event) if gate is not None else None
            loaded, user_row = NOTHING_LOADED, None
            if refusal is None:
                loaded = turn_context.load(conn, entry.session_id, plan, factor)
                user_row = transcript.insert_message(conn, entry.session_id, user_message)
                if not loaded.messages:
                    # The session's first user message titles it: decided from the
                    # history this transaction read anyway, so a turn that continues a
                    # session costs no statement; the UPDATE keeps a title set (/title).
                    titles.set_first_title(conn, entry.session_id, text)
            journal.start_turn(
                conn,
                session_key=session_key,
                session_id=entry.session_id,
                inbox_ids=inbox_ids,
                user_message_id=user_row,
                event=record,
                now=now,
                running=running,
            )
            return TurnStart(entry, False, text, fresh, minute, loaded, user_row, running, refusal)

        return tx

    async def finish(
        self,
        session_key: str,
        start: TurnStart,
        event: MessageEvent,
        *,
        reply: str | None,
        usage: TokenUsage | None,
        chunks: list[str],
        then: tuple[MessageEvent, str] | None = None,
        messages: Sequence[dict[str, Any]] = (),
        writes: Sequence[Callable[[sqlite3.Connection], object]] = (),
        settles: Sequence[Callable[[sqlite3.Connection], object]] = (),
        edits: Sequence[str] | None = None,
        attachments: Sequence[dict[str, Any]] = (),
        token_factor: float | None = None,
    ) -> tuple[list[int], TurnStart | None]:
        """Record the turn's outcome and its reply chunks; returns their delivery ids,
        and the start of the `then` turn.

        `reply` is the assistant message for the transcript, None when the turn failed
        (the chunks then carry the error text; resume and reset flags stay set).
        `messages` (the turn's tool rounds) are stored before it and `writes` (what the
        turn's tools change in state.db, the scratchpad) run before it, in the same
        transaction, when the turn succeeded: the transcript and what its tool calls
        wrote commit together, or (a crash before this) not at all.
        `then` (an accepted event waiting behind this turn, and its text as stored) is
        begun in the same transaction: a queued message's turn costs no transaction of
        its own (at most two awaited transactions per turn). `settles` run
        whether the turn succeeded or not (a scheduled run's outcome).
        `edits` (a streamed reply: the platform messages it was shown in, or []
        when none was sent) ends the key's stream row here, and chunk i is delivered as an
        edit of `edits[i]`; None (no stream) touches no stream row.
        `attachments` (the reply's files, `Attachment.to_dict()`) are recorded after the
        chunks; their delivery ids follow the chunks' in the returned list.
        `token_factor`: the session's token calibration, when it moved (stored with it).
        """
        begin_next = None
        if then is not None:
            next_event, next_text = then
            # Fenced by this transaction's own fence (below).
            # Begun, not running: it waits for this turn's reply to go out first.
            begin_next = self._begin_tx(
                next_event,
                session_key,
                next_text,
                _encoded(next_event),
                fenced=True,
                running=False,
            )
            next_inbox = list(next_event.inbox_ids)
        now = datetime.now(UTC)
        succeeded = reply is not None
        session_id = start.entry.session_id
        minute = entries.minute_of(now)
        if minute == start.active_minute:
            minute = None  # the row has it: its index entry is not rewritten
        fence = self.fence

        def tx(conn: sqlite3.Connection) -> tuple[list[int], TurnStart | None]:
            if fence is not None:
                fence(conn, session_key)
            if succeeded:
                for write in writes:
                    write(conn)
                for message in messages:
                    transcript.insert_message(conn, session_id, message)
                transcript.insert_message(conn, session_id, {"role": "assistant", "content": reply})
            for write in settles:
                write(conn)
            # One UPDATE of the hot row, nothing loaded or encoded; a session reset since
            # `begin` is left alone (its own entry is not this turn's to settle).
            entries.settle_turn(
                conn,
                session_key,
                session_id,
                now.timestamp(),
                minute,
                usage,
                succeeded,
                token_factor,
            )
            journal.close_inbox(conn, list(event.inbox_ids), journal.DONE, now.timestamp())
            journal.end_turn(conn, session_key)
            if edits is not None:
                journal.end_stream(conn, session_key)
            ids = journal.record_outbound(
                conn,
                event.source,
                chunks,
                reply_to=event.reply_to,
                session_key=session_key,
                now=now.timestamp(),
                edits=edits or (),
            )
            if attachments:
                ids += journal.record_attachments(
                    conn,
                    event.source,
                    list(attachments),
                    reply_to=event.reply_to,
                    session_key=session_key,
                    now=now.timestamp(),
                )
            return ids, None if begin_next is None else begin_next(conn, next_inbox)

        # Waits out a full disk: the reply is sent only once it is recorded.
        ids, next_start = await self.store.write(tx, persist=True)
        crash_point("after_transcript_write")
        if next_start is not None:
            crash_point("after_turn_begin")
        return ids, next_start

    async def abandon(
        self,
        session_key: str,
        inbox_ids: list[int],
        notice: tuple[SessionSource, list[str]] | None = None,
    ) -> None:
        """A turn and its queue were cancelled (/stop, /new, the stuck-loop guard): forget
        the marker and rows. A `notice` (target, chunks) for the user is recorded in the
        same transaction, so a crash cannot drop the messages without telling them."""
        now = time.time()

        def tx(conn: sqlite3.Connection) -> None:
            # The marker's own messages too: one accepted together with its turn's start
            # may not have reached the caller's list yet.
            tool_calls.forget_marked(conn, session_key)
            marked = journal.end_turn(conn, session_key)
            journal.end_stream(conn, session_key)  # a stopped reply's partial stays as it is
            journal.close_inbox(conn, [*inbox_ids, *marked], journal.DROPPED, now)
            if notice is not None:
                target, chunks = notice
                journal.record_outbound(
                    conn, target, chunks, reply_to=None, session_key=session_key, now=now
                )

        await self.store.write(tx, dirty=False)

    async def set_aside(
        self,
        session_key: str,
        inbox_ids: list[int],
        target: SessionSource,
        notice: Callable[[list[dict[str, Any]]], list[str]],
        settle: Callable[[sqlite3.Connection, str], object] | None = None,
    ) -> tuple[list[int], list[str]]:
        """The stuck-loop guard gives up on the key's turn: its marker goes, its messages
        are set aside (kept for /retry, `set_aside_messages`), and `notice(their events)`
        is recorded for `target`, all in one transaction: a crash cannot set them aside
        without the user being told. `settle(conn, notice text)` runs in it too (an
        agent task's end). Returns the notice's delivery ids and chunks."""
        now = time.time()
        fence = self.fence

        def tx(conn: sqlite3.Connection) -> tuple[list[int], list[str]]:
            if fence is not None:
                fence(conn, session_key)
            tool_calls.forget_marked(conn, session_key)
            marked = journal.end_turn(conn, session_key)
            journal.end_stream(conn, session_key)
            ids = list(dict.fromkeys([*inbox_ids, *marked]))
            chunks = notice(journal.inbox_events(conn, ids))
            journal.close_inbox(conn, ids, journal.SET_ASIDE, now)
            delivery = journal.record_outbound(
                conn, target, chunks, reply_to=None, session_key=session_key, now=now
            )
            if settle is not None:
                settle(conn, "\n".join(chunks))
            return delivery, chunks

        return await self.store.write(tx, dirty=False)

    async def set_aside_messages(self, session_key: str) -> list[tuple[int, dict[str, Any]]]:
        """The key's set-aside messages (inbox id, event), oldest first."""
        return await self.store.read(lambda conn: journal.set_aside_rows(conn, session_key))

    def mark_running(self, session_key: str, user_message_id: int, running: bool) -> None:
        """Say in the key's marker whether its turn runs now (the stuck-loop guard counts
        a crash against a running turn only), in the next group commit, unawaited: only
        a turn that waited before its agent slot writes this."""
        fence = self.fence

        def tx(conn: sqlite3.Connection) -> None:
            if fence is not None:
                fence(conn, session_key)
            journal.mark_running(conn, session_key, user_message_id, running)

        self.store.write_later(tx, _log_failed_running_mark)

    async def mark_waiting(self, session_key: str) -> None:
        """The key's turn was stopped (a drain): its marker no longer says it runs."""
        await self.store.write(
            lambda conn: conn.execute(
                "UPDATE turns SET running = 0 WHERE session_key = ?", (session_key,)
            ),
            dirty=False,
        )

    async def answer_unbegun(
        self, session_key: str, event: MessageEvent, chunks: list[str]
    ) -> list[int]:
        """A turn that failed before its begin committed: settle its messages and record
        `chunks` (an error notice) as their answer, in one transaction. A resumed turn's
        marker (written by an earlier run) goes too. Returns the chunks' delivery ids."""
        now = time.time()
        fence = self.fence

        def tx(conn: sqlite3.Connection) -> list[int]:
            if fence is not None:
                fence(conn, session_key)
            if event.resume:
                tool_calls.forget_marked(conn, session_key)
                journal.end_turn(conn, session_key)
            journal.close_inbox(conn, list(event.inbox_ids), journal.DONE, now)
            return journal.record_outbound(
                conn,
                event.source,
                chunks,
                reply_to=event.reply_to,
                session_key=session_key,
                now=now,
            )

        return await self.store.write(tx, dirty=False)

    async def close_inbox(self, inbox_ids: list[int]) -> None:
        """Messages answered without a turn (a command another replica journaled)."""
        now = time.time()
        await self.store.write(
            lambda conn: journal.close_inbox(conn, inbox_ids, journal.DONE, now), dirty=False
        )

    async def abandon_inbox(self, inbox_ids: list[int]) -> None:
        """Messages refused after acceptance (queue full): settled, never replayed."""
        now = time.time()
        await self.store.write(
            lambda conn: journal.close_inbox(conn, inbox_ids, journal.DROPPED, now), dirty=False
        )

    async def record_reply(
        self,
        target: SessionSource,
        chunks: list[str],
        session_key: str | None,
        *,
        reply_to: str | None = None,
    ) -> list[int]:
        """Record chunks that answer no turn (command replies, notices)."""
        now = time.time()
        return await self.store.write(
            lambda conn: journal.record_outbound(
                conn, target, chunks, reply_to=reply_to, session_key=session_key, now=now
            ),
            dirty=False,
        )

    def mark_sent(self, delivery_id: int, platform_message_id: str | None) -> asyncio.Future[None]:
        """Acknowledge a sent chunk in the next group commit; the future settles once it
        is committed (`mark_sent_later` is the same without a future)."""
        marked = self.store.write_soon(
            self._mark_tx(delivery_id, platform_message_id), persist=True
        )
        marked.add_done_callback(_log_failed_mark)
        return marked

    def mark_sent_later(
        self,
        delivery_id: int,
        platform_message_id: str | None,
        done: Callable[[BaseException | None], object],
    ) -> None:
        """Acknowledge a sent chunk in the next group commit, without waiting for it and
        without a future: `done(None)` once committed, `done(error)` if it never is.

        Nothing after a send depends on the mark, so the turn does not wait a commit for
        it. A crash before it commits leaves the chunk pending and re-sent once at start:
        the window every platform without an idempotency key has between its
        acknowledgement and our mark, one commit (about a millisecond) wide."""

        def settled(error: BaseException | None) -> None:
            if error is not None:
                _log_failed_mark_error(error)
            done(error)

        # Persistent: a mark the disk refused would leave a delivered chunk to be re-sent.
        self.store.write_later(
            self._mark_tx(delivery_id, platform_message_id), settled, persist=True
        )

    @staticmethod
    def _mark_tx(
        delivery_id: int, platform_message_id: str | None
    ) -> Callable[[sqlite3.Connection], None]:
        now = time.time()
        return lambda conn: journal.mark_sent(conn, delivery_id, platform_message_id, now)

    def save_stream(self, session_key: str, message_ids: Sequence[str]) -> asyncio.Future[None]:
        """Remember the messages a streamed reply is shown in, in the next
        group commit: a turn re-run after a crash edits them instead of sending anew."""
        now, ids = time.time(), list(message_ids)
        saved = self.store.write_soon(
            lambda conn: journal.save_stream(conn, session_key, ids, now), persist=True
        )
        saved.add_done_callback(_log_failed_mark)
        return saved

    async def stream_of(self, session_key: str) -> list[str]:
        """The messages an interrupted turn's streamed reply was shown in ([]: none)."""
        return await self.store.read(lambda conn: journal.get_stream(conn, session_key))

    async def last_reply_seq(self, platform: str, chat_id: str) -> int:
        return await self.store.read(lambda conn: journal.last_reply_seq(conn, platform, chat_id))

    async def open_inbox(self) -> list[dict[str, Any]]:
        return await self.store.read(journal.open_inbox)

    async def open_turns(self) -> list[dict[str, Any]]:
        return await self.store.read(journal.open_turns)

    async def pending_outbound(self, min_age_seconds: float = 0) -> list[dict[str, Any]]:
        before = time.time() - min_age_seconds
        # On the writer, in line with the marks: the reader thread's snapshot could
        # predate a mark whose chunk's claim (Delivery._sending) is already released.
        return await self.store.write(
            lambda conn: journal.pending_outbound(conn, before), dirty=False
        )

    async def replies_after(
        self, platform: str, chat_id: str, after: int, limit: int
    ) -> list[dict[str, Any]]:
        return await self.store.read(
            lambda conn: journal.replies_after(conn, platform, chat_id, after, limit)
        )

    async def expire(self, max_age_days: float) -> int:
        """Forget finished inbox rows (their dedup window) and old sent replies."""
        before = (datetime.now(UTC) - timedelta(days=max_age_days)).timestamp()
        total = 0
        for expire in (journal.expire_inbox, journal.expire_outbound):
            while True:  # page by page (journal.EXPIRE_PAGE): ends at the first short page
                count = await self.store.write(
                    lambda conn, expire=expire: expire(conn, before, journal.EXPIRE_PAGE),
                    dirty=False,
                )
                total += count
                if count < journal.EXPIRE_PAGE:
                    break
        return total


def _encoded(event: MessageEvent) -> str:
    return journal.encode_event(event.to_dict())


def _log_failed_mark(marked: asyncio.Future[None]) -> None:
    if not marked.cancelled() and (exc := marked.exception()) is not None:
        _log_failed_mark_error(exc)


def _log_failed_running_mark(error: BaseException | None) -> None:
    if error is not None:
        log.warning("turn_running_mark_failed", error=str(error))


def _log_failed_mark_error(exc: BaseException) -> None:
    # The chunk stays pending and is re-sent at the next start.
    log.error("ledger_mark_failed", error=str(exc))
