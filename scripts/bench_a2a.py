"""What an A2A `SendMessage` costs over the HTTP API's own round trip, through a real
daemon (`hermes-gateway run`, echo agent without delay, `a2a.enabled: true`):

    http     POST /v1/messages, then GET /v1/chats/{chat}/messages?after=SEQ&wait=10
             until the reply is there (the HTTP API's round trip)
    a2a      POST /a2a/main, JSON-RPC `SendMessage` (A2A 1.0), which answers with the
             completed task and the reply as its artifact

Both over one keep-alive connection each, one message at a time, the two ways
interleaved and their order swapped every pair, each way cycling over the same number of
conversations (one session each). Prints each way's median and p95 and the median of
the pairs' differences (a2a - http).

    .venv/bin/python scripts/bench_a2a.py [--rounds 300] [--chats 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from scripts.harness import Daemon, percentile

WAIT_SECONDS = 10


async def http_round(session: aiohttp.ClientSession, url: str, chat: str, after: int) -> int:
    body = {"chat_id": chat, "user_id": "bench", "text": "hello there"}
    async with session.post(f"{url}/v1/messages", json=body) as resp:
        if resp.status != 202:
            raise RuntimeError(f"POST /v1/messages: {resp.status} {await resp.text()}")
    for _ in range(100):  # bounded: each poll waits up to WAIT_SECONDS
        query = f"after={after}&wait={WAIT_SECONDS}"
        async with session.get(f"{url}/v1/chats/{chat}/messages?{query}") as resp:
            messages = (await resp.json())["messages"]
        if messages:
            return max(m["seq"] for m in messages)
    raise RuntimeError(f"no reply in chat {chat}")


async def a2a_round(session: aiohttp.ClientSession, url: str, context: str | None) -> str:
    message = {
        "messageId": uuid.uuid4().hex,
        "role": "ROLE_USER",
        "parts": [{"text": "hello there"}],
    }
    if context is not None:
        message["contextId"] = context
    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": message}}
    headers = {"A2A-Version": "1.0"}
    async with session.post(f"{url}/a2a/main", json=body, headers=headers) as resp:
        data = await resp.json()
    task = (data.get("result") or {}).get("task")
    if task is None or task["status"]["state"] != "TASK_STATE_COMPLETED":
        raise RuntimeError(f"SendMessage did not complete: {json.dumps(data)[:300]}")
    return task["contextId"]


async def measure(url: str, rounds: int, chats: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"http": [], "a2a": []}
    after = {f"bench-{i}": 0 for i in range(chats)}
    contexts: list[str | None] = [None] * chats
    connector = aiohttp.TCPConnector(limit=1)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as a2a,
    ):
        for n in range(rounds + chats):  # the first `chats` rounds make the sessions
            i = n % chats
            chat = f"bench-{i}"
            order = ("http", "a2a") if n % 2 == 0 else ("a2a", "http")
            for way in order:
                start = time.perf_counter()
                if way == "http":
                    after[chat] = await http_round(http, url, chat, after[chat])
                else:
                    contexts[i] = await a2a_round(a2a, url, contexts[i])
                if n >= chats:
                    timings[way].append(time.perf_counter() - start)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--chats", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = "agent:\n  backend: echo\n  delay_seconds: 0\na2a:\n  enabled: true\n"
    with tempfile.TemporaryDirectory(prefix="hermes-bench-a2a-") as tmp:
        daemon = Daemon(Path(tmp) / "home", settings)
        daemon.start()
        try:
            daemon.wait_ready()
            timings = asyncio.run(measure(daemon.url, args.rounds, args.chats))
        finally:
            daemon.stop()
    diffs = [a - h for h, a in zip(timings["http"], timings["a2a"], strict=True)]
    result = {
        way: {
            "p50_ms": statistics.median(values) * 1000,
            "p95_ms": percentile(values, 95) * 1000,
        }
        for way, values in timings.items()
    }
    result["a2a_minus_http_ms"] = {"median_of_pairs": statistics.median(diffs) * 1000}
    result["rounds"] = args.rounds
    if args.json:
        print(json.dumps(result))
        return
    for way in ("http", "a2a"):
        print(f"{way:5} p50 {result[way]['p50_ms']:.2f} ms  p95 {result[way]['p95_ms']:.2f} ms")
    print(f"a2a - http (median of {args.rounds} pairs): {statistics.median(diffs) * 1000:+.2f} ms")


if __name__ == "__main__":
    main()
