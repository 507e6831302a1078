"""The schema of state.db, as numbered migrations, and running the ones a file lacks.

`PRAGMA user_version` holds the version a file is at; each migration runs in a
transaction of its own, so a crash leaves a file at one version or the next, never in
between. A file newer than this code is refused, not downgraded.
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 7

# Index columns mirror fields of the entry JSON so look-ups and range scans stay O(log N).
_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE session_entries (
        session_key      TEXT PRIMARY KEY,
        session_id       TEXT NOT NULL,
        updated_at       REAL NOT NULL,
        active_minute    INTEGER NOT NULL,
        suspended        INTEGER NOT NULL DEFAULT 0,
        resume_pending   INTEGER NOT NULL DEFAULT 0,
        expiry_finalized INTEGER NOT NULL DEFAULT 0,
        entry            TEXT NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX session_entries_by_session_id ON session_entries(session_id);
    -- Range scans (recently active, idle, prune) go through a minute-granular copy of
    -- updated_at: a message touch rewrites this index at most once a minute per session.
    CREATE INDEX session_entries_by_minute ON session_entries(active_minute);

    CREATE TABLE sessions (
        session_id          TEXT PRIMARY KEY,
        session_key         TEXT NOT NULL,
        origin              TEXT,
        started_at          REAL NOT NULL,
        ended_at            REAL,
        end_reason          TEXT,
        title               TEXT,
        input_tokens        INTEGER NOT NULL DEFAULT 0,
        output_tokens       INTEGER NOT NULL DEFAULT 0,
        cache_read_tokens   INTEGER NOT NULL DEFAULT 0,
        cache_write_tokens  INTEGER NOT NULL DEFAULT 0,
        total_tokens        INTEGER NOT NULL DEFAULT 0,
        estimated_cost_usd  REAL NOT NULL DEFAULT 0
    ) WITHOUT ROWID;
    CREATE INDEX sessions_by_key ON sessions(session_key, started_at);

    CREATE TABLE messages (
        id          INTEGER PRIMARY KEY,
        session_id  TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
        role        TEXT NOT NULL,
        content     TEXT NOT NULL,
        message     TEXT NOT NULL,
        active      INTEGER NOT NULL DEFAULT 1,
        created_at  REAL NOT NULL
    );
    CREATE INDEX messages_by_session ON messages(session_id, active, id);

    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, content='messages', content_rowid='id'
    );
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content)
        VALUES ('delete', old.id, old.content);
    END;
    """,
    # Durability (issue 4): every accepted inbound message, the in-flight turn markers and
    # the outbound delivery ledger.
    2: """
    CREATE TABLE inbox (
        id          INTEGER PRIMARY KEY,
        platform    TEXT NOT NULL,
        chat_id     TEXT NOT NULL,
        message_id  TEXT,
        session_key TEXT NOT NULL,
        kind        TEXT NOT NULL,
        event       TEXT NOT NULL,
        state       TEXT NOT NULL,
        accepted_at REAL NOT NULL,
        done_at     REAL
    );
    CREATE UNIQUE INDEX inbox_dedup ON inbox(platform, chat_id, message_id)
        WHERE message_id IS NOT NULL;
    CREATE INDEX inbox_open ON inbox(id) WHERE state = 'accepted';
    CREATE INDEX inbox_by_time ON inbox(accepted_at);

    CREATE TABLE turns (
        turn_id         INTEGER PRIMARY KEY,
        session_key     TEXT NOT NULL UNIQUE,
        session_id      TEXT NOT NULL,
        inbox_ids       TEXT NOT NULL,
        user_message_id INTEGER,
        event           TEXT NOT NULL,
        started_at      REAL NOT NULL
    );

    CREATE TABLE outbound (
        id                  INTEGER PRIMARY KEY,
        platform            TEXT NOT NULL,
        chat_id             TEXT NOT NULL,
        target              TEXT NOT NULL,
        text                TEXT NOT NULL,
        reply_to            TEXT,
        session_key         TEXT,
        state               TEXT NOT NULL,
        platform_message_id TEXT,
        created_at          REAL NOT NULL,
        sent_at             REAL
    );
    CREATE INDEX outbound_pending ON outbound(id) WHERE state = 'pending';
    CREATE INDEX outbound_by_chat ON outbound(platform, chat_id, id);
    """,
    # DM pairing: codes handed to unknown users, and the users the operator approved.
    3: """
    CREATE TABLE pairing_codes (
        platform    TEXT NOT NULL,
        code        TEXT NOT NULL,
        user_id     TEXT NOT NULL,
        user_name   TEXT,
        created_at  REAL NOT NULL,
        PRIMARY KEY (platform, code)
    ) WITHOUT ROWID;
    CREATE TABLE paired_users (
        platform    TEXT NOT NULL,
        user_id     TEXT NOT NULL,
        user_name   TEXT,
        approved_at REAL NOT NULL,
        PRIMARY KEY (platform, user_id)
    ) WITHOUT ROWID;
    """,
    # Full-text indexing in batches (gateway.store.fts): the insert trigger only notes the row.
    4: """
    CREATE TABLE fts_pending (id INTEGER PRIMARY KEY);
    DROP TRIGGER messages_fts_insert;
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT OR IGNORE INTO fts_pending(id) VALUES (new.id);
    END;
    DROP TRIGGER messages_fts_delete;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content)
        SELECT 'delete', old.id, old.content
        WHERE NOT EXISTS (SELECT 1 FROM fts_pending WHERE id = old.id);
        DELETE FROM fts_pending WHERE id = old.id;
    END;
    """,
    # The full-text index moves to search.db (gateway.store.fts); state.db only logs which
    # messages came and went. A new search.db is built from all messages.
    5: """
    CREATE TABLE fts_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, id INTEGER NOT NULL);
    DROP TRIGGER messages_fts_insert;
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO fts_log(id) VALUES (new.id);
    END;
    DROP TRIGGER messages_fts_delete;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO fts_log(id) VALUES (old.id);
    END;
    DROP TABLE fts_pending;
    DROP TABLE messages_fts;
    """,
    # Where to tell a user their pairing code was approved: the DM it was asked from
    # (a SessionSource as JSON; on Discord and Slack the DM's id is not the user's).
    6: """
    ALTER TABLE pairing_codes ADD COLUMN target TEXT;
    """,
    # issue 15: summary checkpoints
    # One per session (gateway.store.summary_checkpoints): the rolling summary of its
    # active messages up to covered_up_to, written by compare-and-swap on epoch.
    7: """
    CREATE TABLE summary_checkpoints (
        session_id    TEXT PRIMARY KEY REFERENCES sessions(session_id) ON DELETE CASCADE,
        epoch         INTEGER NOT NULL,
        covered_up_to INTEGER NOT NULL DEFAULT 0,
        summary       TEXT,
        messages      INTEGER NOT NULL DEFAULT 0,
        updated_at    REAL NOT NULL
    ) WITHOUT ROWID;
    """,
}


def migrate(conn: sqlite3.Connection) -> None:
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(
            f"schema version {current} is newer than this gateway ({SCHEMA_VERSION}); "
            "upgrade hermes-gateway"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _split_sql(_MIGRATIONS[version]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={version}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def _split_sql(script: str) -> list[str]:
    """Split a migration into statements, keeping trigger bodies whole."""
    statements, buf = [], ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            statements.append(buf.strip())
            buf = ""
    if buf.strip():
        statements.append(buf.strip())
    return statements
