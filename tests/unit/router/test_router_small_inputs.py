"""Blank-line padding before a request line counts towards the 16 KiB head
cap (it streamed past it, holding the connection, on a kept-alive connection without limit);
a key file with a non-ASCII key is refused at load; two Authorization headers are refused."""

from __future__ import annotations

import asyncio
import json

import pytest

from epd_kit.router.auth import KeyFileError, load_api_keys
from tests.unit.router.test_router_listener import exchange, read_answer, serving
from tests.unit.router.test_router_routes import app, client  # noqa: F401  (fixtures)

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n\r\n{}"


async def test_padding_before_the_first_request_is_capped():
    closed: list[str] = []
    async with serving(closed) as port:
        answer = await exchange(port, b"\r\n" * 10_000 + REQUEST)  # 20 KB of empty lines, one write
    assert answer.startswith(b"HTTP/1.1 400 ") and b"request head over 16 KiB" in answer
    assert closed == ["malformed"]


async def test_padding_on_a_kept_alive_connection_is_capped():
    closed: list[str] = []
    async with serving(closed) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(REQUEST)
            assert await read_answer(reader) == (200, {"received": 2})
            writer.write(b"\r\n" * 10_000)  # 20 KB of empty lines after the first request
            await writer.drain()
            status, body = await read_answer(reader)
        finally:
            writer.close()
    assert status == 400 and "request head over 16 KiB" in body["error"]["message"]
    assert closed == ["malformed"]


async def test_a_little_padding_is_still_served():
    closed: list[str] = []
    async with serving(closed) as port:
        answer = await exchange(port, b"\r\n\r\n" + REQUEST)
    assert answer.startswith(b"HTTP/1.1 200 ") and closed == []


@pytest.mark.parametrize("key", ["clé-secrète", "key\x07bell"])
def test_a_key_that_is_not_printable_ascii_is_refused_at_load(tmp_path, key):
    path = tmp_path / "keys"
    path.write_text(f"# keys\nsk-good\n{key}\n", encoding="utf-8")
    path.chmod(0o600)
    with pytest.raises(KeyFileError, match=r"line 3: a key must be printable ASCII"):
        load_api_keys(path)


def test_ascii_keys_still_load(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one\n\n  sk-two  \n", encoding="utf-8")
    path.chmod(0o600)
    assert load_api_keys(path) == (b"sk-one", b"sk-two")


async def test_two_authorization_headers_are_refused(client):  # noqa: F811
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    headers = [("authorization", "Bearer a"), ("authorization", "Bearer b"), ("content-type", "application/json")]
    resp = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("more than one Authorization header")
    resp = await client.get("/v1/models", headers=headers[:2])
    assert resp.status_code == 400
