"""A stdio server's stderr: a pipe of our own (never the daemon's stderr), read by a
task that logs each line cut to `MAX_LINE_CHARS`, at most `LINES_PER_WINDOW` lines per
`WINDOW_SECONDS`, and counts what it drops. A server that floods its stderr costs a
bounded amount of log and memory, and never blocks on a full pipe."""

from __future__ import annotations

import asyncio
import os
from typing import TextIO

import structlog

log = structlog.get_logger("gateway.mcp")

MAX_LINE_CHARS = 500
LINES_PER_WINDOW = 20
WINDOW_SECONDS = 10.0
READ_CHUNK = 65_536


class StderrPipe:
    """One child's stderr: `writer` is handed to the spawn (then `close_writer()`),
    `run()` reads until the child and every holder of the write end are gone."""

    def __init__(self, server: str) -> None:
        self.server = server
        read_fd, write_fd = os.pipe()
        self.inode = os.fstat(read_fd).st_ino
        self.writer: TextIO = os.fdopen(write_fd, "w")
        self._reader_file = os.fdopen(read_fd, "rb", buffering=0)
        self.lines_logged = 0
        self.lines_dropped = 0

    def close_writer(self) -> None:
        """Our copy of the write end: closed once the child holds its own."""
        if not self.writer.closed:
            self.writer.close()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_CHUNK)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), self._reader_file
        )
        partial, window_start, in_window = "", loop.time(), 0
        try:
            while chunk := await reader.read(READ_CHUNK):
                lines = (partial + chunk.decode("utf-8", "replace")).split("\n")
                # A line still open is kept only up to the cut (the rest is never shown).
                partial = lines.pop()[: MAX_LINE_CHARS + 1]
                for line in lines:
                    now = loop.time()
                    if now - window_start >= WINDOW_SECONDS:
                        self._say_dropped()
                        window_start, in_window = now, 0
                    if in_window >= LINES_PER_WINDOW:
                        self.lines_dropped += 1
                        continue
                    in_window += 1
                    self.lines_logged += 1
                    log.info("mcp_server_stderr", server=self.server, line=line[:MAX_LINE_CHARS])
        finally:
            self._say_dropped()
            transport.close()
            self.close_writer()

    def _say_dropped(self) -> None:
        if self.lines_dropped:
            log.warning("mcp_server_stderr_dropped", server=self.server, lines=self.lines_dropped)
            self.lines_dropped = 0
