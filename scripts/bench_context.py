"""Benchmark the context loading: one turn's context from a 10,000-message session.

On a fresh store (production settings, WAL) one session gets --messages transcript
messages (user/assistant pairs, ~200 characters each); then, inside a write transaction
on the store's writer (where a turn's begin reads it), the context is loaded --runs
times per case and fitted to the budget as a turn does (`gateway.store.turn_context`
then `gateway.context.strategy.prepare`):

    window               the newest that fit, at most max_messages (40)
    summary, none        the summary strategy before any checkpoint (history_limit, 100)
    summary, checkpoint  a checkpoint covering all but the newest 60 messages

Prints median / p99 / max in ms per case; the target is a median under 5 ms for 10,000
messages. Also times what a background summary reads first (`unsummarized`): the
count and size of every message a summary does not cover, off the turn's path.

    .venv/bin/python scripts/bench_context.py
    .venv/bin/python scripts/bench_context.py --messages 100000 --runs 500
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from config import GatewayConfig
from gateway.context.strategy import Plan, prepare
from gateway.session import Platform, SessionSource
from gateway.store import summary_checkpoints, transcript, turn_context
from gateway.store.session_store import SessionStore
from scripts.harness import percentile

TARGET_MS = 5.0
SYSTEM_PROMPT = "You are a helpful assistant.\n\n## Current Session Context\n" + "x" * 400


def text(i: int) -> str:
    return f"message {i}: " + " ".join(f"word{i % 97}" for _ in range(25))


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": percentile(ordered, 50, ordered=True) * 1000,
        "p99_ms": percentile(ordered, 99, ordered=True) * 1000,
        "max_ms": ordered[-1] * 1000,
    }


async def timed_in_writer(
    store: SessionStore, runs: int, work: Callable[[Any], object]
) -> list[float]:
    samples = []
    for _ in range(runs):

        def tx(conn: Any) -> float:
            start = time.perf_counter()
            work(conn)
            return time.perf_counter() - start

        samples.append(await store.write(tx, dirty=False))
    return samples


async def bench(messages: int, runs: int) -> list[tuple[str, dict[str, float], int]]:
    with tempfile.TemporaryDirectory(prefix="bench-context-") as root:
        config = GatewayConfig.model_validate({"timezone": "UTC"})
        store = SessionStore(Path(root) / "sessions", config)
        await store.open()
        try:
            source = SessionSource(platform=Platform.TELEGRAM, chat_id="1", user_id="1")
            sid = (await store.get_or_create_session(source)).session_id

            def fill(conn: Any) -> list[int]:
                return [
                    transcript.insert_message(
                        conn,
                        sid,
                        {"role": "user" if i % 2 == 0 else "assistant", "content": text(i)},
                    )
                    for i in range(messages)
                ]

            ids = await store.write(fill, dirty=False)
            summary = summary_message_text(1500)
            results = []
            cases = [
                ("window", config.agent.model_copy(update={"context": _ctx(config, "window")})),
                ("summary, none", config.agent),
            ]
            for name, agent in cases:
                plan = Plan.from_config(agent)
                results.append(await case(store, sid, plan, runs, name))
            await store.write(
                lambda conn: summary_checkpoints.write(
                    conn,
                    sid,
                    expected_epoch=0,
                    covered_up_to=ids[-61],
                    summary=summary,
                    messages=messages - 60,
                    now=time.time(),
                ),
                dirty=False,
            )
            results.append(
                await case(store, sid, Plan.from_config(config.agent), runs, "summary, checkpoint")
            )
            await store.write(lambda conn: summary_checkpoints.on_rewind(conn, sid, 0, 0.0))
            samples = await timed_in_writer(
                store,
                max(runs // 10, 5),
                lambda conn: summary_checkpoints.unsummarized(conn, sid, 400),
            )
            results.append(("background: unsummarized read (no checkpoint)", stats(samples), 400))
            return results
        finally:
            await store.close()


def _ctx(config: GatewayConfig, strategy: str) -> Any:
    return config.agent.context.model_copy(update={"strategy": strategy})


def summary_message_text(chars: int) -> str:
    return ("Recent condensed turns:\n" + "- user: something said\n" * (chars // 23))[:chars]


async def case(
    store: SessionStore, sid: str, plan: Plan, runs: int, name: str
) -> tuple[str, dict[str, float], int]:
    sent = [0]

    def work(conn: Any) -> None:
        loaded = turn_context.load(conn, sid, plan)
        prepared = prepare(plan, loaded, system_prompt=SYSTEM_PROMPT, text="and now?")
        sent[0] = len(prepared.history)

    samples = await timed_in_writer(store, runs, work)
    return name, stats(samples), sent[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args(argv)
    if args.messages < 200 or args.runs < 1:
        parser.error("--messages must be at least 200 and --runs positive")
    results = asyncio.run(bench(args.messages, args.runs))
    print(f"turn context of one {args.messages:,}-message session, {args.runs} loads per case")
    print(f"{'case':<48} {'p50_ms':>8} {'p99_ms':>8} {'max_ms':>8} {'sent':>5}")
    for name, figures, sent in results:
        print(
            f"{name:<48} {figures['p50_ms']:8.3f} {figures['p99_ms']:8.3f}"
            f" {figures['max_ms']:8.3f} {sent:5d}"
        )
    worst = max(f["p50_ms"] for name, f, _ in results if not name.startswith("background"))
    verdict = "PASS" if worst < TARGET_MS else "FAIL"
    print(
        f"{verdict}  a turn's context loads in {worst:.3f} ms"
        f" (median, worst case) < {TARGET_MS:g} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
