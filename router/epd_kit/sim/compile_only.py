"""What a sim engine serves after a CPU compile (VLLM_NEURON_CPU_COMPILE=1): /health 200 and
/version, and a 503 for everything else, until it is stopped.

No source says what `vllm serve` does once a CPU compile is done: cpu_compilation.md says only
that it "compiles model graphs ... but does not execute them". The sim takes the side the kit must
handle (docs/sim.md "Compile cache"): it does not exit by itself, it answers /health like a
server that finished its warmup compile, and it refuses generation, since nothing executes.
playbooks/precompile.yml stops it.
"""

from __future__ import annotations

import logging
import signal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..asgi import app, route
from .app import error_response
from .config import VLLM_VERSION, EngineConfig

log = logging.getLogger("epd_sim.compile_only")

REFUSAL_STATUS = 503


def refusal(target: str) -> str:
    return (
        f"this engine runs in CPU compile mode (VLLM_NEURON_CPU_COMPILE=1, target {target}): its graphs "
        "were compiled, nothing executes here, so it serves no generation. Start it without "
        "VLLM_NEURON_CPU_COMPILE on a Neuron host"
    )


def create_app(target: str) -> Starlette:
    message = refusal(target)

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def refuse(request: Request) -> Response:
        path = request.path_params["path"]
        log.warning("%s /%s refused: CPU compile mode executes nothing", request.method, path)
        return error_response(message, REFUSAL_STATUS, "ServiceUnavailableError")

    return app(
        [
            route("/health", health, ["GET"]),
            route("/version", version, ["GET"]),
            route("/{path:path}", refuse, ["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ]
    )


async def serve(cfg: EngineConfig, target: str, grace_s: float, access_log: bool) -> int:
    """Serve until SIGTERM/SIGINT; exit 0 then (a clean stop for systemd), 1 when it cannot listen."""
    import uvicorn

    config = uvicorn.Config(
        create_app(target),
        host=cfg.host,
        port=cfg.port,
        log_config=None,
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=grace_s,
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    # as server._serve: uvicorn re-raises a captured SIGTERM after its shutdown unless a handler is set
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info(
        "CPU compile mode: serving /health on %s:%d; generation is refused (%d): nothing executes",
        cfg.host,
        cfg.port,
        REFUSAL_STATUS,
    )
    await server.serve()
    if not server.started:
        return 1
    log.info("Stopped after the CPU compile (exit 0).")
    return 0
