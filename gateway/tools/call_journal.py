"""One turn's tool-call journal, as its tools write and read it (the rows:
`gateway.store.tool_calls`).

Every write that comes before a side effect (a round, a call about to run) is awaited:
committed before the call runs, so a crash after it finds the call recorded. A round's
row is held until its first call is recorded and committed with it: one commit fewer
per round, and nothing of the round has run before then. A turn
begun fresh has no rows to read, so only a resumed turn reads; a turn that never
recorded anything writes nothing at its finish either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.store import codec, tool_calls
from gateway.store.tool_calls import Row
from gateway.util.faults import crash_point

Fence = Callable[[Any, str], None]


class CallJournal:
    """The record of one turn: (session_id, user_row), on `store`."""

    def __init__(
        self,
        store: Any,  # gateway.store.session_store.SessionStore
        session_key: str,
        session_id: str,
        user_row: int,
        *,
        resumed: bool,
        fence: Fence | None = None,
    ) -> None:
        self._store = store
        self._key = session_key
        self._turn = (session_id, user_row)
        self._fence = fence
        self._rows: list[Row] | None = None if resumed else []
        self._next_seq = 0
        self._held: list[Row] = []  # a round's row, written with its first call
        self.touched = resumed  # rows may exist: the finish forgets them

    async def recorded(self) -> list[Row]:
        """What an earlier run of this turn recorded, oldest first ([]: none)."""
        if self._rows is None:
            session_id, user_row = self._turn
            self._rows = await self._store.read(
                lambda conn: tool_calls.load(conn, session_id, user_row)
            )
            self._next_seq = max((row.seq for row in self._rows), default=-1) + 1
        return self._rows

    def direct(self, ordinal: int) -> Row | None:
        """The recorded `Tools.call` of this ordinal (after `recorded()`)."""
        for row in self._rows or ():
            if row.kind == tool_calls.DIRECT and row.call_id == str(ordinal):
                return row
        return None

    async def round(self, message: dict[str, Any]) -> None:
        """An assistant message with tool calls, recorded with the first of them (or by
        `flush` when none is)."""
        if self._rows is None:  # resumed, and recorded() not asked yet: seqs follow its rows
            await self.recorded()
        self._held.append(self._row(tool_calls.ROUND, None, None, codec.dumps(message), None))

    async def flush(self) -> None:
        """Write a held round whose calls recorded nothing (none was valid)."""
        if self._held:
            await self._write_rows([])

    async def start(self, kind: str, call_id: str, tool: str, arguments: str) -> int:
        """A call about to run; returns its seq for `finish`."""
        seq = await self._insert(kind, call_id, tool, arguments, None)
        crash_point("tool_call_in_flight")
        return seq

    async def settled(
        self, kind: str, call_id: str, tool: str, arguments: str, result: str
    ) -> None:
        """A call answered without running (refused by the user): its answer is final."""
        await self._insert(kind, call_id, tool, arguments, result)
        crash_point("after_tool_result")

    async def finish(self, seq: int, result: str) -> None:
        session_id, user_row = self._turn
        await self._write(lambda conn: tool_calls.complete(conn, session_id, user_row, seq, result))
        crash_point("after_tool_result")

    def forget(self) -> Callable[[Any], object] | None:
        """The finish transaction's write that removes the record (None: nothing to)."""
        if not self.touched:
            return None
        session_id, user_row = self._turn
        return lambda conn: tool_calls.forget(conn, session_id, user_row)

    async def _insert(
        self, kind: str, call_id: str | None, tool: str | None, payload: str, result: str | None
    ) -> int:
        if self._rows is None:  # resumed, and recorded() not asked yet: seqs follow its rows
            await self.recorded()
        row = self._row(kind, call_id, tool, payload, result)
        await self._write_rows([row])
        return row.seq

    def _row(
        self, kind: str, call_id: str | None, tool: str | None, payload: str, result: str | None
    ) -> Row:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return Row(seq, kind, call_id, tool, payload, result)

    async def _write_rows(self, rows: list[Row]) -> None:
        rows, self._held = [*self._held, *rows], []
        session_id, user_row = self._turn
        self.touched = True

        def insert(conn: Any) -> None:
            for row in rows:
                tool_calls.record(conn, session_id, user_row, row)

        await self._write(insert)

    async def _write(self, fn: Callable[[Any], object]) -> None:
        fence, key = self._fence, self._key

        def tx(conn: Any) -> None:
            if fence is not None:  # a replica that lost the session starts no call
                fence(conn, key)
            fn(conn)

        # persist: the turn is acknowledged work; a full disk delays the call, never
        # lets it run unrecorded.
        await self._store.write(tx, dirty=False, persist=True)
