"""Processes under test: start pinned, wait until healthy, read CPU and peak RSS, stop by pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLK_TCK = os.sysconf("SC_CLK_TCK")
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taskset_prefix(cpus: str | None) -> list[str]:
    """`taskset -c CPUS` when asked for and available (the docs say which pinning was used)."""
    if cpus is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", cpus]


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
    popen: subprocess.Popen | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    def start(self, cpus: str | None = None) -> Proc:
        env = {**os.environ, **self.extra_env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            taskset_prefix(cpus) + self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen is not None and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health_path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT (uvicorn's graceful stop, lets profilers write), then SIGKILL; own pid only."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    # resource accounting from /proc (whole process: every thread)
    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime

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
