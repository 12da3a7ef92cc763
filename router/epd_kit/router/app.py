"""The ASGI app: one `RouterService`, its lifespan, the routes and error handlers of
routes.py. Wiring only (no module globals: two apps in one process share nothing).

`POST /v1/chat/completions` goes straight to its handler; Starlette serves everything else
(operations endpoints, 404/405 envelopes, the lifespan; FastAPI's additions were never used and
cost ~0.4 CPU-s a start to import: epd_kit/asgi.py). Its routing and middleware stack cost
about a seventh of a text request's CPU (docs/benchmarks.md §1), and the chat handler needs
none of it: it reads the raw body and answers every outcome itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers, State
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from epd_kit.router.rendering import Renderer
from epd_kit.router.routes import CHAT_PATH, EXCEPTION_HANDLERS, chat_completions, routes
from epd_kit.router.service import RouterService
from epd_kit.router_yaml import RouterConfig

log = logging.getLogger("epd_router.app")


def build_renderer(cfg: RouterConfig) -> Renderer:
    """The production renderer: tokenizer, chat template and image processing from the
    checkpoint directory (epd_kit.preprocess), under the config's `limits` and `media`."""
    from epd_kit.preprocess import Preprocessor  # heavy import

    return Preprocessor.from_checkpoint(cfg.model, limits=cfg.limits, media=cfg.media, engine_dtype=cfg.dtype)


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    service: RouterService = app.state.service
    await service.start()
    for lane in service.lanes.values():
        pools = lane.state.pools
        log.info(
            "router started",
            extra={
                "model": lane.name,
                "ve": [e.id for e in pools.ve],
                "pd": [e.id for e in pools.pd],
                "ready": lane.state.ready,
            },
        )
    try:
        yield
    finally:
        await service.stop()


class _Headers(Headers):
    """starlette's Headers whose `get` of a missing header returns the default without raising:
    Mapping.get, which Headers inherits, catches a KeyError per miss, and a chat request looks
    up about six headers it usually lacks (x-request-id, authorization, traceparent): 3.2 -> 1.0
    us per miss (timeit, load ~17). The same values otherwise (the first of repeated names)."""

    def get(self, key: str, default: Any = None) -> Any:
        name = key.lower().encode("latin-1")
        for header, value in self._list:
            if header == name:
                return value.decode("latin-1")
        return default


class _ChatRequest(Request):
    @property
    def headers(self) -> Headers:
        headers = self.__dict__.get("_headers")
        if headers is None:
            headers = self._headers = _Headers(scope=self.scope)
        return headers


class RouterApp:
    """The router's ASGI callable: the chat route on a short path, the rest through `api`."""

    def __init__(self, api: Starlette) -> None:
        self.api = api

    @property
    def state(self) -> State:
        return self.api.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == CHAT_PATH:
            scope["app"] = self.api  # what `request.app` is on Starlette's path too
            request = _ChatRequest(scope, receive, send)
            tracing = self.api.state.service.tracing
            trace = tracing.begin(request.headers)  # None unless traced or given a traceparent
            response: Response | None = None
            try:
                try:
                    response = await chat_completions(request)
                except Exception as exc:  # a router bug outside the handler's own net: still an envelope
                    response = await EXCEPTION_HANDLERS[Exception](request, exc)
                await response(scope, receive, send)
            finally:
                if trace is not None:
                    tracing.finish(trace, response)
            return
        await self.api(scope, receive, send)


def create_app(
    cfg: RouterConfig,
    renderer: Renderer | None = None,
    *,
    config_path: Path | None = None,
    worker: str | None = None,
) -> RouterApp:
    app = Starlette(routes=routes.routes, lifespan=_lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.router.redirect_slashes = routes.redirect_slashes  # False: routes.py says why
    app.state.service = RouterService(
        cfg,
        renderer or build_renderer(cfg.lane_config(cfg.model_name)),
        config_path=config_path,
        worker=worker,
        lane_renderer=None if renderer is not None else build_renderer,
    )
    return RouterApp(app)
