"""PostgreSQL for tests: the server at HERMES_TEST_PG_DSN, a fresh schema per use.

Each test (or module) gets a schema of its own, `t_<random hex>`, dropped with CASCADE
afterwards, and a DSN whose `options` put search_path on it: code under test connects
with that DSN and sees only its own tables. Tests skip, with the reason, only when no
server answers.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from config import GatewayConfig
from gateway.store.pg.dsn import redact

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
CONNECT_TIMEOUT_SECONDS = 3


def pg_dsn() -> str:
    """The test server's DSN: $HERMES_TEST_PG_DSN, else the local trust-auth default."""
    return os.environ.get("HERMES_TEST_PG_DSN") or DEFAULT_DSN


@functools.cache
def pg_available() -> str | None:
    """None when the test server answers, else why not (asked once per test run)."""
    try:
        with psycopg.connect(pg_dsn(), connect_timeout=CONNECT_TIMEOUT_SECONDS) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return f"no PostgreSQL at {redact(pg_dsn())}: {str(exc).strip()}"
    return None


def schema_dsn(schema: str) -> str:
    """The test server's DSN with search_path on `schema` (and nothing else)."""
    return make_conninfo(pg_dsn(), options=f"-c search_path={schema}")


@contextmanager
def fresh_schema() -> Iterator[str]:
    """A new empty schema on the test server: yields a DSN on it, drops it at the end.
    Skips the test when no server answers."""
    reason = pg_available()
    if reason is not None:
        pytest.skip(reason)
    schema = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(pg_dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema_dsn(schema)
    finally:
        with psycopg.connect(pg_dsn(), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


@pytest.fixture
def pg_schema_dsn() -> Iterator[str]:
    """A DSN on a fresh schema of the test server (import this fixture to use it)."""
    with fresh_schema() as dsn:
        yield dsn


@dataclass(frozen=True)
class StorageBackend:
    """A store backend under test (the `store_backend` fixture, tests/conftest.py)."""

    name: str  # "sqlite" or "postgres"
    dsn: str | None  # the PostgreSQL schema's DSN

    @property
    def postgres(self) -> bool:
        return self.name == "postgres"

    def storage(self) -> dict[str, str]:
        """The `storage:` config keys that select this backend."""
        return {"backend": "postgres", "dsn": self.dsn or ""} if self.postgres else {}

    def apply(self, config: GatewayConfig) -> GatewayConfig:
        """`config` with its store on this backend."""
        if not self.postgres:
            return config
        storage = config.storage.model_copy(update=self.storage())
        return config.model_copy(update={"storage": storage})
