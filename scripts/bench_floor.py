"""The floor of our own: the least SQL a durable turn can be, on plain `sqlite3`.

A gateway turn's cost is compared with this floor (`cpu_us / floor_us`), not with a
turns/s target: a ratio holds across machines that differ threefold in speed.

The database is the production one: created and opened through the gateway's own path
(`create_database_file` + `_open_writer`: WAL, synchronous=NORMAL, foreign keys, the
16 MiB page cache, the autocheckpoint safety net, the whole migrated schema with its
triggers), so the floor follows the schema and the pragmas wherever they go. What runs
on it is one process, one thread, no asyncio, no store objects: G turns per
`BEGIN IMMEDIATE ... COMMIT`, as the gateway's group commit batches concurrent turns.

G is what the gateway reaches, not what flatters the floor: `bench_gateway.py --split`
counts about 16 turns per commit with 64 chats in its closed loop (a turn's accept and
finish are commits of their own, and the loop's chats are never all waiting at once),
so GATEWAY_TURNS_PER_COMMIT (16) is the default and `--batch` sets another. Committing
all 64 at once spread each commit's fixed cost over four times as many turns as the
gateway ever does.

One turn leaves the state a gateway turn leaves (inbox row done, both messages in the
transcript and in `fts_log`, session touched and counted, reply sent), in 8 statements:

    1. inbox row, refused when its (platform, chat_id, message_id) came before (dedup);
       written `done` at once, since accept and finish share this one transaction
    2. the session's entry touched (`updated_at` of its hot row), which also routes
       key -> session id
    3. the last 40 transcript messages read and decoded (`codec.loads`, as a turn must)
    4. the user message                                   (the fts_log trigger fires)
    5. the assistant message                              (the fts_log trigger fires)
    6. the session's token counters
    7. the ledger row of the reply, pending
    8. that row marked sent, in the next group commit (after the "platform" took it)

Left out, because a turn in one transaction does not need them: the turn marker and
the inbox row's separate accepted -> done step (the gateway needs both because the
agent runs between its two transactions), and re-encoding the entry JSON.

Sessions are seeded as the gateway's fill writes them (`sessions` row, the entry's hot
row and its cold row), in one transaction; every session that gets a
turn also gets `--history` messages first, so every turn reads a full window.

    .venv/bin/python scripts/bench_floor.py                          # 1k, 10k, 100k
    .venv/bin/python scripts/bench_floor.py --sizes 100000 --turns 10000 --batch 64
    .venv/bin/python scripts/bench_floor.py --quick --json           # seconds; JSON out

`floor_us` is process CPU per turn (the figure that moves least on a busy machine);
`wall_us` and turns/s are wall clock. Everything is bounded by count; the database lives
in a temporary directory that is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson  # the gateway's own JSON encoder (gateway.codec)

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.session import build_session_key
from gateway.store import codec
from gateway.store.db import _open_writer, create_database_file
from scripts.gateway_driver import source_for

HISTORY = 40  # messages read per turn (and seeded per session that gets a turn)
USER_TEXT = "hello there, how are you today?"  # as scripts/bench_gateway.py sends
REPLY_TEXT = f"echo: {USER_TEXT}"
TOKENS_IN, TOKENS_OUT = len(USER_TEXT.split()), len(REPLY_TEXT.split())
STATEMENTS_PER_TURN = 8
# Turns per group commit the gateway reaches in its closed loop of 64 chats
# (`bench_gateway.py --split` prints it): the floor's default batch.
GATEWAY_TURNS_PER_COMMIT = 16
SIZES, QUICK_SIZES = [1_000, 10_000, 100_000], [200, 1_000]
HEADER = (
    f"{'sessions':>9} {'seed_s':>7} {'turns':>6} {'batch':>5} {'turns/s':>8}"
    f" {'floor_us':>8} {'wall_us':>7}"
)

INBOX = (
    "INSERT INTO inbox (platform, chat_id, message_id, session_key, kind, event, state,"
    " accepted_at, done_at) VALUES (?, ?, ?, ?, 'turn', ?, 'done', ?, ?)"
    " ON CONFLICT (platform, chat_id, message_id) WHERE message_id IS NOT NULL DO NOTHING"
)
TOUCH = "UPDATE session_entries SET updated_at = ? WHERE session_key = ? RETURNING session_id"
HISTORY_READ = (
    "SELECT message FROM messages WHERE session_id = ? AND active = 1 AND id < ?"
    " ORDER BY id DESC LIMIT ?"
)
MESSAGE = (
    "INSERT INTO messages (session_id, role, content, message, created_at) VALUES (?, ?, ?, ?, ?)"
)
COUNTERS = (
    "UPDATE sessions SET input_tokens = input_tokens + ?, output_tokens = output_tokens + ?,"
    " total_tokens = total_tokens + ? WHERE session_id = ?"
)
LEDGER = (
    "INSERT INTO outbound (platform, chat_id, target, text, reply_to, session_key, state,"
    " created_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)"
)
MARK_SENT = (
    "UPDATE outbound SET state = 'sent', platform_message_id = ?, sent_at = ?"
    " WHERE id = ? AND state = 'pending'"
)


def open_production_db(path: Path) -> sqlite3.Connection:
    """A new state database at `path`, opened as the gateway opens its writer."""
    create_database_file(path)
    return _open_writer(path)


def session_id_for(i: int, now: datetime) -> str:
    """The shape of `entries.new_session_id` (`YYYYMMDD_HHMMSS_<8hex>`), unique by i."""
    return f"{now:%Y%m%d_%H%M%S}_{i:08x}"


# --- seed ----------------------------------------------------------------------------------


def _session_rows(
    size: int, now: datetime
) -> Iterator[tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]]:
    """(sessions row, hot entry row, cold entry row) per session, as
    `entries.start_session_row` and `entries.save_entry` write a fresh entry."""
    stamp = now.timestamp()
    minute = int(stamp // 60)
    for i in range(size):
        source = source_for(i)
        key, sid = build_session_key(source), session_id_for(i, now)
        origin = orjson.dumps(source.to_dict()).decode()
        yield (
            (sid, key, origin, stamp, 0, 0, 0, 0, 0, 0.0),
            (key, sid, stamp, stamp, minute),
            (key, origin, source.chat_name, source.platform.value, source.chat_type),
        )


def _history_rows(sessions: list[int], history: int, now: datetime) -> Iterator[tuple[Any, ...]]:
    stamp = now.timestamp()
    for i in sessions:
        sid = session_id_for(i, now)
        for k in range(history):
            if k % 2 == 0:
                message = {"role": "user", "content": USER_TEXT, "message_id": f"seed-{i}-{k}"}
            else:
                message = {"role": "assistant", "content": REPLY_TEXT}
            encoded = orjson.dumps(message).decode()
            yield (sid, message["role"], message["content"], encoded, stamp)


def seed(conn: sqlite3.Connection, size: int, touched: list[int], history: int) -> None:
    """`size` sessions, `history` messages in each of `touched`, in one transaction; then
    a checkpoint, so the timed turns start on an empty WAL as after a clean start."""
    now = datetime.now(UTC)
    rows = list(_session_rows(size, now))
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO sessions (session_id, session_key, origin, started_at, input_tokens,"
        " output_tokens, cache_read_tokens, cache_write_tokens, total_tokens,"
        " estimated_cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (session for session, _, _ in rows),
    )
    # In key order: appended, not scattered. The other columns keep their defaults.
    conn.executemany(
        "INSERT INTO session_entries (session_key, session_id, created_at, updated_at,"
        " active_minute) VALUES (?, ?, ?, ?, ?)",
        sorted(hot for _, hot, _ in rows),
    )
    conn.executemany(
        "INSERT INTO session_entry_docs (session_key, origin, display_name, platform,"
        " chat_type) VALUES (?, ?, ?, ?, ?)",
        sorted(cold for _, _, cold in rows),
    )
    del rows
    conn.executemany(MESSAGE, _history_rows(touched, history, now))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


# --- turns ---------------------------------------------------------------------------------


def plan_turns(size: int, turns: int, seed_value: int) -> list[int]:
    """The session of each turn: random among `size` (a session may get several)."""
    rng = random.Random(seed_value)
    return [rng.randrange(size) for _ in range(turns)]


def _chat(i: int) -> tuple[str, str, dict[str, Any], str]:
    """What a turn of session i knows before it starts: its key, its chat, the source as
    the inbox event carries it and as the ledger's target (JSON)."""
    source = source_for(i)
    as_dict = source.to_dict()
    return build_session_key(source), source.chat_id, as_dict, orjson.dumps(as_dict).decode()


