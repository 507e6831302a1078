"""The seed's public `SessionStore` calls against plain sqlite3 doing the same rows.

For each size, a fresh store on disk (production settings) is filled with N sessions,
and the sessions the run visits get a few transcript messages first. Then, on random
keys, one call at a time:

- `get_or_create_session(source)`: the entry read and touched (its hot row rewritten);
- `append_to_transcript(session_id, message)`: one message added;
- `load_transcript(session_id)`: the session's messages read back.

The same visits are then made by plain sqlite3 on a copy of the same database file
(same schema and triggers, same pragmas: WAL, synchronous=NORMAL, foreign keys, cache
size), each call one transaction committed on its own, as the API's are one at a time:
the entry's row read and its `updated_at` and `active_minute` written; the session
checked and the message inserted as JSON; the session's messages selected and decoded.

CPU per call is process CPU (every thread: the API's background indexer, mirror and
checkpointer count too, on whichever call they overlap), taken around each call; the
API's share on the event loop's thread is shown beside it. A ratio is one run's API
figure over the same run's plain one. Each size runs `--runs` times, the two
sides alternating and the order swapped each run; min / median / max over the runs.

    .venv/bin/python scripts/bench_store_api.py                    # 10k and 100k sessions
    .venv/bin/python scripts/bench_store_api.py --sizes 10000 --visits 2000 --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import GatewayConfig
from gateway.store.checkpoint import SAFETY_NET_PAGES, WAL_SIZE_LIMIT
from gateway.store.session_store import SessionStore
from scripts.bench_store import fill, source_for

CALLS = ("get_or_create_session", "append_to_transcript", "load_transcript")
SEEDED_MESSAGES = 8  # messages in each visited session before the timed visits
Timings = dict[str, list[float]]


def _config() -> GatewayConfig:
    return GatewayConfig.model_validate({"timezone": "UTC", "session_reset": {"mode": "none"}})


def _message(i: int) -> dict[str, str]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i}"}


async def prepare(directory: Path, n: int, visited: list[int]) -> dict[int, str]:
    """Fill a store with `n` sessions and seed the visited ones with messages; returns
    the session id of every visited key."""
    async with SessionStore(directory, _config()) as store:
        await fill(store, n)
        ids: dict[int, str] = {}
        for i in sorted(set(visited)):
            entry = await store.get_or_create_session(source_for(i))
            ids[i] = entry.session_id
        keys = list(ids.values())
        for m in range(SEEDED_MESSAGES):
            await asyncio.gather(*(store.append_to_transcript(s, _message(m)) for s in keys))
    return ids


async def run_api(directory: Path, visited: list[int]) -> tuple[Timings, Timings]:
    """Process CPU per call, and the event loop's thread's share of it."""
    timings: Timings = {call: [] for call in CALLS}
    on_loop: Timings = {call: [] for call in CALLS}
    async with SessionStore(directory, _config()) as store:
        for number, i in enumerate(visited):
            source = source_for(i)
            marks = [(time.process_time(), time.thread_time())]
            entry = await store.get_or_create_session(source)
            marks.append((time.process_time(), time.thread_time()))
            await store.append_to_transcript(entry.session_id, _message(number))
            marks.append((time.process_time(), time.thread_time()))
            messages = await store.load_transcript(entry.session_id)
            marks.append((time.process_time(), time.thread_time()))
            for call, before, after in zip(CALLS, marks, marks[1:], strict=False):
                timings[call].append(after[0] - before[0])
                on_loop[call].append(after[1] - before[1])
            assert messages, "a visited session has messages"
    return timings, on_loop


def _connect(path: Path) -> sqlite3.Connection:
    """What the store's writer sets (gateway.store.db._open_writer), nothing more."""
    conn = sqlite3.connect(path, isolation_level=None)
    for pragma in (
        "journal_mode=WAL",
        "synchronous=NORMAL",
        "foreign_keys=ON",
        "busy_timeout=5000",
        "cache_size=-16384",
        f"wal_autocheckpoint={SAFETY_NET_PAGES}",
        f"journal_size_limit={WAL_SIZE_LIMIT}",
    ):
        conn.execute(f"PRAGMA {pragma}")
    return conn


