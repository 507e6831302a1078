"""What the gateway adds to an MCP tool call, over the server's own time: the same call
(`add` of tests/fakes/mcp_server.py, a stdio child) made three ways, interleaved:

    sdk      the official SDK's client alone (`mcp.client.Client` over stdio): the
             server's own time as any client sees it (its process, the pipes, the SDK)
    hub      the gateway's MCP hub (`McpHub.call`: supervision, routing, the result as
             the model's text)
    turn     one round of one call through the turn's tools (`TurnTools.run_round`):
             the hub, the registry and the tool-call journal on a real store (SQLite,
             or PostgreSQL with --postgres), every record awaited as a turn awaits it

    .venv/bin/python scripts/bench_mcp_call.py [--calls 1000] [--postgres DSN]

Prints each way's median and p99 and `turn - sdk`: what a turn with one MCP call adds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from config import GatewayConfig
from config.mcp import ALL_MCP
from gateway.mcp import McpHub
from gateway.store.session_store import SessionStore
from gateway.tools.mcp_tools import McpToolSource
from gateway.tools.registry import Toolbox, TurnScope
from scripts.bench_tool_journal import SOURCE, begin_turn
from scripts.harness import percentile

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "mcp_server.py"
ARGS = {"a": 2, "b": 3}


async def main_async(calls: int, dsn: str | None) -> dict[str, list[float]]:
    data: dict = {
        "timezone": "UTC",
        "mcp": {"servers": {"fake": {"command": sys.executable, "args": [str(FAKE), "stdio"]}}},
    }
    if dsn:
        data["storage"] = {"backend": "postgres", "dsn": dsn}
    config = GatewayConfig.model_validate(data)
    timings: dict[str, list[float]] = {"sdk": [], "hub": [], "turn": []}
    params = StdioServerParameters(command=sys.executable, args=[str(FAKE), "stdio"])
    with tempfile.TemporaryDirectory(prefix="hermes-bench-mcp-") as tmp:
        hub = McpHub(config.mcp, Path(tmp))
        await hub.start()
        try:
            async with (
                Client(stdio_client(params)) as sdk,
                SessionStore(Path(tmp) / "sessions", config) as store,
            ):
                box = Toolbox([], [], McpToolSource(hub, ALL_MCP))
                key = store.session_key_for(SOURCE)
                start = await begin_turn(store)
                assert start.user_row is not None
                call = {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "fake__add", "arguments": '{"a": 2, "b": 3}'},
                }
                for number in range(calls + 100):  # the first 100: warm-up
                    began = time.perf_counter()
                    answer = await sdk.call_tool("add", ARGS)
                    sdk_s = time.perf_counter() - began
                    assert not answer.is_error
                    began = time.perf_counter()
                    assert (await hub.call("fake__add", ARGS)).text == "5"
                    hub_s = time.perf_counter() - began
                    # A turn of its own each time (its journal starts empty), as in a turn.
                    scope = TurnScope(
                        store,
                        None,
                        key,
                        start.entry.session_id,
                        SOURCE,
                        "main",
                        user_row=start.user_row + number + 1,
                    )
                    began = time.perf_counter()
                    messages = await box.bind(scope).run_round(None, [call])
                    turn_s = time.perf_counter() - began
                    assert messages[-1]["content"] == "5"
                    if number >= 100:
                        timings["sdk"].append(sdk_s)
                        timings["hub"].append(hub_s)
                        timings["turn"].append(turn_s)
        finally:
            await hub.stop()
    return timings


def main() -> None:
    # The per-call log line is not what is measured, and would flood the output.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--postgres", metavar="DSN")
    args = parser.parse_args()
    timings = asyncio.run(main_async(args.calls, args.postgres))
    medians = {way: statistics.median(values) for way, values in timings.items()}
    for way, values in timings.items():
        p99 = percentile(values, 99)
        print(f"{way:>4}: median {medians[way] * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms")
    added = (medians["turn"] - medians["sdk"]) * 1e3
    print(f"turn - sdk (what a turn with one MCP call adds): {added:.2f} ms")
    print(f"hub - sdk (the hub alone): {(medians['hub'] - medians['sdk']) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
