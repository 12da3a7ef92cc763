"""Issue 33 item 4 against a real router: a raw-socket PD on 127.0.0.1 whose streams misbehave
after they started, for one client's requests (`max_tokens` 13), next to a sim VE and a sim
PD, while a legitimate client's requests and /health are timed. Each case: what the client
of the spoiled streams sees (an error frame the router wrote, with the request id and no
engine address, nothing after it; or the full answer), no 500, no traceback, /health p99 <
100 ms and the legitimate client's p99 < 2 s; malformed frames logged once per request.

Every loop is bounded in count and time; all traffic stays on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.common import percentile
from bench.hostile import Probe
from epd_kit.sim.app import token_frame
from tests.unit.router.raw_http import RawServer, read_message

from .harness import Stack, wait_until

MARK = 13  # max_tokens of the spoiled client's requests
IDS = list(range(300, 316))  # inside the tiny checkpoint's vocabulary
GAP_S = 1.0
ADDRESS = "10.9.8.7"  # an engine-internal address the PD's error frame carries


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StreamPd(RawServer):
    """A PD whose stream answers to MARK requests misbehave as `mode` says."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = "good"

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10_000):
            head, body = await read_message(reader)
            if head.split(b" ", 2)[1] == b"/health":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
                continue
            req = json.loads(body)
            spoiled = req["sampling_params"].get("max_tokens") == MARK
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            if not req.get("stream"):  # the serving probe and legitimate non-stream calls
                writer.close()
                return
            rid = json.dumps(req["request_id"])
            mode = self.mode if spoiled else "good"
            first = token_frame(rid, IDS[:1], None)
            last = token_frame(rid, IDS[1:2], "length")
            if mode == "good":
                parts = [first, last, b"data: [DONE]\n\n"]
            elif mode == "truncated":
                parts = [first, token_frame(rid, IDS[1:2], None)]
            elif mode == "error_frame":
                error = {"error": {"message": f"worker at {ADDRESS} died", "code": 500, "peer": ADDRESS}}
                parts = [first, b"data: " + json.dumps(error).encode() + b"\n\n", last, b"data: [DONE]\n\n"]
            elif mode == "crlf":
                parts = [p.replace(b"\n", b"\r\n") for p in (first, last, b"data: [DONE]\n\n")]
            elif mode == "malformed":
                junk = [b"data: {oops\n\n", b"data: [1, 2]\n\n", b'data: {"choices": [{"token_ids": "x"}]}\n\n']
                parts = [first, *junk * 700, last, b"data: [DONE]\n\n"]
            elif mode == "tokenless":
                for p in [first] + [b'data: {"choices": []}\n\n'] * 200:  # 10 s of events without tokens
                    writer.write(chunk(p))
                    await writer.drain()
                    await asyncio.sleep(0.05)
                return
            elif mode == "endless_line":
                writer.write(chunk(first) + chunk(b"data: {"))
                for _ in range(64):  # 64 MiB, no newline
                    writer.write(chunk(b"a" * (1 << 20)))
                    await writer.drain()
                    await asyncio.sleep(0.005)
                return
            else:
                raise AssertionError(mode)
            writer.write(b"".join(chunk(p) for p in parts) + b"0\r\n\r\n")
            await writer.drain()
            if mode == "truncated":
                return


@contextlib.contextmanager
def running() -> Iterator[StreamPd]:
    engine = StreamPd()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="stream-pd", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), loop).result(10)
        yield engine
    finally:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory):
    with running() as bad:
        s = Stack.start(
            ckpt,
            tmp_path_factory.mktemp("streams"),
            n_ve=1,
            n_pd=0,
            retries={"max_attempts": 1},
            timeouts={"stream_gap_s": GAP_S},
            # the spoiled streams must not eject the one PD the legitimate client needs too
            health={"failure_threshold": 50, "failure_ratio": 1.0},
            endpoints={"pd": [{"id": "epd-pd-bad", "url": bad.url, "state": "active"}]},
        )
        try:
            yield s, bad
        finally:
            s.stop()


def stream(url: str, max_tokens: int) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30, trust_env=False) as r:
        raw = r.read().decode()
        status, rid = r.status_code, r.headers.get("x-request-id")
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert status != 200 or rid, raw
    return status, events, time.monotonic() - t0


CASES = {  # what the spoiled client's stream ends with: (code, message), or None: served whole
    "truncated": (502, "the stream from the engine ended before the answer was complete"),
    "error_frame": (502, "the engine failed while generating"),
    "tokenless": (504, f"generation stalled: no token for {GAP_S:g}s"),
    "endless_line": (502, "the engine sent an invalid answer"),
    "crlf": None,
    "malformed": None,
}


@pytest.mark.parametrize("mode", list(CASES))
def test_a_misbehaving_pd_stream_reaches_its_client_as_the_routers_own_frame(stack, mode):
    s, bad = stack
    wait_until(lambda: s.router.pools()["epd-pd-bad"]["healthy"], 15, "the PD serving")
    log_at = s.router.log_path.stat().st_size
    bad.mode = mode
    legit: list[tuple[int, float]] = []
    stop = threading.Event()

    def legitimate() -> None:
        for _ in range(200):
            if stop.is_set():
                return
            status, events, seconds = stream(s.router.url, 4)
            legit.append((status if events[-1:] == ["[DONE]"] else -status, seconds))

    probe = Probe(s.router.url)
    threads = [threading.Thread(target=legitimate, daemon=True), threading.Thread(target=probe.run, args=(60,))]
    for t in threads:
        t.start()
    try:
        spoiled = []
        for _ in range(3):
            time.sleep(0.3)  # legitimate requests in between
            spoiled.append(stream(s.router.url, MARK))
        time.sleep(0.3)
    finally:
        stop.set()
        probe.stop()
        for t in threads:
            t.join(timeout=60)
    for status, events, _ in spoiled:
        assert status == 200, (status, events[-1:])
        if CASES[mode] is None:
            assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
            continue
        code, message = CASES[mode]
        doc = json.loads(events[-1])  # the last event is the router's error frame; no [DONE]
        assert doc["error"] == {"message": message, "type": doc["error"]["type"], "param": None, "code": code}
        assert doc["request_id"] and "[DONE]" not in events and ADDRESS not in "".join(events)
    assert legit and all(status == 200 for status, _ in legit), legit
    assert percentile([sec for _, sec in legit], 99) < 2.0, legit
    health = probe.summary()["/health"]
    assert health["p99_ms"] < 100 and probe.failures == 0, health
    log = s.router.log()[log_at:]
    assert "Traceback" not in log and "internal error" not in log
    if mode == "malformed":
        assert log.count("malformed PD stream frames skipped") == 3  # once per request, not 2,100
    bad.mode = "good"
