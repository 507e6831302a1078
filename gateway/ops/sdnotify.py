"""A tiny sd_notify client: tell systemd we are ready, stopping, and still alive.

Speaks the datagram protocol of sd_notify(3) on ``$NOTIFY_SOCKET`` (a filesystem path,
or an abstract socket written with a leading ``@``). Without ``$NOTIFY_SOCKET`` (not
started by systemd, or not ``Type=notify``) every method is a no-op returning False.
Sending never raises: a lost notification must not take the gateway down.
"""

from __future__ import annotations

import asyncio
import os
import socket

import structlog

log = structlog.get_logger(__name__)


class SystemdNotifier:
    """Sends state lines such as ``READY=1`` to the service manager.

    The environment is read once, at construction.
    """

    def __init__(self) -> None:
        self.address = _socket_address(os.environ.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec = _watchdog_usec()

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one datagram of newline-separated ``KEY=value`` lines; True when sent."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(state.encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify_failed", state=state, error=str(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1" if status is None else f"READY=1\nSTATUS={status}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog_interval(self) -> float | None:
        """Seconds between keep-alive pings (half of ``WatchdogSec=``), or None when
        systemd expects none from this process."""
        if self.address is None or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 1_000_000 / 2


async def run_watchdog(notifier: SystemdNotifier, interval: float) -> None:
    """Ping the watchdog every ``interval`` seconds until cancelled.

    Runs on the event loop on purpose: a blocked loop stops the pings and systemd
    restarts the service.
    """
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


def _socket_address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # Linux abstract namespace
    if value.startswith("/"):
        return value
    if value:
        log.debug("sd_notify_unsupported_socket", notify_socket=value)
    return None


def _watchdog_usec() -> int | None:
    """``$WATCHDOG_USEC`` when it is meant for this process (``$WATCHDOG_PID`` unset or ours)."""
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None
