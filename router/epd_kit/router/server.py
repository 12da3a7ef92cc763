"""Running the app under uvicorn with the router's signal semantics.

SIGHUP: reload the config file and the TLS certificate (systemctl reload). SIGTERM/SIGINT: flip /ready to 503, let
in-flight requests finish within `timeouts.shutdown_grace_s`, then stop. A second SIGINT
forces the exit.

Under systemd socket activation (epd-router.socket, docs/router.md "Scale-out") the listening
socket belongs to PID 1 and every router process of the host accepts from it. A draining
process then stops accepting at once (the others, or its successor, take the new ones from the
shared queue; nothing is refused), answers what it has in flight with `Connection: close`,
closes each idle keep-alive connection once no client would still reuse it (listener.py
`drain_linger_s`; a request sent on it before then is answered, with `Connection: close`), and
exits when that is done. A process that bound
its own socket keeps accepting while it drains (a load balancer moves away on /ready).
With NOTIFY_SOCKET set it tells systemd when it serves (Type=notify), so `systemctl restart`
of one process returns when its successor accepts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
from pathlib import Path

import uvicorn

from epd_kit.router.app import create_app
from epd_kit.router.listener import drain_linger_s, protocol_factory
from epd_kit.router.metrics import forget_worker
from epd_kit.router.rendering import Renderer
from epd_kit.router.service import RouterService
from epd_kit.router.signals import EarlySignals
from epd_kit.router.tls import ServerTls, load_error
from epd_kit.router_yaml import RouterConfig

log = logging.getLogger("epd_router.server")


# how often a process copies its live values (engine gauges) into the shared metrics
_PUBLISH_INTERVAL_S = 1.0


class RouterServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        service: RouterService,
        early: EarlySignals | None = None,
        *,
        inherited: list[socket.socket] | None = None,
        worker: str | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        super().__init__(config)
        self.service = service
        self.tls = tls
        self.early = early
        self.inherited = inherited or []
        self.worker = worker
        self._drain_task: asyncio.Task | None = None
        self._stop_signal_in_startup: int | None = None  # SIGTERM/SIGINT before the listeners existed
        self._publisher: asyncio.Task | None = None

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            super().run(sockets or self.inherited or None)
        finally:
            if self.worker is not None:
                forget_worker(self.worker)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # startup failed
            return
        if self._stop_signal_in_startup is not None:  # told to stop while starting: stop now
            self.begin_shutdown(self._stop_signal_in_startup)
            return
        if self.service.metrics.shared_dir is not None:
            self._publisher = asyncio.get_running_loop().create_task(self._publish_metrics())
        _notify_systemd("READY=1")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
        await super().shutdown(sockets)

    async def _publish_metrics(self) -> None:
        while True:
            self.service.metrics.publish()
            await asyncio.sleep(_PUBLISH_INTERVAL_S)

    @contextlib.contextmanager
    def capture_signals(self):
        try:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.begin_shutdown, sig)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        except (RuntimeError, ValueError):  # not the main thread (tests): no signals
            yield
            return
        for sig in self.early.received if self.early else ():
            log.info("replaying a signal received during startup", extra={"signal": signal.Signals(sig).name})
            if sig == signal.SIGHUP:
                self.reload()
            else:
                self.begin_shutdown(sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    def reload(self) -> None:
        """SIGHUP: the config file, and the TLS certificate and key (same paths, new contents)."""
        self.service.reload()
        if self.tls is not None:
            self.tls.reload()

    def begin_shutdown(self, sig: int = signal.SIGTERM) -> None:
        if not self.started:  # no listener to hand over yet: startup() acts on it when it has one
            self._stop_signal_in_startup = sig
            return
        if self._drain_task is not None:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        self.service.begin_drain()  # /ready says 503 from now on
        _notify_systemd("STOPPING=1")
        if self.inherited:
            self._hand_over_listener()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    def _hand_over_listener(self) -> None:
        """Stop accepting from the shared socket (its queue stays with PID 1 and the other
        processes). An idle keep-alive connection closes once it has been idle `drain_linger_s`
        (a client may have just taken it from its pool); a busy one, one that a request reaches
        meanwhile, or a new one whose first request is still on its way, closes after its
        response (`_CloseWhileDraining`)."""
        for server in self.servers:
            server.close()
        cfg = self.service.state.cfg
        linger_s = drain_linger_s(cfg.listen, cfg.timeouts.shutdown_grace_s)
        # the listener's protocol keeps a connection whose first request head is still arriving
        # open until that request is answered (listener.py), so every connection gets shutdown()
        for connection in list(self.server_state.connections):
            connection.shutdown(linger_s)  # type: ignore[call-arg] - listener.GuardedHttpProtocol
        log.info("stopped accepting from the shared listener", extra={"worker": self.worker})

    async def _drain(self) -> None:
        grace = self.service.state.cfg.timeouts.shutdown_grace_s
        log.info("draining", extra={"active_requests": self.service.active_requests, "grace_s": grace})
        if self.inherited:
            done = await self._connections_closed(grace)
        else:
            done = await self.service.wait_idle(grace)
        if not done:
            log.warning(
                "grace period over; exiting with requests in flight",
                extra={"active_requests": self.service.active_requests},
            )
        self.should_exit = True

    async def _connections_closed(self, grace_s: float) -> bool:
        """Every client connection gone (each closes after its response while draining)."""
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.server_state.connections:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


class _CloseWhileDraining:
    """ASGI wrapper: while the process drains, every response says `Connection: close`, so a
    client's next request opens a connection that another process accepts."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message) -> None:
            if message["type"] == "http.response.start" and self.state.draining:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def make_server(
    cfg: RouterConfig,
    *,
    config_path: Path | None = None,
    renderer: Renderer | None = None,
    early: EarlySignals | None = None,
    worker: str | None = None,
) -> RouterServer:
    """`worker`: this process's name among the host's router processes (metrics files)."""
    inherited = inherited_sockets()
    app = create_app(cfg, renderer, config_path=config_path, worker=worker)
    service: RouterService = app.state.service
    listen = cfg.listen
    _allow_descriptors(listen.max_connections + _DESCRIPTORS_BESIDES_CLIENTS)
    uv = uvicorn.Config(
        _CloseWhileDraining(app, service.state) if inherited else app,
        host=listen.host,
        port=listen.port,
        http=protocol_factory(listen, lambda reason: service.metrics.connections_closed.labels(reason).inc()),
        log_config=None,
        access_log=False,
        # the peer is the TCP peer (admin.py): uvicorn's default trusts X-Forwarded-For from
        # 127.0.0.1, which let a loopback client name any address, and its middleware cost
        # about 3 % of a text request's CPU (docs/benchmarks.md "Issue 58 item 6")
        proxy_headers=False,
        ws="none",  # no WebSocket upgrade: an Upgrade header is ignored (listener.py)
        lifespan="on",
        # asyncio calls listen() again on an inherited socket: this is the queue for all processes
        backlog=listen.backlog,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=listen.idle_timeout_s,  # type: ignore[arg-type] - a float works
    )
    tls = _server_tls(cfg)
    if tls is not None:
        # uvicorn builds its own context from file names; the router keeps one it can reload,
        # set where uvicorn's create_server reads it (Config.ssl) once the config is loaded
        uv.load()
        uv.ssl = tls.context
    if inherited:
        log.info(
            "serving on sockets from systemd",
            extra={"addresses": [str(s.getsockname()) for s in inherited], "worker": worker, "tls": tls is not None},
        )
    return RouterServer(uv, service, early, inherited=inherited, worker=worker, tls=tls)


def _server_tls(cfg: RouterConfig) -> ServerTls | None:
    if cfg.listen.tls is None:
        return None
    certificate, key = cfg.listen.tls.certificate, cfg.listen.tls.key
    try:
        return ServerTls(certificate, key)
    except OSError as exc:  # ssl.SSLError is one
        raise ValueError(load_error(exc, certificate, key)) from exc


def inherited_sockets() -> list[socket.socket]:
    """Listening sockets passed by systemd (sd_listen_fds: fds 3.. when LISTEN_PID is ours).
    The variables are removed so that nothing this process starts takes them for its own."""
    mine = os.environ.get("LISTEN_PID") == str(os.getpid())
    count = int(os.environ.get("LISTEN_FDS", "0") or 0) if mine else 0
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    return [socket.socket(fileno=fd) for fd in range(3, 3 + count)]


def _notify_systemd(state: str) -> None:
    """sd_notify: one datagram to NOTIFY_SOCKET (absent outside a Type=notify unit)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), address)


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
