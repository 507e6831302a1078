"""What usage accounting and budgets cost a turn: process CPU per closed-loop turn of the
in-process gateway (the zero-config echo agent, SQLite in RAM), with budgets off (the
default) or on (`--budgets`: every limit set, none reached, so each turn is checked and
its pace recorded). One run is a few seconds, so runs of two builds interleave well:

    for i in $(seq 10); do   # ../base: the other build, with a copy of this script
        (cd ../base && .venv/bin/python scripts/bench_budgets.py)
        .venv/bin/python scripts/bench_budgets.py
        .venv/bin/python scripts/bench_budgets.py --budgets
    done

It measures the same closed loop as `bench_gateway.py` (scripts/gateway_driver.py), with
a fraction of the setup: `bench_gateway.py --sizes 10000` stays the reference figure.
`--profile` prints where the budget checks spend their time (cProfile, slower).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.ops.logs import configure_logging
from gateway.run import GatewayRunner
from scripts.gateway_driver import Driver, InProcessAdapter, gateway_config


async def run(args: argparse.Namespace, scratch: str | None) -> None:
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        # A build from before budgets takes no `budgets` argument: it runs with none.
        config = gateway_config(budgets=True) if args.budgets else gateway_config()
        adapter = InProcessAdapter()
        runner = GatewayRunner(config, [adapter], agent_factory=None, home=Path(tmp))
        driver = Driver(runner, adapter, args.sessions)
        await runner.start()
        try:
            await driver.closed_loop("warmup", args.warmup, args.concurrency, 1, 60)
            profile = cProfile.Profile() if args.profile else None
            started = time.process_time()
            if profile is not None:
                profile.enable()
            await driver.closed_loop("closed", args.messages, args.concurrency, 2, 300)
            if profile is not None:
                profile.disable()
            cpu = time.process_time() - started
        finally:
            await runner.stop()
    budgets = "on" if args.budgets else "off"
    print(f"budgets {budgets}: cpu_us {cpu / args.messages * 1e6:.0f} per turn")
    if profile is not None:
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative").print_stats(r"budgets|store/usage", 15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", action="store_true", help="every limit set")
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=6000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    configure_logging(json_output=True)
    asyncio.run(run(args, "/dev/shm" if Path("/dev/shm").is_dir() else None))


if __name__ == "__main__":
    main()
