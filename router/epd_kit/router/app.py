"""The FastAPI app: one `RouterService`, its lifespan, the routes and error handlers of
routes.py. Wiring only (no module globals: two apps in one process share nothing)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from epd_kit.router.config import RouterConfig
from epd_kit.router.rendering import Renderer
from epd_kit.router.routes import EXCEPTION_HANDLERS, routes
from epd_kit.router.service import RouterService

log = logging.getLogger("epd_router.app")


def build_renderer(cfg: RouterConfig) -> Renderer:
    """The production renderer: tokenizer, chat template and image processing from the
    checkpoint directory (epd_kit.preprocess), under the config's `limits` and `media`."""
    from epd_kit.preprocess import Preprocessor  # heavy import

    return Preprocessor.from_checkpoint(cfg.model, limits=cfg.limits, media=cfg.media, engine_dtype=cfg.dtype)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    service: RouterService = app.state.service
    await service.start()
    pools = service.state.pools
    log.info(
        "router started",
        extra={"ve": [e.id for e in pools.ve], "pd": [e.id for e in pools.pd], "ready": service.state.ready},
    )
    try:
        yield
    finally:
        await service.stop()


def create_app(
    cfg: RouterConfig,
    renderer: Renderer | None = None,
    *,
    config_path: Path | None = None,
) -> FastAPI:
    app = FastAPI(
        title="epd-router",
        lifespan=_lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.service = RouterService(cfg, renderer or build_renderer(cfg), config_path=config_path)
    app.include_router(routes)
    return app
