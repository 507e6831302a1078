"""The naive baseline of `bench_gateway.py` (its step 4): the same closed loop against a
store that rewrites all of sessions.json on every message, the design the store replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.session import SessionSource
from gateway.store import entries
from gateway.store.session_store import SESSIONS_JSON, SessionStore
from scripts.gateway_driver import USER_TEXT, gateway_config, pick_key, source_for


class NaiveStore:
    """The design the store replaced: all entries in one dict, and every message
    rewrites the whole sessions.json (temp file + os.replace) and appends its transcript
    lines to a per-session JSONL file. The cheap end of that design: no fsync, and the
    file is encoded in one go by the C encoder (`json.dump` to a file streams through the
    pure-Python encoder, about 5x slower).
    """

    def __init__(self, directory: Path, index: dict[str, dict[str, Any]]) -> None:
        self.directory = directory
        self.path = directory / SESSIONS_JSON
        self.transcripts = directory / "transcripts"
        self.transcripts.mkdir(parents=True, exist_ok=True)
        self.entries = index

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w", encoding="utf-8") as file:
            file.write(json.dumps(self.entries, ensure_ascii=False))
        os.replace(tmp, self.path)

    def turn(self, key: str, source: SessionSource, text: str, reply: str) -> None:
        now = datetime.now(UTC)
        entry = self.entries.get(key)
        if entry is None:
            entry = entries.fresh_entry(key, source, now).to_dict()
        entry["updated_at"] = now.isoformat()
        words_in, words_out = len(text.split()), len(reply.split())
        entry["input_tokens"] += words_in
        entry["output_tokens"] += words_out
        entry["total_tokens"] += words_in + words_out
        entry["last_prompt_tokens"] = words_in
        self.entries[key] = entry
        self._save()
        lines = [
            {"role": "user", "content": text, "timestamp": now.isoformat()},
            {"role": "assistant", "content": reply, "timestamp": now.isoformat()},
        ]
        with (self.transcripts / f"{entry['session_id']}.jsonl").open("a") as file:
            file.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


async def naive_closed_loop(
    naive: NaiveStore, n: int, count: int, concurrency: int, seed: int, max_seconds: float
) -> dict[str, Any]:
    rng = random.Random(seed)
    busy: set[int] = set()
    config = gateway_config()
    store_key = SessionStore(naive.directory, config).session_key_for
    done = 0
    issued = 0
    deadline = time.perf_counter() + max_seconds

    async def chat() -> None:
        nonlocal done, issued
        while issued < count and time.perf_counter() < deadline:
            issued += 1
            i = pick_key(rng, n, busy)
            try:
                source = source_for(i)
                naive.turn(store_key(source), source, USER_TEXT, f"echo: {USER_TEXT}")
                done += 1
            finally:
                busy.discard(i)
            await asyncio.sleep(0)  # the next chat's turn, as replies would interleave

    started = time.perf_counter()
    await asyncio.gather(*(chat() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"turns": done, "seconds": elapsed, "turns_per_s": done / elapsed if elapsed else 0.0}


def run_naive(home: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Naive baseline, seeded with the very sessions.json the fill left behind."""
    directory = home / "naive"
    directory.mkdir()
    index = json.loads((home / "sessions" / SESSIONS_JSON).read_text(encoding="utf-8"))
    naive = NaiveStore(directory, index)
    try:
        return asyncio.run(
            naive_closed_loop(
                naive, n, args.messages, args.concurrency, args.seed + 1, args.baseline_seconds
            )
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
