"""The router's state and request orchestration: one `RouterService` object per app.

Flow per chat request: render once → encode every unique item on its HRW VE (all VEs in
parallel, retries on the next HRW choice) → pick a PD (least outstanding, capped, bounded
wait) → generate (retry on another PD only before the client saw a byte) → OpenAI body or
SSE chunks with incremental detokenization.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from epd_kit.router import upstream
from epd_kit.router.auth import ApiKeyChecker, load_api_keys
from epd_kit.router.config import RouterConfig, load_config
from epd_kit.router.errors import RouterError, UpstreamError
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.openai_api import ChatCompletionRequest, chunk_body, completion_body
from epd_kit.router.placement import Item, RoundRobin, group_by_ve, place_items
from epd_kit.router.pools import Engine, HealthProber, Pools, build_pools
from epd_kit.router.rendering import DetokenizerLike, PreparedItemLike, Renderer
from epd_kit.wire import EcLocator, iter_sse_payloads

log = logging.getLogger("epd_router.service")

# settings baked into the listener or the preprocessor at start; a reload keeps the old values
RESTART_ONLY = ("model", "served_model_name", "quantization", "listen", "limits", "media")


def _preprocess_error_types() -> tuple[type[BaseException], ...]:
    try:
        from epd_kit.preprocess import PreprocessError  # type: ignore[attr-defined]
    except ImportError:
        return ()
    return (PreprocessError,)


@dataclass
class RequestContext:
    request_id: str
    request: ChatCompletionRequest
    model: str
    t0: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    created: int = field(default_factory=lambda: int(time.time()))
    token_ids: list[int] = field(default_factory=list)
    items: list[PreparedItemLike] = field(default_factory=list)
    locators: dict[str, EcLocator] = field(default_factory=dict)
    encoded_by: dict[str, str] = field(default_factory=dict)  # mm_hash -> VE id

    @property
    def completion_id(self) -> str:
        return f"chatcmpl-{self.request_id}"


@dataclass
class PdStream:
    """An open PD stream whose first payload has already been read (so it is committed)."""

    engine: Engine
    response: httpx.Response
    payloads: AsyncIterator[bytes]
    first: bytes
    closed: bool = False


class RouterService:
    def __init__(
        self,
        cfg: RouterConfig,
        renderer: Renderer,
        *,
        config_path: Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.renderer = renderer
        self.pools, _ = build_pools(cfg)
        self.metrics = RouterMetrics(lambda: self.pools, lambda: getattr(self.renderer, "stats", None))
        self.auth = ApiKeyChecker(load_api_keys(cfg.auth.api_keys_file) if cfg.auth.api_keys_file else ())
        self.rr = RoundRobin()
        self.draining = False  # SIGTERM received: /ready says 503
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._pd_changed = asyncio.Condition()
        self._pd_waiting = 0
        self._transport = transport
        self._background: set[asyncio.Task] = set()
        self._client: httpx.AsyncClient | None = None
        self._prober: HealthProber | None = None
        self._preprocess_errors = _preprocess_error_types()

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(limits=limits, transport=self._transport, trust_env=False)
        self._prober = HealthProber(self._client, lambda: self.pools, lambda: self.cfg.health)
        await self._prober.probe_all()  # know who is up before the first request
        self._prober.start()

    async def stop(self) -> None:
        if self._prober:
            await self._prober.stop()
        if self._client:
            await self._client.aclose()
        aclose = getattr(self.renderer, "aclose", None)
        if aclose is not None:
            await aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "RouterService.start() was not awaited"
        return self._client

    def reload(self) -> bool:
        """Re-read the config file and apply it atomically; a bad file keeps the old config."""
        if self.config_path is None:
            log.warning("reload requested but the router runs from flags, not a file")
            return False
        try:
            new = load_config(self.config_path)
            if new.auth.api_keys_file:
                keys = load_api_keys(new.auth.api_keys_file)
            else:
                keys = ()
        except ValueError as exc:
            self.metrics.reloads.labels("error").inc()
            log.error("config reload failed; keeping the running config", extra={"error": str(exc)})
            return False
        for key in RESTART_ONLY:
            if getattr(new, key) != getattr(self.cfg, key):
                log.warning(f"config reload: '{key}' changed; it takes effect only on restart")
        pools, removed = build_pools(new, self.pools)
        # one assignment each: a request sees either the old or the new snapshot
        self.cfg = new.model_copy(update={k: getattr(self.cfg, k) for k in RESTART_ONLY})
        self.pools = pools
        self.auth = ApiKeyChecker(keys)
        self.metrics.reloads.labels("ok").inc()
        log.info(
            "config reloaded",
            extra={
                "ve": [f"{e.id}:{e.state.value}" for e in pools.ve],
                "pd": [f"{e.id}:{e.state.value}" for e in pools.pd],
                "removed": [e.id for e in removed],
            },
        )
        if self._prober:
            self._prober.poke()
        task = asyncio.get_running_loop().create_task(self._notify_pd_waiters())
        self._background.add(task)  # the loop keeps only weak references
        task.add_done_callback(self._background.discard)
        return True

    @property
    def ready(self) -> bool:
        return not self.draining and bool(self.pools.eligible_ve()) and bool(self.pools.eligible_pd())

    def not_ready_reason(self) -> str:
        if self.draining:
            return "router is shutting down"
        parts = []
        for role, engines in (("VE", self.pools.ve), ("PD", self.pools.pd)):
            ok = [e for e in engines if e.eligible]
            if not ok:
                parts.append(f"no healthy active {role} ({len(engines)} configured)")
        return "; ".join(parts) or "ready"

    def retry_after_s(self) -> float:
        return max(1.0, self.cfg.health.interval_s)

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def begin_request(self) -> None:
        self.active_requests += 1
        self._idle.clear()

    def end_request(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    async def close_stream(self, pd: PdStream) -> None:
        """Idempotent: close the PD stream and free its slot (also when the response body was
        never iterated because the client left first)."""
        if pd.closed:
            return
        pd.closed = True
        with anyio.CancelScope(shield=True):
            await pd.response.aclose()
            await self.release_pd(pd.engine)

    # --- request entry ---------------------------------------------------------------

    def new_context(self, request: ChatCompletionRequest, request_id: str | None) -> RequestContext:
        rid = request_id or uuid.uuid4().hex
        ctx = RequestContext(request_id=rid, request=request, model=request.model or self.cfg.model_name)
        ctx.deadline = ctx.t0 + self.cfg.timeouts.total_s
        return ctx

    @asynccontextmanager
    async def _deadline(self, ctx: RequestContext, stage: str):
        try:
            async with asyncio.timeout_at(self._loop_deadline(ctx)):
                yield
        except TimeoutError:
            raise RouterError(
                504, f"request exceeded the router's total timeout of {self.cfg.timeouts.total_s:g}s during {stage}"
            ) from None

    @staticmethod
    def _loop_deadline(ctx: RequestContext) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (ctx.deadline - time.monotonic())

    async def prepare(self, ctx: RequestContext) -> None:
        """Admission checks, rendering and encoding: everything before the PD."""
        if not self.pools.eligible_pd():
            self.metrics.rejections.labels("not_ready").inc()
            raise RouterError(
                503, f"not ready: {self.not_ready_reason()}", retry_after=self.retry_after_s()
            )
        t = time.monotonic()
        async with self._deadline(ctx, "preprocessing"):
            rendered = await self._render(ctx)
        self.metrics.preprocess.observe(time.monotonic() - t)
        ctx.token_ids = list(rendered.token_ids)
        ctx.items = list(rendered.items)
        if ctx.items:
            t = time.monotonic()
            async with self._deadline(ctx, "encode"):
                ctx.locators = await self.encode(ctx)
            self.metrics.encode.observe(time.monotonic() - t)

    async def _render(self, ctx: RequestContext):
        messages = [m.model_dump(exclude_none=True) for m in ctx.request.messages]
        try:
            return await self.renderer.render(
                messages, add_generation_prompt=ctx.request.add_generation_prompt
            )
        except RouterError:
            raise
        except self._preprocess_errors as exc:
            status = int(getattr(exc, "status", 400))
            param = getattr(exc, "param", None) or "messages"
            raise RouterError(status, f"{param}: {getattr(exc, 'message', exc)}", param=param) from None
        except ValueError as exc:
            raise RouterError(400, f"cannot render the prompt: {exc}", param="messages") from None

    # --- encode ----------------------------------------------------------------------

    async def encode(
        self,
        ctx: RequestContext,
        only: set[str] | None = None,
        avoid: dict[str, set[str]] | None = None,
    ) -> dict[str, EcLocator]:
        """Locators for the request's unique items (or the `only` subset), each on its HRW
        VE; a failed VE call is retried on each item's next HRW choice."""
        by_hash: dict[str, PreparedItemLike] = {}
        for item in ctx.items:
            if only is None or item.mm_hash in only:
                by_hash.setdefault(item.mm_hash, item)
        if only is None:
            if len(by_hash) < len(ctx.items):
                self.metrics.dedupe.inc(len(ctx.items) - len(by_hash))
            self.metrics.items.inc(len(by_hash))
        locators: dict[str, EcLocator] = {}
        tried: dict[str, set[str]] = {h: set() for h in by_hash}
        excluded: dict[str, set[str]] = {h: set((avoid or {}).get(h, ())) for h in by_hash}
        last_error: dict[str, UpstreamError] = {}
        pending = list(by_hash)
        while pending:
            eligible = {e.id: e for e in self.pools.eligible_ve()}
            loads = {eid: e.inflight_work for eid, e in eligible.items()}
            try:
                placement = place_items(
                    [Item(h, by_hash[h].length) for h in pending],
                    loads,
                    self.cfg.placement.ve_load_bound,
                    exclude=excluded,
                    slack_items=self.cfg.placement.ve_load_slack_items,
                )
            except LookupError as exc:
                h = exc.args[0]
                if h in last_error:
                    raise last_error[h] from None
                self.metrics.rejections.labels("no_ve").inc()
                raise RouterError(
                    503, f"cannot encode images: {self.not_ready_reason() if not eligible else 'no VE left to try'}",
                    retry_after=self.retry_after_s(),
                ) from None  # fmt: skip
            groups = group_by_ve(placement)
            work = {ve: sum(by_hash[h].length for h in hashes) for ve, hashes in groups.items()}
            for ve in groups:  # reserve in the same step as the choice (reload/drain see it)
                eligible[ve].inflight += 1
                eligible[ve].inflight_work += work[ve]
            try:
                results = await asyncio.gather(
                    *(self._encode_on(eligible[ve], [by_hash[h] for h in hashes], ctx) for ve, hashes in groups.items()),
                    return_exceptions=True,
                )  # fmt: skip
            finally:
                for ve in groups:
                    eligible[ve].inflight -= 1
                    eligible[ve].inflight_work -= work[ve]
            pending = []
            for (ve, hashes), result in zip(groups.items(), results, strict=True):
                if isinstance(result, UpstreamError):
                    for h in hashes:
                        tried[h].add(ve)
                        excluded[h].add(ve)
                        last_error[h] = result
                        if not result.retry_other or len(tried[h]) >= self.cfg.retries.max_attempts:
                            raise result
                        pending.append(h)
                    self.metrics.retries.labels("encode").inc()
                    log.warning(
                        "encode failed, retrying on next HRW choice",
                        extra={"request_id": ctx.request_id, "engine": ve, "error": result.message},
                    )
                elif isinstance(result, BaseException):
                    raise result
                else:
                    locators.update(result)
                    for h in hashes:
                        ctx.encoded_by[h] = ve
        return locators

    async def refresh_locators(self, ctx: RequestContext, err: UpstreamError) -> bool:
        """After a PD failure: re-encode items whose VE is gone, so the retry on another PD
        does not read from a dead encoder (a failed EC read kills a PD engine core, §7.2).
        Returns True if any locator changed."""
        if not ctx.items:
            return False
        encoders = {e.id: e for e in self.pools.ve if e.id in set(ctx.encoded_by.values())}
        await asyncio.gather(*(self.check_engine(e) for e in encoders.values()))
        stale = {h for h, ve in ctx.encoded_by.items() if ve not in encoders or not encoders[ve].eligible}
        ec_failure = any(s in err.message for s in ("ECLoadFailure", "Encoder-cache load", "ec_locator"))
        if not stale and ec_failure:
            stale = set(ctx.encoded_by)  # the VE lost the blocks (restart?): encode again
        if not stale:
            return False
        avoid = {h: {ctx.encoded_by[h]} for h in stale if ctx.encoded_by[h] not in encoders or not encoders[ctx.encoded_by[h]].eligible}
        log.warning(
            "re-encoding items before retrying on another PD",
            extra={"request_id": ctx.request_id, "items": len(stale)},
        )
        async with self._deadline(ctx, "re-encode"):
            ctx.locators.update(await self.encode(ctx, only=stale, avoid=avoid))
        return True

    async def check_engine(self, engine: Engine) -> None:
        """One immediate /health probe; an engine that refuses connections is ejected now."""
        health = self.cfg.health
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

    async def _encode_on(
        self, engine: Engine, items: list[PreparedItemLike], ctx: RequestContext
    ) -> dict[str, EcLocator]:
        """One encode POST; the caller accounts `engine`'s in-flight work around it."""
        body = upstream.ve_request_body(ctx.request_id, engine.id, items)
        timeout = httpx.Timeout(self.cfg.timeouts.ve_s, connect=self.cfg.timeouts.connect_s)
        try:
            resp = await self.client.post(
                upstream.generate_url(engine), content=upstream.encode_body(body),
                headers=upstream.JSON_HEADERS, timeout=timeout,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise self._engine_error(upstream.classify_exception(exc, engine), engine) from None
        if resp.status_code != 200:
            raise self._engine_error(upstream.classify_status(resp, engine), engine)
        try:
            locators = upstream.parse_ve_response(resp, engine, [i.mm_hash for i in items])
        except UpstreamError as err:
            raise self._engine_error(err, engine) from None
        engine.served += 1
        return locators

    def _engine_error(self, err: UpstreamError, engine: Engine) -> UpstreamError:
        if err.engine_failed:
            engine.record_passive_failure(err.message, eject_now=err.unreachable, health=self.cfg.health)
            self.metrics.engine_failures.labels(engine.id, engine.role).inc()
            if self._prober:
                self._prober.poke()
        return err

    # --- PD selection ----------------------------------------------------------------

    async def _notify_pd_waiters(self) -> None:
        async with self._pd_changed:
            self._pd_changed.notify_all()

    async def acquire_pd(self, exclude: set[str], last_error: RouterError | None) -> Engine:
        placement = self.cfg.placement
        loop = asyncio.get_running_loop()
        wait_until = loop.time() + placement.queue_timeout_s
        queued = False
        try:
            while True:
                pools = self.pools
                eligible = [e for e in pools.eligible_pd() if e.id not in exclude]
                if not eligible:
                    if last_error is not None:
                        raise last_error
                    self.metrics.rejections.labels("not_ready").inc()
                    raise RouterError(
                        503, f"not ready: {self.not_ready_reason()}", retry_after=self.retry_after_s()
                    )
                by_id = {e.id: e for e in eligible}
                # all configured ids in config order keep the round-robin cursor stable
                # while engines come and go; ineligible ones are excluded
                pick = self.rr.choose_pd(
                    [e.id for e in pools.pd],
                    {e.id: e.inflight for e in pools.pd},
                    placement.pd_max_inflight,
                    exclude={e.id for e in pools.pd if e.id not in by_id},
                )
                if pick is not None:
                    engine = by_id[pick]
                    engine.inflight += 1
                    return engine
                if not queued:
                    if self._pd_waiting >= placement.queue_size:
                        self.metrics.rejections.labels("queue_full").inc()
                        raise RouterError(
                            429, f"overloaded: all {len(eligible)} PD engines are at their limit of "
                            f"{placement.pd_max_inflight} requests and the wait queue is full "
                            f"({placement.queue_size})", retry_after=1,
                        )  # fmt: skip
                    self._pd_waiting += 1
                    queued = True
                remaining = wait_until - loop.time()
                if remaining <= 0:
                    self.metrics.rejections.labels("queue_timeout").inc()
                    raise RouterError(
                        429, f"overloaded: waited {placement.queue_timeout_s:g}s for a free PD slot",
                        retry_after=1,
                    )  # fmt: skip
                async with self._pd_changed:
                    try:
                        # also wake periodically: health changes do not notify
                        await asyncio.wait_for(self._pd_changed.wait(), min(remaining, 0.25))
                    except TimeoutError:
                        pass
        finally:
            if queued:
                self._pd_waiting -= 1

    async def release_pd(self, engine: Engine) -> None:
        engine.inflight -= 1
        await self._notify_pd_waiters()

    # --- generate: non-streaming ---------------------------------------------------------

    def _pd_body(self, ctx: RequestContext, stream: bool) -> dict:
        return upstream.pd_request_body(
            ctx.request_id, ctx.token_ids, ctx.items, ctx.request.sampling_params(), ctx.locators, stream
        )

    def _pd_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.cfg.timeouts.pd_s, connect=self.cfg.timeouts.connect_s)

    def _may_retry(self, err: UpstreamError, tried: set[str], ctx: RequestContext) -> bool:
        return (
            err.retry_other
            and len(tried) < self.cfg.retries.max_attempts
            and time.monotonic() < ctx.deadline
        )

    async def complete(self, ctx: RequestContext) -> dict[str, Any]:
        """Non-streaming: the whole OpenAI body (retries allowed: nothing was sent yet)."""
        await self.prepare(ctx)
        body = self._pd_body(ctx, stream=False)
        tried: set[str] = set()
        last: UpstreamError | None = None
        t = time.monotonic()
        async with self._deadline(ctx, "generate"):
            while True:
                engine = await self.acquire_pd(tried, last)
                try:
                    result = await self._generate_once(engine, body)
                except UpstreamError as err:
                    tried.add(engine.id)
                    last = err
                    await self.release_pd(engine)
                    if not self._may_retry(err, tried, ctx):
                        raise
                    self.metrics.retries.labels("generate").inc()
                    log.warning(
                        "generate failed, retrying on another PD",
                        extra={"request_id": ctx.request_id, "engine": engine.id, "error": err.message},
                    )
                    if await self.refresh_locators(ctx, err):
                        body = self._pd_body(ctx, stream=False)
                    continue
                except BaseException:
                    await self.release_pd(engine)
                    raise
                await self.release_pd(engine)
                break
        self.metrics.pd.observe(time.monotonic() - t)
        skip = ctx.request.skip_special_tokens
        choices = []
        for c in result.choices:
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": self.renderer.detokenize(c.token_ids, skip)},
                "finish_reason": c.finish_reason or "stop",
                "token_ids": c.token_ids,
            }
            if c.logprobs is not None:
                choice["logprobs"] = c.logprobs
            choices.append(choice)
        return completion_body(
            completion_id=ctx.completion_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            prompt_tokens=len(ctx.token_ids),
        )

    async def _generate_once(self, engine: Engine, body: dict):
        try:
            resp = await self.client.post(upstream.generate_url(engine), json=body, timeout=self._pd_timeout())
        except httpx.HTTPError as exc:
            raise self._engine_error(upstream.classify_exception(exc, engine), engine) from None
        if resp.status_code != 200:
            raise self._engine_error(upstream.classify_status(resp, engine), engine)
        try:
            result = upstream.parse_pd_response(resp, engine)
        except UpstreamError as err:
            raise self._engine_error(err, engine) from None
        engine.served += 1
        return result

    # --- generate: streaming ---------------------------------------------------------

    async def open_stream(self, ctx: RequestContext) -> PdStream:
        """Prepare, then open a PD stream and read its first payload; retry on another PD
        until that point (the client has received nothing yet)."""
        await self.prepare(ctx)
        body = self._pd_body(ctx, stream=True)
        tried: set[str] = set()
        last: UpstreamError | None = None
        async with self._deadline(ctx, "generate"):
            while True:
                engine = await self.acquire_pd(tried, last)
                try:
                    return await self._open_once(engine, body)
                except UpstreamError as err:
                    await self.release_pd(engine)
                    tried.add(engine.id)
                    last = err
                    if not self._may_retry(err, tried, ctx):
                        raise
                    self.metrics.retries.labels("generate").inc()
                    log.warning(
                        "generate failed before the first token, retrying on another PD",
                        extra={"request_id": ctx.request_id, "engine": engine.id, "error": err.message},
                    )
                    if await self.refresh_locators(ctx, err):
                        body = self._pd_body(ctx, stream=True)
                except BaseException:
                    await self.release_pd(engine)
                    raise

    async def _open_once(self, engine: Engine, body: dict) -> PdStream:
        request = self.client.build_request(
            "POST", upstream.generate_url(engine), json=body, timeout=self._pd_timeout()
        )
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._engine_error(upstream.classify_exception(exc, engine), engine) from None
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise self._engine_error(upstream.classify_status(resp, engine), engine)
            payloads = iter_sse_payloads(resp.aiter_raw())
            try:
                first = await anext(payloads)
            except StopAsyncIteration:
                raise self._engine_error(upstream.bad_body(engine, "stream ended before any token"), engine) from None
            except httpx.HTTPError as exc:
                raise self._engine_error(upstream.classify_exception(exc, engine), engine) from None
            err = self._pd_error_frame(first, engine)
            if err is not None:
                raise self._engine_error(err, engine)
            return PdStream(engine=engine, response=resp, payloads=payloads, first=first)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            raise

    @staticmethod
    def _pd_error_frame(payload: bytes, engine: Engine) -> UpstreamError | None:
        try:
            doc = json.loads(payload)
        except ValueError:
            return None
        if isinstance(doc, dict) and doc.get("error") and not doc.get("choices"):
            err = doc["error"] if isinstance(doc["error"], dict) else {"message": str(doc["error"])}
            code = err.get("code") if isinstance(err.get("code"), int) else 500
            client_fault = 400 <= code < 500
            return UpstreamError(
                502, f"{upstream.where(engine)} failed before the first token: {str(err.get('message'))[:200]}",
                engine_id=engine.id, stage="generate", engine_failed=not client_fault,
                retry_other=not client_fault,
            )  # fmt: skip
        return None

    async def stream_events(
        self, ctx: RequestContext, pd: PdStream, on_first_byte: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        """SSE bytes for the client. Failures after the start end with an error frame and
        `[DONE]`; the PD slot is released and the PD stream closed on every exit path
        (including client disconnect, which cancels this generator)."""
        include_usage = ctx.request.include_usage
        skip = ctx.request.skip_special_tokens
        detoks: dict[int, DetokenizerLike] = {}
        completion_tokens = 0
        usage_sent = False
        first_sent = False
        ok = False
        client_left = False
        t = time.monotonic()

        def frame(doc: dict) -> bytes:
            return b"data: " + json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

        def translate(payload: bytes) -> bytes | None:
            nonlocal usage_sent, completion_tokens
            try:
                doc = json.loads(payload)
            except ValueError:
                log.warning("unparsable PD stream frame skipped", extra={"request_id": ctx.request_id})
                return None
            if not isinstance(doc, dict):
                return None
            if doc.get("error") and not doc.get("choices"):
                return b"data: " + payload + b"\n\n"  # PD error frames pass through (§1.2)
            choices = []
            for c in doc.get("choices") or []:
                idx = int(c.get("index", 0))
                det = detoks.get(idx)
                delta: dict[str, Any] = {}
                if det is None:
                    det = detoks[idx] = self.renderer.detokenizer(skip_special_tokens=skip)
                    delta["role"] = "assistant"
                new_ids = c.get("token_ids") or []
                completion_tokens += len(new_ids)
                text = det.push(new_ids)
                finish = c.get("finish_reason")
                if finish is not None:
                    text += det.flush()
                if text:
                    delta["content"] = text
                choices.append({"index": idx, "delta": delta, "finish_reason": finish})
            if choices:
                return frame(chunk_body(
                    completion_id=ctx.completion_id, created=ctx.created, model=ctx.model,
                    choices=choices, include_usage=include_usage,
                ))  # fmt: skip
            if doc.get("usage") and include_usage and not usage_sent:
                usage_sent = True
                return frame(chunk_body(
                    completion_id=ctx.completion_id, created=ctx.created, model=ctx.model,
                    choices=[], include_usage=True, usage=doc["usage"],
                ))  # fmt: skip
            return None

        try:
            async with self._deadline(ctx, "generate"):
                payload: bytes | None = pd.first
                while payload is not None:
                    out = translate(payload)
                    if out is not None:
                        if not first_sent:
                            first_sent = True
                            on_first_byte()
                        yield out
                    try:
                        payload = await anext(pd.payloads)
                    except StopAsyncIteration:
                        payload = None
            if include_usage and not usage_sent:
                usage = {"prompt_tokens": len(ctx.token_ids), "completion_tokens": completion_tokens,
                         "total_tokens": len(ctx.token_ids) + completion_tokens}  # fmt: skip
                yield frame(chunk_body(
                    completion_id=ctx.completion_id, created=ctx.created, model=ctx.model,
                    choices=[], include_usage=True, usage=usage,
                ))  # fmt: skip
            ok = True
            pd.engine.served += 1
        except httpx.HTTPError as exc:
            err = self._engine_error(upstream.classify_exception(exc, pd.engine), pd.engine)
            log.warning("PD stream failed after start", extra={"request_id": ctx.request_id, "error": err.message})
            yield err.sse_frame(ctx.request_id)
        except RouterError as err:
            yield err.sse_frame(ctx.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            client_left = True  # the client disconnected: Starlette cancels or closes the body
            raise
        except Exception:
            log.exception("stream translation failed", extra={"request_id": ctx.request_id})
            yield RouterError(500, "internal error in the router while streaming").sse_frame(ctx.request_id)
        finally:
            await self.close_stream(pd)
            log.info(
                "stream done" if ok else ("client left" if client_left else "stream ended with an error"),
                extra={"request_id": ctx.request_id, "engine": pd.engine.id,
                       "duration_s": round(time.monotonic() - ctx.t0, 4)},
            )  # fmt: skip
            self.metrics.pd.observe(time.monotonic() - t)
            status = "200" if ok else ("client_closed" if client_left else "stream_error")
            self.metrics.requests.labels(status).inc()
            self.metrics.latency.observe(time.monotonic() - ctx.t0)
        yield b"data: [DONE]\n\n"
