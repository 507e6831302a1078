"""The PostgreSQL store alone, without daemons or HTTP: wall time and this process's CPU
per write and per read, with many writers at once (so the group commit batches them),
through the public `SessionStore` calls a turn makes.

    .venv/bin/python scripts/bench_pg_store.py --writers 32 --rounds 40

Each of `--writers` sessions does `--rounds` rounds of: append a user message, append a
reply (each append reads its new row's id back), load the transcript. All writers run
at once on one event loop, so writes queued in the same pass share a commit. A schema of
the run's own is made on the server (`--dsn`, else $HERMES_TEST_PG_DSN, else the local
trust-auth server) and dropped at the end. CPU is `time.process_time()` of this process
(the gateway's side: PostgreSQL's backends are not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import GatewayConfig
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from scripts.bench_replicas import DEFAULT_DSN, pg_schema


def source(i: int) -> SessionSource:
    return SessionSource(platform=Platform.TELEGRAM, chat_id=str(i), chat_type="dm", user_id=str(i))


async def run(dsn: str, writers: int, rounds: int) -> dict[str, float]:
    config = GatewayConfig.model_validate(
        {"timezone": "UTC", "storage": {"backend": "postgres", "dsn": dsn}}
    )
    with tempfile.TemporaryDirectory(prefix="bench-pg-store-") as home:
        store = SessionStore(home, config)
        await store.open()
        try:
            entries = [await store.get_or_create_session(source(i)) for i in range(writers)]

            async def writer(session_id: str) -> None:
                for n in range(rounds):
                    await store.append_to_transcript(
                        session_id, {"role": "user", "content": f"m{n}"}
                    )
                    await store.append_to_transcript(
                        session_id, {"role": "assistant", "content": f"r{n}"}
                    )
                    await store.load_transcript(session_id)

            wall, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(writer(e.session_id) for e in entries))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            await store.close()
    rounds_done = writers * rounds
    return {
        "rounds": rounds_done,
        "rounds_per_s": rounds_done / wall,
        "cpu_us_per_round": 1e6 * cpu / rounds_done,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=32, help="sessions writing at once")
    parser.add_argument("--rounds", type=int, default=40, help="rounds per session")
    parser.add_argument("--dsn", default=os.environ.get("HERMES_TEST_PG_DSN") or DEFAULT_DSN)
    args = parser.parse_args(argv)
    if not 1 <= args.writers <= 1000 or not 1 <= args.rounds <= 100_000:
        parser.error("--writers must be 1..1000, --rounds 1..100000")
    with pg_schema(args.dsn) as dsn:
        result = asyncio.run(run(dsn, args.writers, args.rounds))
    print(
        f"{args.writers} writers x {args.rounds} rounds (2 appends + 1 load each):"
        f" {result['rounds_per_s']:.0f} rounds/s, {result['cpu_us_per_round']:.0f} us CPU"
        f" per round, {result['wall_s']:.2f} s; load average"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
