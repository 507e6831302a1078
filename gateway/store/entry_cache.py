"""The live `SessionEntry` objects of recently used session keys (issue 14).

A continuing session's turn routes from the cached entry (no load, no JSON decode) and
ends by writing only its live columns (`entries.save_live`, no encode). The cache is
coherent because every write of an entry runs on the store's one writer connection in
this process, and each write path keeps it so:

- a cached object is never changed in place: a write that changes an entry caches the
  new object it saved, or drops the key (`drop`, `clear`), from inside its transaction;
- a turn's end saves from its cached object only while the key still holds the very
  object its start got (`is_current`): anything else that wrote the entry meanwhile
  replaced or dropped it, and the turn then loads the entry again;
- a batch that did not commit cleanly (a failing write, a full disk) clears the whole
  cache (`Database.on_abort`), since its transactions may have cached what never
  committed. Another process (`sessions list`) reads state.db, never this cache.

Bounded (least recently used first out), like the agent cache: a miss costs one load.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from collections.abc import Callable

from gateway.session import SessionEntry
from gateway.store import entries

#: entries kept: far more than the turns in flight at once, a few MB at most
ENTRY_CACHE_SIZE = 4096


class EntryCache:
    def __init__(self, max_size: int = ENTRY_CACHE_SIZE) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> SessionEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def is_current(self, key: str, entry: SessionEntry) -> bool:
        """Whether `entry` (an object this cache handed out) is still the key's entry."""
        return self._entries.get(key) is entry

    def put(self, key: str, entry: SessionEntry) -> None:
        entries = self._entries
        entries[key] = entry
        entries.move_to_end(key)
        if len(entries) > self.max_size:
            entries.popitem(last=False)

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def settle_tx(
        self, key: str, begun: SessionEntry, settle: Callable[[SessionEntry], SessionEntry]
    ) -> Callable[[sqlite3.Connection], None]:
        """The entry's part of a turn's end: `settle` (given a copy, returns it changed)
        applied to the entry and saved. A continuing session whose entry nothing else
        wrote since `begun` (what the turn's start routed to) and whose turn changed only
        live fields writes those columns alone (`entries.save_live`); otherwise the entry
        is loaded again and saved whole, if the key still holds the turn's session.
        Re-runnable: computed from `begun`, never from the cache."""

        def tx(conn: sqlite3.Connection) -> None:
            if self.is_current(key, begun):
                new = settle(begun.copy())
                if entries.only_live_changed(new, begun) and entries.save_live(conn, new, begun):
                    self.put(key, new)
                    return
            self.drop(key)
            current = entries.load_entry(conn, key)
            if current is not None and current.session_id == begun.session_id:
                current = settle(current)
                entries.save_entry(conn, current)
                self.put(key, current)

        return tx
