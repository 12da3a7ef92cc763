"""Kept-alive engine connections (router/engine_client.py): a connection the engine closes
while idle is dropped by the pool, and a request that races the engine's close (the
connection dies before any answer byte) is resent once on a fresh connection, without
charging the engine. The engine here is a raw asyncio server on 127.0.0.1 that answers the
first request of each connection and, when told to, drops the connection on the next one
without a byte (closed, or reset as a server that closes with a request unread in its buffer
does), the way a keep-alive expiry races a reused connection."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.openai_api import parse_request
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import parse_config
from tests.unit.router.raw_http import RawServer, read_message


class RacingEngine(RawServer):
    """HTTP/1.1 keep-alive engine: GET /health → 200; a generate → two tokens. With
    `drop_reused`, a second request on a connection is dropped unanswered (`reset`: by a
    TCP reset)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop_reused = False
        self.reset = False
        self.generate_connections = 0  # connections that carried a generate (probes aside)
        self.generates = 0
        self.dropped = 0

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        while True:
            head, body = await read_message(reader)
            if served and self.drop_reused and not head.startswith(b"GET"):
                self.dropped += 1
                if self.reset:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                return  # closes the connection: no byte of an answer
            served += 1
            if head.startswith(b"GET"):
                answer = b""
            else:
                self.generate_connections += served == 1
                self.generates += 1
                rid = json.loads(body)["request_id"]
                answer = json.dumps({"request_id": rid, "choices": [{"token_ids": [72, 105]}]}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(answer)).encode()
                + b"\r\n\r\n"
                + answer
            )
            await writer.drain()


@pytest.fixture
async def setup(char_renderer):
    ve, pd = RacingEngine(), RacingEngine()
    await ve.start()
    await pd.start()
    cfg = parse_config(
        {
            "model": "/m",
            "health": {"interval_s": 60},
            "endpoints": {"ve": [{"id": "epd-ve-0", "url": ve.url}], "pd": [{"id": "epd-pd-0", "url": pd.url}]},
        }
    )
    service = RouterService(cfg, char_renderer([1, 2, 3]))
    await service.start()
    yield service, pd
    await service.stop()
    await ve.stop()
    await pd.stop()


async def ask(service: RouterService) -> str:
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}]})
    answer = await service.generation.complete(RequestContext.start(chat, "rid", service.state.cfg))
    return answer["choices"][0]["message"]["content"]


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_request_racing_the_engines_close_is_resent_on_a_fresh_connection(setup, reset):
    service, pd = setup
    assert await ask(service) == "Hi"  # one connection, kept alive in the pool
    pd.drop_reused, pd.reset = True, reset
    assert await ask(service) == "Hi"  # reused: dropped unanswered, resent on a new connection
    assert pd.dropped == 1 and pd.generates == 2 and pd.generate_connections == 2
    engine = service.state.pools.pd[0]
    assert engine.healthy and engine.call_failures == 0  # the race is not the engine's failure


async def test_kept_alive_connections_serve_a_burst_after_a_pause(setup):
    service, pd = setup
    assert await ask(service) == "Hi"
    await asyncio.sleep(0.5)
    assert await ask(service) == "Hi"
    assert pd.generate_connections == 1 and pd.generates == 2  # the pooled connection survived the pause
