"""A deliberately misbehaving engine in front of which the router must hold,
and the runs that time the router while it misbehaves.

`BadEngine` is a PD on raw asyncio sockets (tests/unit/router/raw_http.py's `RawServer`) on
127.0.0.1. It misbehaves only on the requests of the misbehaviour client (`max_tokens` =
`MARK_MAX_TOKENS`) and, in the `/health` modes, on every probe; every other request gets a
well-formed answer, so a legitimate request the router places on it is served. `run_case`
sends the misbehaviour client's requests and, at the same time, one legitimate client's
(a text chat, one at a time) while `/health` is timed and the router's RSS sampled.

Done when, for every case: no answer of 500 (and no stream frame of 500), `/health` p99
< 100 ms, legitimate p99 < 2 s, router RSS growth < 50 MB, no traceback in the router log,
and a SIGSTOPped PD is ejected in the time it takes without the slow engine.

    python -m bench.hostile --random 0 --engines        # these rows only (see bench/hostile.py)

tests/router_processes/test_engine_misbehaviour.py runs every case for a few seconds. The router runs
with `retries.max_attempts: 1`, so what the engine's answer becomes reaches the misbehaviour
client instead of being retried away on a good PD. Every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.common import percentile
from bench.hostile import _STREAM_IDS as GOOD_IDS  # inside the tiny checkpoint's vocabulary (1024)
from bench.hostile import STREAM_MARK, Answer, Case, Probe, _chunk, chat, in_thread, send, user
from epd_kit.sim.app import token_frame
from epd_kit.wire import GenerateChoice, GenerateResponse
from tests.unit.router.raw_http import RawServer, read_message

MARK_MAX_TOKENS = STREAM_MARK  # the misbehaviour client's requests (as --streams'); legitimate ones ask for 4
MB = 1024 * 1024
HUGE = 100 * MB  # a header, a /health body
STREAM_LINE = 300 * MB  # a stream line without a newline
CHUNK = MB  # sent a chunk at a time, a little apart ("slowly"), while the router reads
SEND_MAX_S = 10.0  # no misbehaviour sends for longer than this
RSS_GROWTH_MAX_MB = 50.0
OOV_IDS = (-1, 2**40)
RETRY_AFTER = ("inf", "Infinity", "nan", "1e400", "-5", "99999999999999999999999")

REQUEST_MODES = {"header", "retry_after", "oov", "interim", "stream_line"}
HEALTH_MODES = {"health", "slow_health"}


class BadEngine(RawServer):
    """A PD that misbehaves as `mode` says (`good`: never). `misbehaved` counts the answers
    it spoiled; `name` is its engine id in the router's config."""

    def __init__(self, name: str = "epd-pd-bad") -> None:
        super().__init__()
        self.name = name
        self.mode = "good"
        self.misbehaved = 0

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10_000):  # keep-alive: one connection serves the router's requests in turn
            head, body = await read_message(reader)
            mode = self.mode
            if head.split(b" ", 2)[1] == b"/health":
                if mode not in HEALTH_MODES:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                self.misbehaved += 1
                await (self._huge_health(writer) if mode == "health" else self._slow_health(writer))
                return
            req = json.loads(body)
            if mode not in REQUEST_MODES or req.get("sampling_params", {}).get("max_tokens") != MARK_MAX_TOKENS:
                await self._answer(writer, req)
                continue
            self.misbehaved += 1
            n = self.misbehaved
            if mode == "interim":  # each in a read of its own, then the answer; the connection stays open
                for interim in (b"HTTP/1.1 100 Continue\r\n\r\n", _EARLY_HINTS):
                    writer.write(interim)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                await self._answer(writer, req)
                continue
            if mode == "header":
                await self._huge_head(writer, one_line=n % 2 == 1)
            elif mode == "retry_after":
                await self._answer_429(writer, RETRY_AFTER[n % len(RETRY_AFTER)])
            elif mode == "oov":
                await self._answer(writer, req, ids=[OOV_IDS[n % len(OOV_IDS)]])
            elif mode == "stream_line":
                await self._endless_line(writer)
            return  # the connection closes: it is spoiled

    async def _answer(self, writer: asyncio.StreamWriter, req: dict, ids: list[int] | None = None) -> None:
        """A well-formed answer to `req` (its first max_tokens of GOOD_IDS, or `ids`), as the
        sim's: JSON, or SSE frames and [DONE]."""
        if ids is None:
            wanted = req.get("sampling_params", {}).get("max_tokens") or 1
            ids = GOOD_IDS[: max(1, min(wanted, len(GOOD_IDS)))]
        rid = json.dumps(req.get("request_id") or "bad")
        if req.get("stream"):
            frames = [token_frame(rid, [t], None) for t in ids[:-1]] + [token_frame(rid, ids[-1:], "length")]
            body, ctype = b"".join(frames) + b"data: [DONE]\n\n", b"text/event-stream"
        else:
            choice = GenerateChoice(index=0, finish_reason="length", token_ids=ids)
            body = GenerateResponse(request_id=json.loads(rid), choices=[choice]).model_dump_json().encode()
            ctype = b"application/json"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (ctype, len(body))
        writer.write(head + body)
        await writer.drain()

    async def _answer_429(self, writer: asyncio.StreamWriter, retry_after: str) -> None:
        body = b'{"error": {"message": "too many requests", "type": "RateLimitError", "code": 429}}'
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\nretry-after: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (retry_after.encode(), len(body), body)
        )
        await writer.drain()

    async def _huge_head(self, writer: asyncio.StreamWriter, *, one_line: bool) -> None:
        """A 200 whose head goes on for HUGE bytes: one header line, or 1 KiB lines."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
        if one_line:
            writer.write(b"x-big: ")
            chunk = b"a" * CHUNK
        else:
            chunk = b"".join(b"x-h%07d: %s\r\n" % (i, b"b" * 1010) for i in range(CHUNK // 1024))
        await _send_slowly(writer, chunk, HUGE)

    async def _huge_health(self, writer: asyncio.StreamWriter) -> None:
        """/health: 200 with a HUGE body, by Content-Length or chunked in turn."""
        if self.misbehaved % 2:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % HUGE)
            await _send_slowly(writer, b"h" * CHUNK, HUGE)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await _send_slowly(writer, _chunk(b"h" * CHUNK), HUGE)

    async def _slow_health(self, writer: asyncio.StreamWriter) -> None:
        """/health: a 100-byte body, a byte every 0.1 s (a read timeout never fires)."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        for _ in range(100):
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(b"s")

    async def _endless_line(self, writer: asyncio.StreamWriter) -> None:
        """A stream whose one line has no end: STREAM_LINE bytes without a newline."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(_chunk(b"data: {"))
        await _send_slowly(writer, _chunk(b"a" * CHUNK), STREAM_LINE)


_EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"


async def _send_slowly(writer: asyncio.StreamWriter, chunk: bytes, total: int) -> None:
    """`chunk` again and again up to `total` bytes, 5 ms apart, within SEND_MAX_S; a router
    that closes the connection ends it (ConnectionError, which RawServer takes quietly)."""
    deadline = time.monotonic() + SEND_MAX_S
    for _ in range(total // len(chunk)):
        writer.write(chunk)
        await writer.drain()
        if time.monotonic() > deadline or writer.is_closing():
            return
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def running(name: str = "epd-pd-bad") -> Iterator[BadEngine]:
    with in_thread(BadEngine(name)) as engine:
        yield engine


@dataclass(frozen=True)
class EngineCase:
    name: str
    mode: str
    expect: tuple[int, ...] = ()  # what the misbehaviour client may get (empty: no such client)
    spoiled: int | None = None  # the status its requests on the bad engine get, one at least
    streams: tuple[bool, ...] = (False,)  # the misbehaviour client's requests stream in this turn
    sigstop: bool = False  # a sim PD is SIGSTOPped: ejected in about the normal time?


CASES = [
    EngineCase("100 MB response head, 1 MB every 5 ms", "header", (200, 502), 502),
    EngineCase("100 MB /health answers", "health"),
    EngineCase("429 with Retry-After: inf (and nan, 1e400, -5, ...)", "retry_after", (200, 429), 429),
    EngineCase("token ids -1 and 2**40", "oov", (200, 502), 502, streams=(False, True)),
    EngineCase("100 Continue and 103 before the answer", "interim", (200,), 200, streams=(False, True)),
    # the stream reader caps a line at 1 MiB (pd_stream.py): a 502 before the client's first byte
    EngineCase("300 MB stream line without newline", "stream_line", (200, 502), 502, streams=(True,)),
    EngineCase("SIGSTOPped PD, the other engines' /health normal", "good", sigstop=True),
    EngineCase("SIGSTOPped PD while another engine's /health is slow", "slow_health", sigstop=True),
]


def rss_mb(pid: int) -> float:
    """VmRSS of `pid`, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def pd_health(url: str) -> dict[str, bool]:
    doc = httpx.get(url + "/pools", timeout=5, trust_env=False).json()
    return {e["id"]: e["healthy"] for e in doc["engines"] if e["role"] == "pd"}


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until `predicate` held, or None after `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval_s)
    return None


def _loop(stop: threading.Event, seconds: float, max_count: int, fn: Callable[[int], object]) -> None:
    deadline = time.monotonic() + seconds
    for i in range(max_count):
        if stop.is_set() or time.monotonic() > deadline:
            return
        fn(i)


def run_case(
    url: str,
    router_pid: int,
    engine: BadEngine,
    case: EngineCase,
    seconds: float,
    stop_pd: tuple[str, int] | None = None,
) -> dict:
    """One case: the engine misbehaves for `seconds` of legitimate traffic (after the stopped
    PD's ejection in a `sigstop` case; `stop_pd` is its engine id and pid). The figures, and
    the statuses both clients got."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    assert host == "127.0.0.1", "the misbehaving engine's runs go to 127.0.0.1 only"
    engine.mode = "good"
    # every PD serving (the previous case may have left one ejected): requests reach the bad one
    back = wait_for(lambda: all(pd_health(url).values()), 30, 0.1)
    for i in range(8):  # warm: the baseline RSS is the serving router's
        send(host, port, Case("warm", chat(user(f"warm {i}")), valid=True), timeout_s=30)
    rss0 = rss_mb(router_pid)
    peak = [rss0]
    stop = threading.Event()
    probe = Probe(url)
    out: dict = {"pools_ready_s": None if back is None else round(back, 2)}

    def sample(_: int) -> None:
        peak.append(rss_mb(router_pid))
        stop.wait(0.1)

    threads = [
        threading.Thread(target=probe.run, args=(seconds + 40,), daemon=True),
        threading.Thread(target=_loop, args=(stop, seconds + 40, 1000, sample), daemon=True),
    ]
    for t in threads:
        t.start()
    engine.mode = case.mode
    spoiled: list[Answer] = []
    legit: list[Answer] = []
    try:
        if case.sigstop:
            assert stop_pd is not None, "a sigstop case needs a PD to stop"
            pd_id, pd_pid = stop_pd
            if case.mode == "slow_health":  # a slow probe under way before the PD stops
                wait_for(lambda: engine.misbehaved > 0, 10)
            os.kill(pd_pid, signal.SIGSTOP)
            try:
                ejected = wait_for(lambda: not pd_health(url)[pd_id], 30)
                out["ejected_s"] = None if ejected is None else round(ejected, 2)
                _clients(host, port, case, seconds, stop, spoiled, legit)
            finally:
                os.kill(pd_pid, signal.SIGCONT)
        else:
            _clients(host, port, case, seconds, stop, spoiled, legit)
    finally:
        engine.mode = "good"
        probe.stop()
        stop.set()
        for t in threads:
            t.join(10)
    statuses = Counter(a.status for a in spoiled + legit)
    out.update(
        {
            "misbehaved": engine.misbehaved,
            "answers_500": statuses.get(500, 0),
            "misbehaviour_client": {
                "n": len(spoiled),
                "statuses": {str(k): v for k, v in sorted(Counter(a.status for a in spoiled).items(), key=str)},
                "problems": sorted({a.problem for a in spoiled if a.problem})[:5],
            },
            "legit": {
                "n": len(legit),
                "not_200": sum(a.status != 200 for a in legit),
                "p99_s": round(percentile([a.seconds for a in legit], 99), 3) if legit else None,
                "problems": sorted({a.problem for a in legit if a.problem})[:5],
            },
            "/health": probe.summary()["/health"],
            "probe_failures": probe.failures,
            "rss_mb": {"before": round(rss0, 1), "peak": round(max(peak), 1), "growth": round(max(peak) - rss0, 1)},
        }
    )
    return out


def _clients(
    host: str, port: int, case: EngineCase, seconds: float, stop: threading.Event, spoiled: list, legit: list
) -> None:
    """The legitimate client and (if the case has one) the misbehaviour client, `seconds`."""
    legit_raw = chat(user("hello"))
    marked = [chat(user("spoil", max_tokens=MARK_MAX_TOKENS, stream=stream)) for stream in case.streams]
    most = max(100, int(seconds * 500))  # a bound that a fast router does not reach before `seconds`
    threads = [
        threading.Thread(
            target=_loop,
            args=(stop, seconds, most, lambda i: legit.append(send(host, port, Case("legit", legit_raw, True), 30))),
            daemon=True,
        )
    ]
    if case.expect:
        threads.append(
            threading.Thread(
                target=_loop,
                args=(
                    stop,
                    seconds,
                    most,
                    lambda i: spoiled.append(send(host, port, Case(case.name, marked[i % len(marked)]), 30)),
                ),
                daemon=True,
            )
        )
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)


def failures(case: EngineCase, figures: dict, ejected_max_s: float | None = None) -> list[str]:
    """What a case's figures break of the goals (the module docstring); empty when met."""
    out = []
    if figures["answers_500"]:
        out.append(f"{figures['answers_500']} answers of 500")
    spoiled, legit, health = figures["misbehaviour_client"], figures["legit"], figures["/health"]
    out += [f"misbehaviour client: {p}" for p in spoiled["problems"]]
    out += [f"legitimate client: {p}" for p in legit["problems"]]
    if case.expect and (bad := set(spoiled["statuses"]) - {str(s) for s in case.expect}):
        out.append(f"misbehaviour client got {sorted(bad)} (expected {case.expect}): {spoiled['statuses']}")
    if case.spoiled is not None and spoiled["statuses"].get(str(case.spoiled), 0) == 0:
        out.append(f"no request met the misbehaviour (no {case.spoiled}): {spoiled['statuses']}")
    if not figures["misbehaved"] and not case.sigstop:
        out.append("the engine never misbehaved (no request or probe reached it)")
    if legit["n"] == 0 or legit["not_200"] or (legit["p99_s"] or 0) >= 2.0:
        out.append(f"legitimate client: {legit}")
    if not health["p99_ms"] < 100 or figures["probe_failures"]:
        out.append(f"/health p99 {health['p99_ms']} ms (max {health['max_ms']}), {figures['probe_failures']} failed")
    if figures["rss_mb"]["growth"] >= RSS_GROWTH_MAX_MB:
        out.append(f"router RSS grew {figures['rss_mb']}")
    if case.sigstop and (figures.get("ejected_s") is None or (ejected_max_s and figures["ejected_s"] > ejected_max_s)):
        out.append(f"the SIGSTOPped PD was ejected after {figures.get('ejected_s')} s (bound {ejected_max_s})")
    return out


@contextlib.contextmanager
def engine_stack(work: Path) -> Iterator[tuple[object, BadEngine, object]]:
    """A sim VE, two sim PDs, the bad engine as a third PD and a router (default config but
    `retries.max_attempts: 1`), all on 127.0.0.1: yields (router, bad engine, second sim PD)."""
    from bench.stack import engine_proc, router_proc
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(work / "checkpoint")
    procs = [engine_proc("ve", 0, ckpt, work).start(), *(engine_proc("pd", i, ckpt, work).start() for i in (0, 1))]
    with running() as bad:
        try:
            for p in procs:
                p.wait_healthy()
            router = router_proc(ckpt, procs[:1], [*procs[1:], bad], work, extra={"retries": {"max_attempts": 1}})
            procs.append(router.start())
            router.wait_healthy()
            yield router, bad, procs[2]
        finally:
            for p in reversed(procs):
                p.stop()


def run_all(seconds: float) -> dict:
    """Every case on one stack (engine_stack); per case its figures and what broke a goal."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    out: dict = {}
    normal_s: float | None = None  # a stopped PD's ejection with every other /health answering
    with engine_stack(work) as (router, bad, pd1):
        for case in CASES:
            log_at = router.log_path.stat().st_size
            figures = run_case(router.url, router.pid, bad, case, seconds, stop_pd=(pd1.name, pd1.pid))
            with router.log_path.open("rb") as log:
                log.seek(log_at)
                figures["router_log_tracebacks"] = log.read().count(b"Traceback")
            if case.sigstop and case.mode == "good":
                normal_s = figures.get("ejected_s")
            # "about the normal time": within one probe interval (the default 2 s) of it
            bound = normal_s + 2.0 if case.sigstop and case.mode != "good" and normal_s is not None else None
            figures["failures"] = failures(case, figures, bound) + (
                ["tracebacks in the router log"] if figures["router_log_tracebacks"] else []
            )
            out[case.name] = figures
    return out
