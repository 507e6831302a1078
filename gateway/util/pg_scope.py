"""PostgreSQL names that belong to a whole database, scoped to the store's schema.

LISTEN/NOTIFY channels and advisory locks are per database, not per schema: two stores
in schemas of one database (the test suite's parallel workers, two deployments sharing
a server) would hear each other's notifications and queue on each other's locks. These
SQL expressions scope a channel name or a lock key to `current_schema()` (the first
existing schema of the connection's search_path) on the server, so every connection of
one store agrees without a round trip of its own. The default schema, public, keeps the bare
channel name and lock key.

Plain strings, no psycopg: the SQLite store imports this module too.
"""

from __future__ import annotations

_SCHEMA = "coalesce(current_schema(), 'public')"
# 48 bits of the schema name's md5: ASCII and of fixed length, so a scoped channel stays
# within the 63 bytes of a Postgres identifier whatever the schema is called.
_SCHEMA_TAG = f"left(md5({_SCHEMA}), 12)"

#: the channel `%(channel)s` as listened and notified on in this schema
CHANNEL_SQL = (
    f"CASE {_SCHEMA} WHEN 'public' THEN %(channel)s ELSE %(channel)s || '.' || {_SCHEMA_TAG} END"
)

#: `pg_notify` of `%(payload)s` on the channel `%(channel)s` of this schema
NOTIFY_SQL = f"SELECT pg_notify({CHANNEL_SQL}, %(payload)s)"

#: the advisory lock key `%(key)s` (a bigint) of this schema: XORed with the tag
LOCK_KEY_SQL = (
    f"CASE {_SCHEMA} WHEN 'public' THEN %(key)s::bigint"
    f" ELSE %(key)s::bigint # ('x' || lpad({_SCHEMA_TAG}, 16, '0'))::bit(64)::bigint END"
)
