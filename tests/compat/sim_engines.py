"""The kit's simulated VE and PD (`epd-sim serve`, this checkout's code) as subprocesses on
127.0.0.1, started with the tutorial's argv and environment, as the compat stack's engines are,
and told to answer like the vLLM of this run (`EPD_SIM_VLLM`)."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from epd_kit import wire
from epd_kit.sim.launch import STANDIN_BIN
from epd_kit.sim.release import AnswerShape
from epd_kit.testing.process import LOOPBACK, ManagedProcess, free_port
from tests.compat.stack import READY_TIMEOUT_S, SCALE_OUT_FLAGS, tutorial_argv
from tests.compat.vllm_api import VLLM_SERIES
from tests.golden.tutorial import TUTORIAL_EXPORTS, tutorial_command

# the hand-off the sim (and the vLLM it is compared with) speaks: vllm-neuron's
# kv_transfer_params.ec_locator before vLLM 0.30, upstream's top-level ec_transfer_params from it
HANDOFF = AnswerShape(VLLM_SERIES).handoff


def ve_items(answer: dict[str, Any]) -> dict[str, wire.EcHandoffItem]:
    """The items a VE's answer hands over, where HANDOFF puts them."""
    return wire.handoff_items(HANDOFF, answer.get("kv_transfer_params"), answer.get("ec_transfer_params"))


def with_handoff(pd_body: dict[str, Any], items: dict[str, wire.EcHandoffItem]) -> dict[str, Any]:
    """`pd_body` carrying `items` as the router puts them (wire.handoff_request_fields)."""
    body = copy.deepcopy(pd_body)
    sampling = body["sampling_params"]
    sampling["extra_args"], top = wire.handoff_request_fields(HANDOFF, sampling.get("extra_args"), items)
    return {**body, **top}


@dataclass
class SimEngine:
    url: str
    process: ManagedProcess

    @classmethod
    def start(cls, instance: str, model: Path, workdir: Path) -> SimEngine:
        port = free_port()
        side_channel = free_port() if instance.startswith("ve") else None
        golden_env, _ = tutorial_command(instance, str(model))
        # TP 1 (tutorial_argv): one NeuronCore, as the sim checks the two agree
        golden_env["NEURON_VISIBLE_DEVICES"] = golden_env["NEURON_VISIBLE_DEVICES"].split(",")[0]
        argv = [
            sys.executable,
            "-m",
            "epd_kit.sim.cli",
            *tutorial_argv(instance, model, port, side_channel)[1:],
            *SCALE_OUT_FLAGS,  # a sim answering as vLLM >= 0.30 serves generate only with it, as vLLM does
        ]
        env = {
            **os.environ,
            **TUTORIAL_EXPORTS,
            **golden_env,
            "EPD_SIM_PROFILE": "zero",
            "EPD_SIM_VLLM": VLLM_SERIES,  # answer like the vLLM it is compared with (docs/sim.md)
            "PYTHONPATH": os.pathsep.join(sys.path),
            # a cache miss needs a neuronx-cc on PATH: the sim's stand-in, as in the kit's sim units
            "PATH": os.pathsep.join([str(STANDIN_BIN), os.environ.get("PATH", os.defpath)]),
        }
        url = f"http://{LOOPBACK}:{port}"
        process = ManagedProcess(argv, workdir / f"sim-{instance}.log", env=env, name=f"epd-sim {instance}")
        try:
            process.wait_http(url + "/health", READY_TIMEOUT_S, interval=0.1)
        except BaseException:
            process.stop()
            raise
        return cls(url, process)

    def stop(self) -> None:
        self.process.stop(10)

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
