"""Running the app under uvicorn with the router's signal semantics.

SIGHUP: reload the config file (systemctl reload). SIGTERM/SIGINT: flip /ready to 503, let
in-flight requests finish within `timeouts.shutdown_grace_s`, then stop. A second SIGINT
forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import uvicorn

from epd_kit.router.app import create_app
from epd_kit.router.config import RouterConfig
from epd_kit.router.rendering import Renderer
from epd_kit.router.service import RouterService
from epd_kit.router.signals import EarlySignals

log = logging.getLogger("epd_router.server")


class RouterServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, service: RouterService, early: EarlySignals | None = None
    ) -> None:
        super().__init__(config)
        self.service = service
        self.early = early
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        try:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.begin_shutdown, sig)
            loop.add_signal_handler(signal.SIGHUP, self.service.reload)
        except (RuntimeError, ValueError):  # not the main thread (tests): no signals
            yield
            return
        for sig in self.early.received if self.early else ():
            log.info("replaying a signal received during startup", extra={"signal": signal.Signals(sig).name})
            if sig == signal.SIGHUP:
                self.service.reload()
            else:
                self.begin_shutdown(sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def begin_shutdown(self, sig: int = signal.SIGTERM) -> None:
        if self._drain_task is not None:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self.service.begin_drain()  # /ready says 503 from now on
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        grace = self.service.state.cfg.timeouts.shutdown_grace_s
        log.info("draining", extra={"active_requests": self.service.active_requests, "grace_s": grace})
        idle = await self.service.wait_idle(grace)
        if not idle:
            log.warning("grace period over; exiting with requests in flight",
                        extra={"active_requests": self.service.active_requests})
        self.should_exit = True


def make_server(
    cfg: RouterConfig,
    *,
    config_path: Path | None = None,
    renderer: Renderer | None = None,
    early: EarlySignals | None = None,
) -> RouterServer:
    app = create_app(cfg, renderer, config_path=config_path)
    uv = uvicorn.Config(
        app,
        host=cfg.listen.host,
        port=cfg.listen.port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )
    return RouterServer(uv, app.state.service, early)
