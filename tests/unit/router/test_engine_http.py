"""The router's engine HTTP client (router/engine_http.py) against raw servers on 127.0.0.1:
keep-alive reuse and expiry, a connection the engine closed while idle or before answering,
an answer cut short, chunked and read-until-close bodies, streams closed before their end,
refused connections, read timeouts, resets and garbage, each mapped to the failure class
upstream.classify_exception gives it."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable

import pytest

from epd_kit.router import engine_http, upstream
from epd_kit.router.errors import Failure
from epd_kit.router.pools import Engine
from tests.unit.router.raw_http import RawServer, read_message

PATH = "/inference/v1/generate"

# (request number on this connection, request head, request body, writer) -> None
Script = Callable[[int, bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


def answer(body: bytes = b'{"ok":1}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


class Server(RawServer):
    """A raw HTTP/1.1 server: reads each request (head, Content-Length body) and lets the
    test's script write whatever it likes; counts connections and requests."""

    def __init__(self, script: Script) -> None:
        super().__init__()
        self.script = script
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        while True:
            head, body = await read_message(reader)
            self.requests.append((head, body))
            await self.script(n, head, body, writer)
            n += 1
            if writer.is_closing():
                return
            await writer.drain()


VE = Engine(id="epd-ve-0", url="http://127.0.0.1:1", role="ve")


def classified(exc: engine_http.EngineCallError) -> tuple[int, Failure | None, str]:
    err = upstream.classify_exception(exc, VE)
    return err.status, err.failure, err.message


@pytest.fixture
async def client():
    http = engine_http.EngineHTTP(keepalive_s=60)
    yield http
    http.close()


async def post(client: engine_http.EngineHTTP, server: Server, body: bytes = b"{}", **kw) -> tuple[int, bytes]:
    resp, data = await client.post(server.url, PATH, body, connect_s=2, read_s=kw.pop("read_s", 5), **kw)
    return resp.status, data


async def test_the_request_on_the_wire_and_keep_alive_reuse(client):
    async def ok(n, head, body, writer):
        writer.write(answer(b"echo:" + body))

    async with Server(ok) as server:
        for i in range(3):
            assert await post(client, server, b'{"i":%d}' % i) == (200, b'echo:{"i":%d}' % i)
        assert server.connections == 1
        head = server.requests[0][0].decode()
        assert head.startswith(f"POST {PATH} HTTP/1.1\r\n")
        assert f"host: {server.url.removeprefix('http://')}" in head
        assert "content-type: application/json" in head and "content-length: 7" in head
        assert "accept-encoding" not in head.lower()  # nothing asks for a compressed answer


async def test_a_connection_the_engine_closed_while_idle_is_not_reused(client):
    async def once(n, head, body, writer):
        writer.write(answer())
        await writer.drain()
        writer.close()  # the engine's keep-alive expiry, after the answer

    async with Server(once) as server:
        assert await post(client, server) == (200, b'{"ok":1}')
        await asyncio.sleep(0.1)
        assert await post(client, server) == (200, b'{"ok":1}')
        assert server.connections == 2


async def test_a_connection_closed_before_any_answer_byte_is_server_disconnected_and_fresh_dials(client):
    async def first_only(n, head, body, writer):
        if n == 0:
            writer.write(answer())
        else:
            writer.close()  # a reused connection dropped without a byte: the race with the expiry

    async with Server(first_only) as server:
        assert await post(client, server) == (200, b'{"ok":1}')
        with pytest.raises(engine_http.ClosedBeforeAnswer) as info:
            await post(client, server)
        assert classified(info.value)[:2] == (502, Failure.error)
        assert "connection broken (ClosedBeforeAnswer)" in classified(info.value)[2]
        assert await post(client, server, fresh=True) == (200, b'{"ok":1}')
        assert server.connections == 2


async def test_fresh_dials_even_with_an_idle_connection(client):
    async def ok(n, head, body, writer):
        writer.write(answer())

    async with Server(ok) as server:
        await post(client, server)
        await post(client, server, fresh=True)
        assert server.connections == 2


