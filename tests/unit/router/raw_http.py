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


class RawServer:
    """A raw HTTP/1.1 server on 127.0.0.1 (`url` once started): the subclass's
    `serve_connection` runs for each connection; a peer that closes mid-read ends it quietly,
    and the connection is closed when it returns. `stop` closes every open connection, which
    ends the handlers' reads: no task is left to cancel."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        for writer in list(self._writers):
            writer.close()
        self._server.close()
        await self._server.wait_closed()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self.serve_connection(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
