"""A real Matrix homeserver for the Matrix adapter's tests: Synapse (`matrix-synapse`
from PyPI, in the test extras) on SQLite in a temporary directory, on a free loopback
port, with no federation, rate limits raised for tests, and users registered by the
shared-secret admin API. It starts and stops with its test module."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from scripts.harness import free_port

SERVER_NAME = "hermes.test"
SECRET = "shared-secret-for-tests"
START_SECONDS = 90.0


def synapse_missing() -> str | None:
    try:
        import synapse  # noqa: F401
    except ImportError:
        return "matrix-synapse is not installed (it is in the test extras: make test)"
    return None


@dataclass
class Homeserver:
    url: str
    root: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def register(self, localpart: str, password: str = "pass-1234") -> dict[str, str]:
        """A new user (access_token, user_id, device_id) by the shared secret."""
        nonce = self._json("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(SECRET.encode(), digestmod=hashlib.sha1)
        mac.update(f"{nonce}\0{localpart}\0{password}\0notadmin".encode())
        return self._json(
            "POST",
            "/_synapse/admin/v1/register",
            {
                "nonce": nonce,
                "username": localpart,
                "password": password,
                "admin": False,
                "mac": mac.hexdigest(),
            },
        )

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            return json.loads(response.read())


@contextmanager
def synapse() -> Iterator[Homeserver]:
    root = Path(tempfile.mkdtemp(prefix="hermes-synapse-"))
    port = free_port()
    config = root / "homeserver.yaml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "synapse.app.homeserver",
            "--server-name",
            SERVER_NAME,
            "--config-path",
            str(config),
            "--generate-config",
            "--report-stats=no",
            "--data-directory",
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    (root / "log.yaml").write_text(
        "version: 1\n"
        "formatters: {plain: {format: '%(asctime)s %(levelname)s %(name)s %(message)s'}}\n"
        f"handlers: {{file: {{class: logging.FileHandler, filename: '{root}/synapse.log',"
        " formatter: plain}}\n"
        "root: {level: WARNING, handlers: [file]}\n"
        "disable_existing_loggers: false\n"
    )
    limits = "{per_second: 1000, burst_count: 1000}"
    overrides = f"""
listeners:
  - port: {port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args: {{database: '{root}/homeserver.db'}}
log_config: '{root}/log.yaml'
media_store_path: '{root}/media'
registration_shared_secret: '{SECRET}'
enable_registration: false
report_stats: false
trusted_key_servers: []
suppress_key_server_warning: true
use_presence: false
url_preview_enabled: false
max_upload_size: 10M
rc_message: {limits}
rc_registration: {limits}
rc_joins: {{local: {limits}, remote: {limits}}}
rc_invites: {{per_room: {limits}, per_user: {limits}, per_issuer: {limits}}}
rc_login: {{address: {limits}, account: {limits}, failed_attempts: {limits}}}
rc_admin_redaction: {limits}
"""
    kept = [
        line
        for line in config.read_text().splitlines()
        if line.split(":", 1)[0].strip()
        in ("server_name", "pid_file", "macaroon_secret_key", "form_secret", "signing_key_path")
    ]
    config.write_text("\n".join(kept) + "\n" + overrides)
    process = subprocess.Popen(
        [sys.executable, "-m", "synapse.app.homeserver", "--config-path", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, root)
        yield Homeserver(url, root, process)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        shutil.rmtree(root, ignore_errors=True)


def _wait_ready(url: str, process: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace")[-3000:] if process.stderr else ""
            log = (
                (root / "synapse.log").read_text()[-3000:]
                if (root / "synapse.log").exists()
                else ""
            )
            raise RuntimeError(f"synapse exited {process.returncode}: {err}\n{log}")
        try:
            with urllib.request.urlopen(f"{url}/_matrix/client/versions", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("synapse did not answer within its start time")
