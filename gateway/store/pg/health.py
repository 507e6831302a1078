"""What `doctor` asks a PostgreSQL store: does it answer, at which schema version, and
is the cluster's `leases` table there. Read-only; the DSN's password never leaves here."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.store.pg.dsn import scrub

CONNECT_TIMEOUT_SECONDS = 5


@dataclass(frozen=True)
class StoreHealth:
    error: str | None = None  # why it could not be asked (connection, permissions)
    server: str = ""  # e.g. "PostgreSQL 15.8"
    schema: str | None = None  # where the tables are (None: search_path names no schema)
    version: int = 0  # hermes_schema's, 0: no schema yet
    leases_table: bool = False
    leases: int = 0  # rows held (live or expired)
    expired_leases: int = 0


def inspect(dsn: str) -> StoreHealth:
    # Imported here: `doctor` on an SQLite home never loads the driver.
    import psycopg

    from gateway.store.pg.schema import schema_version

    try:
        with psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT_SECONDS, autocommit=True) as conn:
            row = conn.execute("SELECT version(), current_schema()").fetchone()
            server = " ".join(str(row[0]).split()[:2]) if row else "PostgreSQL"
            if not (row and row[1]):
                return StoreHealth(server=server)
            found = StoreHealth(server=server, schema=row[1], version=schema_version(conn))
            exists = conn.execute("SELECT to_regclass('leases') IS NOT NULL").fetchone()
            if not (exists and exists[0]):
                return found
            counts = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE expires_at < extract(epoch FROM now()))"
                " FROM leases"
            ).fetchone() or (0, 0)
    except psycopg.Error as exc:
        return StoreHealth(error=scrub(str(exc).strip(), dsn) or type(exc).__name__)
    return replace(found, leases_table=True, leases=int(counts[0]), expired_leases=int(counts[1]))
