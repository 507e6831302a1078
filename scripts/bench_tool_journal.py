"""What the tool-call journal adds to a tool call: one round of one call (a tool that
does nothing) through `TurnTools.run_round`, journaled (the round's row, the call's
start and its result: three awaited commits) and not (a turn without a user row
journals nothing), on a real store.

    .venv/bin/python scripts/bench_tool_journal.py [--rounds 2000] [--postgres DSN]

Prints the median and p99 of a round each way and their difference: the journal's cost
per round of one call. One chat at a time (pure latency, no group commit sharing).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog
from pydantic import BaseModel

from adapters.base import MessageEvent
from config import GatewayConfig
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from gateway.store.turnlog import TurnLog, TurnStart
from gateway.tools.registry import Tool, Toolbox, TurnScope
from scripts.harness import percentile

SOURCE = SessionSource(platform=Platform.LOCAL, chat_id="bench", user_id="u1")


class _NoArgs(BaseModel):
    pass


async def _nothing(scope: TurnScope, args: _NoArgs) -> dict[str, bool]:
    return {"ok": True}


async def measure(
    store: SessionStore, start: TurnStart, rounds: int, offset: int
) -> dict[str, list[float]]:
    key = store.session_key_for(SOURCE)
    assert start.user_row is not None
    box = Toolbox([Tool("nothing", "does nothing", _NoArgs, _nothing)], ["nothing"])
    call = {"id": "c", "type": "function", "function": {"name": "nothing", "arguments": "{}"}}
    timings: dict[str, list[float]] = {"journaled": [], "plain": []}
    for number in range(rounds):
        for mode in ("journaled", "plain"):
            # A new turn's tools each round, as a turn would have: its seqs start at 0,
            # so each journaled round writes the rows of a turn of its own.
            row = start.user_row + offset + number + 1 if mode == "journaled" else None
            tools = box.bind(
                TurnScope(store, None, key, start.entry.session_id, SOURCE, "main", user_row=row)
            )
            began = time.perf_counter()
            await tools.run_round(None, [call])
            timings[mode].append(time.perf_counter() - began)
    return timings


async def begin_turn(store: SessionStore) -> TurnStart:
    """A turn of the bench's chat, begun as the runner begins one (its user row is the
    turn, as the tool-call journal knows it)."""
    key = store.session_key_for(SOURCE)
    event = MessageEvent(source=SOURCE, text="go", message_id="b1")
    start = await TurnLog(store).begin(event, key, "go")
    assert start.user_row is not None
    return start


async def main_async(rounds: int, dsn: str | None) -> None:
    data = {"timezone": "UTC"}
    if dsn:
        data["storage"] = {"backend": "postgres", "dsn": dsn}  # type: ignore[assignment]
    config = GatewayConfig.model_validate(data)
    with tempfile.TemporaryDirectory(prefix="hermes-bench-journal-") as tmp:
        async with SessionStore(Path(tmp) / "sessions", config) as store:
            start = await begin_turn(store)
            await measure(store, start, min(rounds, 200), 0)  # warm-up
            timings = await measure(store, start, rounds, rounds + 200)
    medians = {mode: statistics.median(values) for mode, values in timings.items()}
    for mode, values in timings.items():
        print(
            f"{mode:>9}: median {medians[mode] * 1e6:7.0f} us"
            f"  p99 {percentile(values, 99) * 1e6:7.0f} us"
        )
    print(
        f"journal per round of one call: {(medians['journaled'] - medians['plain']) * 1e6:.0f} us"
    )


def main() -> None:
    # The per-call log line is not what is measured, and would flood the output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--postgres", metavar="DSN")
    args = parser.parse_args()
    asyncio.run(main_async(args.rounds, args.postgres))


if __name__ == "__main__":
    main()
