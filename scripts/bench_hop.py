"""Measure one round trip from the event loop to aiosqlite's worker thread and back.

Every store read pays this hop (writes do not: they run on the event loop's own thread,
where this hop would cost each statement). On a VM a wake-up across CPUs can cost several times more
than on one CPU. Compare:

    .venv/bin/python scripts/bench_hop.py
    taskset -c 0 .venv/bin/python scripts/bench_hop.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiosqlite


async def main(rounds: int = 5000, repeats: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        conn = await aiosqlite.connect(Path(tmp) / "hop.db")
        try:
            results = []
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(rounds):
                    await conn.execute("SELECT 1")
                results.append((time.perf_counter() - started) / rounds * 1e6)
        finally:
            await conn.close()
    print(f"event loop -> sqlite thread -> event loop: median {statistics.median(results):.1f} us")


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
