"""DM pairing: an unknown user gets a short code; the operator approves it.

    unknown user DMs the bot  -> code (8 characters, no look-alikes, valid 1 hour;
                                 at most 3 pending per platform; the same user keeps
                                 the same code while it is valid)
    hermes-gateway pairing approve telegram K7MQ2XPA  -> the user may talk to the bot,
                                                         and is told so in their DM
    hermes-gateway pairing revoke telegram 12345      -> and no longer

Both the daemon and the CLI use the store's database, so an approval from another
process counts for the very next message. The approval notice is recorded in the
delivery ledger in the approving transaction, so it is sent once even across restarts:
by the running daemon at once (`approve` nudges it with SIGUSR2), else by its next
housekeeping pass or start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass
from typing import Any

import structlog

from config import ChatPlatformConfig, GatewayConfig, PlatformsConfig, hermes_home
from gateway.domain.session import SessionSource
from gateway.store import codec, journal
from gateway.store.homelock import held_by
from gateway.store.session_store import SessionStore

# A-Z and 2-9 without I, O (and without 0, 1): nothing to confuse when read aloud.
ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 8
CODE_TTL_SECONDS = 3600
MAX_PENDING_PER_PLATFORM = 3
#: where users can ask to pair: the chat platforms (the HTTP API has no access rules)
PAIRING_PLATFORMS = tuple(
    name
    for name, field in PlatformsConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, ChatPlatformConfig)
)
APPROVED_NOTICE = "You're approved; send a message to start."

log = structlog.get_logger("gateway.pairing")


@dataclass(frozen=True, slots=True)
class PairingRequest:
    platform: str
    code: str
    user_id: str
    user_name: str | None
    created_at: float
    #: the DM the code was asked from, where the approval notice goes (None for codes
    #: handed out before it was recorded)
    target: SessionSource | None = None


def new_code() -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(CODE_LENGTH))


class Pairing:
    """Pairing state in the store's database (tables `pairing_codes`, `paired_users`)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    async def is_paired(self, platform: str, user_id: str) -> bool:
        return await self.store.read(
            lambda conn: (
                conn.execute(
                    "SELECT 1 FROM paired_users WHERE platform = ? AND user_id = ?",
                    (platform, user_id),
                ).fetchone()
                is not None
            )
        )

    async def request(
        self,
        platform: str,
        user_id: str,
        user_name: str | None,
        *,
        target: SessionSource | None = None,
    ) -> str | None:
        """The user's pairing code; None when the platform has too many pending already.

        `target` is the DM to tell them in once the code is approved (the latest DM they
        asked from). Logs one line per request (not the code: `pairing list` shows it to
        the operator), with `outcome` new_code, same_code (asked again while valid) or
        too_many_pending."""
        now = time.time()
        target_json = codec.dumps(target.to_dict()) if target is not None else None
        outcome = "new_code"

        def tx(conn: sqlite3.Connection) -> str | None:
            nonlocal outcome
            conn.execute(
                "DELETE FROM pairing_codes WHERE created_at < ?", (now - CODE_TTL_SECONDS,)
            )
            row = conn.execute(
                "UPDATE pairing_codes SET target = coalesce(?, target)"
                " WHERE platform = ? AND user_id = ? RETURNING code",
                (target_json, platform, user_id),
            ).fetchone()
            if row:
                outcome = "same_code"
                return str(row[0])
            (pending,) = conn.execute(
                "SELECT COUNT(*) FROM pairing_codes WHERE platform = ?", (platform,)
            ).fetchone()
            if pending >= MAX_PENDING_PER_PLATFORM:
                outcome = "too_many_pending"
                return None
            outcome = "new_code"
            code = new_code()
            conn.execute(
                "INSERT INTO pairing_codes (platform, code, user_id, user_name, created_at,"
                " target) VALUES (?, ?, ?, ?, ?, ?)",
                (platform, code, user_id, user_name, now, target_json),
            )
            return code

        code = await self.store.write(tx, dirty=False)
        log.info(
            "pairing_requested",
            platform=platform,
            user_id=user_id,
            user_name=user_name,
            outcome=outcome,
        )
        return code

    async def pending(self) -> list[PairingRequest]:
        cutoff = time.time() - CODE_TTL_SECONDS
        rows = await self.store.read(
            lambda conn: conn.execute(
                "SELECT platform, code, user_id, user_name, created_at FROM pairing_codes"
                " WHERE created_at >= ? ORDER BY created_at",
                (cutoff,),
            ).fetchall()
        )
        return [PairingRequest(*row) for row in rows]

    async def paired(self) -> list[dict[str, Any]]:
        rows = await self.store.read(
            lambda conn: conn.execute(
                "SELECT platform, user_id, user_name, approved_at FROM paired_users"
                " ORDER BY platform, approved_at"
            ).fetchall()
        )
        names = ("platform", "user_id", "user_name", "approved_at")
        return [dict(zip(names, row, strict=True)) for row in rows]

    async def approve(self, platform: str, code: str) -> PairingRequest | None:
        """Approve a valid code (case-insensitive); None when unknown or expired. The
        user's notice is recorded in the delivery ledger in the same transaction."""
        now = time.time()
        code = code.strip().upper()

        def tx(conn: sqlite3.Connection) -> PairingRequest | None:
            row = conn.execute(
                "DELETE FROM pairing_codes WHERE platform = ? AND code = ? AND created_at >= ?"
                " RETURNING platform, code, user_id, user_name, created_at, target",
                (platform, code, now - CODE_TTL_SECONDS),
            ).fetchone()
            if row is None:
                return None
            *fields, target_json = row
            target = SessionSource.from_dict(codec.loads(target_json)) if target_json else None
            request = PairingRequest(*fields, target=target)
            if target is not None:
                journal.record_outbound(
                    conn, target, [APPROVED_NOTICE], reply_to=None, session_key=None, now=now
                )
            conn.execute(
                "INSERT OR REPLACE INTO paired_users (platform, user_id, user_name, approved_at)"
                " VALUES (?, ?, ?, ?)",
                (platform, request.user_id, request.user_name, now),
            )
            return request

        return await self.store.write(tx, dirty=False)

    async def deny(self, platform: str, code: str) -> bool:
        """Drop a pending code (the user may ask again later); False when none such."""
        code = code.strip().upper()
        return await self.store.write(
            lambda conn: (
                conn.execute(
                    "DELETE FROM pairing_codes WHERE platform = ? AND code = ?", (platform, code)
                ).rowcount
                > 0
            ),
            dirty=False,
        )

    async def revoke(self, platform: str, user_id: str) -> bool:
        return await self.store.write(
            lambda conn: (
                conn.execute(
                    "DELETE FROM paired_users WHERE platform = ? AND user_id = ?",
                    (platform, user_id),
                ).rowcount
                == 1
            ),
            dirty=False,
        )


