"""The line a reply opens with when a rolling summary condensed messages the user was
not told about yet (`agent.context.notify`).

What is owed is read with the turn's context (`Loaded.condensed` less `Loaded.told`,
the summary checkpoint's counts, after the turn's own catch-up condensed what did not
fit), and marked told in the transaction that records the reply (`told_tx`): a reply
recorded carries the notice, one that is not leaves it owed to the next, across a
restart too. /compress marks what it condenses told itself (its answer says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.context.strategy import Loaded
from gateway.store import summary_checkpoints


def owed(loaded: Loaded) -> int:
    """Condensed messages the user was not told about (0: no notice)."""
    return max(0, loaded.condensed - loaded.told)


def condense_notice(count: int) -> str:
    """The line put before a reply after a summary condensed `count` more messages."""
    noun = "message" if count == 1 else "messages"
    return f"(Earlier messages were condensed into a summary: {count:,} {noun}.)"


def told_tx(session_id: str, loaded: Loaded) -> Callable[[Any], object]:
    """Marks the notice for `loaded`'s summary told, in the reply's transaction."""
    condensed = loaded.condensed
    return lambda conn: summary_checkpoints.mark_told(conn, session_id, condensed)
