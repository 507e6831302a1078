"""An aiohttp request body read within a size bound, for every endpoint that takes one
(the HTTP API's messages, the A2A JSON-RPC endpoint)."""

from __future__ import annotations

from aiohttp import StreamReader

__all__ = ["read_bounded"]


async def read_bounded(content: StreamReader, limit: int) -> bytes | None:
    """The body, or None once it exceeds `limit` bytes (chunked bodies too: counted as
    read, never held past the bound). The stream's own errors (a body that does not
    decode, a client gone mid-body) are the caller's to answer."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