def run_plain(path: Path, visited: list[int], keys: dict[int, str]) -> Timings:
    cpu = time.process_time
    timings: Timings = {call: [] for call in CALLS}
    got, appended, loaded = (timings[call] for call in CALLS)
    conn = _connect(path)
    execute = conn.execute
    try:
        for number, i in enumerate(visited):
            key = keys[i]
            started = cpu()
            execute("BEGIN IMMEDIATE")
            row = execute(
                "SELECT h.*, d.* FROM session_entries h LEFT JOIN session_entry_docs d"
                " ON d.session_key = h.session_key WHERE h.session_key = ?",
                (key,),
            ).fetchone()
            session_id, now = row[1], time.time()
            execute(
                "UPDATE session_entries SET updated_at = ?, active_minute = ?"
                " WHERE session_key = ?",
                (now, int(now // 60), key),
            )
            execute("COMMIT")
            middle = cpu()
            message = _message(number)
            execute("BEGIN IMMEDIATE")
            execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            execute(
                "INSERT INTO messages (session_id, role, content, message, created_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (
                    session_id,
                    message["role"],
                    message["content"],
                    orjson.dumps(message).decode(),
                    time.time(),
                ),
            )
            execute("COMMIT")
            third = cpu()
            messages = [
                orjson.loads(text)
                for (text,) in execute(
                    "SELECT message FROM messages WHERE session_id = ? AND active = 1 ORDER BY id",
                    (session_id,),
                )
            ]
            ended = cpu()
            got.append(middle - started)
            appended.append(third - middle)
            loaded.append(ended - third)
            assert messages, "a visited session has messages"
    finally:
        conn.close()
    return timings


def _session_keys(visited: list[int], store: SessionStore) -> dict[int, str]:
    return {i: store.session_key_for(source_for(i)) for i in set(visited)}


def _per_call_us(timings: Timings) -> dict[str, float]:
    return {call: statistics.fmean(values) * 1e6 for call, values in timings.items()}


def bench_size(n: int, visits: int, runs: int, seed: int) -> dict[str, dict[str, list[float]]]:
    """{"api"|"plain": {call: [us per call, one per run]}}."""
    rng = random.Random(seed)
    results: dict[str, dict[str, list[float]]] = {
        side: {call: [] for call in CALLS} for side in ("api", "api_loop", "plain")
    }
    with tempfile.TemporaryDirectory(prefix="bench-store-api-") as tmp:
        base = Path(tmp) / "base"
        visited = [rng.randrange(n) for _ in range(visits)]
        asyncio.run(prepare(base, n, visited))
        keys = _session_keys(visited, SessionStore(base, _config()))
        for run in range(runs):
            order: list[str] = ["api", "plain"] if run % 2 == 0 else ["plain", "api"]
            for side in order:
                copy = Path(tmp) / f"{side}-{run}"
                shutil.copytree(base, copy)
                measured: dict[str, Timings] = {}
                if side == "api":
                    timings, on_loop = asyncio.run(run_api(copy, visited))
                    measured = {"api": timings, "api_loop": on_loop}
                else:
                    measured = {"plain": run_plain(copy / "state.db", visited, keys)}
                for name, timings in measured.items():
                    for call, us in _per_call_us(timings).items():
                        results[name][call].append(us)
                shutil.rmtree(copy)
    return results


def _spread(values: list[float]) -> str:
    return f"{min(values):,.0f} / {statistics.median(values):,.0f} / {max(values):,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--visits", type=int, default=3_000, help="timed visits per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, ", end="")
    print(f"visits={args.visits}, runs={args.runs}; CPU us per call, min / median / max")
    print(
        f"{'sessions':>9} {'call':<22} {'API':>17} {'of it, loop thread':>19}"
        f" {'plain sqlite3':>15} {'API / plain':>18}"
    )
    for n in args.sizes:
        results = bench_size(n, args.visits, args.runs, args.seed)
        for call in CALLS:
            api, plain = results["api"][call], results["plain"][call]
            ratios = [a / p for a, p in zip(api, plain, strict=True)]
            print(
                f"{n:>9} {call:<22} {_spread(api):>17} {_spread(results['api_loop'][call]):>19}"
                f" {_spread(plain):>15}"
                f" {min(ratios):>5.1f} / {statistics.median(ratios):.1f} / {max(ratios):.1f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
