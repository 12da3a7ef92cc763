"""A lean closed-loop HTTP/1.1 load generator for loopback benchmarks.

Why not httpx here: on a 2-core machine the load generator must cost far less CPU per request
than the thing it measures, so it writes pre-encoded requests on keep-alive connections and
parses just enough of the answer (status, Content-Length or chunked framing). The proxies
under test use the production stack (httpx + uvicorn); only the client is lean.

Every run is bounded twice: a request count and a wall-clock deadline. Addresses are checked:
only 127.0.0.1 is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


class LoadError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    def __post_init__(self) -> None:
        if self.host != "127.0.0.1":
            raise LoadError(f"benchmarks only send to 127.0.0.1, not {self.host!r}")


def encode_post(path: str, body: bytes, port: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Response:
    status: int
    body: bytes
    first_byte_s: float  # time to the first body chunk (TTFT for SSE)


class Connection:
    """One keep-alive connection; one request at a time.

    A connection idle for longer than `max_idle_s` is replaced before use: uvicorn closes
    idle keep-alive connections after 5 s, and a request written into a connection the
    server is closing gets no answer.
    """

    max_idle_s = 2.0

    def __init__(self, target: Target) -> None:
        self.target = target
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self._last_used = 0.0

    async def _ensure(self) -> None:
        if self._w is not None and time.monotonic() - self._last_used > self.max_idle_s:
            await self.close()
        if self._w is None or self._w.is_closing():
            self._r, self._w = await asyncio.open_connection(self.target.host, self.target.port, limit=1 << 22)

    async def close(self) -> None:
        if self._w is not None:
            self._w.close()
            with contextlib.suppress(OSError):
                await self._w.wait_closed()
            self._w = None

    async def request(self, raw: bytes, first_event: bytes | None = None) -> Response:
        """Send a pre-encoded request; read the full answer.

        `first_event`: for SSE, the time of the first body chunk containing this marker is
        recorded as first_byte_s (e.g. b'"token_ids":[' skips empty frames).
        """
        await self._ensure()
        assert self._r is not None and self._w is not None
        t0 = time.perf_counter()
        self._w.write(raw)
        await self._w.drain()
        status_line = await self._r.readline()
        if not status_line:
            await self.close()
            raise LoadError("connection closed before a response")
        status = int(status_line.split()[1])
        length: int | None = None
        chunked = False
        close = False
        while True:
            line = await self._r.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value.strip())
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        first = None
        if chunked:
            parts = []
            while True:
                size = int((await self._r.readline()).split(b";")[0], 16)
                if size == 0:
                    await self._r.readline()
                    break
                chunk = await self._r.readexactly(size)
                await self._r.readexactly(2)
                if first is None and (first_event is None or first_event in chunk):
                    first = time.perf_counter() - t0
                parts.append(chunk)
            body = b"".join(parts)
        elif length is not None:
            body = await self._r.readexactly(length)
        else:
            body = await self._r.read()
            close = True
        if close:
            await self.close()
        self._last_used = time.monotonic()
        end = time.perf_counter() - t0
        return Response(status, body, first if first is not None else end)


@dataclass
class Sample:
    start_s: float
    latency_s: float
    first_byte_s: float
    ok: bool


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok_latencies(self) -> list[float]:
        return [s.latency_s for s in self.samples if s.ok]

    @property
    def throughput_rps(self) -> float:
        return sum(s.ok for s in self.samples) / self.wall_s if self.wall_s else 0.0


# A scenario: given the worker's connections and the request index, do one logical request
# (possibly several HTTP calls) and return (ok, first_byte_s).
Scenario = Callable[[dict[str, Connection], int], Awaitable[tuple[bool, float]]]


async def closed_loop(
    targets: dict[str, Target],
    scenario: Scenario,
    *,
    concurrency: int,
    max_requests: int,
    deadline_s: float,
    warmup: int = 0,
) -> LoadResult:
    """`concurrency` workers, each with its own connections, issue requests back to back.

    Stops at `max_requests` or `deadline_s`, whichever comes first. The first `warmup`
    requests are issued but not recorded.
    """
    if concurrency < 1 or max_requests < 1 or deadline_s <= 0:
        raise LoadError("concurrency, max_requests and deadline_s must be positive")
    result = LoadResult()
    counter = 0
    t_start = time.perf_counter()
    stop_at = t_start + deadline_s

    async def worker() -> None:
        nonlocal counter
        conns = {name: Connection(t) for name, t in targets.items()}
        try:
            while time.perf_counter() < stop_at:
                idx = counter
                if idx >= max_requests + warmup:
                    return
                counter += 1
                t0 = time.perf_counter()
                try:
                    ok, first = await asyncio.wait_for(scenario(conns, idx), timeout=max(0.1, stop_at - t0 + 30))
                except (OSError, LoadError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    ok, first = False, 0.0
                    if len(result.errors) < 20:
                        result.errors.append(f"{type(exc).__name__}: {exc}")
                    for c in conns.values():
                        await c.close()
                if idx >= warmup:
                    result.samples.append(Sample(t0 - t_start, time.perf_counter() - t0, first, ok))
        finally:
            for c in conns.values():
                await c.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - t_start
    if result.samples:
        first_recorded = min(s.start_s for s in result.samples)
        last_end = max(s.start_s + s.latency_s for s in result.samples)
        result.wall_s = max(1e-9, last_end - first_recorded)
    return result
