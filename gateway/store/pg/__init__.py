"""The PostgreSQL backend of the store: its schema, connection and SQL dialect.

This package's own namespace imports no psycopg: a gateway on SQLite (the default) never
loads the driver (22 MiB of RSS), and the shared store code asks only what is here.
"""

from __future__ import annotations

import sys


def is_postgres(conn: object) -> bool:
    """Whether a store function was handed a PostgreSQL connection (`PgConn`)."""
    return getattr(conn, "dialect", None) == "postgres"


def driver_errors() -> tuple[type[BaseException], ...]:
    """psycopg's base error once psycopg is loaded (a PostgreSQL store), else nothing to
    catch: a gateway that never imported the driver cannot get its errors."""
    psycopg = sys.modules.get("psycopg")
    return (psycopg.Error,) if psycopg is not None else ()
