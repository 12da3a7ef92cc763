"""No engine answer is trusted. Against raw servers on 127.0.0.1: a head too
long or with too many lines is refused after a bounded read (not joined quadratically), a
body above the call's cap is refused before it is read whole, interim 1xx answers are
skipped, a `/health` of 100 MB costs nothing, an engine 429's Retry-After is read
defensively, and token ids outside the vocabulary are refused before detokenizing."""

from __future__ import annotations

import asyncio
import time

import pytest

from epd_kit.router import engine_http, upstream
from epd_kit.router.engine_client import MAX_HEALTH_BYTES, EngineClient
from epd_kit.router.health import ProbeFailed
from epd_kit.router.pools import Engine
from epd_kit.router_yaml import Health
from tests.unit.router.test_engine_http import PATH, Server, answer

PD = Engine(id="epd-pd-0", url="http://127.0.0.1:1", role="pd")


def call(http: engine_http.EngineHTTP, url: str, **kw: float):
    kw.setdefault("max_body", 1 << 20)
    return http.post(url, PATH, b"{}", connect_s=2, read_s=5, deadline=http.loop.time() + 10, **kw)


async def test_a_huge_answer_head_is_refused_after_a_bounded_read():
    async def script(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        for _ in range(1600):  # 100 MB in 64 KiB writes, if the client kept reading
            writer.write(b"a" * 65536)
            await writer.drain()
            if writer.is_closing():
                return

    async with Server(script) as server:
        http = engine_http.EngineHTTP(keepalive_s=5)
        t = time.monotonic()
        with pytest.raises(engine_http.AnswerTooLarge, match="head is longer than 65536 bytes"):
            await call(http, server.url)
        assert time.monotonic() - t < 1.0
        http.close()


async def test_too_many_header_lines_are_refused():
    async def script(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x: 1\r\n" * 500 + b"content-length: 0\r\n\r\n")

    async with Server(script) as server:
        http = engine_http.EngineHTTP(keepalive_s=5)
        with pytest.raises(engine_http.AnswerTooLarge, match="more than 100 header lines"):
            await call(http, server.url)
        http.close()


@pytest.mark.parametrize("framing", ["length", "chunked", "declared"])
async def test_a_body_above_the_cap_is_refused_before_it_is_read_whole(framing):
    async def script(n, head, body, writer):
        if framing == "declared":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n{")
            return
        size = 4 << 20
        if framing == "length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"a" * size)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(64):
                writer.write(b"10000\r\n" + b"a" * 65536 + b"\r\n")
            writer.write(b"0\r\n\r\n")

    async with Server(script) as server:
        http = engine_http.EngineHTTP(keepalive_s=5)
        with pytest.raises(engine_http.AnswerTooLarge):
            await call(http, server.url, max_body=1 << 20)
        http.close()
    err = upstream.classify_exception(engine_http.AnswerTooLarge("the engine's answer is longer than 1 bytes"), PD)
    assert err.status == 502 and err.failure is not None  # charged to the engine
    # named for what happened: the connection itself was fine
    assert "connection broken" not in err.message and "answer is longer than 1 bytes" in err.message
    assert err.client_message == "the engine's answer was too large"


async def test_interim_answers_are_skipped_and_the_final_one_is_read():
    async def script(n, head, body, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n" + answer(b'{"n":%d}' % n))

    async with Server(script) as server:
        http = engine_http.EngineHTTP(keepalive_s=5)
        for n in range(2):  # and the connection stays usable
            resp, body = await call(http, server.url)
            assert (resp.status, body) == (200, b'{"n":%d}' % n)
            assert "link" not in resp.headers
        assert server.connections == 1
        http.close()


async def test_endless_interim_answers_are_bounded_by_the_head_cap():
    async def script(n, head, body, writer):
        for _ in range(10_000):
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
            await writer.drain()
            if writer.is_closing():
                return

    async with Server(script) as server:
        http = engine_http.EngineHTTP(keepalive_s=5)
        with pytest.raises(engine_http.AnswerTooLarge):
            await call(http, server.url)
        http.close()


def _client(health_timeout: float = 1.0):
    from types import SimpleNamespace

    from epd_kit.router.metrics import RouterMetrics  # noqa: F401 (the client's signature)

    state = SimpleNamespace(cfg=SimpleNamespace(health=Health(timeout_s=health_timeout)))
    client = EngineClient(state, None)  # type: ignore[arg-type]
    client._http = engine_http.EngineHTTP(keepalive_s=5)
    return client


async def test_a_100_mb_health_answer_is_not_read():
    async def script(n, head, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        for _ in range(1600):
            writer.write(b"a" * 65536)
            await writer.drain()
            if writer.is_closing():
                return

    class GetServer(Server):
        async def serve_connection(self, reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await script(0, b"", b"", writer)

    async with GetServer(script) as server:
        client = _client()
        engine = Engine(id="epd-pd-0", url=server.url, role="pd")
        t = time.monotonic()
        with pytest.raises(ProbeFailed, match="AnswerTooLarge"):
            await client.health_status(engine, Health(timeout_s=5))
        assert time.monotonic() - t < 1.0
        assert MAX_HEALTH_BYTES <= 64 * 1024
        client.http.close()


async def test_a_health_answer_that_trickles_fails_by_its_deadline():
    async def script(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        for _ in range(100):  # a byte every 50 ms: each read restarts a read timeout, not a deadline
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(0.05)

    class Trickle(Server):
        async def serve_connection(self, reader, writer):
            await script(reader, writer)

    async with Trickle(None) as server:  # type: ignore[arg-type]
        client = _client()
        t = time.monotonic()
        with pytest.raises(ProbeFailed, match=r"no answer within 0.5s"):
            await client.health_status(Engine(id="epd-pd-0", url=server.url, role="pd"), Health(timeout_s=0.5))
        assert time.monotonic() - t < 1.0
        client.http.close()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("inf", 1),
        ("nan", 1),
        ("-5", 1),
        ("1e9", 1),
        ("garbage", 1),
        ("\xb2", 1),  # a latin-1 digit that int() refuses
        ("", 1),
        ("7", 7),
        ("99999999999999999999", 60),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 1),  # in the past
        ("Wed, 21 Oct 2099 07:28:00 GMT", 60),
    ],
)
def test_an_engine_retry_after_is_read_defensively(value, seconds):
    err = upstream.classify_status(upstream.EngineAnswer(429, b"", {"retry-after": value}), PD)
    assert err.status == 429 and err.retry_after == seconds
    assert err.headers("r")["Retry-After"] == str(seconds)  # what the client gets, no OverflowError


def test_token_ids_outside_the_vocabulary_are_refused_before_detokenizing(tmp_path):
    from epd_kit.preprocess.model_files import CheckpointFiles
    from epd_kit.preprocess.text import IncrementalDetokenizer, TextCodec, TokenIdOutOfRange
    from epd_kit.router.errors import Failure, UpstreamError
    from epd_kit.router.translate import engine_tokens
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "ckpt")
    codec = TextCodec(CheckpointFiles.load(checkpoint))
    assert codec.id_limit >= codec.vocab_size
    assert codec.decode([1, 2, codec.id_limit - 1]) is not None  # a padding row decodes to nothing
    for bad in (-1, 2**40, codec.id_limit, "7", 1.0, True):
        with pytest.raises(TokenIdOutOfRange):
            codec.decode([1, bad])
        detok = IncrementalDetokenizer(codec)
        with pytest.raises(TokenIdOutOfRange):
            detok.push([bad])
        assert detok.token_ids == []
    with pytest.raises(UpstreamError) as err, engine_tokens(PD):  # the PD's invalid answer, charged to it
        codec.decode([-1])
    assert err.value.status == 502 and "outside the model's vocabulary" in err.value.message
    assert err.value.failure is Failure.error and err.value.engine_id == PD.id
