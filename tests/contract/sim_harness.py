"""Simulated engines as real subprocesses on 127.0.0.1, started with the tutorial's argv.

The conftest fixtures own every process started here and kill it, whatever the outcome.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SIM = Path(sys.executable).parent / "epd-sim"
# Engines run the code of THIS checkout, whatever the shared venv's editable install points at.
ROUTER_SRC = Path(__file__).resolve().parents[2] / "router"
HOST = "127.0.0.1"
IMAGE_TOKEN_ID_KEY = "image_token_id"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


def additional_config(role: str, *, vab: int = 1024, blocks: int = 128, **vision: object) -> str:
    neuron = {"quantization": "bf16", "num_batched_tokens_buckets": [8192],
              "on_device_sampling_config": {"all_greedy": True}}
    if role == "ve":
        neuron["num_seqs_buckets"] = [1]
    cfg: dict[str, object] = {
        "neuron_config": neuron,
        "vision_neuron_config": {"num_vision_tokens_buckets": [30720],
                                 "vision_attention_block_size": vab,
                                 "dp_size": 4 if role == "ve" else 1,
                                 "encoder_cache_num_blocks": blocks, **vision},
    }
    if role == "pd":
        cfg["mm_language_model_only"] = True
    return json.dumps(cfg)


def ve_argv(model: str | None, port: int, side_port: int, *, tp: int = 4,
            extra_flags: tuple[str, ...] = ("--no-enable-prefix-caching",),
            max_num_batched_tokens: int = 8192, **ac: object) -> list[str]:
    """Tutorial Step 1 (with our ports)."""
    argv = [str(SIM), "serve"] + ([model] if model is not None else [])
    return argv + [
        "--tensor-parallel-size", str(tp), "--host", HOST, "--port", str(port),
        "--max-model-len", "8192", "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--max-num-seqs", "1", "--dtype", "bfloat16", "--limit-mm-per-prompt", '{"image": 30}',
        *extra_flags, "--mm-encoder-only", "--no-async-scheduling",
        "--additional-config", additional_config("ve", **ac),
        "--ec-transfer-config", json.dumps({
            "ec_connector": "NeuronNixlECConnector", "ec_role": "ec_producer",
            "engine_id": "epd-ve-0",
            "ec_connector_extra_config": {"backends": ["LIBFABRIC"], "side_channel_host": HOST,
                                          "side_channel_port": side_port}}),
    ]


def pd_argv(model: str | None, port: int, *, tp: int = 8, max_num_seqs: int = 8,
            extra_flags: tuple[str, ...] = ("--no-enable-prefix-caching",),
            ec_extra: dict | None = None, **ac: object) -> list[str]:
    """Tutorial Step 2 (with our ports)."""
    argv = [str(SIM), "serve"] + ([model] if model is not None else [])
    return argv + [
        "--tensor-parallel-size", str(tp), "--host", HOST, "--port", str(port),
        "--max-model-len", "8192", "--max-num-batched-tokens", "8192",
        "--max-num-seqs", str(max_num_seqs), "--dtype", "bfloat16",
        "--limit-mm-per-prompt", '{"image": 30}', *extra_flags, "--mm-processor-cache-gb", "0",
        "--additional-config", additional_config("pd", **ac),
        "--ec-transfer-config", json.dumps({
            "ec_connector": "NeuronNixlECConnector", "ec_role": "ec_consumer",
            "engine_id": "epd-pd-0",
            "ec_connector_extra_config": {"backends": ["LIBFABRIC"], **(ec_extra or {})}}),
    ]


def engine_env(cores: str, *, efa: bool = True, **sim: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EPD_SIM_", "FI_EFA_", "NEURON_"))}
    env.update(NEURON_VISIBLE_DEVICES=cores, VLLM_NEURON_COMPILATION_TIMEOUT="6000",
               HF_HUB_OFFLINE="1", EPD_SIM_PROFILE="zero", EPD_SIM_DEAD_LINGER_S="0.5",
               EPD_SIM_GRACE_S="3", PYTHONPATH=str(ROUTER_SRC))
    if efa:
        env.update(FI_EFA_ENABLE_SHM_TRANSFER="0", FI_EFA_USE_DEVICE_RDMA="1")
    env.update({f"EPD_SIM_{k.upper()}": v for k, v in sim.items()})
    return env


VE_CORES, PD_CORES = "8,9,10,11", "0,1,2,3,4,5,6,7"


class Engine:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.env, self.log_path = argv, env, log_path
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://{HOST}:{self.port}"
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 20.0) -> Engine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"engine not ready after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"engine still running after {timeout}s:\n{self.log()}") from exc

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Launcher:
    """Starts engines; the owning fixture stops every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.engines: list[Engine] = []

    def start(self, argv: list[str], env: dict[str, str], name: str = "engine") -> Engine:
        eng = Engine(argv, env, self.log_dir / f"{name}-{len(self.engines)}.log")
        self.engines.append(eng)
        return eng

    def stop_all(self) -> None:
        for eng in reversed(self.engines):
            eng.stop()


class Pair:
    def __init__(self, ve: Engine, pd: Engine, side_port: int) -> None:
        self.ve, self.pd, self.side_port = ve, pd, side_port


def start_pair(launcher: Launcher, model: str, *, ve_kw: dict | None = None,
               pd_kw: dict | None = None, ve_env: dict | None = None,
               pd_env: dict | None = None) -> Pair:
    side = free_port()
    ve = launcher.start(ve_argv(model, free_port(), side, **(ve_kw or {})),
                        ve_env or engine_env(VE_CORES), "ve")
    pd = launcher.start(pd_argv(model, free_port(), **(pd_kw or {})),
                        pd_env or engine_env(PD_CORES), "pd")
    ve.wait_ready()
    pd.wait_ready()
    return Pair(ve, pd, side)




def start_pd(launcher: Launcher, model: str, env: dict | None = None, **pd_kw: object) -> Engine:
    """A fresh PD (for tests that kill it), next to an existing VE."""
    return launcher.start(pd_argv(model, free_port(), **pd_kw), env or engine_env(PD_CORES),
                          "pd").wait_ready()
