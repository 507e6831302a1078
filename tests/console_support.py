"""A live daemon for the console tests (tests/test_console.py, test_console_browser.py):
`hermes-gateway run` in a subprocess with a token, seeded through its own HTTP API (a
session per chat, titled by its first message, and a schedule made with /schedule)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.commandline import finish, spawn, wait_ready

TOKEN = "console-test-token-7f3a"
# chat id -> its first message, which titles the chat's session
SEEDED = {
    "c-zebra": "Quarterly zebra report",
    "c-grocery": "Grocery list for Tuesday",
    "c-lisbon": "Trip to Lisbon in May",
}
SCHEDULE_CHAT = "c-zebra"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Daemon:
    url: str
    home: Path
    proc: subprocess.Popen[str]

    def api(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """The HTTP API with the bearer token: (status, JSON body)."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def say(self, chat_id: str, text: str) -> None:
        """Post a message and wait for the reply (the echo agent answers every one)."""
        _, before = self.api("GET", f"/v1/chats/{chat_id}/messages")
        status, body = self.api(
            "POST", "/v1/messages", {"chat_id": chat_id, "user_id": "alice", "text": text}
        )
        assert status == 202, body
        _, replies = self.api("GET", f"/v1/chats/{chat_id}/messages?after={before['next']}&wait=20")
        assert replies["messages"], f"no reply to {text!r} in {chat_id}"

    def session_id(self, chat_id: str) -> str:
        _, page = self.api("GET", "/v1/sessions?limit=1000")
        (found,) = [s for s in page["sessions"] if s["session_key"].endswith(f":{chat_id}")]
        return found["session_id"]

    def schedule_ids(self) -> list[str]:
        _, replies = self.api("GET", f"/v1/chats/{SCHEDULE_CHAT}/messages?limit=500")
        found = re.findall(r"sch_[0-9a-f]{8}", " ".join(r["text"] for r in replies["messages"]))
        return list(dict.fromkeys(found))


def start_daemon(home: Path, procs: list[subprocess.Popen[str]]) -> Daemon:
    """A daemon on a free port of 127.0.0.1, seeded with `SEEDED` and one schedule."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (home / "hermes.yaml").write_text(
        f"platforms:\n  http:\n    host: 127.0.0.1\n    port: {port}\n    token: {TOKEN}\n"
    )
    proc = spawn(home, "run")
    procs.append(proc)
    wait_ready(proc)
    daemon = Daemon(f"http://127.0.0.1:{port}", home, proc)
    for chat_id, text in SEEDED.items():
        daemon.say(chat_id, text)
    daemon.say(SCHEDULE_CHAT, "/schedule add every 2 hours water the plants")
    assert len(daemon.schedule_ids()) == 1
    return daemon


def stop_daemon(daemon: Daemon) -> str:
    code, out = finish(daemon.proc)
    assert code == 0, out
    return out
