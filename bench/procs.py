"""Processes under test: start pinned, wait until healthy, read CPU and peak RSS, stop by pid.
Starting, waiting and stopping are epd_kit.testing.process's, as for the tests and the sim launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from epd_kit.testing.process import ManagedProcess, free_port

__all__ = ["CLK_TCK", "VENV_BIN", "Proc", "cpu_seconds", "free_port", "pin_self", "taskset_prefix"]

CLK_TCK = os.sysconf("SC_CLK_TCK")
VENV_BIN = Path(sys.executable).parent


def taskset_prefix(cpus: str | None) -> list[str]:
    """`taskset -c CPUS` when asked for and available (the docs say which pinning was used)."""
    if cpus is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (the whole process: every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def pin_self(cpus: str | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


@dataclass
class Proc:
    name: str
    argv: list[str]
    port: int
    health_path: str
    log_path: Path
    process: ManagedProcess | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def start(self, cpus: str | None = None) -> Proc:
        self.process = ManagedProcess(
            taskset_prefix(cpus) + self.argv, self.log_path, env={**os.environ, **self.extra_env}, name=self.name
        )
        return self

    @property
    def popen(self) -> subprocess.Popen | None:
        return self.process.popen if self.process is not None else None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        assert self.process is not None, f"{self.name} was never started"
        self.process.wait_http(self.url + self.health_path, timeout_s, interval=0.1)

    def log_tail(self, n: int = 30) -> str:
        return self.process.log_tail(n) if self.process is not None else "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (uvicorn's graceful stop, lets profilers write), then SIGKILL; own pid only."""
        if self.process is not None:
            self.process.stop(timeout_s, signal.SIGINT)

    # resource accounting from /proc (whole process: every thread)
    def cpu_s(self) -> float:
        return cpu_seconds(self.pid)

    def reset_peak_rss(self) -> bool:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")
