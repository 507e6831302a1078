"""What the hub offers of a server's tool (no SDK needed to read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class McpTool:
    """One offered tool: `qualified` is the name the model sees ("<server>__<tool>")."""

    qualified: str
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool
    approve: bool
