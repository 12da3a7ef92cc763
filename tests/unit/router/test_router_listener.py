"""The listener's request-head cap (router/listener.py): llhttp has none of its own, so a
header flood is cut at MAX_HEAD_BYTES with the JSON 400 envelope, while a normal head that
arrives in one chunk with a large body is not mistaken for one. A real uvicorn server on
127.0.0.1 with the router's protocol and a trivial app."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import tomllib
from collections.abc import AsyncIterator
from importlib import metadata
from pathlib import Path

import pytest
import uvicorn
from packaging.requirements import Requirement

from epd_kit.router.listener import (
    CLIENT_KEEPALIVE_S,
    MAX_HEAD_BYTES,
    HeadJoiner,
    drain_linger_s,
    protocol_factory,
)
from epd_kit.router_yaml import Listen
from tests.unit.router.raw_http import read_message

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def uvicorn_bound() -> Requirement:
    """The kit's uvicorn requirement (pyproject.toml): the releases the listener was measured with."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (requirement,) = [Requirement(d) for d in dependencies if re.match(r"uvicorn\b", d)]
    return requirement


def test_the_installed_uvicorn_is_one_the_listener_was_measured_with():
    """The listener subclasses uvicorn's HttpToolsProtocol and reads its private state (cycle,
    flow, parser, connections): another uvicorn release may change any of it without notice.
    The bound has an upper end, and this test fails on a uvicorn outside it, naming it."""
    bound = uvicorn_bound()
    assert any(spec.operator == "<" for spec in bound.specifier), f"{bound} has no upper bound"
    installed = metadata.version("uvicorn")
    assert bound.specifier.contains(installed, prereleases=True), (
        f"uvicorn {installed} is installed, outside the kit's bound {bound} (pyproject.toml): "
        "router/listener.py uses uvicorn's internals and was measured only inside it; run this module's "
        "tests and tests/router_processes on the new release, then move the bound"
    )


async def echo_length(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"received": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(closed: list[str], app=echo_length, listen: Listen | None = None) -> AsyncIterator[int]:
    async with running_server(closed, app, listen) as server:
        yield server.servers[0].sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def running_server(
    closed: list[str], app=echo_length, listen: Listen | None = None
) -> AsyncIterator[uvicorn.Server]:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=protocol_factory(listen or Listen(), closed.append),
        lifespan="off",
        log_config=None,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(500):  # up to 5 s
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


async def exchange(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(5):
            head, body = await read_message(reader)
            return head + body
    finally:
        writer.close()


async def test_a_header_flood_is_cut_with_the_json_envelope():
    closed: list[str] = []
    async with serving(closed) as port:
        flood = b"".join(b"x-filler-%d: %s\r\n" % (i, b"a" * 100) for i in range(200))  # ~22 KiB, no end
        answer = await exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n" + flood)
    assert answer.startswith(b"HTTP/1.1 400 ")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert f"request head over {MAX_HEAD_BYTES // 1024} KiB" in body["error"]["message"]
    assert closed == ["malformed"]


async def test_a_normal_head_with_a_large_body_in_one_chunk_is_served():
    closed: list[str] = []
    async with serving(closed) as port:
        body = b"{" + b" " * 200_000 + b"}"
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
        answer = await exchange(port, head + body)
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"received": len(body)}
    assert closed == []


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict]:
    async with asyncio.timeout(5):
        head, body = await read_message(reader)
        return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    "headers",
    [
        b"authorization: Bearer " + b"k" * 120_000 + b"\r\n",  # one 120 KB header
        b"".join(b"x-h-%d: v\r\n" % i for i in range(1500)),  # 1,500 small ones (~20 KB)
    ],
    ids=["one-huge-header", "many-headers"],
)
async def test_the_head_cap_holds_for_a_head_sent_in_one_write(headers):
    """The 16 KiB cap held only for heads that arrived in pieces."""
    closed: list[str] = []
    async with serving(closed) as port:
        answer = await exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n" + headers + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ") and b"request head over 16 KiB" in answer
    assert closed == ["malformed"]


