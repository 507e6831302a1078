"""Recall latency over one user's 100,000 transcript chunks.

A fresh HERMES home gets one user's DM sessions (--sessions x --per-session messages,
each about 40 words drawn Zipf-like from a 20,000-word vocabulary, so every message is
one chunk and common words match a large share of them), written straight into
state.db's tables (the triggers log them as a turn's insert does), plus --others
users' messages beside them. The memory indexer then indexes everything (the same
rounds the daemon runs in the background: chunking, FTS5; hash vectors on PostgreSQL), and
`Recall.search` is timed end to end (catch-up check, query embedding, FTS5 bm25, numpy
cosine, merge) for --queries queries of 3-6 words drawn the same way, after one
untimed search that loads the user's vectors (on SQLite the hash vectors are not
stored: that search computes them from the chunks' texts; its time is printed apart).

    .venv/bin/python scripts/bench_recall.py                 # 100,000 chunks
    .venv/bin/python scripts/bench_recall.py --chunks 10000  # quicker
    .venv/bin/python scripts/bench_recall.py --postgres postgresql://postgres@127.0.0.1/test

With --postgres the store (and so the index: gateway.memory.pg_index) is on that server,
in a schema of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from psycopg.conninfo import make_conninfo

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
from gateway.store import codec
from gateway.store.session_store import SessionStore

VOCABULARY = [f"w{i}" for i in range(20_000)]
# Zipf-like word frequencies, as cumulative weights: `random.choices` given plain weights
# sums all 20,000 of them again on every call, which made filling the index take half an
# hour; given these it only bisects (and draws the same words for the same seed).
CUM_WEIGHTS = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(VOCABULARY))))
USER = "bench-user"


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(VOCABULARY, cum_weights=CUM_WEIGHTS, k=count))


async def fill(store: SessionStore, chunks: int, per_session: int, others: int, seed: int) -> None:
    rng = random.Random(seed)
    users = [(USER, chunks)] + [(f"other-{i}", per_session) for i in range(others)]
    now = time.time()
    for user, count in users:
        for first in range(0, count, per_session):
            session_id = f"s-{user}-{first}"
            key = f"agent:main:telegram:dm:{user}"
            origin = codec.dumps(
                {"platform": "telegram", "chat_id": user, "chat_type": "dm", "user_id": user}
            )
            rows = [
                (session_id, "user" if i % 2 == 0 else "assistant", words(rng, 40), now + i)
                for i in range(min(per_session, count - first))
            ]

            def write(
                conn: Any,
                session_id: str = session_id,
                key: str = key,
                origin: str = origin,
                rows: list[Any] = rows,
            ) -> None:
                conn.execute(
                    "INSERT INTO sessions (session_id, session_key, origin, started_at)"
                    " VALUES (?, ?, ?, ?)",
                    (session_id, key, origin, now),
                )
                conn.executemany(
                    "INSERT INTO messages (session_id, role, content, message, created_at)"
                    " VALUES (?, ?, ?, '{}', ?)",
                    rows,
                )

            await store.write(write, dirty=False)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


async def measure(home: Path, args: argparse.Namespace) -> dict[str, float]:
    storage = {"backend": "postgres", "dsn": args.schema_dsn} if args.postgres else {}
    config = GatewayConfig.model_validate(
        {"memory": {"index_transcripts": True}, "storage": storage}
    )
    async with SessionStore(home / "sessions", config) as store:
        started = time.perf_counter()
        await fill(store, args.chunks, args.per_session, args.others, args.seed)
        fill_s = time.perf_counter() - started
        recall = Recall(store, config)
        await recall.open()
        started = time.perf_counter()
        await recall.indexer.catch_up()
        index_s = time.perf_counter() - started
        table, mark = ("memory_chunks", "%s") if args.postgres else ("chunks", "?")
        chunk_count = await recall.indexer.run(
            lambda conn, ns: conn.execute(
                f"SELECT count(*) FROM {table} WHERE namespace = {mark}", (ns,)
            ).fetchone()[0],
            str(Namespace("main", "telegram", USER)),
        )
        ns = Namespace("main", "telegram", USER)
        rng = random.Random(args.seed + 1)
        t0 = time.perf_counter()
        await recall.search(ns, words(rng, 4))  # loads (on SQLite: computes) their vectors
        first_ms = (time.perf_counter() - t0) * 1000
        latencies = []
        for _ in range(args.queries):
            query = words(rng, rng.randint(3, 6))
            t0 = time.perf_counter()
            await recall.search(ns, query, k=5)
            latencies.append((time.perf_counter() - t0) * 1000)
        await recall.close()
    return {
        "chunks": chunk_count,
        "fill_s": fill_s,
        "index_s": index_s,
        "first_ms": first_ms,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
    }


def run(args: argparse.Namespace) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="bench-recall-"))
    schema = f"bench_{secrets.token_hex(4)}"
    if args.postgres:
        with psycopg.connect(args.postgres, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        args.schema_dsn = make_conninfo(args.postgres, options=f"-c search_path={schema}")
    try:
        return asyncio.run(measure(home, args))
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if args.postgres:
            with psycopg.connect(args.postgres, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=100_000, help="the user's chunks")
    parser.add_argument("--per-session", type=int, default=100, help="messages per session")
    parser.add_argument("--others", type=int, default=20, help="other users (one session each)")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--postgres", metavar="DSN", help="the store on this PostgreSQL server")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(
        f"recall over {result['chunks']} chunks of one user (hash embedding"
        f"{', PostgreSQL' if args.postgres else ''}):"
        f" p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms,"
        f" max {result['max_ms']:.1f} ms ({args.queries} queries; the first, untimed above,"
        f" {result['first_ms']:.0f} ms);"
        f" writing their messages took {result['fill_s']:.1f} s, indexing them"
        f" {result['index_s']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
