"""`hermes-gateway storage migrate --to DSN`: the command line only. The copy itself is
gateway.ops.storage_migrate, imported when the command runs: every other command (and the
daemon on SQLite) starts without loading the PostgreSQL driver."""

from __future__ import annotations

import argparse
from typing import Any

from config import GatewayConfig


def add_storage_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    storage = sub.add_parser("storage", parents=parents, help="move the store to PostgreSQL")
    storage_sub = storage.add_subparsers(dest="storage_command", required=True)
    copy = storage_sub.add_parser(
        "migrate",
        parents=parents,
        help="copy state.db into an empty PostgreSQL database (the gateway must be stopped)",
    )
    copy.add_argument(
        "--to",
        required=True,
        metavar="DSN",
        help="postgresql://USER[:PASSWORD]@HOST[:PORT]/DB; ${VAR} is read from the"
        " environment, and libpq reads PGPASSWORD",
    )
    storage.set_defaults(handler=cmd_storage)


def cmd_storage(args: argparse.Namespace, config: GatewayConfig) -> int:
    from gateway.ops import storage_migrate

    return storage_migrate.cmd_storage(args, config)
