"""The VE body the router sends (docs/contract.md §2.2), built from the cached item bytes."""

from __future__ import annotations

import base64
import json
import socket

from aiohttp import web

from epd_kit.router import engine_http
from epd_kit.router.bodies import ve_body, ve_request_id
from epd_kit.wire import encode_request


def test_ve_body_is_the_contract_body_with_the_cached_bytes_unchanged(make_item):
    big = base64.b64encode(bytes(range(256)) * 100).decode()
    items = [make_item("h1", 0, 4, big), make_item("h2", 9, 3, "QUJD")]
    body = ve_body("rid", "epd-ve-0", items)
    # the same body through the wire model (the reference the chunked writer must match)
    entries = [(i.mm_hash, i.length, i.ve_kwargs_b64) for i in items]
    expected = encode_request(ve_request_id("rid", "epd-ve-0"), entries).wire_dict()
    assert json.loads(bytes(body)) == expected
    assert expected["request_id"] == "rid/enc/epd-ve-0"
    assert any(chunk is items[0].ve_kwargs for chunk in body.chunks)  # sent as cached, not copied
    assert body.size == len(bytes(body)) and body.content_type == "application/json"


async def test_an_engine_receives_the_body_whole_with_its_length_also_on_a_resend(make_item):
    """Posted with the router's engine client (engine_http.py) to a real aiohttp server on
    127.0.0.1, once on a kept-alive connection and once on a fresh one."""
    body = ve_body("rid", "epd-ve-0", [make_item("h1", 0, 4, base64.b64encode(b"x" * 300_000).decode())])
    received: list[tuple[str | None, str | None, bytes]] = []

    async def generate(request: web.Request) -> web.Response:
        received.append(
            (request.headers.get("content-length"), request.headers.get("transfer-encoding"), await request.read())
        )
        return web.Response()

    app = web.Application(client_max_size=2**24)
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        client = engine_http.EngineHTTP(keepalive_s=60)
        try:
            for fresh in (False, True):  # the engine client resends the same body after a raced keep-alive close
                resp, _ = await client.post(
                    f"http://127.0.0.1:{port}", "/inference/v1/generate", body, connect_s=5, read_s=5, fresh=fresh
                )
                assert resp.status == 200
        finally:
            client.close()
    finally:
        await runner.cleanup()
    assert received == [(str(body.size), None, bytes(body))] * 2
