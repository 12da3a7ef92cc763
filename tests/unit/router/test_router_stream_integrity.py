"""What a client sees of a PD stream that misbehaves after it started, over
real HTTP from a scripted PD. A truncated stream, a PD error frame or a stream without
tokens ends with the router's own error frame (request id, no engine address, nothing after
it); malformed frames are skipped, counted and logged once; CRLF line endings are valid; a
line without a newline is bounded."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
import pytest

from epd_kit.router.context import RequestContext
from epd_kit.router.openai_api import parse_request
from epd_kit.router.pd_stream import SseReader
from tests.unit.router.test_router_generation import (
    Engines,
    all_slots_free,
    make_service,  # noqa: F401  (the fixture)
)


def frame(doc: dict, end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(doc).encode() + end


def token(t: int, finish: str | None = None) -> dict:
    return {"request_id": "r", "choices": [{"index": 0, "token_ids": [t], "finish_reason": finish}]}


@dataclass
class RawPd(Engines):
    """PDs whose streams send `raw` chunks (then hang for `hang_s` if set)."""

    raw: list[bytes] = field(default_factory=list)
    pace_s: float = 0.0

    def _generate(self, pd: str, body: dict) -> httpx.Response:
        if not body.get("stream"):
            return super()._generate(pd, body)

        async def content():
            for chunk in self.raw:
                yield chunk
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)

        return httpx.Response(200, content=content(), headers={"content-type": "text/event-stream"})


async def stream(service) -> tuple[list[bytes], str]:
    chat = parse_request({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    ctx = RequestContext.start(chat, "rid-7", service.state.cfg)
    pd = await service.generation.open_stream(ctx)
    outcome = service.metrics.track_request()
    frames = [f async for f in service.generation.relay(ctx, pd, outcome)]
    return frames, outcome.status


def pd_failures(service) -> float:
    return sum(
        service.metrics.registry.get_sample_value("epd_router_engine_failures_total", {"engine": e.id, "role": "pd"})
        or 0
        for e in service.state.pools.pd
    )


def router_error(frames: list[bytes]) -> dict:
    """The last frame is the router's own error envelope; nothing follows it."""
    doc = json.loads(frames[-1][6:])
    assert set(doc) == {"error", "request_id"} and doc["request_id"] == "rid-7", doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert b"127.0.0.1" not in b"".join(frames) and b"[DONE]" not in b"".join(frames)
    return doc["error"]


async def test_a_truncated_stream_ends_with_an_error_frame(make_service):  # noqa: F811
    engines = RawPd(raw=[frame(token(72)), frame(token(105))])  # no finish_reason, no [DONE]
    service = await make_service(engines)
    frames, status = await stream(service)
    error = router_error(frames)
    assert error["code"] == 502 and "ended before the answer was complete" in error["message"]
    assert status == "stream_error" and pd_failures(service) == 1 and all_slots_free(service)


async def test_a_pd_error_frame_becomes_the_routers_own(make_service):  # noqa: F811
    leak = {"error": {"message": "EngineCore died at 127.0.0.1:9", "code": 500, "peer": "127.0.0.1"}}
    engines = RawPd(raw=[frame(token(72)), frame(leak), frame(token(105, "stop")), b"data: [DONE]\n\n"])
    service = await make_service(engines)
    frames, status = await stream(service)
    error = router_error(frames)
    assert error == {
        "message": "the engine failed while generating",
        "type": "upstream_error",
        "param": None,
        "code": 502,
    }
    assert len(frames) == 2 and status == "stream_error" and pd_failures(service) == 1


async def test_events_without_tokens_do_not_hold_a_stream_past_the_gap(make_service):  # noqa: F811
    empty = frame({"request_id": "r", "choices": []})
    engines = RawPd(raw=[frame(token(72))] + [empty] * 400, pace_s=0.02)  # 8 s of keep-alive noise
    service = await make_service(engines, stream_gap_s=0.4)
    t0 = time.monotonic()
    frames, status = await stream(service)
    assert time.monotonic() - t0 < 0.4 + 1.0
    error = router_error(frames)
    assert error["code"] == 504 and error["message"] == "generation stalled: no token for 0.4s"
    assert status == "stream_error" and all_slots_free(service)


async def test_malformed_frames_are_counted_and_logged_once(make_service, caplog):  # noqa: F811
    junk = [b"data: {not json\n\n", b"data: [1]\n\n", frame({"choices": [{"index": 0, "token_ids": ["x"]}]})]
    engines = RawPd(raw=[frame(token(72)), *junk * 100, frame(token(105, "stop")), b"data: [DONE]\n\n"])
    service = await make_service(engines)
    with caplog.at_level(logging.WARNING):
        frames, status = await stream(service)
    assert status == "200" and frames[-1] == b"data: [DONE]\n\n"
    text = "".join(json.loads(f[6:])["choices"][0]["delta"].get("content", "") for f in frames[:-1])
    assert text == "Hi"
    labels = {"model": service.state.cfg.model_name}
    assert service.metrics.registry.get_sample_value("epd_router_pd_stream_malformed_frames_total", labels) == 300
    assert [r.getMessage() for r in caplog.records].count("malformed PD stream frames skipped") == 1


async def test_crlf_line_endings_are_accepted(make_service):  # noqa: F811
    raw = b"".join([frame(token(72), b"\r\n\r\n"), b": comment\r\n", frame(token(105, "stop"), b"\r\n\r\n")])
    engines = RawPd(raw=[raw[i : i + 7] for i in range(0, len(raw), 7)] + [b"data: [DONE]\r\n\r\n"])
    service = await make_service(engines)
    frames, status = await stream(service)
    assert status == "200" and frames[-1] == b"data: [DONE]\n\n" and len(frames) == 3


async def test_a_line_without_a_newline_is_bounded(make_service):  # noqa: F811
    engines = RawPd(raw=[frame(token(72)), b"data: " + b"x" * 65536] + [b"y" * 65536] * 40)  # 2.6 MB, no LF
    service = await make_service(engines)
    frames, status = await stream(service)
    error = router_error(frames)
    assert error == {
        "message": "the engine sent an invalid answer",
        "type": "upstream_error",
        "param": None,
        "code": 502,
    }
    assert status == "stream_error" and pd_failures(service) == 1 and all_slots_free(service)


class _Pd:
    id, url, role = "pd-x", "http://127.0.0.1:1", "pd"


async def chunks(*parts: bytes):
    for part in parts:
        yield part


@pytest.mark.parametrize("size", [1, 2, 3, 5, 64])
async def test_the_reader_splits_events_at_any_chunk_boundary(size):
    raw = b'data: {"a":1}\r\n\r\nevent: x\ndata: line1\ndata:line2\n\n: c\n\ndata: [DONE]\n\ndata: after\n\n'
    reader = SseReader(chunks(*(raw[i : i + size] for i in range(0, len(raw), size))), _Pd())
    assert [p async for p in reader] == [b'{"a":1}', b"line1\nline2"] and reader.done


async def test_the_reader_without_done_says_so():
    reader = SseReader(chunks(b"data: 1\n\ndata: 2"), _Pd())
    assert [p async for p in reader] == [b"1"] and not reader.done
