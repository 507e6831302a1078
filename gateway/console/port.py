"""What the console needs of the running gateway, and nothing more: the runner side
implements it (`gateway.runner.console_desk.ConsoleDesk`), the console only calls it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class ConsoleRefused(Exception):
    """An action the gateway would not do; the message says why, for the operator."""


@dataclass(frozen=True, slots=True)
class SessionQuery:
    """The session listing's filters; None or empty: no filter. `user` and `text` match
    as case-blind substrings (`text`: a session's title or key)."""

    agent: str | None = None
    platform: str | None = None
    user: str | None = None
    text: str | None = None


class ConsolePort(Protocol):
    async def overview(self) -> dict[str, Any]:
        """The status snapshot (`status_snapshot()`) with `turns_total` (a counter) and,
        on PostgreSQL, `replicas`: every replica holding a lease (owner, sessions_held,
        leader_of, this)."""
        ...

    async def upcoming_schedules(self, limit: int) -> list[dict[str, Any]]: ...

    async def sessions_page(
        self, query: SessionQuery, after: str | None, limit: int
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of session entries in key order and the key the next page starts
        after (None on the last)."""
        ...

    async def search(self, text: str, limit: int) -> list[dict[str, Any]]: ...

    async def session(self, session_id: str, after: int, limit: int) -> dict[str, Any] | None:
        """One session's row, counters (`counts`) and a page of messages; None if unknown."""
        ...

    async def export(self, session_id: str, limit: int) -> dict[str, Any] | None:
        """The session and its first `limit` messages (`sessions export`'s shape)."""
        ...

    async def delete_session(self, session_id: str) -> dict[str, Any]: ...

    async def schedules(self) -> list[dict[str, Any]]: ...

    async def schedule_runs(self, schedule_id: str) -> list[dict[str, Any]]: ...

    async def change_schedule(self, schedule_id: str, action: str) -> str:
        """`pause`, `resume`, `run` or `remove`; the outcome in words, ConsoleRefused
        when it was not done."""
        ...

    async def notes(self, platform: str, user_id: str) -> list[dict[str, Any]]: ...

    async def delete_note(self, platform: str, user_id: str, note_id: str) -> bool: ...

    async def pairing_requests(self) -> list[dict[str, Any]]: ...

    async def decide_pairing(self, platform: str, code: str, approve: bool) -> bool:
        """Approve or deny a pending code; False when no such code is pending."""
        ...
