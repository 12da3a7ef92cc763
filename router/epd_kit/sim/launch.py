"""Start simulated engines the way the tutorial starts real ones (tests, demo, benchmarks).

`ve_argv` / `pd_argv` give the tutorial's Step 1 / Step 2 `serve` argv (contract §6.3) for any
ports; `engine_env` the environment §6.4 forces; `SimProcess` runs one engine as a
subprocess and always cleans up. Only 127.0.0.1-style local use: nothing here picks hosts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

DEFAULT_SIM = Path(sys.executable).parent / "epd-sim"
EFA_ENV = {"FI_EFA_ENABLE_SHM_TRANSFER": "0", "FI_EFA_USE_DEVICE_RDMA": "1"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def additional_config(role: str, *, max_model_len: int = 8192, vab: int = 1024,
                      blocks: int = 128, images: int = 30, dp: int = 4,
                      **vision_extra: object) -> str:
    neuron: dict[str, object] = {"quantization": "bf16",
                                 "num_batched_tokens_buckets": [max_model_len],
                                 "on_device_sampling_config": {"all_greedy": True}}
    if role == "ve":
        neuron["num_seqs_buckets"] = [1]
    cfg: dict[str, object] = {
        "neuron_config": neuron,
        "vision_neuron_config": {"num_vision_tokens_buckets": [images * vab],
                                 "vision_attention_block_size": vab,
                                 "dp_size": dp if role == "ve" else 1,
                                 "encoder_cache_num_blocks": blocks, **vision_extra},
    }
    if role == "pd":
        cfg["mm_language_model_only"] = True
    return json.dumps(cfg)


def _common(executable: Sequence[str], model: str | None, tp: int, host: str, port: int,
            max_model_len: int, mnbt: int, max_num_seqs: int, images: int) -> list[str]:
    argv = [*executable, "serve"] + ([model] if model is not None else [])
    return argv + [
        "--tensor-parallel-size", str(tp), "--host", host, "--port", str(port),
        "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(mnbt),
        "--max-num-seqs", str(max_num_seqs), "--dtype", "bfloat16",
        "--limit-mm-per-prompt", json.dumps({"image": images}),
    ]


def ve_argv(model: str | None, port: int, side_channel_port: int, *, host: str = "127.0.0.1",
            tp: int = 4, engine_id: str = "epd-ve-0", max_model_len: int = 8192,
            max_num_batched_tokens: int | None = None, images: int = 30,
            extra_flags: Sequence[str] = ("--no-enable-prefix-caching",),
            executable: Sequence[str] = (str(DEFAULT_SIM),), **ac: object) -> list[str]:
    """Tutorial Step 1. `ac` goes to `additional_config` (vab, blocks, dp, vision extras)."""
    return _common(executable, model, tp, host, port, max_model_len,
                   max_num_batched_tokens or max_model_len, 1, images) + [
        *extra_flags, "--mm-encoder-only", "--no-async-scheduling",
        "--additional-config", additional_config("ve", max_model_len=max_model_len,
                                                 images=images, **ac),  # type: ignore[arg-type]
        "--ec-transfer-config", json.dumps({
            "ec_connector": "NeuronNixlECConnector", "ec_role": "ec_producer",
            "engine_id": engine_id,
            "ec_connector_extra_config": {"backends": ["LIBFABRIC"], "side_channel_host": host,
                                          "side_channel_port": side_channel_port}}),
    ]


def pd_argv(model: str | None, port: int, *, host: str = "127.0.0.1", tp: int = 8,
            engine_id: str = "epd-pd-0", max_model_len: int = 8192, max_num_seqs: int = 8,
            images: int = 30, extra_flags: Sequence[str] = ("--no-enable-prefix-caching",),
            ec_extra: Mapping[str, object] | None = None,
            executable: Sequence[str] = (str(DEFAULT_SIM),), **ac: object) -> list[str]:
    """Tutorial Step 2. `ec_extra` adds ec_connector_extra_config keys (transfer_timeout_sec)."""
    return _common(executable, model, tp, host, port, max_model_len, max_model_len,
                   max_num_seqs, images) + [
        *extra_flags, "--mm-processor-cache-gb", "0",
        "--additional-config", additional_config("pd", max_model_len=max_model_len,
                                                 images=images, **ac),  # type: ignore[arg-type]
        "--ec-transfer-config", json.dumps({
            "ec_connector": "NeuronNixlECConnector", "ec_role": "ec_consumer",
            "engine_id": engine_id,
            "ec_connector_extra_config": {"backends": ["LIBFABRIC"], **(ec_extra or {})}}),
    ]


def engine_env(cores: str, *, efa: bool = True, base: Mapping[str, str] | None = None,
               **sim: str) -> dict[str, str]:
    """The launcher's engine environment (§6.4) + EPD_SIM_* settings (`profile="zero"`...).
    Inherited EPD_SIM_*, FI_EFA_* and NEURON_* variables are dropped so a test is explicit."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("EPD_SIM_", "FI_EFA_", "NEURON_"))}
    env.update(NEURON_VISIBLE_DEVICES=cores, VLLM_NEURON_COMPILATION_TIMEOUT="6000",
               HF_HUB_OFFLINE="1")
    if efa:
        env.update(EFA_ENV)
    env.update({f"EPD_SIM_{k.upper()}": str(v) for k, v in sim.items()})
    return env


class SimProcess:
    """One engine subprocess; stdout+stderr go to `log_path`. Use `stop()` in a finalizer."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        self.argv, self.log_path = argv, Path(log_path)
        self.host = argv[argv.index("--host") + 1] if "--host" in argv else "0.0.0.0"
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=dict(env), stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> SimProcess:
        """Poll /health until 200 (the units' readiness gate); fail fast if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"engine not ready after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"engine still running after {timeout}s:\n{self.log()}") from exc

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
