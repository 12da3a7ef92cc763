"""Router + simulated engines as real subprocesses on 127.0.0.1 (ephemeral ports).

Every wait here is bounded (a base budget scaled to the machine, tests/budget.py); every
process is killed on teardown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from epd_kit.sim import launch
from epd_kit.testing.process import ManagedProcess, free_port, http_ok, stop_all
from tests.budget import describe, scaled

__all__ = [
    "ROUTER",
    "SIM",
    "RouterProc",
    "SimEngine",
    "Stack",
    "free_port",
    "http_ok",
    "router_config",
    "wait_until",
    "wait_until_async",
]

BIN = Path(sys.executable).parent
SIM = str(BIN / "epd-sim")
ROUTER = str(BIN / "epd-router")
HOST = "127.0.0.1"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll until predicate() is true; `timeout` is the quiet machine's budget, scaled."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {describe(timeout)} waiting for {what}")


async def wait_until_async(predicate, base_s: float, what: str, interval: float = 0.1) -> None:
    """wait_until for a test whose load runs on the same event loop: `await predicate()` and an
    asyncio sleep between polls, so the loop keeps serving while it waits; `base_s` is the quiet
    machine's budget, scaled."""
    deadline = time.monotonic() + scaled(base_s)
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {describe(base_s)} waiting for {what}")


def engine_argv(
    ckpt: Path, role: str, engine_id: str, port: int, side_port: int | None, max_num_seqs: int = 8
) -> list[str]:
    """The kit's `serve` argv (docs/contract.md §6.3) for one tp=1 local sim engine."""
    argv = launch.serve_argv(
        role,
        str(ckpt),
        port,
        side_channel_port=side_port,
        engine_id=engine_id,
        tp=1,
        dp=1,
        max_num_seqs=max_num_seqs,
        executable=SIM,
    )
    return [*argv, "--disable-uvicorn-access-log"]


@dataclass
class SimEngine:
    role: str
    engine_id: str
    ckpt: Path
    log_dir: Path
    sim_env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    side_port: int | None = None
    process: ManagedProcess | None = None
    extra_args: tuple[str, ...] = ()  # after the kit's argv (a vLLM flag the test adds)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.popen if self.process is not None else None

    def __post_init__(self) -> None:
        if self.role == "ve" and self.side_port is None:
            self.side_port = free_port()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> SimEngine:
        env = {**launch.engine_env("0", profile="zero", dead_linger_s="0.2", grace_s="2"), **self.sim_env}
        self.process = ManagedProcess(
            [*engine_argv(self.ckpt, self.role, self.engine_id, self.port, self.side_port), *self.extra_args],
            self.log_dir / f"{self.engine_id}.log",
            env=env,
            name=self.engine_id,
            append_log=True,  # a restarted engine keeps its earlier log
        )
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        assert self.process is not None, f"{self.engine_id} was never started"
        self.process.wait_http(self.url + "/health", scaled(timeout))

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(10)


def router_config(
    ckpt: Path, ves: list[SimEngine], pds: list[SimEngine], port: int, **overrides: Any
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": str(ckpt),
        "listen": {"host": HOST, "port": port},
        "timeouts": {"connect_s": 1, "ve_s": 20, "pd_s": 20, "total_s": 40, "shutdown_grace_s": 10},
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2, "success_threshold": 1},
        "placement": {"ve_load_bound": 1.25, "pd_max_inflight": 16, "queue_size": 64, "queue_timeout_s": 5},
        "endpoints": {
            "ve": [{"id": e.engine_id, "url": e.url, "state": "active"} for e in ves],
            "pd": [{"id": e.engine_id, "url": e.url, "state": "active"} for e in pds],
        },
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@dataclass
class RouterProc:
    config_path: Path
    log_path: Path
    port: int
    process: ManagedProcess | None = None
    ca: Path | None = None  # listen.tls is on: https, verified with this CA

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{HOST}:{self.port}"

    @property
    def proc(self) -> subprocess.Popen:
        assert self.process is not None, "the router was never started"
        return self.process.popen

    def start(self, wait_ready: bool = True, timeout: float = 60) -> RouterProc:
        self.process = ManagedProcess(
            [ROUTER, "serve", "--config", str(self.config_path)],
            self.log_path,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            name="router",
            append_log=True,
        )
        ca = str(self.ca) if self.ca else None
        self.process.wait_http(self.url + ("/ready" if wait_ready else "/health"), scaled(timeout), ca=ca)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def write_config(self, cfg: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        tmp.replace(self.config_path)

    def reload(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def pools(self) -> dict[str, dict[str, Any]]:
        doc = httpx.get(self.url + "/pools", timeout=5, trust_env=False).json()
        return {e["id"]: e for e in doc["engines"]}

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(20)


@dataclass
class Stack:
    ckpt: Path
    workdir: Path
    ves: list[SimEngine]
    pds: list[SimEngine]
    router: RouterProc
    config: dict[str, Any]

    @classmethod
    def start(
        cls,
        ckpt: Path,
        workdir: Path,
        n_ve: int,
        n_pd: int,
        sim_env: dict[str, dict[str, str]] | None = None,
        ca: Path | None = None,
        engine_args: tuple[str, ...] = (),
        **cfg_overrides: Any,
    ) -> Stack:
        sim_env = sim_env or {}
        ves = [
            SimEngine("ve", f"epd-ve-{i}", ckpt, workdir, sim_env.get(f"epd-ve-{i}", {}), extra_args=engine_args)
            for i in range(n_ve)
        ]
        pds = [
            SimEngine("pd", f"epd-pd-{i}", ckpt, workdir, sim_env.get(f"epd-pd-{i}", {}), extra_args=engine_args)
            for i in range(n_pd)
        ]
        port = free_port()
        cfg = router_config(ckpt, ves, pds, port, **cfg_overrides)
        router = RouterProc(workdir / "router.yaml", workdir / "router.log", port, ca=ca)
        router.write_config(cfg)
        stack = cls(ckpt, workdir, ves, pds, router, cfg)
        try:
            for engine in ves + pds:
                engine.start()
            for engine in ves + pds:
                engine.wait_healthy()
            router.start()
        except BaseException:
            stack.stop()
            raise
        return stack

    def internals(self) -> list[str]:
        """What no client may read in an error: each engine's address and id."""
        engines = self.ves + self.pds
        return [f"{HOST}:{e.port}" for e in engines] + [e.engine_id for e in engines]

    def stop(self) -> None:
        self.router.stop()
        stop_all([e.process for e in self.ves + self.pds if e.process is not None])
