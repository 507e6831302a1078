"""Recall quality: rank-1 and top-5 hits on a paraphrase set, vector-only, text-only and fused.

One user's notes and questions asked in other words (tests/data/recall_paraphrases.json,
each question naming the note that answers it) are saved and searched through
`Recall.search`, the path the memory tools and auto_recall take, three times: with the
weights (1, 0) (vector only), (0, 1) (text only) and memory.weights' defaults (fused).

    .venv/bin/python scripts/bench_recall_quality.py                   # hash embedding
    .venv/bin/python scripts/bench_recall_quality.py --openai http://127.0.0.1:18811/v1 \\
        --model all-MiniLM-L6-v2                                     # any /v1/embeddings
    .venv/bin/python scripts/bench_recall_quality.py --local PATH     # a model2vec model
    .venv/bin/python scripts/bench_recall_quality.py --postgres postgresql://postgres@127.0.0.1/test
    .venv/bin/python scripts/bench_recall_quality.py --cost   # also auto_recall's cost a turn

With --postgres the store (and so the index) is on that server, in a schema of its own,
dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import GatewayConfig
from gateway.memory.recall import Namespace, Recall
from gateway.store.session_store import SessionStore
from scripts.bench_replicas import pg_schema

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "recall_paraphrases.json"
USER = Namespace("main", "telegram", "bench-user")
MODES = ("vector", "text", "fused")


@dataclass
class Score:
    rank1: int = 0
    top5: int = 0
    misses: list[str] = field(default_factory=list)  # questions not answered first


def load(path: Path = DATA) -> tuple[list[str], list[tuple[str, int]]]:
    data = json.loads(path.read_text())
    return data["notes"], [(item["q"], item["note"]) for item in data["questions"]]


async def quality(home: Path, config: GatewayConfig, path: Path = DATA) -> dict[str, Score]:
    """Each mode's hits on the set, in a fresh store at `home`."""
    notes, questions = load(path)
    fused = (config.memory.weights.vector, config.memory.weights.text)
    weights = {"vector": (1.0, 0.0), "text": (0.0, 1.0), "fused": fused}
    out = {mode: Score() for mode in MODES}
    async with SessionStore(home, config) as store:
        recall = Recall(store, config)
        await recall.open()
        try:
            ids = [await recall.save(USER, note) for note in notes]
            await recall.indexer.catch_up()
            for mode in MODES:
                recall.weights = weights[mode]
                for question, answer in questions:
                    found = [hit.id for hit in await recall.search(USER, question, k=5)]
                    score = out[mode]
                    if found[:1] == [ids[answer]]:
                        score.rank1 += 1
                    else:
                        score.misses.append(question)
                    score.top5 += ids[answer] in found
        finally:
            await recall.close()
    return out


async def auto_recall_cost(home: Path, config: GatewayConfig, rounds: int = 20) -> dict[str, float]:
    """CPU and wall time of one `Recall.for_turn` (auto_recall before a turn), per call:
    for a user with the set's notes, and for one with none (the common case)."""
    notes, questions = load()
    nobody = Namespace("main", "telegram", "no-notes")
    out: dict[str, float] = {}
    async with SessionStore(home, config) as store:
        recall = Recall(store, config)
        await recall.open()
        try:
            for note in notes:
                await recall.save(USER, note)
            for name, ns in (("with_notes", USER), ("without_notes", nobody)):
                await recall.for_turn(ns, questions[0][0])  # warm: vectors loaded
                calls = [q for _ in range(rounds) for q, _ in questions]
                cpu, wall = time.process_time(), time.perf_counter()
                for question in calls:
                    await recall.for_turn(ns, question)
                out[f"{name}_cpu_us"] = (time.process_time() - cpu) / len(calls) * 1e6
                out[f"{name}_ms"] = (time.perf_counter() - wall) / len(calls) * 1e3
        finally:
            await recall.close()
    return out


def memory_config(args: argparse.Namespace) -> dict[str, Any]:
    if args.openai:
        return {"embedding": "openai", "base_url": args.openai, "model": args.model}
    if args.local:
        return {"embedding": "local", "model_path": args.local}
    return {}


def run(args: argparse.Namespace) -> dict[str, Score]:
    home = Path(tempfile.mkdtemp(prefix="bench-recall-quality-"))
    try:
        with contextlib.ExitStack() as stack:
            storage: dict[str, Any] = {}
            if args.postgres:
                dsn = stack.enter_context(pg_schema(args.postgres))
                storage = {"backend": "postgres", "dsn": dsn}
            memory = memory_config(args)
            config = GatewayConfig.model_validate({"memory": memory, "storage": storage})
            result = asyncio.run(quality(home / "sessions", config))
            if args.cost:
                args.cost_figures = asyncio.run(auto_recall_cost(home / "cost", config))
            return result
    finally:
        shutil.rmtree(home, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--openai", metavar="BASE_URL", help="an OpenAI-compatible /embeddings")
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="with --openai")
    parser.add_argument("--local", metavar="PATH", help="a model2vec model directory")
    parser.add_argument("--postgres", metavar="DSN", help="the store on this PostgreSQL server")
    parser.add_argument("--misses", action="store_true", help="list the questions missed")
    parser.add_argument("--cost", action="store_true", help="also time auto_recall per turn")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    _, questions = load()
    backend = f"openai {args.model}" if args.openai else "local" if args.local else "hash"
    where = ", PostgreSQL" if args.postgres else ""
    print(f"recall quality, {len(questions)} paraphrased questions ({backend}{where}):")
    print(f"{'mode':<8} {'rank-1':>7} {'top-5':>7}")
    for mode in MODES:
        score = result[mode]
        print(f"{mode:<8} {score.rank1:>4}/{len(questions):<2} {score.top5:>4}/{len(questions):<2}")
        if args.misses:
            for question in score.misses:
                print(f"    missed at rank 1: {question}")
    if args.cost:
        c = args.cost_figures
        print(
            f"auto_recall per turn: a user with {len(load()[0])} notes"
            f" {c['with_notes_cpu_us']:.0f} us CPU, {c['with_notes_ms']:.2f} ms;"
            f" a user without notes {c['without_notes_cpu_us']:.1f} us CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
