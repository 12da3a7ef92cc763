"""Simulated engines as real subprocesses on 127.0.0.1, started with the tutorial's argv.

The conftest fixtures own every process started here and kill it, whatever the outcome.
"""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from epd_kit.sim.launch import SimProcess, free_port, pd_argv, ve_argv
from epd_kit.sim.launch import engine_env as launch_env
from epd_kit.testing.process import stop_all

__all__ = ["free_port", "pd_argv", "ve_argv"]

# Engines run the code of THIS checkout, whatever the shared venv's editable install points at.
ROUTER_SRC = Path(__file__).resolve().parents[2] / "router"
HOST = "127.0.0.1"
IMAGE_TOKEN_ID_KEY = "image_token_id"
VE_CORES, PD_CORES = "8,9,10,11", "0,1,2,3,4,5,6,7"
Engine = SimProcess
# the plugin's cache root (VLLM_CACHE_ROOT) of every engine of this run: not the runner's ~/.cache
CACHE_ROOT = Path(tempfile.mkdtemp(prefix="epd-sim-vllm-cache-"))


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def engine_env(cores: str, *, efa: bool = True, **sim: str) -> dict[str, str]:
    """Tutorial env, the `zero` latency profile, a short SIGTERM grace, and a death linger long
    enough for a test on a loaded machine to still see the 503 before the exit."""
    settings = {"profile": "zero", "dead_linger_s": "3", "grace_s": "3", **sim}
    env = launch_env(cores, efa=efa, **settings)
    env["PYTHONPATH"] = str(ROUTER_SRC)
    env.setdefault("VLLM_CACHE_ROOT", str(CACHE_ROOT))
    return env


class Launcher:
    """Starts engines; the owning fixture stops every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.engines: list[Engine] = []

    def start(self, argv: list[str], env: dict[str, str], name: str = "engine") -> Engine:
        eng = SimProcess(argv, env, self.log_dir / f"{name}-{len(self.engines)}.log")
        self.engines.append(eng)
        return eng

    def stop_all(self) -> None:
        stop_all(list(reversed(self.engines)))


class Pair:
    def __init__(self, ve: Engine, pd: Engine, side_port: int) -> None:
        self.ve, self.pd, self.side_port = ve, pd, side_port


def start_pair(
    launcher: Launcher,
    model: str,
    *,
    ve_kw: dict | None = None,
    pd_kw: dict | None = None,
    ve_env: dict | None = None,
    pd_env: dict | None = None,
) -> Pair:
    side = free_port()
    ve = launcher.start(ve_argv(model, free_port(), side, **(ve_kw or {})), ve_env or engine_env(VE_CORES), "ve")
    pd = launcher.start(pd_argv(model, free_port(), **(pd_kw or {})), pd_env or engine_env(PD_CORES), "pd")
    ve.wait_ready()
    pd.wait_ready()
    return Pair(ve, pd, side)


def start_pd(launcher: Launcher, model: str, env: dict | None = None, **pd_kw: object) -> Engine:
    """A fresh PD (for tests that kill it), next to an existing VE."""
    return launcher.start(pd_argv(model, free_port(), **pd_kw), env or engine_env(PD_CORES), "pd").wait_ready()
