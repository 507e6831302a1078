"""The A2A conformance kit (a2aproject/a2a-tck, a checkout of your own: it is not a
dependency) run against this gateway's A2A server and, the same way, against the
a2a-sdk's own server (tests/a2a_reference_agent.py, an echo agent with 0.3
compatibility on), side by side:

    .venv/bin/python scripts/a2a_conformance.py --tck /path/to/a2a-tck [--json]

The kit runs with its own interpreter (`<tck>/.venv/bin/python`, made with
`python3 -m venv .venv && .venv/bin/pip install -e .` in the checkout), its mandatory
category restricted to JSON-RPC (`-m "mandatory or mandatory_protocol or
mandatory_jsonrpc"`, what `run_tck.py --category mandatory --transports jsonrpc`
selects). Prints each test's outcome on both servers, the counts, and the tests the
reference passes that ours does not (the bar: none).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.harness import Daemon, free_port

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "tests" / "a2a_reference_agent.py"
MARKERS = "mandatory or mandatory_protocol or mandatory_jsonrpc"
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+)")
TCK_TIMEOUT_SECONDS = 900


def run_tck(tck: Path, url: str) -> dict[str, str]:
    """Each test's outcome (PASSED, FAILED, ...) by test id."""
    python = tck / ".venv" / "bin" / "python"
    command = [
        str(python), "-m", "pytest", "tests/mandatory/", f"--sut-url={url}",
        "--test-scope=all", "--tb=no", "-q", "-rA", "-m", MARKERS, "-p", "no:cacheprovider",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tck, capture_output=True, text=True, timeout=TCK_TIMEOUT_SECONDS
    )
    outcomes: dict[str, str] = {}
    for line in done.stdout.splitlines():
        match = OUTCOME.match(line)
        if match and "::" in match.group(2):
            outcomes[match.group(2)] = match.group(1)
    if not outcomes:
        raise RuntimeError(
            f"the kit reported no tests:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return outcomes


def wait_for_card(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/.well-known/agent-card.json", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tck", type=Path, required=True, help="an a2a-tck checkout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port = free_port()
    reference = subprocess.Popen([sys.executable, str(REFERENCE), "--port", str(port)])
    settings = "agent:\n  backend: echo\n  delay_seconds: 0\na2a:\n  enabled: true\n"
    try:
        with tempfile.TemporaryDirectory(prefix="hermes-a2a-tck-") as tmp:
            daemon = Daemon(Path(tmp) / "home", settings)
            daemon.start()
            try:
                daemon.wait_ready()
                wait_for_card(f"http://127.0.0.1:{port}")
                ours = run_tck(args.tck, f"{daemon.url}/a2a/main")
                theirs = run_tck(args.tck, f"http://127.0.0.1:{port}/")
            finally:
                daemon.stop()
    finally:
        reference.terminate()
        reference.wait(timeout=10)
    tests = sorted(set(ours) | set(theirs))
    short_of = [t for t in tests if theirs.get(t) == "PASSED" and ours.get(t) != "PASSED"]
    counts = {
        name: {o: list(result.values()).count(o) for o in sorted(set(result.values()))}
        for name, result in (("hermes", ours), ("sdk_reference", theirs))
    }
    if args.json:
        print(json.dumps({"counts": counts, "short_of_reference": short_of,
                          "tests": {t: [ours.get(t), theirs.get(t)] for t in tests}}))  # fmt: skip
        return
    print(f"{'test':100} {'hermes':8} {'sdk ref':8}")
    for test in tests:
        print(f"{test[:100]:100} {ours.get(test, '-'):8} {theirs.get(test, '-'):8}")
    print(f"hermes: {counts['hermes']}")
    print(f"sdk reference: {counts['sdk_reference']}")
    print(f"passed by the reference, not by hermes: {len(short_of)}")
    for test in short_of:
        print(f"  {test}")


if __name__ == "__main__":
    main()
