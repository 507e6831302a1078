"""Benchmark the per-message store cycle at 1,000 / 10,000 / 100,000 sessions.

One cycle is what the runner does per message: get_or_create_session + append the user
message + append the reply + update_session (with token usage), on a random key. Each
size gets a fresh store on disk (WAL, production settings) filled with N sessions first.

    .venv/bin/python scripts/bench_store.py                      # 1k, 10k, 100k
    .venv/bin/python scripts/bench_store.py --sizes 1000 --cycles 2000 --concurrency 8

`--concurrency 1` (default) measures one chat at a time, i.e. pure per-cycle latency;
higher values show what group commit does for many chats at once.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from config import GatewayConfig
from gateway.session import Platform, SessionSource, TokenUsage
from gateway.store.session_store import SessionStore


def source_for(i: int) -> SessionSource:
    return SessionSource(
        platform=Platform.TELEGRAM, chat_id=str(100_000_000 + i), user_id=str(i), user_name="u"
    )


async def fill(store: SessionStore, n: int, batch: int = 512) -> None:
    for start in range(0, n, batch):
        await asyncio.gather(
            *(
                store.get_or_create_session(source_for(i))
                for i in range(start, min(n, start + batch))
            )
        )


async def cycle(store: SessionStore, source: SessionSource, latencies: list[float]) -> None:
    started = time.perf_counter()
    entry = await store.get_or_create_session(source)
    await store.append_to_transcript(entry.session_id, {"role": "user", "content": "hello there"})
    await store.append_to_transcript(
        entry.session_id, {"role": "assistant", "content": "echo: hello there"}
    )
    await store.update_session(
        entry.session_key, last_prompt_tokens=12, usage=TokenUsage(input_tokens=12, output_tokens=4)
    )
    latencies.append(time.perf_counter() - started)


async def bench_size(n: int, cycles: int, concurrency: int, seed: int) -> dict[str, float]:
    config = GatewayConfig.model_validate({"timezone": "UTC", "session_reset": {"mode": "none"}})
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        async with SessionStore(Path(tmp) / "sessions", config) as store:
            fill_started = time.perf_counter()
            await fill(store, n)
            fill_seconds = time.perf_counter() - fill_started
            keys = [rng.randrange(n) for _ in range(cycles)]
            latencies: list[float] = []
            queue = iter(keys)

            async def worker() -> None:
                for i in queue:
                    await cycle(store, source_for(i), latencies)

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "sessions": n,
        "fill_s": fill_seconds,
        "cycles_per_s": cycles / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "max_ms": latencies[-1] * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--cycles", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, cycles={args.cycles}, concurrency={args.concurrency}")
    print(
        f"{'sessions':>9} {'fill s':>7} {'cycles/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"
    )
    results = []
    for n in args.sizes:
        r = asyncio.run(bench_size(n, args.cycles, args.concurrency, args.seed))
        results.append(r)
        print(
            f"{r['sessions']:>9} {r['fill_s']:>7.1f} {r['cycles_per_s']:>9.0f}"
            f" {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} {r['max_ms']:>7.2f}",
            flush=True,
        )
    if len(results) > 1:
        ratio = results[-1]["cycles_per_s"] / results[0]["cycles_per_s"]
        print(f"throughput at {results[-1]['sessions']} vs {results[0]['sessions']}: {ratio:.2f}x")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {peak_mib:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