def run_turns(
    conn: sqlite3.Connection,
    plan: list[tuple[str, str, dict[str, Any], str]],
    batch: int,
    history: int,
) -> dict[str, Any]:
    """The timed part: every turn of `plan` (key, chat_id, source dict, target JSON), `batch`
    turns per commit, each commit also marking the previous commit's replies sent; each
    turn reads the last `history` messages of its session."""
    execute = conn.execute
    marks: list[int] = []
    duplicates = commits = 0
    before = 2**62  # no bound: the newest messages
    started, cpu_started = time.perf_counter(), time.process_time()
    for first in range(0, len(plan), batch):
        execute("BEGIN IMMEDIATE")
        now = time.time()
        for delivery_id in marks:
            execute(MARK_SENT, (f"local-{delivery_id}", now, delivery_id))
        marks = []
        for n, (key, chat_id, source, target) in enumerate(
            plan[first : first + batch], start=first
        ):
            now = time.time()
            message_id = f"floor-{n}"
            event = orjson.dumps(
                {"source": source, "text": USER_TEXT, "message_id": message_id, "received_at": now}
            ).decode()
            if execute(INBOX, ("local", chat_id, message_id, key, event, now, now)).rowcount != 1:
                duplicates += 1
                continue
            (sid,) = execute(TOUCH, (now, key)).fetchone()
            # Decoded, as the gateway's turn must to hand the messages to its agent.
            [codec.loads(row[0]) for row in execute(HISTORY_READ, (sid, before, history))]
            user = {"role": "user", "content": USER_TEXT, "message_id": message_id}
            execute(MESSAGE, (sid, "user", USER_TEXT, orjson.dumps(user).decode(), now))
            reply = {"role": "assistant", "content": REPLY_TEXT}
            execute(MESSAGE, (sid, "assistant", REPLY_TEXT, orjson.dumps(reply).decode(), now))
            execute(COUNTERS, (TOKENS_IN, TOKENS_OUT, TOKENS_IN + TOKENS_OUT, sid))
            cursor = execute(LEDGER, ("local", chat_id, target, REPLY_TEXT, message_id, key, now))
            marks.append(cursor.lastrowid)
        execute("COMMIT")
        commits += 1
    # The last commit's replies are marked in a commit of their own, as the next batch would.
    execute("BEGIN IMMEDIATE")
    now = time.time()
    for delivery_id in marks:
        execute(MARK_SENT, (f"local-{delivery_id}", now, delivery_id))
    execute("COMMIT")
    commits += 1
    cpu, wall = time.process_time() - cpu_started, time.perf_counter() - started
    return {"cpu_s": cpu, "wall_s": wall, "commits": commits, "duplicates": duplicates}


