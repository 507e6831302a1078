"""The background housekeeper (seed section 10): finalize expired sessions, close idle
cached agents, prune old routing entries.

Every `housekeeping.expiry_interval_seconds` (300 s): for each expired, not yet
finalized session run the `on_session_finalize` hooks, close and evict its cached agent,
and set `expiry_finalized`. A session whose hooks fail is retried on the next passes;
after `finalize_max_attempts` failures it is finalized anyway so it cannot loop forever.
Pruning by `session_store_max_age_days` runs every `prune_interval_seconds` (1 h), with
the journal expiry (inbox ids older than `storage.inbound_dedup_days`). Each pass also
re-sends reply chunks that a platform failed to take earlier; `send_pending_soon` does
that at once for a reply another process recorded (`pairing approve`'s notice).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from gateway.runner.ports import HousekeeperHost
from gateway.store import media_files
from gateway.store.outage import StoreUnwritable

log = structlog.get_logger("gateway.housekeeping")

RESEND_AFTER_SECONDS = 30.0


class Housekeeper:
    def __init__(self, runner: HousekeeperHost) -> None:
        self.runner = runner
        self.settings = runner.config.housekeeping
        self.passes = 0
        self.finalized = 0
        self.pruned = 0
        self._failures: dict[str, int] = {}
        self._last_prune = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._sender: asyncio.Task[None] | None = None  # send_pending_soon's passes
        self._send_again = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="housekeeper")

    async def stop(self) -> None:
        for task in (self._task, self._sender):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._sender = None

    def send_pending_soon(self) -> None:
        """Send every pending reply now, not at the next pass (ignored unless running).

        Fresh rows are safe to take, as at start-up: a row this process records is
        claimed by its sender before a read on the writer can hand it to this pass."""
        self._send_again = True
        if self._task is not None and (self._sender is None or self._sender.done()):
            self._sender = asyncio.create_task(self._send_pending(), name="send-pending")

    async def _send_pending(self) -> None:
        while self._send_again:  # a nudge during a pass gets a pass of its own
            self._send_again = False
            try:
                await self.runner.resend_pending()
            except Exception:
                log.exception("send_pending_failed")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.expiry_interval_seconds)
            try:
                await self.run_once()
            except StoreUnwritable:
                pass  # the store logs a disk that refuses writes; the next pass tries again
            except Exception:
                log.exception("housekeeping_pass_failed")

    async def run_once(self) -> None:
        """One pass: finalize expired sessions, sweep idle agents, prune when due."""
        self.passes += 1
        await self.runner.resend_pending(RESEND_AFTER_SECONDS)  # replies a platform refused
        await self.finalize_expired()
        swept = await self.runner.agents.sweep_idle()
        if swept:
            log.info("idle_agents_closed", count=swept)
        if time.monotonic() - self._last_prune >= self.settings.prune_interval_seconds:
            self._last_prune = time.monotonic()
            pruned = await self.runner.store.prune_old_entries(
                self.runner.config.session_store_max_age_days
            )
            self.pruned += pruned
            if pruned:
                log.info("sessions_pruned", count=pruned)
            await self.runner.turnlog.expire(self.runner.config.storage.inbound_dedup_days)
        # Files of sessions deleted or pruned by any path (the CLI, forgetting a user).
        swept = await media_files.sweep(self.runner.store)
        if swept:
            log.info("media_swept", sessions=swept)

    async def finalize_expired(self) -> int:
        runner = self.runner
        done = 0
        for entry in await runner.store.expired_entries():
            key = entry.session_key
            if runner.is_busy(key):
                continue  # a turn is running; it is not idle after all
            try:
                for hook in runner.finalize_hooks:
                    await hook(entry)
            except Exception as exc:
                attempts = self._failures.get(key, 0) + 1
                self._failures[key] = attempts
                if attempts < self.settings.finalize_max_attempts:
                    log.warning(
                        "finalize_hook_failed", session_key=key, attempt=attempts, error=str(exc)
                    )
                    continue
                log.error("finalize_forced", session_key=key, attempts=attempts, error=str(exc))
            self._failures.pop(key, None)
            await runner.agents.evict(key)
            await runner.store.set_expiry_finalized(key)
            done += 1
        self.finalized += done
        return done
