"""The VE body the router sends (docs/contract.md §2.2), built from the cached item bytes."""

from __future__ import annotations

import base64
import json

from epd_kit.router import upstream
from epd_kit.router.encode import ve_body


def test_ve_body_is_the_contract_body_with_the_cached_bytes_unchanged(make_item):
    big = base64.b64encode(bytes(range(256)) * 100).decode()
    items = [make_item("h1", 0, 4, big), make_item("h2", 9, 3, "QUJD")]
    body = ve_body("rid", "epd-ve-0", items)
    expected = upstream.ve_request_body("rid", "epd-ve-0", items)
    assert json.loads(bytes(body)) == expected
    assert expected["request_id"] == "rid/enc/epd-ve-0"
    assert any(chunk is items[0].ve_kwargs for chunk in body.chunks)  # sent as cached, not copied
    assert body.headers == {"content-type": "application/json", "content-length": str(len(bytes(body)))}


async def test_ve_body_streams_its_chunks_afresh_each_time(make_item):
    body = ve_body("rid", "epd-ve-0", [make_item("h1", 0, 4, base64.b64encode(b"x" * 9000).decode())])
    for _ in range(2):  # a resend on a fresh connection starts over
        assert b"".join([chunk async for chunk in body.stream()]) == bytes(body)