def count_rows(conn: sqlite3.Connection) -> dict[str, int]:
    """What the run left in the database (the proof that the turns wrote)."""

    def one(sql: str) -> int:
        return int(conn.execute(sql).fetchone()[0])

    return {
        "inbox": one("SELECT count(*) FROM inbox"),
        "inbox_done": one("SELECT count(*) FROM inbox WHERE state = 'done'"),
        "messages": one("SELECT count(*) FROM messages"),
        "fts_log": one("SELECT count(*) FROM fts_log"),
        "outbound": one("SELECT count(*) FROM outbound"),
        "outbound_sent": one("SELECT count(*) FROM outbound WHERE state = 'sent'"),
        "total_tokens": one("SELECT coalesce(sum(total_tokens), 0) FROM sessions"),
        "touched_entries": one(
            "SELECT count(*) FROM session_entries WHERE updated_at > ("
            "SELECT min(started_at) FROM sessions)"
        ),
    }


def redelivery_refused(conn: sqlite3.Connection, chat_id: str, message_id: str) -> bool:
    """A message id offered again is refused by the dedup index (checked after the run)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        now = time.time()
        cursor = conn.execute(INBOX, ("local", chat_id, message_id, "k", "{}", now, now))
        return cursor.rowcount == 0
    finally:
        conn.execute("ROLLBACK")


def measure_floor(
    size: int,
    turns: int,
    batch: int,
    workdir: Path,
    *,
    history: int = HISTORY,
    read_limit: int | None = None,
    seed_value: int = 1,
) -> dict[str, Any]:
    """Seed `size` sessions in a fresh production database under `workdir`, run `turns`
    minimal durable turns `batch` per commit, and return the figures (`floor_us`: process
    CPU per turn) with the rows counted afterwards. The database is removed afterwards.

    `history` messages are seeded in every session that gets a turn; each turn reads up
    to `read_limit` (default `history`) of its session's newest messages, seeded or
    written by earlier turns of the run. `history=0, read_limit=100` is what the
    gateway's closed loop does: sessions start empty, every turn asks for 100."""
    limit = history if read_limit is None else read_limit
    if size < 1 or turns < 1 or batch < 1 or history < 0 or limit < 0:
        raise ValueError("size, turns and batch must be positive, history not negative")
    directory = Path(tempfile.mkdtemp(prefix="floor-", dir=workdir))
    try:
        conn = open_production_db(directory / "state.db")
        try:
            sessions = plan_turns(size, turns, seed_value)
            seeded = time.perf_counter()
            seed(conn, size, sorted(set(sessions)), history)
            seed_s = time.perf_counter() - seeded
            chats = {i: _chat(i) for i in set(sessions)}
            timed = run_turns(conn, [chats[i] for i in sessions], batch, limit)
            rows = count_rows(conn)
            refused = redelivery_refused(conn, chats[sessions[0]][1], "floor-0")
        finally:
            conn.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    done = turns - timed["duplicates"]
    return {
        "sessions": size,
        "turns": turns,
        "batch": batch,
        "history": history,
        "read_limit": limit,
        "statements_per_turn": STATEMENTS_PER_TURN,
        "seed_s": seed_s,
        "seeded_messages": len(set(sessions)) * history,
        "turns_per_s": done / timed["wall_s"] if timed["wall_s"] > 0 else 0.0,
        "floor_us": timed["cpu_s"] / done * 1e6 if done else 0.0,
        "wall_us": timed["wall_s"] / done * 1e6 if done else 0.0,
        **timed,
        "rows": rows,
        "redelivery_refused": refused,
        "sqlite": sqlite3.sqlite_version,
    }


