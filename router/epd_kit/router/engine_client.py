"""The router's HTTP to the engines: one pooled client, one call per engine request, the
active health prober, and the passive health signal of every failed call.

Each call either returns the parsed answer or raises an `UpstreamError` (classified in
upstream.py) after charging the failure to the engine when it is the engine's fault.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import anyio
import httpx

from epd_kit.router import upstream
from epd_kit.router.errors import UpstreamError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import Engine, HealthProber
from epd_kit.router.rendering import PreparedItemLike
from epd_kit.router.state import RouterState
from epd_kit.wire import EcLocator, GenerateResponse, iter_sse_payloads


@dataclass
class PdStream:
    """An open PD stream whose first payload has already been read (so it is committed)."""

    engine: Engine
    response: httpx.Response
    payloads: AsyncIterator[bytes]
    first: bytes
    closed: bool = False


class EngineClient:
    def __init__(
        self, state: RouterState, metrics: RouterMetrics, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._prober: HealthProber | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(limits=limits, transport=self._transport, trust_env=False)
        self._prober = HealthProber(self._client, lambda: self._state.pools, lambda: self._state.cfg.health)
        await self._prober.probe_all()  # know who is up before the first request
        self._prober.start()

    async def aclose(self) -> None:
        if self._prober:
            await self._prober.stop()
        if self._client:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "EngineClient.start() was not awaited"
        return self._client

    def probe_soon(self) -> None:
        """Run a probe round now (after a reload or an ejection), not a full interval later."""
        if self._prober:
            self._prober.poke()

    # --- calls -----------------------------------------------------------------------------

    async def encode(
        self, engine: Engine, items: Sequence[PreparedItemLike], request_id: str
    ) -> dict[str, EcLocator]:
        """One encode POST to a VE: a locator for every item, or an UpstreamError."""
        body = upstream.ve_request_body(request_id, engine.id, items)
        try:
            resp = await self.client.post(
                upstream.generate_url(engine),
                content=upstream.encode_body(body),
                headers=upstream.JSON_HEADERS,
                timeout=self._timeout(self._state.cfg.timeouts.ve_s),
            )
        except httpx.HTTPError as exc:
            raise self.failed(upstream.classify_exception(exc, engine), engine) from None
        if resp.status_code != 200:
            raise self.failed(upstream.classify_status(resp, engine), engine)
        try:
            locators = upstream.parse_ve_response(resp, engine, [i.mm_hash for i in items])
        except UpstreamError as err:
            raise self.failed(err, engine) from None
        engine.served += 1
        return locators

    async def generate(self, engine: Engine, body: dict) -> GenerateResponse:
        """One non-streaming generate POST to a PD."""
        try:
            resp = await self.client.post(upstream.generate_url(engine), json=body, timeout=self._pd_timeout())
        except httpx.HTTPError as exc:
            raise self.failed(upstream.classify_exception(exc, engine), engine) from None
        if resp.status_code != 200:
            raise self.failed(upstream.classify_status(resp, engine), engine)
        try:
            result = upstream.parse_pd_response(resp, engine)
        except UpstreamError as err:
            raise self.failed(err, engine) from None
        engine.served += 1
        return result

    async def open_stream(self, engine: Engine, body: dict) -> PdStream:
        """Open a streaming generate on a PD and read its first payload: until then a failure
        is an error here (the request may still move to another PD); after it, the stream is
        committed. The caller closes the returned stream's response."""
        url = upstream.generate_url(engine)
        request = self.client.build_request("POST", url, json=body, timeout=self._pd_timeout())
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.failed(upstream.classify_exception(exc, engine), engine) from None
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise self.failed(upstream.classify_status(resp, engine), engine)
            payloads = iter_sse_payloads(resp.aiter_raw())
            try:
                first = await anext(payloads)
            except StopAsyncIteration:
                raise self.failed(upstream.bad_body(engine, "stream ended before any token"), engine) from None
            except httpx.HTTPError as exc:
                raise self.failed(upstream.classify_exception(exc, engine), engine) from None
            err = upstream.classify_stream_error(first, engine)
            if err is not None:
                raise self.failed(err, engine)
            return PdStream(engine=engine, response=resp, payloads=payloads, first=first)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            raise

    async def check(self, engine: Engine) -> None:
        """One immediate /health probe; an engine that refuses connections is ejected now."""
        health = self._state.cfg.health
        try:
            resp = await self.client.get(f"{engine.url}/health", timeout=health.timeout_s)
        except httpx.ConnectError as exc:
            engine.record_passive_failure(f"/health: {type(exc).__name__}", eject_now=True, health=health)
            return
        except httpx.HTTPError as exc:
            engine.record_probe(False, f"/health: {type(exc).__name__}", health)
            return
        if resp.status_code != 200:
            engine.record_passive_failure(f"/health: HTTP {resp.status_code}", eject_now=True, health=health)

    def failed(self, err: UpstreamError, engine: Engine) -> UpstreamError:
        """Charge `err` to `engine` when it is the engine's fault (passive health); returns it."""
        if err.engine_failed:
            engine.record_passive_failure(err.message, eject_now=err.unreachable, health=self._state.cfg.health)
            self._metrics.engine_failures.labels(engine.id, engine.role).inc()
            self.probe_soon()
        return err

    def _timeout(self, read_s: float) -> httpx.Timeout:
        return httpx.Timeout(read_s, connect=self._state.cfg.timeouts.connect_s)

    def _pd_timeout(self) -> httpx.Timeout:
        return self._timeout(self._state.cfg.timeouts.pd_s)