async def test_an_answer_cut_short_in_the_body_is_a_payload_error(client):
    async def cut(n, head, body, writer):
        writer.write(answer(b"x" * 100)[:-40])
        await writer.drain()
        writer.close()

    async with Server(cut) as server:
        with pytest.raises(engine_http.AnswerCutShort) as info:
            await post(client, server)
        status, failure, message = classified(info.value)
        assert (status, failure) == (502, Failure.error) and "connection broken (AnswerCutShort)" in message


async def test_a_chunked_answer_is_read_whole_and_its_connection_reused(client):
    async def chunked(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b'{"a":', b'"bc"', b"}"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")

    async with Server(chunked) as server:
        assert await post(client, server) == (200, b'{"a":"bc"}')
        assert await post(client, server) == (200, b'{"a":"bc"}')
        assert server.connections == 1


async def test_a_body_that_ends_with_the_connection_is_complete_and_not_reused(client):
    async def until_close(n, head, body, writer):
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a":1}')
        await writer.drain()
        writer.close()

    async with Server(until_close) as server:
        assert await post(client, server) == (200, b'{"a":1}')
        assert await post(client, server) == (200, b'{"a":1}')
        assert server.connections == 2


async def test_connection_close_is_honoured(client):
    async def close_header(n, head, body, writer):
        writer.write(answer(extra=b"connection: close\r\n"))

    async with Server(close_header) as server:
        await post(client, server)
        await post(client, server)
        assert server.connections == 2


async def test_headers_and_error_statuses_reach_the_caller(client):
    async def busy(n, head, body, writer):
        writer.write(b"HTTP/1.1 429 Too Many\r\nRetry-After: 7\r\ncontent-length: 2\r\n\r\n{}")

    async with Server(busy) as server:
        resp, data = await client.post(server.url, PATH, b"{}", connect_s=2, read_s=5)
        assert (resp.status, data) == (429, b"{}")
        assert resp.headers.get("retry-after") == "7" and resp.headers["RETRY-AFTER"] == "7"
        err = upstream.classify_status(upstream.EngineAnswer(resp.status, data, resp.headers), VE)
        assert err.status == 429 and err.retry_after == 7.0


async def test_a_refused_connection_is_a_connector_error_classified_refused(client):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(engine_http.CannotConnect) as info:
        await client.post(f"http://127.0.0.1:{port}", PATH, b"{}", connect_s=2, read_s=5)
    status, failure, message = classified(info.value)
    assert (status, failure) == (502, Failure.refused) and "cannot connect (CannotConnect)" in message


async def test_no_byte_within_the_read_timeout_is_a_socket_timeout(client):
    async def hang(n, head, body, writer):
        await asyncio.sleep(30)

    async with Server(hang) as server:
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(engine_http.ReadTimeout) as info:
            await post(client, server, read_s=0.3)
        assert 0.25 < loop.time() - t < 3
        assert isinstance(info.value, TimeoutError)  # callers catch EngineCallError first
        status, failure, message = classified(info.value)
        assert (status, failure) == (504, Failure.timeout) and "timed out (ReadTimeout)" in message


async def test_the_read_timeout_restarts_with_each_byte(client):
    async def trickle(n, head, body, writer):
        data = answer(b"x" * 6)
        for i in range(0, len(data), 8):
            writer.write(data[i : i + 8])
            await writer.drain()
            await asyncio.sleep(0.1)

    async with Server(trickle) as server:
        assert await post(client, server, read_s=0.5) == (200, b"x" * 6)


async def test_a_reset_before_the_answer_is_a_client_os_error(client):
    async def reset(n, head, body, writer):
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async with Server(reset) as server:
        with pytest.raises((engine_http.ConnectionBroken, engine_http.ClosedBeforeAnswer)) as info:
            await post(client, server)
        assert classified(info.value)[:2] == (502, Failure.error)


async def test_garbage_is_a_response_error(client):
    async def garbage(n, head, body, writer):
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    async with Server(garbage) as server:
        with pytest.raises(engine_http.NotAnAnswer) as info:
            await post(client, server)
        assert classified(info.value)[:2] == (502, Failure.error)


async def test_a_stream_is_read_as_it_arrives_and_reused_only_when_read_to_its_end(client):
    gate = asyncio.Event()

    async def sse(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await gate.wait()
        writer.write(b"0\r\n\r\n")

    async with Server(sse) as server:
        resp = await client.open(server.url, PATH, b"{}", connect_s=2, read_s=5)
        chunks = resp.iter_any()
        assert await anext(chunks) == b"data: 1\n\n"  # before the engine sent the rest
        gate.set()
        assert [c async for c in chunks] == [b"data: 2\n\n"]
        resp.release()  # read to its end: back to the pool
        gate.clear()
        resp = await client.open(server.url, PATH, b"{}", connect_s=2, read_s=5)
        assert server.connections == 1
        assert await anext(resp.iter_any()) == b"data: 1\n\n"
        resp.release()  # not read to its end: the connection is dropped
        gate.set()
        resp = await client.open(server.url, PATH, b"{}", connect_s=2, read_s=5)
        assert await resp.read() == b"data: 1\n\ndata: 2\n\n"
        resp.release()
        assert server.connections == 2


async def test_closing_a_stream_wakes_its_reader(client):
    async def silent_stream(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(30)

    async with Server(silent_stream) as server:
        resp = await client.open(server.url, PATH, b"{}", connect_s=2, read_s=30)
        chunks = resp.iter_any()
        assert await anext(chunks) == b"hello"
        asyncio.get_running_loop().call_later(0.1, resp.close)  # as generation.GapWatch does
        with pytest.raises(engine_http.ConnectionFailed):
            await asyncio.wait_for(anext(chunks), 5)


async def test_a_cancelled_call_drops_its_connection(client):
    async def slow(n, head, body, writer):
        await asyncio.sleep(0.5 if n == 0 else 0)
        writer.write(answer())

    async with Server(slow) as server:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await post(client, server)
        assert await post(client, server) == (200, b'{"ok":1}')
        assert server.connections == 2  # the first connection's late answer is never read as this one's


async def test_idle_connections_expire_after_the_keep_alive():
    http = engine_http.EngineHTTP(keepalive_s=0.2)

    async def ok(n, head, body, writer):
        writer.write(answer())

    try:
        async with Server(ok) as server:
            await post(http, server)
            await asyncio.sleep(0.05)
            await post(http, server)
            assert server.connections == 1
            await asyncio.sleep(0.5)  # the sweep closes it
            pool = http._pools[server.url]
            assert pool.idle == [] and pool.open == set()
            await post(http, server)
            assert server.connections == 2
    finally:
        http.close()


class Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = tuple(chunks)
        self.size = sum(map(len, chunks))


async def test_a_chunked_request_body_is_sent_whole_with_its_length(client):
    async def echo_len(n, head, body, writer):
        writer.write(answer(str(len(body)).encode()))

    big = Chunks([b'{"a":"', b"x" * 3_000_000, b"y" * 2_000_000, b'"}'])
    async with Server(echo_len) as server:
        assert await post(client, server, big) == (200, str(big.size).encode())
        head, body = server.requests[0]
        assert b"content-length: %d" % big.size in head and body == b"".join(big.chunks)


async def test_a_closed_client_refuses_calls(client):
    client.close()
    with pytest.raises(engine_http.ConnectionFailed):
        await client.post("http://127.0.0.1:1", PATH, b"{}", connect_s=1, read_s=1)


async def test_the_call_deadline_fires_as_deadline_exceeded_also_while_the_body_is_sent(client):
    """`deadline` bounds the whole call (not a EngineCallError: the caller words it), also when
    the engine reads nothing and the request body cannot be written out."""
    stop = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await stop.wait()
        writer.close()

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        loop = asyncio.get_running_loop()
        for content in (b"{}", Chunks([b"x" * 65536] * 400)):  # 26 MB: more than the socket buffers hold
            t = loop.time()
            with pytest.raises(engine_http.DeadlineExceeded) as info:
                await client.post(url, PATH, content, connect_s=2, read_s=30, deadline=t + 0.3)
            assert not isinstance(info.value, engine_http.EngineCallError) and isinstance(info.value, TimeoutError)
            assert 0.25 < loop.time() - t < 3
        assert client._pools[url].open == set() or all(c.lost for c in client._pools[url].open)
    finally:
        stop.set()
        server.close()
        await server.wait_closed()


async def test_a_deadline_shorter_than_the_connect_timeout_is_the_deadline(client):
    with pytest.raises(engine_http.DeadlineExceeded):
        await client.post("http://127.0.0.1:1", PATH, b"{}", connect_s=5, read_s=5, deadline=0.0)