# --- command line --------------------------------------------------------------------------


def format_row(r: dict[str, Any]) -> str:
    return (
        f"{r['sessions']:>9} {r['seed_s']:>7.2f} {r['turns']:>6} {r['batch']:>5}"
        f" {r['turns_per_s']:>8.0f} {r['floor_us']:>8.1f} {r['wall_us']:>7.1f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="sessions (1k 10k 100k)")
    parser.add_argument("--turns", type=int, default=None, help="turns per size (10000)")
    parser.add_argument(
        "--batch",
        type=int,
        default=GATEWAY_TURNS_PER_COMMIT,
        help=f"turns per commit ({GATEWAY_TURNS_PER_COMMIT}: what the gateway reaches)",
    )
    parser.add_argument("--history", type=int, default=HISTORY, help="messages read per turn")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="200 and 1k sessions, 500 turns")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=str,
        help="print all figures as JSON instead of the table (or write them to this file)",
    )
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.turns is None:
        args.turns = 500 if args.quick else 10_000
    if min(args.sizes) < 1 or args.turns < 1 or args.batch < 1 or args.history < 0:
        parser.error("--sizes, --turns and --batch must be positive, --history not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    to_stdout = args.json == "-"
    if not to_stdout:
        print(
            f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version},"
            f" {os.cpu_count()} CPUs, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC,"
            f" load {os.getloadavg()[0]:.2f}"
        )
        print(
            f"minimal durable turn: {STATEMENTS_PER_TURN} statements, {args.history}-message"
            " history read; floor_us: process CPU per turn"
        )
        print(HEADER, flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as workdir:
        for size in args.sizes:
            row = measure_floor(
                size,
                args.turns,
                args.batch,
                Path(workdir),
                history=args.history,
                seed_value=args.seed,
            )
            rows.append(row)
            if not to_stdout:
                print(format_row(row), flush=True)
    report = {"argv": sys.argv[1:], "rows": rows}
    if to_stdout:
        print(json.dumps(report, indent=1))
    elif args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