# --- CLI: hermes-gateway pairing list | approve PLATFORM CODE | revoke PLATFORM USER_ID -----


def add_pairing_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    pairing = subparsers.add_parser(
        "pairing", parents=parents, help="approve users who asked to talk to the bot"
    )
    verbs = pairing.add_subparsers(dest="pairing_command", required=True)
    verbs.add_parser("list", parents=parents, help="pending codes and paired users")
    # An unknown platform is a usage error that names it and the valid ones, before
    # anything is opened.
    platform = argparse.ArgumentParser(add_help=False)
    platform.add_argument(
        "platform",
        metavar="PLATFORM",
        choices=PAIRING_PLATFORMS,
        help="one of: " + ", ".join(PAIRING_PLATFORMS),
    )
    approve = verbs.add_parser(
        "approve", parents=[*parents, platform], help="approve a pairing code"
    )
    approve.add_argument("code")
    revoke = verbs.add_parser("revoke", parents=[*parents, platform], help="remove a paired user")
    revoke.add_argument("user_id")
    pairing.set_defaults(handler=cmd_pairing)


def cmd_pairing(args: argparse.Namespace, config: GatewayConfig) -> int:
    async def run() -> int:
        async with SessionStore(hermes_home() / "sessions", config) as store:
            pairing = Pairing(store)
            if args.pairing_command == "approve":
                request = await pairing.approve(args.platform, args.code)
                if request is None:
                    print(f"no valid code {args.code!r} for {args.platform}", file=sys.stderr)
                    return 1
                who = (
                    f"{request.user_name} ({request.user_id})"
                    if request.user_name
                    else (request.user_id)
                )
                print(f"approved {who} on {args.platform}; {_tell(request)}")
                return 0
            if args.pairing_command == "revoke":
                if await pairing.revoke(args.platform, args.user_id):
                    print(f"revoked {args.user_id} on {args.platform}")
                    return 0
                print(f"{args.user_id} is not paired on {args.platform}", file=sys.stderr)
                return 1
            pending = await pairing.pending()
            print("pending codes:" if pending else "no pending codes")
            for r in pending:
                age = int((time.time() - r.created_at) // 60)
                print(
                    f"  {r.platform:9} {r.code}  {r.user_name or '-'} ({r.user_id}), {age} min ago"
                )
            paired = await pairing.paired()
            print("paired users:" if paired else "no paired users")
            for p in paired:
                print(f"  {p['platform']:9} {p['user_id']}  {p['user_name'] or '-'}")
            return 0

    return asyncio.run(run())


def _tell(request: PairingRequest) -> str:
    """Have the running daemon send the approval notice now; say how the user learns."""
    if request.target is None:
        return "tell them they can start (their code predates approval notices)"
    # The home's lock names the live daemon (a status file could name a reused pid).
    holder = held_by(hermes_home())
    if holder is None or holder.pid is None:
        return "they are told when the gateway next starts"
    try:
        # SIGUSR2: "send what is pending in the delivery ledger" (gateway.cli.serve).
        os.kill(holder.pid, signal.SIGUSR2)
    except OSError:  # another user's daemon: its housekeeping pass sends it
        return "the gateway tells them within a few minutes"
    return "the gateway is telling them now"
