"""Text into indexable chunks, content hashes, and the tag rules of notes (seed 002).

Pure functions: the indexer (gateway.memory.index) and the note API (gateway.memory.recall)
share them, so a note and a transcript message are cut the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

CHUNK_SIZE = 640
CHUNK_OVERLAP = 96
MAX_TAGS = 16
MAX_TAG_LENGTH = 64


def normalize(text: str) -> str:
    """Runs of whitespace as one space, trimmed: what is chunked and hashed, so the same
    words indexed twice (a re-sent message) are one chunk. (`str.split` splits where
    the regex `\\s+` matches, on every code point, at a quarter of its cost.)"""
    return " ".join(text.split())


def chunk_text(text: str, size: int = CHUNK_SIZE, overlap: int = CHUNK_OVERLAP) -> list[str]:
    """`text` (normalized) in windows of at most `size` characters, each starting
    `size - overlap` after the previous one, so a phrase cut at one window's end is
    whole in the next. A window ends at the last space of its final `overlap` characters
    when there is one (no word cut in two); empty text gives no chunk."""
    if not 0 <= overlap < size:
        raise ValueError(f"overlap ({overlap}) must be at least 0 and less than size ({size})")
    text = normalize(text)
    chunks: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind(" ", end - overlap, end)
            if cut > start:
                end = cut
        chunks.append(text[start:end].strip())
        if end >= len(text):
            break
        nxt = max(end - overlap, start + 1)
        if text[nxt - 1] != " ":  # mid-word: begin at the next word instead
            space = text.find(" ", nxt, end)
            nxt = space + 1 if space != -1 else nxt
        start = nxt
    return [chunk for chunk in chunks if chunk]


def content_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def normalize_tags(tags: Iterable[str]) -> tuple[str, ...]:
    """Trimmed, lowercased, deduplicated (first one kept), empty ones dropped; more than
    MAX_TAGS, or one longer than MAX_TAG_LENGTH, is a ValueError (the model is told,
    rather than its tags silently cut)."""
    if isinstance(tags, str):
        raise ValueError("tags must be a list of strings, not one string")
    seen: dict[str, None] = {}
    for tag in tags:
        if not isinstance(tag, str):
            raise ValueError(f"a tag must be a string, not {type(tag).__name__}")
        clean = tag.strip().lower()
        if len(clean) > MAX_TAG_LENGTH:
            raise ValueError(f"tag {clean[:20]!r}... is longer than {MAX_TAG_LENGTH} characters")
        if clean:
            seen.setdefault(clean, None)
    if len(seen) > MAX_TAGS:
        raise ValueError(f"at most {MAX_TAGS} tags (got {len(seen)})")
    return tuple(seen)
