"""The line a reply opens with when a rolling summary condensed messages the user was
not told about yet (`agent.context.notify`).

What is owed is read with the turn's context (`Loaded.condensed` less `Loaded.told`,
the summary checkpoint's counts, after the turn's own catch-up condensed what did not
fit), and marked told in the transaction that records the reply (`told_tx`): a reply
recorded carries the notice, one that is not leaves it owed to the next, across a
restart too. /compress marks what it condenses told itself (its answer says so).
With the notice off the reply's finish marks them told all the same.

A summary condenses in chunks (`gateway.context.strategy.catch_up_start`, and the
background summary's `target_ratio`), so a notice comes once per many turns.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gateway.context.strategy import Loaded
from gateway.store import summary_checkpoints


def owed(loaded: Loaded) -> int:
    """Condensed messages the user was not told about (0: no notice)."""
    return max(0, loaded.condensed - loaded.told)


_NOTICE = re.compile(
    r"\(Earlier messages were condensed into a summary: ([\d,]+) messages?\.\)\n\n"
)


def condense_notice(count: int) -> str:
    """The line put before a reply after a summary condensed `count` more messages."""
    noun = "message" if count == 1 else "messages"
    return f"(Earlier messages were condensed into a summary: {count:,} {noun}.)"


def told_tx(session_id: str, loaded: Loaded) -> Callable[[Any], object]:
    """Marks the notice for `loaded`'s summary told, in the reply's transaction."""
    condensed = loaded.condensed
    return lambda conn: summary_checkpoints.mark_told(conn, session_id, condensed)


def split(reply: str) -> tuple[int, str]:
    """A reply's condense notice (the messages it counts; 0 without one) and the rest:
    for clients that check what a reply says (tests, benchmarks)."""
    match = _NOTICE.match(reply)
    if match is None:
        return 0, reply
    return int(match.group(1).replace(",", "")), reply[match.end() :]
