"""The memory indexer alone: CPU per transcript message of its rounds, at the default
settings (hash embedding, transcripts on), without a gateway around it.

A home with N sessions (one user each, as `bench_gateway.py` fills it) gets M messages
appended in turns (a user message and its reply, on sessions drawn at random), logged
as a turn logs them; then the indexer's rounds (`MemoryIndex.apply_logs`, what the
background indexer runs on its thread) apply the log in pages of --page entries, and the
process CPU they take is divided by M. Repeated --runs times on fresh copies of the
filled home; min / median / max are printed.

    .venv/bin/python scripts/bench_indexer.py                       # 10,000 sessions
    .venv/bin/python scripts/bench_indexer.py --sessions 100000 --messages 20000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.memory import index, sqlite_index
from gateway.memory.embeddings import HashEmbedder
from gateway.store import transcript
from gateway.store.session_store import SessionStore
from scripts.bench_gateway import fill_home
from scripts.gateway_driver import gateway_config

WORDS = [f"w{i}" for i in range(5_000)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--messages", type=int, default=20_000, help="appended, then indexed")
    parser.add_argument("--page", type=int, default=2_000, help="log entries per round")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def text(rng: random.Random) -> str:
    """A message of 6-30 words drawn Zipf-like: distinct texts, a repeated vocabulary."""
    return " ".join(
        WORDS[int(rng.paretovariate(1.2)) % len(WORDS)] for _ in range(rng.randint(6, 30))
    )


async def append_messages(home: Path, sessions: int, messages: int, seed: int) -> None:
    store = SessionStore(home / "sessions", gateway_config())
    await store.open()
    try:
        ids = await store.read(
            lambda conn: [row[0] for row in conn.execute("SELECT session_id FROM sessions")]
        )
        rng = random.Random(seed)
        await store.write(
            lambda conn: conn.execute(
                "INSERT OR IGNORE INTO log_readers (name, applied) VALUES (?, 0)",
                (index.LOG_READER,),
            ),
            dirty=False,
        )

        def turns(conn: Any, count: int) -> None:
            for _ in range(count // 2):
                sid = rng.choice(ids)
                transcript.insert_message(conn, sid, {"role": "user", "content": text(rng)})
                transcript.insert_message(conn, sid, {"role": "assistant", "content": text(rng)})

        for first in range(0, messages, 1_000):
            count = min(1_000, messages - first)
            await store.write(lambda conn, n=count: turns(conn, n))
    finally:
        await store.close()


def index_all(home: Path, page: int) -> tuple[float, int]:
    """(process CPU seconds, rounds) to apply the whole log."""
    sessions = home / "sessions"
    conn = sqlite_index.connect(sessions / index.MEMORY_DB, sessions / "state.db")
    index.MESSAGE_PAGE = page
    sqlite_index.MESSAGE_PAGE = page
    # The default configuration's: the hash embedder, whose vectors recall derives (none
    # is made or stored by the rounds).
    ops, settings = sqlite_index.DERIVED_INDEX, index.IndexSettings()
    namespaces, embedder = index.NamespaceCache(), HashEmbedder()
    try:
        ops.requeue_other_models(conn, embedder.model_id)
        started, rounds = time.process_time(), 0
        while True:
            rounds += 1
            if not ops.apply_logs(conn, settings, namespaces).more:
                break
        return time.process_time() - started, rounds
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-indexer-"))
    try:
        filled = root / "filled"
        filled.mkdir(mode=0o700)
        asyncio.run(fill_home(filled, args.sessions))
        # memory.db made before the messages, so the rounds follow the log (not a rebuild)
        index_all(filled, args.page)
        asyncio.run(append_messages(filled, args.sessions, args.messages, args.seed))
        per_message = []
        for run in range(args.runs):
            home = root / f"run-{run}"
            shutil.copytree(filled, home)
            cpu, rounds = index_all(home, args.page)
            shutil.rmtree(home, ignore_errors=True)
            per_message.append(cpu / args.messages * 1e6)
            print(
                f"run {run + 1}: {per_message[-1]:.1f} us a message ({rounds} rounds)", flush=True
            )
        print(
            f"{args.sessions} sessions, {args.messages} messages, pages of {args.page}:"
            f" indexer CPU per message min {min(per_message):.1f} / median"
            f" {statistics.median(per_message):.1f} / max {max(per_message):.1f} us"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
