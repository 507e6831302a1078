"""A tools/call answer (the SDK's `CallToolResult`) as the model's `McpResult`: text
content as is, structured content as JSON, images apart, cut at the configured limit."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import mcp_types as types

from gateway.mcp.results import MAX_IMAGE_BYTES, McpResult, cut


def to_result(answer: types.CallToolResult, limit: int) -> McpResult:
    """The model's view of a tools/call result."""
    parts: list[str] = []
    images: list[tuple[str, bytes]] = []
    for block in answer.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.ImageContent):
            image = _decoded(block.data)
            if image is None or len(image) > MAX_IMAGE_BYTES:
                parts.append(f"[an image ({block.mime_type}) too large or not valid base64]")
            else:
                images.append((block.mime_type, image))
        elif isinstance(block, types.EmbeddedResource):
            parts.append(_resource_text(block.resource))
        else:
            parts.append(f"[{getattr(block, 'type', 'content')} content not shown]")
    if answer.structured_content is not None and not parts:
        parts.append(json.dumps(answer.structured_content, ensure_ascii=False, default=str))
    elif answer.structured_content is not None and _only_echo(parts, answer.structured_content):
        pass  # the text block is the structured content's own rendering
    elif answer.structured_content is not None:
        parts.append(json.dumps(answer.structured_content, ensure_ascii=False, default=str))
    return McpResult(cut("\n".join(parts), limit), tuple(images), bool(answer.is_error))


def _only_echo(parts: list[str], structured: dict[str, Any]) -> bool:
    """Does the one text block already say what the structured content says (SDK servers
    send a function's return value both ways: as JSON text, or `{"result": value}`)?"""
    if len(parts) != 1:
        return False
    try:
        said = json.loads(parts[0])
    except ValueError:
        said = parts[0]
    return said == structured or (len(structured) == 1 and said == structured.get("result"))


def _decoded(data: str) -> bytes | None:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None


def _resource_text(resource: Any) -> str:
    text = getattr(resource, "text", None)
    if isinstance(text, str):
        return text
    return f"[a binary resource {getattr(resource, 'uri', '')} not shown]"