@pytest.mark.parametrize(
    "upgrade",
    [
        b"upgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
        b"upgrade: foo\r\nconnection: upgrade\r\n",
        b"upgrade: websocket\r\nconnection: upgrade\r\n",
        b"upgrade: foo\r\n",
    ],
    ids=["h2c", "foo", "websocket", "no-connection-upgrade"],
)
async def test_an_upgrade_is_ignored_the_body_read_and_the_next_request_served(upgrade):
    """`curl --http2` (Upgrade: h2c) got 400 'not valid JSON' (the body
    was dropped) and a request pipelined after it got no answer."""
    closed: list[str] = []
    async with serving(closed) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"messages": []}'
        first = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\n" + upgrade
        first += b"content-length: %d\r\n\r\n" % len(body) + body
        second = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 3\r\n\r\nabc"
        writer.write(first + second)  # pipelined
        try:
            assert await read_answer(reader) == (200, {"received": len(body)})
            assert await read_answer(reader) == (200, {"received": 3})
        finally:
            writer.close()
    assert closed == []


async def test_an_unsupported_transfer_coding_is_a_501():
    """`Transfer-Encoding: gzip, chunked` with a plain body was accepted."""
    closed: list[str] = []
    async with serving(closed) as port:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
        answer = await exchange(port, head + b"3\r\nabc\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 501 ") and b"transfer coding 'gzip, chunked' is not implemented" in answer


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_write_buffer_size(self) -> int:
        return 0


class Cycle:
    response_started = False


async def test_the_response_head_goes_out_with_the_first_body_write():
    """uvicorn writes a response's head and body apart: two sends, two segments for a
    one-piece answer. The head waits for the body's first write and goes out with it."""
    transport, cycle = RecordingTransport(), Cycle()
    joiner = HeadJoiner(transport, cycle, asyncio.get_running_loop())
    joiner.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the response: straight through
    cycle.response_started = True
    joiner.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert transport.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    joiner.write(b"{}")
    joiner.write(b"more")  # later writes: as they come
    assert transport.writes[1:] == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"more"]
    await asyncio.sleep(0)  # the end-of-turn flush finds nothing held
    assert len(transport.writes) == 3
    assert joiner.get_write_buffer_size() == 0  # anything else is the transport's


async def test_a_held_head_goes_out_at_the_end_of_the_turn_or_before_a_close():
    loop = asyncio.get_running_loop()
    transport, cycle = RecordingTransport(), Cycle()
    joiner = HeadJoiner(transport, cycle, loop)
    cycle.response_started = True
    joiner.write(b"head")
    await asyncio.sleep(0)  # no body this turn (a stream's first frame not ready): the head alone
    assert transport.writes == [b"head"]
    transport, cycle = RecordingTransport(), Cycle()
    joiner = HeadJoiner(transport, cycle, loop)
    cycle.response_started = True
    joiner.write(b"head")
    joiner.close()
    assert transport.writes == [b"head"] and transport.closed
    await asyncio.sleep(0)
    assert transport.writes == [b"head"]  # not twice
    transport, cycle = RecordingTransport(), Cycle()
    joiner = HeadJoiner(transport, cycle, loop)
    cycle.response_started = True
    joiner.write(b"head")
    joiner.abort()  # a dropped client: nothing more is sent
    await asyncio.sleep(0)
    assert transport.writes == [] and transport.aborted


async def test_a_stream_gets_its_head_before_its_first_frame_is_ready():
    """A real server: the head of a response whose body comes later is not held back for it."""
    release = asyncio.Event()

    async def late_body(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late"})

    async with serving([], late_body) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
            release.set()
            async with asyncio.timeout(5):
                assert await reader.readuntil(b"0\r\n\r\n") == b"4\r\nlate\r\n0\r\n\r\n"
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("header_s", "body_s", "late"),
    [(0.4, 30.0, "head"), (30.0, 0.4, "body")],
    ids=["header-after-a-long-body-limit", "body-before-a-long-header-limit"],
)
async def test_each_phase_keeps_its_deadline_on_a_kept_alive_connection(header_s, body_s, late):
    """The listener keeps one timer per connection and moves its deadline per phase
    (`_arm`): a later deadline leaves the timer, an earlier one replaces it. Either way the
    second request on a kept-alive connection gets its 408 at its own phase's limit."""
    closed: list[str] = []
    listen = Listen(header_timeout_s=header_s, body_timeout_s=body_s)
    async with serving(closed, listen=listen) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):  # requests that complete: every phase armed and disarmed
                writer.write(b"POST / HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}")
                assert await read_answer(reader) == (200, {"received": 2})
            loop = asyncio.get_running_loop()
            started = loop.time()
            if late == "head":
                writer.write(b"POST / HTTP/1.1\r\nhost: r\r\n")  # the head never ends
            else:
                writer.write(b"POST / HTTP/1.1\r\nhost: r\r\ncontent-length: 10\r\n\r\n{}")
            async with asyncio.timeout(10):
                answer = await reader.read()
            waited = loop.time() - started
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    limit = header_s if late == "head" else body_s
    assert limit * 0.9 <= waited < limit + 3.0, waited
    assert closed == [f"{'header' if late == 'head' else 'body'}_timeout"]


