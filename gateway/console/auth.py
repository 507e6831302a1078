"""Who may use the console: a login with the HTTP API's token (when one is set) opens a
console session, held server-side and named by a random id in a cookie (never the token);
each session has its CSRF token, which every POST must carry. Without a token the console
is served only while the API listens on a loopback address."""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from config import GatewayConfig, HttpConfig
from config.platforms import is_loopback_host

COOKIE = "hermes-console"
COOKIE_PATH = "/console"
SESSION_SECONDS = 12 * 3600  # a login lasts this long
MAX_SESSIONS = 256  # the oldest is forgotten past this many
LOGIN_FAILURES_PER_MINUTE = 10  # wrong tokens accepted per minute before 429
_ID_CHARS = 64  # two 32-byte hex tokens: session id and CSRF token


@dataclass(slots=True)
class ConsoleSession:
    csrf: str
    expires_at: float
    #: what the last action did, shown once on the page it redirects to: (text, error)
    flash: tuple[str, bool] | None = None

    def take_flash(self) -> tuple[str | None, bool]:
        flash, self.flash = self.flash, None
        return flash if flash is not None else (None, False)


def open_problem(config: HttpConfig) -> str | None:
    """Why the console is not served without a token (None: it is served)."""
    if config.token or is_loopback_host(config.host):
        return None
    return (
        f"the console is not served: platforms.http.host is {config.host}, not a loopback"
        " address, and platforms.http.token is unset; set a token (the console's login"
        " asks for it) or listen on 127.0.0.1"
    )


def check_config_line(gateway: GatewayConfig) -> str | None:
    """`check-config`'s line about the console, for an operator who set no token."""
    config = gateway.platforms.http
    serves_http = config.enabled or not gateway.connected_platforms()
    if not serves_http or not config.console or config.token:
        return None
    problem = open_problem(config)
    if problem is not None:
        return problem
    return (
        f"the console at /console/ on {config.host}:{config.port} needs no login: no"
        " platforms.http.token is set, so it is served on the loopback address only"
    )


def token_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


class ConsoleSessions:
    """The open console sessions, bounded in count and time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._open: OrderedDict[str, ConsoleSession] = OrderedDict()
        self._failures: list[float] = []

    def open(self) -> tuple[str, ConsoleSession]:
        now = self.clock()
        for sid in [sid for sid, s in self._open.items() if s.expires_at <= now]:
            del self._open[sid]
        while len(self._open) >= MAX_SESSIONS:
            self._open.popitem(last=False)
        sid = secrets.token_hex(32)
        session = ConsoleSession(csrf=secrets.token_hex(32), expires_at=now + SESSION_SECONDS)
        self._open[sid] = session
        return sid, session

    def find(self, sid: str | None) -> ConsoleSession | None:
        if not sid or len(sid) != _ID_CHARS:
            return None
        session = self._open.get(sid)
        if session is None:
            return None
        if session.expires_at <= self.clock():
            del self._open[sid]
            return None
        return session

    def close(self, sid: str | None) -> None:
        if sid:
            self._open.pop(sid, None)

    def login_allowed(self) -> bool:
        """False while more than `LOGIN_FAILURES_PER_MINUTE` wrong tokens came in the
        last minute: guessing the token stays slow."""
        cutoff = self.clock() - 60
        self._failures = [t for t in self._failures if t > cutoff]
        return len(self._failures) < LOGIN_FAILURES_PER_MINUTE

    def login_failed(self) -> None:
        self._failures.append(self.clock())


def csrf_ok(session: ConsoleSession, given: str | None) -> bool:
    if not given or len(given) != _ID_CHARS:
        return False
    return hmac.compare_digest(given.encode("ascii", "replace"), session.csrf.encode("ascii"))
