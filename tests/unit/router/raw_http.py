"""Raw HTTP/1.1 on an asyncio stream, for the tests' hand-written servers and clients: one
message (a request or an answer) read as its head and its Content-Length body."""

from __future__ import annotations

import asyncio


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next message's head (through the blank line) and its body (Content-Length bytes;
    none without the header)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, await reader.readexactly(length)
