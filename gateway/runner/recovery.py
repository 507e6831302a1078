"""Start-up recovery (seed section 7) on top of the exact turn markers of the journal.

    .clean_shutdown present?  yes: delete it, skip suspension
                              no:  suspend_recently_active(120), then the stuck-loop check
    interrupted turns (markers) -> resume_pending, re-run once adapters are up
    accepted, unanswered messages -> re-queued in acceptance order (a lane command
                                     left unanswered, e.g. /compress, runs again)
    recorded, unsent reply chunks -> sent once

`prepare()` decides all of it from what is on disk before the adapters start, and
writes nothing; `mark()` writes it once they are all up, then `resume()` re-runs. A
start that fails in between (a port taken) leaves the sessions and the markers as it
found them, for the next start to decide again.

Stuck loop: `restart_counts.json` counts, per session key, the consecutive unclean
starts that found the same turn of that key running (a busy chat whose different turns
happen to be running at crashes is not a loop). Running means its work had begun (its
marker's `running`, set when it takes its agent slot); a turn that only waited (behind
another turn, for a slot, or resumed and not reached before the next crash) is neither
counted nor cleared. At 3 the session is suspended, its turn set aside, and the user
told how many messages that was, with the start of each; /retry runs them again (once,
as one turn). A successful turn clears its count.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from gateway.domain.agent_tasks import TaskState
from gateway.domain.command_syntax import MessageKind
from gateway.domain.events import MessageEvent
from gateway.domain.session import Platform, SessionSource, schedule_id_of_key
from gateway.runner.ports import RecoveryHost
from gateway.store import agent_tasks, journal
from gateway.util.fsutil import atomic_write_bytes

log = structlog.get_logger("gateway.recovery")

CLEAN_SHUTDOWN = ".clean_shutdown"
RESTART_COUNTS = "restart_counts.json"
STUCK_LOOP_THRESHOLD = 3
RECENTLY_ACTIVE_SECONDS = 120
#: how every stuck-loop notice begins (`stuck_notice`)
STUCK_NOTICE_START = "I was restarted several times while answering"
QUOTE_CHARS = 60  # of each set-aside message, quoted in the notice
MAX_QUOTED = 5  # messages quoted; the rest are counted


def stuck_notice(events: Sequence[dict[str, Any]], session_key: str = "") -> str:
    """What the user is told when the guard sets a turn aside: how many messages, the
    start of each (at most MAX_QUOTED of them), and that /retry runs them again.
    `events`: the turn's messages as the inbox recorded them, oldest first. A scheduled
    job's run (`session_key` is its session) is not the chat's to /retry: the notice
    names the task and `/schedule run`."""
    schedule_id = schedule_id_of_key(session_key)
    if schedule_id is not None:
        return (
            f"{STUCK_NOTICE_START} scheduled task {schedule_id}, so I stopped trying and set"
            f" this run aside. /schedule run {schedule_id} runs it again now."
        )
    count = len(events)
    them = "it" if count == 1 else "them"
    what = "your message" if count == 1 else f"your {count} messages"
    lines = [
        f"{STUCK_NOTICE_START} {what}, so I stopped trying, set {them} aside and started "
        "a fresh session. Set aside:"
    ]
    lines += [f"- {_quote(data)}" for data in events[:MAX_QUOTED]]
    if count > MAX_QUOTED:
        lines.append(f"and {count - MAX_QUOTED} more")
    lines.append(f"Send /retry to run {them} again (once, as one message).")
    return "\n".join(lines)


def _quote(data: dict[str, Any]) -> str:
    text = " ".join(str(data.get("text") or "").split())
    if not text:
        return "(a file)" if data.get("media") else "(an empty message)"
    if len(text) > QUOTE_CHARS:
        text = text[:QUOTE_CHARS].rstrip() + "…"
    return f'"{text}"'


class Recovery:
    def __init__(self, runner: RecoveryHost) -> None:
        self.runner = runner
        self.clean_marker = runner.home / CLEAN_SHUTDOWN
        self.counts_path = runner.home / RESTART_COUNTS
        self.counts: dict[str, dict[str, int]] = {}  # key -> {"turn": id, "count": n}
        self.was_clean = True
        self.marked = False  # set once start-up consumed `.clean_shutdown` (see `mark`)
        self._markers: list[dict[str, Any]] = []
        self._stuck: list[dict[str, Any]] = []
        self._backlog: list[dict[str, Any]] = []

    async def prepare(self) -> None:
        """Before the adapters start: read what the last run left and decide what to do.

        Nothing is written here. The marks wait for `mark()`, after every adapter is up:
        a start that fails before (a port taken, a platform refusing its token) leaves
        the sessions, `.clean_shutdown` and `restart_counts.json` as it found them.
        """
        store, turnlog = self.runner.store, self.runner.turnlog
        # A home that had no state yet is a first start, not a crash.
        self.was_clean = self.clean_marker.exists() or store.created
        self.counts = _read_counts(self.counts_path)
        markers = await turnlog.open_turns()
        # Snapshot the backlog now, before any adapter can accept a new message: those
        # are held by the runner and must not be queued a second time from here. The
        # messages of a turn (resumed, or dropped as stuck) are not backlog either.
        in_turns = {i for marker in markers for i in marker["inbox_ids"]}
        self._backlog = [r for r in await turnlog.open_inbox() if r["id"] not in in_turns]
        if not self.was_clean:
            # Consecutive: a key not in flight at this crash, or in flight with another
            # turn, starts counting again.
            counts = {}
            for marker in markers:
                key, turn = marker["session_key"], marker["user_message_id"] or 0
                before = self.counts.get(key, {})
                same = before.get("turn") == turn
                if not marker["running"]:
                    # It waited and did nothing: no evidence either way.
                    if same:
                        counts[key] = before
                    continue
                counts[key] = {"turn": turn, "count": before.get("count", 0) + 1 if same else 1}
            self.counts = counts
            stuck = {k for k, c in counts.items() if c["count"] >= STUCK_LOOP_THRESHOLD}
            self._stuck = [m for m in markers if m["session_key"] in stuck]
            markers = [m for m in markers if m["session_key"] not in stuck]
        self._markers = markers

    async def mark(self) -> None:
        """Write what `prepare` decided: once the adapters are up, before anything runs."""
        store = self.runner.store
        self.clean_marker.unlink(missing_ok=True)
        self.marked = True
        if not self.was_clean:
            marked = await store.suspend_recently_active(RECENTLY_ACTIVE_SECONDS)
            for marker in self._stuck:
                # The notice is recorded with the set-aside (one transaction) and sent
                # by resume() with the other pending replies: a crash in between cannot
                # leave the messages set aside and the user untold.
                await store.suspend_session(marker["session_key"])
                await self.set_aside(marker)
                self.counts.pop(marker["session_key"], None)
            self._write_counts()
            log.warning(
                "unclean_start",
                recently_active_marked=marked,
                interrupted_turns=len(self._markers),
                stuck_sessions_suspended=len(self._stuck),
            )
        if self._markers:
            # Nothing of the last process runs any more: each turn is running again
            # only once this one reaches its agent slot.
            await store.write(journal.all_waiting, dirty=False)
        for marker in self._markers:
            entry = await store.get_entry(marker["session_key"])
            if entry is not None and not entry.resume_pending:
                await store.mark_resume_pending(marker["session_key"], "restart_interrupted")

    async def set_aside(self, marker: dict[str, Any]) -> tuple[list[int], list[str]]:
        """Give up on a stuck turn: its messages set aside for /retry and the notice
        recorded, in one transaction. Returns the notice's delivery ids and chunks."""
        source = MessageEvent.from_dict(marker["event"]).source
        split = self.runner.split_reply
        return await self.runner.turnlog.set_aside(
            marker["session_key"],
            marker["inbox_ids"],
            source,
            lambda events: split(
                source, stuck_notice(events or [marker["event"]], marker["session_key"])
            ),
            task_failure(source),
        )

    async def resume(self) -> int:
        """After `mark()`: resend, re-run and re-queue. Returns events queued."""
        runner = self.runner
        await runner.resend_pending()  # the stuck-loop notices among them
        queued = 0
        for marker in self._markers:
            event = MessageEvent.from_dict(
                marker["event"],
                inbox_ids=tuple(marker["inbox_ids"]),
                resume=True,
                synthetic=True,
            )
            await runner.submit(marker["session_key"], event)
            queued += 1
        for row in self._backlog:
            event = MessageEvent.from_dict(row["event"], inbox_ids=(row["id"],))
            await runner.requeue(row["session_key"], event, MessageKind(row["kind"]))
            queued += 1
        if queued or self._stuck:
            log.info("recovery_resumed", turns=len(self._markers), queued=queued)
        self._markers, self._stuck, self._backlog = [], [], []
        return queued

    def turn_succeeded(self, session_key: str) -> None:
        if self.counts.pop(session_key, None) is not None:
            self._write_counts()

    def write_clean_shutdown(self) -> None:
        atomic_write_bytes(self.clean_marker, b"clean shutdown\n")

    def _write_counts(self) -> None:
        data = json.dumps(self.counts, indent=1, sort_keys=True).encode()
        atomic_write_bytes(self.counts_path, data)


def _read_counts(path: Path) -> dict[str, dict[str, int]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as exc:
        log.warning("restart_counts_unreadable", path=str(path), error=str(exc))
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(key): {"turn": int(value.get("turn", 0)), "count": int(value.get("count", 0))}
        for key, value in data.items()
        if isinstance(value, dict)
    }


def task_failure(source: SessionSource) -> Callable[[Any, str], None] | None:
    """For a turn given up on: the write that fails its agent task with the notice
    (None: not an agent task's turn)."""
    if source.platform is not Platform.A2A or not source.message_id:
        return None
    return partial(_fail_task, source.message_id)


def _fail_task(task_id: str, conn: Any, notice: str) -> None:
    agent_tasks.settle(conn, task_id, TaskState.FAILED, time.time(), error=notice)
