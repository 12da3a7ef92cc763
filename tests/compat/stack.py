"""The compat stack: the kit's router (its own CLI, a subprocess) in front of one vLLM VE and
one vLLM PD (vllm_server.py, in a background event loop of this process), all on 127.0.0.1.

The engines get the tutorial's argv (tests/golden) with their own ports and tensor-parallel
size 1 (the tiny checkpoint has 4 heads; TP is hardware layout and never reaches the wire).
Each engine records the bodies that reached it and the `Request`s its engine core built.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from epd_kit.plan.neuron_releases import front_checks_of, serve_flags_of
from epd_kit.router_yaml import config_from_flags
from epd_kit.testing.process import LOOPBACK, ManagedProcess, free_port
from tests.compat.vllm_api import VLLM_SERIES, VLLM_VERSION
from tests.compat.vllm_server import VllmServer, vllm_server
from tests.golden.tutorial import tutorial_command

T = TypeVar("T")
# a bound for a hang, not a speed goal: an in-process vLLM engine took 96-110 s to start (either
# version) with the 2 cores at load 20-28 (other test runs), well under 90 s at load ~10
READY_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 60.0


# From vLLM 0.30 the generate and render routes answer 403 "Scale-out endpoints are disabled.
# Restart vllm serve with --enable-scale-out" unless the server runs with that flag
# (0.32.0 entrypoints/scale_out/factories.py register_scale_out_api_routers); 0.24 and 0.29 have no
# such flag. The simulated engines answer so too (epd_kit/sim/release.py) and take this flag only.
SCALE_OUT_FLAGS = ("--enable-scale-out",) if tuple(int(p) for p in VLLM_SERIES.split(".")) >= (0, 30) else ()
# the vLLM engines run the plan's flags for this vLLM (plan/neuron_releases.py SERVE_FLAGS, one
# place): --enable-scale-out, and from 0.30 --no-mm-device-do-normalize (the router's pixels are
# normalised already)
ENGINE_FLAGS = serve_flags_of(VLLM_VERSION)


def tutorial_argv(instance: str, model: Path, port: int, side_channel_port: int | None = None) -> list[str]:
    """The tutorial's `vllm serve` argv for `instance` ("ve-0" / "pd-0") on loopback:
    `port`, TP 1 and (VE) `side_channel_port` replace the tutorial's values in place."""
    _, argv = tutorial_command(instance, str(model))
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--tensor-parallel-size") + 1] = "1"
    at = argv.index("--ec-transfer-config") + 1
    ec = json.loads(argv[at])
    if side_channel_port is not None:
        ec["ec_connector_extra_config"]["side_channel_port"] = side_channel_port
    argv[at] = json.dumps(ec)
    return argv


class BackgroundLoop:
    """An event loop in a daemon thread: the vLLM servers answer while tests block."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="compat-vllm", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = READY_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


@dataclass
class Exchange:
    """One chat request through the router: what the client got, what each engine saw."""

    status: int
    body: dict[str, Any] | None  # non-stream answer
    frames: list[dict[str, Any]]  # stream answer, [DONE] excluded
    ve_bodies: list[dict[str, Any]]
    pd_bodies: list[dict[str, Any]]
    ve_requests: list[Any]  # vllm.v1.request.Request
    pd_requests: list[Any]


@dataclass
class CompatStack:
    loop: BackgroundLoop
    ve: VllmServer
    pd: VllmServer
    router_url: str
    model: Path

    @classmethod
    @contextlib.contextmanager
    def start(cls, model: Path, workdir: Path) -> Iterator[CompatStack]:
        loop = BackgroundLoop()
        servers = contextlib.AsyncExitStack()
        router: ManagedProcess | None = None
        try:
            ve_argv = [*tutorial_argv("ve-0", model, free_port(), free_port()), *ENGINE_FLAGS]
            ve = loop.run(servers.enter_async_context(vllm_server(ve_argv)))
            pd_argv = [*tutorial_argv("pd-0", model, free_port()), *ENGINE_FLAGS]
            pd = loop.run(servers.enter_async_context(vllm_server(pd_argv)))
            port = free_port()
            # the reference router's flags (ids ve-0 / pd-0), plus the context checks of this
            # run's vLLM front, which router.yaml alone names (as the plan writes it)
            config = config_from_flags(
                model=str(model), ve_endpoints=[ve.host_port], pd_endpoints=[pd.host_port], host=LOOPBACK, port=port
            ).model_dump(mode="json", exclude_none=True)
            config_path = workdir / "router.yaml"
            config_path.write_text(json.dumps({**config, "front_checks": front_checks_of(VLLM_VERSION)}))
            router = ManagedProcess(
                [sys.executable, "-m", "epd_kit.router.cli", "serve", "--config", str(config_path)],
                workdir / "router.log",
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                name="the router",
            )
            stack = cls(loop, ve, pd, f"http://{LOOPBACK}:{port}", model)
            router.wait_http(stack.router_url + "/ready", READY_TIMEOUT_S, interval=0.1)
            yield stack
        finally:
            if router is not None:
                router.stop(10)
            loop.run(servers.aclose())
            loop.close()

    # --- requests ---

    def chat(self, messages: list[dict[str, Any]], *, stream: bool = False, max_tokens: int = 4) -> Exchange:
        """One /v1/chat/completions through the router; engines' records from this call only."""
        self.ve.clear()
        self.pd.clear()
        payload = {
            "model": str(self.model),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        with httpx.Client(base_url=self.router_url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            resp = client.post("/v1/chat/completions", json=payload)
        body, frames = None, []
        if stream:
            frames = [
                json.loads(line[len("data: ") :])
                for line in resp.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        else:
            body = resp.json()
        return Exchange(
            resp.status_code,
            body,
            frames,
            self.ve.generate_bodies(),
            self.pd.generate_bodies(),
            list(self.ve.core.requests),
            list(self.pd.core.requests),
        )

    def render(self, messages: list[dict[str, Any]], *, max_tokens: int = 4) -> dict[str, Any]:
        """vLLM's own rendering of a chat request (`/v1/chat/completions/render` on the PD):
        the `GenerateRequest` the reference disaggregated router sends."""
        payload = {"model": str(self.model), "messages": messages, "max_tokens": max_tokens}
        resp = httpx.post(
            self.pd.url + "/v1/chat/completions/render", json=payload, timeout=REQUEST_TIMEOUT_S, trust_env=False
        )
        resp.raise_for_status()
        return resp.json()

    def generate(self, server: VllmServer, body: dict[str, Any]) -> httpx.Response:
        """POST a body straight to an engine's `/inference/v1/generate`."""
        return httpx.post(server.url + "/inference/v1/generate", json=body, timeout=REQUEST_TIMEOUT_S, trust_env=False)
