"""What every bench section shares: machine description, percentiles, result files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
IMG_DIR = REPO / "docs" / "img"


@dataclass(frozen=True)
class Machine:
    """The machine a figure came from, as the docs print it."""

    nproc: int
    cpu_model: str
    python: str
    kernel: str
    loadavg_at_start: tuple[float, float, float]
    other_processes_busy: int  # runnable processes that are not ours when the run began

    @classmethod
    def describe(cls) -> Machine:
        model = "unknown"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return cls(
            nproc=os.cpu_count() or 1,
            cpu_model=model,
            python=platform.python_version(),
            kernel=platform.release(),
            loadavg_at_start=os.getloadavg(),
            other_processes_busy=_runnable_processes(),
        )


def _runnable_processes() -> int:
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("procs_running"):
                return max(0, int(line.split()[1]) - 1)  # minus the reader itself
    except OSError:
        pass
    return -1


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for an empty list."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _plain(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None  # NaN is not JSON
    return obj


@dataclass
class RunRecord:
    """One section's result file: what ran, where, when, and the numbers."""

    section: str
    command: str
    started_utc: str
    machine: Machine
    notes: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    loadavg_at_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    revision: str = ""

    @classmethod
    def start(cls, section: str) -> RunRecord:
        return cls(
            section=section,
            command=" ".join([_python_name(), "-m", f"bench.{section}", *sys.argv[1:]]),
            started_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            machine=Machine.describe(),
        )

    def save(self, out_dir: Path | None = None) -> Path:
        self.loadavg_at_end = os.getloadavg()
        self.revision = git_revision()
        out_dir = out_dir or RESULTS_DIR
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.section}.json"
        path.write_text(json.dumps(_plain(self), indent=1) + "\n")
        return path


def emit_summary(summary: dict, out: Path | None) -> dict:
    """Print a run's summary as JSON and, with --out, write it there too."""
    text = json.dumps(summary, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
    return summary


def _python_name() -> str:
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(REPO))  # .venv/bin/python
    except ValueError:
        return exe.name


def git_revision() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
