"""Running the app under uvicorn with the router's signal semantics.

SIGHUP: reload the config file (systemctl reload). SIGTERM/SIGINT: flip /ready to 503, let
in-flight requests finish within `timeouts.shutdown_grace_s`, then stop. A second SIGINT
forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
from pathlib import Path

import uvicorn

from epd_kit.router.app import create_app
from epd_kit.router.config import RouterConfig
from epd_kit.router.listener import protocol_factory
from epd_kit.router.rendering import Renderer
from epd_kit.router.service import RouterService
from epd_kit.router.signals import EarlySignals

log = logging.getLogger("epd_router.server")


class RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: RouterService, early: EarlySignals | None = None) -> None:
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
            log.warning(
                "grace period over; exiting with requests in flight",
                extra={"active_requests": self.service.active_requests},
            )
        self.should_exit = True


def make_server(
    cfg: RouterConfig,
    *,
    config_path: Path | None = None,
    renderer: Renderer | None = None,
    early: EarlySignals | None = None,
) -> RouterServer:
    app = create_app(cfg, renderer, config_path=config_path)
    service: RouterService = app.state.service
    listen = cfg.listen
    _allow_descriptors(listen.max_connections + _DESCRIPTORS_BESIDES_CLIENTS)
    uv = uvicorn.Config(
        app,
        host=listen.host,
        port=listen.port,
        http=protocol_factory(listen, lambda reason: service.metrics.connections_closed.labels(reason).inc()),
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=listen.idle_timeout_s,  # type: ignore[arg-type] - a float works
    )
    return RouterServer(uv, service, early)


# engine connections, media fetches, log and checkpoint files
_DESCRIPTORS_BESIDES_CLIENTS = 1024


def _allow_descriptors(needed: int) -> None:
    """Raise the soft open-files limit so `listen.max_connections` can be reached (systemd's
    default soft limit is 1024); warn when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            log.warning(
                "open-files limit too low for listen.max_connections; raise LimitNOFILE",
                extra={"needed": needed, "hard_limit": hard},
            )
