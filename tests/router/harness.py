"""Router + simulated engines as real subprocesses on 127.0.0.1 (ephemeral ports).

Every wait here is bounded; every process is killed on teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from epd_kit.sim import launch

BIN = Path(sys.executable).parent
SIM = str(BIN / "epd-sim")
ROUTER = str(BIN / "epd-router")
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


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
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if self.role == "ve" and self.side_port is None:
            self.side_port = free_port()

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> SimEngine:
        env = {**launch.engine_env("0", profile="zero", dead_linger_s="0.2", grace_s="2"), **self.sim_env}
        log = open(self.log_dir / f"{self.engine_id}.log", "ab")  # noqa: SIM115 (closed once the child has it)
        self.proc = subprocess.Popen(
            engine_argv(self.ckpt, self.role, self.engine_id, self.port, self.side_port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                tail = (self.log_dir / f"{self.engine_id}.log").read_text()[-2000:]
                raise AssertionError(f"{self.engine_id} exited ({self.proc.returncode}):\n{tail}")
            return http_ok(self.url + "/health")

        wait_until(up, timeout, f"{self.engine_id} /health")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


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
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 60) -> RouterProc:
        log = open(self.log_path, "ab")  # noqa: SIM115 (closed once the child has it)
        self.proc = subprocess.Popen(
            [ROUTER, "serve", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        log.close()

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"router exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            return http_ok(self.url + ("/ready" if wait_ready else "/health"))

        wait_until(up, timeout, "router")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def write_config(self, cfg: dict[str, Any]) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        tmp.replace(self.config_path)

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def pools(self) -> dict[str, dict[str, Any]]:
        doc = httpx.get(self.url + "/pools", timeout=5, trust_env=False).json()
        return {e["id"]: e for e in doc["engines"]}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


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
        **cfg_overrides: Any,
    ) -> Stack:
        sim_env = sim_env or {}
        ves = [SimEngine("ve", f"epd-ve-{i}", ckpt, workdir, sim_env.get(f"epd-ve-{i}", {})) for i in range(n_ve)]
        pds = [SimEngine("pd", f"epd-pd-{i}", ckpt, workdir, sim_env.get(f"epd-pd-{i}", {})) for i in range(n_pd)]
        port = free_port()
        cfg = router_config(ckpt, ves, pds, port, **cfg_overrides)
        router = RouterProc(workdir / "router.yaml", workdir / "router.log", port)
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

    def stop(self) -> None:
        self.router.stop()
        engines = [e for e in self.ves + self.pds if e.proc and e.proc.poll() is None]
        for engine in engines:  # signal all first, then wait: teardown in parallel
            engine.proc.terminate()
        for engine in engines:
            engine.stop()
