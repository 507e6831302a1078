"""schemathesis (a tool we did not write) against a live daemon with a token: every
operation of its /openapi.json fuzzed with valid and invalid input, no server error,
and every answer as the description says (status, content type, body).

The console's routes (their security is the console's session cookie) are fuzzed twice:
logged in (the cookie of a real login, fixed like the bearer token) and with a cookie
naming no console session (pages answer a redirect to the login, changes 403). Their
changes never happen: the CSRF token schemathesis makes up is never the session's.

Exclusions, each for a reason:
- `GET /v1/chats/{chat_id}/stream` is not called: its 200 is a server-sent event stream
  that lasts until the client goes, so a client that reads the whole response never
  ends. Its path and query go through the same models as the long poll's (ChatPath,
  and the same digits rule), which are fuzzed here; its stream is tested in
  tests/test_streaming.py.
- `GET /console/events` is not called either: the console's overview stream, unending
  like the API's; its login answer (401) is tested in tests/test_console.py.
- The long poll's `wait` is cut to at most 0.05 s before each call: a valid `wait` up
  to 60 s on a chat with no reply would make one example last a minute. Whatever `wait`
  schemathesis chose, invalid ones included, is sent as it was otherwise.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.console.auth import COOKIE
from tests.commandline import finish, spawn, wait_ready

TOKEN = "fuzz-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 12  # per operation and mode; the time guard at the end catches a runaway value
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
NOT_CALLED = {  # unending responses (module docstring)
    "GET /v1/chats/{chat_id}/stream",
    "GET /console/events",
}
NO_SESSION = "0" * 64  # a cookie of the right shape naming no console session
_DIGITS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def daemon_url(tmp_path: Path, procs: list[subprocess.Popen[str]]) -> Iterator[str]:
    port = _free_port()
    (tmp_path / "hermes.yaml").write_text(
        "platforms:\n"
        f"  http:\n    enabled: true\n    host: 127.0.0.1\n    port: {port}\n"
        f"    token: {TOKEN}\n"
        "a2a:\n  enabled: true\n"
    )
    daemon = spawn(tmp_path, "run")
    procs.append(daemon)
    wait_ready(daemon)
    yield f"http://127.0.0.1:{port}"
    code, out = finish(daemon)
    assert code == 0, out
    assert "http_api_error" not in out, out  # a 500's traceback, had there been one


def _bounded_wait(case: schemathesis.Case) -> None:
    """The long poll's `wait`, if a valid number, cut to 0.05 s (module docstring)."""
    wait = (case.query or {}).get("wait")
    if isinstance(wait, int | float) or (isinstance(wait, str) and _DIGITS.fullmatch(wait)):
        if float(wait) > 0.05:
            case.query["wait"] = "0.05"


def _console_login(url: str) -> str:
    response = requests.post(
        f"{url}/console/login", data={"token": TOKEN}, allow_redirects=False, timeout=10
    )
    assert response.status_code == 303, response.text
    return response.cookies[COOKIE]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(daemon_url: str) -> None:
    logged_in = {COOKIE: _console_login(daemon_url)}
    schema = schemathesis.openapi.from_url(f"{daemon_url}/openapi.json", timeout=10)
    began = time.monotonic()
    tested = []
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        if label in NOT_CALLED:
            continue
        raw = schema.raw_schema["paths"][operation.path][operation.method.lower()]
        modes = [schemathesis.GenerationMode.POSITIVE]
        if "parameters" in raw or "requestBody" in raw:  # else there is nothing to spoil
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        cookies: list[dict[str, str] | None] = [None]
        if {COOKIE: []} in raw["security"]:
            cookies = [logged_in, {COOKIE: NO_SESSION}]
        for mode, cookie in [(mode, cookie) for mode in modes for cookie in cookies]:
            # The token and the cookie are fixed, never spoilt: a case made invalid by
            # them alone would be a valid request once they are added.
            strategy = operation.as_strategy(generation_mode=mode, headers=AUTH, cookies=cookie)

            @given(case=strategy)
            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case: schemathesis.Case) -> None:
                _bounded_wait(case)
                response = case.call_and_validate(checks=CHECKS, timeout=10)
                statuses[response.status_code] += 1

            run()
        tested.append(label)
    described = {
        f"{method.upper()} {path}"
        for path, methods in schema.raw_schema["paths"].items()
        for method in methods
    }
    # schemathesis leaves out the operation its schema was loaded from (/openapi.json)
    assert set(tested) == described - NOT_CALLED - {"GET /openapi.json"}
    assert {"POST /v1/messages", "DELETE /v1/sessions/{session_id}", "POST /a2a/{agent}"} <= set(
        tested
    )
    assert 401 not in statuses, statuses  # the token went with every case
    assert statuses[200] and statuses[202] and statuses[400], statuses
    assert statuses[303] and statuses[403], statuses  # the console's login and CSRF answers
    assert {"GET /console/sessions", "POST /console/notes/delete"} <= set(tested)
    # A guard against a runaway EXAMPLES, not a speed figure: loose enough for a slow
    # machine running the suite two tests at a time.
    assert time.monotonic() - began < 90, "schemathesis took too long; lower EXAMPLES"