# --- a group's hand-over: idle kept-alive connections linger (server.py _hand_over_listener) ---

GET = b"GET / HTTP/1.1\r\nhost: r\r\n\r\n"


async def kept_alive(server: uvicorn.Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, object]:
    """A connection with one answered request on it, kept alive, and the server's protocol of it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.servers[0].sockets[0].getsockname()[1])
    writer.write(GET)
    async with asyncio.timeout(5):
        head, _ = await read_message(reader)
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head.lower()
    (protocol,) = server.server_state.connections
    return reader, writer, protocol


async def test_a_request_on_an_idle_connection_during_the_linger_is_answered_then_closed():
    """The race of issue 55: a client takes its idle connection from its pool as the process
    starts to hand over; closing the connection then met the client's request with a reset.
    Within the linger the request is answered with `Connection: close`, and the connection
    closed after it."""
    closed: list[str] = []
    async with running_server(closed) as server:
        reader, writer, protocol = await kept_alive(server)
        protocol.shutdown(5.0)
        assert not protocol.transport.is_closing()  # idle for less than the linger: kept
        writer.write(GET)
        async with asyncio.timeout(5):
            head, body = await read_message(reader)
            rest = await reader.read()
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" in head.lower(), head
    assert json.loads(body) == {"received": 0}
    assert rest == b""  # closed after the answer
    assert closed == []


async def test_an_idle_connection_closes_at_the_end_of_the_linger():
    """A drain with only an idle client ends once the connection has been idle the linger, not at
    the idle timeout (75 s by default)."""
    closed: list[str] = []
    linger_s = 0.5
    async with running_server(closed) as server:
        reader, writer, protocol = await kept_alive(server)
        loop = asyncio.get_running_loop()
        # the server's response ended then (uvicorn armed its keep-alive timer; same event loop)
        idle_since = protocol.timeout_keep_alive_task.when() - protocol.timeout_keep_alive
        protocol.shutdown(linger_s)
        lingering = not protocol.transport.is_closing()
        async with asyncio.timeout(linger_s + 10):
            rest = await reader.read()  # EOF at the linger's end
        ended = loop.time()
        writer.close()
    assert lingering
    assert rest == b""
    assert ended >= idle_since + linger_s  # not before it had been idle the linger


async def test_a_connection_idle_past_the_linger_or_at_uvicorns_exit_closes_at_once():
    """A connection idle longer than the linger is one no conforming client sends on any more:
    the hand-over closes it at once. uvicorn's own shutdown (no linger) closes an idle one at
    once, as before."""
    closed: list[str] = []
    async with running_server(closed) as server:
        _, writer, protocol = await kept_alive(server)
        await asyncio.sleep(0.2)  # the idle time is what is tested: longer than the linger below
        protocol.shutdown(0.1)
        assert protocol.transport.is_closing()
        writer.close()
        _, writer, protocol = await kept_alive(server)
        protocol.shutdown()
        assert protocol.transport.is_closing()
        writer.close()


def test_the_linger_outlasts_the_clients_keep_alive_within_the_idle_timeout_and_the_grace():
    """httpx and the OpenAI SDK drop a pooled connection idle 5 s; the linger is past that, never
    past listen.idle_timeout_s, and half the shutdown grace at most (a request sent at its end
    still has time to be answered); no grace, no linger."""
    assert CLIENT_KEEPALIVE_S < drain_linger_s(Listen(), 30.0) <= 15.0
    assert drain_linger_s(Listen(idle_timeout_s=3), 30.0) == 3
    assert drain_linger_s(Listen(), 4.0) == 2
    assert drain_linger_s(Listen(), 0.0) == 0
