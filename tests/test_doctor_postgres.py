"""`doctor` on a PostgreSQL store (storage.backend: postgres): connectivity, the schema
version and the `leases` table, reported like the state.db checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.store.migrations import SCHEMA_VERSION
from gateway.store.pg.schema import migrate
from tests.commandline import cli
from tests.pg_support import pg_available, pg_dsn, pg_schema_dsn

__all__ = ["pg_schema_dsn"]  # the fixture, imported for pytest

SECRET = "doctor-S3cret"


def schema_of(dsn: str) -> str:
    return conninfo_to_dict(dsn)["options"].rpartition("=")[2]


def doctor_on(tmp_path: Path, dsn: str) -> tuple[int, dict[str, Any], str]:
    """`doctor --json` on a home whose config points at `dsn`: (exit code, findings by
    name, everything printed)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    # JSON is YAML: the DSN quoted whatever it holds.
    storage = {"storage": {"backend": "postgres", "dsn": dsn}}
    (home / "hermes.yaml").write_text(json.dumps(storage))
    done = cli(home, "doctor", "--json")
    found = {f["name"]: f for f in json.loads(done.stdout)} if done.stdout else {}
    return done.returncode, found, done.stdout + done.stderr


def test_a_fresh_database_is_ok_and_says_it_has_no_schema_yet(
    tmp_path: Path, pg_schema_dsn: str
) -> None:
    rc, found, _ = doctor_on(tmp_path, pg_schema_dsn)
    assert rc == 0
    assert found["postgres"]["status"] == "ok"
    assert "PostgreSQL" in found["postgres"]["detail"]
    assert found["postgres schema"]["detail"].startswith("no schema yet")
    assert "state.db" not in found  # not the store of this home


def test_a_migrated_store_reports_its_version_and_leases(
    tmp_path: Path, pg_schema_dsn: str
) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO leases VALUES ('leader:telegram', 'r1', 1, 0),"
            " ('turn:k', 'r2', extract(epoch FROM now()) + 600, 0)"
        )
    rc, found, _ = doctor_on(tmp_path, pg_schema_dsn)
    assert rc == 0
    assert found["postgres schema"] == {
        **found["postgres schema"],
        "status": "ok",
        "detail": f"schema version {SCHEMA_VERSION} in {schema_of(pg_schema_dsn)}",
    }
    assert found["leases"]["status"] == "ok"
    assert found["leases"]["detail"] == "2 held, 1 expired"


def test_a_search_path_without_a_schema_is_an_error(tmp_path: Path) -> None:
    if reason := pg_available():
        pytest.skip(reason)
    rc, found, _ = doctor_on(tmp_path, make_conninfo(pg_dsn(), options="-c search_path=nope"))
    assert rc == 1
    assert found["postgres"]["status"] == "ok"
    assert found["postgres schema"]["status"] == "error"


def test_a_newer_schema_is_an_error(tmp_path: Path, pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("UPDATE hermes_schema SET version = %s", (SCHEMA_VERSION + 1,))
    rc, found, _ = doctor_on(tmp_path, pg_schema_dsn)
    assert rc == 1
    assert found["postgres schema"]["status"] == "error"
    assert "newer than this gateway" in found["postgres schema"]["detail"]


def test_a_missing_leases_table_is_an_error(tmp_path: Path, pg_schema_dsn: str) -> None:
    with psycopg.connect(pg_schema_dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute("DROP TABLE leases")
    rc, found, _ = doctor_on(tmp_path, pg_schema_dsn)
    assert rc == 1
    assert found["leases"]["status"] == "error"


@pytest.mark.parametrize(
    "dsn",
    [
        f"postgresql://postgres:{SECRET}@127.0.0.1:1/test",
        f"postgresql://postgres:{SECRET}@127.0.0.1:5432/no_such_database_here",
        f"host=127.0.0.1 port=1 password={SECRET} dbname=test",
    ],
)
def test_an_unreachable_database_is_an_error_without_the_password(tmp_path: Path, dsn: str) -> None:
    rc, found, printed = doctor_on(tmp_path, dsn)
    assert rc == 1
    assert found["postgres"]["status"] == "error"
    assert found["postgres"]["detail"].startswith("cannot connect to ")
    assert SECRET not in printed


@pytest.mark.timeout(120)
def test_a_replica_that_stopped_says_so_in_status_json_and_doctor(
    tmp_path: Path, pg_schema_dsn: str
) -> None:
    from scripts.harness import Daemon

    storage = json.dumps({"backend": "postgres", "dsn": pg_schema_dsn})
    daemon = Daemon(tmp_path / "home", f"storage: {storage}\n")
    try:
        daemon.start()
        daemon.post("c1", "hello")
        daemon.wait_replies("c1", 1)
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        daemon.ensure_stopped()
    status = json.loads((daemon.home / "status.json").read_text())
    assert status["state"] == "stopped"
    stopped = cli(daemon.home, "status")
    assert stopped.returncode == 3, stopped.stdout  # not running
    done = cli(daemon.home, "doctor", "--json")
    found = {f["name"]: f for f in json.loads(done.stdout)}
    assert found["clean shutdown"]["detail"] == "this home's replica stopped cleanly (status.json)"
