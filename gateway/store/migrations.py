"""The schema of state.db, as numbered migrations, and running the ones a file lacks.

`PRAGMA user_version` holds the version a file is at; each migration runs in a
transaction of its own, so a crash leaves a file at one version or the next, never in
between. A file newer than this code is refused, not downgraded.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import datetime
from typing import Any

from gateway.domain.session import SessionEntry
from gateway.store import codec

SCHEMA_VERSION = 24

# Index columns mirror fields of the entry JSON so look-ups and range scans stay O(log N).
#: each a script of statements, or a function that runs its own on the open transaction
_MIGRATIONS: dict[int, str | Callable[[sqlite3.Connection], None]] = {
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
    # Durability: every accepted inbound message, the in-flight turn markers and
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
    # A turn does not decode and re-encode the entry's JSON. What a turn reads
    # and changes (times, flags, counters) gets columns of its own in a narrow hot row;
    # what it never changes (origin, display name, platform, chat type) moves to a cold
    # table written only when one of those changes. Python, not SQL: SQLite's date
    # functions keep milliseconds, and the entries' ISO times carry microseconds.
    7: lambda conn: _split_entries(conn),
    # Titles. A turn titles its session from the first user message
    # (gateway.store.titles.make_title); sessions from before get theirs here, by the same
    # rule: the first 40 characters, CR dropped, LF a space, trimmed, "..." when cut.
    8: """
    UPDATE sessions SET title = (
        SELECT trim(replace(replace(substr(t, 1, 40), char(13), ''), char(10), ' '),
                    ' ' || char(9, 10, 13))
               || CASE WHEN length(t) > 40 THEN '...' ELSE '' END
        FROM (SELECT trim(m.content, ' ' || char(9, 10, 13)) AS t FROM messages m
              WHERE m.session_id = sessions.session_id AND m.active = 1 AND m.role = 'user'
              ORDER BY m.id LIMIT 1)
        WHERE t != ''
    ) WHERE title IS NULL;
    """,
    # Summary checkpoints. One per session (gateway.store.summary_checkpoints):
    # the rolling summary of its active messages up to covered_up_to, written by
    # compare-and-swap on epoch.
    9: """
    CREATE TABLE summary_checkpoints (
        session_id    TEXT PRIMARY KEY REFERENCES sessions(session_id) ON DELETE CASCADE,
        epoch         INTEGER NOT NULL,
        covered_up_to INTEGER NOT NULL DEFAULT 0,
        summary       TEXT,
        messages      INTEGER NOT NULL DEFAULT 0,
        updated_at    REAL NOT NULL
    ) WITHOUT ROWID;
    """,
    # Long-term memory (gateway.memory). Notes are the user's data of record,
    # here; their chunks, full-text index and vectors live in memory.db, an index rebuilt
    # from this file. `note_log` tells the indexer which notes changed (notes are written
    # by the memory tools and the CLI, never in a turn's transaction). `log_readers`: how
    # far each reader of `fts_log` besides search.db got (the memory indexer), so the
    # log is trimmed only behind all of them.
    10: """
    CREATE TABLE notes (
        note_id    TEXT PRIMARY KEY,
        namespace  TEXT NOT NULL,
        agent_id   TEXT NOT NULL,
        platform   TEXT NOT NULL,
        user_id    TEXT NOT NULL,
        content    TEXT NOT NULL,
        tags       TEXT NOT NULL DEFAULT '[]',
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX notes_by_namespace ON notes(namespace, updated_at);
    CREATE INDEX notes_by_user ON notes(platform, user_id);
    CREATE TABLE note_log (seq INTEGER PRIMARY KEY AUTOINCREMENT, note_id TEXT NOT NULL);
    CREATE TRIGGER notes_log_insert AFTER INSERT ON notes BEGIN
        INSERT INTO note_log(note_id) VALUES (new.note_id);
    END;
    CREATE TRIGGER notes_log_update AFTER UPDATE ON notes BEGIN
        INSERT INTO note_log(note_id) VALUES (new.note_id);
    END;
    CREATE TRIGGER notes_log_delete AFTER DELETE ON notes BEGIN
        INSERT INTO note_log(note_id) VALUES (old.note_id);
    END;
    CREATE TABLE log_readers (name TEXT PRIMARY KEY, applied INTEGER NOT NULL) WITHOUT ROWID;
    """,
    # Scratchpad. The model's working notes for one session
    # (gateway.store.scratchpad): its items as a JSON list, replaced whole by each write;
    # deleted with the session (gateway.store.purge finds it by its session_id).
    11: """
    CREATE TABLE scratchpads (
        session_id TEXT PRIMARY KEY REFERENCES sessions(session_id) ON DELETE CASCADE,
        items      TEXT NOT NULL,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID;
    """,
    # Scheduled jobs (gateway.store.schedules). The rows are the one source of
    # truth: the scheduler sleeps until the earliest active `next_run_at` (a partial
    # index: finding it is one B-tree descent, whatever the number of schedules). A run
    # is claimed by its row, unique per fire time, in the transaction that advances
    # `next_run_at` and begins its turn: a fire time is never run twice. Times are Unix
    # seconds (UTC); `cadence` is JSON (gateway.schedules.cadence).
    12: """
    CREATE TABLE schedules (
        schedule_id          TEXT PRIMARY KEY,
        agent_id             TEXT NOT NULL,
        platform             TEXT NOT NULL,
        chat_id              TEXT NOT NULL,
        user_id              TEXT,
        target               TEXT NOT NULL,
        deliver              TEXT NOT NULL DEFAULT 'chat',
        prompt               TEXT NOT NULL,
        cadence              TEXT NOT NULL,
        status               TEXT NOT NULL DEFAULT 'active',
        created_at           REAL NOT NULL,
        updated_at           REAL NOT NULL,
        next_run_at          REAL,
        last_run_at          REAL,
        last_run_status      TEXT,
        consecutive_failures INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID;
    CREATE INDEX schedules_due ON schedules(next_run_at) WHERE status = 'active';
    CREATE INDEX schedules_by_user ON schedules(platform, user_id, agent_id);
    CREATE INDEX schedules_by_chat ON schedules(platform, chat_id);
    CREATE TABLE schedule_runs (
        run_id         INTEGER PRIMARY KEY,
        schedule_id    TEXT NOT NULL REFERENCES schedules(schedule_id) ON DELETE CASCADE,
        fire_time      REAL NOT NULL,
        status         TEXT NOT NULL,
        started_at     REAL,
        finished_at    REAL,
        output_summary TEXT,
        input_tokens   INTEGER NOT NULL DEFAULT 0,
        output_tokens  INTEGER NOT NULL DEFAULT 0,
        UNIQUE (schedule_id, fire_time)
    );
    CREATE INDEX schedule_runs_running ON schedule_runs(status) WHERE status = 'running';
    CREATE TABLE home_channels (
        platform   TEXT PRIMARY KEY,
        target     TEXT NOT NULL,
        updated_at REAL NOT NULL
    ) WITHOUT ROWID;
    """,
    # Streamed replies: `streams` holds the platform messages a running turn
    # is editing in place (written when the first is sent, gone with the turn's end), so
    # a turn re-run after a crash edits them instead of sending a second reply; a reply
    # chunk with `edit_message_id` is delivered as an edit of that message.
    13: """
    CREATE TABLE streams (
        session_key  TEXT PRIMARY KEY,
        message_ids  TEXT NOT NULL,
        updated_at   REAL NOT NULL
    ) WITHOUT ROWID;
    ALTER TABLE outbound ADD COLUMN edit_message_id TEXT;
    """,
    # Media out. A reply's attachment waits in the delivery ledger like a text
    # chunk: its row's `attachment` is the Attachment as JSON (path or URL, kind,
    # caption; `text` holds the caption), NULL for text.
    14: """
    ALTER TABLE outbound ADD COLUMN attachment TEXT;
    """,
    # The session's token calibration (gateway.context.tokens.Calibration): the ratio of
    # the prompt tokens its model reports to the gateway's estimate, kept in the key's hot
    # row so a restart does not start again from 1.0. There a turn reads it with the row
    # and its end writes it in the UPDATE it makes anyway: no statement of its own. A new
    # session of the key starts from its predecessor's (the same chat's prompt shape).
    # NULL: none learnt yet.
    15: """
    ALTER TABLE session_entries ADD COLUMN token_factor REAL;
    """,
    # The stuck-loop guard. `turns.running`: 1 once the turn's work began (its agent
    # slot taken), 0 while it only waits (behind another turn, for a slot, or resumed
    # and not yet run): a crash counts against a turn only when it was running. Inbox
    # rows of a turn the guard gave up on are `set_aside` (not dropped): /retry runs
    # them again, found by the partial index.
    16: """
    ALTER TABLE turns ADD COLUMN running INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX inbox_set_aside ON inbox(session_key, id) WHERE state = 'set_aside';
    """,
    # The tool-call journal of running turns (gateway.store.tool_calls): a turn resumed
    # after a crash replays what its calls did instead of running them again. A turn's
    # rows go with its finish; deleted with the session.
    17: """
    CREATE TABLE tool_calls (
        session_id TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
        user_row   INTEGER NOT NULL,
        seq        INTEGER NOT NULL,
        kind       TEXT NOT NULL,
        call_id    TEXT,
        tool       TEXT,
        payload    TEXT NOT NULL,
        result     TEXT,
        PRIMARY KEY (session_id, user_row, seq)
    ) WITHOUT ROWID;
    """,
    # Agent tasks (gateway.store.agent_tasks): one A2A message to one agent and the turn
    # that answers it. A resent message id (per agent and caller) is the same row; a
    # caller's tasks are listed newest first. Deleted with their session or caller
    # (gateway.store.purge).
    18: """
    CREATE TABLE agent_tasks (
        task_id      TEXT PRIMARY KEY,
        agent_id     TEXT NOT NULL,
        context_id   TEXT NOT NULL,
        message_id   TEXT NOT NULL,
        caller       TEXT NOT NULL,
        state        TEXT NOT NULL,
        request_text TEXT NOT NULL,
        result_text  TEXT,
        error        TEXT,
        chain        TEXT NOT NULL,
        session_key  TEXT NOT NULL,
        created_at   REAL NOT NULL,
        updated_at   REAL NOT NULL,
        UNIQUE (agent_id, caller, message_id)
    ) WITHOUT ROWID;
    CREATE INDEX agent_tasks_by_caller ON agent_tasks(caller, created_at, task_id);
    CREATE INDEX agent_tasks_by_session ON agent_tasks(session_key, state);
    CREATE INDEX agent_tasks_by_context ON agent_tasks(agent_id, context_id);
    """,
    # The context each chat keeps with each remote A2A agent it delegated to
    # (gateway.store.remote_contexts): a second `agent_call` in the conversation
    # continues the remote's context. Deleted with the session that last used it.
    19: """
    CREATE TABLE remote_contexts (
        session_key TEXT NOT NULL,
        remote      TEXT NOT NULL,
        session_id  TEXT NOT NULL REFERENCES sessions(session_id) ON DELETE CASCADE,
        context_id  TEXT NOT NULL,
        updated_at  REAL NOT NULL,
        PRIMARY KEY (session_key, remote)
    ) WITHOUT ROWID;
    CREATE INDEX remote_contexts_by_session ON remote_contexts(session_id);
    """,
    # A task's turn's token counts (the OpenAI-compatible endpoint's `usage`): NULL
    # until it ends, and for a turn whose model reported none.
    20: """
    ALTER TABLE agent_tasks ADD COLUMN input_tokens INTEGER;
    ALTER TABLE agent_tasks ADD COLUMN output_tokens INTEGER;
    """,
    # The model each chat picked with /model (gateway.store.chat_models), by session key:
    # it outlives the chat's sessions (/new keeps it).
    21: """
    CREATE TABLE chat_models (
        session_key TEXT PRIMARY KEY,
        model       TEXT NOT NULL,
        updated_at  REAL NOT NULL
    ) WITHOUT ROWID;
    """,
    # Usage per user, day, agent and model, and each user's turn starts of the last
    # minute for `turns_per_minute` (gateway.store.usage).
    22: """
    CREATE TABLE usage_days (
        user_key        TEXT NOT NULL,
        day             TEXT NOT NULL,
        agent_id        TEXT NOT NULL,
        model           TEXT NOT NULL,
        turns           INTEGER NOT NULL DEFAULT 0,
        input_tokens    INTEGER NOT NULL DEFAULT 0,
        output_tokens   INTEGER NOT NULL DEFAULT 0,
        estimated_turns INTEGER NOT NULL DEFAULT 0,
        cost_usd        REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (user_key, day, agent_id, model)
    ) WITHOUT ROWID;
    CREATE INDEX usage_days_by_day ON usage_days(day);
    CREATE TABLE budget_pace (user_key TEXT PRIMARY KEY, starts TEXT NOT NULL,
                              updated_at REAL NOT NULL) WITHOUT ROWID;
    """,
    # How many condensed messages the user was told about (a notice with the next reply,
    # gateway.memory.notice). Summaries written before the notice existed are not owed.
    23: """
    ALTER TABLE summary_checkpoints ADD COLUMN told INTEGER NOT NULL DEFAULT 0;
    UPDATE summary_checkpoints SET told = messages;
    """,
    # Where an adapter's stream of events stands: Matrix's sync token (gateway.store.cursors).
    24: """
    CREATE TABLE platform_cursors (
        platform   TEXT NOT NULL,
        name       TEXT NOT NULL,
        value      TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (platform, name)
    ) WITHOUT ROWID;
    """,
}

#: the hot row's columns after session_key, in the order `_hot_values` gives them
_V7_HOT = (
    "session_id, created_at, updated_at, active_minute, suspended, resume_pending,"
    " expiry_finalized, was_auto_reset, is_fresh_reset, reset_had_activity,"
    " auto_reset_reason, resume_reason, last_resume_marked_at, cost_status,"
    " input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, total_tokens,"
    " estimated_cost_usd, last_prompt_tokens"
)
_V7_TABLES = """
    CREATE TABLE session_entries_v7 (
        session_key           TEXT PRIMARY KEY,
        session_id            TEXT NOT NULL,
        created_at            REAL NOT NULL,
        updated_at            REAL NOT NULL,
        active_minute         INTEGER NOT NULL,
        suspended             INTEGER NOT NULL DEFAULT 0,
        resume_pending        INTEGER NOT NULL DEFAULT 0,
        expiry_finalized      INTEGER NOT NULL DEFAULT 0,
        was_auto_reset        INTEGER NOT NULL DEFAULT 0,
        is_fresh_reset        INTEGER NOT NULL DEFAULT 0,
        reset_had_activity    INTEGER NOT NULL DEFAULT 0,
        auto_reset_reason     TEXT,
        resume_reason         TEXT,
        last_resume_marked_at REAL,
        cost_status           TEXT NOT NULL DEFAULT 'unknown',
        input_tokens          INTEGER NOT NULL DEFAULT 0,
        output_tokens         INTEGER NOT NULL DEFAULT 0,
        cache_read_tokens     INTEGER NOT NULL DEFAULT 0,
        cache_write_tokens    INTEGER NOT NULL DEFAULT 0,
        total_tokens          INTEGER NOT NULL DEFAULT 0,
        estimated_cost_usd    REAL NOT NULL DEFAULT 0,
        last_prompt_tokens    INTEGER NOT NULL DEFAULT 0
    ) WITHOUT ROWID;
    CREATE TABLE session_entry_docs (
        session_key  TEXT PRIMARY KEY,
        origin       TEXT,
        display_name TEXT,
        platform     TEXT,
        chat_type    TEXT NOT NULL DEFAULT 'dm'
    ) WITHOUT ROWID;
"""
_V7_AFTER = """
    DROP TABLE session_entries;
    ALTER TABLE session_entries_v7 RENAME TO session_entries;
    CREATE INDEX session_entries_by_session_id ON session_entries(session_id);
    CREATE INDEX session_entries_by_minute ON session_entries(active_minute);
"""


def _split_entries(conn: sqlite3.Connection) -> None:
    """v6 -> v7: each entry's JSON becomes its hot row and its cold row, field for field.
    An entry whose JSON does not parse (no turn of its key could have run either) keeps
    what the v6 columns held, so its key still routes to its session."""
    for statement in _split_sql(_V7_TABLES):
        conn.execute(statement)
    hot = f"INSERT INTO session_entries_v7 (session_key, {_V7_HOT}) VALUES ({', '.join('?' * 22)})"
    cold = (
        "INSERT INTO session_entry_docs (session_key, origin, display_name, platform,"
        " chat_type) VALUES (?, ?, ?, ?, ?)"
    )
    rows = conn.execute(
        "SELECT session_key, session_id, updated_at, suspended, resume_pending,"
        " expiry_finalized, entry FROM session_entries"
    )
    for key, session_id, updated_at, suspended, resume_pending, finalized, raw in rows:
        try:
            entry = SessionEntry.from_dict(codec.loads(raw))
        except (TypeError, ValueError, KeyError, AttributeError):
            conn.execute(
                "INSERT INTO session_entries_v7 (session_key, session_id, created_at,"
                " updated_at, active_minute, suspended, resume_pending, expiry_finalized)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    session_id,
                    updated_at,
                    updated_at,
                    int(updated_at // 60),
                    suspended,
                    resume_pending,
                    finalized,
                ),
            )
            continue
        conn.execute(hot, (key, *_hot_values(entry)))
        origin = codec.dumps(entry.origin.to_dict()) if entry.origin else None
        platform = entry.platform.value if entry.platform else None
        conn.execute(cold, (key, origin, entry.display_name, platform, entry.chat_type))
    for statement in _split_sql(_V7_AFTER):
        conn.execute(statement)


def _epoch(moment: datetime | None) -> float | None:
    return None if moment is None else moment.timestamp()


def _hot_values(entry: SessionEntry) -> tuple[Any, ...]:
    """The values of `_V7_HOT` for one entry (frozen here: a later schema must not change
    what this migration writes)."""
    return (
        entry.session_id,
        entry.created_at.timestamp(),
        entry.updated_at.timestamp(),
        int(entry.updated_at.timestamp() // 60),
        int(entry.suspended),
        int(entry.resume_pending),
        int(entry.expiry_finalized),
        int(entry.was_auto_reset),
        int(entry.is_fresh_reset),
        int(entry.reset_had_activity),
        entry.auto_reset_reason,
        entry.resume_reason,
        _epoch(entry.last_resume_marked_at),
        entry.cost_status,
        entry.input_tokens,
        entry.output_tokens,
        entry.cache_read_tokens,
        entry.cache_write_tokens,
        entry.total_tokens,
        entry.estimated_cost_usd,
        entry.last_prompt_tokens,
    )


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
            step = _MIGRATIONS[version]
            if callable(step):
                step(conn)
            else:
                for statement in _split_sql(step):
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
