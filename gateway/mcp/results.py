"""A tool server's answer as the model gets it (`McpResult`): text content as is,
structured content as JSON, images kept apart for the caller (vision, or a one-line
note), everything cut at `mcp.max_result_chars` with a marker saying so."""

from __future__ import annotations

import json
from dataclasses import dataclass

# An image larger than this (decoded) is dropped with a note: a tool result must not
# carry megabytes into the transcript.
MAX_IMAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class McpResult:
    """What one MCP tool call answered: `text` for the model, `images` as (mime, bytes)
    for a backend that sees them, `is_error` when the tool (or the hub) failed."""

    text: str
    images: tuple[tuple[str, bytes], ...] = ()
    is_error: bool = False


def error_result(message: str) -> McpResult:
    """The hub's own failures, as the JSON object the model reads."""
    return McpResult(json.dumps({"error": message}), is_error=True)


def cut(text: str, limit: int) -> str:
    """`text`, at most `limit` characters, the marker included when it was cut."""
    if len(text) <= limit:
        return text
    marker = f"\n[cut: {len(text):,} characters, the first {{kept:,}} shown]"
    kept = max(0, limit - len(marker.format(kept=limit)))
    return text[:kept] + marker.format(kept=kept)
