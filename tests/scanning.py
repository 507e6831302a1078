"""Looking for a value in every table of a database file: how the forget and delete
tests show that nothing of a session or a user is left behind."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg


def tables_holding(db: Path, needle: str) -> list[str]:
    """Every table.column of a database with a value containing `needle` (FTS5 shadow
    tables included; the virtual tables themselves are read through them)."""
    conn = sqlite3.connect(db)
    try:
        found = []
        tables = [
            name
            for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                " AND name NOT LIKE 'sqlite_%' AND sql NOT LIKE 'CREATE VIRTUAL%'"
            )
        ]
        for table in tables:
            for column in [c[1] for c in conn.execute(f'PRAGMA table_info("{table}")')]:
                hit = conn.execute(
                    f'SELECT 1 FROM "{table}" WHERE instr(CAST("{column}" AS TEXT), ?) > 0 LIMIT 1',
                    (needle,),
                ).fetchone()
                if hit:
                    found.append(f"{table}.{column}")
        return found
    finally:
        conn.close()


def pg_tables_holding(dsn: str, needle: str) -> list[str]:
    """The PostgreSQL store's tables with a row whose text holds `needle` (every
    column, as the row's text form)."""
    with psycopg.connect(dsn) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT table_name FROM information_schema.tables"
                " WHERE table_schema = current_schema() AND table_type = 'BASE TABLE'"
            )
        ]
        return sorted(
            table
            for table in tables
            if conn.execute(
                f"SELECT EXISTS (SELECT 1 FROM {table} t WHERE strpos(t::text, %s) > 0)",
                (needle,),
            ).fetchone()[0]
        )
