"""A streamed engine answer is flow-controlled (router/engine_http.py): a PD
that floods a stream the router's reader does not take (a slow client, or a burst) is held
by TCP, not buffered by the router, and the reader gets bounded blocks; a stream paused on
the reader's account does not fail the read timeout. Against a raw server on 127.0.0.1."""

from __future__ import annotations

import asyncio

from epd_kit.router import engine_http
from tests.unit.router.test_engine_http import PATH, Server, client  # noqa: F401  (fixture)

MB = 1024 * 1024
FLOOD = 64 * MB  # far above what the kernel's loopback buffers hold
PIECE = 64 * 1024
# one socket read at most (asyncio's selector transport), the most a block may exceed the mark by
READ_MAX = 256 * 1024


class Flood(Server):
    """A chunked stream of FLOOD bytes without a newline, as fast as TCP takes it; `sent`
    counts the bytes the kernel accepted."""

    def __init__(self) -> None:
        super().__init__(self._flood)
        self.sent = 0

    async def _flood(self, n, head, body, writer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (PIECE, b"a" * PIECE)
        for _ in range(FLOOD // PIECE):
            writer.write(piece)
            await writer.drain()
            self.sent += PIECE
        writer.write(b"0\r\n\r\n")


async def test_a_flooded_stream_is_held_by_tcp_while_the_reader_is_behind(client):  # noqa: F811
    async with Flood() as server:
        resp = await client.open(server.url, PATH, b"{}", connect_s=2, read_s=0.3)
        blocks = resp.iter_any()
        got = len(await anext(blocks))
        await asyncio.sleep(1.0)  # the reader is behind for longer than the read timeout
        buffered = sum(map(len, resp._chunks))
        assert buffered <= engine_http.HIGH_WATER + READ_MAX, buffered  # not the flood
        assert server.sent < FLOOD // 4, server.sent  # the rest waits in the engine
        biggest = got
        async for block in blocks:  # reading resumes: the whole answer, in bounded blocks
            got += len(block)
            biggest = max(biggest, len(block))
        assert got == FLOOD == server.sent
        assert biggest <= max(engine_http.HIGH_WATER, READ_MAX), biggest
        resp.release()


async def test_an_answer_read_whole_is_not_paused(client):  # noqa: F811
    async with Flood() as server:
        _, body = await client.post(server.url, PATH, b"{}", connect_s=2, read_s=5, max_body=FLOOD)
        assert len(body) == FLOOD
