"""The FastAPI app: HTTP surface over one `RouterService` (no module globals)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from epd_kit.router.config import RouterConfig
from epd_kit.router.errors import RouterError
from epd_kit.router.openai_api import parse_request
from epd_kit.router.rendering import Renderer
from epd_kit.router.service import RouterService

log = logging.getLogger("epd_router.app")

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:+=@-]{1,128}$")


def build_renderer(cfg: RouterConfig) -> Renderer:
    """The production renderer: tokenizer, chat template and image processing from the
    checkpoint directory (epd_kit.preprocess)."""
    from epd_kit.preprocess import MediaPolicy, Preprocessor, PreprocessLimits  # heavy import

    return Preprocessor.from_checkpoint(
        cfg.model,
        limits=PreprocessLimits.model_validate(cfg.limits.model_dump()),
        media=MediaPolicy.model_validate(cfg.media.model_dump()),
    )


def create_app(
    cfg: RouterConfig,
    renderer: Renderer | None = None,
    *,
    config_path: Path | None = None,
) -> FastAPI:
    service = RouterService(cfg, renderer or build_renderer(cfg), config_path=config_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        log.info(
            "router started",
            extra={"ve": [e.id for e in service.pools.ve], "pd": [e.id for e in service.pools.pd],
                   "ready": service.ready},
        )  # fmt: skip
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="epd-router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        return exc.response(request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        err = RouterError(exc.status_code, msg.get(exc.status_code, str(exc.detail)))
        return err.response(None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return RouterError(400, f"invalid request: {exc.errors()[0].get('msg', 'bad input')}").response(None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", extra={"path": request.url.path})
        return RouterError(500, "internal error in the router (see its log)").response(None)

    def _auth(request: Request, protected: bool = True) -> None:
        if protected:
            service.auth.check(request.headers.get("authorization"))

    # --- OpenAI surface ---------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t0 = time.monotonic()
        rid = request.headers.get("x-request-id")
        try:
            if rid is not None and not REQUEST_ID_RE.match(rid):
                rid = None
                raise RouterError(400, "x-request-id must be 1-128 characters of [A-Za-z0-9._:+=@-]")
            _auth(request)
            body = await _read_body(request, service.cfg.limits.max_body_bytes)
            try:
                data = json.loads(body)  # (a thread would not help: json.loads holds the GIL)
            except (ValueError, UnicodeDecodeError) as exc:
                raise RouterError(400, f"request body is not valid JSON: {exc}") from None
            chat = parse_request(data)
            ctx = service.new_context(chat, rid)
            rid = ctx.request_id
            if chat.stream:
                return await _stream(request, ctx, t0)
            service.begin_request()
            try:
                result = await _race_disconnect(request, service.complete(ctx))
            finally:
                service.end_request()
        except RouterError as err:
            service.metrics.requests.labels(str(err.status)).inc()
            service.metrics.latency.observe(time.monotonic() - t0)
            level = logging.WARNING if err.status >= 500 or err.status == 429 else logging.INFO
            log.log(level, "request failed", extra={"request_id": rid, "status": err.status, "error": err.message})
            return err.response(rid)
        if result is None:  # client went away; nobody reads this
            service.metrics.requests.labels("client_closed").inc()
            return Response(status_code=499)
        service.metrics.requests.labels("200").inc()
        elapsed = time.monotonic() - t0
        service.metrics.latency.observe(elapsed)
        service.metrics.ttft.observe(elapsed)
        log.info("request done", extra={"request_id": rid, "status": 200, "duration_s": round(elapsed, 4)})
        return JSONResponse(result, headers={"x-request-id": rid})

    async def _stream(request: Request, ctx, t0: float) -> Response:
        service.begin_request()  # ended by the response, whatever happens to it
        try:
            pd = await _race_disconnect(request, service.open_stream(ctx))
        except BaseException:
            service.end_request()
            raise
        if pd is None:
            service.end_request()
            service.metrics.requests.labels("client_closed").inc()
            return Response(status_code=499)

        def first_byte() -> None:
            service.metrics.ttft.observe(time.monotonic() - t0)

        async def cleanup() -> None:
            await service.close_stream(pd)
            service.end_request()

        return _CleanupStreamingResponse(
            service.stream_events(ctx, pd, first_byte),
            cleanup,
            media_type="text/event-stream",
            headers={"x-request-id": ctx.request_id, "Cache-Control": "no-cache"},
        )

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _auth(request)
        return JSONResponse({
            "object": "list",
            "data": [{"id": service.cfg.model_name, "object": "model", "created": 0,
                      "owned_by": "epd-kit", "root": service.cfg.model}],
        })  # fmt: skip

    # --- operations ---------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if service.ready:
            return JSONResponse({"ready": True})
        return JSONResponse(
            {"ready": False, "reason": service.not_ready_reason()},
            status_code=503,
            headers={"Retry-After": str(round(service.retry_after_s()))},
        )

    @app.get("/healthcheck")
    async def healthcheck() -> JSONResponse:
        pools = service.pools
        return JSONResponse({
            "status": "ok" if service.ready else "degraded",
            "ve_instances": len(pools.ve),
            "pd_instances": len(pools.pd),
            "ve_healthy": len(pools.eligible_ve()),
            "pd_healthy": len(pools.eligible_pd()),
        })  # fmt: skip

    @app.get("/pools")
    async def pools_view(request: Request) -> JSONResponse:
        _auth(request, service.cfg.auth.protect_pools)
        pools = service.pools
        return JSONResponse({
            "ready": service.ready,
            "draining": service.draining,
            "active_requests": service.active_requests,
            "engines": [e.snapshot() for e in pools.all()],
        })  # fmt: skip

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        _auth(request, service.cfg.auth.protect_metrics)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` after the response ends on every path, including a client that left
    before the body started (the generator's own `finally` would then never run)."""

    def __init__(self, content, cleanup, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._cleanup()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RouterError(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise RouterError(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _race_disconnect(request: Request, work):
    """Run `work`; if the client disconnects first, cancel it (which aborts the engine
    request: httpx closes the connection) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None
