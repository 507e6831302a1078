"""A DSN's password kept out of output and errors (gateway.store.pg.dsn), in both forms."""

from __future__ import annotations

import pytest

from gateway.store.pg.dsn import PASSWORD_REFERENCE, passwords, redact, scrub


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgresql://u:pw@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgres://u:p%40ss@h/db?sslmode=require", "postgres://u:***@h/db?sslmode=require"),
        (
            "postgresql://u@h/db?password=pw&sslmode=off",
            "postgresql://u@h/db?password=***&sslmode=off",
        ),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("host=h password=pw dbname=db", "host=h password=*** dbname=db"),
        ("host=h password = 'p w\\'x' dbname=db", "host=h password = *** dbname=db"),
        ("host=h dbname=db", "host=h dbname=db"),
    ],
)
def test_redact_hides_every_password(dsn: str, shown: str) -> None:
    assert redact(dsn) == shown


def test_the_config_reference_replaces_the_password() -> None:
    shown = redact("postgresql://hermes:pw@db/hermes", PASSWORD_REFERENCE)
    assert shown == "postgresql://hermes:${HERMES_PG_PASSWORD}@db/hermes"


def test_scrub_hides_the_password_as_written_and_decoded() -> None:
    dsn = "postgresql://u:p%40ss@h/db"
    assert passwords(dsn) == ["p%40ss", "p@ss"]
    message = 'invalid value "p@ss" near "u:p%40ss@h"'
    assert "p@ss" not in scrub(message, dsn) and "p%40ss" not in scrub(message, dsn)


def test_a_quoted_password_is_found_unescaped() -> None:
    assert "p w'x" in passwords("host=h password='p w\\'x' dbname=db")
