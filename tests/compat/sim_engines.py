"""The kit's simulated VE and PD (`epd-sim serve`, this checkout's code) as subprocesses on
127.0.0.1, started with the tutorial's argv and environment, as the compat stack's engines are."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.compat.stack import READY_TIMEOUT_S, tutorial_argv
from tests.compat.vllm_server import LOOPBACK, free_port
from tests.golden.tutorial import TUTORIAL_EXPORTS, tutorial_command


@dataclass
class SimEngine:
    url: str
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, instance: str, model: Path, workdir: Path) -> SimEngine:
        port = free_port()
        side_channel = free_port() if instance.startswith("ve") else None
        golden_env, _ = tutorial_command(instance, str(model))
        # TP 1 (tutorial_argv): one NeuronCore, as the sim checks the two agree
        golden_env["NEURON_VISIBLE_DEVICES"] = golden_env["NEURON_VISIBLE_DEVICES"].split(",")[0]
        argv = [sys.executable, "-m", "epd_kit.sim.cli", *tutorial_argv(instance, model, port, side_channel)[1:]]
        env = {
            **os.environ,
            **TUTORIAL_EXPORTS,
            **golden_env,
            "EPD_SIM_PROFILE": "zero",
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        log = workdir / f"sim-{instance}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        engine = cls(f"http://{LOOPBACK}:{port}", process, log)
        engine._wait_healthy()
        return engine

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"epd-sim exited {self.process.returncode}:\n{self.log.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"epd-sim was not healthy within {READY_TIMEOUT_S} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def generate(self, body: dict) -> httpx.Response:
        return httpx.post(self.url + "/inference/v1/generate", json=body, timeout=60, trust_env=False)


@dataclass
class SimPair:
    ve: SimEngine
    pd: SimEngine

    @classmethod
    @contextlib.contextmanager
    def start(cls, model: Path, workdir: Path) -> Iterator[SimPair]:
        started: list[SimEngine] = []
        try:
            started.append(SimEngine.start("ve-0", model, workdir))
            started.append(SimEngine.start("pd-0", model, workdir))
            yield cls(*started)
        finally:
            for engine in reversed(started):
                engine.stop()
